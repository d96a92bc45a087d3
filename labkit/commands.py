"""What each ``labkit`` subcommand does: the functions the notebooks call, on a cluster started
(or connected to) as the notebooks do. ``labkit.cli`` parses the arguments and calls these;
each returns the exit status and prints its result as JSON (tables: polars' text table).
Every value that needs no engine is checked first (``labkit.preflight``), before engines start.
``labkit plan`` and ``labkit forecast``, which need no cluster, are ``labkit.planning``,
``labkit.model_module`` and ``labkit.forecasting``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys
from typing import Any, Iterator

from labkit.config.tomlfile import ClusterConfig, LabConfig

__all__ = ["cluster_client", "export", "prepare", "resume", "run_world_size", "stage", "sweep", "train"]


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _print_table(df) -> None:
    import polars as pl

    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, tbl_hide_dataframe_shape=True,
                   tbl_hide_column_data_types=True, tbl_hide_dtype_separator=True):
        print(df)


@contextlib.contextmanager
def cluster_client(cc: ClusterConfig) -> Iterator[Any]:
    """An ``ipyparallel.Client`` on the engines ``cc`` describes: a running cluster when
    ``cc.cluster_id`` is set (left running), else a new one (local, Slurm or MPI) that is
    stopped on exit, also on an error or Ctrl-C."""
    from labkit import cluster as lc

    kw = {"profile": cc.profile} if cc.profile else {}
    if cc.cluster_id:
        yield lc.get_client(lc.connect_cluster(cc.cluster_id, **kw))
        return
    print(f"starting {cc.engines if cc.kind != 'slurm' else 'Slurm'} {cc.kind} engine(s)", file=sys.stderr, flush=True)
    cluster = lc.start_cluster(None if cc.kind == "slurm" else cc.engines, engines=cc.kind,
                               slurm=dict(cc.slurm) or None, **kw)
    try:
        yield lc.get_client(cluster)
    finally:
        lc.stop_cluster(cluster)


def prepare(cfg: LabConfig, *, force: bool = False) -> int:
    """Corpus, cleaning, tokenizer and shards (notebook 01) under ``cfg.workdir``; prints
    ``lab.preparation_report``."""
    from labkit import preflight

    preflight.check_prepare(cfg)
    from labkit import lab  # after the checks: its imports (torch, ipyparallel) take seconds
    with cluster_client(cfg.cluster) as client:
        report = lab.prepare(client, cfg, force=force)
    _print_json(report)
    return 0


def _require_shards(data_dir: str | pathlib.Path, key: str) -> None:
    """FileNotFoundError naming ``key`` when ``data_dir`` holds no shard index (checked here,
    before engines are started for nothing)."""
    if not (pathlib.Path(data_dir) / "index.json").is_file():
        raise FileNotFoundError(f"{key}: {data_dir} holds no shard set (index.json); run labkit prepare first")


def _local(cc: ClusterConfig) -> bool:
    """Whether the engines will be local processes of this machine (what preflight may check here)."""
    return cc.kind == "local" and not cc.cluster_id


def _stage(client, cfg: LabConfig) -> dict[str, dict]:
    from labkit import lab

    return lab.stage(client, cfg.workdir, local_root=cfg.stage.local_root, verify=cfg.stage.verify)


def stage(cfg: LabConfig) -> int:
    """Copy the shards to every node's local disk, checksums verified (notebook 02)."""
    _require_shards(pathlib.Path(cfg.workdir) / "shards", "workdir")
    with cluster_client(cfg.cluster) as client:
        _print_json(_stage(client, cfg))
    return 0


def _summary(result: dict) -> dict:
    """The result's main numbers as ``labkit train`` / ``resume`` print them: the training loss
    at the first and last step and the held-out ``eval_loss`` / ``perplexity`` of the last
    evaluation (None when the run evaluated nothing), then steps, tokens, speed, world size, the
    run's wall-clock goodput and its culprit's line (None when no rank held the others up)."""
    keys = ("initial_loss", "final_loss", "eval_loss", "perplexity", "steps", "max_steps", "tokens", "tokens_per_s",
            "world_size", "global_batch_size", "resumed_from_step", "wall_s", "goodput")
    return {k: result.get(k) for k in keys} | {"culprit": (result.get("culprit") or {}).get("line")}


def _uses_workdir_shards(cfg: LabConfig) -> bool:
    return pathlib.Path(cfg.train.data_dir).resolve() == (pathlib.Path(cfg.workdir) / "shards").resolve()


