"""The culprit named: which rank holds the others up, and why (data, compute or network).

Under DDP every rank's step takes as long as the slowest one's: the collectives wait for the
last rank, so a slow rank's victims show the same step time, and the same long backward, as the
slow rank itself (traceml-ai/traceml#252: a rank with +200 ms of backward showed as "compute
bound" on every rank). The per-rank timeline (``labkit.train.timeline``) holds what tells them
apart: each rank's own clock readings at the points where all ranks meet. Nothing here compares
clocks across machines; every comparison is between durations measured from an instant the
ranks share: the end of a blocking collective, which all ranks leave together.

Per step, three gates (``step_verdicts``), each naming the rank the others waited for there and
for how long ("held up"):

- **arrival** (data or compute): the first synchronisation of the step (the masked-token count
  all-reduce) is left by every rank at once, so the rank that arrived last waited least in it
  (``sync_first_s``). It held the others up by the median of their waits minus its own. Cause
  data when its data wait exceeds the others' median by at least half of that, else compute
  (its host work since the previous step: the optimiser step, logging, evaluation).
- **gradients ready** (compute): from the end of that synchronisation, the time until this
  rank's last gradient bucket was ready (``bucket_ready_s``) is its own forward and backward
  compute. The rank with the latest one held the others' gradient collectives up by its lead
  over the others' median.
- **collective done** (network): all buckets ready, the collectives still take ``tail`` =
  (the latest completion) - (the latest ready time). When that is most of the step (``net``:
  half of it; gloo's CPU-bound all-reduce of a small model takes up to 0.5 of the step on an
  even run) and one rank's collectives complete last by a margin (``min_skew`` of the tail, at
  least ``min_skew_s``), its incoming transfers are the slow part: a rank whose incoming link is
  slow receives its data last in gloo's ring and completes last (measured on network hosts:
  tests/cluster/test_stragglers.py; a link slow both ways between two hosts slows two ranks'
  incoming data alike, and neither is named). It held the others up by the tail.

The step's verdict is the gate with the largest hold-up, when that is at least ``rel`` of the
step time (and ``min_s``). The run's culprit (``culprit``) is the (rank, cause) that held the
others up for most of the seconds lost that way over the recent steps, when that is a real cost;
None otherwise (on an even run the verdicts scatter: no one is named).
"""

from __future__ import annotations

import statistics
from typing import Any

import polars as pl

__all__ = ["CAUSES", "culprit", "culprit_line", "rank_breakdown", "step_verdicts"]

CAUSES = ("data", "compute", "network")
"""What can hold the other ranks up."""

BREAKDOWN = ("data", "wait", "forward", "backward", "communication", "optimizer", "other", "eval", "checkpoint")
"""``rank_breakdown``'s parts of a step, in order."""


def _median_others(values: list[float], i: int) -> float:
    return statistics.median(v for j, v in enumerate(values) if j != i)


def _gates(rows: list[dict], *, net: float, min_skew: float, min_skew_s: float) -> list[tuple[str, int, float, str]]:
    """[(gate, index of the late rank in rows, held-up seconds, cause)] of one step's rows."""
    out = []
    waits = [r["sync_first_s"] for r in rows]
    if all(w is not None for w in waits):
        last = min(range(len(rows)), key=lambda i: waits[i])
        held = _median_others(waits, last) - waits[last]
        data_excess = rows[last]["data_s"] - _median_others([r["data_s"] for r in rows], last)
        out.append(("arrival", last, held, "data" if data_excess >= 0.5 * held else "compute"))
    if all(r["bucket_ready_s"] and r["bucket_done_s"] and r["sync_end_s"] is not None for r in rows):
        ready = [max(r["bucket_ready_s"]) - r["sync_end_s"] for r in rows]
        done = [max(r["bucket_done_s"]) - r["sync_end_s"] for r in rows]
        late = max(range(len(rows)), key=lambda i: ready[i])
        out.append(("ready", late, ready[late] - _median_others(ready, late), "compute"))
        tail = max(done) - max(ready)
        last = max(range(len(rows)), key=lambda i: done[i])
        skew = done[last] - _median_others(done, last)
        if tail >= net * statistics.median(r["step_s"] for r in rows) and skew >= max(min_skew * tail, min_skew_s):
            out.append(("done", last, tail, "network"))
    return out


