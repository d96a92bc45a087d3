"""One job per run directory (labkit/train/runlock.py): the lock names its holder, a live holder
refuses a second job in one line, a holder that cannot be running any more is taken over (a dead,
zombie or reused pid on this host; a silent heartbeat from another host)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from labkit.train.runlock import LOCK_FILE, RunLock, RunLocked, holder_alive, read_lock, release_all


def _write(run_dir, **fields) -> None:
    record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": None, "run_dir": str(run_dir),
              "lease_s": 60.0, "acquired": "2026-01-01T00:00:00+00:00", "heartbeat": time.time()} | fields
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps(record))


def test_a_live_holder_refuses_in_one_line_and_gives_the_lock_back(tmp_path):
    lock = RunLock(tmp_path / "run").acquire()
    held = read_lock(tmp_path / "run")
    assert (held["host"], held["pid"]) == (socket.gethostname(), os.getpid()) and holder_alive(held)
    with pytest.raises(RunLocked) as err:
        RunLock(tmp_path / "run").acquire()
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"run_dir: {tmp_path / 'run'} is in use by pid {os.getpid()} on host {socket.gethostname()} (since ")
    lock.release()
    assert read_lock(tmp_path / "run") is None
    RunLock(tmp_path / "run").acquire().release()  # free again


def test_a_dead_zombie_or_reused_pid_on_this_host_is_stale(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, and is not reaped until wait()
    for _ in range(200):
        with open(f"/proc/{zombie.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    cases = {"dead": {"pid": int(dead.stdout)}, "zombie": {"pid": zombie.pid},
             "reused": {"pid": os.getppid(), "pid_start": 1}}  # a live pid, but it started at another time
    try:
        for name, fields in cases.items():
            run = tmp_path / name
            _write(run, **fields)
            assert not holder_alive(read_lock(run)), name
            lock = RunLock(run).acquire()  # taken over
            assert read_lock(run)["pid"] == os.getpid(), name
            lock.release()
    finally:
        zombie.wait()


def test_another_hosts_lock_lives_by_its_heartbeat(tmp_path):
    run = tmp_path / "run"
    _write(run, host="elsewhere", pid=1, heartbeat=time.time() - 5)
    with pytest.raises(RunLocked, match="in use by pid 1 on host elsewhere .*last heartbeat 5 s ago"):
        RunLock(run).acquire()
    _write(run, host="elsewhere", pid=1, heartbeat=time.time() - 61)  # older than the 60 s lease: stale
    lock = RunLock(run).acquire()
    assert read_lock(run)["host"] == socket.gethostname()
    lock.release()


def test_a_torn_lock_file_is_taken_over_and_the_heartbeat_advances(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text('{"host": "x", "pi')  # a crash while it was written
    old = time.time() - 10
    os.utime(run / LOCK_FILE, (old, old))
    lock = RunLock(run, lease_s=0.6).acquire()  # heartbeat every 0.1 s
    first = read_lock(run)["heartbeat"]
    time.sleep(0.5)
    assert read_lock(run)["heartbeat"] > first
    lock.release()


def test_release_all_gives_back_a_lock_a_cut_short_run_left_held(tmp_path):
    """A persistent engine whose run's clean-up was interrupted still holds the lock (its own pid:
    alive, so its next run would be refused); run_ddp's release_all after the call gives it back."""
    RunLock(tmp_path / "run").acquire()  # never released: the run's finally was cut short
    with pytest.raises(RunLocked):
        RunLock(tmp_path / "run").acquire()
    assert release_all() == 1 and read_lock(tmp_path / "run") is None
    RunLock(tmp_path / "run").acquire().release()
    assert release_all() == 0
