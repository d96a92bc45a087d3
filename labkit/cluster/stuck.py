"""A stuck rank named while it is stuck: read every rank's status file, find the rank the others wait
for, and get its Python stack.

Every rank of a ``run_ddp`` call keeps a status file (``labkit.train.status``: a thread of its
own rewrites ``<run_dir>/ranks/rank-<R>.json`` every 0.5-1 s with its step, the newest collective
torch's Flight Recorder saw it issue (sequence number, operation, in flight or done) and its main
thread's stack). The controller reads those files, never the blocked ranks' main threads:

- ``stalled``: the step now running has run ``STALL_FACTOR`` times the median step time and at
  least ``STALL_MIN_S`` (without step times, a collective waited in for ``STALL_NO_STEPS_S``);
- ``diagnose``: in the process group where ranks have waited longest, the members that are in no
  collective (computing, reading data) or whose file is ``STALE_BEATS`` intervals old
  (``labkit.train.status.stale``: not running at all, stopped, or hung holding the GIL) are "not in collective n", n the first collective the
  others wait in: the ranks the others wait for;
- ``StallWatch``: both, polled by ``run_ddp`` about once a second, plus the stuck rank's stack:
  read from outside with py-spy (``labkit.train.probes.py_spy_stack``) by this process when the
  rank runs on this host, else by a live rank on its host (a ``dump-<R>.request`` file its
  status thread answers), else the stack the rank itself last wrote (a stopped process cannot write,
  so that stack is as old as its heartbeat, and says so);
- ``request_interrupt``: ask every rank's status thread to free its collectives (an interrupted
  cell then ends at once instead of at the collective timeout; ``labkit.train.probes.free_collectives``).

``rank_lines``/``stuck_line`` are what ``labkit ranks RUN_DIR`` prints.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path

from labkit.io import atomic_write_json
from labkit.train.probes import py_spy_stack
from labkit.train.status import stale

__all__ = ["STALL_FACTOR", "STALL_MIN_S", "STALL_NO_STEPS_S", "StallWatch", "clear_requests", "diagnose",
           "labkit_frame", "rank_lines",
           "ranks_text", "read_statuses", "report", "request_interrupt", "stalled", "stuck_line"]

STALL_FACTOR = 5.0
"""A step counts as stalled once it has run this many times the median step time ..."""
STALL_MIN_S = 3.0
"""... and at least this many seconds."""
STALL_NO_STEPS_S = 30.0
"""Without step times (a function that is not ``labkit.train.train``, or before its first step): a
collective waited in this long is a stall."""


def read_statuses(status_dir: str | os.PathLike, token: str | None = None) -> dict[int, dict]:
    """{rank: status} of the run ``token`` (None: the run whose rank files started last) from
    ``status_dir``'s ``rank-*.json``; files of other runs and unreadable files are left out."""
    out = []
    for path in Path(status_dir).glob("rank-*.json"):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    if token is None and out:
        token = max(out, key=lambda s: str(s.get("started", ""))).get("token")  # ISO 8601 UTC: sorts by time
    return {int(s["rank"]): s for s in sorted(out, key=lambda s: s["rank"]) if s.get("token") == token}


def ranks_text(ranks: list[int]) -> str:
    """"ranks 0-2, 5" for [0, 1, 2, 5]; "rank 3" for [3]."""
    runs, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _members(entries: dict[int, dict | None], statuses: dict[int, dict]) -> list[int]:
    """The group's members as its ranks report them (every rank when none says)."""
    for e in entries.values():
        if e and e.get("ranks"):
            return [r for r in e["ranks"] if r in statuses]
    return sorted(statuses)


def stalled(statuses: dict[int, dict], now: float | None = None) -> float | None:
    """Seconds the current step has run when that is a stall (module docstring), else None."""
    now = time.time() if now is None else now
    done = [s["step_at"] for s in statuses.values() if s.get("step_at")]
    medians = [s["median_step_s"] for s in statuses.values() if s.get("median_step_s")]
    if done and medians:
        running = now - max(done)
        return running if running >= max(STALL_MIN_S, STALL_FACTOR * statistics.median(medians)) else None
    waits = [now - g["since"] for s in statuses.values() for g in (s.get("collectives") or {}).values()
             if g.get("in_flight")]
    return max(waits) if waits and max(waits) >= STALL_NO_STEPS_S else None


