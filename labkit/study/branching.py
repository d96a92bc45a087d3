"""The critical batch measured during a run, by branching (Merrill et al. 2025, arXiv:2505.23971).

A base run trains at global batch B and is checkpointed at the branch points S_1 < S_2 < ...
(``train_base``: one process, the config's global batch on its engines as micro-batch x
accumulation). From each checkpoint, short branches train at k x B for k in ``factors`` (factor 1
included: the reference) through labkit's resharded resume (``checkpoint.init_from``: the
weights, optimiser state and sampler position of the checkpoint, the same ranks with k times the
accumulation). Every branch of a point trains on the same window of Δ examples (the sampler
continues the base's global order), so Δ/(k B) steps, at a constant learning rate: the base's lr
at S (``labkit.train.optim.lr_at``) scaled by ``batch.lr_rule`` (``critical_batch.lr_for_batch``),
no warm-up and no decay, so that no branch is favoured by the schedule. A repeat r > 0 trains
every branch of the point again on another window (seed + r reorders the data from S on).

The held-out loss of the checkpoint and of every branch's end, per held-out sequence
(``heldout_losses``), gives the efficiencies, the batch that keeps pace (the local critical
batch), the noise scale the branches imply and their intervals (``labkit.study.branch_stats``;
docs/measurement.md, "The critical batch by branching"). Beside them: the base run's in-run
B_simple at S (``labkit.train.gns``) and a batch sweep's B_crit, and whether each agrees with
the branches' noise scale (``agreement``).

Tables: <workdir>/sweeps/branch.parquet (one row per branch point) and branch_runs.parquet (one
row per branch: point, repeat, factor, batch, lr, steps, losses). ``labkit sweep branch`` and
notebook 07 call ``sweep_branch``.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import polars as pl

from labkit.config import TrainConfig, to_dict
from labkit.data import made_by
from labkit.io import atomic_write
from labkit.study.branch_stats import branch_estimates, overlap

__all__ = ["FACTORS", "TOLERANCE", "agreement", "base_config", "branch_config", "heldout_losses", "notebook_run",
           "sweep_branch", "train_base"]

FACTORS = (1, 2, 4, 8)
"""Branch batches as multiples of the base's global batch (1: the reference)."""
TOLERANCE = 0.2
"""A branch keeps pace when its progress per example is at least 1 − TOLERANCE of the base batch's."""


def base_config(train: TrainConfig, workdir: str | pathlib.Path, *, engines: int = 1) -> TrainConfig:
    """The base run of a branching sweep: ``train`` in one process at the global batch it has on
    ``engines`` data-parallel ranks (micro-batch x accumulation x engines: the accumulation takes
    the ranks' share), every checkpoint kept, in <workdir>/sweeps/branch/base. ValueError for a
    model-parallel split (branches run data parallel)."""
    if train.parallel.is_split:
        raise ValueError(f"parallel.tp / parallel.pp: branching runs data parallel in one process; got tp "
                         f"{train.parallel.tp}, pp {train.parallel.pp}")
    return train.replace(run_dir=str(pathlib.Path(workdir) / "sweeps" / "branch" / "base"), stop_after=None,
                         resume=True, batch={"grad_accum_steps": train.batch.grad_accum_steps * engines},
                         checkpoint={"enabled": True, "every": 0, "keep": 1000, "init_from": None})


def notebook_run(workdir: str | pathlib.Path, *, model: str, micro_batch: int, lr: float, steps: int) -> TrainConfig:
    """The run notebook 07 (and ``labkit demo``, for it) branches from, on ``<workdir>/shards``:
    ``model`` at global batch 2 x ``micro_batch`` (2 accumulation steps), learning rate ``lr``
    with 2 warm-up steps and the default decay over ``steps``, seed 0, one thread, the held-out
    loss on 64 sequences in batches of 8, no trackers (``sweep_branch`` then keeps every checkpoint)."""
    return TrainConfig(data_dir=f"{workdir}/shards", run_dir=f"{workdir}/runs/branch-base", model=model,
                       max_steps=steps, num_threads=1, seed=0,
                       batch={"micro_batch_size": micro_batch, "grad_accum_steps": 2}, optim={"lr": lr},
                       schedule={"warmup_steps": 2}, eval={"sequences": 64, "batch_size": 8}, measure={"trackers": ()})


def _global_batch(cfg: TrainConfig) -> int:
    return cfg.batch.micro_batch_size * cfg.batch.grad_accum_steps


def _progress_sink(progress: bool, total: int, initial: int, label: str):
    """A metrics sink drawing a bar from step ``initial`` to ``total`` (``StepProgress.record``; the
    bar closes itself at ``total``), or None without ``progress``."""
    if not progress:
        return None
    from labkit.cluster.progress import StepProgress

    return StepProgress(total, label=label, initial=initial).record


