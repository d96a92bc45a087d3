"""What each ``labkit`` subcommand does: the functions the notebooks call, on a cluster started
(or connected to) as the notebooks do. ``labkit.cli`` parses the arguments and calls these;
each returns the exit status and prints its result as JSON (tables: polars' text table).
Every value that needs no engine is checked first (``labkit.preflight``), before engines start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys
from typing import Any, Iterator

from labkit.config.tomlfile import ClusterConfig, LabConfig

__all__ = [
    "cluster_client", "export", "load_model_module", "plan", "plan_config", "prepare", "print_plan",
    "print_plan_model", "resume", "run_world_size", "stage", "sweep", "train", "forecast", "plan_model_module"
]


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
    evaluation (None when the run evaluated nothing), then steps, tokens, speed, world size."""
    keys = ("initial_loss", "final_loss", "eval_loss", "perplexity", "steps", "max_steps", "tokens", "tokens_per_s",
            "world_size", "global_batch_size", "resumed_from_step", "wall_s")
    return {k: result.get(k) for k in keys}


def _uses_workdir_shards(cfg: LabConfig) -> bool:
    return pathlib.Path(cfg.train.data_dir).resolve() == (pathlib.Path(cfg.workdir) / "shards").resolve()


def train(cfg: LabConfig, *, stage_first: bool = True) -> int:
    """DDP training on the engines (notebook 03); each rank reads its node's staged copy when
    the run's data_dir is the work directory's shards. Prints the result's main numbers."""
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
        result = lab.train_on_cluster(client, cfg.train, staged=staged)
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
        result = lab.train_on_cluster(client, cfg)
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

    if cfg.train.eval_every <= 0 and not cfg.train.data_dir:
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
            df = lab.sweep_loader_workers(client, w, batch_size=cfg.train.micro_batch_size,
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


def load_model_module(spec: str, **factory_kw) -> tuple[Any, Any]:
    """``(make_model, make_batch)`` from ``"FILE.py:FACTORY"``: the file is imported under its
    own name and ``FACTORY(**factory_kw)`` is called (``seq_len``, and ``vocab_size`` when asked;
    ``labkit.cli.FACTORY_CONTRACT``). ValueError naming the problem (no ':', no such function, a factory
    whose signature cannot take ``factory_kw``, one that does not return two callables);
    FileNotFoundError for a missing file."""
    import importlib.util
    import inspect

    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"model_module: expected FILE.py:FACTORY, got {spec!r}")
    file = pathlib.Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"model_module: {file} does not exist")
    module_spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, str(file.resolve().parent))  # the file may import its neighbours
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(file.resolve().parent))
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"model_module: {file} has no function {name!r}")
    signature = inspect.signature(factory)
    called = f"{name}({', '.join(f'{k}={v!r}' for k, v in factory_kw.items())})"
    named = {n for n, prm in signature.parameters.items() if prm.kind is not prm.VAR_KEYWORD}
    if "vocab_size" in factory_kw and "vocab_size" not in named:
        raise ValueError(f"--vocab-size: {name}{signature} has no vocab_size parameter; set the vocabulary in "
                         f"{name} or give it a vocab_size parameter")
    try:
        signature.bind(**factory_kw)
    except TypeError as err:
        raise ValueError(f"model_module: {name}{signature} cannot be called as {called} ({err}); "
                         "the contract: FACTORY(seq_len) -> (make_model, make_batch), labkit plan --help") from None
    made = factory(**factory_kw)
    if not (isinstance(made, tuple) and len(made) == 2 and all(callable(f) for f in made)):
        raise ValueError(f"model_module: {name}() must return (make_model, make_batch), got {type(made).__name__}")
    return made