def diagnose(statuses: dict[int, dict], now: float | None = None) -> dict | None:
    """The ranks the others wait for. In each process group, the members in flight in a collective
    wait (those whose file is stale excepted, ``labkit.train.status.stale``: a process that does not run
    holds the others up wherever it stopped); every other member is "behind": outside any
    collective (computing, or reading data), or not running. Ranks finish a collective at
    different moments, so the waiting ranks may be one collective apart: n is the first one they
    wait in, the one that cannot complete. Of the groups with both, the one waited in longest.
    Returns {"group", "seq" (n), "op" (its operation), "behind" (not-running ranks first),
    "waiting", "waiting_s", "stale" ({rank: heartbeat age s} of the ranks not running)}, or None
    when no group has ranks waiting for others (all computing, or all waiting: the network)."""
    now = time.time() if now is None else now
    groups = {name for s in statuses.values() for name in (s.get("collectives") or {})}
    best = None
    for name in sorted(groups):
        entries = {r: (s.get("collectives") or {}).get(name) for r, s in statuses.items()}
        members = _members(entries, statuses)
        ages = {r: stale(statuses[r], now) for r in members}
        silent = {r: age for r, age in ages.items() if age is not None}
        waiting = [r for r in members if r not in silent and entries[r] and entries[r]["in_flight"]]
        behind = sorted((r for r in members if r not in waiting), key=lambda r: (r not in silent, r))
        if not waiting or not behind:
            continue
        first = min((entries[r] for r in waiting), key=lambda e: e["seq"])
        waited = now - min(entries[r]["since"] for r in waiting)
        if best is None or waited > best["waiting_s"]:
            best = {"group": name, "seq": first["seq"], "op": first["op"], "behind": behind, "waiting": waiting,
                    "waiting_s": waited, "stale": silent}
    return best


def stuck_line(found: dict, statuses: dict[int, dict], engines: dict[int, int] | None = None) -> str:
    """One line naming the first rank the others wait for, its host, node and pid, the collective
    they wait in and for how long, and whether it is running (``diagnose``'s result)."""
    r = found["behind"][0]
    s = statuses[r]
    engine = f", engine {engines[r]}" if engines and r in engines else ""
    where = f"host {s['host']}" + (f", node {s['node']}" if s.get("node") != s["host"] else "") + f", pid {s['pid']}"
    more = f" (and {ranks_text(found['behind'][1:])})" if len(found["behind"]) > 1 else ""
    state = (f"its heartbeat stopped {found['stale'][r]:.0f} s ago: the process is not running (stopped, or hung "
             "holding the GIL) or its node is cut off" if r in found["stale"]
             else "its task has ended" if s.get("phase") in ("done", "failed") else "it is running")
    step = f", at step {s['step']}" if s.get("step") else ""
    have = "has" if len(found["waiting"]) == 1 else "have"
    return (f"rank {r} ({where}{engine}){more} is not in collective {found['seq']} ({found['op']}) that "
            f"{ranks_text(found['waiting'])} {have} waited in for {found['waiting_s']:.0f} s{step}; {state}")


def rank_lines(statuses: dict[int, dict], now: float | None = None) -> list[str]:
    """One line per rank: host, node, pid, step and phase, the newest collective and the file's age."""
    now = time.time() if now is None else now
    lines = []
    for r, s in sorted(statuses.items()):
        c = s.get("collective")
        coll = (f"collective {c['seq']} ({c['op']}) {'in flight for %.1f s' % (now - c['since']) if c['in_flight'] else 'done'}"
                if c else "no collective yet")
        ended = s.get("phase") in ("done", "failed")
        where = f"step {s.get('step', 0)}, {s['phase']}" if ended else f"step {s.get('step', 0)} in {s.get('phase')}"
        lines.append(f"rank {r}: host {s['host']}, node {s['node']}, pid {s['pid']}, {where}, {coll}"
                     + ("" if ended else f", heartbeat {now - s['time']:.1f} s ago"))
    return lines


def labkit_frame(stack: list[str]) -> str | None:
    """The innermost frame of ``stack`` (lines "path:line in func", innermost last) in labkit's own
    code, as "labkit/train/runtime.py:84 in forward_backward"; None when no frame is labkit's."""
    for frame in reversed(stack):
        path, _, rest = frame.partition(":")
        if "/labkit/" in path and "/site-packages/" not in path:
            return f"labkit/{path.rsplit('/labkit/', 1)[1]}:{rest}"
    return None


def request_interrupt(status_dir: str | os.PathLike, token: str) -> None:
    """Ask every rank of run ``token`` to free its collectives (its status thread reads the request)."""
    atomic_write_json(Path(status_dir) / "interrupt", {"token": token, "time": time.time()}, durable=False)


def clear_requests(status_dir: str | os.PathLike) -> None:
    """Remove the requests of earlier runs (``interrupt``, ``dump-*``) from ``status_dir``."""
    for path in [Path(status_dir) / "interrupt", *Path(status_dir).glob("dump-*")]:
        path.unlink(missing_ok=True)


