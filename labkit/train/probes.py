"""What a rank's status thread (``labkit.train.status``) reads while the main thread may be blocked
in a collective, and what it does when asked to free it.

- ``collectives``: the newest collective of each process group per torch's Flight Recorder (its
  sequence number in the group, the operation, in flight or done, since when). The recorder
  records gloo and NCCL work when ``TORCH_FR_BUFFER_SIZE`` > 0 before the process group is made
  (``enable_flight_recorder``); it is read with ``torch._C._distributed_c10d._dump_fr_trace_json``
  (torch 2.13), which another thread can call while the main thread waits in a collective: gloo and
  NCCL release the GIL while they wait.
- ``main_stack``: the main thread's Python stack (``sys._current_frames``).
- ``py_spy_stack``: another process's stack read from outside with py-spy (``py-spy dump
  --nonblocking``, which reads a stopped process's memory without attaching to it).
- ``free_collectives``: end the collectives this process waits in (NCCL: abort; gloo: shut its
  connections), so that a blocked main thread raises at once instead of at the group's timeout.

Nothing happens at import; torch is imported only where it already is.
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
import traceback
from typing import Any

__all__ = ["FR_ENTRIES", "STACK_FRAMES", "collectives", "enable_flight_recorder", "free_collectives", "main_stack",
           "py_spy_stack", "tcp_connections"]

FR_ENTRIES = 32
"""Flight Recorder entries kept per process (``TORCH_FR_BUFFER_SIZE``) when labkit turns it on. The
status thread reads them all every beat, and the read grows in proportion to them (torch 2.13:
256 entries took 20 times as long as 32, holding the GIL); a blocked rank's own newest entry is never pushed out, as
it issues nothing while blocked. Set TORCH_FR_BUFFER_SIZE for more (torch's own dumps)."""
STACK_FRAMES = 40
"""The innermost frames of a Python stack kept."""


def enable_flight_recorder() -> None:
    """Turn torch's Flight Recorder on for the process groups made from now on
    (``TORCH_FR_BUFFER_SIZE`` = ``FR_ENTRIES`` unless already set)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_ENTRIES))


def _group_members() -> dict[str, list[int]]:
    """{process group name: its members' global ranks} of the groups this process is in (torch's
    registry; the Flight Recorder's own group table is empty for gloo in torch 2.13)."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    return {name: sorted(world.pg_group_ranks[pg]) for pg, name in list(world.pg_names.items())
            if pg in world.pg_group_ranks}


def collectives(since_ns: int = 0) -> dict[str, dict[str, Any]]:
    """The newest Flight Recorder entry of each process group created at or after ``since_ns``
    (Unix ns): {group name: {"record_id", "seq" (collective sequence number in the group), "op"
    (e.g. "gloo:all_reduce"), "in_flight" (bool: the recorder retires an entry when its work
    ends), "since" (Unix s), "ranks" (the group's global ranks, or None when the group is gone)}};
    {} when torch.distributed is not imported, or the recorder is off or unreadable."""
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


def main_stack() -> list[str]:
    """The main thread's Python stack as "file:line in func" lines, innermost last (at most
    ``STACK_FRAMES``)."""
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


def tcp_connections() -> set[tuple]:
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
    process opened since ``before`` (``tcp_connections``: gloo's pairs and its store client) is
    shut down (``shutdown(2)``, both ways): gloo's wait then raises "Connection closed by peer" on
    this rank and on its peers. Returns the connections shut down."""
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and dist.is_initialized() and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
    shut = 0
    for fd, _, _ in tcp_connections() - before:
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(fd))
            try:
                s.shutdown(socket.SHUT_RDWR)
                shut += 1
            finally:
                s.close()
    return shut
