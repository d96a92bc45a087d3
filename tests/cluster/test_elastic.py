"""An elastic run that shrinks and grows back, on a real local cluster of its own: 2 engines train a
tiny BERT with ``run_ddp_resumable(..., elastic=True)``; rank 1's engine is SIGKILLed mid-run and
the run goes on alone from its newest checkpoint (2 micro-batches accumulated per step); an engine
started meanwhile (``Cluster.start_engines_sync``) joins at the next checkpoint and the run ends on
2 ranks. With dropout 0 its losses and weights are within 1e-5 of an uninterrupted 2-rank run; both
changes of world size are in world_size_changes.jsonl. (Losing a node on the network hosts is
tests/cluster/test_cluster_faults.py.)

No step of it depends on timing: while it runs alone, rank 0 holds its steps (a file it waits on)
until the new engine has registered and the run's growth watch has warmed it up; then it trains to
the next checkpoint and holds again, at world size 1 only, until the watch interrupts it to grow."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from labkit import cluster as C

STEPS = 24
CKPT = 4


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    from conftest import TESTS
    from tiny_shards import write_tiny_shards

    d = tmp_path_factory.mktemp("elastic")
    cl = C.start_cluster(2, env={"PYTHONPATH": TESTS})
    try:
        yield cl, write_tiny_shards(d / "shards"), d
    finally:
        C.stop_cluster(cl)


def _cfg(shards, run_dir):
    from labkit.config import TrainConfig

    return TrainConfig(data_dir=str(shards), run_dir=str(run_dir), model="tiny", max_steps=STEPS, num_threads=1,
                       device="cpu", backend="gloo", seed=0, timeout_s=10, batch={"micro_batch_size": 4},
                       optim={"lr": 3e-3}, schedule={"warmup_steps": 2}, measure={"timing_warmup_steps": 1, "trackers": ()},
                       checkpoint={"every": CKPT, "keep": 3},
                       model_overrides={"hidden_dropout": 0.0, "attention_dropout": 0.0})


def train_gated(cfg, gates: str, sink=None):
    """labkit.train.train with rank 0's sink slowed to 50 ms a step; at world size 1 it waits while
    ``gates``/hold exists, and from the step in ``gates``/from on for good (until interrupted)."""
    import os
    import pathlib
    import time

    from labkit.train import train

    hold, start = pathlib.Path(gates, "hold"), pathlib.Path(gates, "from")

    def gated(record):
        while os.environ.get("WORLD_SIZE") == "1" and (
                hold.exists() or (start.exists() and record["step"] >= int(start.read_text()))):
            time.sleep(0.05)
        time.sleep(0.05)
        if sink is not None:
            sink(record)

    return train(cfg, sink=gated)


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_elastic_run_shrinks_and_grows_back(two):
    from labkit.train.checkpoint import checkpoint_steps, load_weights
    from test_elastic import train_gated  # by module name: the engines import it from tests/cluster

    cl, shards, d = two
    rc = C.get_client(cl)
    (gates := d / "gates").mkdir()
    ref = C.run_ddp(rc, train_gated, _cfg(shards, d / "ref"), str(gates), timeout=300, stream=False)[0]
    infos = C.engine_info(rc)
    ranks = C.assign_ranks(infos, master_port=1)
    victim = next(i for i in infos if ranks[i["engine_id"]]["RANK"] == "1")
    old, events = set(rc.ids), []

    def come_back():  # the node comes back: one engine more, warmed up by the run's growth watch
        cl.start_engines_sync(1)
        end = time.monotonic() + 300
        while time.monotonic() < end:
            new = set(rc.ids) - old
            if new and rc.queue_status(targets=sorted(new))[min(new)]["completed"] >= 1:
                break
            time.sleep(0.2)
        since = checkpoint_steps(d / "run")[-1]  # the watch's mark: no checkpoint is written while held
        (gates / "from").write_text(str(since + CKPT + 1))  # hold again once the next checkpoint is written
        (gates / "hold").unlink()

    def kill_then_add(records):
        if not events and records[-1]["step"] >= 6:
            (gates / "hold").touch()
            os.kill(victim["pid"], signal.SIGKILL)
            events.append(records[-1]["step"])
            threading.Thread(target=come_back, daemon=True).start()

    res = C.run_ddp_resumable(rc, train_gated, _cfg(shards, d / "run"), str(gates), elastic=True, restarts=2,
                              live=kill_then_add, timeout=300, stream=False)[0]
    assert events and res["steps"] == STEPS and res["world_size"] == 2 and ref["world_size"] == 2
    records = _records(d / "run")
    worlds = [r["world_size"] for r in records]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and worlds[0] == worlds[-1] == 2 and 1 in worlds
    assert {r["global_batch_size"] for r in records} == {8}  # kept by accumulation at world size 1
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(records, _records(d / "ref"))) < 1e-5
    mine = load_weights(d / "run" / "checkpoints" / f"step-{STEPS}")
    want = load_weights(d / "ref" / "checkpoints" / f"step-{STEPS}")
    assert max(float((mine[k] - want[k]).abs().max()) for k in want) < 1e-5
    shrink, grow = res["world_size_changes"]
    assert (shrink["from_world_size"], shrink["to_world_size"]) == (2, 1)
    assert (grow["from_world_size"], grow["to_world_size"]) == (1, 2)
    assert "engine died" in shrink["reason"] and shrink["engines_left"] == [victim["engine_id"]]
    assert grow["reason"].startswith("engines came back") and grow["engines_joined"] == sorted(set(rc.ids) - old)
    assert grow["resumed_from_step"] == shrink["resumed_from_step"] + CKPT  # the next checkpoint after the join
    assert all(c["lost_s"] is not None and c["lost_s"] > 0 for c in (shrink, grow))
    saved = [json.loads(line) for line in (d / "run" / "world_size_changes.jsonl").read_text().splitlines()]
    assert saved == res["world_size_changes"]
