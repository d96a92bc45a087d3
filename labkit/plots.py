"""plotly figures for labkit results (the live display of metrics streamed from engines: ``labkit.live``).

One style for every figure lives in `style()` (template, colours, fonts). Figures take polars
frames (the tables labkit writes) and return `plotly.graph_objects.Figure`; nothing is shown.
Notebooks call `setup_notebook_plotting()` once so exported HTML embeds plotly.js offline;
`LivePlot` (``labkit.live``, re-exported here) needs no setup call: its first frame is drawn by the
front end's own plotly renderer.
Patterns: docs/references.md section E (plotly).
"""

from __future__ import annotations

import functools
import json
import math
from typing import Sequence

import plotly.graph_objects as go
import plotly.io as pio
import polars as pl
from plotly.subplots import make_subplots

from labkit.live import LivePlot, live_html  # noqa: F401 (re-exported: notebooks use plots.LivePlot)

__all__ = [
    "COLORS", "COLORWAY", "FONT", "MEMORY_TERMS", "RENDERER", "drop_reasons_figure", "efficiency_figure",
    "figure_bundle", "goodput_tokens_per_s", "integer_axis", "law_figure", "loader_figure", "log_ticks", "loss_figure",
    "memory_figure", "microbatch_figure", "network_figure", "nice_step", "parallel_figure", "preparation_figure",
    "reference_line", "round_axis", "scaling_table",
    "setup_notebook_plotting", "split_label", "staging_figure", "style", "throughput_figure", "topology_figure",
    "busy_marks", "critical_batch_figure", "noise_scale_figure", "steps_examples_figure"
]

COLORS = {"loss": "#1f4e79", "throughput": "#c55a11", "ideal": "#7f7f7f", "bar": "#2e75b6", "busy": "#c00000"}
"""Named colours used across figures (colour-blind safe blue/orange pair, grey reference)."""
COLORWAY = ("#1f4e79", "#c55a11", "#548235", "#7030a0", "#bf9000", "#2e75b6", "#c00000", "#00a3a3")
"""Series colours in order; 8, so the 7 terms of ``memory_figure`` never share one."""
FONT = {"family": "Inter, Helvetica, Arial, sans-serif", "size": 13, "color": "#222222"}
RENDERER = "plotly_mimetype+labkit_notebook"
"""Kernel mimetype for JupyterLab + labkit's variant of plotly's `notebook` renderer, which embeds
plotly.js once so nbconvert's HTML export renders offline (plotly/io/_renderers.py)."""


@functools.cache
def style() -> go.layout.Template:
    """The labkit plotly template: simple_white with the labkit font, colorway and grid."""
    t = go.layout.Template(pio.templates["simple_white"])
    # the legend sits at the bottom of the whole figure (container coordinates), under the x-axis
    # title, and plotly grows the bottom margin for its rows: at JupyterLab's output width (450 px
    # high) a legend placed in plot coordinates (y=-0.18) wrapped onto the axis title
    t.layout.update(font=FONT, colorway=list(COLORWAY), hovermode="x unified",
                    margin={"l": 60, "r": 30, "t": 60, "b": 50},
                    legend={"orientation": "h", "yref": "container", "yanchor": "bottom", "y": 0,
                            "xanchor": "left", "x": 0})
    t.layout.xaxis.update(showgrid=True, gridcolor="#e5e5e5")
    t.layout.yaxis.update(showgrid=True, gridcolor="#e5e5e5")
    # simple_white draws shapes with line width 0 (and 0.3 opacity): reference lines would be invisible
    t.layout.shapedefaults = {"line": {"width": 2, "color": COLORS["ideal"]}, "opacity": 1}
    return t


def nice_step(span: float, target: int = 5) -> float:
    """A round tick step (1, 2 or 5 x 10^k) giving about `target` intervals over `span` (> 0)."""
    if not span > 0 or not math.isfinite(span):
        return 1.0
    raw = span / target
    base = 10 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw)


