"""Figures of the per-rank step timeline (``labkit.train.timeline``): where each rank's seconds go.

- ``rank_heatmap_figure``: ranks x steps, step time and data wait side by side.
- ``rank_breakdown_figure``: a stacked bar per rank of where its seconds went
  (``labkit.train.straggler.rank_breakdown``): its own data wait, forward, backward, optimiser,
  the communication, and what it spent waiting for other ranks.
- ``goodput_figure``: one bar of the run's elapsed time split into goodput and each
  ``badput_*`` cause (``labkit.measure.goodput``).
- ``rank_view_figure``: the three together under the culprit's line
  (``labkit.train.straggler.culprit``); ``RankView`` redraws it live while the engines train
  (``labkit.cluster.run_ddp`` hands it every rank's published rows); ``CulpritLine`` prints the
  culprit's line to stderr whenever it changes (``labkit train``).

In labkit's one style (``labkit.plots.style``); plots.py itself is already past the size of a module.
"""

from __future__ import annotations

import time
from typing import Any
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from labkit.live import LivePlot
from labkit.plots import style
from labkit.measure import BADPUT, goodput
from labkit.train.straggler import BREAKDOWN, culprit, culprit_line, rank_breakdown
from labkit.train.timeline import SCHEMA

__all__ = ["BREAKDOWN_COLORS", "CulpritLine", "GOODPUT_COLOR", "RankView", "goodput_figure", "rank_breakdown_figure",
           "rank_heatmap_figure",
           "rank_view_figure", "timeline_frame"]

BREAKDOWN_COLORS = {"data": "#c00000", "wait": "#bfbfbf", "forward": "#2e75b6", "backward": "#1f4e79",
                    "communication": "#c55a11", "optimizer": "#548235", "other": "#7f7f7f", "eval": "#7030a0",
                    "checkpoint": "#bf9000"}
"""One colour per part of a step (``rank_breakdown_figure``) and per badput cause with the same name."""
GOODPUT_COLOR = "#00a3a3"
"""Goodput's colour (``goodput_figure``), apart from every part and cause."""
_BADPUT_COLORS = {"startup": "#404040", "restart": "#7f6000", "redone": "#ff9999", **BREAKDOWN_COLORS}


def timeline_frame(rows: pl.DataFrame | list[dict]) -> pl.DataFrame:
    """A timeline frame (``labkit.train.timeline.SCHEMA``'s columns and dtypes) from rows as
    published by the ranks (a list of dicts) or a frame. ValueError naming missing columns."""
    if isinstance(rows, list):
        missing = sorted(set(SCHEMA) - set(rows[0])) if rows else []
        if missing:
            raise ValueError(f"not a timeline: missing columns {missing}")
        return pl.from_dicts(rows, schema=SCHEMA) if rows else pl.DataFrame(schema=SCHEMA)
    missing = [c for c in SCHEMA if c not in rows.columns]
    if missing and rows.height:
        raise ValueError(f"not a timeline: missing columns {missing}")
    return rows.select(list(SCHEMA)).cast(SCHEMA) if rows.height else pl.DataFrame(schema=SCHEMA)


def _newest(frame: pl.DataFrame, last_steps: int | None) -> pl.DataFrame:
    """The newest segment's rows, its last ``last_steps`` steps (None: all)."""
    frame = frame.filter(pl.col("segment_start") == pl.col("segment_start").max())
    if last_steps is not None:
        steps = frame["step"].unique().sort()[-last_steps:]
        frame = frame.filter(pl.col("step").is_in(steps.implode()))
    return frame


def _heatmaps(fig: go.Figure, frame: pl.DataFrame, *, row: int = 1) -> None:
    """Step time (col 1) and data wait (col 2) heatmaps, ranks x steps, in ms, into ``fig``."""
    steps = frame["step"].unique().sort().to_list()
    ranks = frame.select("rank", "host").unique("rank").sort("rank")
    labels = [f"{r} ({h})" for r, h in ranks.iter_rows()]
    for col, (name, what) in enumerate((("step_s", "step time"), ("data_s", "data wait")), start=1):
        wide = frame.pivot(on="step", index="rank", values=name, aggregate_function="first").sort("rank")
        wide = ranks.select("rank").join(wide, on="rank", how="left")
        z = [[None if v is None else v * 1e3 for v in r] for r in wide.select([str(s) for s in steps]).rows()]
        fig.add_trace(go.Heatmap(x=steps, y=labels, z=z, colorscale="Blues" if col == 1 else "Reds", zmin=0,
                                 colorbar={"title": {"text": "ms"}, "len": 0.42, "y": 0.79 if row == 1 else 0.5,
                                           "x": 0.45 if col == 1 else 1.0, "thickness": 10},
                                 hovertemplate=f"rank %{{y}}<br>step %{{x}}<br>{what} %{{z:.1f}} ms<extra></extra>",
                                 name=what, showlegend=False), row=row, col=col)  # a colour bar, no legend entry