def _culprit_line():
    """The live culprit line of ``labkit train`` / ``resume`` (stderr, when it changes)."""
    from labkit.rankview import CulpritLine

    return CulpritLine()


def train(cfg: LabConfig, *, stage_first: bool = True) -> int:
    """DDP training on the engines (notebook 03); each rank reads its node's staged copy when
    the run's data_dir is the work directory's shards. Prints the result's main numbers; while it
    trains, one line on stderr names the rank that holds the others up (``CulpritLine``)."""
    from labkit import preflight

    preflight.check_train(cfg.train, engines=cfg.cluster.engines, local=_local(cfg.cluster))
    from labkit.train.run_config import finished_run

    done = finished_run(cfg.train)  # a finished run of this config: said so, no engine started, no file touched
    if done is not None:
        _print_json(_summary(done) | {"run_dir": cfg.train.run_dir, "already_finished": True})
        return 0
    from labkit import lab
    with cluster_client(cfg.cluster) as client:
        staged = _stage(client, cfg) if stage_first and _uses_workdir_shards(cfg) else None
        result = lab.train_on_cluster(client, cfg.train, staged=staged, live=_culprit_line())
    _print_json(_summary(result) | {"run_dir": cfg.train.run_dir})
    return 0


def resume(run_dir: str, cluster: ClusterConfig, overrides: list[str]) -> int:
    """Continue a run from its newest checkpoint with the config it was started with (its
    config.json; ``train.key=value`` overrides), on as many engines as it ran on. The run's
    ``stop_after`` is dropped unless an override sets it again."""
    from labkit import preflight
    from labkit.config.tomlfile import read_run_config

    cfg = read_run_config(run_dir, overrides)
    if not any(o.split("=", 1)[0].strip() == "train.stop_after" for o in overrides):
        cfg = dataclasses.replace(cfg, stop_after=None)
    cfg = dataclasses.replace(cfg, resume=True)
    preflight.check_train(cfg, engines=cluster.engines, local=_local(cluster))
    from labkit.train.run_config import finished_run

    done = finished_run(cfg)  # nothing left to train: said so, no engine started, no file touched
    if done is not None:
        _print_json(_summary(done) | {"run_dir": run_dir, "already_finished": True})
        return 0
    from labkit import lab
    with cluster_client(cluster) as client:
        result = lab.train_on_cluster(client, cfg, live=_culprit_line())
    _print_json(_summary(result) | {"run_dir": run_dir})
    return 0


def run_world_size(run_dir: str) -> int | None:
    """The world size a run was written with (its config.json provenance), None if unknown."""
    path = pathlib.Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    return (json.loads(path.read_text()).get("provenance") or {}).get("world_size")


def _sweep_batch(cfg: LabConfig, args) -> int:
    """``labkit sweep batch``: the critical batch measured directly (labkit.study.critical_batch),
    printed with the in-run B_simple at the target."""
    from labkit.study.critical_batch import sweep_batch

    if cfg.train.eval.every <= 0 and not cfg.train.data_dir:
        raise ValueError("train.data_dir: the batch sweep needs shards with a held-out split")
    df, fit = sweep_batch(cfg.train, cfg.workdir, batch_sizes=args.batches, target=args.target,
                          lr_rule=args.lr_rule, max_examples=args.examples, force=args.force)
    _print_table(df.select("batch", "lr", "steps", "examples", "reached", "b_simple", "b_simple_tokens",
                           "final_eval_loss", "reused"))
    if "b_crit" in fit:
        print(f"B_crit = E_min/S_min = {fit['b_crit']:.1f} sequences ({100 * fit['level']:.0f} % bootstrap range "
              f"{fit['b_crit_low']:.1f}-{fit['b_crit_high']:.1f}) at held-out loss {fit['target_eval_loss']:.3f}, "
              f"{fit['reached']} batch sizes reached it; sweeps/critical_batch.parquet in {cfg.workdir}")
    else:
        print(f"only {fit['reached']} batch sizes reached held-out loss {fit['target_eval_loss']:.3f}: no fit")
    return 0


