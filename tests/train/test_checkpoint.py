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
    base = dict(data_dir=str(shards), run_dir=str(run_dir), model="tiny", micro_batch_size=4,
                grad_accum_steps=2, max_steps=10, lr=3e-3, warmup_steps=2, num_threads=1,
                timing_warmup_steps=1, device="cpu", seed=0, trackers=())
    base.update(kw)
    return TrainConfig(**base)


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
    a = train(tiny_cfg(shards, run, max_steps=8, ckpt_every=4))
    id_a = a["run_id"]
    assert checkpoint_steps(run) == [4, 8] and _run_id(run) == id_a
    assert checkpoint_run_id(run / "checkpoints" / "step-8") == id_a
    b_cfg = tiny_cfg(shards, run, max_steps=6, ckpt_every=2, keep_checkpoints=2, resume=False, seed=1)
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
    again = train(dataclasses.replace(b_cfg, resume=True))
    assert again["run_id"] == id_b and again["steps"] == 6 and again["resumed_from_step"] == 6
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, 7))
    assert checkpoint_steps(old) == [4, 8]  # still there


def test_a_crashed_new_run_restarted_with_resume_continues_itself(shards, tmp_path):
    """Run B (resume=False) in run A's run_dir crashes at step 3;
    the restart with resume=True (what ``run_ddp_resumable`` reruns, ``launch._resuming``)
    continues B from its step-2 and ends with exactly the losses of an uninterrupted B."""
    from labkit.cluster.launch import _resuming

    run = tmp_path / "run"
    train(tiny_cfg(shards, run, max_steps=8, ckpt_every=4))
    b_cfg = tiny_cfg(shards, run, max_steps=6, ckpt_every=2, keep_checkpoints=2, resume=False, seed=1)

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
    id_a = train(tiny_cfg(shards, run_a, max_steps=4, ckpt_every=4))["run_id"]
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
        train(tiny_cfg(shards, run, max_steps=2, lr=0.01))


# -- torn metrics line --------------------------------------------------------------------------


def test_a_torn_last_metrics_line_is_dropped_on_resume_with_a_warning(shards, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_cfg(shards, run, max_steps=6, ckpt_every=2)
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
    cfg = tiny_cfg(shards, run, max_steps=4, ckpt_every=2)
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
    first = tiny_cfg(shards, shared, max_steps=8, ckpt_every=2, stop_after=4, timeout_s=60)
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
