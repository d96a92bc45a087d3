"""Sweeps over a cluster: throughput vs ranks, the largest micro-batch per model size, loader
workers, throughput per model size, data x tensor x pipeline splits. Each point is one short run
(or one measurement) on the engines; a sweep's table is Parquet under ``<workdir>/sweeps/``.

Each row records what made it (``labkit.study.points``): ``made_by`` (JSON of the point's
settings: the run's ``TrainConfig`` without where it is written, the shard set's ``index.json``
sha256, the quantity, the model, budget, ...), ``measured_at`` (ISO 8601 UTC) and the machine's
load just before (``points.load_columns``). A point already in the table is reused only when its
``made_by`` equals the one it would be measured with now; otherwise it is measured again, with
one line on stderr naming the change (``sweep parallel dp2-tp1-pp1: max_steps 4 -> 8, measuring
again``). ``force=True`` measures all. The returned frame has a ``reused`` column (True: read
back from the table, measured at ``measured_at``, not now); the table on disk has none.
``reused_note`` is the one line every printer of a sweep shows for reused rows. A point measured
anew always trains in an emptied run directory (``points.fresh_run_dir``)."""

from __future__ import annotations

import contextlib
import sys

import polars as pl

from labkit.cluster.engines import call
from labkit.cluster.progress import StepProgress
from labkit.cluster.resumable import train_on_cluster
from labkit.config import TrainConfig, to_dict
from labkit.data import made_by
from labkit.data.shards import read_index
from labkit.measure import check_cpu_budget
from labkit.model import count_parameters, flops_per_token, model_config
from labkit.study import gpu, memory
from labkit.study.goodput import goodput_columns
from labkit.study.loader_sweep import sweep_loader
from labkit.study.points import (BUSY_LOAD_PER_CPU, done_rows, fresh_run_dir, load_columns, machine_load, point,
                                 reusable, reused_note, run_settings, save)
from labkit.workdir import paths

__all__ = [
    "BUSY_LOAD_PER_CPU", "machine_load", "parallel_grid", "sweep_config", "sweep_loader_workers", "sweep_micro_batch",
    "sweep_model_size", "sweep_parallel", "sweep_ranks", "reused_note", "run_settings"
]


NO_EVAL = {"enabled": False, "every": 0}
"""The eval section of every timed sweep run (ranks, model sizes, splits): no held-out evaluation,
not even at the end. Their quantity is a time; an evaluation would only add its forward passes to
the point's cost (a third of an 8-step ``mini`` run on one CPU rank). ``eval`` is in
``points.TIME_FREE``, so points measured with an evaluation are still reused."""


def sweep_config(workdir: str, **fields) -> TrainConfig:
    """The base TrainConfig of the lab's short sweep runs on ``<workdir>/shards`` (notebooks 04
    and 06 and ``labkit demo`` build theirs here, so that the demo's points are the notebooks'):
    one warm-up step, one thread per rank, a new run each time, ``<workdir>/runs/sweep`` (each
    point trains in its own run directory); ``fields`` give the rest (model, max_steps, a section
    as a dict: ``batch={"micro_batch_size": 16}``, ...)."""
    fields = {"schedule": {"warmup_steps": 1}} | fields
    return TrainConfig(**({"data_dir": f"{workdir}/shards", "run_dir": f"{workdir}/runs/sweep", "num_threads": 1,
                           "resume": False} | fields))


def _bar(progress: bool, total: int, label: str):
    """A progress bar over a point's ``total`` steps (``StepProgress``, a ``live`` callback and a
    context manager) when ``progress``, else a context holding None (no bar)."""
    return StepProgress(total, label=label) if progress else contextlib.nullcontext()


