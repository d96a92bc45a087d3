"""Each rank's status file: its sign of life, where it is, and which rank stopped answering.

Every rank of a multi-rank run keeps ``<dir>/rank-<r>.json`` (docs/formats.md) up to date: a daemon
thread rewrites it atomically every ``interval_s`` seconds (``interval_for``), so it goes on while
the main thread is blocked in a collective. ``<dir>`` is the run directory's ``ranks/``; a
``labkit.cluster.run_ddp`` call of a function without a ``TrainConfig``, or on a finished run
resumed (nothing trained: its ``ranks/`` stays as the run left it), uses a directory of its own.
One ``RankStatus`` per process: ``run_ddp`` starts it on each engine before the function runs
(any function), and ``labkit.train.train`` starts one itself when none runs (torchrun, a spawn);
``begin`` / ``finish`` are the training loop's side of both. The record:

    {"rank", "world_size", "host", "node", "pid", "token" (the run_ddp call, else the run segment),
     "run_id", "started" (ISO 8601 UTC), "time" (Unix time of this write), "beat" (writes so far),
     "interval_s", "step" (the optimiser step in progress, 1-based), "steps_done", "step_at"
     (Unix time it finished), "median_step_s" (of the last 50), "phase" ("start", "train",
     "evaluate", "checkpoint", then "done" or "failed"; "failed_in": the phase it failed in),
     "labkit_collective" (the labkit
     collective it is in: ``labkit.train.dist``'s wrappers, else null), "collective" (the newest
     collective torch's Flight Recorder saw it issue: "seq", "op", "in_flight", "since", "ranks",
     "record_id"; null when off), "collectives" (the newest per process group), "stack" (the main
     thread's Python stack, innermost last), "freed", "freed_at" (connections shut on request)}

Fields set on the training thread (``update``, ``step_done``) are a dict update, no I/O there.

A rank that stops without dying (SIGSTOP, a node cut off the network) stops its thread too, so its
``time`` falls behind: ``STALE_BEATS`` intervals behind, it counts as not answering. A rank that
dies does the same, and on this host its pid is gone; a rank that ends with an error of its own
writes phase "failed" first. Hosts sharing the directory must keep their clocks within a second
or so (NTP). Two readers:

- ``explain``: when a collective of this rank fails (the run's ``timeout_s`` ran out, or a peer's
  connection broke), the one line it ends with: ``rank 1 (pid 4242 on host n2) stopped answering:
  no heartbeat for 21.4 s, last at step 5 in train, in collective 83 (gloo:all_reduce) (collective
  timeout 20 s); here: <this rank's own error>`` (``unanswering``, ``failure_line``).
- ``labkit.cluster.stuck``: while the others are blocked, which rank they wait for, its host and
  stack. Its requests are files in the same directory carrying the token, which the thread
  answers every beat: ``interrupt`` (free this rank's collectives: ``probes.free_collectives``)
  and ``dump-<R>.request`` (rank R's stack, a process on this host, read with py-spy into
  ``dump-<R>.json``).
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from labkit.env import node_name
from labkit.io import atomic_write_json
from labkit.train import probes

__all__ = ["STALE_BEATS", "RankStatus", "begin", "current", "explain", "failure_line", "finish", "in_collective",
           "interval_for", "read_all", "stale", "status_path", "step_done", "unanswering", "update"]

STALE_BEATS = 3
"""Intervals without a write after which a rank counts as not answering."""

_current: RankStatus | None = None


def interval_for(timeout_s: float | None) -> float:
    """The status interval (s) of a run with collective timeout ``timeout_s``: a tenth of it,
    within [0.5, 1] s (0.5 s without one): a rank silent for the whole timeout is stale long before
    it ends, and a stopped rank is named within seconds while the others wait."""
    return 0.5 if timeout_s is None else min(1.0, max(0.5, timeout_s / 10))


def status_path(status_dir: str | os.PathLike, rank: int) -> pathlib.Path:
    """The status file of ``rank`` in ``status_dir``: ``rank-3.json``."""
    return pathlib.Path(status_dir) / f"rank-{int(rank)}.json"


def stale(record: dict[str, Any], now: float | None = None) -> float | None:
    """Seconds since ``record``'s last write when that is more than ``STALE_BEATS`` of its
    intervals (its process does not run), else None; a finished rank is never stale."""
    age = (time.time() if now is None else now) - float(record.get("time", 0))
    if record.get("phase") in ("done", "failed"):
        return None
    return age if age > STALE_BEATS * float(record.get("interval_s") or 1.0) else None


class RankStatus:
    """This rank's status file and the thread that keeps it fresh (module docstring). ``start()``
    writes it, starts the thread and makes it the process's status (``current``); ``stop(phase)``
    ends it with a last write. ``owner``: who started it ("run_ddp" or "train"), who stops it."""

    def __init__(self, status_dir: str | os.PathLike, rank: int, world: int, *, interval_s: float,
                 token: str | None = None, run_id: str | None = None, owner: str = "train") -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: must be positive seconds, got {interval_s}")
        self.dir, self.path, self.interval_s, self.owner = (pathlib.Path(status_dir), status_path(status_dir, rank),
                                                            interval_s, owner)
        self.fields: dict[str, Any] = {
            "rank": rank, "world_size": world, "host": socket.gethostname(), "node": node_name(), "pid": os.getpid(),
            "token": token or uuid.uuid4().hex[:12], "run_id": run_id,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "interval_s": interval_s, "beat": 0, "step": 0, "steps_done": 0, "step_at": None, "median_step_s": None,
            "phase": "start", "failed_in": None, "labkit_collective": None, "freed": None, "freed_at": None}
        self.token = self.fields["token"]
        self._steps: deque = deque(maxlen=50)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._before: set[tuple] = set()
        self._since_ns = 0

    def start(self) -> RankStatus:
        global _current
        self.dir.mkdir(parents=True, exist_ok=True)
        self._before = probes.tcp_connections()  # what interrupt leaves open: the connections made before this
        self._since_ns = time.time_ns()
        self.write()
        self._thread = threading.Thread(target=self._run, name=f"labkit-rank-status-{self.fields['rank']}", daemon=True)
        self._thread.start()
        _current = self
        return self

    def step_done(self, step: int) -> None:
        """Record that optimiser step ``step`` has just finished (called on the training thread)."""
        now, last = time.time(), self.fields["step_at"]
        if last is not None and step == self.fields["steps_done"] + 1:
            self._steps.append(now - last)
            ordered = sorted(self._steps)
            self.fields["median_step_s"] = ordered[len(ordered) // 2]
        self.fields.update(steps_done=int(step), step_at=now)

    def write(self) -> None:
        """Rewrite the file now (atomic: a reader sees the old or the new record; not fsynced)."""
        groups = probes.collectives(self._since_ns)
        self.fields.update(time=time.time(), beat=self.fields["beat"] + 1, collectives=groups, stack=probes.main_stack(),
                           collective=max(groups.values(), key=lambda g: g["record_id"], default=None))
        with suppress(OSError):  # a full or vanished disk must not stop training; the rank just looks silent
            atomic_write_json(self.path, dict(self.fields), indent=None, durable=False)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with suppress(Exception):
                self._answer_requests()
                self.write()

    def stop(self, phase: str) -> None:
        """Stop the thread and write the last record with ``phase`` ("done" or "failed")."""
        global _current
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.end(phase)
        if _current is self:
            _current = None

    def end(self, phase: str) -> None:
        """Write ``phase`` ("done", or "failed": the phase it failed in is kept as "failed_in") now."""
        if phase == "failed" and self.fields["phase"] not in ("done", "failed"):
            self.fields["failed_in"] = self.fields["phase"]
        self.fields.update(phase=phase, labkit_collective=None)
        self.write()

    def _request(self, name: str) -> dict | None:
        try:
            req = json.loads((self.dir / name).read_text())
        except (OSError, ValueError):
            return None
        return req if isinstance(req, dict) and req.get("token") == self.token else None

    def _answer_requests(self) -> None:
        if self.fields["freed"] is None and self._request("interrupt") is not None:
            self.fields.update(freed=probes.free_collectives(self._before), freed_at=time.time())
        host = socket.gethostname()
        for req_path in self.dir.glob("dump-*.request"):
            req = self._request(req_path.name)
            answer = req_path.with_suffix(".json")
            if req is None or req.get("host") != host or req.get("pid") == os.getpid() or answer.exists():
                continue
            stack = probes.py_spy_stack(int(req["pid"]))
            if stack is not None:
                atomic_write_json(answer, {"token": self.token, "pid": req["pid"], "by_rank": self.fields["rank"],
                                           "time": time.time(), "stack": stack}, indent=None, durable=False)


def current() -> RankStatus | None:
    """This process's running ``RankStatus`` (None: none started)."""
    return _current


