"""Tests of labkit/train/checkpoint.py through train(): run identity (a new run in a used run_dir
never restores the old run, whose files are kept), a torn metrics line on resume, and rank 0's
choice of the resume step confirmed by every rank (2 gloo ranks)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp

from labkit.config import TrainConfig, from_dict, to_dict
from labkit.train import checkpoint_steps, train
from labkit.train.checkpoint import PREVIOUS_DIR, checkpoint_run_id
from tiny_shards import write_tiny_shards


@pytest.fixture
def shards(tmp_path: pathlib.Path) -> pathlib.Path:
    return write_tiny_shards(tmp_path / "shards")


def tiny_cfg(shards: pathlib.Path, run_dir: pathlib.Path, **kw) -> TrainConfig:
    """The tests' tiny run with ``kw`` (``TrainConfig.replace``: a section's dict changes only its keys)."""
    base = TrainConfig(data_dir=str(shards), run_dir=str(run_dir), model="tiny", max_steps=10, num_threads=1,
                       device="cpu", seed=0, batch={"micro_batch_size": 4, "grad_accum_steps": 2},
                       optim={"lr": 3e-3}, schedule={"warmup_steps": 2},
                       measure={"timing_warmup_steps": 1, "trackers": ()})
    return base.replace(**kw)


def read_metrics(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run_id(run_dir: pathlib.Path) -> str:
    return json.loads((run_dir / "config.json").read_text())["run_id"]


# -- run identity -----------------------------------------------------------------------------


def test_a_new_run_in_a_used_run_dir_never_restores_the_old_run(shards, tmp_path):
    """Issue 28's scenario: run A (8 steps, checkpoints every 4), then run B in the same run_dir
    with resume=False (6 steps, every 2, keep 2), then resume=True: it continues B (steps 6),
    never A's step 8; A's checkpoints, metrics, config and result are kept under previous/."""
    run = tmp_path / "run"
    a = train(tiny_cfg(shards, run, max_steps=8, checkpoint={"every": 4}))
    id_a = a["run_id"]
    assert checkpoint_steps(run) == [4, 8] and _run_id(run) == id_a
    assert checkpoint_run_id(run / "checkpoints" / "step-8") == id_a
    b_cfg = tiny_cfg(shards, run, max_steps=6, resume=False, seed=1, checkpoint={"every": 2, "keep": 2})
    b = train(b_cfg)
    id_b = b["run_id"]
    assert id_b != id_a and _run_id(run) == id_b
    assert checkpoint_steps(run) == [4, 6]  # B's own, A's are not in checkpoints/ any more
    assert {checkpoint_run_id(run / "checkpoints" / f"step-{s}") for s in (4, 6)} == {id_b}
    (old,) = (run / PREVIOUS_DIR).iterdir()
    assert old.name.endswith(f"-{id_a}")
    assert checkpoint_steps(old) == [4, 8] and checkpoint_run_id(old / "checkpoints" / "step-8") == id_a
    assert [r["step"] for r in read_metrics(old / "metrics.jsonl")] == list(range(1, 9))
    assert json.loads((old / "config.json").read_text())["run_id"] == id_a
    assert json.loads((old / "result.json").read_text())["steps"] == 8
    result_b = (run / "result.json").read_bytes()
    again = train(dataclasses.replace(b_cfg, resume=True))  # B is finished: B's result, nothing of A restored
    assert again["run_id"] == id_b and again["steps"] == 6 and (run / "result.json").read_bytes() == result_b
    more = train(dataclasses.replace(b_cfg, resume=True, max_steps=8, allow_safe_changes=True))
    assert more["run_id"] == id_b and more["steps"] == 8 and more["resumed_from_step"] == 6
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, 9))
    assert checkpoint_steps(old) == [4, 8]  # still there


def test_a_crashed_new_run_restarted_with_resume_continues_itself(shards, tmp_path):
    """Run B (resume=False) in run A's run_dir crashes at step 3;
    the restart with resume=True (what ``run_ddp_resumable`` reruns, ``launch._resuming``)
    continues B from its step-2 and ends with exactly the losses of an uninterrupted B."""
    from labkit.cluster.launch import _resuming

    run = tmp_path / "run"
    train(tiny_cfg(shards, run, max_steps=8, checkpoint={"every": 4}))
    b_cfg = tiny_cfg(shards, run, max_steps=6, resume=False, seed=1, checkpoint={"every": 2, "keep": 2})

    def crash(record):
        if record["step"] == 3:
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        train(b_cfg, sink=crash)
    id_b = _run_id(run)
    assert checkpoint_steps(run) == [2]  # B's: A's step-4 and step-8 went to previous/
    restarted = _resuming(b_cfg)
    assert restarted.resume and _resuming(3) == 3
    result = train(restarted)
    assert result["run_id"] == id_b and result["resumed_from_step"] == 2 and result["steps"] == 6
    whole = train(dataclasses.replace(b_cfg, run_dir=str(tmp_path / "whole")))
    want = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl")] == want
    assert result["final_loss"] == whole["final_loss"]
    assert len(list((run / PREVIOUS_DIR).iterdir())) == 1  # the restart set nothing aside


def test_resume_refuses_a_checkpoint_of_another_run(shards, tmp_path):
    """A checkpoint of run A that ends up among run B's (copied in by hand, or left by an older
    labkit) is refused in one line naming both run ids; B's config is untouched."""
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    id_a = train(tiny_cfg(shards, run_a, max_steps=4, checkpoint={"every": 4}))["run_id"]
    id_b = train(tiny_cfg(shards, run_b, max_steps=2))["run_id"]
    shutil.copytree(run_a / "checkpoints" / "step-4", run_b / "checkpoints" / "step-4")
    with pytest.raises(ValueError, match=f"^resume: checkpoint .*step-4 belongs to run {id_a}, but .* holds run "
                                         f"{id_b} \\(config.json\\)") as err:
        train(tiny_cfg(shards, run_b, max_steps=4, allow_safe_changes=True))
    assert "\n" not in str(err.value)
    assert _run_id(run_b) == id_b and checkpoint_steps(run_b) == [2, 4]


