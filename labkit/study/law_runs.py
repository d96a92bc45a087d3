"""The tiny runs behind notebook 05's real scaling-law fit: one single-process run per width,
each evaluating the held-out loss a few times; every evaluation is one (N, D, loss) point for
``labkit.study.laws.fit_law`` (N: non-embedding parameters, Kaplan et al. 2020's convention,
arXiv:2001.08361; D: tokens seen).

Each width is a sweep point (``labkit.study.points``): its curve is read back from
``<workdir>/sweeps/law_curves.parquet`` only when it was made with the same run settings
(``loss_settings``: model, widths, steps, batch, learning rate, evaluation) from the same shard
set; otherwise the run is trained again. ``labkit demo`` measures them as a stage and notebook
05 reads them back through the same check.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from labkit.config import TrainConfig
from labkit.data import made_by
from labkit.data.shards import read_index
from labkit.model import count_parameters, model_config
from labkit.study.points import loss_settings, reused_note, train_points

__all__ = ["law_config", "sweep_law_runs"]


def law_config(workdir: str, width: int, *, steps: int, micro_batch: int, points: int) -> TrainConfig:
    """The run of ``width`` (hidden size; FFN 4 x width, 2 heads, the ``tiny`` preset's 2 layers)
    on ``<workdir>/shards``: ``steps`` optimiser steps of ``micro_batch`` sequences at a constant
    learning rate of 2e-3 after 5 warm-up steps, the held-out loss on 128 sequences every
    ``steps // points`` steps, one thread, no checkpoint, no trackers (the curve is read from
    metrics.jsonl; a TensorBoard writer cost about a tenth of a step here), in
    ``<workdir>/runs/law-<width>``."""
    return TrainConfig(data_dir=f"{workdir}/shards", run_dir=f"{workdir}/runs/law-{width}", model="tiny",
                       model_overrides={"hidden_size": width, "intermediate_size": 4 * width, "num_heads": 2},
                       max_steps=steps, num_threads=1, resume=False, seed=0, batch={"micro_batch_size": micro_batch},
                       optim={"lr": 2e-3}, schedule={"warmup_steps": 5, "min_lr_ratio": 1.0},
                       checkpoint={"enabled": False}, eval={"every": max(1, steps // points), "sequences": 128},
                       measure={"trackers": ()})


def sweep_law_runs(workdir: str, *, widths: list[int], steps: int, micro_batch: int, points: int,
                   force: bool = False, executor=None) -> pl.DataFrame:
    """Train (or read back) ``law_config`` at each width (through ``executor``, a
    ``concurrent.futures.Executor``, in parallel; else here, one after another), and return
    the fit's points: one row per held-out evaluation with width, n_params (non-embedding
    parameters, ``labkit.model.count_parameters``), n_tokens (tokens seen at that step), loss
    (the held-out loss), step, and the point's measured_at, load_avg_1m, cpu_count, busy and
    reused. Writes ``<workdir>/sweeps/law_curves.parquet`` (``points.train_points``). Prints one
    line (``points.reused_note``) when widths were read back. ``force`` trains every width.
    Raises ValueError without widths; what ``labkit.train.train`` raises otherwise."""
    if not widths:
        raise ValueError("widths: give at least one width")
    vocab = int(read_index(f"{workdir}/shards")["vocab_size"])
    cfgs = {w: law_config(workdir, w, steps=steps, micro_batch=micro_batch, points=points) for w in widths}
    curves = train_points(cfgs, Path(workdir) / "sweeps" / "law_curves.parquet", sweep="law", key="width",
                          settings={w: loss_settings(c, width=w) for w, c in cfgs.items()},
                          fields=("step", "tokens", "eval_loss"), force=force, executor=executor)
    n_params = {w: count_parameters(model_config("tiny", vocab, **c.model_overrides))["non_embedding"]
                for w, c in cfgs.items()}
    out = (curves.filter(pl.col("eval_loss").is_not_null())
           .with_columns(n_params=pl.col("width").replace_strict(n_params, return_dtype=pl.Int64))
           .select("width", "n_params", pl.col("tokens").alias("n_tokens"), pl.col("eval_loss").alias("loss"),
                   "step", "measured_at", "load_avg_1m", "cpu_count", "busy", "reused")
           .sort("width", "step"))
    note = reused_note(out.unique("width"))
    if note:
        made_by.say(f"sweep law: {note.replace('points', 'widths', 1)}")
    return out
