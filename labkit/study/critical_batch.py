"""The critical batch measured directly: steps and examples to a target held-out loss per batch size.

McCandlish, Kaplan, Amodei et al. 2018 (arXiv:1812.06162), eq. 2.11: training to a fixed loss
at batch B takes S steps and E = B·S examples with

    (S/S_min − 1)(E/E_min − 1) = 1,

S_min the fewest steps (infinite batch) and E_min the fewest examples (batch → 0). Equivalently
S(B) = S_min·(1 + B_crit/B) and E(B) = E_min·(1 + B/B_crit) with B_crit = E_min/S_min, the batch
where both are within a factor 2 of their minima. ``fit_critical_batch`` fits S(B) in log space
(least squares on log S, which weighs the small and large batches alike) and gives B_crit with
a bootstrap range (points resampled with replacement).

``steps_to_target`` reads one run's held-out losses (``eval_loss`` of labkit.train's metrics
records) and interpolates the step at which it first reaches the target (linear in the step
between the two evaluations that bracket it). ``sweep_batch`` trains one configuration at
several global batch sizes in this process, the learning rate set per batch by a stated rule,
and writes tidy Parquet (one row per batch size). Notebook 07 and ``labkit sweep batch`` use it.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import numpy as np
import polars as pl

from labkit.data import made_by
from labkit.io import atomic_write
from labkit.study.goodput import goodput_columns
from labkit.train.lr import LR_RULES, lr_for_batch  # noqa: F401 (here since the sweeps; the ramp's too)

__all__ = ["CURVE_FIELDS", "b_simple_at", "batch_base", "batch_config", "fit_critical_batch", "hyperbola", "lr_for_batch",
           "run_rates", "steps_to_target", "sweep_batch"]


def steps_to_target(records: list[dict], target: float, key: str = "eval_loss") -> float | None:
    """The (fractional) step at which ``records[i][key]`` first falls to ``target`` or below,
    linear between the two evaluations around it (from the run's start, step 0, when the first
    evaluation is already there: that evaluation's step). None if it never does."""
    evals = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    prev = None
    for step, loss in evals:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step)
            (s0, l0) = prev
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        prev = (step, loss)
    return None


def _fit(batch: np.ndarray, steps: np.ndarray) -> tuple[float, float]:
    """(S_min, B_crit) minimising Σ (log S_i − log(S_min·(1 + B_crit/B_i)))², both positive."""
    from scipy.optimize import least_squares

    x = 1.0 / batch
    slope, icpt = np.polyfit(x, steps, 1)  # S = S_min + S_min·B_crit·(1/B): a linear start
    s0 = max(icpt, steps.min() * 0.5)
    b0 = max(slope / s0, batch.min() * 0.1)

    def resid(p):
        s_min, b_crit = np.exp(p)
        return np.log(steps) - np.log(s_min * (1.0 + b_crit / batch))

    sol = least_squares(resid, np.log([s0, b0]))
    s_min, b_crit = np.exp(sol.x)
    return float(s_min), float(b_crit)


def fit_critical_batch(batch: list[float] | np.ndarray, steps: list[float] | np.ndarray, *, n_boot: int = 1000,
                       level: float = 0.9, seed: int = 0) -> dict[str, Any]:
    """Fit (S/S_min − 1)(E/E_min − 1) = 1 to steps ``steps`` [n] at global batch ``batch`` [n]
    (sequences; E = B·S examples). Returns {"b_crit", "s_min", "e_min", "b_crit_low", "b_crit_high"
    (the central ``level`` bootstrap interval over ``n_boot`` resamples of the points), "level",
    "n_points", "rms_log_residual"}. Raises ValueError with fewer than 3 distinct batch sizes or a
    non-positive value."""
    b, s = np.asarray(batch, dtype=float), np.asarray(steps, dtype=float)
    if b.shape != s.shape or len(np.unique(b)) < 3:
        raise ValueError(f"fit_critical_batch: need >= 3 distinct batch sizes with their steps, got {b.tolist()}")
    if (b <= 0).any() or (s <= 0).any():
        raise ValueError("fit_critical_batch: batch sizes and steps must be positive")
    s_min, b_crit = _fit(b, s)
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(b), len(b))
        if len(np.unique(b[idx])) < 3:
            continue
        boots.append(_fit(b[idx], s[idx])[1])
    lo, hi = (np.quantile(boots, [(1 - level) / 2, (1 + level) / 2]) if boots else (math.nan, math.nan))
    pred = s_min * (1 + b_crit / b)
    return {"b_crit": b_crit, "s_min": s_min, "e_min": s_min * b_crit, "b_crit_low": float(lo),
            "b_crit_high": float(hi), "level": level, "n_points": int(len(b)), "n_boot": len(boots),
            "rms_log_residual": float(np.sqrt(np.mean((np.log(s) - np.log(pred)) ** 2)))}