def begin(status_dir: str | os.PathLike, rank: int, world: int, *, timeout_s: float, run_id: str | None,
          token: str) -> None:
    """The training loop's start: the status that runs (``run_ddp``'s) takes the run's id, else one
    is started in ``status_dir`` with ``token`` (the same on every rank of this run segment;
    ``owner`` "train": ``finish`` stops it)."""
    if _current is not None:
        _current.fields.update(run_id=run_id, world_size=world)
    else:
        RankStatus(status_dir, rank, world, interval_s=interval_for(timeout_s), token=token, run_id=run_id).start()


def finish(phase: str, owner: str = "train") -> None:
    """End this process's status with ``phase`` ("done" or "failed"): ``stop`` when ``owner``
    started it, else the phase is written now and its owner stops it later. A no-op without one."""
    if _current is None:
        return
    if _current.owner == owner:
        _current.stop(phase)
    else:
        _current.end(phase)


@contextmanager
def in_collective(name: str) -> Iterator[None]:
    """Mark this rank as inside labkit collective ``name`` (``labkit.train.dist``'s wrappers) while
    the block runs; DDP's, FSDP's and DCP's own collectives run inside the phases instead (the
    Flight Recorder's ``collective`` has them all)."""
    update(labkit_collective=name)
    try:
        yield
    finally:
        update(labkit_collective=None)