def test_refusal_to_resume_under_another_config_names_the_new_run_path(shards, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(shards, run, max_steps=2))
    with pytest.raises(ValueError, match=r"resume=False to start a new run there \(the old run's files move to "):
        train(tiny_cfg(shards, run, max_steps=2, optim={"lr": 0.01}))


# -- torn metrics line --------------------------------------------------------------------------


def test_a_torn_last_metrics_line_is_dropped_on_resume_with_a_warning(shards, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_cfg(shards, run, max_steps=6, checkpoint={"every": 2})
    train(dataclasses.replace(cfg, stop_after=3))
    metrics = run / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 4, "loss": 3.1')  # the crash cut the append
    with pytest.warns(UserWarning, match=f"^{metrics}: line 4 is torn"):
        result = train(cfg)
    assert result["resumed_from_step"] == 3 and result["steps"] == 6
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, 7))
    train(dataclasses.replace(cfg, run_dir=str(tmp_path / "whole")))
    whole = read_metrics(tmp_path / "whole" / "metrics.jsonl")
    assert [r["loss"] for r in read_metrics(metrics)] == [r["loss"] for r in whole]


def test_an_unreadable_metrics_line_before_the_last_is_refused(shards, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_cfg(shards, run, max_steps=4, checkpoint={"every": 2})
    train(dataclasses.replace(cfg, stop_after=3))
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], '{"step": 2, "lo', *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=f"^{metrics}: line 2 is not a JSON record$"):
        train(cfg)


# -- rank 0 chooses the resume step; every rank confirms it (2 gloo ranks) -----------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfgs_json: str, out_dir: str) -> None:
    """Rank ``rank`` runs its own config of each pair in ``cfgs_json`` (its own run_dir: a
    node-local directory); writes the result's resume step or the error per call."""
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    from labkit.train import dist

    dist.init_distributed("gloo", 60.0, torch.device("cpu"))
    outcomes = []
    try:
        for pair in json.loads(cfgs_json):
            try:
                result = train(from_dict(TrainConfig, pair[rank]))
                outcomes.append({"resumed_from_step": result["resumed_from_step"], "steps": result["steps"]})
            except ValueError as err:
                outcomes.append({"error": str(err)})
    finally:
        dist.teardown()
    pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcomes))