def train_base(base: TrainConfig, at: list[int], *, force: bool = False,
               progress: bool = False) -> tuple[list[dict], bool]:
    """Train ``base`` (one process) with a checkpoint at every step in ``at``, segment by segment
    (``stop_after``: a segment ends with a checkpoint and a held-out evaluation). Checkpoints of the
    same config already there are kept; a run of another config (or one that passed a missing
    branch point) is trained again from step 0, saying why. Returns (the run's metrics records,
    whether anything was trained now). ValueError for a point outside 1..max_steps. ``progress``:
    a bar over each segment's steps (``_progress_sink``)."""
    from labkit.train import train
    from labkit.train.checkpoint import checkpoint_steps
    from labkit.train.run_config import config_drift, data_identity

    bad = [s for s in at if not 1 <= s <= base.max_steps]
    if bad:
        raise ValueError(f"--at: branch points {bad} outside 1..train.max_steps {base.max_steps} "
                         "(--set train.max_steps=... to train the base run further)")
    run = pathlib.Path(base.run_dir)
    done = checkpoint_steps(run)
    if done and not force:
        from labkit.data.shards import read_index

        saved = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
        saved_data = json.loads((run / "data.json").read_text()) if (run / "data.json").exists() else None
        drift = config_drift(saved, to_dict(base), saved_data, data_identity(read_index(base.data_dir)),
                             allow_safe_changes=False) if saved else ["no config.json"]
        missing = [s for s in at if s not in done]
        if drift or (missing and max(done) > min(missing)):
            made_by.say(f"sweep branch: base run in {run}: " + ("; ".join(drift) if drift else
                        f"no checkpoint at step {min(missing)} before {max(done)}") + ", training it again")
            done = []
    trained, last = False, 0
    for step in sorted(set(at)):
        if step in done:
            last = step
            continue
        train(base.replace(stop_after=step, resume=bool(done) or trained),  # the first: a new run unless kept
              sink=_progress_sink(progress, step, last, "sweep branch: base run"))
        trained, last = True, step
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return records, trained


def branch_config(base: TrainConfig, step: int, factor: int, *, window: int, repeat: int = 0,
                  lr_rule: str | None = None) -> TrainConfig:
    """Branch ``factor`` of ``base``'s checkpoint at ``step``: global batch factor x B (factor x the
    accumulation), ``window`` // (factor x B) steps, constant lr = lr_at(step) of the base scaled by
    ``lr_rule`` (default base.batch.lr_rule), seed + ``repeat``, a checkpoint at its end, the
    held-out loss only there; run directory <base's parent>/step-<S>/r<repeat>-x<factor>. ValueError
    when the window is not a whole number of the branch's steps."""
    from labkit.train.optim import lr_at, lr_for_batch

    batch = _global_batch(base)
    if window % (factor * batch) or window < factor * batch:
        raise ValueError(f"--window: {window} examples is not a positive multiple of branch batch {factor * batch} "
                         f"(factor {factor} x the base's global batch {batch})")
    lr = lr_for_batch(lr_at(step, base), batch, factor * batch, lr_rule or base.batch.lr_rule)
    run = pathlib.Path(base.run_dir).parent / f"step-{step}" / f"r{repeat}-x{factor}"
    return base.replace(run_dir=str(run), max_steps=step + window // (factor * batch), stop_after=None, resume=True,
                        seed=base.seed + repeat, batch={"grad_accum_steps": base.batch.grad_accum_steps * factor},
                        optim={"lr": lr}, schedule={"kind": "linear", "warmup_steps": 0, "min_lr_ratio": 1.0},
                        checkpoint={"enabled": True, "every": 0, "keep": 1,
                                    "init_from": str(pathlib.Path(base.run_dir) / "checkpoints" / f"step-{step}")},
                        eval={"every": 0})