def print_plan_model(p: dict[str, Any], *, label: str = "") -> None:
    """``labkit.study.memory.plan_model``'s answer as a readable table: the max micro-batch, the
    terms behind it (state, activations, transients, each with its bytes), FLOPs per token,
    and what the count corrected for the device."""
    gb = 1e9
    at = max(p["max_micro_batch"], 1)
    st, act, tr = p["state_terms"], p["activation_terms"], p["transient_terms"]
    rows = [("state: parameters", st["params"]), ("state: gradients", st["grads"]),
            ("state: DDP buckets (beside the gradients)", st["buckets"]),
            (f"state: {p['optimizer']} state", st["optimizer"]), ("state: optimiser steps", st["optimizer_steps"]),
            ("activations: per sequence", act["per_sequence"]), ("activations: fixed", act["fixed"]),
            ("  of which autocast weight copies", act["autocast_weight_copies"]),
            ("transient: held outputs per sequence", tr["held_outputs_per_sequence"]),
            ("transient: backward temporaries per sequence", tr["backward_per_sequence"]),
            ("transient: backward temporaries fixed", tr["backward_fixed"]),
            ("transient: FSDP gathered units", tr["fsdp_gathered"]),
            (f"transient: {p['optimizer_impl']} optimiser step", tr["optimizer_step"])]
    print(f"plan_model {label}{p['model']} on {p['device']}, {p['precision']}, {p['sharding']} over {p['dp']} "
          f"rank(s) (ZeRO stage {p['zero_stage']}), seq {p['seq_len']}, {p['params'] / 1e6:.1f} M parameters, "
          f"counted on {p['method']}")
    width = max(len(r[0]) for r in rows)
    print(f"{'term':<{width}}  {'bytes':>16}  {'GB':>9}")
    for name, value in rows:
        print(f"{name:<{width}}  {value:>16,}  {value / gb:>9.3f}")
    print(f"{'total at micro-batch ' + str(at):<{width}}  {p['total_bytes']:>16,}  {p['total_bytes'] / gb:>9.3f}")
    print(f"{'capacity':<{width}}  {p['capacity_bytes']:>16,}  {p['capacity_bytes'] / gb:>9.3f}")
    check = (f"verified by counting at {p['verified']['micro_batch']} and {p['verified']['micro_batch'] + 1}"
             if p["verified"] else "linear from the counts at b = 2, 3 (not counted at the answer)")
    print(f"max micro-batch: {p['max_micro_batch']} ({check})")
    print(f"FLOPs per token (forward + backward, FlopCounterMode): {p['flops_per_token']:,.0f}")
    for line in p["corrections"]:
        print(f"  corrected: {line}")
    for line in p.get("not_modelled", ()):
        print(f"  not modelled: {line}")
    if p["fake_refused"]:
        print(f"  CPU tensors because fake tensors could not run the model: {p['fake_refused']}")
    if p["device"] == "cpu":
        from labkit.measure import cpu_rss_caveat

        print(cpu_rss_caveat(p["capacity_bytes"]))


def forecast(args) -> int:
    """``labkit forecast CONFIG``: wall-clock time and GPU-hours to the target per GPU count and
    micro-batch (``labkit.study.forecast.study_forecast``), the knee and its reason, the
    assumptions labelled; ``--json``: one JSON object."""
    import json

    import polars as pl

    from labkit.config.tomlfile import load
    from labkit.study.forecast import study_forecast

    lab = load(args.config, args.set)

    def ints(flag: str, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split(",") if x]
        except ValueError:
            raise ValueError(f"{flag}: comma-separated integers, got {text!r}") from None

    gpus = ints("--gpus", args.gpus)
    mbs = ints("--micro-batches", args.micro_batches) if args.micro_batches else [lab.train.micro_batch_size]
    from labkit.study.plan import STUDY_VOCAB
    from labkit.train.run_config import model_config_of

    mcfg = model_config_of(lab.train, lab.plan.vocab_size or STUDY_VOCAB)
    out = study_forecast(mcfg, gpus=gpus, micro_batches=mbs, seq_len=lab.shards.seq_len, network=args.network,
                         device=lab.plan.device, mfu=args.mfu, precision=lab.train.precision, e_min_tokens=args.tokens,
                         b_crit_tokens=args.b_crit_tokens, growth=args.growth, target_loss=args.target_loss,
                         gpus_per_node=lab.plan.gpus_per_node)
    if args.json:
        print(json.dumps(out))
        return 0
    df = pl.DataFrame(out["table"]).select("n_gpus", "micro_batch", "global_batch", "steps", "step_s", "hours",
                                           "gpu_hours", "batch_over_b_crit")
    _print_table(df)
    for b, k in out["knee"].items():
        where = f"{k['n_gpus']} GPUs ({k['reason']}: the next doubling buys {k['gain_next_doubling']:.2f}x)" \
            if k["n_gpus"] else "none within the GPU counts"
        print(f"micro-batch {b}: more GPUs stop paying from {where}")
    print("assumptions:\n  " + "\n  ".join(out["assumptions"]))
    return 0


