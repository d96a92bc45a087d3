"""Ctrl-C during every blocking wait on the engines (issue 31): ipyparallel's ``apply_sync`` catches
KeyboardInterrupt and returns the AsyncResult, which made `labkit prepare` exit 0 when interrupted
in its tokenizer and shard-planning steps. Here the real command runs in a child process on a
local engine, a stage's engine function is replaced by one that announces itself and sleeps, and
SIGINT goes to the command (as a terminal's Ctrl-C does): it must exit 130 with the one-line
message of the other stages, and leave no process of its cluster running."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

DRIVER = """
import sys

stage, marker = sys.argv[1], sys.argv[2]


def slow(*args, _marker=marker, **kwargs):  # runs on the engine: say so, then work for minutes
    import os
    import pathlib
    import time

    pathlib.Path(_marker).write_text(str(os.getpid()))
    time.sleep(300)


if stage == "tokenizer":
    import labkit.data.tokenize as module
    module.train_tokenizer = slow
elif stage == "shard plan":
    import labkit.data.shards as module
    module.plan_shards = slow
elif stage == "loaders sweep":
    import labkit.study.sweeps as module
    module.sweep_loader = slow
from labkit.cli import main

sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A text-only corpus (fast: no disassembly) and a config for one local engine; the same work
    directory for every stage, in order, so each run reuses the stages before the one it stops."""
    root = tmp_path_factory.mktemp("ctrl_c")
    text = root / "text"
    text.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    for i in range(40):
        (text / f"doc{i}.txt").write_text("\n\n".join(" ".join(words[(i + j + k) % len(words)] for k in range(30))
                                                   for j in range(5)))
    from tiny_shards import write_tiny_shards

    tiny = root / "tiny"
    tiny.mkdir()
    write_tiny_shards(tiny)
    (root / "lab.toml").write_text(f"""workdir = "{root / 'work'}"
[cluster]
engines = 1
[corpus]
text_paths = ["{text}"]
[tokenizer]
vocab_size = 200
[shards]
seq_len = 32
[train]
model = "tiny"
""")
    return root


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("stage, args", [
    ("tokenizer", ["prepare", "{cfg}"]),
    ("shard plan", ["prepare", "{cfg}"]),
    ("loaders sweep", ["sweep", "loaders", "{cfg}", "--workers", "0", "--set", 'train.data_dir="{tiny}"']),
])
def test_sigint_in_a_blocking_engine_call_exits_130_and_stops_the_engines(workdir, stage, args):
    marker = workdir / f"{stage.replace(' ', '_')}.started"
    command = [a.format(cfg=workdir / "lab.toml", tiny=workdir / "tiny") for a in args]
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, stage, str(marker), *command], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 400
        while not marker.exists():  # the earlier stages run for real first
            assert proc.poll() is None, f"{stage}: exited {proc.returncode} before the stage\n{proc.communicate()[1]}"
            assert time.monotonic() < deadline, f"{stage}: the stage did not start in 400 s"
            time.sleep(0.2)
        time.sleep(0.5)  # the task is running on the engine (it wrote the marker)
        engine = psutil.Process(int(marker.read_text()))
        cluster = _tree(proc.pid)  # the controller, the engine and its nanny
        assert engine in cluster, (stage, engine, cluster)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (stage, proc.returncode, err[-2000:])
    # 5 s on an idle machine (about 2 s of it is the interpreter's own exit: torch, ipyparallel); on a
    # shared, busy one the bound grows with the load per CPU (a swallowed Ctrl-C takes the task's 300 s)
    load = os.getloadavg()[0]
    limit = 5.0 * max(1.0, load / (os.cpu_count() or 1))
    assert took < limit, f"{stage}: exited {took:.1f} s after SIGINT (limit {limit:.1f} s at load {load:.1f})"
    name = "labkit prepare" if command[0] == "prepare" else "labkit sweep"
    assert err.strip().splitlines()[-1] == (f"{name}: interrupted; engines were stopped. Completed stages are kept "
                                            "and are reused by the next run with the same work directory."), err[-2000:]
    _, alive = psutil.wait_procs(cluster, timeout=1.0)  # reaped by now, or a moment after the exit
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"{stage}: still running after the command exited: {[(p, p.cmdline()) for p in alive]}"


def _busy(marker: str) -> str:
    import os
    import pathlib
    import time

    pathlib.Path(marker).write_text(str(os.getpid()))
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        pathlib.Path(marker).write_text("interrupted")
        raise
    return "finished"


def _interrupt_me_when(marker: pathlib.Path) -> None:
    """SIGINT to this process once ``marker`` exists, as a terminal's Ctrl-C (process-directed: the
    kernel hands it to any thread that does not block it)."""
    import threading

    def fire():
        while not marker.exists():
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()


def test_call_raises_ctrl_c_and_stops_the_engines_task(cluster, tmp_path):
    """``engines.call`` under a process-directed SIGINT, as a terminal sends: it raises
    KeyboardInterrupt (its wait wakes every second, whichever thread the signal landed on), the
    engine's task is interrupted (it records so) and the engine is free for the next task at once.
    ipyparallel's own ``apply_sync`` would return the AsyncResult instead and leave the task running
    (ipyparallel/client/view.py, ``_really_apply``: ``except KeyboardInterrupt: pass``)."""
    from labkit import cluster as C
    from labkit.cluster.engines import call

    rc = C.get_client(cluster)
    engine = rc[rc.ids[0]]
    marker = tmp_path / "raised"
    _interrupt_me_when(marker)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        call(engine, _busy, str(marker))
    assert time.monotonic() - started < 100  # not the task's 120 s
    assert marker.read_text() == "interrupted"
    assert engine.apply_async(os.getpid).get(timeout=20) > 0  # free again (busy for 120 s otherwise)
