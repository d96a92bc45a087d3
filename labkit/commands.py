"""What each ``labkit`` subcommand does: the functions the notebooks call, on a cluster started
(or connected to) as the notebooks do. ``labkit.cli`` parses the arguments and calls these;
each returns the exit status and prints its result as JSON (tables: polars' text table).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys
from typing import Any, Iterator

from labkit.config.tomlfile import ClusterConfig, LabConfig


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _print_table(df) -> None:
    import polars as pl

    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200):
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
    from labkit import lab

    w = cfg.workdir
    with cluster_client(cfg.cluster) as client:
        lab.build_corpus(client, cfg.corpus, w, force=force)
        lab.clean_corpus(client, cfg.clean, w, force=force)
        lab.build_tokenizer(client, cfg.tokenizer, w, force=force)
        lab.build_shards(client, cfg.shards, w, force=force)
    _print_json(lab.preparation_report(w))
    return 0


def _require_shards(data_dir: str | pathlib.Path, key: str) -> None:
    """FileNotFoundError naming ``key`` when ``data_dir`` holds no shard index (checked here,
    before engines are started for nothing)."""
    if not (pathlib.Path(data_dir) / "index.json").is_file():
        raise FileNotFoundError(f"{key}: {data_dir} holds no shard set (index.json); run labkit prepare first")


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
    keys = ("initial_loss", "final_loss", "steps", "max_steps", "tokens", "tokens_per_s", "world_size",
            "global_batch_size", "resumed_from_step", "wall_s")
    return {k: result.get(k) for k in keys}


def _uses_workdir_shards(cfg: LabConfig) -> bool:
    return pathlib.Path(cfg.train.data_dir).resolve() == (pathlib.Path(cfg.workdir) / "shards").resolve()


def train(cfg: LabConfig, *, stage_first: bool = True) -> int:
    """DDP training on the engines (notebook 03); each rank reads its node's staged copy when
    the run's data_dir is the work directory's shards. Prints the result's main numbers."""
    from labkit import lab

    _require_shards(cfg.train.data_dir, "train.data_dir")
    with cluster_client(cfg.cluster) as client:
        staged = _stage(client, cfg) if stage_first and _uses_workdir_shards(cfg) else None
        result = lab.train_on_cluster(client, cfg.train, staged=staged)
    _print_json(_summary(result) | {"run_dir": cfg.train.run_dir})
    return 0


def resume(run_dir: str, cluster: ClusterConfig, overrides: list[str]) -> int:
    """Continue a run from its newest checkpoint with the config it was started with (its
    config.json; ``train.key=value`` overrides), on as many engines as it ran on. The run's
    ``stop_after`` is dropped unless an override sets it again."""
    from labkit import lab
    from labkit.config.tomlfile import read_run_config

    cfg = read_run_config(run_dir, overrides)
    if not any(o.split("=", 1)[0].strip() == "train.stop_after" for o in overrides):
        cfg = dataclasses.replace(cfg, stop_after=None)
    cfg = dataclasses.replace(cfg, resume=True)
    with cluster_client(cluster) as client:
        result = lab.train_on_cluster(client, cfg)
    _print_json(_summary(result) | {"run_dir": run_dir})
    return 0


def run_world_size(run_dir: str) -> int | None:
    """The world size a run was written with (its config.json provenance), None if unknown."""
    path = pathlib.Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    return (json.loads(path.read_text()).get("provenance") or {}).get("world_size")


