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


def test_loss_figure_shows_statistical_goodput_beside_throughput():
    """A 2-rank run's records with the in-run B_simple: goodput = tokens/s x (B_noise + B0)/(B_noise + B),
    B the global batch 16, B0 one rank's 8; a record without B_simple (the first steps) has none."""
    m = pl.DataFrame({"step": [1, 2, 3], "loss": [9.0, 8.0, 7.0], "tokens_per_s": [90.0, 100.0, 110.0],
                      "b_simple": [None, 8.0, 24.0], "global_batch_size": [16] * 3, "world_size": [2] * 3})
    good = _trace(plots.loss_figure(m), "statistical goodput (tokens/s x E(B))")
    assert list(good.x) == [2, 3] and good.yaxis == "y2"
    assert list(good.y) == pytest.approx([100.0 * 16 / 24, 110.0 * 32 / 40])
    one = m.with_columns(world_size=pl.lit(1))  # one process: B0 = B, goodput = throughput
    assert plots.goodput_tokens_per_s(one)["goodput"].to_list() == pytest.approx([100.0, 110.0])
    assert plots.goodput_tokens_per_s(m.drop("b_simple")) is None


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
    live = plots.LivePlot(plots.loss_figure, min_interval=0)
    live([{"step": 0, "loss": 5.0}])
    live([{"step": 0, "loss": 5.0}, {"step": 1, "loss": 4.0}])
    assert [c[0] for c in calls] == ["display", "update"]
    first, between = calls[0][1], calls[1][1]
    # the first frame is drawn by the front end's plotly renderer too (no setup call needed) ...
    assert first["application/vnd.plotly.v1+json"]["data"][0]["y"] == [5.0]
    # ... the frames between are HTML only (redrawn on update), and no frame carries plotly.js
    assert "application/vnd.plotly.v1+json" not in between and "Plotly.react" in between["text/html"]
    assert not any("plotly.js v" in c[1]["text/html"] for c in calls)
    calls.clear()
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
    monkeypatch.setattr(plots.LivePlot, "page_has_plotly", False)
    with pl.Config():  # restores polars' table settings afterwards
        plots.setup_notebook_plotting(table_rows=25)
        assert pl.Config.state()["POLARS_FMT_MAX_ROWS"] == "25"  # tables up to 25 rows shown whole
    assert pio.renderers.default == "plotly_mimetype+labkit_notebook"
    # plotly.js is on the page now: a live figure's first frame draws with it (HTML only), its last
    # carries the plotly mimetype still (a saved notebook renders it untrusted)
    calls = []
    monkeypatch.setattr(IPython.display, "display", lambda b, **kw: calls.append(b))
    monkeypatch.setattr(IPython.display, "update_display", lambda b, **kw: calls.append(b))
    live = plots.LivePlot(plots.loss_figure, min_interval=0)
    live([{"step": 0, "loss": 5.0}])
    live.flush()
    assert "application/vnd.plotly.v1+json" not in calls[0] and "Plotly.react" in calls[0]["text/html"]
    assert "application/vnd.plotly.v1+json" in calls[-1]
    html = pio.renderers["labkit_notebook"].to_mimebundle({"data": [], "layout": {}})["text/html"]
    assert "mathjax" not in html.lower() and "<script src" not in html  # nothing fetched from a CDN


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