def sweep_ranks(client, base: TrainConfig, workdir: str, *, ranks: list[int] | None = None,
                staged: dict[str, dict] | None = None, force: bool = False, b_noise: float | None = None,
                b_noise_source: str | None = None, progress: bool = False) -> pl.DataFrame:
    """Weak scaling: the same per-rank micro-batch at 1..N ranks, one short run per point.

    Points already in ``sweeps/ranks.parquet`` are not rerun. Columns: ranks, model,
    micro_batch_size, global_batch_size, tokens_per_s (all ranks, after timing warm-up),
    samples_per_s, data_wait_fraction, comm_exposed_s and comm_exposed_fraction (gradient
    all-reduce not hidden behind backward, mean seconds per timed step and share of the step;
    ``labkit.measure.comm_exposed_s``; 0 at one rank; null in rows measured before it existed),
    efficiency = tokens_per_s(n) / (n * tokens_per_s(1)), and the machine's load just before the point (``points.load_columns``: load_avg_1m, load_avg_5m,
    cpu_count, busy). Sweep runs write metrics and result.json, no checkpoint, and evaluate nothing
    (``NO_EVAL``). ``progress``: a
    bar over each measured point's steps (``StepProgress``), drawn here.

    Statistical goodput (``labkit.study.goodput.goodput_columns``, per model and micro-batch):
    b_simple (each run's in-run noise scale, null at one rank without accumulation), b_noise and
    b_noise_source (``b_noise`` given, e.g. a batch sweep's B_crit, named by ``b_noise_source``;
    else the in-run B_simple of the run with the most ranks), statistical_efficiency E(B) against
    the one-rank global batch, and goodput_tokens_per_s = tokens_per_s x E(B).
    """
    out = paths(workdir)["sweeps"] / "ranks.parquet"
    ranks = ranks or list(range(1, len(client.ids) + 1))
    derived = ("efficiency", "b_noise", "b_noise_source", "statistical_efficiency", "goodput_tokens_per_s")
    rows = [{k: v for k, v in r.items() if k not in derived} for r in done_rows(out, force)]
    have = {(r["ranks"], r["model"], r["micro_batch_size"]): r for r in rows}
    mb = base.batch.micro_batch_size
    for n in ranks:
        cfg = base.replace(run_dir=str(paths(workdir)["runs"] / f"sweep-ranks-{base.model}-{n}"), resume=False,
                           checkpoint={"enabled": False}, eval=NO_EVAL)
        settings = run_settings(cfg, ranks=n)
        old = have.get((n, base.model, mb))
        if reusable("ranks", f"{n} rank(s)", old, settings):
            continue
        rows = [r for r in rows if r is not old]
        load = load_columns(client, client.ids[0])
        with _bar(progress, cfg.max_steps, f"sweep ranks: {n} rank(s)") as bar:
            res = train_on_cluster(client, fresh_run_dir(cfg), targets=client.ids[:n], staged=staged, live=bar)
        rows.append({"ranks": n, "model": base.model, "micro_batch_size": mb,
                     "global_batch_size": res["global_batch_size"], "tokens_per_s": res["tokens_per_s"],
                     "samples_per_s": res["samples_per_s"], "data_wait_fraction": res["data_wait_fraction"],
                     "comm_exposed_s": res["comm_exposed_s"], "comm_exposed_fraction": res["comm_exposed_fraction"],
                     "b_simple": res.get("b_simple"), **load, **point(settings)})
    df = pl.DataFrame(rows, infer_schema_length=None).sort("model", "micro_batch_size", "ranks")
    one = (df.filter(pl.col("ranks") == 1).select("model", "micro_batch_size", pl.col("tokens_per_s").alias("_t1")))
    df = df.join(one, on=["model", "micro_batch_size"], how="left").with_columns(
        (pl.col("tokens_per_s") / (pl.col("ranks") * pl.col("_t1"))).alias("efficiency")
    ).drop("_t1")
    if "b_simple" not in df.columns:  # every row from a table written before the column
        df = df.with_columns(b_simple=pl.lit(None, dtype=pl.Float64))
    df = goodput_columns(df, batch="global_batch_size", throughput="tokens_per_s", group=["model", "micro_batch_size"],
                         b_noise=b_noise, source=b_noise_source)
    return save(df, out)


def _engine_memory() -> dict:
    """On an engine: ``available_memory()`` plus its pid, hostname and cgroup OOM-kill count."""
    import os
    import socket

    from labkit.cluster.engine_watch import oom_kills
    from labkit.measure import available_memory

    return available_memory() | {"pid": os.getpid(), "hostname": socket.gethostname(), "oom_kills": oom_kills()}