def test_rank_0_chooses_the_resume_step_and_every_rank_confirms_it(shards, tmp_path):
    """Node-local run_dirs: each rank reads its own copy. Rank 1's copy also lists a step-6 that
    rank 0's lacks (a stale listing): both ranks still resume rank 0's step 4. Then rank 1's copy
    lacks the step rank 0 chose: both ranks refuse in the same one line naming rank 1, before
    any rank loads it (no hang, no divergence)."""
    shared = tmp_path / "r0"
    first = tiny_cfg(shards, shared, max_steps=8, stop_after=4, timeout_s=60, checkpoint={"every": 2})
    cfgs = [[to_dict(first), to_dict(first)]]
    mp.spawn(_worker, args=(2, _free_port(), json.dumps(cfgs), str(tmp_path)), nprocs=2, join=True)
    assert checkpoint_steps(shared) == [2, 4]
    stale = tmp_path / "r1-stale"
    shutil.copytree(shared, stale)
    shutil.copytree(shared / "checkpoints" / "step-4", stale / "checkpoints" / "step-6")  # rank 1 alone lists it
    behind = tmp_path / "r1-behind"
    shutil.copytree(shared, behind)
    shutil.rmtree(behind / "checkpoints" / "step-4")
    refused_copy = tmp_path / "r0-again"
    shutil.copytree(shared, refused_copy)
    go_on = dataclasses.replace(first, stop_after=6)
    cfgs = [[to_dict(dataclasses.replace(go_on, run_dir=str(refused_copy))),
             to_dict(dataclasses.replace(go_on, run_dir=str(behind)))],
            [to_dict(go_on), to_dict(dataclasses.replace(go_on, run_dir=str(stale)))]]
    mp.spawn(_worker, args=(2, _free_port(), json.dumps(cfgs), str(tmp_path)), nprocs=2, join=True)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    refusal = out[0][0]["error"]
    assert out[1][0]["error"] == refusal
    assert refusal.startswith("resume: rank(s) [1] cannot read checkpoints/step-4 in their run_dir, the checkpoint "
                              "rank 0 chose") and "\n" not in refusal
    assert out[0][1] == out[1][1] == {"resumed_from_step": 4, "steps": 6}


# -- one format for every mode: a checkpoint moves between world sizes, splits and shardings ------

NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "num_heads": 4}


def _moving_cfg(shards: pathlib.Path, run_dir: pathlib.Path, **kw) -> TrainConfig:
    """6 steps of a global batch of 16 (2 ranks x 2 micro-batches of 4), checkpoints every 3, no
    dropout. The shards (``moved``) hold 52 sequences: no multiple of the global batch, so step 4
    straddles the end of epoch 0 and the resume at step 3 continues mid-epoch (before the global
    sample position, a move from dp 2 to 1 was refused at such sizes: the epochs did not line up)."""
    base = tiny_cfg(shards, run_dir, max_steps=6, timeout_s=60, model_overrides=NO_DROPOUT,
                    batch={"micro_batch_size": 4, "grad_accum_steps": 2}, checkpoint={"every": 3},
                    schedule={"warmup_steps": 1}, optim={"grad_clip": 1.0}, eval={"every": 0})
    return base.replace(**kw)


def _many_worker(rank: int, world: int, port: int, steps_json: str) -> None:
    """One process group; each step is a config to train or ["copy", src, dst] (rank 0 copies)."""
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    from labkit.train import dist

    dist.init_distributed("gloo", 60.0, torch.device("cpu"))
    try:
        for step in json.loads(steps_json):
            if isinstance(step, list):
                if rank == 0:
                    shutil.copytree(step[1], step[2])
                dist.barrier()
            else:
                train(from_dict(TrainConfig, step))
    finally:
        dist.teardown()


