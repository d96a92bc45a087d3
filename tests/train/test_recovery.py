"""Recovery: SIGKILL one of 2 gloo ranks at a chosen point of a run; the other rank must stop by
itself (never hang past the collective timeout + 10 s), and the rerun with resume=True must end
exactly where an uninterrupted run ends (losses and weights bitwise equal), or stop with a
one-line error.

Each rank is its own process running this file as a script (``_rank_main``); a fault is planted
in the doomed rank by patching the function it dies in (the kill is ``os.kill(getpid(), SIGKILL)``:
no cleanup, no exception handler runs). Points covered so far: mid-forward, inside the gradient
all-reduce (DDP's comm hook), inside the rank's own checkpoint write (DCP's write), inside the
metrics append (a torn line), inside evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

TIMEOUT_S = 20.0  # the runs' collective timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _plant(fault: str) -> None:
    """Patch the doomed rank so that it dies at ``fault`` (at its n-th visit, so that a complete
    checkpoint exists before)."""
    calls = {"n": 0}

    def nth(n: int) -> bool:
        calls["n"] += 1
        return calls["n"] == n

    if fault == "forward":
        from labkit.model import BertMLM

        real = BertMLM.forward
        BertMLM.forward = lambda self, *a, **k: _die() if nth(9) else real(self, *a, **k)
    elif fault == "allreduce":  # inside DDP's comm hook: the bucket's all-reduce (labkit.train.comm's inner hook)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        real = default_hooks.allreduce_hook
        default_hooks.allreduce_hook = lambda state, bucket: _die() if nth(5) else real(state, bucket)
    elif fault == "checkpoint":
        from torch.distributed.checkpoint import FileSystemWriter

        real = FileSystemWriter.write_data
        FileSystemWriter.write_data = lambda self, *a, **k: _die() if nth(2) else real(self, *a, **k)
    elif fault == "metrics":
        from labkit.train import loop

        real = loop._log

        def log(record, metrics_file, sink):
            if metrics_file is not None and record["step"] == 5:
                with open(metrics_file, "a") as f:
                    f.write(json.dumps(record)[:20])
                    f.flush()
                _die()
            return real(record, metrics_file, sink)

        loop._log = log
    elif fault == "evaluation":
        from labkit.train import evaluation

        real = evaluation.evaluate
        evaluation.evaluate = lambda *a, **k: _die() if nth(2) else real(*a, **k)
    else:
        raise ValueError(f"fault: {fault!r}")


def _rank_main(rank: int, port: int, cfg_json: str, fault: str, doomed: int) -> None:
    import torch

    from labkit.config import TrainConfig, from_dict
    from labkit.train import train

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    if fault != "none" and rank == doomed:
        _plant(fault)
    train(from_dict(TrainConfig, json.loads(cfg_json)))


def _launch(cfg, fault: str = "none", doomed: int = 1) -> tuple[list[int], float, list[str]]:
    """Both ranks as processes; returns their exit codes, the seconds until the last exited, stderr tails."""
    from labkit.config import to_dict

    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), json.dumps(to_dict(cfg)), fault,
                               str(doomed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              cwd=pathlib.Path(__file__).resolve().parents[2]) for r in range(2)]
    t0 = time.monotonic()
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=TIMEOUT_S + 10 + 60)  # + start-up (imports) on a loaded machine
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank hung past the collective timeout after fault {fault!r}")
        errs.append(err[-3000:])
    return [p.returncode for p in procs], time.monotonic() - t0, errs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank run every recovery is compared with."""
    from labkit.config import TrainConfig
    from tiny_shards import write_tiny_shards

    root = tmp_path_factory.mktemp("recovery")
    shards = write_tiny_shards(root / "shards", n_sequences=48, heldout_sequences=8)
    cfg = TrainConfig(data_dir=str(shards), run_dir=str(root / "whole"), model="tiny", micro_batch_size=4,
                      grad_accum_steps=2, max_steps=8, lr=3e-3, warmup_steps=1, num_threads=1, device="cpu",
                      timing_warmup_steps=1, timeout_s=TIMEOUT_S, ckpt_every=2, keep_checkpoints=2, eval_every=4,
                      eval_sequences=8, trackers=(), seed=0)
    codes, _, errs = _launch(cfg)
    assert codes == [0, 0], errs
    return root, cfg


def _records(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("fault,doomed", [("forward", 1), ("allreduce", 1), ("checkpoint", 1), ("checkpoint", 0),
                                          ("metrics", 0), ("evaluation", 1)])
def test_a_killed_rank_ends_in_an_exact_resume(reference, fault, doomed):
    from labkit.train.checkpoint import load_weights

    root, whole = reference
    cfg = dataclasses.replace(whole, run_dir=str(root / f"{fault}-{doomed}"))
    codes, seconds, errs = _launch(cfg, fault, doomed)
    assert codes[doomed] == -signal.SIGKILL, (codes, errs)
    assert codes[1 - doomed] != 0, errs  # the survivor stopped by itself, with an error
    codes, _, errs = _launch(cfg)  # the rerun resumes
    assert codes == [0, 0], errs
    keys = ("step", "loss", "grad_norm", "lr", "tokens", "epoch", "eval_loss")
    want = [tuple(r.get(k) for k in keys) for r in _records(root / "whole")]
    assert [tuple(r.get(k) for k in keys) for r in _records(pathlib.Path(cfg.run_dir))] == want
    ref, got = load_weights(root / "whole" / "checkpoints" / "step-8"), load_weights(pathlib.Path(cfg.run_dir) /
                                                                                    "checkpoints" / "step-8")
    assert all(got[k].equal(v) for k, v in ref.items())


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