def hyperbola(s_min: float, e_min: float, n: int = 100, *, batches: tuple[float, float] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """Points (S [n], E [n]) on (S/S_min − 1)(E/E_min − 1) = 1 for batch sizes log-spaced over
    ``batches`` (low, high), default 1e-2..1e2 × B_crit: S = S_min(1 + B_crit/B), E = E_min(1 + B/B_crit)."""
    b_crit = e_min / s_min
    lo, hi = batches or (b_crit * 1e-2, b_crit * 1e2)
    b = np.geomspace(lo, hi, n)
    return s_min * (1 + b_crit / b), e_min * (1 + b / b_crit)


def b_simple_at(records: list[dict], step: float, key: str = "b_simple") -> float | None:
    """The in-run ``key`` (labkit.train.gns) of the record nearest ``step`` that has one."""
    have = [r for r in records if r.get(key) is not None]
    return min(have, key=lambda r: abs(r["step"] - step))[key] if have else None


def run_rates(records: list[dict], warmup_steps: int = 0) -> tuple[float | None, float | None]:
    """(tokens/s, samples/s) of one run from its metrics records (``labkit.measure``: all real
    tokens, or sequences, over all step time), the first ``warmup_steps`` steps left out as the run's
    result.json leaves them out; (None, None) when no record after them has a step time."""
    from labkit.measure import samples_per_s, tokens_per_s

    timed = [r for r in records if r["step"] > warmup_steps and r.get("step_time_s")] or \
        [r for r in records if r.get("step_time_s")]
    if not timed:
        return None, None
    seconds = sum(r["step_time_s"] for r in timed)
    return (tokens_per_s(sum(r["step_tokens"] for r in timed), seconds),
            samples_per_s(sum(r["global_batch_size"] for r in timed), seconds))


def batch_base(workdir: str | pathlib.Path, *, model: str, micro_batch: int, lr: float) -> Any:
    """The base TrainConfig of notebook 07's (and ``labkit demo``'s) batch sweep on
    ``<workdir>/shards``: ``model`` at micro-batch ``micro_batch`` and learning rate ``lr`` (at a
    global batch of ``micro_batch``), 2 warm-up steps then constant (min_lr_ratio 1), seed 0,
    one thread, the held-out loss on 64 sequences in batches of 8, no checkpoints, no trackers
    (the curves are read from metrics.jsonl; ``measure.trackers`` is not part of a loss point's
    record, ``labkit.study.points.LOSS_FREE``)."""
    from labkit.config import TrainConfig

    return TrainConfig(data_dir=f"{workdir}/shards", run_dir=f"{workdir}/runs/critical-batch", model=model,
                       num_threads=1, resume=False, seed=0, batch={"micro_batch_size": micro_batch, "grad_accum_steps": 1},
                       optim={"lr": lr}, schedule={"warmup_steps": 2, "min_lr_ratio": 1.0},
                       checkpoint={"enabled": False}, eval={"sequences": 64, "batch_size": 8},
                       measure={"trackers": ()})


def batch_config(base: Any, workdir: str | pathlib.Path, batch: int, *, lr_rule: str = "sqrt",
                 max_examples: int | None = None, eval_every: int | None = None,
                 micro_batch_size: int | None = None) -> Any:
    """The TrainConfig of ``sweep_batch``'s run at global ``batch`` (sequences): micro-batch
    ``micro_batch_size`` or base's, at most half the batch (accumulation >= 2, so the in-run
    noise scale exists), the rest accumulation; ``max(2, max_examples // batch)`` steps (default
    max_examples: base.max_steps x base's global batch); the learning rate by ``lr_for_batch``
    from base's lr at base's global batch; the held-out loss every ``eval_every`` steps (default
    about 12 evaluations); run directory ``<workdir>/sweeps/critical_batch/batch-<B>``. Raises
    ValueError when the batch is not a multiple of the micro-batch."""
    from labkit.train import optim

    mb = micro_batch_size or base.batch.micro_batch_size
    base_batch = base.batch.micro_batch_size * base.batch.grad_accum_steps
    max_examples = max_examples or base.max_steps * base_batch
    m = min(mb, batch // 2)
    if m < 1 or batch % m:
        raise ValueError(f"sweep batch: global batch {batch} is not a multiple of the micro-batch {m}")
    steps = max(2, max_examples // batch)
    return base.replace(run_dir=str(pathlib.Path(workdir) / "sweeps" / "critical_batch" / f"batch-{batch}"),
                        max_steps=steps, resume=False, stop_after=None,
                        batch={"micro_batch_size": m, "grad_accum_steps": batch // m},
                        optim={"lr": optim.lr_for_batch(base.optim.lr, base_batch, batch, lr_rule)},
                        schedule={"warmup_steps": min(base.schedule.warmup_steps, max(1, steps // 10))},
                        eval={"every": eval_every or max(1, steps // 12)}, measure={"log_every": 1},
                        checkpoint={"enabled": False})


CURVE_FIELDS = ("step", "loss", "eval_loss", "b_simple", "b_simple_tokens", "step_time_s", "step_tokens",
                "global_batch_size")
"""The fields of each run's metrics records kept in critical_batch_curves.parquet (the last three
for ``run_rates``: a point read back has its throughput too)."""


def sweep_batch(base: Any, workdir: str | pathlib.Path, *, batch_sizes: list[int], target: float | None = None,
                lr_rule: str = "sqrt", max_examples: int | None = None, eval_every: int | None = None,
                micro_batch_size: int | None = None, force: bool = False, executor=None,
                progress: bool = False) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Train ``base`` (a TrainConfig; one process per run) at each global batch in
    ``batch_sizes`` (sequences; ``batch_config``: micro-batch ``micro_batch_size`` or base's, the
    rest accumulation, at least 2 so the in-run noise scale exists) until ``max_examples``
    sequences, the learning rate by ``lr_for_batch(base.optim.lr, base's global batch, B, lr_rule)``,
    evaluating the held-out loss every ``eval_every`` steps (default: about 12 evaluations).
    ``target``: the held-out loss to reach (default: the largest final held-out loss over the
    runs, so that every run reaches it). ``executor`` (a ``concurrent.futures.Executor``, e.g. an
    ipyparallel view's) trains the runs in parallel (``labkit.study.points.train_points``).
    ``progress``: a bar over each run's steps trained in this process (``labkit.cluster.progress.
    StepProgress``, "sweep batch: <B>", fed by the run's metrics sink).

    Each batch size is a sweep point (``labkit.study.points``): its run's curve is read back from
    <workdir>/sweeps/critical_batch_curves.parquet when it was made with the same settings
    (``loss_settings`` of its TrainConfig: the optimisation, the evaluation, the shard set's
    identity), else trained anew in an emptied run directory; ``force`` trains every point.
    Writes that curves table (batch, step, examples, loss, eval_loss, b_simple, b_simple_tokens
    per record, and each point's made_by, measured_at and load) and
    <workdir>/sweeps/critical_batch.parquet (one row per batch: batch, lr, steps, examples,
    reached, b_simple, b_simple_tokens at the target, final_eval_loss, tokens_per_s and
    samples_per_s of the run (``run_rates``), the fit's b_crit, b_crit_low, b_crit_high, s_min,
    e_min, the statistical goodput columns of ``labkit.study.goodput.goodput_columns`` with
    B_noise = the fitted B_crit and B0 = the smallest batch (b_noise, b_noise_source,
    statistical_efficiency, goodput_samples_per_s; null without a fit), and measured_at,
    load_avg_1m, cpu_count, busy, reused), and returns (rows, fit | {"target_eval_loss", "lr_rule", "reached"}); one line
    (``points.reused_note``) says which points were read back, when and at what load. Raises
    ValueError with fewer than 3 batch sizes."""
    from labkit.study.points import loss_settings, reused_note, train_points

    if len(set(batch_sizes)) < 3:
        raise ValueError(f"sweep batch: need >= 3 distinct batch sizes, got {batch_sizes}")
    out = pathlib.Path(workdir) / "sweeps"
    cfgs = {b: batch_config(base, workdir, b, lr_rule=lr_rule, max_examples=max_examples, eval_every=eval_every,
                            micro_batch_size=micro_batch_size) for b in sorted(set(batch_sizes))}
    curves = train_points(cfgs, out / "critical_batch_curves.parquet", sweep="batch", key="batch",
                          settings={b: loss_settings(c, batch=b) for b, c in cfgs.items()}, fields=CURVE_FIELDS,
                          columns={"examples": pl.col("step") * pl.col("batch")}, force=force, executor=executor,
                          progress=progress)
    runs = {b: curves.filter(pl.col("batch") == b).sort("step") for b in cfgs}
    finals = {b: r["eval_loss"].drop_nulls().min() for b, r in runs.items()}
    target = target if target is not None else max(finals.values())
    rows = []
    for batch, run in runs.items():
        recs = run.to_dicts()
        s = steps_to_target(recs, target)
        tps, sps = run_rates(recs, cfgs[batch].measure.timing_warmup_steps)
        rows.append({"batch": batch, "lr": cfgs[batch].optim.lr, "lr_rule": lr_rule, "target_eval_loss": target,
                     "steps": s, "examples": s * batch if s is not None else None, "reached": s is not None,
                     "b_simple": b_simple_at(recs, s) if s is not None else None,
                     "b_simple_tokens": b_simple_at(recs, s, "b_simple_tokens") if s is not None else None,
                     "final_eval_loss": finals[batch], "tokens_per_s": tps, "samples_per_s": sps,
                     **{k: recs[0][k] for k in ("measured_at", "load_avg_1m", "cpu_count", "busy", "reused")}})
    df = pl.DataFrame(rows, infer_schema_length=None)
    reached = df.filter(pl.col("reached"))
    fit = fit_critical_batch(reached["batch"].to_numpy(), reached["steps"].to_numpy()) if reached.height >= 3 else {}
    fit |= {"target_eval_loss": target, "lr_rule": lr_rule, "reached": int(reached.height)}
    df = df.with_columns(*(pl.lit(fit.get(k)).alias(k) for k in ("b_crit", "b_crit_low", "b_crit_high", "s_min", "e_min")))
    if fit.get("b_crit") is not None:
        df = goodput_columns(df, batch="batch", throughput="samples_per_s", b_noise=fit["b_crit"],
                             source=f"this sweep's B_crit (fit at held-out loss {target:.3f})")
    else:  # no fit: no one B_noise for the table
        df = df.with_columns(*(pl.lit(None, dtype=t).alias(c) for c, t in (
            ("b_noise", pl.Float64), ("b_noise_source", pl.String), ("statistical_efficiency", pl.Float64),
            ("goodput_samples_per_s", pl.Float64))))
    atomic_write(out / "critical_batch.parquet", df.drop("reused").write_parquet)
    note = reused_note(df)
    if note:
        made_by.say(f"sweep batch: {note}")
    return df, fit
