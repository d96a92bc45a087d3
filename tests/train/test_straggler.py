"""labkit.train.straggler on timelines in closed form (tests/timeline_sim.py: what DDP's
collectives make each rank record); the same analysis on real slowed ranks across network hosts
is tests/cluster/test_stragglers.py."""

from __future__ import annotations

import polars as pl
import pytest

from labkit.train.straggler import culprit, culprit_line, rank_breakdown, step_verdicts
from labkit.train.timeline import SCHEMA
from timeline_sim import simulate


def frame(rows: list[dict]) -> pl.DataFrame:
    return pl.from_dicts(rows, schema=SCHEMA)


def test_a_compute_straggler_is_named_though_every_backward_is_equally_long():
    """traceml#252: rank 1 computes 200 ms longer; DDP's all-reduce makes every rank's backward
    (and step) equally long, yet rank 1 alone is named, for compute, the others as waiting."""
    tl = frame(simulate(20, data=[0.002] * 4, compute=[0.05, 0.25, 0.05, 0.05], jitter=0.05))
    last = tl.filter(pl.col("step") == 10)
    assert max(last["step_s"]) - min(last["step_s"]) < 1e-9
    assert max(last["backward_s"] + last["forward_s"]) - min(last["backward_s"] + last["forward_s"]) < 1e-9
    found = culprit(tl)
    assert (found["rank"], found["cause"], found["waiting"]) == (1, "compute", [0, 2, 3])
    assert found["held_s"] == pytest.approx(0.2, rel=0.15) and found["steps"] == 18 and found["of"] == 18
    assert "rank 1 (h1)" in found["line"] and "compute" in found["line"] and "0, 2, 3 wait" in found["line"]


def test_a_data_straggler_is_named_by_the_wait_it_causes_at_the_first_collective():
    tl = frame(simulate(20, data=[0.002, 0.002, 0.3, 0.002], compute=[0.05] * 4, jitter=0.05))
    found = culprit(tl)
    assert (found["rank"], found["cause"]) == (2, "data")
    assert found["held_s"] == pytest.approx(0.298, rel=0.1)
    verdicts = step_verdicts(tl)
    assert set(verdicts["gate"].to_list()) == {"arrival"}


def test_a_rank_behind_a_slow_link_is_named_for_the_network():
    """All gradients ready together; the collectives take 0.8 s and rank 3's end 60 ms after the
    others' (its incoming data comes last)."""
    tl = frame(simulate(20, data=[0.002] * 4, compute=[0.05] * 4, tail=0.8, late_done=(3, 0.06), jitter=0.05))
    found = culprit(tl)
    assert (found["rank"], found["cause"]) == (3, "network")
    assert found["fraction"] > 0.8


def test_an_even_run_names_no_one_and_says_so():
    tl = frame(simulate(200, data=[0.002] * 4, compute=[0.05] * 4, tail=0.02, jitter=0.3, seed=3))
    assert culprit(tl, window=200) is None
    for end in range(22, 201, 7):  # nor any 20-step window of it, as the live view sees it
        assert culprit(tl.filter(pl.col("step") <= end)) is None
    assert culprit_line(None) == "culprit: none (no rank holds the others up)"


def test_a_fast_link_is_not_a_culprit_however_consistent_the_order():
    """A collective tail of a fifth of the step (gloo's CPU-bound all-reduce) with rank 3 always
    last is the run's communication, not a slow link."""
    tl = frame(simulate(20, data=[0.002] * 4, compute=[0.1] * 4, tail=0.03, late_done=(3, 0.003)))
    assert culprit(tl) is None


def test_culprit_looks_at_the_newest_segment_and_skips_its_warm_up():
    old = simulate(10, data=[0.002, 0.3], compute=[0.05, 0.05], segment_start=1000.0)
    new = simulate(10, data=[0.002, 0.002], compute=[0.05, 0.05], segment_start=2000.0, first_step=6,
                   resumed_from=5)
    assert culprit(frame(old))["rank"] == 1
    assert culprit(frame(old + new)) is None
    slow_start = simulate(2, data=[0.5, 0.002], compute=[0.05] * 2) + simulate(
        10, data=[0.002] * 2, compute=[0.05] * 2, first_step=3)
    assert culprit(frame(slow_start)) is None  # steps 1-2 are warm-up
    assert culprit(frame(slow_start), skip=0) is None  # two slow steps are a pause, not a culprit
    assert culprit(frame(slow_start), skip=0, min_steps=2)["rank"] == 0
    short = frame(simulate(9, data=[0.002, 0.3], compute=[0.05] * 2))
    assert culprit(short) is None  # 7 steps after the warm-up: too few to tell
    assert culprit(short, min_window=7)["line"].endswith("rank 0 waits for it")


def test_rank_breakdown_splits_the_victims_wait_from_the_communication():
    """Compute straggler: the victims' exposed communication is mostly waiting for rank 1; each
    rank's parts add up to its step."""
    tl = frame(simulate(5, data=[0.002] * 3, compute=[0.05, 0.25, 0.05], tail=0.01))
    parts = rank_breakdown(tl)
    by_rank = {r["rank"]: r for r in parts.to_dicts()}
    assert by_rank[1]["wait_s"] < 0.01 and by_rank[0]["wait_s"] == pytest.approx(0.2, abs=0.01)
    assert by_rank[0]["communication_s"] == pytest.approx(0.01, abs=1e-6)
    for r in by_rank.values():
        total = sum(r[f"{p}_s"] for p in ("data", "wait", "forward", "backward", "communication", "optimizer", "other"))
        assert total == pytest.approx(r["step_s"] + 0.002, abs=1e-6)  # + other, outside the step time


def test_one_rank_or_no_bucket_times_is_no_verdict():
    """One rank: nothing to compare. Without bucket times (no gradient collective observed) a
    compute straggler is invisible: the loss all-reduce after the backward lines every rank up
    again before the next step's first collective."""
    one = frame(simulate(5, data=[0.002], compute=[0.05]))
    assert step_verdicts(one).height == 0 and culprit(one) is None
    no_buckets = frame(simulate(5, data=[0.002, 0.002], compute=[0.05, 0.3])).with_columns(
        bucket_ready_s=pl.lit([], dtype=pl.List(pl.Float64)), bucket_done_s=pl.lit([], dtype=pl.List(pl.Float64)))
    assert step_verdicts(no_buckets)["gate"].drop_nulls().to_list() == []