def rank_heatmap_figure(timeline: pl.DataFrame | list[dict], *, last_steps: int | None = None,
                        title: str = "Step time and data wait, per rank and step") -> go.Figure:
    """Two heatmaps, ranks (rows, "rank (host)") x steps (columns), of the newest run segment:
    each rank's step time and its data wait, in ms. ``last_steps``: only the newest that many."""
    frame = _newest(timeline_frame(timeline), last_steps)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("step time (ms)", "data wait (ms)"), horizontal_spacing=0.12)
    if frame.height:
        _heatmaps(fig, frame)
    fig.update_layout(template=style(), title=title, height=max(320, 120 + 18 * frame["rank"].n_unique()))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(autorange="reversed", type="category")
    return fig


def _breakdown_bars(fig: go.Figure, frame: pl.DataFrame, **where: int) -> None:
    parts = rank_breakdown(frame)
    hosts = dict(frame.select("rank", "host").unique("rank").iter_rows())
    x = [f"rank {r} ({hosts[r]})" for r in parts["rank"].to_list()]
    for part in BREAKDOWN:
        y = [v * 1e3 for v in parts[f"{part}_s"].fill_null(0.0).to_list()]
        if any(v > 0 for v in y):
            fig.add_trace(go.Bar(x=x, y=y, name=part, marker_color=BREAKDOWN_COLORS[part], legendgroup=part,
                                 hovertemplate=f"%{{x}}<br>{part} %{{y:.1f}} ms a step<extra></extra>"), **where)


def rank_breakdown_figure(timeline: pl.DataFrame | list[dict], *, last_steps: int | None = None,
                          title: str = "Where each rank's seconds went (mean ms a step)") -> go.Figure:
    """A stacked bar per rank of the newest segment: mean ms a step of each part in
    ``labkit.train.straggler.BREAKDOWN`` (its own data wait, forward, backward, optimiser; the
    communication; "wait", the time it waited for other ranks)."""
    frame = _newest(timeline_frame(timeline), last_steps)
    fig = go.Figure()
    _breakdown_bars(fig, frame)
    fig.update_layout(template=style(), title=title, barmode="stack", yaxis_title="ms a step", xaxis_type="category")
    return fig


def _goodput_bars(fig: go.Figure, g: dict, *, beside_breakdown: bool = False, **where: int) -> None:
    """One 100 % bar of goodput and the badput causes; ``beside_breakdown``: a cause that is also
    a part of the breakdown bars joins that part's legend entry (same colour, same meaning)."""
    parts = [("goodput", g["goodput"], GOODPUT_COLOR)] + [(c, g[f"badput_{c}"], _BADPUT_COLORS[c]) for c in BADPUT]
    for name, share, color in parts:
        if share > 0:
            label = name if name == "goodput" else f"badput: {name}"
            shared = beside_breakdown and name in BREAKDOWN_COLORS
            fig.add_trace(go.Bar(x=[100 * share], y=["run"], orientation="h", name=label, marker_color=color,
                                 legendgroup=name if shared else f"badput-{name}", showlegend=not shared,
                                 text=[f"{100 * share:.0f}%" if share >= 0.05 else ""], textposition="inside",
                                 hovertemplate=f"{label} %{{x:.1f}} % of {g['goodput_elapsed_s']:.0f} s"
                                               "<extra></extra>"),
                          **where)


def goodput_figure(timeline_or_goodput: pl.DataFrame | list[dict] | dict, *,
                   title: str = "Goodput: the run's elapsed time by what it was spent on") -> go.Figure:
    """One horizontal bar, 100 % of the run's elapsed time: goodput and each ``badput_*`` cause
    (``labkit.measure.goodput``). Takes a timeline (rows or frame) or goodput's dict (a
    result.json holds its keys)."""
    g = timeline_or_goodput if isinstance(timeline_or_goodput, dict) else goodput(timeline_frame(timeline_or_goodput))
    fig = go.Figure()
    _goodput_bars(fig, g)
    fig.update_layout(template=style(), title=title, barmode="stack",
                      xaxis={"title": "% of elapsed", "range": [0, 100]},
                      height=260, hovermode="closest")
    return fig