def heldout_losses(cfg: TrainConfig, checkpoint: str | pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """(loss sum [n], masked tokens [n]) of the model in ``checkpoint`` on each sequence of
    ``cfg``'s fixed held-out set (``labkit.train.evaluation.HeldoutSet``: the first eval.sequences
    held-out sequences, their masks fixed), fp32 on the CPU in eval mode; Σ loss / Σ masked is the
    run's eval_loss. ``HeldoutError`` when the shards have no held-out split."""
    import torch

    from labkit.data.shards import read_index
    from labkit.model import BertMLM
    from labkit.train.checkpoint import load_weights
    from labkit.train.evaluation import HeldoutSet
    from labkit.train.run_config import model_config_of

    index = read_index(cfg.data_dir)
    model = BertMLM(model_config_of(cfg, int(index["vocab_size"])))
    model.load_state_dict(load_weights(checkpoint))
    model.eval()
    held = HeldoutSet(cfg.data_dir, rank=0, world_size=1,
                      mlm_probability=cfg.data.mlm_probability, max_sequences=cfg.eval.sequences, batch_size=1,
                      device=torch.device("cpu"))
    sums, counts = [], []
    with torch.no_grad():
        for b in held.batches:
            out = model(b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
            sums.append(float(out.loss_sum))
            counts.append(float(out.n_masked))
    return np.array(sums), np.array(counts)


def _at(records: list[dict], step: int, key: str) -> Any:
    return next((r.get(key) for r in records if r["step"] == step), None)


def agreement(row: dict) -> str:
    """One sentence: which of the in-run B_simple and the batch sweep's B_crit agree with the noise
    scale the branches imply at this point (``branch_stats.overlap`` of their intervals)."""
    br = (row["b_noise"], row["b_noise_low"], row["b_noise_high"])
    if br[0] is None:
        return f"step {row['step']}: the base batch made no progress over the window, no estimate"
    parts = []
    for name, key in (("in-run B_simple", "b_simple"), ("the batch sweep's B_crit", "b_crit_sweep")):
        other = (row.get(key), row.get(f"{key}_low"), row.get(f"{key}_high"))
        ok = overlap(br, other)
        if ok is not None:
            parts.append(f"{name} {other[0]:.1f} {'agrees' if ok else 'does not agree'}")
    at_least = "at least " if row["b_noise_censored"] else ""
    return (f"step {row['step']}: branching implies B_noise {at_least}{br[0]:.1f} ({br[1]:.1f}-{br[2]:.1f}); "
            + ("; ".join(parts) if parts else "nothing to compare"))


def _sweep_b_crit(path: str | pathlib.Path | None, workdir: str | pathlib.Path) -> dict:
    """{"b_crit_sweep", "b_crit_sweep_low", "b_crit_sweep_high", "b_crit_sweep_target"} from a
    ``labkit sweep batch`` table (default <workdir>/sweeps/critical_batch.parquet when it exists);
    {} without one or without a fit. ValueError naming a given path that does not exist."""
    default = pathlib.Path(workdir) / "sweeps" / "critical_batch.parquet"
    if path is not None and not pathlib.Path(path).is_file():
        raise ValueError(f"--critical-batch: {path} does not exist (`labkit sweep batch CONFIG` writes "
                         "<workdir>/sweeps/critical_batch.parquet)")
    path = pathlib.Path(path) if path is not None else default
    if not path.is_file():
        return {}
    row = pl.read_parquet(path).row(0, named=True)
    if row.get("b_crit") is None:
        return {}
    return {"b_crit_sweep": row["b_crit"], "b_crit_sweep_low": row.get("b_crit_low"),
            "b_crit_sweep_high": row.get("b_crit_high"), "b_crit_sweep_target": row.get("target_eval_loss")}


def sweep_branch(train_cfg: TrainConfig, workdir: str | pathlib.Path, *, at: list[int],
                 factors: tuple[int, ...] | list[int] = FACTORS, window: int | None = None, repeats: int = 1,
                 tolerance: float = TOLERANCE, engines: int = 1, lr_rule: str | None = None,
                 critical_batch: str | pathlib.Path | None = None, n_boot: int = 1000,
                 force: bool = False, progress: bool = False,
                 wait: Callable[[], object] | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The local critical batch of ``train_cfg``'s run at each step in ``at`` (module docstring).

    ``factors``: branch batches as multiples of the base's global batch (1 is added when absent);
    ``window``: examples every branch trains on (default 8 x the largest branch's batch; a
    multiple of it); ``repeats``: windows per point; ``tolerance``: of keeping pace
    (``branch_stats``); ``engines``: the data-parallel ranks whose global batch the one-process
    base takes; ``lr_rule``: default train's batch.lr_rule; ``critical_batch``: a batch sweep's
    table (default: <workdir>/sweeps/critical_batch.parquet, if any), read once the runs are trained,
    after ``wait()`` returns when given (``labkit demo`` runs its batch sweep beside the branches and
    waits for it there; a given path must exist before anything trains). A finished branch of the same
    config is read back (``labkit.train.run_config.finished_run``) unless the base was trained
    again or ``force``. Returns (points, runs) and writes them to <workdir>/sweeps/branch.parquet
    and branch_runs.parquet. Points: step, tokens (seen by the base at the step), examples, batch
    (B), window, factors, repeats, tolerance, lr_rule, lr_base (the base's lr at the step),
    loss_start, b_keep_pace (the local critical batch) with _low, _high, _censored, b_noise (the
    branches' noise scale) with _low, _high, _censored, level, b_simple (the base's in-run B_simple
    at the step, with b_simple_low/high when the run records them), b_crit_sweep with _low, _high,
    _target, b_simple_agrees and b_crit_sweep_agrees (``branch_stats.overlap`` with b_noise's range;
    None where either is missing), and agreement (one sentence). ValueError on bad factors,
    window or repeats. ``progress``: a bar over each run's steps, the base's and each branch's."""
    factors = sorted(set(factors) | {1})
    if factors[0] < 1 or len(factors) < 2 or repeats < 1 or not 0 < tolerance < 1:
        raise ValueError(f"sweep branch: need factors >= 1 (two or more), repeats >= 1 and 0 < tolerance < 1, got "
                         f"{factors}, {repeats}, {tolerance}")
    base = base_config(train_cfg, workdir, engines=engines)
    batch, rule = _global_batch(base), lr_rule or base.batch.lr_rule
    window = window or 8 * factors[-1] * batch
    bad = [k for k in factors if window % (k * batch)]
    if bad:
        raise ValueError(f"--window: {window} examples is not a multiple of the branch batch of factor(s) {bad} "
                         f"(x the run's global batch {batch})")
    outside = [s for s in at if not 1 <= s <= base.max_steps]
    if outside:
        raise ValueError(f"--at: branch points {outside} outside 1..train.max_steps {base.max_steps} "
                         "(--set train.max_steps=... to train the base run further)")
    _sweep_b_crit(critical_batch, workdir)  # a given table that is not there: refused before anything trains
    from labkit.train import train  # after the checks: torch takes seconds to import
    from labkit.train.optim import lr_at

    records, trained = train_base(base, at, force=force, progress=progress)
    points, runs, estimates = [], [], {}
    for step in sorted(set(at)):
        if trained or force:  # branches of an older base checkpoint are not this one's
            shutil.rmtree(pathlib.Path(base.run_dir).parent / f"step-{step}", ignore_errors=True)
        l0, masked = heldout_losses(base, pathlib.Path(base.run_dir) / "checkpoints" / f"step-{step}")
        lk = np.empty((repeats, len(factors), len(masked)))
        for r in range(repeats):
            for j, k in enumerate(factors):
                cfg = branch_config(base, step, k, window=window, repeat=r, lr_rule=rule)
                result = train(cfg, sink=_progress_sink(progress, cfg.max_steps, step, f"sweep branch: {step} x{k}"))
                lk[r, j], m = heldout_losses(cfg, pathlib.Path(cfg.run_dir) / "checkpoints" / f"step-{cfg.max_steps}")
                if not np.array_equal(m, masked):
                    raise RuntimeError(f"sweep branch: the held-out masks of {cfg.run_dir} differ from the base's")
                runs.append({"step": step, "repeat": r, "factor": k, "batch": k * batch, "lr": cfg.optim.lr,
                             "steps": cfg.max_steps - step, "examples": window, "eval_loss": result.get("eval_loss"),
                             "loss_end": float(lk[r, j].sum() / masked.sum()), "run_dir": cfg.run_dir})
        est = estimates[step] = branch_estimates(l0, lk, masked, factors, batch, tolerance=tolerance, n_boot=n_boot)
        for run in runs:
            if run["step"] == step:
                run["loss_start"], run["efficiency"] = est["loss_start"], est["efficiency"][factors.index(run["factor"])]
    if wait is not None:
        wait()
    crit = _sweep_b_crit(critical_batch, workdir)
    for step, est in estimates.items():
        row = {"step": step, "tokens": _at(records, step, "tokens"), "examples": step * batch, "batch": batch,
               "window": window, "factors": factors, "repeats": repeats, "tolerance": tolerance, "lr_rule": rule,
               "lr_base": lr_at(step, base), **{k: v for k, v in est.items() if k not in ("loss_end", "efficiency")},
               **{k: _at(records, step, k) for k in ("b_simple", "b_simple_low", "b_simple_high")}, **crit}
        br = (row["b_noise"], row["b_noise_low"], row["b_noise_high"])
        row |= {f"{key}_agrees": overlap(br, (row.get(key), row.get(f"{key}_low"), row.get(f"{key}_high")))
                for key in ("b_simple", "b_crit_sweep")}
        points.append(row | {"agreement": agreement(row)})
    out = pathlib.Path(workdir) / "sweeps"
    points_df, runs_df = (pl.DataFrame(x, infer_schema_length=None) for x in (points, runs))
    atomic_write(out / "branch_runs.parquet", runs_df.write_parquet)
    atomic_write(out / "branch.parquet", points_df.write_parquet)
    return points_df, runs_df