def _all_figures() -> dict:
    """One figure from every labkit figure function, on small tables like those labkit writes."""
    import numpy as np

    from labkit.model import model_config
    from labkit.study import laws, plan, scaling

    eff = scaling.efficiency_table(compute_s=0.2, grad_bytes=4e8, tokens_per_step=1000)
    p = plan.memory_plan(model_config("bert-120m", 30522), seq_len=512, micro_batch=32)
    n, d = np.repeat([1e4, 1e5], 3), np.tile([1e4, 1e5, 1e6], 2)
    return {
        "loss": plots.loss_figure(pl.DataFrame({"step": [1, 2, 3], "loss": [7.0, 6.0, 5.5],
                                                "tokens_per_s": [320.0, 2210.0, 4090.0]})),
        "throughput": plots.throughput_figure(pl.DataFrame({"ranks": [1, 2], "tokens_per_s": [100.0, 180.0]})),
        "microbatch": plots.microbatch_figure(pl.DataFrame({"model": ["a", "b"], "params": [1, 2],
                                                            "max_micro_batch": [8, 4], "budget_bytes": [2**30] * 2})),
        "drops": plots.drop_reasons_figure({"input": 10, "kept": 7, "dropped": {"empty": 1, "exact": 2}}),
        "topology": plots.topology_figure(pl.DataFrame({"engine_id": [0, 1], "node": ["n0", "n0"],
                                                        "RANK": ["0", "1"], "LOCAL_RANK": ["0", "1"]})),
        "efficiency": plots.efficiency_figure(eff, measured=pl.DataFrame({"ranks": [1, 2], "efficiency": [1.0, 0.9]})),
        "loader": plots.loader_figure(pl.DataFrame({"num_workers": [0, 1, 2], "samples_per_s": [10.0, 30.0, 31.0],
                                                    "data_wait_fraction": [0.012, 0.008, 0.004],
                                                    "knee": [False, True, False]})),
        "law": plots.law_figure(pl.DataFrame({"n_params": n, "n_tokens": d, "loss": laws.CHINCHILLA.loss(n, d)}),
                                laws.CHINCHILLA,
                                frontier=pl.DataFrame([laws.compute_optimal(c) for c in (1e10, 1e11)])),
        "memory": plots.memory_figure(pl.DataFrame([p | {"label": "120m"}]), capacity_bytes=94e9),
        "staging": plots.staging_figure({"n0": {"bytes": 1e6, "seconds": 0.1, "mb_per_s": 10.0}}),
        "parallel": plots.parallel_figure(pl.DataFrame({
            "dp": [2, 1], "tp": [1, 1], "pp": [1, 2], "pp_schedule": [None, "1f1b"], "tokens_per_s": [100.0, 90.0],
            "pipeline_bubble": [None, 0.25], "planned_bubble": [0.0, 0.2], "measured_total_bytes": [2**21, 2**20],
            "planned_total_bytes": [2**21, 2**20]})),
        **_rank_figures(),
    }


def _rank_figures() -> dict:
    """labkit.rankview's figures on a closed-form timeline of 3 ranks, one slow on its data."""
    from labkit import rankview
    from timeline_sim import simulate

    rows = simulate(12, data=[0.002, 0.002, 0.3], compute=[0.05] * 3, hosts=["n1", "n1", "n2"])
    return {"rank_heatmap": rankview.rank_heatmap_figure(rows), "rank_breakdown": rankview.rank_breakdown_figure(rows),
            "goodput": rankview.goodput_figure(rows), "rank_view": rankview.rank_view_figure(rows)}


def _colour(fig, i, trace) -> str:
    for attr in ("line", "marker"):
        c = getattr(getattr(trace, attr, None), "color", None)
        if isinstance(c, str):
            return c.lower()
    colorway = fig.layout.colorway or fig.layout.template.layout.colorway
    return colorway[i % len(colorway)].lower()  # plotly's default: the i-th colour of the colorway


def test_every_figure_draws_visible_reference_lines_and_distinct_series_colours():
    figs = _all_figures()
    shapes = 0
    for name, fig in figs.items():
        defaults = fig.layout.template.layout.shapedefaults
        for shape in fig.layout.shapes:
            width = shape.line.width if shape.line.width is not None else defaults.line.width
            opacity = shape.opacity if shape.opacity is not None else defaults.opacity
            assert width and width > 0 and (opacity is None or opacity > 0), (name, shape)
            shapes += 1
        shown = [(t.name, _colour(fig, i, t)) for i, t in enumerate(fig.data) if t.showlegend is not False]
        if name != "topology":  # one bar per engine, deliberately one colour and no legend
            assert len({c for _, c in shown}) == len(shown), (name, shown)
    assert shapes == 3  # the 90 % line, the loader knee, the capacity line
    assert len(figs["memory"].data) == 7


def test_round_ticks_and_distinct_percent_labels():
    assert plots.log_ticks(7_000, 160_000) == [10_000, 20_000, 50_000, 100_000]
    assert [plots.nice_step(s) for s in (4090, 1.0, 0.012, 7)] == [1000, 0.2, 0.005, 2]
    tps = plots.loss_figure(pl.DataFrame({"step": [1, 2], "loss": [7.0, 6.0], "tokens_per_s": [320.0, 4090.0]}))
    assert (tps.layout.yaxis2.tick0, tps.layout.yaxis2.dtick) == (0, 1000)
    ax = plots.round_axis([0.012, 0.004], percent=True)
    labels = [f"{k * ax['dtick']:{ax['tickformat']}}" for k in range(4)]
    assert labels == ["0.0%", "0.5%", "1.0%", "1.5%"]  # not 0 %, 0 %, 1 %, 1 %


