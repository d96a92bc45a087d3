"""What a sweep point is: the settings it was measured with, when, at what load, and when it may
be reused instead of measured again. Every sweep of labkit keeps its points this way (the
cluster sweeps of ``labkit.study.sweeps``, the loss sweeps of ``labkit.study.critical_batch`` and
``labkit.study.law_runs``, ``labkit.study.network_sweep``).

A point's row in its sweep's Parquet table carries ``made_by`` (canonical JSON of the point's
settings: the run's configuration as far as it shapes the measured quantity, the identity of its
input data -- the sha256 of the shard set's ``index.json`` --, and ``measures``, the quantity),
``measured_at`` (ISO 8601 UTC) and the machine's load just before it was measured
(``load_columns``). On the next sweep a point is reused only when the ``made_by`` it would be
measured with now is equal (``reusable``); otherwise it is measured anew, with one line on stderr
naming each change (``sweep ranks 2 rank(s): max_steps 4 -> 8, measuring again``); ``force``
measures every point. Frames returned to a caller carry ``reused`` (True: read back, measured at
``measured_at``, not now); ``reused_note`` is the one line every printer of a sweep shows for them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import polars as pl

from labkit.config import dotted, to_dict
from labkit.data import made_by
from labkit.io import atomic_write

__all__ = ["BUSY_LOAD_PER_CPU", "TIME_FREE", "LOSS_FREE", "done_rows", "fresh_run_dir", "load_columns",
           "loss_settings", "machine_load", "point", "reusable", "reused_note", "run_settings", "save", "train_points"]

BUSY_LOAD_PER_CPU = 1.0
"""A sweep point counts as measured on a busy machine when the engine host's 1-minute load
average, just before the point, was at least this many runnable tasks per usable CPU: other work
already occupied every core, so the point's throughput is low by an unknown amount."""


def machine_load() -> dict:
    """This host's load: {"load_avg_1m", "load_avg_5m" (os.getloadavg: runnable + waiting tasks,
    averaged over 1 and 5 minutes), "cpu_count" (CPUs this process may use, sched_getaffinity)}.
    Runs on an engine in the cluster sweeps (``call(client[id], machine_load)``)."""
    import os

    one, five, _ = os.getloadavg()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"load_avg_1m": round(one, 2), "load_avg_5m": round(five, 2), "cpu_count": cpus}


def load_columns(client=None, engine_id: int | None = None) -> dict:
    """``machine_load`` of an engine's host (``client[engine_id]``; this host without a client)
    plus ``busy`` (load_avg_1m >= BUSY_LOAD_PER_CPU x cpu_count)."""
    if client is None:
        load = machine_load()
    else:
        from labkit.cluster.engines import call

        load = call(client[engine_id], machine_load)
    return load | {"busy": load["load_avg_1m"] >= BUSY_LOAD_PER_CPU * load["cpu_count"]}


TIME_FREE = frozenset({"run_dir", "data_dir", "data.tokenizer_path", "resume", "allow_safe_changes",
                       "measure.trackers", "timeout_s", "stop_after", "data.verify_data", "seed", "on_nonfinite",
                       "optim.lr", "optim.weight_decay", "optim.beta1", "optim.beta2", "optim.grad_clip",
                       "schedule.kind", "schedule.warmup_steps", "schedule.min_lr_ratio",
                       "schedule.wsd_decay_fraction", "measure.log_every", "checkpoint.every", "checkpoint.keep",
                       "checkpoint.enabled", "checkpoint.asynchronous", "checkpoint.init_from", "eval.every",
                       "eval.enabled", "eval.sequences", "eval.batch_size", "batch.lr_rule"})
"""TrainConfig fields (dotted, ``labkit.config.dotted``) that do not shape a measurement of time and memory: where the run is
written and read (the data are identified by their index.json instead), the values of the
optimisation (learning rate and its schedule, decay, clipping threshold, seed: the same work per
step; ``batch.lr_rule`` only sets a sweep's lr, and a checkpoint to start from changes the
weights, not the work) and what happens between the timed steps (logging, checkpoints, held-out
evaluation).
Everything else -- model, batch, steps, timing warm-up, precision, sharding, split, threads,
loader workers, compile, bucket size -- is part of the point's record."""

