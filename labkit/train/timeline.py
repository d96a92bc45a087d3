"""The per-rank step timeline: where each rank's seconds go, step by step, without a collective.

Every rank keeps its own ``Timeline``. The training step reads a clock at each phase boundary
(``mark``): data wait, the first synchronisation (the masked-token count all-reduce before the
forwards: the wait for the last rank to arrive), forward, backward, the optimiser step, the rest
of the step, evaluation and checkpoint. ``BucketClock``, a ``labkit.train.comm.GradientObserver``
inside the composed comm hook, reads the same clock when each gradient bucket becomes ready on
this rank (``before``: DDP calls its hook the moment a bucket's last gradient is accumulated; FSDP2's
reduce-scatter and a split run's replica all-reduce go through the same observers) and when its
collective completes (``after``). No device sync and no collective: a clock read and a list
append per bucket.

``end`` turns a step into one row (below) and appends it as a JSON line to
``run_dir/timeline/rank-NNNNN.jsonl``, opened per row (nothing to leak; a torn last line after a
crash is skipped by ``read_timeline``), and hands the recent rows to ``publish`` (the engines'
live view: ``labkit.cluster.launch.run_ddp`` passes ipyparallel's ``publish_data``). ``close``
(the end of a run segment) moves the lines into ``rank-NNNNN.parquet`` (rewritten atomically with
the earlier segments' rows, then the lines removed). ``read_timeline(run_dir)`` reads every
rank's Parquet and lines as one polars frame; ``chrome_trace`` exports it as Chrome trace /
Perfetto JSON. The analyses over it: ``labkit.train.straggler`` (the culprit) and
``labkit.measure.goodput``.

A row (one rank, one step; seconds unless said; docs/measurement.md "Per-rank step timeline"):
``step``, ``rank``, ``host``, ``world_size``, ``segment_start`` (unix time this run segment's
``train`` began: a restart is a new segment), ``resumed_from`` (the step it resumed at, 0 for a
fresh run), ``t_start``/``t_end`` (unix time at the step's start and at the end of its row: after
its evaluation and checkpoint), ``step_s`` (the synchronised step time of ``measure.StepTimer``),
the phases ``data_s``, ``sync_s`` (blocking small collectives: waiting for the other ranks),
``forward_s``, ``backward_s`` (includes DDP's wait for the gradient collectives at its end),
``optimizer_s`` (unscale, clip, step), ``other_s`` (zero_grad, per-step measures, logging),
``eval_s``, ``checkpoint_s`` (the checkpoint's stall on this rank), ``sync_first_s`` (the first
``sync`` of the step alone), ``sync_end_s`` (seconds from the step's start to the end of that
first sync: the instant all ranks leave it together), ``comm_exposed_s`` (``measure.comm_exposed_s``
of this rank), ``bucket_ready_s`` and ``bucket_done_s`` (list[float]: seconds from the step's start
at which each gradient collective was launched and completed on this rank, in launch order).

On a GPU the phase marks and bucket times are host clock readings (kernel launches, no sync);
``step_s`` alone is synchronised. Forward and backward are sums over the step's micro-batches.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import time
import warnings
from typing import Any, Callable

import polars as pl

from labkit.io import atomic_write, atomic_write_text
from labkit.train.comm import GradientObserver

__all__ = ["PHASES", "BucketClock", "Timeline", "chrome_trace", "read_timeline", "timeline_dir",
           "write_chrome_trace"]

PHASES = ("data", "sync", "forward", "backward", "optimizer", "other", "eval", "checkpoint")
"""The phases a step's seconds are split into, in the order the step runs them."""

SCHEMA: dict[str, Any] = {
    "step": pl.Int64, "rank": pl.Int64, "host": pl.String, "world_size": pl.Int64, "segment_start": pl.Float64,
    "resumed_from": pl.Int64, "t_start": pl.Float64, "t_end": pl.Float64, "step_s": pl.Float64,
    **{f"{p}_s": pl.Float64 for p in PHASES}, "sync_first_s": pl.Float64, "sync_end_s": pl.Float64,
    "comm_exposed_s": pl.Float64, "bucket_ready_s": pl.List(pl.Float64), "bucket_done_s": pl.List(pl.Float64),
}
"""Column -> polars dtype of a timeline frame (``read_timeline``)."""


def timeline_dir(run_dir: str | os.PathLike) -> pathlib.Path:
    """Where a run's per-rank timeline files live: ``run_dir/timeline``."""
    return pathlib.Path(run_dir) / "timeline"


class BucketClock(GradientObserver):
    """A ``GradientObserver`` that reads ``time.perf_counter`` when each gradient collective is
    launched (``before``: the bucket is ready on this rank) and when it completes (``after``).
    ``reset`` (the comm timer calls it before each step) forgets the last step; ``ready`` and
    ``done`` hold the clock readings of this step in call order. Adds nothing to the metrics
    record (``step_fields`` is empty) and runs no collective."""

    def __init__(self) -> None:
        self.ready: list[float] = []
        self.done: list[float] = []

    def before(self, bucket_index: int, local: Any, weights: Any = None) -> None:  # noqa: D102
        self.ready.append(time.perf_counter())

    def after(self, bucket_index: int, reduced: Any, weights: Any = None) -> None:  # noqa: D102
        self.done.append(time.perf_counter())

    def reset(self) -> None:  # noqa: D102
        self.ready, self.done = [], []