def _search(engine, fn, *args, name: str, before: dict, engine_id: int):
    """``engine.apply_sync(fn, *args)`` that Ctrl-C interrupts (``labkit.cluster.engines.call``); an
    engine that dies under it raises RuntimeError saying how
    (the signal; probably out of memory when the kernel says so: ``engine_watch.death_cause``)."""
    import socket

    from ipyparallel.error import EngineError

    from labkit.cluster.engine_watch import death_cause

    try:
        return call(engine, fn, *args)
    except EngineError as err:
        cause = death_cause(before["pid"], local=before["hostname"] == socket.gethostname(),
                            oom_kills_before=before["oom_kills"])
        raise RuntimeError(f"micro-batch search for {name}: engine {engine_id} (pid {before['pid']}) died: {cause}. "
                           f"Use a smaller budget, or plan it without allocating: labkit plan --model {name}") from err


def sweep_micro_batch(client, models: list[str], *, seq_len: int, vocab_size: int, budget_bytes: int | None,
                      workdir: str, force: bool = False, progress: bool = False) -> pl.DataFrame:
    """Largest micro-batch per model size, measured on an engine: under a per-rank memory
    budget (``labkit.study.memory.max_micro_batch``: model state as a DDP rank holds it plus the
    step's counted peak of activations and transients, ``plan_model``), or with ``budget_bytes=None`` on the
    engine's GPU until out of memory (``labkit.study.gpu.max_micro_batch_cuda``; budget_bytes is
    then the device's memory). Cached in ``sweeps/microbatch.parquet``; measured points are
    not rerun. A budget above the memory the engine's machine or cgroup can give is refused
    before any search (``labkit.measure.check_cpu_budget``, ValueError); an engine that dies in a search raises
    RuntimeError with the signal and whether the kernel ran out of memory. ``progress``: one line
    on stderr per model searched (a search is one engine call, with no steps to count).
    """
    out = paths(workdir)["sweeps"] / "microbatch.parquet"
    rows = [{"method": "budget", **r} for r in done_rows(out, force)]  # tables written before the GPU method
    have = {(r["model"], r["seq_len"], r["budget_bytes"] if r["method"] == "budget" else None): r for r in rows}
    eid = client.ids[0]
    engine = client[eid]
    for name in models:
        mcfg = model_config(name, vocab_size)
        settings = {"model_config": to_dict(mcfg), "seq_len": seq_len, "vocab_size": vocab_size,
                    "budget_bytes": budget_bytes, "measures": "max_micro_batch"}
        old = have.get((name, seq_len, budget_bytes))
        if reusable("micro-batch", name, old, settings):
            continue
        rows = [r for r in rows if r is not old]
        if progress:
            print(f"sweep micro-batch: searching the largest micro-batch of {name}", file=sys.stderr, flush=True)
        before = call(engine, _engine_memory)
        if budget_bytes is None:
            rep = _search(engine, gpu.max_micro_batch_cuda, mcfg, seq_len, name=name, before=before, engine_id=eid)
            rep |= {"state_bytes": memory.model_state_bytes(mcfg), "act_bytes_per_sample": None}
        else:
            check_cpu_budget(budget_bytes, before, model=name)
            rep = _search(engine, memory.max_micro_batch, mcfg, seq_len, budget_bytes, name=name, before=before,
                          engine_id=eid) \
                | {"budget_bytes": budget_bytes}
        rows.append({"method": "budget" if budget_bytes else "cuda_oom", "model": name, "params": int(rep["params"]),
                     "seq_len": seq_len, "budget_bytes": int(rep["budget_bytes"]), "state_bytes": int(rep["state_bytes"]),
                     "act_bytes_per_sample": rep["act_bytes_per_sample"],
                     "transient_bytes": rep.get("transient_bytes"), "max_micro_batch": int(rep["max_micro_batch"]),
                     **point(settings)})
    return save(pl.DataFrame(rows, infer_schema_length=None).sort("params"), out)


