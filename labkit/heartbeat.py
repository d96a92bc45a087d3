"""Each rank's status file, written by a thread of its own, so that a controller can tell which rank
holds the others up while they are blocked.

A ``Heartbeat`` is a daemon thread that every ``interval`` seconds writes ``<status_dir>/rank-<R>.json``
(atomically; not fsynced, it is volatile state) with:

- who: rank, world size, host, node (``labkit.env.node_name``), pid;
- ``step``: the last optimiser step this rank finished and when (``set_step``, which
  ``labkit.train.loop`` calls after every step), and the median of its recent step times;
- ``collective``: the newest collective this rank issued, per torch's Flight Recorder: its sequence
  number in its process group (``seq``), the operation (``op``, e.g. "gloo:all_reduce"), the group,
  whether it is still in flight (``in_flight``: the recorder retires an entry when the work ends)
  and since when (``since``, Unix seconds). The recorder records gloo and NCCL work when
  ``TORCH_FR_BUFFER_SIZE`` > 0 before the process group is made (``start`` sets it to
  ``FR_ENTRIES`` unless set); it is read with ``torch._C._distributed_c10d._dump_fr_trace_json``
  (torch 2.13), which this thread can call while the main thread waits in a collective: gloo and
  NCCL release the GIL while they wait;
- ``stack``: the main thread's Python stack, innermost last (``sys._current_frames``); a stopped
  process writes nothing, so its file keeps the stack it had at its last beat (``time``).

Every beat the thread also answers two requests of the controller (``labkit.cluster.stuck``),
files in the same directory carrying the run's ``token``:

- ``interrupt``: free this rank's collectives, so that a main thread blocked in one raises at once
  instead of at the group's timeout (``free_collectives``);
- ``dump-<R>.request``: the Python stack of rank R, a process on this host, read from outside with
  py-spy (``py-spy dump --nonblocking``, which reads a stopped process's memory without attaching
  to it), answered in ``dump-<R>.json``.

Nothing happens at import.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

from labkit.env import node_name
from labkit.io import atomic_write_json

__all__ = ["FR_ENTRIES", "Heartbeat", "collectives", "free_collectives", "py_spy_stack", "set_step", "status_path"]

FR_ENTRIES = 256
"""Flight Recorder entries kept per process (``TORCH_FR_BUFFER_SIZE``) when labkit turns it on."""
STACK_FRAMES = 40
"""The innermost frames of the main thread's stack a status file keeps."""

_CURRENT: "Heartbeat | None" = None


def status_path(status_dir: str | os.PathLike, rank: int) -> Path:
    """The status file of ``rank`` in ``status_dir``: ``rank-00003.json``."""
    return Path(status_dir) / f"rank-{int(rank):05d}.json"


def set_step(step: int) -> None:
    """Tell this process's heartbeat (if one runs) that optimiser step ``step`` has just finished."""
    beat = _CURRENT
    if beat is not None:
        beat.step(step)


def _group_members() -> dict[str, list[int]]:
    """{process group name: its members' global ranks} of the groups this process is in (torch's
    registry; the Flight Recorder's own group table is empty for gloo in torch 2.13)."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    return {name: sorted(world.pg_group_ranks[pg]) for pg, name in list(world.pg_names.items())
            if pg in world.pg_group_ranks}


def collectives(since_ns: int = 0) -> dict[str, dict[str, Any]]:
    """The newest Flight Recorder entry of each process group created at or after ``since_ns``
    (Unix ns): {group name: {"record_id", "seq" (collective sequence number in the group), "op",
    "in_flight" (bool), "since" (Unix s), "ranks" (the group's global ranks, or None when the
    group is gone)}}; {} when the recorder is off or unreadable."""
    if "torch.distributed" not in sys.modules:  # a run without torch: nothing recorded (and nothing imported)
        return {}
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        trace = json.loads(_dump_fr_trace_json(True, False))
        members = _group_members()
    except Exception:  # noqa: BLE001 - no recorder in this build, or nothing recorded yet
        return {}
    out: dict[str, dict[str, Any]] = {}
    for e in trace.get("entries") or []:
        if int(e.get("time_created_ns") or 0) < since_ns or e.get("is_p2p"):
            continue
        group = (e.get("process_group") or [""])[0]
        if group in out and out[group]["record_id"] > e["record_id"]:
            continue
        out[group] = {"record_id": e["record_id"], "seq": int(e["collective_seq_id"]), "op": e["profiling_name"],
                      "in_flight": not e.get("retired", False), "since": e["time_created_ns"] / 1e9,
                      "ranks": members.get(group)}
    return out


def _main_stack() -> list[str]:
    """The main thread's Python stack as "file:line in func" lines, innermost last."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return []
    return [f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_stack(frame)[-STACK_FRAMES:]]


def py_spy_stack(pid: int, *, timeout: float = 10.0) -> list[str] | None:
    """The Python stack of process ``pid``'s main thread, innermost last, read from outside with
    ``py-spy dump --nonblocking --json`` (py-spy reads the process's memory without stopping it, so
    a SIGSTOPped process is read too); None when py-spy is not installed, the process is not on this
    host, or py-spy cannot read it (no ptrace permission: Yama's ptrace_scope, a container)."""
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--nonblocking", "--json"], capture_output=True,
                             text=True, timeout=timeout)
        threads = json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    if not threads:
        return None
    main = next((t for t in threads if t.get("os_thread_id") == pid), threads[0])
    frames = [f"{f['filename']}:{f['line']} in {f['name']}" for f in main.get("frames", [])]
    return frames[::-1][-STACK_FRAMES:]  # py-spy lists innermost first


