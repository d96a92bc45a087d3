"""The parts of an elastic run (``run_ddp_resumable(..., elastic=True)``): which engines it goes on
with, when it grows back, and the record of each change of world size.

A lost engine ends a DDP run on every rank (``labkit.cluster.launch.DDPError``). An elastic run then
goes on with the engines that are left, from its newest checkpoint, at the smaller world size:
``labkit.train`` keeps the checkpoint's global batch by accumulating more micro-batches per rank,
and the sampler continues the global sample order, so with dropout 0 the losses are those of a
run that never lost the engines up to the floating-point order of the sums. When engines register
again (restarted on a node that came back), ``GrowWatch`` interrupts the run once the next
checkpoint is complete, and it goes on from there with every engine.

Each change is a line of ``<run_dir>/world_size_changes.jsonl`` (``ChangeLog``): when (``time``,
UTC ISO; ``unix``), why (``reason``), ``from_world_size`` -> ``to_world_size``, the engines that
left or joined, the step the run had reached (``reached_step``, from rank 0's newest metrics
record) and the checkpoint it went on from (``resumed_from_step``), and the time lost: from the
last step before the change to the moment the run was back at that step, less the time those
steps take at the new size (``lost_s``; split into ``detect_s``, from that last step to the error
or interrupt, ``restart_s``, from there to the first step after it, and ``redo_s``, redoing the
steps after the checkpoint). The times come from the metrics records' ``time`` (Unix seconds), so
they are exact with ``log_every`` 1.
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from labkit.cluster.engine_watch import registered, unreachable
from labkit.io import atomic_write_text

__all__ = ["CHANGES_FILE", "ChangeLog", "GrowWatch", "Regroup", "metrics_records", "survivors", "usable"]

CHANGES_FILE = "world_size_changes.jsonl"
"""The run directory's record of its changes of world size."""


class Regroup(KeyboardInterrupt):
    """Raised inside ``run_ddp``'s wait by ``GrowWatch``: new engines are there and a checkpoint
    after their arrival is complete. A KeyboardInterrupt, so ``run_ddp`` frees and interrupts the
    ranks as for Ctrl-C before it propagates; the elastic runner catches it."""


def metrics_records(run_dir: str | Path) -> list[dict]:
    """Rank 0's metrics records of ``run_dir`` (metrics.jsonl), torn or unreadable lines skipped."""
    out = []
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _newest_checkpoint(run_dir: str | Path) -> int:
    from labkit.train.checkpoint import checkpoint_steps

    steps = checkpoint_steps(run_dir)
    return steps[-1] if steps else 0


def _warm_engine() -> bool:
    """On a joining engine: import what a training rank imports (torch, the training loop), so that
    its first rank does not keep the others waiting at the process group's rendezvous."""
    import labkit.train.loop  # noqa: F401 - labkit.train alone imports nothing of it (its names come on first use)

    return True


class GrowWatch:
    """A ``live`` callback of an elastic run on ``engines``: once engines other than those (and not
    ``gone``) are registered, it notes the newest complete checkpoint and warms them up
    (``_warm_engine``, while the run goes on); when they are warm and a newer checkpoint is
    complete it raises ``Regroup``. Engines whose warm-up fails are left out. ``joined``: the new
    engines' ids. ``run_ddp`` calls it at every poll (``every_poll``), records or not."""

    every_poll = True

    def __init__(self, client: Any, engines: list[int], run_dir: str | Path, gone: set[int] | frozenset = frozenset()):
        self.client, self.engines, self.run_dir, self.gone = client, set(engines), run_dir, set(gone)
        self.joined: list[int] = []
        self.since: int | None = None
        self._warming: Any = None

    def __call__(self, records: list[dict]) -> None:
        if self.since is None:
            new = sorted(set(registered(self.client)) - self.engines - self.gone)
            if new:
                self.joined, self.since = new, _newest_checkpoint(self.run_dir)
                self._warming = self.client[new].apply_async(_warm_engine)
            return
        if not self._warming.ready():
            return
        if not self._warming.successful():  # an engine that cannot import the training code does not join
            self.gone |= set(self.joined)
            self.joined, self.since = [], None
            return
        if _newest_checkpoint(self.run_dir) > self.since:
            raise Regroup(f"engines {self.joined} joined; checkpoint step-{_newest_checkpoint(self.run_dir)} is complete")


