"""A shard that changes under a running 2-rank DDP run (gloo, CPU): every rank stops with an
error within seconds, far inside the collective timeout, instead of waiting for it.

Each rank trains from its own copy of the shard set (as after staging to node-local disks,
``labkit.data.stage``). Rank 0's metrics sink truncates rank 1's copy of a shard at step 2,
the way ``cp`` of a shorter file onto a live data directory does (same inode, O_TRUNC).
"""

from __future__ import annotations

import faulthandler
import json
import os
import pathlib
import signal
import shutil
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg_json: str, root: str, num_workers: int) -> None:
    """train() on this rank's copy of the shards; write {outcome, t_end}; stay alive until the
    peer has written too (or 40 s), so the peer's error comes from train()'s own exit path, not
    from this process ending."""
    from labkit.config import TrainConfig, from_dict
    from labkit.train import train

    torch.set_num_threads(1)
    stacks = open(pathlib.Path(root, f"stack{rank}.txt"), "w")  # SIGUSR1: where a rank that hangs is
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    out = pathlib.Path(root)
    cfg = from_dict(TrainConfig, json.loads(cfg_json)).replace(data_dir=str(out / f"shards-{rank}"),
                                                               data={"num_workers": num_workers})
    victim = out / "shards-1" / "shard-00001.bin"

    def sink(record: dict) -> None:  # rank 0 only
        if record["step"] == 2:
            data = victim.read_bytes()
            with open(victim, "r+b") as f:  # cp of a shorter file: truncate the inode, then write
                f.truncate(0)
                f.write(data[:len(data) // 2])
            (out / "truncated.txt").write_text(repr(time.time()))

    try:
        train(cfg, sink=sink)
        outcome = "finished"
    except BaseException as err:  # noqa: BLE001 - what each rank saw is the result
        outcome = f"{type(err).__name__}: {err}"
    (out / f"rank{rank}.json").write_text(json.dumps({"outcome": outcome, "t_end": time.time()}))
    deadline = time.time() + 40
    while time.time() < deadline and not (out / f"rank{1 - rank}.json").exists():
        time.sleep(0.2)
    os._exit(0)  # skip any teardown of a group whose peer failed


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_truncated_mid_run_stops_every_rank_in_seconds(tmp_path, num_workers):
    from labkit.config import TrainConfig, to_dict
    from tiny_shards import write_tiny_shards  # tests/ is on sys.path

    write_tiny_shards(tmp_path / "shards-0", n_sequences=64)
    shutil.copytree(tmp_path / "shards-0", tmp_path / "shards-1")
    cfg = TrainConfig(data_dir=str(tmp_path / "shards-0"), run_dir=str(tmp_path / "run"), model="tiny", max_steps=40,
                      num_threads=1, device="cpu", timeout_s=TIMEOUT_S,
                      batch={"micro_batch_size": 4, "grad_accum_steps": 1}, schedule={"warmup_steps": 1},
                      measure={"timing_warmup_steps": 1}, checkpoint={"enabled": False})
    ctx = mp.spawn(_worker, args=(2, _free_port(), json.dumps(to_dict(cfg)), str(tmp_path), num_workers),
                   nprocs=2, join=False)
    done = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    deadline = None
    while not all(p.exists() for p in done):
        if deadline is None and (tmp_path / "truncated.txt").exists():
            deadline = time.time() + TIMEOUT_S / 2
        if deadline is not None and time.time() > deadline or not any(p.is_alive() for p in ctx.processes):
            hung = [r for r in (0, 1) if not done[r].exists()]
            for r in hung:  # where each hung rank is, then end it (our own child, by pid)
                if ctx.processes[r].is_alive():
                    os.kill(ctx.processes[r].pid, signal.SIGUSR1)
            time.sleep(2)
            for proc in ctx.processes:
                proc.kill()
            stacks = {r: (tmp_path / f"stack{r}.txt").read_text()[-3000:] for r in hung}
            pytest.fail(f"ranks {hung} did not stop within {TIMEOUT_S / 2} s of the truncation: {stacks}")
        time.sleep(0.2)
    ctx.join()
    t_trunc = float((tmp_path / "truncated.txt").read_text())
    ranks = [json.loads(p.read_text()) for p in done]
    victim = tmp_path / "shards-1" / "shard-00001.bin"
    assert ranks[1]["outcome"].startswith("ShardError"), ranks[1]
    assert f"{victim}: changed since the shard set was opened: size" in ranks[1]["outcome"]
    assert ranks[0]["outcome"] != "finished", ranks[0]  # its peer left: an error, not a hang
    for r in ranks:
        assert r["t_end"] - t_trunc < TIMEOUT_S / 2, (r, t_trunc)