def plan(args) -> int:
    """The planner at a chosen scale (notebook 04's second half), for a model preset: memory per
    GPU term by term under plain data parallelism, the largest micro-batch that fits, the dp x tp x
    pp x ZeRO splits that fit, and the predicted data-parallel scaling from 1 GPU to ``args.gpus``
    (``print_plan``). No cluster needed. With a CONFIG file, ``plan_config`` plans that file's run
    instead; with ``args.model_module`` ("FILE.py:FACTORY") it counts a user's own model
    (``labkit.study.memory.plan_model``) and prints ``print_plan_model``'s table."""
    from labkit.study import plan as lp
    from labkit.model import model_config

    if getattr(args, "config", None):
        return plan_config(args)
    defaults = {"model": "bert-120m", "gpus": 256, "gpus_per_node": 2, "seq_len": 512, "micro_batch": 16,
                "device": "H100 NVL", "precision": "bf16", "network": "25GbE", "top": 8}
    given = {key for key in defaults if getattr(args, key, None) is not None}
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if getattr(args, "model_module", None):
        return plan_model_module(args, given)
    if getattr(args, "budget_gb", None) is not None or args.device == "cpu":
        raise ValueError("--budget-gb and --device cpu plan a counted model: give --model-module FILE.py:FACTORY "
                         "(a preset is planned for a device from the table, at that device's memory)")
    cfg = model_config(args.model, args.vocab_size or lp.STUDY_VOCAB,
                       max_position_embeddings=max(512, args.seq_len))
    print_plan(cfg, args, name=args.model)
    return 0