def test_throughput_figure_flags_rows_measured_on_a_busy_machine():
    df = pl.DataFrame({"ranks": [1, 2], "tokens_per_s": [100.0, 110.0], "busy": [False, True],
                       "load_avg_1m": [0.3, 3.5], "cpu_count": [2, 2]})
    fig = plots.throughput_figure(df)
    busy = _trace(fig, "busy machine (load >= CPUs)")
    assert list(busy.x) == [2] and list(busy.y) == [110.0] and list(busy.customdata[0]) == [3.5, 2]
    assert [t.name for t in plots.throughput_figure(df.with_columns(busy=pl.lit(False))).data] == ["ideal", "measured"]


def test_every_sweep_figure_flags_points_measured_on_a_busy_machine():
    """Notebook 06's parallel figure (throughput panel), the loader figure and the efficiency
    figure's measured points cross the rows measured at a load of at least the CPUs, hovering
    the load, the CPUs, when they were measured and whether they were reused."""
    load = {"busy": [False, True], "load_avg_1m": [0.4, 6.0], "cpu_count": [2, 2],
            "measured_at": ["2026-12-01T17:00:00+00:00", "2026-12-01T17:01:00+00:00"], "reused": [False, True]}
    par = pl.DataFrame({"dp": [2, 1], "tp": [1, 1], "pp": [1, 2], "pp_schedule": [None, "1f1b"],
                        "tokens_per_s": [100.0, 180.0], "pipeline_bubble": [None, 0.2], "planned_bubble": [0.0, 0.2],
                        "measured_total_bytes": [2**20, 2**20], "planned_total_bytes": [2**20, 2**20], **load})
    busy = _trace(plots.parallel_figure(par), "busy machine (load >= CPUs)")
    assert list(busy.x) == ["dp 1 x tp 1 x pp 2 1f1b"] and list(busy.y) == [180.0]
    assert list(busy.customdata[0]) == [6.0, 2, "2026-12-01T17:01:00+00:00", " (reused from an earlier sweep)"]
    assert busy.xaxis == "x"  # on the throughput panel
    loader = pl.DataFrame({"num_workers": [0, 1], "samples_per_s": [50.0, 90.0], "data_wait_fraction": [0.4, 0.1],
                           **load})
    assert list(_trace(plots.loader_figure(loader), "busy machine (load >= CPUs)").x) == [1]
    measured = pl.DataFrame({"ranks": [1, 2], "efficiency": [1.0, 0.6], **load})
    pred = pl.DataFrame({"n_gpus": [1, 2, 4], "efficiency": [1.0, 0.95, 0.9]})
    eff = _trace(plots.efficiency_figure(pred, measured=measured), "busy machine (load >= CPUs)")
    assert list(eff.x) == [2] and list(eff.y) == [0.6]
    for fig in (plots.parallel_figure(par.drop(*load)), plots.loader_figure(loader.with_columns(busy=pl.lit(False)))):
        assert "busy machine (load >= CPUs)" not in [t.name for t in fig.data]


def test_parallel_figure_three_panels_measured_beside_planned():
    df = pl.DataFrame({"dp": [2, 1, 1], "tp": [1, 2, 1], "pp": [1, 1, 2], "pp_schedule": [None, None, "gpipe"],
                       "tokens_per_s": [100.0, 80.0, 90.0], "pipeline_bubble": [None, None, 0.25],
                       "planned_bubble": [0.0, 0.0, 0.2], "measured_total_bytes": [2**21, 2**20, 3 * 2**20],
                       "planned_total_bytes": [2**21, 2**20, 3 * 2**20]})
    fig = plots.parallel_figure(df)
    names = [t.name for t in fig.data]
    assert names == ["tokens/s (measured)", "bubble measured", "bubble planned", "memory measured", "memory planned"]
    assert list(fig.data[1].x) == ["dp 1 x tp 1 x pp 2 gpipe"] and list(fig.data[1].y) == [0.25]  # pp > 1 only
    assert list(fig.data[3].y) == [2.0, 1.0, 3.0]  # MiB
    with pytest.raises(ValueError, match="planned_bubble"):
        plots.parallel_figure(df.drop("planned_bubble"))