class StallWatch:
    """The stall view's state for one run: ``poll()`` reads the status files; when the step is
    stalled and ``diagnose`` names ranks, it returns {"line", "kind" ("stuck": the rank's process
    is not running, "slow": it runs), "stack", "stack_source", "in_labkit" (``labkit_frame``), "rank",
    "host", "pid", "seq", "op", "waiting_s", "behind" (every rank not in the collective), "stopped"
    (those of them whose status file stopped)}; None otherwise (also kept as ``found``). ``engines``: {rank: engine id} for the line."""

    def __init__(self, status_dir: str | os.PathLike, token: str, engines: dict[int, int] | None = None):
        self.dir, self.token, self.engines = Path(status_dir), token, dict(engines or {})
        self.found: dict | None = None
        self._requested: dict[int, float] = {}

    def poll(self, now: float | None = None) -> dict | None:
        now = time.time() if now is None else now
        statuses = read_statuses(self.dir, self.token)
        found = diagnose(statuses, now) if statuses and stalled(statuses, now) is not None else None
        if found is None:
            self.found = None
            return None
        r = found["behind"][0]
        stack, source = self._stack(statuses[r], now)
        self.found = {"line": stuck_line(found, statuses, self.engines), "stack": stack, "stack_source": source,
                      "kind": "stuck" if r in found["stale"] else "slow", "in_labkit": labkit_frame(stack),
                      "rank": r, "host": statuses[r]["host"], "pid": statuses[r]["pid"], "seq": found["seq"],
                      "op": found["op"], "waiting_s": found["waiting_s"], "behind": found["behind"],
                      "stopped": sorted(found["stale"])}
        return self.found

    def _stack(self, status: dict, now: float) -> tuple[list[str], str]:
        """The rank's stack and where it came from: py-spy here (same host), py-spy by a live rank on
        its host (asked once through a request file, answered within a beat or two), or its own."""
        r, pid = status["rank"], status["pid"]
        if status["host"] == socket.gethostname():
            stack = py_spy_stack(pid)
            if stack is not None:
                return stack, f"read now with py-spy from this host ({status['host']})"
        answer = self.dir / f"dump-{r}.json"
        try:
            dump = json.loads(answer.read_text())
            if dump.get("token") == self.token and dump.get("pid") == pid and dump["time"] >= self._requested.get(r, now):
                return dump["stack"], f"read with py-spy by rank {dump['by_rank']} on {status['host']}, {now - dump['time']:.0f} s ago"
        except (OSError, ValueError, KeyError):
            pass
        if r not in self._requested:
            self._requested[r] = now
            answer.unlink(missing_ok=True)
            atomic_write_json(self.dir / f"dump-{r}.request", {"token": self.token, "host": status["host"],
                                                               "pid": pid, "time": now}, durable=False)
        return status.get("stack") or [], f"written by the rank itself {now - status['time']:.0f} s ago"


def report(run_dir: str | os.PathLike, *, wait_s: float = 3.0) -> dict:
    """What ``labkit ranks RUN_DIR`` prints: {"state" ("stuck": a rank the others wait for whose
    process is not running, "slow": one that runs, "running", "finished"), "stuck" (``StallWatch``'s
    result, None unless stuck or slow), "ranks" ({rank: its status record}), "lines"}. The lines: a
    first line with the state ("stuck: " + ``stuck_line``, with the rank's stack below, waiting up
    to ``wait_s`` for a py-spy dump by a rank on its host; or the ranks and their step), then
    ``rank_lines``. ``run_dir``: a run directory (its ``ranks/`` is read) or a status directory.
    Raises FileNotFoundError (one line) when ``run_dir`` does not exist or holds no rank status."""
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"{run_dir}: run directory does not exist")
    status_dir = Path(run_dir) / "ranks" if (Path(run_dir) / "ranks").is_dir() else Path(run_dir)
    statuses = read_statuses(status_dir)
    if not statuses:
        raise FileNotFoundError(f"{run_dir}: no rank status files (ranks/rank-*.json); a run of 2 or more ranks "
                                "writes them while it trains")
    token = next(iter(statuses.values()))["token"]
    watch = StallWatch(status_dir, token)
    found = watch.poll()
    end = time.monotonic() + wait_s
    while found and found["stack_source"].startswith("written") and time.monotonic() < end:
        time.sleep(0.2)
        found = watch.poll()
    step = max(s.get("step") or 0 for s in statuses.values())
    if found:
        state = found["kind"]
        head = [f"{found['kind']}: {found['line']}", f"  in labkit at {found['in_labkit']}",
                f"  its Python stack ({found['stack_source']}), innermost last:",
                *(f"    {f}" for f in found["stack"][-12:])]
    elif all(s.get("phase") in ("done", "failed") for s in statuses.values()):
        state, head = "finished", [f"finished: {len(statuses)} ranks, step {step}"]
    else:
        state, head = "running", [f"running: {len(statuses)} ranks at step {step}; no rank holds the others up"]
    return {"state": state, "stuck": found, "ranks": statuses, "lines": head + rank_lines(statuses)}
