"""Each rank's sign of life in the run directory, and which rank stopped answering.

Every rank of a run with a process group keeps ``run_dir/ranks/rank-<r>.json`` (docs/formats.md)
up to date: a daemon thread rewrites it (atomically) every ``interval_s`` seconds with what the
rank is doing, which the training loop sets as it goes (``update``: a dict update, no I/O on the
training thread):

    {"rank", "world_size", "host", "pid", "run_id", "step", "phase" ("start", "train",
     "evaluate", "checkpoint", "done", "failed"), "collective" (the labkit collective this rank
     is in, ``labkit.train.dist``'s wrappers, else null), "started" (ISO 8601 UTC), "time" (Unix time of
     this write), "beat" (writes so far), "interval_s"}

A rank that stops without dying (SIGSTOP, a node cut off the network) stops its thread too, so
its ``time`` falls behind; a rank that dies does the same, and on this host its pid is gone; a
rank that ends with an error of its own writes phase "failed" first. When a collective of this
rank fails (the run's ``timeout_s`` ran out, or a peer's connection broke), ``unanswering``
reads the other ranks' files and names those whose heartbeat is older than ``STALE_BEATS``
intervals, whose pid is gone on this host or which failed, waiting up to that long for a peer
whose connection just broke; ``failure_line`` makes the one line the run ends with:
``rank 1 (pid 4242 on host n2) stopped answering: no heartbeat for 21.4 s, last at step 5 in
train (collective timeout 20 s)`` (the step and phase as of its last write). Hosts sharing a
run directory must keep their clocks within seconds (NTP).

The file is the common base of a stuck-rank view: a reader needs nothing but the run directory.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from labkit.io import atomic_write_text

__all__ = ["STALE_BEATS", "RankStatus", "current", "explain", "failure_line", "finish", "in_collective", "interval_for",
           "read_all", "unanswering", "update"]

STALE_BEATS = 3
"""Intervals without a write after which a rank counts as not answering."""

_current: RankStatus | None = None


def interval_for(timeout_s: float) -> float:
    """The heartbeat interval of a run with collective timeout ``timeout_s``: a tenth of it, within
    [0.5, 10] s, so that a rank silent for the whole timeout is stale long before it ends."""
    return min(10.0, max(0.5, timeout_s / 10))


class RankStatus:
    """This rank's status file and the thread that keeps it fresh (``start`` / ``stop``)."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, world: int, *, interval_s: float,
                 run_id: str | None = None) -> None:
        self.path = pathlib.Path(run_dir) / "ranks" / f"rank-{rank}.json"
        self.interval_s = interval_s
        self.fields: dict[str, Any] = {
            "rank": rank, "world_size": world, "host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id,
            "step": 0, "phase": "start", "collective": None, "interval_s": interval_s, "beat": 0,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RankStatus:
        """Write the file, start the thread and make this the process's status (``update``)."""
        global _current
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread = threading.Thread(target=self._run, name="labkit-rank-status", daemon=True)
        self._thread.start()
        _current = self
        return self

    def write(self) -> None:
        """Rewrite the file now (atomic: a reader sees the old or the new record)."""
        self.fields["time"] = time.time()
        self.fields["beat"] += 1
        try:
            atomic_write_text(self.path, json.dumps(self.fields))
        except OSError:
            pass  # a full or vanished disk must not stop training; the rank just looks silent

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()

    def stop(self, phase: str) -> None:
        """Stop the thread and write the last record with ``phase`` ("done" or "failed")."""
        global _current
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.fields["phase"], self.fields["collective"] = phase, None
        self.write()
        if _current is self:
            _current = None


def current() -> RankStatus | None:
    """This process's running ``RankStatus`` (None: none started)."""
    return _current


@contextlib.contextmanager
def in_collective(name: str) -> Iterator[None]:
    """Mark this rank as inside labkit collective ``name`` (``labkit.train.dist``'s wrappers) while
    the block runs; DDP's, FSDP's and DCP's own collectives run inside the phases instead."""
    update(collective=name)
    try:
        yield
    finally:
        update(collective=None)


def update(**fields: Any) -> None:
    """Set fields of this process's status (step, phase, collective); no I/O. A no-op without one."""
    if _current is not None:
        _current.fields.update(fields)


def read_all(run_dir: str | os.PathLike, world: int) -> dict[int, dict[str, Any] | None]:
    """Rank -> its status record (None: no file, or unreadable), for ranks 0 .. world - 1."""
    out: dict[int, dict[str, Any] | None] = {}
    for r in range(world):
        try:
            out[r] = json.loads((pathlib.Path(run_dir) / "ranks" / f"rank-{r}.json").read_text())
        except (OSError, ValueError):
            out[r] = None
    return out


def _gone(record: dict[str, Any]) -> bool:
    """Whether the record's process is gone (only knowable on its own host)."""
    if record.get("host") != socket.gethostname():
        return False
    try:
        stat = pathlib.Path(f"/proc/{record['pid']}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def unanswering(run_dir: str | os.PathLike, world: int, me: int, *, wait_s: float = 0.0) -> list[dict[str, Any]]:
    """The other ranks that stopped answering, their records with "how": "gone" (its process is
    gone, on this host), "silent" (no write for ``STALE_BEATS`` intervals; "silent_s" seconds) or
    "failed" (it ended with an error of its own, phase "failed"). Waits up to ``wait_s`` for one
    (a peer whose connection just broke goes silent within ``STALE_BEATS`` intervals). Gone or
    silent ranks are named before (and instead of) failed ones. [] when every other rank answers."""
    deadline = time.time() + wait_s
    while True:
        now, out = time.time(), []
        for r, record in read_all(run_dir, world).items():
            if r == me or record is None or record.get("phase") == "done":
                continue
            age = now - float(record.get("time", 0))
            if record.get("phase") == "failed":
                out.append(record | {"how": "failed", "silent_s": age})
            elif _gone(record):
                out.append(record | {"how": "gone", "silent_s": age})
            elif age > STALE_BEATS * float(record.get("interval_s", 1.0)):
                out.append(record | {"how": "silent", "silent_s": age})
        lost = [r for r in out if r["how"] != "failed"]  # a rank that failed may have failed because of these
        if out or time.time() >= deadline:
            return lost or out
        time.sleep(0.2)


def failure_line(ranks: list[dict[str, Any]], timeout_s: float) -> str:
    """One line naming the ranks that stopped answering (``unanswering``'s records)."""
    parts = []
    for r in ranks:
        where = f"step {r.get('step')} in {r.get('phase')}" + (f", in {r['collective']}" if r.get("collective") else "")
        who = f"rank {r['rank']} (pid {r['pid']} on host {r['host']})"
        if r["how"] == "failed":
            parts.append(f"{who} failed with an error of its own (see its log), at {where}")
        else:
            how = "its process is gone" if r["how"] == "gone" else f"no heartbeat for {r['silent_s']:.1f} s"
            parts.append(f"{who} stopped answering: {how}, last at {where}")
    return "; ".join(parts) + f" (collective timeout {timeout_s:g} s)"


_COMM_WORDS = ("timed out", "timeout", "connection", "closed by peer", "broken pipe", "reset by peer", "nccl",
               "gloo")


def explain(err: BaseException, run_dir: str | os.PathLike, world: int, rank: int, timeout_s: float) -> str | None:
    """The one line a failed collective of this rank ends with: which ranks stopped answering
    (``failure_line``), when ``err`` is a communication failure (``torch.distributed.DistError``,
    or a RuntimeError from the process group: a timeout, a broken connection) in a run of
    ``world`` > 1 ranks and some other rank went silent (waiting up to ``STALE_BEATS`` intervals,
    at most 8 s, for one to); None otherwise (``err`` says it best)."""
    import torch.distributed as tdist

    text = str(err).lower()
    comm = isinstance(err, tdist.DistError) or (isinstance(err, RuntimeError) and any(w in text for w in _COMM_WORDS))
    if world < 2 or not comm:
        return None
    mine = current()
    interval = mine.interval_s if mine is not None else interval_for(timeout_s)
    ranks = unanswering(run_dir, world, rank, wait_s=min(8.0, STALE_BEATS * interval + 1.0))
    return failure_line(ranks, timeout_s) if ranks else None


def finish(phase: str) -> None:
    """``stop`` this process's status with ``phase`` ("done" or "failed"); a no-op without one."""
    if _current is not None:
        _current.stop(phase)