def test_no_figure_has_a_fixed_width():
    """A fixed width wider than the output area is cut off (notebook 06's 1,250-px figure in a
    1,280-px window); every figure takes its output's width instead."""
    assert {name: fig.layout.width for name, fig in _all_figures().items() if fig.layout.width is not None} == {}


def test_figures_fit_a_1280_px_window_in_chromium(tmp_path):
    """Each figure as a notebook output draws it (plotly.js, its output's width) in a 1,280-px
    Chromium window, inside margins as wide as JupyterLab's side bar and cell prompt: the drawn
    figure, its legend and every tick label stay within the window."""
    from browser import chromium, need_browser

    need_browser()
    import plotly.io as pio

    for name, fig in _all_figures().items():
        body = pio.to_html(fig, include_plotlyjs=True, full_html=False, default_width="100%", default_height=525)
        (tmp_path / f"{name}.html").write_text(
            f"<html><body style='margin:0'><div style='margin-left:150px;margin-right:40px'>{body}</div></body></html>")
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for name in _all_figures():
            page.goto((tmp_path / f"{name}.html").as_uri())
            page.wait_for_selector(".main-svg")
            right = page.evaluate("""() => Math.max(...[...document.querySelectorAll(
                '.main-svg, .legend, g.xtick text, g.ytick text, .gtitle')].map(e => e.getBoundingClientRect().right))""")
            assert right <= 1280 - 40 + 1, (name, right)


def test_live_frames_in_chromium_draw_only_the_newest_and_never_blank(tmp_path):
    """Live frames replacing one another in a notebook output, as JupyterLab does on each
    update_display (the output's HTML replaced, its script run), in Chromium with plotly.js: 30
    frames arriving at once (a page behind the kernel) draw only the newest, once or twice, not
    30 times; once drawn, the figure stays drawn under every later frame (the plot moves into
    the new output) and ends with the last frame's points. In a loaded CI the browser had
    rendered every frame of notebook 03's two live figures, fell a whole run behind and showed
    03's last output after the test's 300 s."""
    import pathlib

    import plotly

    from browser import chromium, need_browser

    need_browser()
    js = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    frames = [plots.live_html(plots.loss_figure(pl.DataFrame({"step": list(range(1, n + 1)),
                                                                "loss": [5.0 / k for k in range(1, n + 1)]})),
                              "live-test-plot") for n in range(1, 31)]
    replace = """html => { const out = document.getElementById('out'); out.innerHTML = html;
        for (const old of out.querySelectorAll('script')) { const s = document.createElement('script');
            s.text = old.text; old.replaceWith(s); } }"""  # what JupyterLab's HTML renderer does
    drawn = "() => { const gd = document.getElementById('live-test-plot'); return gd && gd.data ? gd.data[0].x.length : 0; }"
    with chromium() as browser:
        page = browser.new_page()
        page.set_content("<html><body><div id='out'></div></body></html>")
        page.add_script_tag(path=str(js))
        page.evaluate("""() => { const react = Plotly.react; window.reacts = [];
            Plotly.react = function (gd, data) { window.reacts.push(data[0].x.length); return react.apply(this, arguments); }; }""")
        page.evaluate(f"frames => {{ const replace = {replace}; for (const f of frames) replace(f); }}", frames)
        page.wait_for_function(f"() => ({drawn})() === 30", timeout=20_000)
        reacts = page.evaluate("() => window.reacts")
        assert reacts[-1] == 30 and len(reacts) <= 2, reacts  # the backlog drawn as its newest frame
        for n, frame in enumerate(frames[:10], start=1):  # one at a time now: never blank in between
            page.evaluate(replace, frame)
            assert page.evaluate(drawn) > 0, n
        page.wait_for_function(f"() => ({drawn})() === 10", timeout=20_000)