def sweep(kind: str, cfg: LabConfig, args) -> int:
    """The scaling sweeps of notebook 04: ``ranks`` (tokens/s at 1..N ranks), ``micro-batch``
    (largest micro-batch per model under a memory budget), ``loaders`` (data-wait fraction per
    DataLoader worker count), and notebook 06's ``parallel`` (every dp x tp x pp split of the
    engines: throughput, measured bubble, time in TP collectives and per-rank memory beside the
    planner). Prints the sweep's table (also under <workdir>/sweeps/)."""
    from labkit import lab
    from labkit.data.shards import read_index

    w = cfg.workdir
    _require_shards(cfg.train.data_dir, "train.data_dir")
    with cluster_client(cfg.cluster) as client:
        if kind == "ranks":
            staged = _stage(client, cfg) if _uses_workdir_shards(cfg) else None
            df = lab.sweep_ranks(client, cfg.train, w, ranks=args.ranks, staged=staged, force=args.force)
        elif kind == "micro-batch":
            index = read_index(cfg.train.data_dir)
            budget = int(args.budget_gb * 2**30) if args.budget_gb else None
            df = lab.sweep_micro_batch(client, args.models or [cfg.train.model], seq_len=int(index["seq_len"]),
                                       vocab_size=int(index["vocab_size"]), budget_bytes=budget, workdir=w,
                                       force=args.force)
        elif kind == "parallel":
            staged = _stage(client, cfg) if _uses_workdir_shards(cfg) else None
            df = lab.sweep_parallel(client, cfg.train, w, micro_batches=args.micro_batches, steps=args.steps,
                                    staged=staged, force=args.force)
        else:
            staged = _stage(client, cfg) if _uses_workdir_shards(cfg) else None
            df = lab.sweep_loader_workers(client, w, batch_size=cfg.train.micro_batch_size,
                                          step_time_s=args.step_time_s, workers=args.workers, staged=staged,
                                          force=args.force)
    _print_table(df)
    return 0


def plan(args) -> int:
    """The planner at a chosen scale (notebook 04's second half): memory per GPU term by term
    under plain data parallelism, the dp x tp x pp x ZeRO splits that fit, and the predicted
    data-parallel scaling from 1 GPU to ``args.gpus``. No cluster needed."""
    from labkit.study import plan as lp
    from labkit.study import parallel, scaling
    from labkit.model import model_config

    cfg = model_config(args.model, args.vocab_size or lp.STUDY_VOCAB,
                       max_position_embeddings=max(512, args.seq_len))
    mem = lp.memory_plan(cfg, seq_len=args.seq_len, micro_batch=args.micro_batch, precision=args.precision,
                         dp=args.gpus)
    cap = lp.device_info(args.device)["memory_bytes"]
    print(f"memory per GPU, {args.model} on {args.device} ({cap / 1e9:.0f} GB), data parallel over {args.gpus} "
          f"GPUs, micro-batch {args.micro_batch} x {args.seq_len} tokens, {args.precision}:")
    _print_json({k: v for k, v in mem.items()} | {"fits": mem["total"] <= cap})
    plans = parallel.parallel_plans(cfg, n_gpus=args.gpus, seq_len=args.seq_len, micro_batch=args.micro_batch,
                              device=args.device, gpus_per_node=args.gpus_per_node, precision=args.precision)
    print("splits that fit (dp x tp x pp, ZeRO stage), least model parallelism first:")
    import polars as pl

    _print_table(plans.filter(pl.col("fits")).head(args.top))
    gpus = tuple(g for g in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if g <= args.gpus)
    table = scaling.study_scaling(args.model, micro_batch=args.micro_batch, seq_len=args.seq_len, device=args.device,
                                  vocab_size=args.vocab_size, gpus=gpus, network=args.network,
                                  gpus_per_node=args.gpus_per_node)
    print(f"predicted data-parallel scaling over {args.network}, {args.gpus_per_node} GPUs per node:")
    _print_table(table)
    return 0


def export(args) -> int:
    """``labkit.export.export_run``: model, tokenizer and model card for transformers."""
    from labkit.export import export_run

    out = export_run(args.run_dir, args.out, tokenizer_path=args.tokenizer, step=args.step, force=args.force)
    _print_json({"out": str(out), "files": sorted(p.name for p in out.iterdir())})
    return 0