LOSS_FREE = frozenset({"run_dir", "data_dir", "data.tokenizer_path", "resume", "allow_safe_changes",
                       "measure.trackers", "timeout_s", "data.verify_data", "checkpoint.every", "checkpoint.keep",
                       "checkpoint.enabled", "checkpoint.asynchronous", "batch.lr_rule"})
"""TrainConfig fields that do not shape a measured loss curve: where the run is written and read
(the data are identified by their index.json), how long a process may wait, checkpoints, and
``batch.lr_rule`` (it sets a sweep's lr, which is itself in the record).
The optimisation and the evaluation (learning rate, schedule, seed, evaluation interval and
sequences) shape it, so they are part of a loss point's record, unlike a timing point's."""


def _settings(cfg, free: frozenset, measures: str, extra: dict) -> dict:
    keep = {k: v for k, v in dotted(to_dict(cfg)).items() if k not in free}
    data = made_by.file_identity(Path(cfg.data_dir) / "index.json") if cfg.data_dir else None
    return keep | {"data": data, "measures": measures} | extra


def run_settings(cfg, *, measures: str = "throughput", **extra) -> dict:
    """The settings of a sweep point that is one short run of ``cfg`` (a TrainConfig) timed: its
    fields (dotted, ``labkit.config.dotted``) without ``TIME_FREE``, the sha256 of the shard set's ``index.json`` (``data``;
    None when there is none), the quantity (``measures``) and ``extra`` (e.g. ``ranks``)."""
    return _settings(cfg, TIME_FREE, measures, extra)


def loss_settings(cfg, *, measures: str = "eval_loss", **extra) -> dict:
    """The settings of a sweep point whose quantity is a run's loss curve: its fields (dotted)
    without ``LOSS_FREE``, the shard set's identity (``data``), ``measures`` and ``extra``."""
    return _settings(cfg, LOSS_FREE, measures, extra)


def point(settings: dict, load: dict | None = None) -> dict:
    """The bookkeeping columns of a newly measured row: made_by (its settings as canonical JSON),
    measured_at (ISO 8601 UTC), reused (False) and ``load`` (``load_columns``) when given."""
    return {"made_by": json.dumps(made_by.plain(settings), sort_keys=True), "measured_at": made_by._now_iso(),
            **(load or {}), "reused": False}


def reusable(sweep: str, name: str, row: dict | None, settings: dict) -> bool:
    """Whether ``row`` (the table's row for this point, None: not measured) was made with
    ``settings``; prints one line naming the change when it was not."""
    if row is None:
        return False
    saved = row.get("made_by")
    old = {"settings": json.loads(saved), "inputs": {}} if saved else None
    diff = made_by.changes(old, {"settings": made_by.plain(settings), "inputs": {}})
    if diff:
        made_by.say(f"sweep {sweep} {name}: {'; '.join(diff)}, measuring again")
    return not diff


def reused_note(df: pl.DataFrame) -> str | None:
    """One line for the rows of a sweep frame that were read back, not measured now: how many,
    when they were measured and the highest load then (``"3 of 4 points reused from earlier
    runs (measured 2026-12-01T17:00:00+00:00 to ..., load up to 7.0 on 2 CPUs, busy); --force
    measures them again"``). None when every row was measured now."""
    if "reused" not in df.columns or not df["reused"].any():
        return None
    old = df.filter(pl.col("reused"))
    if "measured_at" in old.columns and old["measured_at"].drop_nulls().len():
        first, last = old["measured_at"].drop_nulls().min(), old["measured_at"].drop_nulls().max()
        when = f"measured {first}" + (f" to {last}" if last != first else "")
    else:
        when = "measured at an unrecorded time"
    load = ""
    if "load_avg_1m" in old.columns and old["load_avg_1m"].drop_nulls().len():
        load = f", load up to {old['load_avg_1m'].max()} on {old['cpu_count'].max()} CPUs"
        if "busy" in old.columns and old["busy"].any():
            load += ", busy"
    return f"{old.height} of {df.height} points reused from earlier runs ({when}{load}); --force measures them again"


def fresh_run_dir(cfg):
    """``cfg`` with its run directory emptied first: a sweep point's run directory is the sweep's
    scratch, and a finished run of the same config would otherwise be returned as it is, without
    a step (``labkit.train.run_config.finished_run``)."""
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    return cfg