def test_reference_labels_sit_at_their_value_on_log_and_linear_axes():
    """plotly reads an annotation's position on a log axis as log10 of the value: report 07's
    S_min label at y = 60 put the axis's top at 1e60. Each label sits at its line: log10 of the
    value on a log axis, the value on a linear one."""
    import math

    pts = pl.DataFrame({"batch": [4, 8, 16, 32], "steps": [120.0, 70.0, 45.0, 33.0]}).with_columns(
        examples=pl.col("batch") * pl.col("steps"))
    fit = {"s_min": 25.0, "e_min": 300.0, "b_crit": 12.0, "target_eval_loss": 3.5, "lr_rule": "sqrt"}
    fig = plots.steps_examples_figure(pts, fit)
    labels = {a.text: a for a in fig.layout.annotations}
    assert labels["S_min"].y == pytest.approx(math.log10(25.0)) and labels["S_min"].xref == "x domain"
    assert labels["E_min"].x == pytest.approx(math.log10(300.0)) and labels["E_min"].yref == "y domain"
    assert fig.layout.title.text == "Steps against examples to held-out loss 3.500 (lr by the sqrt rule)"
    curves = pl.DataFrame({"batch": [4, 4, 8], "examples": [8, 16, 16], "b_simple": [3.0, 30.0, 10.0]})
    noise = plots.noise_scale_figure(curves, b_crit=12.0)
    assert [a.y for a in noise.layout.annotations] == [pytest.approx(math.log10(12.0))]
    eff = plots.efficiency_figure(pl.DataFrame({"n_gpus": [1, 2], "efficiency": [1.0, 0.95]}),
                                  measured=pl.DataFrame({"ranks": [1, 2], "efficiency": [1.0, 1.2]}))
    assert [a.y for a in eff.layout.annotations] == [0.9] and eff.layout.yaxis.range[1] >= 1.2  # a measured 1.2 shows
    branch = pl.DataFrame({"tokens": [1e4, 4e4], "batch": [16, 16], "b_keep_pace": [32.0, 64.0],
                           "b_keep_pace_low": [16.0, 32.0], "b_keep_pace_high": [64.0, 64.0],
                           "b_keep_pace_censored": [False, True], "b_noise": [20.0, 40.0], "b_noise_low": [2.0, 10.0],
                           "b_noise_high": [80.0, 90.0], "b_noise_censored": [False, False], "b_simple": [10.0, 25.0],
                           "b_crit_sweep": [42.0, 42.0]})
    crit = plots.critical_batch_figure(branch)  # its B_crit label had gone to 1e42
    assert [a.y for a in crit.layout.annotations] == [pytest.approx(math.log10(42.0))]
    with pytest.raises(ValueError, match="exactly one of x, y"):
        plots.reference_line(fig, text="?")


def test_figures_state_their_settings():
    """The micro-batch figure names its budget and sequence length; the loader figure its
    consumer, the step's own limit, and why there is no knee when there is none."""
    gib = 2**30
    mb = pl.DataFrame({"model": ["mini", "small"], "params": [3_700_000, 20_200_000], "max_micro_batch": [182, 52],
                       "budget_bytes": [2 * gib] * 2, "seq_len": [128, 128]})
    assert plots.microbatch_figure(mb).layout.title.text == \
        "Largest micro-batch that fits in 2 GiB per rank, sequences of 128 tokens"
    loader = pl.DataFrame({"num_workers": [0, 1, 2], "samples_per_s": [604.0, 689.0, 668.0],
                           "data_wait_fraction": [0.065, 0.063, 0.115], "data_wait_s": [0.0017, 0.00145, 0.0027],
                           "knee": [False] * 3, "batch_size": [16] * 3, "step_time_s_planned": [0.02] * 3})
    fig = plots.loader_figure(loader)
    assert fig.layout.title.text.startswith("DataLoader workers in front of a 20 ms step of 16 sequences<br><sup>no knee: "
                                            "the data wait stays at 6%-12% of the step from 0 to 2 workers: making a "
                                            "batch here takes 1.7 ms, taking one from a worker 1.4-2.7 ms")
    assert [a.y for a in fig.layout.annotations] == [800.0]  # the step's limit: 16 sequences / 20 ms
    kneed = plots.loader_figure(loader.with_columns(knee=pl.Series([False, True, False])))
    assert "no knee" not in kneed.layout.title.text and {a.text for a in kneed.layout.annotations} == {
        "the step's limit: 16 / 20 ms", "knee: 1 workers"}