def sweep(kind: str, cfg: LabConfig, args) -> int:
    """The scaling sweeps of notebook 04: ``ranks`` (tokens/s at 1..N ranks), ``micro-batch``
    (largest micro-batch per model under a memory budget), ``loaders`` (data-wait fraction per
    DataLoader worker count), and notebook 06's ``parallel`` (every dp x tp x pp split of the
    engines: throughput, measured bubble, time in TP collectives and per-rank memory beside the
    planner). ``network`` (root; no engines): 2 ranks across two network hosts at each link
    setting, beside the network model (``labkit.study.network_sweep``). Prints the sweep's table
    (also under <workdir>/sweeps/)."""
    from labkit import preflight

    w = cfg.workdir
    if kind == "batch":  # one process per batch size, here (labkit.study.critical_batch)
        return _sweep_batch(cfg, args)
    if kind == "network":
        return _sweep_network(cfg, args)
    preflight.check_sweep(kind, cfg, args)
    from labkit import lab
    from labkit.data.shards import read_index
    with cluster_client(cfg.cluster) as client:
        if kind == "ranks":
            staged = _stage(client, cfg) if _uses_workdir_shards(cfg) else None
            df = lab.sweep_ranks(client, cfg.train, w, ranks=args.ranks, staged=staged, force=args.force)
        elif kind == "micro-batch":
            index = read_index(cfg.train.data_dir)
            budget = int(args.budget_gib * 2**30) if args.budget_gib else None
            df = lab.sweep_micro_batch(client, args.models or [cfg.train.model], seq_len=int(index["seq_len"]),
                                       vocab_size=int(index["vocab_size"]), budget_bytes=budget, workdir=w,
                                       force=args.force)
        elif kind == "parallel":
            staged = _stage(client, cfg) if _uses_workdir_shards(cfg) else None
            df = lab.sweep_parallel(client, cfg.train, w, micro_batches=args.micro_batches, steps=args.steps or 8,
                                    staged=staged, force=args.force)
        else:
            staged = _stage(client, cfg) if _uses_workdir_shards(cfg) else None
            df = lab.sweep_loader_workers(client, w, batch_size=cfg.train.batch.micro_batch_size,
                                          step_time_s=args.step_time_s, workers=args.workers, staged=staged,
                                          force=args.force)
    if kind == "parallel":  # 26 columns: the ones to read, memory in GB; the rest stay in the Parquet file
        import polars as pl

        gb = [pl.col(c) / 1e9 for c in ("measured_total_bytes", "planned_total_bytes")]
        df = df.select("dp", "tp", "pp", "pp_schedule", "micro_batches", "tokens_per_s", "pipeline_bubble",
                       "planned_bubble", "tp_comm_fraction",
                       gb[0].alias("measured_GB_per_rank"), gb[1].alias("planned_GB_per_rank"),
                       *[c for c in ("busy", "reused") if c in df.columns])
        print(f"sweeps/parallel.parquet in {w} holds every column (load, state and activation bytes)")
    note = lab.reused_note(df)
    if note:
        print(note)
    _print_table(df)
    return 0


def _sweep_network(cfg: LabConfig, args) -> int:
    """``labkit sweep network``: ``labkit.study.network_sweep.run_network_sweep`` on CONFIG's
    [train] (its --set overrides passed on to every rank) and its shards; prints the table."""
    from labkit.preflight import check_model as _check
    from labkit.study.network_sweep import run_network_sweep

    models = args.models or [cfg.train.model]
    for name in models:
        _check(name, {}, key="--models")
    if any(r < 0 for r in args.rates_mbit):
        raise ValueError(f"--rates-mbit: must be >= 0 (0: unshaped), got {args.rates_mbit}")
    steps = args.steps or 6
    if steps < 4:
        raise ValueError(f"--steps: the network sweep needs at least 4 (the first 2 untimed: DDP all-reduces the "
                         f"whole model as one bucket until it rebuilt its buckets), got {steps}")
    if not pathlib.Path(cfg.train.data_dir, "index.json").is_file():
        raise ValueError(f"train.data_dir: no shards at {cfg.train.data_dir} (run `labkit prepare {args.config}` first)")
    df = run_network_sweep(args.config, cfg.workdir, models=models, rates_mbit=[r or None for r in args.rates_mbit],
                           compressions=args.compression, steps=steps, data_dir=cfg.train.data_dir,
                           overrides=args.set, force=args.force)
    cols = ("model", "grad_compression", "rate_mbit", "link_mbit", "comm_bytes", "compute_s", "step_s", "efficiency",
            "comm_exposed_s", "predicted_step_s", "predicted_ratio", "reused")
    print(f"sweeps/network.parquet in {cfg.workdir} holds every column")
    _print_table(df.select(cols))
    return 0


def export(args) -> int:
    """``labkit.export.export_run``: model, tokenizer and model card for transformers."""
    from labkit.export import export_run

    out = export_run(args.run_dir, args.out, tokenizer_path=args.tokenizer, step=args.step, force=args.force)
    _print_json({"out": str(out), "files": sorted(p.name for p in out.iterdir())})
    return 0
