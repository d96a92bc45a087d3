"""labkit.rankview: the figures' contents computed exactly from a closed-form timeline
(tests/timeline_sim.py), the live RankView's display pattern, and the CLI's culprit line. The
same figures in Chromium at 1,280 px: tests/test_plots.py; live through run_ddp:
tests/cluster/test_engines.py."""

from __future__ import annotations

import io

import IPython.display
import polars as pl
import pytest

from labkit import measure, rankview
from labkit.train.straggler import culprit, culprit_line, rank_breakdown
from labkit.train.timeline import SCHEMA
from timeline_sim import simulate

ROWS = simulate(12, data=[0.002, 0.002, 0.3], compute=[0.05, 0.05, 0.05], hosts=["n1", "n1", "n2"])


def test_heatmaps_hold_each_ranks_step_time_and_data_wait_in_ms():
    fig = rankview.rank_heatmap_figure(ROWS, last_steps=5)
    step, wait = fig.data
    assert list(step.x) == list(range(8, 13)) and list(step.y) == ["0 (n1)", "1 (n1)", "2 (n2)"]
    by = {(r["rank"], r["step"]): r for r in ROWS}
    assert step.z[2][0] == pytest.approx(by[(2, 8)]["step_s"] * 1e3)
    assert wait.z[2][4] == pytest.approx(300.0) and wait.z[0][4] == pytest.approx(2.0)


def test_breakdown_bars_are_rank_breakdown_in_ms():
    fig = rankview.rank_breakdown_figure(ROWS)
    parts = rank_breakdown(pl.from_dicts(ROWS, schema=SCHEMA))
    bars = {t.name: t for t in fig.data}
    assert set(bars) <= set(rankview.BREAKDOWN_COLORS) and {"data", "wait", "forward"} <= set(bars)
    assert list(bars["wait"].y) == pytest.approx([v * 1e3 for v in parts["wait_s"]])
    assert bars["data"].y[2] == pytest.approx(300.0)
    assert bars["wait"].y[0] == pytest.approx(300.0)  # ranks 0 and 1 wait for rank 2's data (and two small all-reduces)


def test_goodput_bar_is_the_run_split_by_cause():
    g = measure.goodput(pl.from_dicts(ROWS, schema=SCHEMA))
    for source in (ROWS, g):
        fig = rankview.goodput_figure(source)
        shares = {t.name: t.x[0] for t in fig.data}
        assert shares["goodput"] == pytest.approx(100 * g["goodput"])
        assert shares["badput: data"] == pytest.approx(100 * g["badput_data"])
        assert sum(shares.values()) == pytest.approx(100.0)


def test_rank_view_titles_the_culprit_and_joins_shared_legend_entries():
    fig = rankview.rank_view_figure(ROWS)
    found = culprit(pl.from_dicts(ROWS, schema=SCHEMA))
    assert found["rank"] == 2 and fig.layout.title.text.replace("<br>", " ") == culprit_line(found)
    shown = [t.name for t in fig.data if t.showlegend is not False and t.type == "bar"]
    assert len(shown) == len(set(shown)) and "badput: data" not in shown and "goodput" in shown
    even = simulate(12, data=[0.002] * 2, compute=[0.05] * 2)
    assert rankview.rank_view_figure(even).layout.title.text.startswith("culprit: none")
    with pytest.raises(ValueError, match="missing columns"):
        rankview.rank_view_figure([{"step": 1}])


def test_rank_view_draws_once_then_updates_and_measures_its_latency(monkeypatch):
    calls = []
    monkeypatch.setattr(IPython.display, "display", lambda b, **kw: calls.append("display"))
    monkeypatch.setattr(IPython.display, "update_display", lambda b, **kw: calls.append("update"))
    view = rankview.RankView(min_interval=0)
    assert view.wants == "timeline"
    view(ROWS[:6])
    view(ROWS)
    view.flush()
    assert calls == ["display", "update", "update"] and len(view.latencies) == 3
    assert view.latencies[0] > view.latencies[1] - 1e-3  # the first rows are older than the last


def test_culprit_line_says_it_once_and_again_when_the_culprit_changes():
    out = io.StringIO()
    line = rankview.CulpritLine(window=10, stream=out)
    line(simulate(5, data=[0.002] * 2, compute=[0.05] * 2))
    assert out.getvalue() == ""  # too few steps to say anything
    slow = simulate(12, data=[0.002, 0.3], compute=[0.05] * 2)
    line(slow)
    line(slow)
    even = slow + simulate(12, data=[0.002] * 2, compute=[0.05] * 2, first_step=13, start_delay=0.0,
                           segment_start=slow[-1]["t_end"])
    line(even)
    said = out.getvalue().splitlines()
    assert len(said) == 2 and "culprit: rank 1" in said[0] and "data" in said[0]
    assert said[1] == "labkit: culprit: none (no rank holds the others up)"