class Timeline:
    """This rank's step timeline (module docstring). ``start(step)`` at the step's start,
    ``mark(phase)`` at the end of each phase (the seconds since the previous mark go to
    ``phase``, one of ``PHASES``; repeated phases add up), ``end(step_s=..., comm_exposed_s=...)``
    after the step's evaluation and checkpoint: the row, written and published; ``around(phase,
    fn, ...)`` times a call as ``phase`` (what came before it since the last mark is ``other``).
    ``clock`` is the ``BucketClock``; with ``comm`` (the run's ``labkit.train.comm.CommTimer``) it
    joins that timer's observers, so the comm hook reads it for every gradient collective.
    ``enabled=False``: every call is a no-op (nothing written, nothing observed). ``publish(rows)``:
    called with this rank's last ``history`` rows at most every ``publish_every_s`` seconds and at
    ``close``. ``resumed_from``: the step this segment starts at, ``segment_start`` the unix time
    its ``train`` began (default: now)."""

    def __init__(self, run_dir: str | os.PathLike, *, rank: int, world_size: int, resumed_from: int = 0,
                 segment_start: float | None = None, host: str | None = None, enabled: bool = True,
                 comm: Any = None, publish: Callable[[list[dict]], None] | None = None,
                 publish_every_s: float = 0.5, history: int = 32) -> None:
        self.enabled, self.rank = enabled, rank
        self.path = timeline_dir(run_dir) / f"rank-{rank:05d}.jsonl"
        self.clock = BucketClock()
        if enabled and comm is not None:  # a labkit.train.comm.CommTimer: its hook calls its observers per bucket
            comm.observers.append(self.clock)
        self.publish, self.publish_every_s = publish, publish_every_s
        self.recent: list[dict] = []
        self.history = history
        self._fixed = {"rank": rank, "host": host or socket.gethostname(), "world_size": world_size,
                       "segment_start": segment_start or time.time(), "resumed_from": resumed_from}
        self._published = float("-inf")
        self._step = 0
        self._t0 = self._last = 0.0
        self._wall0 = 0.0
        self._phases: dict[str, float] = {}
        self._sync_first: float | None = None
        self._sync_end: float | None = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def start(self, step: int) -> None:
        """Step ``step`` (1-based, the step it completes) begins now."""
        if not self.enabled:
            return
        self._step = step
        self._wall0 = time.time()
        self._t0 = self._last = time.perf_counter()
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._sync_first = self._sync_end = None
        self.clock.reset()

    def mark(self, phase: str) -> None:
        """The seconds since the previous mark (or ``start``) were spent in ``phase`` (one of
        ``PHASES``; KeyError otherwise). The step's first ``sync`` is also kept alone."""
        if not self.enabled:
            return
        now = time.perf_counter()
        self._phases[phase] += now - self._last
        if phase == "sync" and self._sync_first is None:
            self._sync_first, self._sync_end = now - self._last, now - self._t0
        self._last = now

    def around(self, phase: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, its seconds in ``phase`` (the time since the last mark in
        ``other``); returns what it returns."""
        self.mark("other")
        out = fn(*args, **kwargs)
        self.mark(phase)
        return out

    def end(self, *, step_s: float, comm_exposed_s: float | None = None) -> dict | None:
        """Close the step: its row (module docstring), appended to this rank's file and kept in
        ``recent``; published when ``publish_every_s`` has passed. Returns the row (None when
        disabled). Time since the last mark goes to ``other``."""
        if not self.enabled:
            return None
        self.mark("other")
        t0 = self._t0
        row = {"step": self._step, **self._fixed, "t_start": self._wall0, "t_end": time.time(), "step_s": step_s,
               **{f"{p}_s": v for p, v in self._phases.items()}, "sync_first_s": self._sync_first,
               "sync_end_s": self._sync_end, "comm_exposed_s": comm_exposed_s,
               "bucket_ready_s": [t - t0 for t in self.clock.ready], "bucket_done_s": [t - t0 for t in self.clock.done]}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.recent = [*self.recent[-(self.history - 1):], row]
        if self.publish is not None and time.monotonic() - self._published >= self.publish_every_s:
            self._publish()
        return row

    def _publish(self) -> None:
        self.publish(list(self.recent))
        self._published = time.monotonic()

    def close(self) -> pathlib.Path | None:
        """End of the segment: publish the last rows, then write ``rank-NNNNN.parquet`` (the rows
        of earlier segments and this one's, atomically) and remove the lines file. Returns the
        Parquet path (None when disabled or nothing was recorded)."""
        if not self.enabled:
            return None
        if self.publish is not None and self.recent:
            self._publish()
        if not self.path.exists():
            return None
        parquet = self.path.with_suffix(".parquet")
        frame = _read_rank(parquet, self.path)
        atomic_write(parquet, frame.write_parquet)
        self.path.unlink()
        return parquet


def _read_lines(path: pathlib.Path) -> pl.DataFrame:
    """The rows of one rank's lines file; a torn last line (a crash during its append) is
    skipped with a warning, an unreadable line before it is a ValueError naming file and line."""
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}: line {number} is not a JSON record") from None
            warnings.warn(f"{path}: line {number} is torn (cut off during its append); skipped", stacklevel=3)
    return pl.from_dicts(rows, schema=SCHEMA) if rows else pl.DataFrame(schema=SCHEMA)


def _read_rank(parquet: pathlib.Path, lines: pathlib.Path) -> pl.DataFrame:
    """One rank's rows: its Parquet (earlier segments) and its lines file (the segment running or
    one that ended without ``close``), without duplicates."""
    parts = [pl.read_parquet(parquet).select(list(SCHEMA)).cast(SCHEMA)] if parquet.exists() else []
    if lines.exists():
        parts.append(_read_lines(lines))
    if not parts:
        return pl.DataFrame(schema=SCHEMA)
    return pl.concat(parts).unique(["segment_start", "step", "rank"], keep="last", maintain_order=True)


def read_timeline(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Every rank's timeline rows of a run (``Timeline``'s module docstring), sorted by
    (segment_start, step, rank); an empty frame with the columns of ``SCHEMA`` when the run has
    none. Reads ``run_dir/timeline/rank-*.parquet`` and ``rank-*.jsonl`` (a run still going, or
    one that crashed)."""
    folder = timeline_dir(run_dir)
    ranks = sorted({p.name.split(".")[0] for p in folder.glob("rank-*.*") if p.suffix in (".parquet", ".jsonl")})
    frames = [_read_rank(folder / f"{r}.parquet", folder / f"{r}.jsonl") for r in ranks]
    frames = [f for f in frames if f.height]
    if not frames:
        return pl.DataFrame(schema=SCHEMA)
    return pl.concat(frames).sort("segment_start", "step", "rank")


def chrome_trace(timeline: pl.DataFrame) -> dict[str, Any]:
    """The timeline as a Chrome trace (the Trace Event Format's JSON object form, which Perfetto
    and chrome://tracing open; "Trace Event Format", Google, docs.google.com/document/d/
    1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU): one process per rank ("rank r (host)"), on
    thread 0 the step's phases as complete ("X") events laid end to end from the step's start in
    ``PHASES`` order (with gradient accumulation forward and backward are each one block of
    their summed time), on thread 1 each gradient collective from launch to completion. ``ts``
    and ``dur`` in microseconds from the earliest step start; ``args`` carry the step and
    seconds. ValueError when the frame lacks timeline columns."""
    missing = [c for c in ("step", "rank", "host", "t_start", *(f"{p}_s" for p in PHASES)) if c not in timeline.columns]
    if missing:
        raise ValueError(f"chrome_trace: not a timeline frame, missing columns {missing}")
    events: list[dict[str, Any]] = []
    if timeline.height == 0:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    origin = float(timeline["t_start"].min())
    for rank, host in timeline.select("rank", "host").unique("rank").sort("rank").iter_rows():
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} ({host})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "step phases"}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 1,
                       "args": {"name": "gradient collectives"}})
    for row in timeline.iter_rows(named=True):
        start = (row["t_start"] - origin) * 1e6
        at = start
        for phase in PHASES:
            seconds = row[f"{phase}_s"] or 0.0
            if seconds > 0:
                events.append({"ph": "X", "name": phase, "cat": "phase", "pid": row["rank"], "tid": 0, "ts": at,
                               "dur": seconds * 1e6, "args": {"step": row["step"], "seconds": seconds}})
                at += seconds * 1e6
        for i, (ready, done) in enumerate(zip(row.get("bucket_ready_s") or [], row.get("bucket_done_s") or [])):
            events.append({"ph": "X", "name": f"bucket {i}", "cat": "collective", "pid": row["rank"], "tid": 1,
                           "ts": start + ready * 1e6, "dur": max(0.0, done - ready) * 1e6,
                           "args": {"step": row["step"], "ready_s": ready, "done_s": done}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(run_dir: str | os.PathLike, path: str | os.PathLike | None = None) -> pathlib.Path:
    """Write ``chrome_trace(read_timeline(run_dir))`` to ``path`` (default
    ``run_dir/timeline/trace.json``), atomically. Returns the path; open it in ui.perfetto.dev
    or chrome://tracing. FileNotFoundError when the run has no timeline."""
    frame = read_timeline(run_dir)
    if frame.height == 0:
        raise FileNotFoundError(f"{timeline_dir(run_dir)}: no timeline rows (was the run trained with timeline on?)")
    out = pathlib.Path(path) if path is not None else timeline_dir(run_dir) / "trace.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(out, json.dumps(chrome_trace(frame)))