@pytest.fixture(scope="module")
def moved(tmp_path_factory) -> pathlib.Path:
    """Run dirs: "dp2" (6 steps at 2 ranks, never moved), "part" (its first 3 steps), continued
    at 2 ranks ("same"), at tp 2 ("tp2"), at 1 rank ("one", in this process; "one-explicit" with
    grad_accum_steps set to the value that keeps the global batch); "fsdp" (never
    moved) and "fsdp-part" continued under DDP ("fsdp-ddp"); "async" (asynchronous saves every 2
    steps) stopped at 3 and resumed."""
    root = tmp_path_factory.mktemp("moved")
    shards = write_tiny_shards(root / "shards", n_sequences=52)
    dp2 = _moving_cfg(shards, root / "dp2", parallel={"sharding": "ddp"})
    part = dataclasses.replace(dp2, run_dir=str(root / "part"), stop_after=3)
    fsdp = _moving_cfg(shards, root / "fsdp", parallel={"sharding": "fsdp"})
    fsdp_part = dataclasses.replace(fsdp, run_dir=str(root / "fsdp-part"), stop_after=3)
    asynchronous = dp2.replace(run_dir=str(root / "async"), checkpoint={"asynchronous": True, "every": 2})
    steps = [dp2, part, ["copy", root / "part", root / "same"], ["copy", root / "part", root / "tp2"],
             ["copy", root / "part", root / "one"], ["copy", root / "part", root / "one-explicit"],
             dataclasses.replace(part, run_dir=str(root / "same"), stop_after=None),
             part.replace(run_dir=str(root / "tp2"), stop_after=None, allow_safe_changes=True,
                          parallel={"tp": 2, "sharding": "replicate"}),
             fsdp, fsdp_part, ["copy", root / "fsdp-part", root / "fsdp-ddp"],
             fsdp_part.replace(run_dir=str(root / "fsdp-ddp"), stop_after=None, allow_safe_changes=True,
                               parallel={"sharding": "ddp"}),
             dataclasses.replace(asynchronous, stop_after=3), asynchronous]
    steps = [[s[0], str(s[1]), str(s[2])] if isinstance(s, list) else to_dict(s) for s in steps]
    mp.spawn(_many_worker, args=(2, _free_port(), json.dumps(steps)), nprocs=2, join=True)
    train(dataclasses.replace(part, run_dir=str(root / "one"), stop_after=None))  # 1 rank, no process group
    # 1 rank with grad_accum_steps set by hand to the value that keeps the global batch (4 x 4 x 1 = 16): accepted
    train(part.replace(run_dir=str(root / "one-explicit"), stop_after=None, batch={"grad_accum_steps": 4}))
    return root


def _weights(run_dir: pathlib.Path, step: int = 6) -> dict[str, torch.Tensor]:
    from labkit.train.checkpoint import load_weights

    return load_weights(run_dir / "checkpoints" / f"step-{step}")