def sweep_loader_workers(client, workdir: str, *, batch_size: int, step_time_s: float,
                         workers: list[int] | tuple[int, ...] = (0, 1, 2), n_batches: int = 30,
                         staged: dict[str, dict] | None = None, force: bool = False, **kw) -> pl.DataFrame:
    """Lesson 3: samples/s and data-wait fraction per DataLoader worker count, in front of a
    consumer taking ``step_time_s`` per batch (a planned GPU step, ``labkit.study.scaling.compute_time``),
    run on the first engine with ``labkit.study.loader_sweep.sweep_loader`` (the loader helper's
    sweep) on its node's staged copy when ``staged`` is given. Worker counts already in
    ``sweeps/loader.parquet`` for the same batch_size and step_time_s are not rerun; ``knee`` is
    recomputed over the whole table (fewest workers with data-wait fraction below 5 %). Rows
    measured now carry the machine's load just before (``points.load_columns``: load_avg_1m,
    load_avg_5m, cpu_count, busy); the micro-batch sweep alone has none (it counts memory, which
    the load does not change).
    """
    out = paths(workdir)["sweeps"] / "loader.parquet"
    rows = [{k: v for k, v in r.items() if k != "knee"} for r in done_rows(out, force)]
    have = {(r["num_workers"], r["batch_size"], r["step_time_s_planned"]): r for r in rows}
    settings = {"batch_size": batch_size, "step_time_s": step_time_s, "n_batches": n_batches,
                "data": made_by.file_identity(paths(workdir)["shards"] / "index.json"), "measures": "data_wait",
                **kw}
    todo = [w for w in workers
            if not reusable("loaders", f"{w} worker(s)", have.get((w, batch_size, step_time_s)), settings)]
    rows = [r for r in rows if (r["num_workers"], r["batch_size"], r["step_time_s_planned"])
            not in {(w, batch_size, step_time_s) for w in todo}]
    data_dir = str(paths(workdir)["shards"])
    if staged:
        data_dir = next(iter(staged.values()))["path"]
    if todo:
        load = load_columns(client, client.ids[0])
        table = call(client[client.ids[0]], sweep_loader, data_dir, batch_size=batch_size,
                     step_time_s=step_time_s, workers=todo, n_batches=n_batches,
                     gpu_index=None, **kw)
        rows += [r | {"batch_size": batch_size, "step_time_s_planned": step_time_s} | load | point(settings)
                 for r in table.drop("knee").to_dicts()]
    df = pl.DataFrame(rows, infer_schema_length=None).sort("batch_size", "step_time_s_planned", "num_workers")
    knee = (pl.col("data_wait_fraction") < 0.05) & (
        pl.col("num_workers") == pl.col("num_workers").filter(pl.col("data_wait_fraction") < 0.05).min()
        .over("batch_size", "step_time_s_planned"))
    return save(df.with_columns(knee=knee.fill_null(False)), out)


def sweep_model_size(client, base: TrainConfig, workdir: str, *, models: list[str], ranks: int | None = None,
                     staged: dict[str, dict] | None = None, force: bool = False, progress: bool = False) -> pl.DataFrame:
    """Throughput per model size at a fixed number of ranks, one short run per model (lesson 5:
    larger models fit smaller batches and cost throughput). Models already in
    ``sweeps/model_size.parquet`` at the same ranks and micro-batch are not rerun. Columns:
    model, params, non_embedding_params, ranks, micro_batch_size, seq_len, tokens_per_s,
    samples_per_s, flops_per_token (``labkit.model.flops_per_token``), achieved_flops
    (tokens_per_s x flops_per_token, all ranks), comm_exposed_s (as in ``sweep_ranks``), and the machine's load before the run
    (load_avg_1m, load_avg_5m, cpu_count, busy; ``points.load_columns``). No checkpoints are written, no
    held-out evaluation runs (``NO_EVAL``).
    ``progress``: a bar over each measured point's steps (``StepProgress``)."""
    out = paths(workdir)["sweeps"] / "model_size.parquet"
    n = ranks or len(client.ids)
    rows = done_rows(out, force)
    have = {(r["model"], r["ranks"], r["micro_batch_size"]): r for r in rows}
    index = read_index(base.data_dir)
    for name in models:
        cfg = base.replace(model=name, resume=False, checkpoint={"enabled": False}, eval=NO_EVAL,
                           run_dir=str(paths(workdir)["runs"] / f"sweep-size-{name}-{n}"))
        settings = run_settings(cfg, ranks=n)
        old = have.get((name, n, base.batch.micro_batch_size))
        if reusable("model-size", name, old, settings):
            continue
        rows = [r for r in rows if r is not old]
        load = load_columns(client, client.ids[0])
        with _bar(progress, cfg.max_steps, f"sweep model size: {name}") as bar:
            res = train_on_cluster(client, fresh_run_dir(cfg), targets=client.ids[:n], staged=staged, live=bar)
        mcfg = model_config(name, index["vocab_size"], **base.model_overrides)
        fpt = flops_per_token(mcfg, index["seq_len"], mlm_probability=base.data.mlm_probability)
        counts = count_parameters(mcfg)
        rows.append({"model": name, "params": counts["total"], "non_embedding_params": counts["non_embedding"],
                     "ranks": n, "micro_batch_size": base.batch.micro_batch_size, "seq_len": index["seq_len"],
                     "tokens_per_s": res["tokens_per_s"], "samples_per_s": res["samples_per_s"],
                     "flops_per_token": fpt, "achieved_flops": res["tokens_per_s"] * fpt,
                     "comm_exposed_s": res["comm_exposed_s"], **load, **point(settings)})
    return save(pl.DataFrame(rows, infer_schema_length=None).sort("params", "ranks"), out)