def _tcp_connections() -> set[tuple]:
    """This process's established TCP connections as (fd, local address, remote address)."""
    import psutil

    with contextlib.suppress(Exception):
        return {(c.fd, tuple(c.laddr), tuple(c.raddr)) for c in psutil.Process().net_connections("tcp")
                if c.raddr and c.status == psutil.CONN_ESTABLISHED}
    return set()


def free_collectives(before: set[tuple]) -> int:
    """End the collectives this process waits in, so that they raise at once: NCCL's groups are
    aborted (``torch.distributed.distributed_c10d._abort_process_group``); gloo has no abort that
    frees a waiting collective in torch 2.13 (``ProcessGroupGloo.abort``/``shutdown`` return and
    the wait runs on to the timeout; pytorch/gloo#388 is open), so every TCP connection this
    process opened since ``before`` (``_tcp_connections``: gloo's pairs and its store client) is
    shut down (``shutdown(2)``, both ways): gloo's wait then raises "Connection closed by peer" on
    this rank and on its peers. Returns the connections shut down."""
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and dist.is_initialized() and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
    shut = 0
    for fd, _, _ in _tcp_connections() - before:
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(fd))
            try:
                s.shutdown(socket.SHUT_RDWR)
                shut += 1
            finally:
                s.close()
    return shut


class Heartbeat:
    """This rank's status file, rewritten every ``interval`` s by a daemon thread (module docstring).

    ``status_dir``: a directory every rank and the controller can read (the run directory's
    ``status/``); ``rank``, ``world_size``: this process's place; ``token``: the run's id, which
    the controller's requests must carry. ``start()`` begins (and makes this the process's current
    heartbeat, which ``set_step`` reaches), ``stop()`` ends it and writes the file a last time."""

    def __init__(self, status_dir: str | os.PathLike, *, rank: int, world_size: int, token: str,
                 interval: float = 0.5):
        if interval <= 0:
            raise ValueError(f"interval: must be positive seconds, got {interval}")
        self.dir, self.rank, self.world, self.token, self.interval = Path(status_dir), rank, world_size, token, interval
        self.path = status_path(status_dir, rank)
        self._steps: deque = deque(maxlen=50)
        self._step, self._step_at = 0, None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._before: set[tuple] = set()
        self._since_ns = 0
        self.freed: int | None = None
        self.freed_at: float | None = None
        self.started = time.time()

    def step(self, step: int) -> None:
        """Record that optimiser step ``step`` has just finished (called on the training thread)."""
        now = time.time()
        if self._step_at is not None and step == self._step + 1:
            self._steps.append(now - self._step_at)
        self._step, self._step_at = int(step), now

    def start(self) -> "Heartbeat":
        global _CURRENT
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_ENTRIES))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._before = _tcp_connections()
        self._since_ns = time.time_ns()
        self.write()
        self._thread = threading.Thread(target=self._run, name=f"labkit-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        _CURRENT = self
        return self

    def stop(self) -> None:
        global _CURRENT
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if _CURRENT is self:
            _CURRENT = None
        with contextlib.suppress(OSError):
            self.write(finished=True)

    def status(self, *, finished: bool = False) -> dict[str, Any]:
        """This rank's status now (the file's contents)."""
        steps = sorted(self._steps)
        groups = collectives(self._since_ns)
        newest = max(groups.values(), key=lambda g: g["record_id"], default=None)
        return {"rank": self.rank, "world_size": self.world, "token": self.token, "host": socket.gethostname(),
                "node": node_name(), "pid": os.getpid(), "time": time.time(), "started": self.started,
                "finished": finished, "step": self._step, "step_at": self._step_at,
                "median_step_s": steps[len(steps) // 2] if steps else None,
                "collective": newest, "collectives": groups, "stack": _main_stack(), "freed": self.freed,
                "freed_at": self.freed_at}

    def write(self, *, finished: bool = False) -> None:
        atomic_write_json(self.path, self.status(finished=finished), indent=None, durable=False)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # a full disk or a vanished directory must not end the rank
                self._answer_requests()
                self.write()

    def _request(self, name: str) -> dict | None:
        try:
            req = json.loads((self.dir / name).read_text())
        except (OSError, ValueError):
            return None
        return req if isinstance(req, dict) and req.get("token") == self.token else None

    def _answer_requests(self) -> None:
        if self.freed is None and self._request("interrupt") is not None:
            self.freed, self.freed_at = free_collectives(self._before), time.time()
        host = socket.gethostname()
        for req_path in self.dir.glob("dump-*.request"):
            req = self._request(req_path.name)
            answer = req_path.with_suffix(".json")
            if req is None or req.get("host") != host or req.get("pid") == os.getpid() or answer.exists():
                continue
            stack = py_spy_stack(int(req["pid"]))
            if stack is not None:
                atomic_write_json(answer, {"token": self.token, "pid": req["pid"], "by_rank": self.rank,
                                           "time": time.time(), "stack": stack}, indent=None, durable=False)
