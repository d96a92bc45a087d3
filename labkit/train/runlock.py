"""One job at a time in a run directory: ``run_dir/lock.json`` names the process that holds it.

A run's rank 0 takes the lock before it plans the run or writes anything (``labkit.train.loop.train``)
and gives it back when the run ends, whatever way it ends. A second job started in a live run
directory is refused in one line naming the holder (``RunLocked``), instead of "resuming" the
live run under its id and interleaving its metrics with it.

The lock file (JSON, docs/formats.md): {"host", "pid", "pid_start" (the process's start time in
clock ticks since boot, ``/proc/<pid>/stat`` field 22: tells a reused pid apart), "run_dir",
"acquired" (ISO 8601 UTC), "heartbeat" (Unix time of the holder's last refresh), "lease_s"}.
It is created with ``O_CREAT | O_EXCL`` (one creator wins, on a local file system and on NFSv3+),
and the holder rewrites its ``heartbeat`` every ``lease_s / 6`` seconds from a daemon thread.

A lock is stale, and is taken over, when its holder cannot be running any more:

- on this host (the lock's host is this machine's name): the pid is gone, a zombie, or a
  process that started at another time (a reused pid);
- on another host: its heartbeat is older than ``lease_s`` (``LEASE_S``, 60 s) by this host's
  clock (hosts sharing a run directory must keep their clocks within seconds, NTP). A holder
  that stops without dying (SIGSTOP, a node cut off the network) also loses its lock after the
  lease; should it wake up, its run continues unaware, so a job on another host takes over only
  what its holder could no longer refresh for a full minute.

A takeover happens under a second, short-lived ``O_EXCL`` file (``.lock.json.takeover``): the
job that creates it checks that the lock is still the stale one it judged and removes it, then
creates its own like any job, so two jobs taking over the same stale lock cannot both win.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket
import threading
import time
from typing import Any

from labkit.io import atomic_write_text

__all__ = ["LEASE_S", "RunLock", "RunLocked", "holder_alive", "read_lock", "release_all"]

LEASE_S = 60.0
"""Seconds without a heartbeat after which a lock held on another host is stale."""

LOCK_FILE = "lock.json"
"""The lock's file name inside the run directory."""


_HELD: set[RunLock] = set()
"""The locks this process holds now (``release_all``)."""


class RunLocked(ValueError):
    """A live job holds the run directory (one line naming it)."""


def _pid_start(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None when
    there is no such process or no /proc."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])  # the fields after "(comm) ": state is field 3


def _pid_state(pid: int) -> str | None:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def read_lock(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The lock record of ``run_dir`` (None: no lock, or a file torn by a crash during its write)."""
    try:
        return json.loads((pathlib.Path(run_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None


def holder_alive(lock: dict[str, Any], *, now: float | None = None) -> bool:
    """Whether the process ``lock`` names may still be running (see the module docstring)."""
    if lock.get("host") == socket.gethostname():
        pid = int(lock.get("pid", -1))
        if pid == os.getpid():
            return True
        state = _pid_state(pid)
        if state is None or state in ("Z", "X"):
            return False
        return lock.get("pid_start") in (None, _pid_start(pid))
    age = (now or time.time()) - float(lock.get("heartbeat", 0))
    return age <= float(lock.get("lease_s", LEASE_S))


def _describe(lock: dict[str, Any]) -> str:
    age = time.time() - float(lock.get("heartbeat", 0))
    return (f"pid {lock.get('pid')} on host {lock.get('host')} (since {lock.get('acquired')}, last heartbeat "
            f"{age:.0f} s ago)")


class RunLock:
    """The lock of one run directory, held by this process (``acquire``) until ``release``."""

    def __init__(self, run_dir: str | os.PathLike, *, lease_s: float = LEASE_S) -> None:
        self.path = pathlib.Path(run_dir) / LOCK_FILE
        self.lease_s = lease_s
        self.record: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> RunLock:
        """Take the lock, taking over a stale one; starts the heartbeat. Raises ``RunLocked`` (one
        line naming the holder) when a live process holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
                      "run_dir": str(self.path.parent), "lease_s": self.lease_s,
                      "acquired": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "heartbeat": time.time()}
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                held = read_lock(self.path.parent)
                if held is not None and holder_alive(held):
                    raise RunLocked(f"run_dir: {self.path.parent} is in use by {_describe(held)}; wait for that "
                                    f"job to end, or use another run_dir ({self.path} names the holder)") from None
                if held is not None or time.time() - self._mtime() > 2.0:  # stale, or torn by a crash while written
                    self._take_over(held)
                time.sleep(0.05)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            self.record = record
            self._thread = threading.Thread(target=self._beat, name="labkit-run-lock", daemon=True)
            self._thread.start()
            _HELD.add(self)
            return self
        raise RunLocked(f"run_dir: could not take {self.path} (other jobs keep taking it)")

    def _mtime(self) -> float:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return time.time()

    def _take_over(self, stale: dict[str, Any] | None) -> None:
        """Remove the lock judged ``stale`` (None: torn), under the takeover guard, if it still is."""
        guard = self.path.with_name(f".{LOCK_FILE}.takeover")
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                if time.time() - guard.stat().st_mtime > 10.0:  # a takeover that crashed midway
                    guard.unlink(missing_ok=True)
            except OSError:
                pass
            return
        try:
            if read_lock(self.path.parent) == stale:
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)
            guard.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.lease_s / 6):
            held = read_lock(self.path.parent)
            if held is None or (held.get("host"), held.get("pid")) != (self.record["host"], self.record["pid"]):
                return  # taken over (we were stale): not ours to refresh
            self.record["heartbeat"] = time.time()
            try:
                atomic_write_text(self.path, json.dumps(self.record))
            except OSError:
                pass  # the next beat tries again

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        held = read_lock(self.path.parent)
        if self.record is not None and held is not None and \
                (held.get("host"), held.get("pid")) == (self.record["host"], self.record["pid"]):
            self.path.unlink(missing_ok=True)
        self.record = None
        _HELD.discard(self)


def release_all() -> int:
    """Release every lock this process still holds; returns how many. ``labkit.cluster.run_ddp``
    calls it on each engine after the function: a run whose clean-up was cut short (the SIGINT
    that stops the other ranks can land in it) would otherwise leave its lock held by a process
    that lives on and runs the next call, which it would refuse."""
    held = list(_HELD)
    for lock in held:
        lock.release()
    return len(held)
