"""The scaling figures of labkit/plots.py: what each draws, from the tables labkit writes."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from labkit import plots

from labkit.study import laws, plan, scaling
from labkit.model import model_config


def test_efficiency_figure_draws_each_label_and_the_measured_points():
    a = scaling.efficiency_table(compute_s=0.2, grad_bytes=4e8, tokens_per_step=1000).with_columns(label=pl.lit("a"))
    b = scaling.efficiency_table(compute_s=0.2, grad_bytes=4e8, tokens_per_step=1000,
                                 network="IB-NDR").with_columns(label=pl.lit("b"))
    measured = pl.DataFrame({"ranks": [1, 2], "efficiency": [1.0, 0.8]})
    fig = plots.efficiency_figure(pl.concat([a, b]), measured=measured)
    assert [t.name for t in fig.data] == ["a", "b", "measured here"]
    assert list(fig.data[0].y) == a["efficiency"].to_list() and list(fig.data[2].y) == [1.0, 0.8]
    assert fig.layout.xaxis.type == "log"
    with pytest.raises(ValueError, match="efficiency"):
        plots.efficiency_figure(pl.DataFrame({"n_gpus": [1]}))


def test_loader_figure_marks_the_knee():
    df = pl.DataFrame({"num_workers": [0, 1, 2], "samples_per_s": [10.0, 30.0, 31.0],
                       "data_wait_fraction": [0.6, 0.03, 0.01], "knee": [False, True, False]})
    fig = plots.loader_figure(df)
    assert [t.name for t in fig.data] == ["samples/s", "data-wait fraction"]
    assert any("knee: 1 workers" in (a.text or "") for a in fig.layout.annotations)


def test_law_figure_curves_follow_the_law():
    n = np.repeat([1e4, 1e5], 3)
    d = np.tile([1e4, 1e5, 1e6], 2)
    pts = pl.DataFrame({"n_params": n, "n_tokens": d, "loss": laws.CHINCHILLA.loss(n, d)})
    frontier = pl.DataFrame([laws.compute_optimal(c) for c in (1e10, 1e11, 1e12)])
    fig = plots.law_figure(pts, laws.CHINCHILLA, frontier=frontier)
    assert len(fig.data) == 2 * 2 + 1 and fig.data[-1].name == "compute-optimal"
    curve = fig.data[1]
    assert list(curve.y) == pytest.approx(laws.CHINCHILLA.loss(1e4, np.array(curve.x)).tolist())


def test_memory_figure_stacks_the_planner_terms():
    p = plan.memory_plan(model_config("bert-120m", 30522), seq_len=512, micro_batch=32)
    fig = plots.memory_figure(pl.DataFrame([p | {"label": "120m"}]), capacity_bytes=94e9)
    assert len(fig.data) == len(plots.MEMORY_TERMS)
    assert sum(t.y[0] for t in fig.data) == pytest.approx(p["total"] / 1e9)