def rank_view_figure(timeline: pl.DataFrame | list[dict], *, last_steps: int | None = 100,
                     window: int = 20) -> go.Figure:
    """The live rank view: the culprit's line (``culprit`` over the last ``window`` steps) as
    the title; step time and data wait heatmaps (ranks x the last ``last_steps`` steps); where
    each rank's seconds went over those steps; the run's goodput so far."""
    full = timeline_frame(timeline)
    frame = _newest(full, last_steps)
    found = culprit(frame, window=window) if frame.height else None
    fig = make_subplots(rows=3, cols=2, specs=[[{}, {}], [{"colspan": 2}, None], [{"colspan": 2}, None]],
                        row_heights=[0.45, 0.35, 0.2], vertical_spacing=0.09, horizontal_spacing=0.12,
                        subplot_titles=("step time (ms), ranks x steps", "data wait (ms), ranks x steps",
                                        "where each rank's seconds went (ms a step)", "goodput so far (% of elapsed)"))
    if frame.height:
        _heatmaps(fig, frame)
        _breakdown_bars(fig, frame, row=2, col=1)
        _goodput_bars(fig, goodput(full), beside_breakdown=True, row=3, col=1)
    n_ranks = frame["rank"].n_unique() if frame.height else 1
    fig.update_layout(template=style(), barmode="stack", height=max(760, 560 + 14 * n_ranks), hovermode="closest",
                      title={"text": _wrap(culprit_line(found)), "font": {"size": 14}},
                      margin={"l": 60, "r": 30, "t": 110, "b": 50})
    fig.update_yaxes(autorange="reversed", type="category", row=1)
    fig.update_xaxes(type="category", row=2, col=1)
    fig.update_xaxes(range=[0, 100], row=3, col=1)
    fig.update_yaxes(showticklabels=False, row=3, col=1)
    return fig


def _wrap(text: str, width: int = 100) -> str:
    """``text`` broken into lines of at most about ``width`` characters with <br> (plotly titles do not wrap)."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "<br>".join([*lines, line])


class RankView(LivePlot):
    """``rank_view_figure`` redrawn in place while the engines train (``LivePlot``): give it to
    ``labkit.cluster.run_ddp`` / ``train_on_cluster`` as ``live``. ``wants = "timeline"``:
    run_ddp calls it with the rows every rank publishes (``labkit.train.timeline.Timeline``'s
    ``publish``), not rank 0's metric records. ``latencies``: for each draw, seconds from the
    newest row's ``t_end`` (its rank recorded it) to the figure's display."""

    wants = "timeline"

    def __init__(self, *, last_steps: int | None = 100, window: int = 20, min_interval: float = 1.0,
                 height: int | None = None) -> None:
        super().__init__(lambda frame: rank_view_figure(frame, last_steps=last_steps, window=window),
                         min_interval=min_interval, height=height or 760)
        self.latencies: list[float] = []

    def frame(self, records: list[dict]) -> pl.DataFrame:  # noqa: D102 (LivePlot's; the timeline's schema)
        return timeline_frame(records)

    def _draw(self, *, final: bool) -> None:
        super()._draw(final=final)
        newest = max((r.get("t_end") or 0.0 for r in self._records or []), default=0.0)
        if newest:
            self.latencies.append(time.time() - newest)


class CulpritLine:
    """A ``live`` for the command line: every rank's timeline rows in (``wants = "timeline"``),
    ``culprit_line`` of the last ``window`` steps printed to ``stream`` (default stderr) whenever
    the culprit's rank or cause changes (first line: once a culprit is named, or once there are
    ``window`` steps without one). ``lines`` keeps what it printed."""

    wants = "timeline"

    def __init__(self, *, window: int = 20, stream: Any = None) -> None:
        self.window, self.stream, self.lines = window, stream, []
        self._said: tuple | None = None

    def __call__(self, rows: list[dict]) -> None:
        import sys

        frame = timeline_frame(rows)
        found = culprit(frame, window=self.window)
        newest = _newest(frame, None)
        if found is None and newest["step"].n_unique() < self.window:
            return  # not enough steps yet to say "none"
        said = (found["rank"], found["cause"]) if found else None
        if said != self._said or not self.lines:
            self.lines.append(culprit_line(found))
            print(f"labkit: {self.lines[-1]}", file=self.stream or sys.stderr, flush=True)
            self._said = said
