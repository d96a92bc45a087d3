"""labkit.plots: figure contents computed exactly, and the LivePlot display/update pattern."""

from __future__ import annotations

import IPython.display
import plotly.io as pio
import polars as pl
import pytest

from labkit import plots


def _trace(fig, name):
    (t,) = [t for t in fig.data if t.name == name]
    return t


def test_loss_figure_loss_and_throughput_on_second_axis():
    m = pl.DataFrame({"step": [3, 1, 2], "loss": [7.0, 9.0, None], "tokens_per_s": [110.0, 90.0, 100.0]})
    fig = plots.loss_figure(m.lazy())
    loss, tps = _trace(fig, "loss"), _trace(fig, "tokens/s")
    assert list(loss.x) == [1, 3] and list(loss.y) == [9.0, 7.0]  # sorted by step, null loss skipped
    assert list(tps.x) == [1, 2, 3] and list(tps.y) == [90.0, 100.0, 110.0]
    assert loss.yaxis == "y" and tps.yaxis == "y2"
    assert fig.layout.template.layout.font.family == plots.FONT["family"]
    assert [t.name for t in plots.loss_figure(m.drop("tokens_per_s")).data] == ["loss"]
    with pytest.raises(ValueError, match=r"\['loss'\]"):
        plots.loss_figure(m.drop("loss"))


def test_throughput_figure_ideal_line_and_efficiency():
    df = pl.DataFrame({"ranks": [4, 1, 2, 1], "tokens_per_s": [350.0, 98.0, 190.0, 102.0]})
    fig = plots.throughput_figure(df)
    base = (98.0 + 102.0) / 2  # repeated ranks == 1 runs are averaged
    ideal, meas = _trace(fig, "ideal"), _trace(fig, "measured")
    assert list(ideal.x) == [1, 2, 4] and list(ideal.y) == [base, 2 * base, 4 * base]
    assert list(meas.y) == [base, 190.0, 350.0]
    eff = [base / base, 190.0 / (2 * base), 350.0 / (4 * base)]
    assert list(meas.customdata) == pytest.approx(eff, rel=1e-12)
    assert [a.text for a in fig.layout.annotations] == [f"{e:.0%}" for e in eff]  # 100%, 95%, 88%
    with pytest.raises(ValueError, match="ranks == 1"):
        plots.throughput_figure(df.filter(pl.col("ranks") > 1))


def test_microbatch_figure_orders_models_by_params_one_trace_per_budget():
    gib = 2**30
    df = pl.DataFrame({"model": ["bert-350m", "bert-120m", "bert-350m", "bert-120m"],
                       "params": [335_000_000, 110_000_000, 335_000_000, 110_000_000],
                       "max_micro_batch": [20, 184, 8, 90], "budget_bytes": [94 * gib, 94 * gib, 40 * gib, 40 * gib]})
    fig = plots.microbatch_figure(df)
    assert [t.name for t in fig.data] == ["40 GiB", "94 GiB"]
    assert list(fig.data[1].x) == ["bert-120m", "bert-350m"] and list(fig.data[1].y) == [184, 20]
    assert list(fig.layout.xaxis.categoryarray) == ["bert-120m", "bert-350m"]


def test_liveplot_displays_once_then_updates_same_id(monkeypatch):
    calls = []
    monkeypatch.setattr(IPython.display, "display", lambda b, **kw: calls.append(("display", b, kw)))
    monkeypatch.setattr(IPython.display, "update_display", lambda b, **kw: calls.append(("update", b, kw)))
    live = plots.LivePlot(plots.loss_figure, min_interval=3600)  # every later call is inside the interval
    live([{"step": 0, "loss": 5.0}])
    live([{"step": 0, "loss": 5.0}, {"step": 1, "loss": 4.0}])
    live([{"step": 0, "loss": 5.0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.5, "mfu": None}])
    assert [c[0] for c in calls] == ["display"]  # throttled
    live.flush()
    live.flush()  # nothing new: no redraw
    assert [c[0] for c in calls] == ["display", "update"]
    assert {c[2]["display_id"] for c in calls} == {live.display_id} and all(c[2]["raw"] for c in calls)
    final = calls[-1][1]
    (trace,) = final["application/vnd.plotly.v1+json"]["data"]
    assert pio.from_json(pio.to_json(final["application/vnd.plotly.v1+json"])).data[0].y == (5.0, 4.0, 3.5)
    assert trace["name"] == "loss"
    assert "plotly-graph-div" in final["text/html"] and "plotly.js v" not in final["text/html"]


def test_setup_notebook_plotting_sets_renderer(monkeypatch):
    monkeypatch.setattr(pio.renderers, "default", pio.renderers.default)  # restored afterwards
    plots.setup_notebook_plotting()
    assert pio.renderers.default == "plotly_mimetype+notebook"


def test_topology_figure_one_segment_per_engine_labelled_by_rank():
    from labkit.plots import topology_figure

    df = pl.DataFrame({"engine_id": [3, 0, 1], "node": ["b", "a", "a"], "RANK": ["2", "0", "1"], "LOCAL_RANK": [0, 0, 1]})
    fig = topology_figure(df)
    assert [t.x[0] for t in fig.data] == ["a", "a", "b"]
    assert [t.text[0].split(" (")[0] for t in fig.data] == ["rank 0", "rank 1", "rank 2"]
    with pytest.raises(ValueError, match="RANK"):
        topology_figure(df.drop("RANK"))


def test_staging_figure_rates_per_node():
    from labkit.plots import staging_figure

    fig = staging_figure({"b": {"bytes": 2e6, "seconds": 0.5, "mb_per_s": 4.0, "copied": True},
                          "a": {"bytes": 2e6, "seconds": 1.0, "mb_per_s": 2.0, "copied": False}})
    assert list(fig.data[0].x) == ["a", "b"] and list(fig.data[0].y) == [2.0, 4.0]
    assert "kept" in fig.data[0].text[0]