def save(df: pl.DataFrame, out: Path) -> pl.DataFrame:
    """Write a sweep table to Parquet atomically (``labkit.io``), without the per-call ``reused``
    column; returns ``df`` (with it: rows without one are marked measured now)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    df = df.with_columns(reused=pl.col("reused").fill_null(False)) if "reused" in df.columns \
        else df.with_columns(reused=pl.lit(False))
    atomic_write(out, df.drop("reused").write_parquet)
    return df


def done_rows(out: Path, force: bool) -> list[dict[str, Any]]:
    """The rows of the table at ``out`` (none with ``force`` or without the file), each marked ``reused``."""
    return [r | {"reused": True} for r in pl.read_parquet(out).to_dicts()] if os.path.exists(out) and not force else []


def _train_one(cfg, label: str | None = None) -> str:
    """One point of ``train_points`` (in a pool process or this one): ``cfg`` trained in its
    emptied run directory (train sets its ``num_threads``); with ``label``, a progress bar over
    its steps (``labkit.cluster.progress.StepProgress``)."""
    from labkit.train import train

    if label is None:
        train(fresh_run_dir(cfg))
        return cfg.run_dir
    from labkit.cluster.progress import StepProgress

    with StepProgress(cfg.max_steps, label=label) as bar:
        train(fresh_run_dir(cfg), sink=bar.record)
    return cfg.run_dir


def train_points(cfgs: dict, out: Path, *, sweep: str, key: str, settings: dict[Any, dict],
                 fields: tuple[str, ...], columns: dict[str, pl.Expr] | None = None, force: bool = False,
                 executor=None, progress: bool = False) -> pl.DataFrame:
    """Single-process training runs as sweep points whose quantity is their metrics curve (the
    held-out loss, the noise scale): ``cfgs`` {point value: TrainConfig}, ``settings`` {point
    value: its record (``loss_settings``)}. A point whose rows in the table ``out`` carry the same
    ``made_by`` is read back; every other point is trained anew in its emptied run directory: in
    this process one after another, or through ``executor`` (a ``concurrent.futures.Executor``:
    a process pool, or an ipyparallel view's ``.executor``, whose engines then train one run each
    at a time), the longest run first. ``progress``: a bar over each run's steps trained in this
    process ("sweep <sweep>: <value>"). The recorded ``fields`` are part of every point's record:
    a table kept with fewer fields is measured again.

    Writes ``out`` (Parquet, atomically): one row per metrics record of every point in ``cfgs``
    (points not asked for are dropped), columns ``key`` (the point value), ``fields`` (from each
    metrics record, null where a record lacks one), ``columns`` ({name: polars expression over
    those}), made_by, measured_at and the load just before the points were trained
    (``load_columns``). Returns that frame with ``reused`` (True: read back). Raises what
    ``labkit.train.train`` raises (a failed point fails the sweep; nothing is written)."""
    import json

    old = pl.DataFrame() if force or not os.path.exists(out) else pl.read_parquet(out)
    frames, todo = {}, []
    settings = {value: settings[value] | {"fields": list(fields)} for value in cfgs}
    for value in cfgs:
        rows = old.filter(pl.col(key) == value) if old.height else old
        first = rows.row(0, named=True) if rows.height else None
        if reusable(sweep, f"{key} {value}", first, settings[value]):
            frames[value] = rows.with_columns(reused=pl.lit(True))
        else:
            todo.append(value)
    load = load_columns()  # just before the points measured now

    def curve(value) -> pl.DataFrame:
        records = [json.loads(line) for line in Path(cfgs[value].run_dir, "metrics.jsonl").read_text().splitlines()]
        return pl.DataFrame([{key: value, **{f: r.get(f) for f in fields}, **point(settings[value], load)}
                             for r in records], infer_schema_length=None).with_columns(**(columns or {}))

    if executor is None:
        for value in todo:
            _train_one(cfgs[value], f"sweep {sweep}: {value}" if progress else None)
    else:  # the longest first (forward passes: steps x accumulation), so no engine waits alone at the end
        order = sorted(todo, key=lambda v: -cfgs[v].max_steps * cfgs[v].batch.grad_accum_steps)
        for future in [executor.submit(_train_one, cfgs[v]) for v in order]:
            future.result()
    frames |= {value: curve(value) for value in todo}
    df = pl.concat([frames[v] for v in cfgs], how="diagonal_relaxed")
    return save(df, out)