def usable(engines: list[int], *, global_batch: int, micro_batch: int) -> list[int]:
    """The most of ``engines`` (in order) whose count k keeps ``global_batch``: micro_batch x k
    divides it, so each rank accumulates global_batch / (micro_batch x k) micro-batches."""
    for k in range(len(engines), 0, -1):
        if global_batch % (micro_batch * k) == 0:
            return list(engines[:k])
    return []


def survivors(client: Any, engines: list[int], *, wait_s: float, poll: float = 0.5) -> list[int]:
    """The engines of ``engines`` that are registered, answer their control channel within 3 s and
    are idle (their task of the failed run has ended) within ``wait_s`` seconds; in order."""
    alive = [e for e in engines if e in client.ids]
    gone = set(unreachable(client, alive, timeout=3.0))
    alive = [e for e in alive if e not in gone]
    end = time.monotonic() + wait_s
    while True:
        status = client.queue_status(targets=alive, verbose=False) if alive else {}
        busy = [e for e in alive if isinstance(status.get(e), dict)
                and status[e].get("queue", 0) + status[e].get("tasks", 0) > 0]
        if not busy or time.monotonic() > end:
            return [e for e in alive if e not in busy]
        time.sleep(poll)


def _now_iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


class ChangeLog:
    """``<run_dir>/world_size_changes.jsonl``: ``add`` appends a change when it happens (its times
    lost still None); ``complete`` fills in the times lost of the changes this runner made, from
    the run's metrics records, and rewrites the file (atomically). ``changes``: this runner's."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / CHANGES_FILE
        self.changes: list[dict] = []

    def add(self, *, reason: str, old: list[int], new: list[int], error_time: float) -> dict:
        records = metrics_records(self.path.parent)
        last = records[-1] if records else {}
        change = {"time": _now_iso(error_time), "unix": error_time, "reason": reason,
                  "from_world_size": len(old), "to_world_size": len(new),
                  "engines_left": sorted(set(old) - set(new)), "engines_joined": sorted(set(new) - set(old)),
                  "reached_step": last.get("step"), "reached_time": last.get("time"),
                  "resumed_from_step": _newest_checkpoint(self.path.parent),
                  "detect_s": None if last.get("time") is None else error_time - last["time"],
                  "restart_s": None, "redo_s": None, "lost_s": None}
        self.changes.append(change)
        with open(self.path, "a") as f:
            f.write(json.dumps(change) + "\n")
        return change

    def complete(self) -> list[dict]:
        records = metrics_records(self.path.parent)
        for change in self.changes:
            change.update(_lost_times(change, records))
        try:
            lines = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            lines = []
        ours = {c["unix"]: c for c in self.changes}
        lines = [ours.get(line.get("unix"), line) for line in lines]
        atomic_write_text(self.path, "".join(json.dumps(line) + "\n" for line in lines))
        return self.changes


def _lost_times(change: dict, records: list[dict]) -> dict[str, Any]:
    """{restart_s, redo_s, lost_s} of ``change`` from the metrics records written after it
    (``ChangeLog``'s docstring); Nones while the run has not come back to the step it had reached."""
    after = [r for r in records if (r.get("time") or 0) > change["unix"]]
    reached, t_reached = change["reached_step"], change["reached_time"]
    if not after or reached is None or t_reached is None:
        return {}
    back = next((r for r in after if r["step"] >= reached), None)
    if back is None:
        return {}
    step_s = statistics.median(r["step_time_s"] for r in after if r.get("step_time_s") is not None)
    first = after[0]
    return {"restart_s": first["time"] - change["unix"], "redo_s": back["time"] - first["time"],
            "lost_s": back["time"] - t_reached - (back["step"] - reached) * step_s}