def plan_model_module(args, given: set[str]) -> int:
    """``labkit plan --model-module FILE.py:FACTORY``: the user's model counted
    (``labkit.study.memory.plan_model``) at ``args.seq_len`` on ``args.device``, sharded
    ``args.sharding`` over ``args.dp`` ranks (default: ``args.gpus``), then the predicted
    data-parallel scaling from 1 GPU to ``args.gpus`` over ``args.network`` from the counted
    parameters and FLOPs per token (``labkit.study.scaling.model_scaling``, the presets' path) at
    ``args.micro_batch`` (default: the counted largest one; a given one is also checked against
    the memory). ``given``: the options set on the command line. Options that cannot apply are
    refused in one line (ValueError): --model, --top (the dp x tp x pp splits need a preset's
    layer shapes), CONFIG's --set/--count/--out, --vocab-size when the factory takes no
    ``vocab_size``, and the scaling options with --device cpu (no peak FLOPs)."""
    import polars as pl

    from labkit.study import memory, scaling

    refused = [flag for flag, on in (("--model", "model" in given), ("--top", "top" in given),
                                     ("--set", bool(getattr(args, "set", None))),
                                     ("--count", getattr(args, "count", False)),
                                     ("--out", getattr(args, "out", None) is not None)) if on]
    why = {"--model": "the model is FACTORY's", "--top": "the dp x tp x pp splits need a labkit preset's layer shapes",
           "--set": "it overrides a CONFIG", "--count": "a FACTORY's model is always counted",
           "--out": "it writes a CONFIG plan's summary (use --json)"}
    if args.device == "cpu":
        refused += [f"--{k.replace('_', '-')}" for k in ("gpus", "gpus_per_node", "network") if k in given]
        why |= dict.fromkeys(("--gpus", "--gpus-per-node", "--network"),
                             "the scaling table needs a GPU's peak FLOPs (give --device)")
    if refused:
        raise ValueError(f"{refused[0]}: does not apply with --model-module ({why[refused[0]]})")
    kw = {"seq_len": args.seq_len}
    if args.vocab_size is not None:
        kw["vocab_size"] = args.vocab_size
    make_model, make_batch = load_model_module(args.model_module, **kw)
    budget = int(args.budget_gb * 1e9) if args.budget_gb else None
    dp = args.dp if args.dp is not None else args.gpus if args.device != "cpu" else 1
    p = memory.plan_model(make_model, make_batch, device=args.device, precision=args.precision, budget_bytes=budget,
                          sharding=args.sharding, dp=dp)
    batch = args.micro_batch if "micro_batch" in given else max(p["max_micro_batch"], 1)
    at = {"micro_batch": batch, "total_bytes": memory.total_at(p, batch),
          "fits": memory.total_at(p, batch) <= p["capacity_bytes"], "capacity_bytes": p["capacity_bytes"]}
    table = None
    if args.device != "cpu":
        gpus = tuple(g for g in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if g <= args.gpus)
        table = scaling.model_scaling(params=p["params"], flops_per_token=p["flops_per_token"], micro_batch=batch,
                                      seq_len=p["seq_len"], device=args.device, gpus=gpus, network=args.network,
                                      gpus_per_node=args.gpus_per_node, params_ready_last=p["params_before_blocks"])
    if getattr(args, "json", False):
        _print_json({"model_module": args.model_module, "plan": p, "at_micro_batch": at,
                     "scaling": None if table is None else table.to_dicts(),
                     "scaling_inputs": None if table is None else
                     {"params": p["params"], "flops_per_token": p["flops_per_token"], "micro_batch": batch,
                      "seq_len": p["seq_len"], "network": args.network, "gpus_per_node": args.gpus_per_node,
                      "mfu": 0.4, "grad_dtype_bytes": 4, "params_ready_last": p["params_before_blocks"]}})
        return 0
    print_plan_model(p, label=f"{args.model_module}: ")
    if "micro_batch" in given:
        print(f"at micro-batch {batch}: {at['total_bytes'] / 1e9:.3f} GB of {at['capacity_bytes'] / 1e9:.3f} GB: "
              + ("fits" if at["fits"] else "does NOT fit"))
    if table is None:
        print("no scaling table on --device cpu (it needs a GPU's peak FLOPs)")
        return 0
    print(f"\npredicted data-parallel scaling over {args.network}, {args.gpus_per_node} GPUs per node, micro-batch "
          f"{batch}{'' if 'micro_batch' in given else ' (the largest that fits)'}, from the counted "
          f"{p['params'] / 1e6:.1f} M parameters and {p['flops_per_token']:,.0f} FLOPs/token at 40 % MFU:")
    _print_table(table.select("n_gpus", "nodes", pl.col("compute_s").round(4), pl.col("exposed_s").round(4),
                              pl.col("step_s").round(4), pl.col("efficiency").round(3), "comm_hidden"))
    return 0