def parallel_grid(n: int, mcfg, *, micro_batches: int, seq_len: int) -> list[dict]:
    """Every split dp x tp x pp = ``n`` a run of ``mcfg`` can take (tp dividing the heads, the FFN
    width and ``seq_len`` (sequence parallelism), with an attention kind checked under tensor
    parallelism; pp at most the layers), the least
    model parallelism first; pp > 1 under GPipe, and under 1F1B when ``micro_batches`` >= pp.
    Each: {"tp", "pp", "pp_schedule"} (pp_schedule None without pp)."""
    from labkit.train.parallel import TP_ATTENTION

    out = []
    for tp in (t for t in range(1, n + 1) if n % t == 0 and mcfg.num_heads % t == 0 and mcfg.ffn_size % t == 0
               and seq_len % t == 0 and (t == 1 or mcfg.attention in TP_ATTENTION)):
        for pp in (p for p in range(1, n // tp + 1) if (n // tp) % p == 0 and p <= mcfg.num_layers):
            schedules = [None] if pp == 1 else ["gpipe"] + (["1f1b"] if micro_batches >= pp else [])
            out += [{"tp": tp, "pp": pp, "pp_schedule": s} for s in schedules]
    return sorted(out, key=lambda g: (g["tp"] * g["pp"], g["pp"], g["pp_schedule"] or ""))


def sweep_parallel(client, base: TrainConfig, workdir: str, *, splits: list[dict] | None = None,
                   micro_batches: int = 4, steps: int = 8, staged: dict[str, dict] | None = None,
                   force: bool = False, progress: bool = False) -> pl.DataFrame:
    """Data, tensor and pipeline parallelism on all engines, each split one short run beside the
    planner: the same model and global batch (``base.batch.micro_batch_size`` x ``micro_batches`` x engines
    sequences) at every split of ``parallel_grid`` (or ``splits``: dicts of tp, pp, pp_schedule), each
    data-parallel replica taking its share in ``micro_batches`` micro-batches (the pipeline's m).
    Model-parallel splits replicate over dp (``sharding="replicate"``; tp > 1 with sequence
    parallelism, as the planner assumes), dp alone uses DDP.

    Per split, ``steps`` optimiser steps (``train_on_cluster``; no checkpoints, no held-out
    evaluation: ``NO_EVAL``) give tokens/s,
    samples/s, step_time_s, the measured pipeline bubble and time in TP collectives (result.json:
    means after the warm-up steps), and one ``labkit.study.parallel.measure_rank_memory`` call on the
    engines the per-rank memory (the largest rank's); beside them the planner's bubble and per-rank
    memory (``planned_rank_memory``). Tidy: one row per split, in ``sweeps/parallel.parquet``;
    splits already there (same model, micro-batches and global batch) are not rerun. Columns: dp,
    tp, pp, pp_schedule, micro_batches, micro_batch_size, global_batch_size, model, world_size,
    tokens_per_s, samples_per_s, step_time_s, pipeline_bubble, planned_bubble, tp_comm_s,
    tp_comm_fraction (of the step), measured_/planned_ state_bytes, activation_bytes, total_bytes,
    and the machine's load before the run (``points.load_columns``). ``progress``: a bar over each
    measured split's steps (``StepProgress``)."""
    from labkit.cluster.launch import run_ddp
    from labkit.study.parallel import measure_rank_memory, planned_rank_memory
    from labkit.train.run_config import model_config_of

    out = paths(workdir)["sweeps"] / "parallel.parquet"
    n = len(client.ids)
    index = read_index(base.data_dir)
    mcfg = model_config_of(base, int(index["vocab_size"]))
    global_batch = base.batch.micro_batch_size * micro_batches * n
    rows = done_rows(out, force)
    have = {(r["dp"], r["tp"], r["pp"], r["pp_schedule"], r["model"], r["micro_batches"], r["global_batch_size"]): r
            for r in rows}
    staged_paths = {node: info["path"] for node, info in staged.items()} if staged else None
    for split in splits or parallel_grid(n, mcfg, micro_batches=micro_batches, seq_len=int(index["seq_len"])):
        tp, pp, schedule = split["tp"], split["pp"], split.get("pp_schedule")
        dp = n // (tp * pp)
        name = f"sweep-parallel-{base.model}-dp{dp}-tp{tp}-pp{pp}" + (f"-{schedule}" if schedule else "")
        cfg = base.replace(parallel={"tp": tp, "pp": pp, "pp_schedule": schedule or "1f1b",
                                     "sharding": "replicate" if tp * pp > 1 else "ddp", "sequence_parallel": tp > 1},
                           batch={"grad_accum_steps": micro_batches,
                                  "micro_batch_size": global_batch // (dp * micro_batches)},
                           max_steps=steps, run_dir=str(paths(workdir)["runs"] / name), resume=False,
                           checkpoint={"enabled": False}, eval=NO_EVAL)
        settings = run_settings(cfg, world_size=n)
        old = have.get((dp, tp, pp, schedule, base.model, micro_batches, global_batch))
        if reusable("parallel", name.removeprefix(f"sweep-parallel-{base.model}-"), old, settings):
            continue
        rows = [r for r in rows if r is not old]
        load = load_columns(client, client.ids[0])
        with _bar(progress, steps, f"sweep parallel: {name.removeprefix(f'sweep-parallel-{base.model}-')}") as bar:
            res = train_on_cluster(client, fresh_run_dir(cfg), staged=staged, live=bar)
        memory = max(run_ddp(client, measure_rank_memory, cfg, staged_paths=staged_paths, stream=False),
                     key=lambda r: r["total_bytes"])
        planned = planned_rank_memory(mcfg, cfg, world=n, seq_len=int(index["seq_len"]))
        step_time = res["global_batch_size"] / res["samples_per_s"]
        rows.append({"dp": dp, "tp": tp, "pp": pp, "pp_schedule": schedule, "micro_batches": micro_batches,
                     "micro_batch_size": cfg.batch.micro_batch_size, "global_batch_size": res["global_batch_size"],
                     "model": base.model, "world_size": n, "tokens_per_s": res["tokens_per_s"],
                     "samples_per_s": res["samples_per_s"], "step_time_s": step_time,
                     "pipeline_bubble": res["pipeline_bubble"], "planned_bubble": planned["bubble"],
                     "tp_comm_s": res["tp_comm_s"],
                     "tp_comm_fraction": res["tp_comm_s"] / step_time if res["tp_comm_s"] is not None else None,
                     **{f"measured_{k}": memory[k] for k in ("state_bytes", "activation_bytes", "total_bytes")},
                     **{f"planned_{k}": int(planned[k]) for k in ("state_bytes", "activation_bytes", "total_bytes")},
                     "steps": steps, **load, **point(settings)})
    df = pl.DataFrame(rows, infer_schema_length=None).with_columns(_order=pl.col("tp") * pl.col("pp"))
    return save(df.sort("_order", "pp", "pp_schedule", nulls_last=False).drop("_order"), out)