def step_verdicts(timeline: pl.DataFrame, *, rel: float = 0.2, min_s: float = 0.002, net: float = 0.5,
                  min_skew: float = 0.03, min_skew_s: float = 0.002) -> pl.DataFrame:
    """One row per (segment_start, step) with at least two ranks: ``rank`` and ``host`` of the
    rank that held the others up (null when none did by at least ``rel`` x the median step time
    and ``min_s`` seconds), ``cause`` (``CAUSES``), ``gate`` ("arrival", "ready", "done"; module
    docstring), ``held_s`` (seconds the others waited for it), ``step_s`` (median over ranks)
    and ``ranks`` (how many). ``timeline``: ``labkit.train.timeline.read_timeline``'s frame."""
    schema = {"segment_start": pl.Float64, "step": pl.Int64, "rank": pl.Int64, "host": pl.String, "cause": pl.String,
              "gate": pl.String, "held_s": pl.Float64, "step_s": pl.Float64, "ranks": pl.Int64}
    out = []
    for (segment, step), group in timeline.sort("rank").group_by(["segment_start", "step"], maintain_order=True):
        rows = group.to_dicts()
        if len(rows) < 2:
            continue
        step_s = statistics.median(r["step_s"] for r in rows)
        gates = _gates(rows, net=net, min_skew=min_skew, min_skew_s=min_skew_s)
        gate, i, held, cause = max(gates, key=lambda g: g[2]) if gates else (None, 0, 0.0, None)
        named = gate is not None and held >= max(rel * step_s, min_s)
        out.append({"segment_start": segment, "step": step, "rank": rows[i]["rank"] if named else None,
                    "host": rows[i]["host"] if named else None, "cause": cause if named else None,
                    "gate": gate if named else None, "held_s": held if named else 0.0, "step_s": step_s,
                    "ranks": len(rows)})
    return pl.from_dicts(out, schema=schema) if out else pl.DataFrame(schema=schema)


def culprit(timeline: pl.DataFrame, *, window: int = 20, skip: int = 2, cost: float = 0.1, share: float = 0.5,
            min_steps: int = 3, min_window: int = 8, **thresholds: float) -> dict[str, Any] | None:
    """The rank that holds the others up over the last ``window`` steps of the newest run
    segment (after its first ``skip`` steps: warm-up), or None.

    Each step's verdict (``step_verdicts``, which ``thresholds`` go to) names a (rank, cause)
    and the seconds the others waited for it. Over the window, the (rank, cause) with the most
    such seconds is the culprit when they are at least ``cost`` of the window's step time, at
    least ``share`` of all the seconds any rank held the others up (one rank dominates: on an
    even run the verdicts scatter over ranks), and it was named in at least ``min_steps`` steps
    (not one odd pause). Time, not a count of steps: a reader that stalls every third step
    for a whole second is a culprit. Fewer than ``min_window`` steps to look at: None (too few
    to tell a culprit from a loaded machine's noise).

    Returns {"rank", "host", "cause" (``CAUSES``), "held_s" (seconds a step the others waited
    for it, averaged over the window), "fraction" (held_s / the window's mean step time),
    "steps" (how many steps named it), "of" (steps looked at), "first_step", "last_step",
    "waiting" (the other ranks), "line" (``culprit_line``)}."""
    if timeline.height == 0:
        return None
    newest = timeline.filter(pl.col("segment_start") == pl.col("segment_start").max())
    first = newest["step"].min() + skip
    steps = sorted(s for s in newest["step"].unique().to_list() if s >= first)[-window:]
    if len(steps) < min_window:
        return None
    verdicts = step_verdicts(newest.filter(pl.col("step").is_in(steps)), **thresholds)
    named = verdicts.drop_nulls("rank")
    if named.height == 0:
        return None
    totals = named.group_by("rank", "cause").agg(pl.col("held_s").sum(), pl.len().alias("steps"),
                                                 pl.col("host").first())
    top = totals.sort("held_s", "rank", descending=[True, False]).row(0, named=True)
    total_step_s = float(verdicts["step_s"].sum())
    if (top["held_s"] < cost * total_step_s or top["held_s"] < share * float(named["held_s"].sum())
            or top["steps"] < min_steps):
        return None
    ranks = sorted(newest["rank"].unique().to_list())
    found = {"rank": top["rank"], "host": top["host"], "cause": top["cause"], "held_s": top["held_s"] / verdicts.height,
             "fraction": top["held_s"] / total_step_s if total_step_s > 0 else None, "steps": top["steps"],
             "of": verdicts.height, "first_step": int(verdicts["step"].min()), "last_step": int(verdicts["step"].max()),
             "waiting": [r for r in ranks if r != top["rank"]]}
    return found | {"line": culprit_line(found)}