def print_plan(cfg, args, *, name: str) -> None:
    """Print the planner's tables for the ModelConfig ``cfg`` under ``args`` (gpus, gpus_per_node,
    seq_len, micro_batch, device, precision, network, top, json): memory per GPU term by term in GB
    under plain data parallelism, the largest micro-batch that fits the device
    (``labkit.study.plan.planned_max_micro_batch``), the dp x tp x pp x ZeRO splits that fit, and
    the predicted data-parallel scaling from 1 GPU to ``args.gpus``. With ``args.json`` one JSON
    object with the raw values (bytes) instead."""
    import polars as pl

    from labkit.study import parallel, scaling
    from labkit.study import plan as lp

    mem = lp.memory_plan(cfg, seq_len=args.seq_len, micro_batch=args.micro_batch, precision=args.precision,
                         dp=args.gpus)
    cap = lp.device_info(args.device)["memory_bytes"]
    best = lp.planned_max_micro_batch(cfg, device=args.device, seq_len=args.seq_len, precision=args.precision,
                                      dp=args.gpus)
    plans = parallel.parallel_plans(cfg, n_gpus=args.gpus, seq_len=args.seq_len, micro_batch=args.micro_batch,
                                    device=args.device, gpus_per_node=args.gpus_per_node, precision=args.precision)
    gpus = tuple(g for g in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if g <= args.gpus)
    table = scaling.study_scaling(name, micro_batch=args.micro_batch, seq_len=args.seq_len, device=args.device,
                                  vocab_size=cfg.vocab_size, gpus=gpus, network=args.network,
                                  gpus_per_node=args.gpus_per_node)
    fits = plans.filter(pl.col("fits")).head(args.top)
    if getattr(args, "json", False):
        _print_json({"memory": mem | {"fits": mem["total"] <= cap, "capacity_bytes": cap},
                     "max_micro_batch": best["max_micro_batch"], "max_micro_batch_capacity_bytes": best["capacity_bytes"],
                     "splits_that_fit": fits.to_dicts(), "scaling": table.to_dicts()})
        return
    print(f"memory per GPU: {name} on {args.device} ({cap / 1e9:.0f} GB), data parallel over {args.gpus} GPUs, "
          f"micro-batch {args.micro_batch} x {args.seq_len} tokens, {args.precision} (GB = 1e9 bytes):")
    _print_memory(mem)
    verdict = "fits" if mem["total"] <= cap else "does NOT fit"
    print(f"{mem['total'] / 1e9:.2f} GB of {cap / 1e9:.0f} GB: {verdict}. Largest micro-batch that fits: "
          f"{best['max_micro_batch']} sequences of {args.seq_len} tokens ({best['capacity_bytes'] / 1e9:.0f} GB usable, "
          "1 GiB kept for the CUDA context)")
    print("\nsplits that fit (dp x tp x pp, ZeRO stage), least model parallelism first:")
    _print_table(fits.select("dp", "tp", "pp", "zero_stage", (pl.col("total") / 1e9).round(2).alias("GB per GPU"),
                             pl.col("bubble").round(3), "tp_within_node"))
    print(f"\npredicted data-parallel scaling over {args.network}, {args.gpus_per_node} GPUs per node:")
    _print_table(table.select("n_gpus", "nodes", pl.col("compute_s").round(4), pl.col("exposed_s").round(4),
                              pl.col("step_s").round(4), pl.col("efficiency").round(3), "comm_hidden"))


def _print_memory(mem: dict) -> None:
    """A ``labkit.study.plan.memory_plan`` as a table: each term in GB (1e9 bytes) and its share
    of the total (``--json`` keeps the bytes)."""
    import polars as pl

    terms = [k for k in ("params", "grads", "optimizer", "autocast_copies", "activations", "logits", "head_backward")
             if k in mem]
    _print_table(pl.DataFrame({"term": terms + ["total"], "GB": [round(mem[k] / 1e9, 3) for k in terms + ["total"]],
                               "share": [round(mem[k] / mem["total"], 3) for k in terms] + [1.0]}))


