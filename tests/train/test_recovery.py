"""Recovery: SIGKILL one of 2 gloo ranks at a chosen point of a run; the other rank must stop by
itself within the collective timeout + 10 s of the kill (measured from the moment the first rank
ended, so process start-up is not counted), and the rerun with resume=True must end exactly
where an uninterrupted run ends (losses and weights bitwise equal), or stop with a one-line error.

Each rank is its own process running this file as a script (``_rank_main``); a fault is planted
in the doomed rank by patching the function it dies in (the kill is ``os.kill(getpid(), SIGKILL)``:
no cleanup, no exception handler runs). Points covered: mid-forward, inside the gradient
all-reduce (DDP's comm hook), inside the rank's own checkpoint write (DCP's write), inside the
metrics append (a torn line), inside evaluation, inside a staging copy (``labkit.data.stage``, the
function ``lab.stage`` runs on each node's engine: a child process dies after a set number of
bytes written by the real copy), and the loss of a whole node: the rank process on one of the
network hosts h1/h2 (``labkit.testing.realcluster.NetHosts``, root only) SIGKILLed from outside
while the other rank trains on the other host. At each rank point a hung rank too (SIGSTOP: it stops
without dying, its sockets stay open), with asynchronous checkpoints on and off: the other rank
ends within the same bound, in one line naming the rank that stopped answering
(``labkit.train.status``). And a second job started in a live run directory is refused in one
line naming the holder (``labkit.train.runlock``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from labkit.testing import realcluster as R

TIMEOUT_S = 20.0  # the runs' collective timeout
STOP_S = TIMEOUT_S + 10  # the bound: a survivor stops within this after the first rank ended
NODE_TIMEOUT_S = 10.0  # the node-loss runs' shorter collective timeout (bound: NODE_TIMEOUT_S + 10)
START_S = 240.0  # the most a run may take before any rank ends (imports and steps on a loaded machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die() -> None:
    """The doomed rank's end: SIGKILL (no cleanup runs), or with RECOVERY_HANG=<file> SIGSTOP: the
    process stops without dying (a hung rank), after writing "<pid> <time.monotonic()>" there."""
    hang = os.environ.get("RECOVERY_HANG")
    if hang:
        pathlib.Path(hang).write_text(f"{os.getpid()} {time.monotonic()}")
        os.kill(os.getpid(), signal.SIGSTOP)
        return
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
    elif fault == "hold":  # a live job: hold in step 5's first forward until RECOVERY_RELEASE exists
        from labkit.model import BertMLM

        real = BertMLM.forward

        def hold(self, *a, **k):
            if self.training and nth(9):
                pathlib.Path(os.environ["RECOVERY_PAUSED"]).write_text(str(os.getpid()))
                while not pathlib.Path(os.environ["RECOVERY_RELEASE"]).exists():
                    time.sleep(0.05)
            return real(self, *a, **k)

        BertMLM.forward = hold
    elif fault == "pause":  # node loss: stop in step 5's first forward, say so, wait to be killed from outside
        from labkit.model import BertMLM

        real = BertMLM.forward

        def pause(self, *a, **k):
            if self.training and nth(9):  # training forwards only: evaluation's come after step 4's
                pathlib.Path(os.environ["RECOVERY_PAUSED"]).write_text(str(os.getpid()))
                time.sleep(3600)
            return real(self, *a, **k)

        BertMLM.forward = pause
    elif fault == "evaluation":
        from labkit.train import evaluation

        real = evaluation.evaluate
        evaluation.evaluate = lambda *a, **k: _die() if nth(2) else real(*a, **k)
    else:
        raise ValueError(f"fault: {fault!r}")


def _rank_main(rank: int, port: int, cfg_json: str, fault: str, doomed: int, master: str = "127.0.0.1") -> None:
    import torch

    from labkit.config import TrainConfig, from_dict
    from labkit.train import train

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank) if master == "127.0.0.1" else "0",
                       "WORLD_SIZE": "2", "MASTER_ADDR": master, "MASTER_PORT": str(port)})
    if master == "127.0.0.1":
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    else:  # on a network host gloo finds its interface from the host name (h1 -> veth-h1)
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    if fault != "none" and rank == doomed:
        _plant(fault)
    try:
        train(from_dict(TrainConfig, json.loads(cfg_json)))
    finally:  # when train() itself ended (returned or raised), before the interpreter's own exit
        if os.environ.get("RECOVERY_ENDED"):
            pathlib.Path(os.environ["RECOVERY_ENDED"], f"rank{rank}").write_text(str(time.monotonic()))


def _start(cfg, fault: str = "none", doomed: int = 1, hosts=None, env: dict | None = None):
    """Both ranks as processes (on hosts h1/h2 when ``hosts``, a ``NetHosts``, with rank 0 on h1
    as the master); stderr goes to files beside the run_dir. Returns (processes, stderr paths)."""
    from labkit.config import to_dict

    port = _free_port()
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for r in range(2):
        log = run_dir.parent / f"{run_dir.name}-{fault}-rank{r}-{time.monotonic_ns()}.err"
        prefix = hosts.wrap(hosts.names[r]) if hosts is not None else []
        with open(log, "w") as err:
            procs.append(subprocess.Popen(
                prefix + [sys.executable, __file__, str(r), str(port), json.dumps(to_dict(cfg)), fault, str(doomed),
                          "h1" if hosts is not None else "127.0.0.1"],
                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **(env or {})},
                cwd=pathlib.Path(__file__).resolve().parents[2]))
        logs.append(log)
    return procs, logs


def _wait(procs, logs, what: str, since: float | None = None,
          stop_s: float = STOP_S) -> tuple[list[int], float, list[str]]:
    """Wait for both ranks; returns their exit codes, the seconds from the first rank's end (or
    from ``since``, a ``time.monotonic()`` such as the moment of a kill from outside) to the
    last rank's end, and the stderr tails. Fails when no rank ends within START_S of the start,
    or the other rank has not ended ``stop_s`` after that (the processes are then killed)."""
    t0 = time.monotonic()
    first = since
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first is None and any(p.poll() is not None for p in procs):
            first = now
        if now > (t0 + START_S if first is None else first + stop_s):
            for q in procs:
                q.kill()
            for q in procs:
                q.wait()
            errs = [log.read_text()[-2000:] for log in logs]
            raise AssertionError(f"{what}: {'no rank ended within START_S' if first is None else 'a rank did not stop'}"
                                 f" ({START_S if first is None else stop_s:.0f} s): {errs}")
        time.sleep(0.02)
    end = time.monotonic()
    return [p.returncode for p in procs], end - (first if first is not None else end), \
        [log.read_text()[-3000:] for log in logs]


def _launch(cfg, fault: str = "none", doomed: int = 1) -> tuple[list[int], float, list[str]]:
    """Both ranks as processes on this host; returns their exit codes, the seconds from the first
    rank's end to the last's (the survivor's stop, after a kill), and the stderr tails."""
    procs, logs = _start(cfg, fault, doomed)
    return _wait(procs, logs, f"fault {fault!r} in rank {doomed}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank run every recovery is compared with."""
    from labkit.config import TrainConfig
    from tiny_shards import write_tiny_shards

    root = tmp_path_factory.mktemp("recovery")
    shards = write_tiny_shards(root / "shards", n_sequences=48, heldout_sequences=8)
    cfg = TrainConfig(data_dir=str(shards), run_dir=str(root / "whole"), model="tiny", max_steps=8, num_threads=1,
                      device="cpu", timeout_s=TIMEOUT_S, seed=0, batch={"micro_batch_size": 4, "grad_accum_steps": 2},
                      optim={"lr": 3e-3}, schedule={"warmup_steps": 1},
                      measure={"timing_warmup_steps": 1, "trackers": ()}, checkpoint={"every": 2, "keep": 2},
                      eval={"every": 4, "sequences": 8})
    codes, _, errs = _launch(cfg)
    assert codes == [0, 0], errs
    return root, cfg


def _records(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


POINTS = [("forward", 1), ("allreduce", 1), ("checkpoint", 1), ("checkpoint", 0), ("metrics", 0), ("evaluation", 1)]
"""The points a rank is killed (or hung) at, and which rank."""


def _last_error(err: str) -> str:
    """The exception line a rank's stderr ends with (torchrun-style "[rankN]: " prefix allowed)."""
    return next((line for line in reversed(err.splitlines())
                 if re.match(r"(\[rank\d\]: )?[\w.]+(Error|Exception): ", line)), "")


@pytest.fixture(scope="module")
def killed(reference):
    """Every point of ``POINTS`` killed side by side (6 pairs of ranks, each in its own run
    directory; the bounds of ``_wait`` hold for each pair), then the 6 reruns side by side:
    {(fault, doomed): (cfg, (codes, stop_s, errs) of the killed run, the lock left behind, the
    temporary checkpoint directories left behind, (codes, errs) of the rerun)}. One pair at a time
    took 14-16 s each, mostly the 2 processes' start (torch's import), 6 x 2 x 2 of them in all."""
    from concurrent.futures import ThreadPoolExecutor

    from labkit.train.runlock import read_lock

    root, whole = reference
    cfgs = {(f, d): dataclasses.replace(whole, run_dir=str(root / f"{f}-{d}")) for f, d in POINTS}
    with ThreadPoolExecutor(len(POINTS)) as pool:
        runs = {p: pool.submit(_launch, cfg, *p) for p, cfg in cfgs.items()}
        runs = {p: r.result() for p, r in runs.items()}  # a pair past its bound fails here, naming its fault
    left = {p: (read_lock(cfg.run_dir) or {}).get("pid") for p, cfg in cfgs.items()}
    tmp = {p: list((pathlib.Path(cfg.run_dir) / "checkpoints").glob(".step-*.tmp")) for p, cfg in cfgs.items()}
    with ThreadPoolExecutor(len(POINTS)) as pool:  # the reruns resume
        reruns = {p: pool.submit(_launch, cfg) for p, cfg in cfgs.items()}
        reruns = {p: r.result()[::2] for p, r in reruns.items()}
    return {p: (cfgs[p], runs[p], left[p], tmp[p], reruns[p]) for p in POINTS}


@pytest.mark.parametrize("fault,doomed", POINTS)
def test_a_killed_rank_ends_in_an_exact_resume(reference, killed, fault, doomed, say):
    root, _ = reference
    cfg, (codes, stop_s, errs), lock_pid, leftovers, (rerun_codes, rerun_errs) = killed[(fault, doomed)]
    assert codes[doomed] == -signal.SIGKILL, (codes, errs)
    assert codes[1 - doomed] != 0, errs  # the survivor stopped by itself, with an error
    assert stop_s < STOP_S  # (_wait enforces it too)
    # one line naming the dead rank (on this host its pid is gone: named at once, not after the timeout)
    assert re.search(rf"rank {doomed} \(pid \d+ on host .+\) stopped answering: its process is gone",
                     _last_error(errs[1 - doomed])), errs[1 - doomed][-3000:]
    if doomed == 0:  # its lock stays behind, naming a dead pid: stale, the rerun takes it over
        assert lock_pid not in (None, os.getpid())
    assert bool(leftovers) == (fault == "checkpoint"), leftovers  # the killed save's temporary directory
    say(f"\n[recovery] fault {fault} in rank {doomed}: the survivor stopped {stop_s:.2f} s after the kill "
        f"(collective timeout {TIMEOUT_S:.0f} s, 6 pairs side by side, load {os.getloadavg()[0]:.1f})")
    assert rerun_codes == [0, 0], rerun_errs  # the rerun resumed
    _assert_exact(root, pathlib.Path(cfg.run_dir))
    assert not list((pathlib.Path(cfg.run_dir) / "checkpoints").glob(".step-*"))  # removed at its first save
    assert not (pathlib.Path(cfg.run_dir) / "lock.json").exists()


@pytest.mark.exclusive  # the collective timeout + 10 s bound
@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_hung_rank_ends_every_other_rank_in_one_line(reference, asynchronous, tmp_path, say):
    """SIGSTOP instead of SIGKILL at every point of ``POINTS``: the rank stops without dying, its
    sockets stay open, and nothing but the timeouts can end the other rank. Its run must end within
    the collective timeout + 10 s of the stop (every process group the run makes has the run's
    timeout: the asynchronous checkpoint's own group too), in one line naming the rank that stopped
    answering (its heartbeat in run_dir/ranks/ went silent), and its process must exit. The points
    run side by side, each pair in its own run directory; the bound is checked at the moment
    train() raised (the interpreter's own exit after it took up to 11 s with 12 processes on 2
    loaded cores)."""
    root, whole = reference
    runs = []
    try:
        for fault, doomed in POINTS:
            cfg = whole.replace(run_dir=str(root / f"hang-{fault}-{doomed}-{int(asynchronous)}"),
                                checkpoint={"asynchronous": asynchronous})
            stopped, ended = tmp_path / f"{fault}-{doomed}.stopped", tmp_path / f"{fault}-{doomed}.ended"
            ended.mkdir()
            env = {"RECOVERY_HANG": str(stopped), "RECOVERY_ENDED": str(ended)}
            procs, logs = _start(cfg, fault, doomed, env=env)
            runs.append((fault, doomed, procs, logs, stopped, ended / f"rank{1 - doomed}"))
        t0 = time.monotonic()
        while any(procs[1 - doomed].poll() is None for _, doomed, procs, *_ in runs):
            assert time.monotonic() < t0 + START_S + STOP_S, \
                [(f, [log.read_text()[-2000:] for log in logs]) for f, d, procs, logs, *_ in runs
                 if procs[1 - d].poll() is None]
            time.sleep(0.05)
        results = []
        for fault, doomed, procs, logs, stopped, ended in runs:
            err = logs[1 - doomed].read_text()
            assert stopped.exists(), (fault, err[-3000:])  # the doomed rank reached its point and stopped
            pid, at = stopped.read_text().split()
            assert procs[doomed].poll() is None and procs[1 - doomed].returncode != 0, err[-3000:]  # stopped, not dead
            line = _last_error(err)
            assert re.search(rf"rank {doomed} \(pid {pid} on host .+\) stopped answering: no heartbeat for "
                             rf"[\d.]+ s, last at step \d+ in \w+", line), (fault, err[-3000:])
            results.append((fault, doomed, float(ended.read_text()) - float(at)))
    finally:
        for *_, procs, _, _, _ in runs:
            for p in procs:
                if p.poll() is None:
                    p.kill()  # SIGKILL ends a stopped process too
                    p.wait()
    say(f"\n[recovery] hung rank, asynchronous checkpoints {asynchronous}: the other rank's run ended "
        f"{'; '.join(f'{f} in rank {d}: {s:.1f} s' for f, d, s in results)} after the stop (collective "
        f"timeout {TIMEOUT_S:.0f} s, load {os.getloadavg()[0]:.1f})")
    assert all(0 < s < STOP_S for *_, s in results), results


def test_a_second_job_in_a_live_run_dir_is_refused(reference, tmp_path):
    """The issue's case: a second, identical job started in the run directory of a live one. Both
    of its ranks stop in one line naming the holder (run_dir/lock.json: its host and pid), nothing
    of the live run is touched, and the live run ends as the uninterrupted run (steps in order)."""
    root, whole = reference
    cfg = whole.replace(run_dir=str(root / "second-job"), timeout_s=180.0)  # job A waits while job B runs
    paused, release = tmp_path / "paused", tmp_path / "release"
    env = {"RECOVERY_PAUSED": str(paused), "RECOVERY_RELEASE": str(release)}
    first, first_logs = _start(cfg, "hold", 0, env=env)
    try:
        deadline = time.monotonic() + START_S
        while not paused.exists():
            assert all(p.poll() is None for p in first) and time.monotonic() < deadline, \
                [log.read_text()[-2000:] for log in first_logs]
            time.sleep(0.05)
        holder = int(paused.read_text())
        before = (pathlib.Path(cfg.run_dir) / "metrics.jsonl").read_text()
        codes, _, errs = _launch(cfg)  # the same job again, while the first holds step 5
        assert codes[0] != 0 and codes[1] != 0, errs
        for err in errs:
            assert re.search(rf"ValueError: run_dir: {re.escape(cfg.run_dir)} is in use by pid {holder} on host "
                             rf"\S+ \(since ", _last_error(err)), err[-3000:]
        assert (pathlib.Path(cfg.run_dir) / "metrics.jsonl").read_text() == before
        release.write_text("go")
        codes, _, errs = _wait(first, first_logs, "the first job")
    finally:
        release.write_text("go")
        for p in first:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], errs
    _assert_exact(root, pathlib.Path(cfg.run_dir))
    assert not (pathlib.Path(cfg.run_dir) / "lock.json").exists()  # given back at the end


def _assert_exact(root: pathlib.Path, run_dir: pathlib.Path) -> None:
    """``run_dir`` ended as the uninterrupted run ``root/whole``: the same records and bitwise the same weights."""
    from labkit.train.checkpoint import load_weights

    keys = ("step", "loss", "grad_norm", "lr", "tokens", "epoch", "eval_loss")
    want = [tuple(r.get(k) for k in keys) for r in _records(root / "whole")]
    assert [tuple(r.get(k) for k in keys) for r in _records(run_dir)] == want
    ref, got = load_weights(root / "whole" / "checkpoints" / "step-8"), load_weights(run_dir / "checkpoints" / "step-8")
    assert ref.keys() == got.keys() and all(got[k].equal(v) for k, v in ref.items())


def _stage_main(src: str, local_root: str, kill_after: int) -> None:
    """Stage ``src`` as ``lab.stage``'s engine does (``stage_shards``), through the real copy
    (``labkit.io.copy_and_hash``) in 512-byte blocks, and SIGKILL this process once ``kill_after``
    bytes of shard data are written: the block that crosses it is written only up to it, so the
    kill always falls inside a file's copy."""
    from labkit.data import stage

    import threading

    real_copy, real_write, written, lock = stage.copy_and_hash, os.write, [0], threading.Lock()

    def write(fd, data):
        with lock:  # the copy threads write one at a time, so the count is exact
            n = min(len(data), kill_after - written[0])
            if n > 0:
                n = real_write(fd, bytes(data[:n]))
                written[0] += n
            if written[0] >= kill_after:
                os.fsync(fd)
                _die()
            return n

    stage.copy_and_hash = lambda src, dst, **kw: real_copy(src, dst, **{**kw, "chunk": 512})
    os.write = write
    stage.stage_shards(src, local_root=local_root, verify=True)


@pytest.mark.parametrize("torn_copy_in_place", [False, True])
def test_a_killed_staging_copy_is_redone_and_trains_exactly(reference, torn_copy_in_place, say):
    """SIGKILL inside a staging copy: no copy is published (a torn copy already in place, one
    shard cut to half, is left as it was: it is replaced only by a verified one); the next staging
    removes the dead process's partial copy and ends with a verified complete copy (byte-equal to
    the source), and a 2-rank run reading it is the uninterrupted run, bitwise."""
    import shutil

    from labkit.data.shards import load_index
    from labkit.data.stage import stage_shards

    root, whole = reference
    src, local = pathlib.Path(whole.data_dir), root / f"local-{torn_copy_in_place}"
    index, sha = load_index(src)
    files = [s["file"] for s in index["shards"] + (index.get("heldout") or {}).get("shards", [])]
    total = sum((src / f).stat().st_size for f in files)
    dst = local / f"{src.resolve().name}-{sha[:12]}"
    if torn_copy_in_place:  # a copy torn under a reader after publication, say
        shutil.copytree(src, dst)
        torn = dst / files[0]
        torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    kill_after = total // 2 + 100  # not a multiple of the 512-byte blocks: the kill falls inside a file
    child = subprocess.run([sys.executable, __file__, "stage", str(src), str(local), str(kill_after)],
                           capture_output=True, text=True, timeout=START_S)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    if torn_copy_in_place:  # untouched: the new copy never verified
        assert (dst / files[0]).stat().st_size == (src / files[0]).stat().st_size // 2
    else:
        assert not dst.exists()  # nothing published
    (tmp,) = local.glob(f".tmp-{dst.name}-*")  # the dead process's partial copy
    partial = {f: (tmp / f).stat().st_size for f in files if (tmp / f).exists()}
    assert sum(partial.values()) == kill_after and not (tmp / "index.json").exists()
    assert any(partial[f] != (src / f).stat().st_size for f in partial)  # killed inside a file's copy

    report = stage_shards(str(src), local_root=str(local))  # the rerun, as on the next lab.stage
    assert report["copied"] is True and report["path"] == str(dst)
    assert not list(local.glob(".tmp-*")) and not list(local.glob(".old-*"))
    for f in files + ["index.json"]:
        assert (dst / f).read_bytes() == (src / f).read_bytes(), f
    assert stage_shards(str(src), local_root=str(local))["copied"] is False  # verified and kept
    say(f"\n[recovery] staging killed after {kill_after} of {total} bytes "
        f"({', '.join(f'{f}: {n}' for f, n in sorted(partial.items()))}); restaged {report['bytes']} bytes "
        f"in {report['seconds']:.3f} s")
    if torn_copy_in_place:
        return  # the copy is byte-equal to the one trained on below

    cfg = dataclasses.replace(whole, data_dir=str(dst), run_dir=str(root / "staged"))
    codes, _, errs = _launch(cfg)
    assert codes == [0, 0], errs
    _assert_exact(root, pathlib.Path(cfg.run_dir))


@pytest.mark.skipif(R.unavailable_hosts() is not None, reason=f"network hosts: {R.unavailable_hosts()}")
@pytest.mark.exclusive  # the collective timeout + 10 s bound
@pytest.mark.parametrize("lost", ["h2", "h1"])
def test_node_loss_across_hosts_ends_in_an_exact_resume(reference, tmp_path, lost, say):
    """Node loss: 2 gloo ranks, rank 0 on network host h1 (the master), rank 1 on h2. The rank on
    ``lost`` stops in step 5's first forward (after the step-4 checkpoint) and everything running
    on that host is SIGKILLed from outside; the rank on the other host must stop with an error
    within the collective timeout (NODE_TIMEOUT_S, shorter than the others') + 10 s of the kill. Rerunning both ranks on their hosts resumes
    from step 4 and ends bitwise equal to the uninterrupted run (on one host: gloo's 2-rank
    all-reduce sums in the same order over loopback and over the veth link)."""
    root, whole = reference
    cfg = dataclasses.replace(whole, run_dir=str(root / f"node-loss-{lost}"), timeout_s=NODE_TIMEOUT_S)
    doomed = R.NetHosts.names.index(lost)
    paused = tmp_path / "paused"
    with R.NetHosts(tmp_path / "net") as hosts:
        procs, logs = _start(cfg, "pause", doomed, hosts=hosts, env={"RECOVERY_PAUSED": str(paused)})
        try:
            R.wait_for(lambda: paused.exists() or any(p.poll() is not None for p in procs), START_S,
                       f"rank {doomed} reaching step 5 on {lost}")
            assert paused.exists(), [log.read_text()[-2000:] for log in logs]
            victims = hosts.pids(lost)
            assert int(paused.read_text()) in victims
            for pid in victims:  # the node is gone: every process on it, at once
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            codes, stop_s, errs = _wait(procs, logs, f"node loss of {lost}", since=killed,
                                        stop_s=NODE_TIMEOUT_S + 10)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        assert codes[doomed] == -signal.SIGKILL, (codes, errs)
        assert codes[1 - doomed] != 0, errs  # the survivor stopped by itself, with an error
        assert stop_s < NODE_TIMEOUT_S + 10
        survivor_error = _last_error(errs[1 - doomed])
        assert re.search(rf"rank {doomed} \(pid \d+ on host {lost}\) stopped answering", survivor_error), \
            errs[1 - doomed][-3000:]
        say(f"\n[recovery] node {lost} lost (SIGKILL of {len(victims)} processes) in step 5: the rank on the "
            f"other host stopped {stop_s:.2f} s later (collective timeout {NODE_TIMEOUT_S:.0f} s, load "
            f"{os.getloadavg()[0]:.1f}): ...{survivor_error[-220:]}")
        steps = sorted(p.name for p in (pathlib.Path(cfg.run_dir) / "checkpoints").glob("step-*"))
        assert "step-4" in steps and "step-6" not in steps, steps  # the rerun has step 4 to resume from
        procs, logs = _start(cfg, hosts=hosts)  # both hosts again: resume
        codes, _, errs = _wait(procs, logs, "the resumed run across hosts")
    assert codes == [0, 0], errs
    _assert_exact(root, pathlib.Path(cfg.run_dir))


if __name__ == "__main__":
    if sys.argv[1] == "stage":
        _stage_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), *sys.argv[6:])