_WHY = {"data": "its data wait: it reaches the step's first collective last",
        "compute": "its compute: its gradients are ready last",
        "network": "the network: its gradient collectives end last while its gradients are ready on time"}


def _runs(ranks: list[int]) -> str:
    """Ranks with runs of three or more consecutive numbers shortened: "0, 2, 3" but "0-40, 42-63"
    (a line that stays short at 64 ranks)."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)) for run in runs)


def culprit_line(found: dict[str, Any] | None) -> str:
    """One line for the CLI and the notebook: who holds the others up, by how much, why and who
    waits ("culprit: none" for None)."""
    if found is None:
        return "culprit: none (no rank holds the others up)"
    waiting = _runs(found["waiting"])
    share = f" ({100 * found['fraction']:.0f} % of the step)" if found.get("fraction") is not None else ""
    return (f"culprit: rank {found['rank']} ({found['host']}) holds the others up by {found['held_s'] * 1e3:.0f} ms "
            f"a step{share} (named in {found['steps']} of steps {found['first_step']}-{found['last_step']}): "
            f"{found['cause']} ({_WHY[found['cause']]}); "
            + (f"ranks {waiting} wait for it" if len(found["waiting"]) > 1 else f"rank {waiting} waits for it"))


def rank_breakdown(timeline: pl.DataFrame) -> pl.DataFrame:
    """Where each rank's seconds went: one row per rank, the mean seconds per step of each part
    in ``BREAKDOWN`` (columns "<part>_s") and ``step_s``. ``backward`` is the rank's own backward
    (its backward less its exposed communication); ``communication`` is the exposed
    communication up to the step's collective tail (the latest completion less the latest ready
    time over the ranks, when bucket times exist); what it waited beyond that, and in the step's
    blocking small collectives (``sync_s``), is ``wait``: waiting for other ranks."""
    if timeline.height == 0:
        return pl.DataFrame(schema={"rank": pl.Int64, **{f"{p}_s": pl.Float64 for p in BREAKDOWN},
                                    "step_s": pl.Float64})
    exposed = pl.col("comm_exposed_s").fill_null(0.0)
    tail = pl.when(pl.col("sync_end_s").is_not_null() & (pl.col("bucket_ready_s").list.len() > 0)).then(
        (pl.col("bucket_done_s").list.max() - pl.col("sync_end_s")).max().over("segment_start", "step")
        - (pl.col("bucket_ready_s").list.max() - pl.col("sync_end_s")).max().over("segment_start", "step"))
    comm = pl.min_horizontal(exposed, tail.clip(lower_bound=0.0)).fill_null(exposed)
    parts = timeline.with_columns(communication_s=comm).with_columns(
        wait_s=pl.col("sync_s") + exposed - pl.col("communication_s"),
        backward_s=(pl.col("backward_s") - exposed).clip(lower_bound=0.0))
    means = [pl.col(f"{p}_s").mean() for p in BREAKDOWN]
    return parts.group_by("rank").agg(*means, pl.col("step_s").mean()).sort("rank")
