"""Held-out evaluation (labkit/train/evaluation.py and its use in labkit/train/loop.py): the same loss for
1 and 2 ranks on the same weights, on repeated calls, with or without dropout configured."""

from __future__ import annotations

import gc
import json
import math
import os
import pathlib

import pytest
import torch
import torch.multiprocessing as mp

from labkit.train.evaluation import HeldoutSet, evaluate
from labkit.model import BertMLM, model_config
from test_dist import _dist_env, _free_port
from test_loop import read_metrics, tiny_cfg
from tiny_shards import write_tiny_shards

VOCAB = 96


def _model(dropout: float = 0.1) -> BertMLM:
    torch.manual_seed(0)
    return BertMLM(model_config("tiny", VOCAB, hidden_dropout=dropout, attention_dropout=dropout))


def _heldout(shards: pathlib.Path, rank: int = 0, world: int = 1, n: int = 13) -> HeldoutSet:
    return HeldoutSet(shards, rank=rank, world_size=world, mlm_probability=0.15,
                      max_sequences=n, batch_size=4, device=torch.device("cpu"))


@pytest.fixture
def shards(tmp_path):
    return write_tiny_shards(tmp_path / "shards", heldout_sequences=16)


def test_repeated_calls_and_dropout_setting_give_the_same_loss(shards):
    model, plain = _model(0.1), _model(0.0)
    plain.load_state_dict(model.state_dict())
    held = _heldout(shards)
    model.train()
    first = evaluate(model, held)
    assert model.training  # mode restored
    assert evaluate(model, held) == first
    assert evaluate(plain, _heldout(shards)) == first  # dropout off in eval: same as a model without it
    assert first["eval_sequences"] == 13 and first["eval_masked"] > 20
    assert first["perplexity"] == pytest.approx(math.exp(first["eval_loss"]))
    assert 0.5 * math.log(VOCAB) < first["eval_loss"] < 2 * math.log(VOCAB)  # untrained: about log V


def _eval_worker(rank: int, world: int, port: int, shards: str, out: str) -> None:
    from labkit.train import dist

    os.environ.update(_dist_env(rank, world, port))
    torch.set_num_threads(1)
    dist.init_distributed("gloo", 60.0, torch.device("cpu"))
    try:
        from labkit.config import TrainConfig

        result = evaluate(_model(), _heldout(pathlib.Path(shards), rank, world))
        # FSDP-sharded weights, 9 sequences: rank 1 holds one batch and repeats it (discarded) so
        # that both ranks run the same number of forwards (each all-gathers the layers)
        from labkit.train import build_runtime

        sharded = build_runtime(TrainConfig(data_dir="-", run_dir="-", parallel={"sharding": "fsdp"}), _model(),
                                torch.device("cpu")).parts  # the training builder: FSDP2 over dp 2
        assert dist.is_fsdp(sharded.chunks[0])
        fsdp = evaluate(sharded, _heldout(pathlib.Path(shards), rank, world, n=9))
        if rank == 0:
            pathlib.Path(out).write_text(json.dumps({**result, "fsdp": fsdp}))
        # both ranks past every collective, and the FSDP module (which holds the group) freed,
        # before either destroys the group: a clean-clone run once saw rank 1 abort at exit
        # ("terminate called without an active exception") while rank 0 had already left
        del sharded
        gc.collect()
        torch.distributed.barrier()
    finally:
        dist.teardown()


def test_two_ranks_give_the_one_rank_loss(shards, tmp_path):
    one = evaluate(_model(), _heldout(shards))
    out = tmp_path / "two.json"
    mp.spawn(_eval_worker, args=(2, _free_port(), str(shards), str(out)), nprocs=2, join=True)
    two = json.loads(out.read_text())
    assert two["eval_masked"] == one["eval_masked"]  # same masks however the set is split
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-6)
    assert _heldout(shards, 1, 2).n_batches == _heldout(shards, 0, 2).n_batches == 2
    one_nine = evaluate(_model(), _heldout(shards, n=9))
    assert two["fsdp"]["eval_masked"] == one_nine["eval_masked"]
    assert two["fsdp"]["eval_loss"] == pytest.approx(one_nine["eval_loss"], abs=1e-6)
    assert len(_heldout(shards, 1, 2, n=9).batches) == 1 < _heldout(shards, 1, 2, n=9).n_batches == 2


def test_training_records_eval_loss(shards, tmp_path):
    from labkit.train import train

    result = train(tiny_cfg(shards, tmp_path / "run", max_steps=4, eval={"every": 2, "sequences": 8},
                            measure={"log_every": 3}))
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [2, 3, 4]  # evaluated steps are always logged
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert result["eval_loss"] == evals[-1]["eval_loss"] and result["perplexity"] == evals[-1]["perplexity"]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] + 0.5


def test_eval_every_needs_a_heldout_split(tmp_path):
    from labkit.data.heldout import HeldoutError
    from labkit.train import train

    bare = write_tiny_shards(tmp_path / "bare")
    with pytest.raises(HeldoutError, match="no held-out split"):
        train(tiny_cfg(bare, tmp_path / "run", max_steps=1, eval={"every": 1}))
    assert train(tiny_cfg(bare, tmp_path / "run2", max_steps=1))["eval_loss"] is None


def test_eval_disabled_evaluates_nothing_not_even_at_the_end(shards, tmp_path):
    """``eval.enabled = false`` (the timed sweep runs, ``labkit.study.sweeps.NO_EVAL``): shards with a
    held-out split, yet no record and no result carries a held-out loss; with ``every`` > 0 refused."""
    from labkit.config import EvalConfig
    from labkit.train import train

    result = train(tiny_cfg(shards, tmp_path / "run", max_steps=2, eval={"enabled": False}))
    assert result["eval_loss"] is None and result["perplexity"] is None
    assert not any("eval_loss" in r for r in read_metrics(tmp_path / "run"))
    assert train(tiny_cfg(shards, tmp_path / "run2", max_steps=2))["eval_loss"] is not None  # the default: at the end
    with pytest.raises(ValueError, match="eval.enabled: false, but eval.every is 3"):
        EvalConfig(enabled=False, every=3)


def test_loss_figure_draws_the_eval_loss_series():
    import polars as pl

    from labkit.plots import loss_figure

    metrics = pl.DataFrame({"step": [1, 2, 3], "loss": [5.0, 4.0, 3.5], "eval_loss": [None, 4.2, None]})
    traces = {t.name: t for t in loss_figure(metrics).data}
    assert list(traces["eval loss (held out)"].y) == [4.2] and list(traces["eval loss (held out)"].x) == [2]