def update(**fields: Any) -> None:
    """Set fields of this process's status (step, phase); no I/O. A no-op without one."""
    if _current is not None:
        _current.fields.update(fields)


def step_done(step: int) -> None:
    """Tell this process's status (if one runs) that optimiser step ``step`` has just finished."""
    if _current is not None:
        _current.step_done(step)


def read_all(status_dir: str | os.PathLike, world: int, token: str | None = None) -> dict[int, dict[str, Any] | None]:
    """Rank -> its status record (None: no file, unreadable, or of another run_ddp call than
    ``token``'s when given), for ranks 0 .. world - 1."""
    out: dict[int, dict[str, Any] | None] = {}
    for r in range(world):
        try:
            record = json.loads(status_path(status_dir, r).read_text())
        except (OSError, ValueError):
            record = None
        out[r] = record if record is None or token is None or record.get("token") == token else None
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


def unanswering(status_dir: str | os.PathLike, world: int, me: int, *, wait_s: float = 0.0,
                token: str | None = None) -> list[dict[str, Any]]:
    """The other ranks that stopped answering, their records with "how": "gone" (its process is
    gone, on this host), "silent" (``stale``; "silent_s" seconds) or "failed" (it ended with an
    error of its own, phase "failed"). Waits up to ``wait_s`` for one (a peer whose connection
    just broke goes silent within ``STALE_BEATS`` intervals). Gone or silent ranks are named before
    (and instead of) failed ones. [] when every other rank answers."""
    deadline = time.time() + max(0.0, wait_s)
    while True:
        now, out = time.time(), []
        for r, record in read_all(status_dir, world, token).items():
            if r == me or record is None or record.get("phase") == "done":
                continue
            age = now - float(record.get("time", 0))
            if record.get("phase") == "failed":
                out.append(record | {"how": "failed", "silent_s": age})
            elif _gone(record):
                out.append(record | {"how": "gone", "silent_s": age})
            elif stale(record, now) is not None:
                out.append(record | {"how": "silent", "silent_s": age})
        lost = [r for r in out if r["how"] != "failed"]  # a rank that failed may have failed because of these
        if out or time.time() >= deadline:
            return lost or out
        time.sleep(0.2)