def test_each_rank_writes_its_own_part_and_a_marker_last(moved):
    """A 2-rank DDP checkpoint: two DCP data files of about half the bytes each (DCP writes each
    replicated tensor once), state.pt, the marker; no whole-model file."""
    from labkit.train.checkpoint import MARKER

    step = moved / "dp2" / "checkpoints" / "step-6"
    names = {p.name for p in step.iterdir()}
    assert names == {".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt", MARKER}
    sizes = [(step / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert 0.35 < sizes[0] / sum(sizes) < 0.65, sizes
    assert json.loads((step / MARKER).read_text())["step"] == 6


def test_a_resume_on_the_same_split_is_bitwise(moved):
    keys = ("step", "loss", "grad_norm", "lr", "tokens", "epoch")
    want = [tuple(r[k] for k in keys) for r in read_metrics(moved / "dp2" / "metrics.jsonl")]
    for name in ("same", "async"):
        assert [tuple(r[k] for k in keys) for r in read_metrics(moved / name / "metrics.jsonl")] == want, name
        for k, v in _weights(moved / "dp2").items():
            assert torch.equal(_weights(moved / name)[k], v), (name, k)


@pytest.mark.parametrize("name,ref", [("one", "dp2"), ("one-explicit", "dp2"), ("tp2", "dp2"), ("fsdp-ddp", "fsdp")])
def test_a_checkpoint_moved_to_another_world_size_or_split_continues_the_run(moved, name, ref):
    """dp 2 -> 1 rank (4 accumulated micro-batches make up the global batch of 16), dp 2 -> tp 2
    (dp 1), fsdp -> ddp: the same global batch and sample order, so the losses and final weights
    of the never-moved run to 1e-5 (only the order of the reductions differs)."""
    want, got = read_metrics(moved / ref / "metrics.jsonl"), read_metrics(moved / name / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 7))
    assert all(r["global_batch_size"] == 16 for r in got)
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want)) < 1e-5
    assert [r["epoch"] for r in got] == [r["epoch"] for r in want] == [0, 0, 0, 1, 1, 1]
    result = json.loads((moved / name / "result.json").read_text())
    assert result["resumed_from_step"] == 3
    ref_w, w = _weights(moved / ref), _weights(moved / name)
    assert set(w) == set(ref_w)
    assert max(float((w[k] - v).abs().max()) for k, v in ref_w.items()) < 1e-5


def test_async_saves_record_their_stall(moved):
    records = read_metrics(moved / "async" / "metrics.jsonl")
    stalls = [r["checkpoint_stall_s"] for r in records if r.get("checkpoint_stall_s") is not None]
    # the saves at steps 2 and 4, each in the next record (step 3's and 6's are after their invocation's last)
    assert [r["step"] for r in records if r.get("checkpoint_stall_s") is not None] == [3, 5]
    assert all(0 < s < 60 for s in stalls)
    result = json.loads((moved / "async" / "result.json").read_text())  # the resumed invocation: steps 4 and 6
    assert len(result["checkpoint_stall_s"]) == len(result["checkpoint_save_s"]) == 2
    assert checkpoint_steps(moved / "async") == [4, 6]


def test_the_global_batch_that_cannot_be_kept_is_refused(shards, tmp_path):
    """A checkpoint's global batch of 8 (micro-batches of 4 x 2) at dp 3: no whole number of
    accumulation steps; the rule in one line."""
    from labkit.train.loop import _keep_global_batch

    cfg = tiny_cfg(shards, tmp_path, batch={"micro_batch_size": 4, "grad_accum_steps": 1})
    assert _keep_global_batch(cfg, 8, 1).batch.grad_accum_steps == 2 and _keep_global_batch(cfg, 8, 2) is cfg
    assert _keep_global_batch(cfg, None, 5) is cfg
    with pytest.raises(ValueError, match=r"^grad_accum_steps: the checkpoint's global batch 8 is not micro_batch_size "
                                         r"4 x dp 3 x a whole number of accumulation steps"):
        _keep_global_batch(cfg, 8, 3)


def test_a_two_rank_checkpoint_exports_to_transformers(moved, tmp_path):
    """The HF round trip reads the new format: the whole model of a 2-rank DCP checkpoint
    (``load_weights``, one process) loads strictly into BertMLM, and ``export_hf``'s directory
    gives transformers' BertForMaskedLM the same logits (1e-5)."""
    import warnings

    import transformers

    from labkit.model import BertMLM, export_hf, model_config

    model = BertMLM(model_config("tiny", 96, **NO_DROPOUT, sparse_head=False)).eval()
    model.load_state_dict(_weights(moved / "dp2"), strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.BertForMaskedLM.from_pretrained(export_hf(model, tmp_path / "hf")).eval()
    ids = torch.randint(5, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_load_weights_names_a_directory_that_is_no_checkpoint(tmp_path):
    from labkit.train.checkpoint import load_weights

    with pytest.raises(FileNotFoundError, match=f"^{tmp_path}: not a checkpoint"):
        load_weights(tmp_path)