def plan_config(args) -> int:
    """``labkit plan CONFIG``: the file's [train] model (preset + model_overrides) at its
    micro-batch, sequence length and precision, on the [plan] device, GPUs and network (each
    also an option of the command; the vocabulary: [plan] vocab_size, else the work
    directory's shards). Prints the memory per GPU term by term, the largest micro-batch that
    fits (``study.plan.planned_max_micro_batch``; with ``--count`` the count of what the step
    keeps, ``study.memory.plan_model``) beside the file's, and the precision experiment
    (``study.scaling.precision_experiment``: step time and DP efficiency at 1..gpus in fp32,
    TF32 and bf16), then one JSON summary (also written to ``--out``)."""
    from labkit.config.tomlfile import load
    from labkit.data.shards import read_index
    from labkit.study import plan as lp
    from labkit.study import scaling
    from labkit.train.run_config import model_config_of

    lab = load(args.config, args.set)
    pc = dataclasses.replace(lab.plan, **{k: v for k, v in (("device", args.device), ("gpus", args.gpus),
                                                            ("gpus_per_node", args.gpus_per_node),
                                                            ("network", args.network),
                                                            ("vocab_size", args.vocab_size)) if v is not None})
    vocab = pc.vocab_size or int(read_index(pathlib.Path(lab.workdir) / "shards")["vocab_size"])
    cfg = model_config_of(lab.train, vocab)
    seq_len, batch = args.seq_len or lab.shards.seq_len, args.micro_batch or lab.train.micro_batch_size
    precision = args.precision or lab.train.precision
    attention = "eager" if cfg.attention_backend == "eager" else "flash"
    mem = lp.memory_plan(cfg, seq_len=seq_len, micro_batch=batch, precision=precision, attention=attention,
                         dp=pc.gpus)
    if getattr(args, "count", False):  # count what the step keeps (any model; about a minute on a CPU)
        from labkit.study import memory

        make_model, make_batch = memory.labkit_model(cfg, seq_len, mlm_probability=lab.train.mlm_probability)
        fit = memory.plan_model(make_model, make_batch, device=pc.device, precision=precision, sharding="ddp",
                                dp=pc.gpus)
        method = "counted (study.memory.plan_model)"
    else:
        fit = lp.planned_max_micro_batch(cfg, device=pc.device, seq_len=seq_len, precision=precision,
                                         attention=attention, dp=pc.gpus)
        method = "planned (study.plan.planned_max_micro_batch)"
    cap = lp.device_info(pc.device)["memory_bytes"]
    print(f"{args.config}: {lab.train.model} + model_overrides, vocabulary {vocab}, seq {seq_len} "
          f"({lab.shards.packing}), {precision}, {attention} attention, DDP over {pc.gpus} GPUs on {pc.device}")
    print(f"memory per GPU at micro-batch {batch} (GB = 1e9 bytes): {mem['total'] / 1e9:.2f} GB of {cap / 1e9:.0f} GB, "
          + ("fits" if mem["total"] <= cap else "does NOT fit"))
    _print_memory(mem)
    gpus = tuple(g for g in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if g <= pc.gpus)
    table = scaling.precision_experiment(cfg, micro_batch=batch, seq_len=seq_len, device=pc.device,
                                         network=pc.network, gpus=gpus, gpus_per_node=pc.gpus_per_node, mfu=pc.mfu)
    print(f"planned data-parallel efficiency over {pc.network} at micro-batch {batch}, {pc.mfu:.0%} of each "
          "precision's dense peak:")
    _print_table(table.pivot(on="precision", index="n_gpus", values="efficiency"))
    table_summary = scaling.precision_summary(table, mfu=pc.mfu)
    _print_table(table_summary)
    levers = scaling.compression_table(cfg, micro_batch=batch, seq_len=seq_len, device=pc.device, network=pc.network,
                                       n_gpus=gpus[-1], gpus_per_node=pc.gpus_per_node, mfu=pc.mfu)
    print(f"gradient compression (train.grad_compression; powersgd at rank 4) at {gpus[-1]} GPUs over {pc.network}:")
    _print_table(levers)
    rows = list(table_summary.iter_rows(named=True))
    best = fit["max_micro_batch"]
    eff = {r["precision"]: round(r["efficiency"], 3) for r in rows}
    print(f"max micro-batch ({precision}, {method}): {best} (the file's micro_batch_size {batch}: "
          f"{(best - batch) / batch:+.1%}); planned {pc.network} DP efficiency at {gpus[-1]} GPUs: "
          + ", ".join(f"{k} {v:.2f}" for k, v in eff.items()))
    summary = {"config": str(args.config), "max_micro_batch": best, "method": method, "micro_batch_size": batch,
               "within_10pct": abs(best - batch) <= 0.1 * batch, "efficiency_at_max_gpus": eff,
               "n_gpus": gpus[-1], "network": pc.network,
               "network_limit_from_n": {r["precision"]: r["first_exposed_n"] for r in rows},
               "break_even_mfu": {r["precision"]: round(r["break_even_mfu"], 3) for r in rows},
               "efficiency_compressed": {p: {r["grad_compression"]: round(r["efficiency"], 3)
                                             for r in levers.iter_rows(named=True) if r["precision"] == p}
                                         for p in levers["precision"].unique(maintain_order=True)}}
    _print_json(summary)
    if getattr(args, "out", None):
        from labkit.io import atomic_write_json

        atomic_write_json(pathlib.Path(args.out), summary)
    return 0


def export(args) -> int:
    """``labkit.export.export_run``: model, tokenizer and model card for transformers."""
    from labkit.export import export_run

    out = export_run(args.run_dir, args.out, tokenizer_path=args.tokenizer, step=args.step, force=args.force)
    _print_json({"out": str(out), "files": sorted(p.name for p in out.iterdir())})
    return 0