def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values 1, 2 and 5 x 10^k between `lo` and `hi` (> 0) for a log axis: labels that never
    repeat (plotly labels a log axis's minor ticks by their leading digit only: 2, 3, ... 9, 2, 3)."""
    if not 0 < lo <= hi:
        raise ValueError(f"log_ticks needs 0 < lo <= hi; got {lo}, {hi}")
    return [m * 10.0**k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
            for m in (1, 2, 5) if lo <= m * 10.0**k <= hi]


def round_axis(values: Sequence[float], *, percent: bool = False) -> dict:
    """Axis settings with round ticks from 0: ``{"tickmode": "linear", "tick0": 0, "dtick": step}``
    for the largest of `values` (step from ``nice_step``); with `percent`, a ``tickformat`` with
    just enough decimals that no two tick labels are equal (0.2 %, 0.4 %, ... not 0 %, 0 %)."""
    top = max((v for v in values if v is not None and math.isfinite(v)), default=0.0)
    step = nice_step(top) if top > 0 else (0.2 if percent else 1.0)
    out = {"tickmode": "linear", "tick0": 0, "dtick": step}
    if percent:
        out["tickformat"] = f".{max(0, -math.floor(math.log10(step * 100) + 1e-9))}%"
    return out


def integer_axis(values: Sequence[float]) -> dict:
    """Axis settings for a count (steps, documents, sequences): ticks on whole numbers only, a
    round step of at least 1 (``nice_step`` over the values' span), so a 4-step run is labelled
    1, 2, 3, 4 and not 1, 1.5, 2, ...; ``tickformat="d"``. `values`: what the axis spans (include
    0 for bars, which start there)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    span = (max(finite) - min(finite)) if finite else 0.0
    return {"tickmode": "linear", "tick0": 0, "dtick": max(1, int(nice_step(span))), "tickformat": "d"}


def reference_line(fig: go.Figure, *, x: float | None = None, y: float | None = None, text: str = "",
                   line: dict | None = None, **where) -> go.Figure:
    """A reference line across the plot at data value ``x`` (vertical) or ``y`` (horizontal),
    labelled ``text`` at its end, on linear and log axes alike; returns ``fig``.

    plotly draws a line's shape in data units, but reads an annotation's position on a log axis
    as log10 of the value (plotly.js ``layout.annotations[].x``/``y``), and plotly.py's
    ``add_hline(..., annotation_text=...)`` places the label at the value itself: a label at
    y = 60 on a log axis went to 1e60 and stretched the axis's range with it. Here the label
    goes at log10(value) when the axis is a log axis at the time of the call (set the axis type
    first). ``line``: the shape's line (default dashed grey); ``where``: ``row``/``col`` of a
    subplot and ``secondary_y`` as plotly takes them. Raises ValueError unless exactly one of
    ``x``, ``y`` is given, or for a value <= 0 on a log axis."""
    if (x is None) == (y is None):
        raise ValueError("reference_line: give exactly one of x, y")
    line = line or {"color": COLORS["ideal"], "dash": "dash"}
    horizontal = y is not None
    if horizontal:
        fig.add_hline(y=y, line=line, **where)
    else:
        fig.add_vline(x=x, line=line, **where)
    if not text:
        return fig
    shape = fig.layout.shapes[-1]
    ref = shape.yref if horizontal else shape.xref  # "y", "y2", ... the axis the value is on
    axis = fig.layout[ref.replace("x", "xaxis").replace("y", "yaxis").split(" ")[0]]
    value = y if horizontal else x
    if axis.type == "log":
        if value <= 0:
            raise ValueError(f"reference_line: {value} cannot be drawn on a log axis")
        value = math.log10(value)
    if horizontal:
        fig.add_annotation(x=1, xref=f"{shape.xref.split(' ')[0]} domain", y=value, yref=ref, text=text,
                           showarrow=False, xanchor="right", yanchor="bottom")
    else:
        fig.add_annotation(x=value, xref=ref, y=1, yref=f"{shape.yref.split(' ')[0]} domain", text=text,
                           showarrow=False, xanchor="left", yanchor="top")
    return fig


def _register_offline_renderer() -> None:
    """Register "labkit_notebook": plotly's `notebook` renderer (plotly.js embedded by its
    activate()) whose figure HTML does not load MathJax from a CDN, as plotly's hard-codes
    (include_mathjax="cdn" in plotly/io/_base_renderers.py): a report makes no network request."""
    from plotly.io._base_renderers import NotebookRenderer

    class OfflineNotebookRenderer(NotebookRenderer):
        def to_mimebundle(self, fig_dict):
            html = pio.to_html(fig_dict, config=self.config, include_plotlyjs=False, include_mathjax=False,
                               full_html=False, default_width="100%", default_height=525, validate=False)
            return {"text/html": html}

    if "labkit_notebook" not in pio.renderers:
        pio.renderers["labkit_notebook"] = OfflineNotebookRenderer()


def setup_notebook_plotting(*, table_rows: int = 100) -> None:
    """Make figures render in notebooks and in nbconvert HTML (plotly.js embedded once, offline),
    and show polars tables of up to `table_rows` rows whole (polars cuts at 10 rows with "…").

    Sets pio.renderers.default to RENDERER and activates it now, so plotly.js is emitted even if
    the notebook only draws through `LivePlot` (whose first frame then draws with it:
    ``LivePlot.page_has_plotly``). Only needed for exported HTML: figures and
    `LivePlot` draw in JupyterLab, Notebook 7 and VS Code without it.
    """
    from labkit._nbformat import import_nbformat

    import_nbformat()  # plotly's notebook renderer imports nbformat: here, without 3.7 CPU-s of jsonschema's IRI checker
    _register_offline_renderer()
    pio.renderers.default = RENDERER
    pio.renderers._activate_pending_renderers()  # emits the notebook renderer's plotly.js once
    LivePlot.page_has_plotly = True  # live figures draw their first frame with it too
    pl.Config.set_tbl_rows(table_rows)


def _frame(df: pl.DataFrame | pl.LazyFrame, need: Sequence[str], what: str) -> pl.DataFrame:
    df = df.collect() if isinstance(df, pl.LazyFrame) else df
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"{what} needs columns {missing}; got {df.columns}")
    return df


def loss_figure(metrics: pl.DataFrame | pl.LazyFrame, *, title: str = "Training loss") -> go.Figure:
    """Loss (left axis) and, when a tokens_per_s column is present, throughput (right axis) vs step.

    `metrics`: rows of metrics.jsonl (labkit.train), columns step (int), loss (float)
    [, eval_loss (float, held-out loss; dashed), tokens_per_s (float, real tokens/s over all
    ranks)]. Null values are skipped. With b_simple, global_batch_size and world_size columns too
    (a data-parallel run's in-run noise scale), the statistical goodput beside the throughput
    (``goodput_tokens_per_s``).
    Raises ValueError naming missing columns.
    """
    df = _frame(metrics, ["step", "loss"], "loss_figure").sort("step")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    d = df.drop_nulls("loss")
    fig.add_trace(go.Scatter(x=d["step"].to_list(), y=d["loss"].to_list(), name="loss",
                             mode="lines+markers", line={"color": COLORS["loss"]}), secondary_y=False)
    if "eval_loss" in df.columns:  # held-out loss (labkit.train.evaluation), at the evaluated steps only
        e = df.drop_nulls("eval_loss")
        fig.add_trace(go.Scatter(x=e["step"].to_list(), y=e["eval_loss"].to_list(), name="eval loss (held out)",
                                 mode="lines+markers", line={"color": COLORS["loss"], "dash": "dash"}),
                      secondary_y=False)
    if "tokens_per_s" in df.columns:
        d = df.drop_nulls("tokens_per_s")
        fig.add_trace(go.Scatter(x=d["step"].to_list(), y=d["tokens_per_s"].to_list(), name="tokens/s",
                                 mode="lines", line={"color": COLORS["throughput"], "dash": "dot"}),
                      secondary_y=True)
        good = goodput_tokens_per_s(df)
        if good is not None:
            fig.add_trace(go.Scatter(x=good["step"].to_list(), y=good["goodput"].to_list(),
                                     name="statistical goodput (tokens/s x E(B))", mode="lines",
                                     line={"color": COLORS["throughput"], "dash": "dashdot"}), secondary_y=True)
        fig.update_yaxes(title_text="tokens/s", secondary_y=True, showgrid=False, rangemode="tozero",
                         **round_axis(d["tokens_per_s"].to_list()))
    fig.update_yaxes(title_text="MLM loss", secondary_y=False)
    fig.update_layout(template=style(), title=title, xaxis_title="step")
    fig.update_xaxes(**integer_axis(df["step"].to_list()))
    return fig


def goodput_tokens_per_s(metrics: pl.DataFrame) -> pl.DataFrame | None:
    """Per metrics record: step and goodput = tokens_per_s x E(B) (``labkit.measure.statistical_goodput``),
    B the record's global_batch_size, B_noise its in-run b_simple (``labkit.train.gns``), B0 the global
    batch of one data-parallel rank: global_batch_size / world_size (the noise scale is measured in
    data-parallel runs alone, where every rank is a data-parallel rank; one process: B0 = B and
    goodput = throughput). None without those columns or a record with a positive b_simple."""
    from labkit.measure import statistical_goodput

    need = ("step", "tokens_per_s", "b_simple", "global_batch_size", "world_size")
    if any(c not in metrics.columns for c in need):
        return None
    d = metrics.select(need).drop_nulls().filter(pl.col("b_simple") > 0)
    if not d.height:
        return None
    good = [statistical_goodput(r["tokens_per_s"], r["global_batch_size"], r["b_simple"],
                                r["global_batch_size"] / r["world_size"]) for r in d.iter_rows(named=True)]
    return pl.DataFrame({"step": d["step"], "goodput": good})


def scaling_table(df: pl.DataFrame | pl.LazyFrame) -> pl.DataFrame:
    """Weak-scaling table: columns ranks, tokens_per_s, ideal (= ranks x throughput(1)),
    efficiency (= tokens_per_s / ideal), sorted by ranks; repeated ranks are averaged.

    Definition: docs/measurement.md. Raises ValueError without a ranks == 1 row.
    """
    lf = (df.lazy().group_by("ranks").agg(pl.col("tokens_per_s").mean()).sort("ranks"))
    out = lf.collect()
    base = out.filter(pl.col("ranks") == 1)["tokens_per_s"]
    if base.len() == 0:
        raise ValueError(f"throughput_figure needs a row with ranks == 1; got ranks {out['ranks'].to_list()}")
    return out.with_columns(ideal=pl.col("ranks") * base[0]).with_columns(
        efficiency=pl.col("tokens_per_s") / pl.col("ideal"))


def _one(df: pl.DataFrame, column: str):
    """The single value of ``column`` in ``df`` (None when absent or not single)."""
    if column not in df.columns:
        return None
    values = df[column].drop_nulls().unique().to_list()
    return values[0] if len(values) == 1 else None


def throughput_figure(df: pl.DataFrame | pl.LazyFrame, *, title: str | None = None) -> go.Figure:
    """Measured tokens/s vs ranks, the ideal linear line n x throughput(1), efficiency labels.
    The default title states the model and micro-batch per rank (weak scaling) when ``df``
    holds one of each (model, micro_batch_size columns).

    `df` columns: ranks (int), tokens_per_s (float) [, busy (bool), load_avg_1m, cpu_count:
    ``labkit.lab.sweep_ranks``]. Traces: "ideal", "measured", and when a row was measured on a
    busy machine, "busy machine" crosses on those ranks (their numbers are low by an unknown amount).
    Raises ValueError naming missing columns or a missing ranks == 1 row.
    """
    df = _frame(df, ["ranks", "tokens_per_s"], "throughput_figure")
    t = scaling_table(df)
    x = t["ranks"].to_list()
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=t["ideal"].to_list(), name="ideal", mode="lines",
                             line={"color": COLORS["ideal"], "dash": "dash"}))
    fig.add_trace(go.Scatter(x=x, y=t["tokens_per_s"].to_list(), name="measured", mode="lines+markers",
                             line={"color": COLORS["throughput"]},
                             customdata=t["efficiency"].to_list(),
                             hovertemplate="%{y:.4s} tokens/s<br>efficiency %{customdata:.0%}"))
    for n, y, e in zip(x, t["tokens_per_s"].to_list(), t["efficiency"].to_list()):
        fig.add_annotation(x=n, y=y, text=f"{e:.0%}", showarrow=False, yshift=14,
                           font={"color": COLORS["throughput"]})
    _flag_busy(fig, df, t)
    if title is None:
        model, mb = _one(df, "model"), _one(df, "micro_batch_size")
        title = "Data-parallel scaling" + (f" of {model}" if model else "") + (
            f", micro-batch {mb} per rank (weak scaling)" if mb else "")
    fig.update_layout(template=style(), title=title, xaxis_title="ranks",
                      yaxis_title="tokens/s (all ranks)")
    fig.update_xaxes(tickvals=x)
    return fig


def busy_marks(rows: pl.DataFrame, x: Sequence, y: Sequence) -> go.Scatter | None:
    """Red crosses on the points ``(x[i], y[i])`` of sweep rows ``rows`` (same order) measured on a
    busy machine (``busy`` True: the 1-minute load was at least the usable CPUs,
    ``labkit.study.sweeps.BUSY_LOAD_PER_CPU``), hovering the load, the CPUs and when the point was
    measured (``measured_at``, and "reused" for a row read back from an earlier sweep). None
    when no row is busy or the rows carry no ``busy`` column."""
    if "busy" not in rows.columns or not rows["busy"].fill_null(False).any():
        return None
    pick = [i for i, b in enumerate(rows["busy"].fill_null(False).to_list()) if b]

    def col(name: str) -> list:
        return [rows[name][i] for i in pick] if name in rows.columns else [None] * len(pick)

    reused = [" (reused from an earlier sweep)" if r else "" for r in col("reused")]
    return go.Scatter(x=[x[i] for i in pick], y=[y[i] for i in pick], mode="markers",
                      name="busy machine (load >= CPUs)", showlegend=True,
                      marker={"symbol": "x-thin-open", "size": 16, "line": {"width": 3, "color": COLORS["busy"]},
                              "color": COLORS["busy"]},
                      customdata=list(zip(col("load_avg_1m"), col("cpu_count"), col("measured_at"), reused)),
                      hovertemplate="measured %{customdata[2]}%{customdata[3]} while the 1-min load was "
                                    "%{customdata[0]} on %{customdata[1]} CPUs<extra></extra>")


def _flag_busy(fig: go.Figure, rows: pl.DataFrame, table: pl.DataFrame, *, x: str = "ranks") -> None:
    """Cross the points of `table` whose `x` value has a row in `rows` with busy == True."""
    if "busy" not in rows.columns or not rows["busy"].fill_null(False).any():
        return
    busy = rows.filter(pl.col("busy").fill_null(False))
    load = busy.group_by(x).agg(pl.col("load_avg_1m").max() if "load_avg_1m" in busy.columns else pl.lit(None),
                                pl.col("cpu_count").max() if "cpu_count" in busy.columns else pl.lit(None))
    pts = table.join(load, on=x).sort(x)
    fig.add_trace(go.Scatter(x=pts[x].to_list(), y=pts["tokens_per_s"].to_list(), mode="markers",
                             name="busy machine (load >= CPUs)",
                             marker={"symbol": "x-thin-open", "size": 16, "line": {"width": 3, "color": COLORS["busy"]},
                                     "color": COLORS["busy"]},
                             customdata=pts.select(pts.columns[-2:]).rows(),
                             hovertemplate="measured while the 1-min load was %{customdata[0]} on %{customdata[1]} CPUs"))


def microbatch_figure(df: pl.DataFrame | pl.LazyFrame, *, title: str | None = None) -> go.Figure:
    """Bars: largest micro-batch per model (ordered by parameter count), one bar group per budget.

    `df` columns: model (str), params (int), max_micro_batch (int), budget_bytes (int; shown in
    GiB) [, seq_len]. From labkit.study.memory.max_micro_batch (``labkit.lab.sweep_micro_batch``).
    The default title states the budget per rank (one budget; else the legend does) and the
    sequence length. Raises ValueError naming missing columns.
    """
    d = _frame(df, ["model", "params", "max_micro_batch", "budget_bytes"], "microbatch_figure").sort("params", "budget_bytes")
    order = d.unique("model", keep="first", maintain_order=True)["model"].to_list()
    fig = go.Figure()
    for budget in d["budget_bytes"].unique().sort().to_list():
        part = d.filter(pl.col("budget_bytes") == budget)
        fig.add_trace(go.Bar(x=part["model"].to_list(), y=part["max_micro_batch"].to_list(),
                             name=f"{budget / 2**30:.3g} GiB", text=part["max_micro_batch"].to_list(),
                             textposition="outside", customdata=part["params"].to_list(),
                             hovertemplate="%{x}: %{y} sequences<br>%{customdata:.3s} params"))
    if title is None:
        budget, seq = _one(d, "budget_bytes"), _one(d, "seq_len")
        title = "Largest micro-batch that fits" + (f" in {budget / 2**30:.3g} GiB per rank" if budget else
                                                   " in each memory budget per rank") + (
            f", sequences of {seq} tokens" if seq else "")
    fig.update_layout(template=style(), title=title, barmode="group", xaxis_title="model",
                      yaxis_title="max micro-batch (sequences)", legend_title_text="memory budget")
    fig.update_xaxes(categoryorder="array", categoryarray=order)
    fig.update_yaxes(**integer_axis([0, *d["max_micro_batch"].to_list()]))
    return fig


def figure_bundle(fig: go.Figure) -> dict:
    """Raw display bundle: plotly JSON for JupyterLab plus HTML (without plotly.js) for exports."""
    return {"application/vnd.plotly.v1+json": json.loads(pio.to_json(fig, validate=False)),
            "text/html": pio.to_html(fig, include_plotlyjs=False, full_html=False)}


def drop_reasons_figure(drops: dict, *, title: str = "Documents dropped, by reason") -> go.Figure:
    """Horizontal bars of dropped documents per reason, from a ``.drops.json`` dict
    ({"input": n, "kept": n, "dropped": {reason: n}}); the title gives kept of input."""
    items = sorted(drops["dropped"].items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[n for _, n in items], y=[r for r, _ in items], orientation="h",
                           text=[n for _, n in items], marker={"color": COLORS["loss"]}))
    fig.update_layout(template=style(), title=f"{title} (kept {drops['kept']:,} of {drops['input']:,})",
                      xaxis_title="documents", yaxis_title="reason")
    fig.update_xaxes(**integer_axis([0] + [n for _, n in items]))
    return fig


def topology_figure(ranks: pl.DataFrame | pl.LazyFrame, *, title: str = "Engines by node, with their ranks") -> go.Figure:
    """One bar segment per engine, stacked per node and labelled with its global rank.

    `ranks` columns: engine_id (int), node (str), RANK and LOCAL_RANK (int, or the str values
    of labkit.cluster.assign_ranks).
    Raises ValueError naming missing columns.
    """
    d = (_frame(ranks, ["engine_id", "node", "RANK", "LOCAL_RANK"], "topology_figure")
         .with_columns(pl.col("RANK", "LOCAL_RANK").cast(pl.Int64)).sort("RANK"))  # env values are str
    fig = go.Figure()
    for row in d.iter_rows(named=True):
        fig.add_trace(go.Bar(x=[row["node"]], y=[1], name=f"rank {row['RANK']}",
                             text=[f"rank {row['RANK']} (local {row['LOCAL_RANK']}, engine {row['engine_id']})"],
                             textposition="inside", showlegend=False, marker={"color": COLORS["bar"],
                                                                               "line": {"color": "white", "width": 2}}))
    fig.update_layout(template=style(), title=title, barmode="stack", xaxis_title="node",
                      yaxis_title="engines (one per GPU)", yaxis={"dtick": 1})
    return fig


def efficiency_figure(predicted: pl.DataFrame | pl.LazyFrame, *, measured: pl.DataFrame | None = None,
                      title: str = "Data-parallel efficiency vs GPUs") -> go.Figure:
    """Efficiency (step time(1) / step time(n)) vs GPUs on a log2 axis, one line per ``label``.

    `predicted` columns: n_gpus (int), efficiency (float) [, label (str), comm_hidden (bool)]:
    ``labkit.study.scaling.efficiency_table`` rows, several tables stacked with a label column.
    `measured` (optional) columns ranks, efficiency [, busy, load_avg_1m, cpu_count]
    (``labkit.lab.sweep_ranks``) are drawn as markers, a busy machine's with red crosses
    (``busy_marks``). The 90 % line marks near-linear scaling. The y axis runs from 0 to 1.05, or
    5 % above the largest value when one is higher. Raises ValueError naming missing columns."""
    d = _frame(predicted, ["n_gpus", "efficiency"], "efficiency_figure")
    if "label" not in d.columns:
        d = d.with_columns(label=pl.lit("model"))
    fig = go.Figure()
    for label in d["label"].unique(maintain_order=True).to_list():
        part = d.filter(pl.col("label") == label).sort("n_gpus")
        fig.add_trace(go.Scatter(x=part["n_gpus"].to_list(), y=part["efficiency"].to_list(), name=label,
                                 mode="lines+markers", hovertemplate="%{x} GPUs: %{y:.0%}"))
    if measured is not None:
        m = _frame(measured, ["ranks", "efficiency"], "efficiency_figure (measured)").sort("ranks")
        fig.add_trace(go.Scatter(x=m["ranks"].to_list(), y=m["efficiency"].to_list(), name="measured here",
                                 mode="markers", marker={"size": 11, "symbol": "diamond", "color": "black"}))
        busy = busy_marks(m, m["ranks"].to_list(), m["efficiency"].to_list())
        if busy is not None:
            fig.add_trace(busy)
    reference_line(fig, y=0.9, text="90 %")
    fig.update_layout(template=style(), title=title, xaxis_title="GPUs (data-parallel ranks)",
                      yaxis_title="scaling efficiency", yaxis_tickformat=".0%")
    fig.update_xaxes(type="log", dtick=math.log10(2), tickformat="d")
    ys = [v for tr in fig.data for v in tr.y if v is not None and math.isfinite(v)]
    fig.update_yaxes(range=[0, max([1.05, *(1.05 * v for v in ys)])])  # from 0; above 1 when measured so (a busy 1-rank point)
    return fig


def loader_figure(df: pl.DataFrame | pl.LazyFrame, *, title: str | None = None) -> go.Figure:
    """Samples/s (left axis) and data-wait fraction (right axis) vs DataLoader workers, the knee
    (fewest workers with data wait under 5 %, ``knee``) marked. `df` columns: num_workers,
    samples_per_s, data_wait_fraction [, knee (bool), batch_size and step_time_s_planned (the
    consumer: the step's own limit, batch / step time, is drawn as a dashed line), data_wait_s,
    busy, load_avg_1m, cpu_count: worker counts measured on a busy machine get red crosses,
    ``busy_marks``] (``labkit.lab.sweep_loader_workers``, one batch size and step time). The
    default title states the consumer's step and batch, and a second line says why there is no
    knee when there is none, or that 0 workers already keep the step fed."""
    d = _frame(df, ["num_workers", "samples_per_s", "data_wait_fraction"], "loader_figure").sort("num_workers")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    x = d["num_workers"].to_list()
    fig.add_trace(go.Scatter(x=x, y=d["samples_per_s"].to_list(), name="samples/s", mode="lines+markers",
                             line={"color": COLORS["throughput"]}), secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=d["data_wait_fraction"].to_list(), name="data-wait fraction",
                             mode="lines+markers", line={"color": COLORS["loss"], "dash": "dot"}), secondary_y=True)
    busy = busy_marks(d, x, d["samples_per_s"].to_list())
    if busy is not None:
        fig.add_trace(busy, secondary_y=False)
    batch, step = _one(d, "batch_size"), _one(d, "step_time_s_planned")
    if batch and step:  # no loader makes the consumer faster than its own step
        reference_line(fig, y=batch / step, text=f"the step's limit: {batch} / {step * 1e3:.3g} ms", secondary_y=False)
    knee = d.filter(pl.col("knee"))["num_workers"].to_list() if "knee" in d.columns else []
    if knee:
        reference_line(fig, x=knee[0], text=f"knee: {knee[0]} workers")
    fig.update_yaxes(title_text="samples/s", secondary_y=False, rangemode="tozero")
    fig.update_yaxes(title_text="data-wait fraction", secondary_y=True, rangemode="tozero", showgrid=False,
                     **round_axis(d["data_wait_fraction"].to_list(), percent=True))
    if title is None:
        title = "DataLoader workers" + (f" in front of a {step * 1e3:.3g} ms step" if step is not None else "") + (
            f" of {batch} sequences" if batch else "")
        waits = d["data_wait_fraction"].to_list()
        if not knee:
            why = f"no knee: the data wait stays at {min(waits):.0%}-{max(waits):.0%} of the step from {x[0]} to {x[-1]} workers"
            alone, helped = d.filter(pl.col("num_workers") == 0), d.filter(pl.col("num_workers") > 0)
            if "data_wait_s" in d.columns and alone.height and helped.height:
                why += (f": making a batch here takes {alone['data_wait_s'][0] * 1e3:.2g} ms, taking one from a "
                        f"worker {helped['data_wait_s'].min() * 1e3:.2g}-{helped['data_wait_s'].max() * 1e3:.2g} ms")
            title += f"<br><sup>{why}</sup>"
        elif knee[0] == min(x):
            title += f"<br><sup>{knee[0]} workers already keep the step fed: its data wait is under 5 %</sup>"
    fig.update_layout(template=style(), title=title, xaxis_title="DataLoader workers per rank",
                      margin={"t": 90})
    fig.update_xaxes(tickvals=x)
    return fig


def network_figure(modelled: pl.DataFrame, *, measured: pl.DataFrame | None = None, model: str = "",
                   title: str = "Data-parallel efficiency at 2 ranks against the link") -> go.Figure:
    """Efficiency at 2 ranks against the link time of a step's gradients over the compute time
    (log axis, ticks 1-2-5: above 1 the link cannot keep up, whatever the overlap): the network
    model's line per gradient compression (``modelled``: columns grad_compression,
    link_over_compute, efficiency; ``labkit.study.scaling.link_step_time``), and, when given, the
    points of ``labkit sweep network`` (``measured``: model, grad_compression, bandwidth_ratio,
    efficiency, compute_s, predicted_step_s; ``sweeps/network.parquet``) beside the model at each
    measured link (crosses). ``model`` names the modelled lines. The y axis runs from 0 to 1.1, or
    5 % above the largest value. Raises ValueError naming missing columns."""
    m = _frame(modelled, ["grad_compression", "link_over_compute", "efficiency"], "network_figure")
    fig = go.Figure()
    for (kind,), t in m.group_by("grad_compression", maintain_order=True):
        fig.add_trace(go.Scatter(x=t["link_over_compute"].to_list(), y=t["efficiency"].to_list(), mode="lines",
                                 name=f"{model} model, {kind}".strip()))
    if measured is not None:
        d = _frame(measured, ["model", "grad_compression", "bandwidth_ratio", "efficiency", "compute_s",
                              "predicted_step_s"], "network_figure (measured)")
        for (name, kind), t in d.group_by("model", "grad_compression", maintain_order=True):
            x = (1 / t["bandwidth_ratio"]).to_list()
            fig.add_trace(go.Scatter(x=x, y=t["efficiency"].to_list(), mode="markers", name=f"{name} measured, {kind}"))
            fig.add_trace(go.Scatter(x=x, y=(t["compute_s"] / t["predicted_step_s"]).to_list(), mode="markers",
                                     marker_symbol="x", name=f"{name} model at the measured link, {kind}"))
    xs = [v for tr in fig.data for v in tr.x if v and v > 0]
    fig.update_layout(template=style(), title=title, xaxis_title="link time of a step's gradients / compute time",
                      yaxis_title="efficiency")
    fig.update_xaxes(type="log", tickvals=log_ticks(min(xs), max(xs)) if xs else None, tickformat="~g")
    ys = [v for tr in fig.data for v in tr.y if v is not None and math.isfinite(v)]
    fig.update_yaxes(range=[0, max([1.1, *(1.05 * v for v in ys)])])
    return fig


def law_figure(points: pl.DataFrame | pl.LazyFrame, law, *, frontier: pl.DataFrame | None = None,
               title: str = "Scaling law fit: loss vs training tokens") -> go.Figure:
    """Observed losses vs tokens (one colour per parameter count), the fitted law's curves at
    those sizes, and the compute-optimal frontier when given.

    `points` columns: n_params, n_tokens, loss. `law`: ``labkit.study.laws.LawParams``. `frontier`
    columns: n_tokens, loss (``labkit.study.laws.compute_optimal`` over a range of budgets)."""
    import numpy as np

    d = _frame(points, ["n_params", "n_tokens", "loss"], "law_figure")
    fig = go.Figure()
    t_lo, t_hi = d["n_tokens"].min(), d["n_tokens"].max()
    grid = np.geomspace(t_lo / 1.5, t_hi * 1.5, 60)
    for i, n in enumerate(sorted(d["n_params"].unique().to_list())):
        c = COLORWAY[i % len(COLORWAY)]
        part = d.filter(pl.col("n_params") == n).sort("n_tokens")
        fig.add_trace(go.Scatter(x=part["n_tokens"].to_list(), y=part["loss"].to_list(), mode="markers",
                                 name=f"N = {n:.3g}", marker={"color": c, "size": 9}, legendgroup=str(n)))
        fig.add_trace(go.Scatter(x=grid.tolist(), y=law.loss(n, grid).tolist(), mode="lines", showlegend=False,
                                 line={"color": c}, legendgroup=str(n), hoverinfo="skip"))
    if frontier is not None:
        f = _frame(frontier, ["n_tokens", "loss"], "law_figure (frontier)").sort("n_tokens")
        fig.add_trace(go.Scatter(x=f["n_tokens"].to_list(), y=f["loss"].to_list(), mode="lines",
                                 name="compute-optimal", line={"color": COLORS["ideal"], "dash": "dash", "width": 3}))
    fig.update_layout(template=style(), title=title, xaxis_title="training tokens D", yaxis_title="MLM loss")
    # ticks at 1, 2, 5 x 10^k: plotly's default log ticks label the digits 2..9 of every decade
    fig.update_xaxes(type="log", tickvals=log_ticks(grid[0], grid[-1]), tickformat="~s")
    return fig


MEMORY_TERMS = ("params", "grads", "optimizer", "autocast_copies", "activations", "logits", "head_backward")
"""Terms of ``labkit.study.plan.memory_plan`` drawn by ``memory_figure``, bottom to top."""


def memory_figure(plans: pl.DataFrame | pl.LazyFrame, *, capacity_bytes: float | None = None,
                  title: str = "Planned memory per GPU") -> go.Figure:
    """Stacked bars of the planner's memory terms (GB) per row, labelled by the ``label`` column;
    the device capacity as a dashed line. `plans` columns: label and ``MEMORY_TERMS`` (bytes)."""
    d = _frame(plans, ["label", *MEMORY_TERMS], "memory_figure")
    fig = go.Figure()
    for i, term in enumerate(MEMORY_TERMS):
        fig.add_trace(go.Bar(x=d["label"].to_list(), y=(d[term] / 1e9).to_list(), name=term.replace("_", " "),
                             marker={"color": COLORWAY[i % len(COLORWAY)]},
                             hovertemplate="%{x}<br>" + term + ": %{y:.2f} GB"))
    if capacity_bytes:
        reference_line(fig, y=capacity_bytes / 1e9, line={"color": "black", "dash": "dash"},
                       text=f"capacity {capacity_bytes / 1e9:.0f} GB")
    fig.update_layout(template=style(), title=title, barmode="stack", yaxis_title="GB per GPU")
    return fig


def staging_figure(staged: dict[str, dict], *, title: str = "Staging to node-local disk") -> go.Figure:
    """Bars of staging throughput per node (MB/s, MB = 1e6 bytes), labelled with bytes and
    seconds, from ``labkit.lab.stage`` ({node: {"bytes", "seconds", "mb_per_s", "copied"}}).
    A node that kept a verified copy shows its verification rate."""
    nodes = sorted(staged)
    rates = [staged[n]["mb_per_s"] for n in nodes]
    text = [f"{staged[n]['bytes'] / 1e6:.1f} MB in {staged[n]['seconds']:.2f} s"
            + ("" if staged[n].get("copied", True) else " (kept, verified)") for n in nodes]
    fig = go.Figure(go.Bar(x=nodes, y=rates, text=text, marker={"color": COLORS["bar"]}))
    fig.update_layout(template=style(), title=title, xaxis_title="node", yaxis_title="MB/s (copy + sha256)")
    return fig


def split_label(row: dict) -> str:
    """"dp 1 x tp 2 x pp 1" (with the schedule when pp > 1): a sweep_parallel row's split."""
    sched = f" {row['pp_schedule']}" if row.get("pp") and row["pp"] > 1 and row.get("pp_schedule") else ""
    return f"dp {row['dp']} x tp {row['tp']} x pp {row['pp']}{sched}"


def parallel_figure(df: pl.DataFrame | pl.LazyFrame, *, title: str | None = None) -> go.Figure:
    """Three panels per split of ``labkit.lab.sweep_parallel``: tokens/s (all ranks); the pipeline
    bubble measured beside the planner's (p - 1)/(v·m + p - 1) (splits with pp > 1); the largest
    rank's memory measured beside the planner's (MiB: parameters, gradients, AdamW moments and the
    activations held for backward). Columns: dp, tp, pp, pp_schedule, tokens_per_s, pipeline_bubble,
    planned_bubble, measured_total_bytes, planned_total_bytes [, busy, load_avg_1m, cpu_count,
    measured_at, reused: the splits measured on a busy machine get red crosses on their throughput,
    ``busy_marks``]. Raises ValueError naming missing columns."""
    need = ["dp", "tp", "pp", "pp_schedule", "tokens_per_s", "pipeline_bubble", "planned_bubble",
            "measured_total_bytes", "planned_total_bytes"]
    d = _frame(df, need, "parallel_figure")
    labels = [split_label(r) for r in d.iter_rows(named=True)]
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09,
                        subplot_titles=("throughput", "pipeline bubble", "memory of the largest rank"))
    fig.add_trace(go.Bar(x=labels, y=d["tokens_per_s"].to_list(), name="tokens/s (measured)",
                         marker={"color": COLORS["throughput"]}, hovertemplate="%{x}: %{y:.4s} tokens/s"), row=1, col=1)
    busy = busy_marks(d, labels, d["tokens_per_s"].to_list())  # a busy machine's throughput is low by an unknown amount
    if busy is not None:
        fig.add_trace(busy, row=1, col=1)
    piped = [i for i, p in enumerate(d["pp"].to_list()) if p > 1]
    for col, colour, name in (("pipeline_bubble", COLORS["bar"], "bubble measured"),
                              ("planned_bubble", COLORS["ideal"], "bubble planned")):
        fig.add_trace(go.Bar(x=[labels[i] for i in piped], y=[d[col][i] for i in piped], name=name,
                             marker={"color": colour}, hovertemplate="%{x}: %{y:.1%}"), row=1, col=2)
    for col, colour, name in (("measured_total_bytes", COLORS["loss"], "memory measured"),
                              ("planned_total_bytes", COLORWAY[3], "memory planned")):
        fig.add_trace(go.Bar(x=labels, y=(d[col] / 2**20).to_list(), name=name, marker={"color": colour},
                             hovertemplate="%{x}: %{y:.1f} MiB"), row=1, col=3)
    fig.update_yaxes(title_text="tokens/s (all ranks)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="idle share of the schedule", tickformat=".0%", rangemode="tozero", row=1, col=2)
    fig.update_yaxes(title_text="MiB per rank", rangemode="tozero", row=1, col=3)
    fig.update_xaxes(tickangle=-30)
    # no fixed width: the figure takes its output's width (a 1,250-px figure was cut off in a
    # 1,280-px window, where JupyterLab's output area is narrower; tests/test_plots.py draws it)
    if title is None:
        model, batch, m = _one(d, "model"), _one(d, "global_batch_size"), _one(d, "micro_batches")
        title = "Data, tensor and pipeline parallelism" + (f" of {model}" if model else "") + (
            f": global batch {batch} sequences" if batch else "") + (f", {m} micro-batches per step" if m else "")
    fig.update_layout(template=style(), title=title, barmode="group", height=480,
                      margin={"l": 70, "r": 30, "t": 80, "b": 140})
    return fig


def preparation_figure(report: dict, *, title: str | None = None) -> go.Figure:
    """Lesson 1 for the data actually used: bytes of the input files read per source kind, of
    the document dataset (corpus Parquet) and of the training data (shards), on a log axis, each
    bar labelled with its size and document count; the title gives the ratio training data /
    document dataset. `report`: ``labkit.lab.preparation_report`` (its sources, dataset_bytes,
    training_data_bytes, documents_kept, tokens)."""
    rows = [(f"{kind} files read", v["raw_bytes"], f"{v['files_read']:,} files, {v['documents']:,} documents")
            for kind, v in report["sources"].items()]
    rows += [("document dataset", report["dataset_bytes"], f"{report['documents_kept']:,} documents kept"),
             ("training data", report["training_data_bytes"], f"{report['tokens']:,} tokens")]
    ratio = report["training_data_bytes"] / report["dataset_bytes"] if report["dataset_bytes"] else float("nan")
    fig = go.Figure(go.Bar(x=[b / 1e6 for _, b, _ in rows], y=[r for r, _, _ in rows], orientation="h",
                           text=[f"{b / 1e6:,.1f} MB: {t}" for _, b, t in rows], textposition="auto",
                           marker={"color": [COLORS["bar"]] * (len(rows) - 2) + [COLORS["loss"], COLORS["throughput"]]}))
    fig.update_layout(template=style(), xaxis_title="MB (1e6 bytes, log scale)", yaxis={"autorange": "reversed"},
                      title=title or f"Training data is {ratio:.2g}x the document dataset "
                                     f"({', '.join(report['sources'])})")
    sizes = [b / 1e6 for _, b, _ in rows if b > 0]
    if sizes:  # 1, 2, 5 x 10^k (powers of 10 over more than 3 decades): plotly labels a log axis's
        lo, hi = min(sizes) / 2, max(sizes) * 2  # minor ticks 5, 6, ... 9, 1 otherwise
        ticks = [v for v in log_ticks(lo, hi) if hi / lo <= 1e3 or abs(math.log10(v) - round(math.log10(v))) < 1e-9]
        fig.update_xaxes(tickvals=ticks, tickformat=",~g")
    fig.update_xaxes(type="log")
    return fig


def steps_examples_figure(points: pl.DataFrame | pl.LazyFrame, fit: dict, *, title: str | None = None) -> go.Figure:
    """S against E (log-log) per global batch, with the fitted (S/S_min − 1)(E/E_min − 1) = 1
    (``labkit.study.critical_batch.hyperbola``) and dashed lines at S_min and E_min.

    `points`: columns batch, steps, examples (rows that reached the target); `fit`: s_min,
    e_min, b_crit (``fit_critical_batch``) [, target_eval_loss, lr_rule: ``sweep_batch``'s, stated
    in the default title]. Raises ValueError naming missing columns."""
    from labkit.study.critical_batch import hyperbola

    df = _frame(points, ["batch", "steps", "examples"], "steps_examples_figure").drop_nulls("steps").sort("batch")
    fig = go.Figure()
    batches = df["batch"].to_list()
    hs, he = hyperbola(fit["s_min"], fit["e_min"], batches=(min(batches) / 2, max(batches) * 2))
    fig.add_trace(go.Scatter(x=he.tolist(), y=hs.tolist(), mode="lines", name=f"fit: B_crit = {fit['b_crit']:.1f}",
                             line={"color": COLORS["ideal"]}))
    fig.add_trace(go.Scatter(x=df["examples"].to_list(), y=df["steps"].to_list(), mode="markers+text",
                             text=[f"B={b}" for b in df["batch"].to_list()], textposition="top right",
                             name="measured", marker={"color": COLORS["loss"], "size": 9}))
    if title is None:
        target, rule = fit.get("target_eval_loss"), fit.get("lr_rule")
        title = "Steps against examples to " + (f"held-out loss {target:.3f}" if target is not None else
                                                  "the target held-out loss") + (
            f" (lr by the {rule} rule)" if rule else "")
    fig.update_layout(template=style(), title=title, xaxis_title="examples E (sequences)", yaxis_title="steps S")
    xs = he.tolist() + df["examples"].to_list() + [fit["e_min"]]
    ys = hs.tolist() + df["steps"].to_list() + [fit["s_min"]]
    fig.update_xaxes(type="log", tickvals=log_ticks(min(xs), max(xs)), tickformat="~s")
    fig.update_yaxes(type="log", tickvals=log_ticks(min(ys), max(ys)), tickformat="~s")
    reference_line(fig, y=fit["s_min"], text="S_min")  # after the axis types: labels at log10 of the value
    reference_line(fig, x=fit["e_min"], text="E_min")
    return fig


def noise_scale_figure(curves: pl.DataFrame | pl.LazyFrame, *, b_crit: float | None = None,
                       title: str = "Gradient noise scale B_simple along training") -> go.Figure:
    """In-run B_simple (labkit.train.gns) against examples seen, one line per global batch, with
    the measured critical batch as a dashed line. `curves`: columns batch, examples, b_simple
    (nulls skipped). Raises ValueError naming missing columns."""
    df = _frame(curves, ["batch", "examples", "b_simple"], "noise_scale_figure").drop_nulls("b_simple")
    fig = go.Figure()
    for (batch,), part in sorted(df.group_by("batch"), key=lambda kv: kv[0][0]):
        part = part.sort("examples")
        fig.add_trace(go.Scatter(x=part["examples"].to_list(), y=part["b_simple"].to_list(), mode="lines",
                                 name=f"B = {batch}"))
    fig.update_layout(template=style(), title=title, xaxis_title="examples seen (sequences)",
                      yaxis_title="B_simple (sequences)")
    ys = [v for v in df["b_simple"].to_list() if v > 0] + ([b_crit] if b_crit else [])
    if ys:
        fig.update_yaxes(type="log", tickvals=log_ticks(min(ys), max(ys)), tickformat="~s")
    if b_crit is not None and b_crit > 0:  # after the axis type: the label at log10 of the value
        reference_line(fig, y=b_crit, line={"color": "black", "dash": "dash"}, text="measured B_crit")
    return fig


def critical_batch_figure(points: pl.DataFrame | pl.LazyFrame, *,
                          title: str = "The critical batch along training, by branching") -> go.Figure:
    """Per branch point (``labkit.study.branching.sweep_branch``'s table) against the tokens the run
    had seen: the local critical batch (the largest batch keeping pace) and the noise scale the
    branches imply, each with its bootstrap range as error bars (an open marker where censored: at
    least), the run's in-run B_simple, the run's own batch (dotted) and the batch sweep's B_crit
    (dashed, when the table has it). Log y. Raises ValueError naming missing columns."""
    need = ["tokens", "batch", "b_keep_pace", "b_keep_pace_low", "b_keep_pace_high", "b_keep_pace_censored",
            "b_noise", "b_noise_low", "b_noise_high", "b_noise_censored", "b_simple"]
    df = _frame(points, need, "critical_batch_figure").sort("tokens")
    fig = go.Figure()
    for key, name, color in (("b_keep_pace", "keeps pace (local critical batch)", COLORS["loss"]),
                             ("b_noise", "B_noise implied by the branches", COLORS["throughput"])):
        d = df.drop_nulls(key)
        fig.add_trace(go.Scatter(
            x=d["tokens"].to_list(), y=d[key].to_list(), name=name, mode="lines+markers",
            line={"color": color}, marker={"symbol": ["circle-open" if c else "circle" for c in d[f"{key}_censored"]],
                                           "size": 9},
            error_y={"type": "data", "symmetric": False, "array": (d[f"{key}_high"] - d[key]).to_list(),
                     "arrayminus": (d[key] - d[f"{key}_low"]).to_list()}))
    d = df.drop_nulls("b_simple")
    fig.add_trace(go.Scatter(x=d["tokens"].to_list(), y=d["b_simple"].to_list(), name="in-run B_simple",
                             mode="markers", marker={"color": COLORWAY[2], "symbol": "diamond", "size": 9}))
    fig.add_trace(go.Scatter(x=df["tokens"].to_list(), y=df["batch"].to_list(), name="the run's batch", mode="lines",
                             line={"color": COLORS["ideal"], "dash": "dot"}))
    crit = df["b_crit_sweep"].drop_nulls() if "b_crit_sweep" in df.columns else pl.Series([])
    ys = [v for c in ("b_keep_pace_low", "b_keep_pace_high", "b_noise_low", "b_noise_high", "b_simple", "batch")
          for v in df[c].to_list() if v is not None and v > 0] + [v for v in crit.to_list() if v > 0]
    fig.update_layout(template=style(), title=title, xaxis_title="tokens seen by the run",
                      yaxis_title="global batch (sequences)")
    if ys:
        fig.update_yaxes(type="log", tickvals=log_ticks(min(ys), max(ys)), tickformat="~s")
    if crit.len() and crit[0] > 0:  # after the axis type: the label at log10 of the value
        reference_line(fig, y=crit[0], line={"color": "black", "dash": "dash"}, text="B_crit of the batch sweep")
    return fig
