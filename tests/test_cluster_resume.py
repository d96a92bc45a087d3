"""Failure recovery on a real 2-engine cluster of its own: an engine SIGKILLed in the middle of a
gloo DDP run makes `run_ddp` raise a DDPError naming the rank (no hang), `run_ddp_resumable`
restarts the engines and the run resumes from its newest checkpoint to the same result as an
uninterrupted run; a second run in the same (new) engines works."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal

import pytest

from labkit import cluster as C

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cluster():
    cl = C.start_cluster(2, env={"PYTHONPATH": str(HERE)})
    try:
        yield cl
    finally:
        C.stop_cluster(cl)


def _weighted_sum(run_dir, total_steps, sink=None):
    """Each step s = 1..total_steps all ranks all-reduce (rank + 1) and add s times it to a
    running total; rank 0 checkpoints the total after every step (checkpoints/step-N, atomic);
    a run resumes from the newest checkpoint. Uninterrupted, total = sum_s s * W(W+1)/2."""
    import datetime
    import json
    import os
    import pathlib
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    ckpt = pathlib.Path(run_dir, "checkpoints")
    ckpt.mkdir(parents=True, exist_ok=True)
    steps = sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*"))
    start = steps[-1] if steps else 0
    total = json.loads((ckpt / f"step-{start}").read_text())["total"] if start else 0.0
    for step in range(start + 1, total_steps + 1):
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        total += step * t.item()
        if dist.get_rank() == 0:
            tmp = ckpt / f".step-{step}.tmp"
            tmp.write_text(json.dumps({"total": total}))
            os.replace(tmp, ckpt / f"step-{step}")
        if sink is not None:
            sink({"step": step, "total": total})
        time.sleep(0.2)
    return {"rank": dist.get_rank(), "resumed_from": start, "total": total, "pid": os.getpid()}


def test_killed_engine_raises_then_resumes(cluster, tmp_path, capsys):
    rc = C.get_client(cluster)
    infos = C.engine_info(rc)
    ranks = C.assign_ranks(infos, master_port=1)
    rank1_pid = next(i["pid"] for i in infos if ranks[i["engine_id"]]["RANK"] == "1")
    killed_at = []

    def kill_rank1_after_step_3(records):
        if not killed_at and records[-1]["step"] >= 3:
            killed_at.append(records[-1]["step"])
            os.kill(rank1_pid, signal.SIGKILL)

    n = 12
    res = C.run_ddp_resumable(cluster, _weighted_sum, str(tmp_path / "run"), n, restarts=1,
                              live=kill_rank1_after_step_3, timeout=120)
    err = capsys.readouterr().err
    assert f"rank 1 (engine" in err and f"pid {rank1_pid}): engine died while running _weighted_sum" in err
    assert "restarting the engines and resuming (restart 1 of 1)" in err
    assert killed_at and killed_at[0] >= 3
    # resumed from a checkpoint written at or after the step the live view saw, before the end
    resumed = res[0]["resumed_from"]
    assert killed_at[0] <= resumed < n and res[1]["resumed_from"] == resumed
    assert [r["total"] for r in res] == [3.0 * n * (n + 1) / 2] * 2  # same as uninterrupted
    old_pids = {i["pid"] for i in infos}
    assert not old_pids & {r["pid"] for r in res}  # new engine processes
    # a second run in the same (new) engines: fresh port, fresh group, from scratch
    again = C.run_ddp(rc, _weighted_sum, str(tmp_path / "run2"), 3, timeout=60, stream=False)
    assert [(r["resumed_from"], r["total"]) for r in again] == [(0, 18.0), (0, 18.0)]


def test_failure_without_restarts_left_is_raised(cluster, tmp_path):
    with pytest.raises(C.DDPError, match=r"rank 1 .*failed while running _fail_rank_1(?s:.*)boom") as ei:
        C.run_ddp_resumable(cluster, _fail_rank_1, restarts=0, timeout=60)
    assert ei.value.rank == 1 and not ei.value.died


def _fail_rank_1():
    import os

    if os.environ["RANK"] == "1":
        raise RuntimeError("boom")
    return 0
