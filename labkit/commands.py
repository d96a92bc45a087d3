"""What each ``labkit`` subcommand does: the functions the notebooks call, on a cluster started
(or connected to) as the notebooks do. ``labkit.cli`` parses the arguments and calls these;
each returns the exit status and prints its result for a reader, in lines and tables
(``labkit.readout``; polars' text tables), or with ``--json`` as one JSON object on standard
output. Every value and path that needs no engine is checked first (``labkit.preflight``),
before engines start and before anything is printed: notes queued while the command line was
read (``note``) are printed once those checks passed. Training shows a progress bar over its
steps (``labkit.cluster.progress.StepProgress``), says where it stopped early, and on Ctrl-C
names its last checkpoint and the command that continues it (``Interrupted``).
``labkit plan`` and ``labkit forecast``, which need no cluster, are ``labkit.planning``,
``labkit.model_module`` and ``labkit.forecasting``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import sys
from typing import Any, Iterator

from labkit.config.tomlfile import ClusterConfig, LabConfig

__all__ = ["Interrupted", "cluster_client", "export", "note", "prepare", "resume", "run_world_size", "stage", "sweep",
           "train"]

_NOTES: list[str] = []


def note(line: str) -> None:
    """Queue one line for standard error, printed once the command's checks passed (a refusal
    comes before any output); ``labkit.cli`` clears the queue after each command."""
    _NOTES.append(line)


def _checked() -> None:
    """The command's checks passed: print the queued notes."""
    while _NOTES:
        print(_NOTES.pop(0), file=sys.stderr, flush=True)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C in a command that knows what to do next: ``note`` says it in one sentence (the run's
    last checkpoint and the command that continues it); ``labkit.cli`` prints it after
    "interrupted; engines were stopped."."""

    def __init__(self, note: str) -> None:
        super().__init__(note)
        self.note = note


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

    _checked()
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


def prepare(cfg: LabConfig, *, force: bool = False, as_json: bool = False) -> int:
    """Corpus, cleaning, tokenizer and shards (notebook 01) under ``cfg.workdir``; prints
    ``lab.preparation_report`` (``readout.prepare_lines``; the report itself with ``as_json``)."""
    from labkit import preflight, readout

    preflight.check_prepare(cfg)
    from labkit import lab  # after the checks: its imports (torch, ipyparallel) take seconds
    with readout.Output(as_json) as out:
        with cluster_client(cfg.cluster) as client:
            report = lab.prepare(client, cfg, force=force)
        out.show(report, readout.prepare_lines(report, cfg.workdir))
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


def stage(cfg: LabConfig, *, as_json: bool = False) -> int:
    """Copy the shards to every node's local disk, checksums verified (notebook 02); prints a
    line per node (``readout.stage_lines``; ``{node: report}`` with ``as_json``)."""
    from labkit import preflight, readout

    _require_shards(pathlib.Path(cfg.workdir) / "shards", "workdir")
    preflight.check_stage(cfg)
    with readout.Output(as_json) as out:
        with cluster_client(cfg.cluster) as client:
            staged = _stage(client, cfg)
        out.show(staged, readout.stage_lines(staged, str(pathlib.Path(cfg.workdir) / "shards")))
    return 0


def _summary(result: dict, run_dir: str, cluster: ClusterConfig, *, already_finished: bool = False) -> dict:
    """The result's main numbers as ``labkit train`` / ``resume`` print them: the training loss
    at the first and last step and the held-out ``eval_loss`` / ``perplexity`` of the last
    evaluation (None when the run evaluated nothing), then steps, tokens, speed, world size, the
    run's wall-clock goodput (fraction of its elapsed time) and its culprit's line (None when no
    rank held the others up); and where the run stands: run_dir, already_finished, stopped_early (fewer steps than max_steps:
    ``train.stop_after``), last_checkpoint (its path, None without one) and continue_command
    (``readout.continue_command``)."""
    from labkit.readout import continue_command
    from labkit.train.checkpoint import checkpoint_steps

    keys = ("initial_loss", "final_loss", "eval_loss", "perplexity", "steps", "max_steps", "tokens", "tokens_per_s",
            "world_size", "global_batch_size", "resumed_from_step", "wall_s", "goodput")
    steps = checkpoint_steps(run_dir)
    return {k: result.get(k) for k in keys} | {
        "culprit": (result.get("culprit") or {}).get("line"), "run_dir": str(run_dir),
        "already_finished": already_finished,
        "stopped_early": (result.get("steps") or 0) < (result.get("max_steps") or 0),
        "last_checkpoint": str(pathlib.Path(run_dir) / "checkpoints" / f"step-{steps[-1]}") if steps else None,
        "continue_command": continue_command(run_dir, cluster)}


def _uses_workdir_shards(cfg: LabConfig) -> bool:
    return pathlib.Path(cfg.train.data_dir).resolve() == (pathlib.Path(cfg.workdir) / "shards").resolve()


@contextlib.contextmanager
def _training(run_dir: str, cluster: ClusterConfig, tcfg) -> Iterator[Any]:
    """Around a run on the engines: the ``live`` callbacks for ``train_on_cluster``, a progress bar
    over its steps (``StepProgress``, from the newest checkpoint's step when it resumes) and the
    culprit line (``labkit.rankview.CulpritLine``, printed above the bar when it changes); Ctrl-C
    becomes ``Interrupted`` naming the run's last checkpoint and the command that continues it
    (or, without a checkpoint, the command that starts it again)."""
    from labkit.cluster.progress import StepProgress
    from labkit.env import COMMAND_ENV
    from labkit.readout import continue_command
    from labkit.train.checkpoint import checkpoint_steps

    from labkit.rankview import CulpritLine

    have = checkpoint_steps(run_dir) if tcfg.resume else []
    total = min(tcfg.max_steps, tcfg.stop_after or tcfg.max_steps)
    try:
        with StepProgress(total, label="train", initial=have[-1] if have else 0) as bar:
            yield [bar, CulpritLine(stream=bar.stream)]
    except KeyboardInterrupt:
        steps = checkpoint_steps(run_dir)
        if steps:
            raise Interrupted(f"Last checkpoint: {pathlib.Path(run_dir) / 'checkpoints' / f'step-{steps[-1]}'} "
                              f"(step {steps[-1]} of {tcfg.max_steps}); to continue from it: "
                              f"{continue_command(run_dir, cluster)}") from None
        again = os.environ.get(COMMAND_ENV) or continue_command(run_dir, cluster)
        every = tcfg.checkpoint.every
        raise Interrupted(f"No checkpoint of {run_dir} was written yet (train.checkpoint.every = {every}: "
                          f"{f'every {every} steps' if every else 'only at its last step'}); to start it again: "
                          f"{again}") from None


def train(cfg: LabConfig, *, stage_first: bool = True, as_json: bool = False) -> int:
    """DDP training on the engines (notebook 03); each rank reads its node's staged copy when
    the run's data_dir is the work directory's shards. Shows a progress bar while it trains (and
    above it, when it changes, the line naming the rank that holds the others up), then
    prints the result's main numbers (``readout.train_lines``; ``_summary`` with ``as_json``)."""
    from labkit import preflight, readout

    staging = stage_first and _uses_workdir_shards(cfg)
    preflight.check_train(cfg.train, engines=cfg.cluster.engines, local=_local(cfg.cluster))
    if staging:
        preflight.check_stage(cfg)
    _checked()
    from labkit.train.run_config import finished_run

    with readout.Output(as_json) as out:
        # a finished run of this config, resumed: said so, no engine started, no file touched (resume=False: a new run)
        done = finished_run(cfg.train) if cfg.train.resume else None
        if done is not None:
            summary = _summary(done, cfg.train.run_dir, cfg.cluster, already_finished=True)
        else:
            from labkit import lab
            with cluster_client(cfg.cluster) as client:
                staged = _stage(client, cfg) if staging else None
                with _training(cfg.train.run_dir, cfg.cluster, cfg.train) as lives:
                    result = lab.train_on_cluster(client, cfg.train, staged=staged, live=lives)
            summary = _summary(result, cfg.train.run_dir, cfg.cluster)
        out.show(summary, readout.train_lines(summary))
    return 0


def resume(run_dir: str, cluster: ClusterConfig, overrides: list[str], *, as_json: bool = False) -> int:
    """Continue a run from its newest checkpoint with the config it was started with (its
    config.json; ``train.key=value`` overrides), on as many engines as it ran on. The run's
    ``stop_after`` is dropped unless an override sets it again. Prints as ``train`` does."""
    from labkit import preflight, readout
    from labkit.config.tomlfile import read_run_config

    cfg = read_run_config(run_dir, overrides)
    if not any(o.split("=", 1)[0].strip() == "train.stop_after" for o in overrides):
        cfg = dataclasses.replace(cfg, stop_after=None)
    cfg = dataclasses.replace(cfg, resume=True)
    preflight.check_train(cfg, engines=cluster.engines, local=_local(cluster))
    _checked()
    from labkit.train.run_config import finished_run

    with readout.Output(as_json) as out:
        done = finished_run(cfg)  # nothing left to train: said so, no engine started, no file touched
        if done is not None:
            summary = _summary(done, run_dir, cluster, already_finished=True)
        else:
            from labkit import lab
            with cluster_client(cluster) as client, _training(run_dir, cluster, cfg) as lives:
                result = lab.train_on_cluster(client, cfg, live=lives)
            summary = _summary(result, run_dir, cluster)
        out.show(summary, readout.train_lines(summary))
    return 0


def run_world_size(run_dir: str) -> int | None:
    """The world size a run was written with (its config.json provenance), None if unknown."""
    path = pathlib.Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    return (json.loads(path.read_text()).get("provenance") or {}).get("world_size")


def _show_sweep(out, kind: str, df, path: pathlib.Path, *, extra: dict | None = None, note_line: str | None = None,
                columns: list | None = None, said: bool = False) -> None:
    """A sweep's result: the reused note (unless the sweep ``said`` it already, as the batch and
    network sweeps do on stderr) and the table (``columns``: the ones to read; the Parquet
    file holds all), its floats rounded to 4 significant figures, or with --json {"sweep", "table"
    (the Parquet path), "rows" (every column, raw values), **extra}."""
    import polars as pl

    from labkit import lab

    if out.as_json:
        out.show({"sweep": kind, "table": str(path), "rows": df.to_dicts(), **(extra or {})}, [])
        return
    for line in filter(None, (note_line, lab.reused_note(df) if "reused" in df.columns and not said else None)):
        print(line)
    shown = df.select(columns) if columns else df
    _print_table(shown.with_columns(pl.col(pl.Float64, pl.Float32).round_sig_figs(4)))


def _sweep_batch(cfg: LabConfig, args, out) -> int:
    """``labkit sweep batch``: the critical batch measured directly (labkit.study.critical_batch),
    printed with the in-run B_simple at the target and the statistical goodput."""
    from labkit.study.critical_batch import sweep_batch

    df, fit = sweep_batch(cfg.train, cfg.workdir, batch_sizes=args.batches, target=args.target,
                          lr_rule=args.lr_rule or cfg.train.batch.lr_rule, max_examples=args.examples,
                          force=args.force, progress=True)
    path = pathlib.Path(cfg.workdir) / "sweeps" / "critical_batch.parquet"
    if "b_crit" in fit:
        lines = [f"B_crit = E_min/S_min = {fit['b_crit']:.1f} sequences ({100 * fit['level']:.0f} % bootstrap range "
                 f"{fit['b_crit_low']:.1f}-{fit['b_crit_high']:.1f}) at held-out loss {fit['target_eval_loss']:.3f}, "
                 f"{fit['reached']} batch sizes reached it; {path}",
                 "statistical goodput = samples/s x E(B), E(B) = (B_crit + B0)/(B_crit + B), B0 the smallest batch "
                 "(labkit.measure.statistical_goodput); one process accumulating micro-batches, so a larger batch "
                 "buys few samples/s here"]
    else:
        lines = [f"only {fit['reached']} batch sizes reached held-out loss {fit['target_eval_loss']:.3f}: no fit"]
    _show_sweep(out, "batch", df, path, extra={"fit": fit}, said=True,
                columns=["batch", "lr", "steps", "examples", "reached", "b_simple", "b_simple_tokens", "final_eval_loss",
                         "samples_per_s", "statistical_efficiency", "goodput_samples_per_s", "reused"])
    if not out.as_json:
        print("\n".join(lines))
    return 0


def _sweep_branch(cfg: LabConfig, args, out) -> int:
    """``labkit sweep branch``: the local critical batch by branching from the run's checkpoints
    (labkit.study.branching), one process, printed per branch point with what agrees (with
    --json: {"sweep", "table", "rows" (the points), "runs" (the branches)})."""
    import polars as pl

    from labkit.study.branching import sweep_branch

    points, runs = sweep_branch(cfg.train, cfg.workdir, at=args.at, factors=args.factors, window=args.window,
                                repeats=args.repeats, tolerance=args.tolerance, engines=cfg.cluster.engines,
                                lr_rule=args.lr_rule, critical_batch=args.critical_batch, force=args.force,
                                progress=True)
    path = pathlib.Path(cfg.workdir) / "sweeps" / "branch.parquet"
    if out.as_json:
        out.show({"sweep": "branch", "table": str(path), "rows": points.to_dicts(), "runs": runs.to_dicts()}, [])
        return 0
    _show_sweep(out, "branch", runs.group_by("step", "factor", maintain_order=True).agg(  # one row per branch
        pl.col("batch", "lr", "steps", "loss_start", "efficiency").first(), pl.col("loss_end").mean()), path,
        columns=["step", "factor", "batch", "lr", "steps", "loss_start", "loss_end", "efficiency"])
    _show_sweep(out, "branch", points, path,
                columns=["step", "tokens", "batch", "b_keep_pace", "b_keep_pace_low", "b_keep_pace_high", "b_noise",
                         "b_noise_low", "b_noise_high", "b_simple", *[c for c in ("b_crit_sweep",) if c in points.columns]])
    row = points.row(0, named=True)
    print(f"local critical batch: the largest batch whose held-out progress per example keeps within "
          f"{row['tolerance']:.0%} of batch {row['batch']}'s over {row['window']} examples ({100 * row['level']:.0f} % "
          f"bootstrap ranges over held-out sequences and {row['repeats']} window(s)); sweeps/branch.parquet and "
          f"branch_runs.parquet in {cfg.workdir}")
    for line in points["agreement"]:
        print(line)
    return 0


def sweep(kind: str, cfg: LabConfig, args) -> int:
    """The scaling sweeps of notebook 04: ``ranks`` (tokens/s at 1..N ranks; with
    ``--critical-batch`` the statistical goodput against a batch sweep's B_crit), ``micro-batch``
    (largest micro-batch per model under a memory budget), ``loaders`` (data-wait fraction per
    DataLoader worker count), and notebook 06's ``parallel`` (every dp x tp x pp split of the
    engines: throughput, measured bubble, time in TP collectives and per-rank memory beside the
    planner). ``network`` (root; no engines): 2 ranks across two network hosts at each link
    setting, beside the network model (``labkit.study.network_sweep``); ``batch`` and ``branch``
    (no engines): the critical batch (``labkit.study.critical_batch``) and the local critical batch
    by branching (``labkit.study.branching``). Each training point shows a progress bar over its
    steps. Prints the sweep's table (also under <workdir>/sweeps/), or its rows as JSON with
    ``args.json``."""
    from labkit import preflight, readout

    w = cfg.workdir
    preflight.check_sweep(kind, cfg, args)
    noise = {}
    if kind == "ranks" and getattr(args, "critical_batch", None):  # read before any engine starts
        from labkit.forecasting import read_critical_batch

        crit = read_critical_batch(args.critical_batch, 1)  # seq_len 1: B_crit in sequences
        noise = {"b_noise": crit["b_crit_tokens"],
                 "b_noise_source": f"B_crit of {crit['source']} (at held-out loss {crit['target_eval_loss']:.3f})"}
    _checked()
    with readout.Output(getattr(args, "json", False)) as out:
        if kind in ("batch", "branch", "network"):  # no engines: in this process, or on the network hosts
            return {"batch": _sweep_batch, "branch": _sweep_branch, "network": _sweep_network}[kind](cfg, args, out)
        from labkit import lab
        from labkit.data.shards import read_index
        with cluster_client(cfg.cluster) as client:
            staged = _stage(client, cfg) if kind != "micro-batch" and _uses_workdir_shards(cfg) else None
            if kind == "ranks":
                df = lab.sweep_ranks(client, cfg.train, w, ranks=args.ranks, staged=staged, force=args.force,
                                     progress=True, **noise)
            elif kind == "micro-batch":
                index = read_index(cfg.train.data_dir)
                budget = int(args.budget_gib * 2**30) if args.budget_gib else None
                df = lab.sweep_micro_batch(client, args.models or [cfg.train.model], seq_len=int(index["seq_len"]),
                                           vocab_size=int(index["vocab_size"]), budget_bytes=budget, workdir=w,
                                           force=args.force, progress=True)
            elif kind == "parallel":
                df = lab.sweep_parallel(client, cfg.train, w, micro_batches=args.micro_batches, steps=args.steps or 8,
                                        staged=staged, force=args.force, progress=True)
            else:
                df = lab.sweep_loader_workers(client, w, batch_size=cfg.train.batch.micro_batch_size,
                                              step_time_s=args.step_time_s, workers=args.workers, staged=staged,
                                              force=args.force)
        name = {"ranks": "ranks", "micro-batch": "microbatch", "parallel": "parallel", "loaders": "loader"}[kind]
        path = pathlib.Path(w) / "sweeps" / f"{name}.parquet"
        if kind == "parallel":  # 26 columns: the ones to read, memory in GB; the rest stay in the Parquet file
            import polars as pl

            gb = [pl.col(c) / 1e9 for c in ("measured_total_bytes", "planned_total_bytes")]
            cols = ["dp", "tp", "pp", "pp_schedule", "micro_batches", "tokens_per_s", "pipeline_bubble",
                    "planned_bubble", "tp_comm_fraction", gb[0].alias("measured_GB_per_rank"),
                    gb[1].alias("planned_GB_per_rank"), *[c for c in ("busy", "reused") if c in df.columns]]
            _show_sweep(out, kind, df, path, columns=cols,
                        note_line=f"{path} holds every column (load, state and activation bytes)")
        else:
            _show_sweep(out, kind, df, path)
    return 0


def _sweep_network(cfg: LabConfig, args, out) -> int:
    """``labkit sweep network``: ``labkit.study.network_sweep.run_network_sweep`` on CONFIG's
    [train] (its --set overrides passed on to every rank) and its shards; prints the table."""
    from labkit.study.network_sweep import run_network_sweep

    df = run_network_sweep(args.config, cfg.workdir, models=args.models or [cfg.train.model],
                           rates_mbit=[r or None for r in args.rates_mbit], compressions=args.compression,
                           steps=args.steps or 6, data_dir=cfg.train.data_dir, overrides=args.set, force=args.force,
                           progress=True)
    cols = ["model", "grad_compression", "rate_mbit", "link_mbit", "comm_bytes", "compute_s", "step_s", "efficiency",
            "comm_exposed_s", "predicted_step_s", "predicted_ratio", "reused"]
    path = pathlib.Path(cfg.workdir) / "sweeps" / "network.parquet"
    _show_sweep(out, "network", df, path, columns=cols, note_line=f"{path} holds every column", said=True)
    return 0


def export(args) -> int:
    """``labkit.export.export_run``: model, tokenizer and model card for transformers; prints
    where it went and its files (``{"out", "files", "step"}`` with ``--json``)."""
    from labkit import preflight, readout

    preflight.check_writable_dir(args.out, "out")
    from labkit.export import export_run
    from labkit.train.checkpoint import checkpoint_steps

    with readout.Output(getattr(args, "json", False)) as shown:
        out = export_run(args.run_dir, args.out, tokenizer_path=args.tokenizer, step=args.step, force=args.force)
        steps = checkpoint_steps(args.run_dir)
        step = args.step if args.step is not None else steps[-1] if steps else None
        files = sorted(p.name for p in out.iterdir())
        shown.show({"out": str(out), "files": files, "step": step},
                   readout.export_lines(str(out), files, step, args.run_dir))
    return 0