def failure_line(ranks: list[dict[str, Any]], timeout_s: float, own: str | None = None) -> str:
    """One line naming the ranks that stopped answering (``unanswering``'s records), then
    ``own``: what this rank saw (its error's first line)."""
    parts = []
    for r in ranks:
        where = f"step {r.get('step')} in {r.get('failed_in') if r['how'] == 'failed' else r.get('phase')}"
        if r.get("labkit_collective"):
            where += f", in {r['labkit_collective']}"
        c = r.get("collective")
        if c:
            where += f", {'in' if c.get('in_flight') else 'after'} collective {c['seq']} ({c['op']})"
        who = f"rank {r['rank']} (pid {r['pid']} on host {r['host']})"
        if r["how"] == "failed":
            parts.append(f"{who} failed with an error of its own (see its log), at {where}")
        else:
            how = "its process is gone" if r["how"] == "gone" else f"no heartbeat for {r['silent_s']:.1f} s"
            parts.append(f"{who} stopped answering: {how}, last at {where}")
    return "; ".join(parts) + f" (collective timeout {timeout_s:g} s)" + (f"; here: {own}" if own else "")


_COMM_WORDS = ("timed out", "timeout", "connection", "closed by peer", "broken pipe", "reset by peer", "nccl",
               "gloo")


def explain(err: BaseException, run_dir: str | os.PathLike, world: int, rank: int, timeout_s: float) -> str | None:
    """The one line a failed collective of this rank ends with: which ranks stopped answering
    (``failure_line``), then this rank's own error's first line (``err``: the timeout or the
    broken connection it saw), when ``err`` is a communication failure
    (``torch.distributed.DistError``, or a RuntimeError from the process group) in a run of
    ``world`` > 1 ranks and some other rank went silent; None otherwise (``err`` says it best). A
    broken connection waits up to ``STALE_BEATS`` intervals + 1 s (at most 8 s) for the peer to go
    silent; a timeout waits only what of that the timeout itself has not (a peer that stopped
    answering has been silent for the whole timeout: with ``interval_for``'s intervals, no wait
    from a 5 s timeout up). The files read: the running status's directory, else
    ``run_dir``'s ``ranks/``."""
    import torch.distributed as tdist

    text = str(err).lower()
    comm = isinstance(err, tdist.DistError) or (isinstance(err, RuntimeError) and any(w in text for w in _COMM_WORDS))
    if world < 2 or not comm:
        return None
    mine = current()
    status_dir = mine.dir if mine is not None else pathlib.Path(run_dir) / "ranks"
    interval = mine.interval_s if mine is not None else interval_for(timeout_s)
    wait_s = min(8.0, STALE_BEATS * interval + 1.0) - (timeout_s if "timed out" in text else 0.0)
    ranks = unanswering(status_dir, world, rank, wait_s=wait_s, token=mine.token if mine is not None else None)
    own = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
    own = _CALLBACK.sub("", own)  # torch.futures wraps a failed all-reduce once per comm-hook callback
    return failure_line(ranks, timeout_s, f"{type(err).__name__}: {own[:300]}") if ranks else None


_CALLBACK = re.compile(r"^(?:Got the following error when running the callback: (?:\w+: )?)+")
