"""labkit command line: the same functions the notebooks call, one subcommand per stage.

    labkit prepare CONFIG            corpus, cleaning, tokenizer, shards (on the engines)
    labkit stage CONFIG              shards to node-local disk, checksums verified
    labkit train CONFIG              DDP training on the engines
    labkit resume RUN_DIR            continue a run from its newest checkpoint
    labkit sweep ranks|micro-batch|loaders|network|parallel|batch CONFIG
    labkit plan [CONFIG]             the planner's memory and scaling tables (a file's run at full size)
    labkit forecast CONFIG           time and GPU-hours to a target loss per GPU count, and the knee
    labkit export RUN_DIR OUT        model + tokenizer + model card for transformers
    labkit ranks RUN_DIR             each rank's host, step and collective; the rank the others wait for
    labkit demo | verify SHARD_DIR | report NOTEBOOK OUT.html

CONFIG is a TOML file (``labkit.config.tomlfile``); ``--set section.key=value`` overrides a key.
Every command prints lines for a reader, or with ``--json`` one JSON object on standard output
(``labkit.readout``). Errors caused by the input (a bad key, a missing file, a failed notebook
cell, a dead kernel, an engine's error) print one line naming the cause and exit with status 2,
before any output when no engine is needed to find them; ``--debug`` shows the traceback instead.
``python -m labkit.train CONFIG`` (also under torchrun) is ``labkit/train/__main__.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import textwrap
from typing import Any

__all__ = ["EXAMPLES", "build_parser", "main"]

EXAMPLES = {
    "prepare": "labkit prepare configs/walkthrough.toml --set corpus.max_functions=20000\n"
               "  labkit prepare configs/study.toml --scaled-down",
    "stage": "labkit stage configs/walkthrough.toml",
    "train": "labkit train configs/walkthrough.toml --set train.max_steps=200 --set train.run_dir=work/walkthrough/runs/long\n"
             "  labkit train configs/walkthrough.toml --tp 2 "
             "--set train.run_dir=work/walkthrough/runs/tp2",
    "resume": "labkit resume work/walkthrough/runs/main --set train.max_steps=400 --set train.allow_safe_changes=true",
    "sweep": "labkit sweep ranks configs/walkthrough.toml --ranks 1 2\n"
             "  labkit sweep micro-batch configs/walkthrough.toml --models mini small --budget-gib 2\n"
             "  labkit sweep loaders configs/walkthrough.toml --workers 0 1 2 --step-time-s 0.05\n"
             "  labkit sweep parallel configs/walkthrough.toml --micro-batches 4 --steps 8\n"
             "  labkit sweep network configs/walkthrough.toml --models mini small --rates-mbit 0 1000 200 50\n"
             "  labkit sweep batch configs/walkthrough.toml --batches 4 8 16 32 64 --examples 4096\n"
             "  labkit sweep branch configs/walkthrough.toml --at 25 100 300 --repeats 3 --set train.max_steps=400",
    "plan": 'labkit plan --model bert-350m --gpus 256 --micro-batch 16 --seq-len 512 --device "H100 NVL"\n'
            '  labkit plan configs/study.toml --device "H100 NVL"',
    "forecast": "labkit forecast configs/study.toml --gpus 1,2,4,8,16,32,64,128,256 --network 25GbE\n"
                "  labkit forecast configs/walkthrough.toml --device cpu --gpus 1,2,4,8",
    "export": "labkit export work/walkthrough/runs/main work/walkthrough/export",
    "checkpoint": "labkit checkpoint upgrade work/walkthrough/runs/main",
    "ranks": "labkit ranks work/walkthrough/runs/main",
    "demo": "labkit demo --workdir work/demo --engines 2",
    "verify": "labkit verify work/demo/shards",
    "report": "labkit report notebooks/03_train.py work/demo/reports/03_train.html --param steps=20",
}

FACTORY_CONTRACT = (
    "FACTORY(seq_len) -> (make_model, make_batch), called as FACTORY(seq_len=<--seq-len>), and with "
    "vocab_size=<--vocab-size> too when that option is given (FACTORY must then name a vocab_size parameter); "
    "make_model() returns a torch.nn.Module; make_batch(b) returns the keyword arguments of its forward for "
    "micro-batch b, int64 input ids [b, seq_len] among them; the forward returns the scalar loss (a tensor, "
    "or an object with .loss)")
"""The ``--model-module`` factory's contract, as ``labkit plan --help`` and docs/measurement.md state it."""


def _one_line(exc: BaseException) -> str:
    """The cause of ``exc`` in one line: a notebook cell's or an engine's error name and value,
    a dead kernel, or the first line of the message."""
    def first(text: object) -> str:
        return next((line.strip() for line in str(text).splitlines() if line.strip()), "")

    if "nbclient" in sys.modules:  # only a command that ran a notebook can raise its errors
        from nbclient.exceptions import CellExecutionError, DeadKernelError

        if isinstance(exc, CellExecutionError):
            return f"a notebook cell failed: {exc.ename}: {first(exc.evalue)}"
        if isinstance(exc, DeadKernelError):
            return f"the notebook's kernel died while running a cell (DeadKernelError: {first(exc)})"
    if hasattr(exc, "ename") and hasattr(exc, "evalue"):  # ipyparallel RemoteError
        return f"error on an engine: {exc.ename}: {first(exc.evalue)}"
    return first(exc) or type(exc).__name__


def _input_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the input or a notebook is wrong", not a bug in labkit. ipyparallel's
    and nbclient's are among them once a command imported those packages (importing them here
    would cost seconds before a value can be refused)."""
    errors: list[type[BaseException]] = [ValueError, OSError, RuntimeError, FloatingPointError]
    if "ipyparallel" in sys.modules:
        from ipyparallel.error import RemoteError

        errors.append(RemoteError)
    if "nbclient" in sys.modules:
        from nbclient.exceptions import CellControlSignal

        errors.append(CellControlSignal)
    return tuple(errors)


def _guarded(name: str, func, args: argparse.Namespace, errors) -> int:
    """Run ``func(args)``: an error of the classes ``errors()`` returns (asked after the error, so
    the classes of packages the command imported count) prints ``<name>: error: <cause>`` and
    returns 2 (with ``--debug`` it is raised); Ctrl-C prints one line (with what continues the
    work: ``labkit.commands.Interrupted``'s note) and returns 130."""
    try:
        return func(args)
    except Exception as exc:
        if not isinstance(exc, errors()) or getattr(args, "debug", False):
            raise
        print(f"{name}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # labkit.commands.Interrupted says what continues the run
        what = getattr(exc, "note", None) or ("Completed stages are kept and are reused by the next run with the "
                                              "same work directory.")
        print(f"{name}: interrupted; engines were stopped. {what}", file=sys.stderr)
        return 130


def _config(args: argparse.Namespace):
    """The LabConfig of CONFIG with --set and the cluster options applied."""
    from labkit.config.tomlfile import load

    overrides = list(args.set)
    for flag in ("tp", "pp"):  # labkit train --tp / --pp: the model-parallel split
        if getattr(args, flag, None) is not None:
            overrides.append(f"train.parallel.{flag}={getattr(args, flag)}")
    for flag, key in (("engines", "engines"), ("profile", "profile"), ("cluster_id", "cluster_id")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"cluster.{key}={json.dumps(value)}")
    if getattr(args, "slurm", False):
        overrides.append('cluster.kind="slurm"')
    scaled = getattr(args, "scaled_down", False)
    if (getattr(args, "tp", None) or 1) * (getattr(args, "pp", None) or 1) > 1 and not _sets_sharding(args, scaled):
        return _split_sharding(load(args.config, [*overrides, 'train.parallel.sharding="replicate"'], scaled_down=scaled))
    return load(args.config, overrides, scaled_down=scaled)


def _sets_sharding(args: argparse.Namespace, scaled: bool) -> bool:
    """Whether CONFIG (its [train] table, or its scaled_down overrides when used) or --set names
    train.parallel.sharding (or its flat name of before the sections, train.sharding): then --tp /
    --pp leave it as given."""
    import pathlib
    import tomllib

    sets = [o.split("=", 1)[0].strip() for o in args.set]
    path = pathlib.Path(args.config) if args.config else None
    data = tomllib.loads(path.read_text(encoding="utf-8")) if path and path.is_file() else {}
    if scaled:
        sets += [o.split("=", 1)[0].strip() for o in data.get("scaled_down", [])]
    train = data.get("train", {})
    return bool({"train.sharding", "train.parallel.sharding"} & set(sets)) or "sharding" in train or \
        "sharding" in train.get("parallel", {})


def _split_sharding(cfg):
    """--tp / --pp without a sharding: "replicate" when the engines hold one model copy
    (dp = engines / (tp x pp) = 1), where it is the only layout (fsdp over one copy shards nothing);
    with dp > 1 fsdp and replicate both apply, so the choice is asked for in one line."""
    t = cfg.train.parallel
    dp, rest = divmod(cfg.cluster.engines, t.tp * t.pp)
    if dp > 1 and not rest:
        raise ValueError(f"train.parallel.sharding: --tp {t.tp} --pp {t.pp} on {cfg.cluster.engines} engines leaves dp {dp} "
                         "model copies; choose how they hold the model: --set train.parallel.sharding=\"fsdp\" (sharded) or "
                         "\"replicate\" (whole copies)")
    if not rest:
        from labkit.commands import note  # printed once the command's checks passed

        note(f"--tp {t.tp} --pp {t.pp} on {cfg.cluster.engines} engines: one model copy (dp 1), so "
             "train.parallel.sharding=\"replicate\"")
    return cfg


def _demo(args: argparse.Namespace) -> int:
    """``labkit demo``: its progress lines as it goes, or with --json those on stderr and the
    summary (``<workdir>/demo.json``) on stdout."""
    from labkit import preflight
    from labkit.config import CorpusConfig, DemoConfig
    from labkit.demo import run_demo
    from labkit.readout import Output

    preflight.check_writable_dir(args.workdir, "--workdir")
    corpus = CorpusConfig()
    if args.max_functions is not None:
        corpus = dataclasses.replace(corpus, max_functions=args.max_functions)
    if args.paths:
        corpus = dataclasses.replace(corpus, paths=tuple(args.paths))
    cfg = DemoConfig(workdir=args.workdir, engines=args.engines, corpus=corpus,
                     train_steps=args.steps if args.steps is not None else DemoConfig().train_steps,
                     reports=not args.no_reports)
    with Output(args.json) as out:
        summary = run_demo(cfg, force=args.force)
        if args.json:
            out.show(summary, [])
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    from labkit.readout import Output
    from labkit.train.upgrade import upgrade

    with Output(args.json) as out:
        done = upgrade(args.run_dir)
        lines = [f"upgraded {d['path']} ({d['kind']} run, step {d['step']}) to format 2" for d in done]
        out.show({"run_dir": args.run_dir, "upgraded": done},
                 lines or [f"{args.run_dir}: no format-1 checkpoint, nothing to upgrade"])
    return 0


def _verify(args: argparse.Namespace) -> int:
    from labkit.data.shards import verify_shards
    from labkit.readout import Output, verify_line

    index = verify_shards(args.shard_dir)
    with Output(args.json) as out:
        out.show({"shard_dir": args.shard_dir, "shards": len(index["shards"]), "sequences": index["n_sequences"],
                  "seq_len": index["seq_len"], "vocab_size": index["vocab_size"],
                  "heldout_sequences": (index.get("heldout") or {}).get("n_sequences", 0)},
                 [verify_line(index, args.shard_dir)])
    return 0


def _report(args: argparse.Namespace) -> int:
    from labkit import preflight
    from labkit.readout import Output
    from labkit.report import execute_notebook

    params = {}
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {item!r}: expected key=value")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    preflight.check_writable_file(args.out, "out")
    with Output(args.json) as out:
        html = execute_notebook(args.notebook, args.out, parameters=params)
        out.show({"notebook": args.notebook, "out": str(html)}, [f"wrote {html} (executed {args.notebook})"])
    return 0


def _resume(args: argparse.Namespace) -> int:
    from labkit import commands
    from labkit.config.tomlfile import ClusterConfig

    engines = args.engines or commands.run_world_size(args.run_dir) or ClusterConfig().engines
    cluster = ClusterConfig(engines=engines, kind="slurm" if args.slurm else "local", profile=args.profile,
                            cluster_id=args.cluster_id)
    return commands.resume(args.run_dir, cluster, args.set, as_json=args.json)


def _command(name: str):
    """The handler of subcommand ``name`` (imports labkit.commands lazily: --help stays fast)."""
    def run(args: argparse.Namespace) -> int:
        from labkit import commands

        if name == "sweep":
            return commands.sweep(args.kind, _config(args), args)
        if name == "plan":
            from labkit import planning

            if getattr(args, "model_module", None) and not args.config:  # your own model, counted
                from labkit.model_module import plan_model_module

                return plan_model_module(args, planning.preset_defaults(args))
            return planning.plan(args)
        if name == "forecast":
            from labkit.forecasting import forecast

            return forecast(args)
        if name == "export":
            return commands.export(args)
        cfg = _config(args)
        if name == "prepare":
            return commands.prepare(cfg, force=args.force, as_json=args.json)
        if name == "train":
            return commands.train(cfg, stage_first=not args.no_stage, as_json=args.json)
        return commands.stage(cfg, as_json=args.json)
    return run


JSON_HELP = "print one JSON object with the raw values on standard output (everything else goes to stderr)"


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def _add_common(p: argparse.ArgumentParser, *, config: bool = True, cluster: bool = True,
                engines_help: str = "number of engines (default: [cluster] engines)") -> None:
    if config:
        p.add_argument("config", help="TOML config file (see configs/walkthrough.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key (TOML value, else a string); repeatable")
    if config:
        p.add_argument("--scaled-down", action="store_true",
                       help="apply the file's scaled_down overrides first (configs/study.toml: its run on 2 CPU engines)")
    _add_json(p)
    if cluster:
        g = p.add_argument_group("cluster (default: local engines, as the notebooks)")
        g.add_argument("--engines", type=int, default=None, help=engines_help)
        g.add_argument("--profile", default=None, help="IPython profile of the cluster (default: ipyparallel's)")
        g.add_argument("--slurm", action="store_true", help="start the engines as a Slurm job ([cluster.slurm])")
        g.add_argument("--cluster-id", default=None, help="connect to this running cluster instead of starting one "
                                                          "(default: start one, stopped at the end)")


def _sub(sub, name: str, help_text: str, debug_parent: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, description=help_text, parents=[debug_parent],
                          epilog=f"example:\n  {EXAMPLES[name]}", formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_checkpoint(sub, debug: argparse.ArgumentParser) -> None:
    """The ``labkit checkpoint upgrade RUN_DIR`` subcommand (``labkit.train.upgrade``)."""
    p = _sub(sub, "checkpoint", "rewrite a run's format-1 checkpoints (before torch.distributed.checkpoint) once, "
                                "so it resumes", debug)
    p.add_argument("action", choices=("upgrade",))
    p.add_argument("run_dir")
    _add_json(p)
    p.set_defaults(func=_checkpoint)


def _add_plan(sub, debug_parent: argparse.ArgumentParser) -> None:
    """The ``labkit plan`` subcommand: a preset, a CONFIG file's run, or your own model
    (``--model-module``, whose contract is ``FACTORY_CONTRACT``)."""
    p = _sub(sub, "plan", "the planner's memory per GPU, parallel splits and scaling for a model and cluster",
             debug_parent)
    p.add_argument("config", nargs="?", default=None,
                   help="plan this TOML file's [train] model on its [plan] cluster (configs/study.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="with CONFIG: override one config key; repeatable")
    p.add_argument("--model", default=None, help="model preset (labkit.model.MODEL_SIZES; default bert-120m)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default 256)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default 2")
    p.add_argument("--seq-len", type=int, default=None, help="default 512, or CONFIG's [shards] seq_len")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per GPU per step (default 16, or CONFIG's micro_batch_size)")
    p.add_argument("--device", default=None,
                   help="a labkit.study.plan.DEVICES name, or cpu (with --model-module and --budget-gb); default H100 NVL")
    p.add_argument("--precision", default=None, choices=("bf16", "fp16", "fp32"),
                   help="default bf16, or CONFIG's [train] precision; the scaling table's compute runs at this "
                        "precision's peak (fp32: the CUDA cores')")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="default: the study's vocabulary (with --model-module: FACTORY's vocab_size, if it takes one)")
    p.add_argument("--network", default=None, help="a labkit.study.scaling.NETWORKS name (default 25GbE)")
    p.add_argument("--count", action="store_true",
                   help="with CONFIG: count what the step keeps (study.memory.plan_model; a minute or more on a CPU) "
                        "instead of the formula planner")
    p.add_argument("--out", default=None, help="with CONFIG: also write the JSON summary to this file")
    p.add_argument("--top", type=int, default=None, help="splits shown (default 8)")
    p.add_argument("--json", action="store_true", help="one JSON object with the raw values (bytes) instead of lines")
    g = p.add_argument_group(
        "your own model (labkit.study.memory.plan_model: counted, not estimated)", textwrap.fill(
        "--model-module FILE.py:FACTORY counts your model and predicts its data-parallel scaling (--gpus, "
        "--gpus-per-node, --network, --micro-batch; --json) from the counted parameters and FLOPs. "
        "The factory's contract: " + FACTORY_CONTRACT + ". Example: tests/plain_encoder.py. --model, --top and "
        "CONFIG's options are refused with it; --vocab-size is passed to the factory.", 100, break_on_hyphens=False))
    g.add_argument("--model-module", default=None, metavar="FILE.py:FACTORY",
                   help="FACTORY(seq_len=...) returns (make_model, make_batch); see tests/plain_encoder.py")
    g.add_argument("--budget-gb", type=float, default=None, help="with --model-module: memory per rank in GB (default: the device's)")
    g.add_argument("--sharding", default="ddp", choices=("none", "ddp", "zero1", "fsdp"))
    g.add_argument("--dp", type=int, default=None,
                   help="data-parallel ranks the state is sharded over (default: --gpus; 1 with --device cpu)")
    p.set_defaults(func=_command("plan"))


def _add_batch_sweep_args(p: argparse.ArgumentParser) -> None:
    """``labkit sweep batch``'s options (labkit.study.critical_batch)."""
    p.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32, 64],
                   help="batch: global batch sizes (sequences), one process each (labkit.study.critical_batch)")
    p.add_argument("--examples", type=int, default=None,
                   help="batch: sequences each run trains on (default: train.max_steps x its global batch)")
    p.add_argument("--target", type=float, default=None,
                   help="batch: held-out loss to reach (default: the worst run's best, so every run reaches it)")
    p.add_argument("--lr-rule", choices=("sqrt", "linear", "constant"), default=None,
                   help="batch, branch: train.optim.lr at train's global batch, scaled to each batch by this rule "
                        "(default: train.batch.lr_rule, sqrt)")
    p.add_argument("--at", type=int, nargs="+", default=None,
                   help="branch: steps of the base run to branch from (labkit.study.branching)")
    p.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="branch: branch batches as multiples of the run's global batch (1: the reference)")
    p.add_argument("--window", type=int, default=None,
                   help="branch: examples each branch trains on (default 8 x the largest branch's batch)")
    p.add_argument("--repeats", type=int, default=1, help="branch: data windows per branch point (default 1)")
    p.add_argument("--tolerance", type=float, default=0.2,
                   help="branch: a branch keeps pace when its progress per example is at least 1 - this of the "
                        "run's batch (default 0.2)")


def _add_forecast(sub: Any, debug: argparse.ArgumentParser) -> None:
    """``labkit forecast`` (labkit.forecasting, labkit.study.forecast)."""
    p = _sub(sub, "forecast", "time and GPU-hours to a target loss per GPU count: the planner's (or a measured) step "
                              "time joined with the critical batch, the knee by statistical goodput "
                              "(labkit.study.forecast)", debug)
    p.add_argument("config", help="a TOML file: its [train] model, micro_batch_size and precision, [shards] seq_len, "
                                  "[plan] device, network, gpus_per_node, mfu and vocab_size (else the shards')")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config key")
    p.add_argument("--gpus", default="1,2,4,8,16,32,64,128,256", help="comma-separated GPU counts")
    p.add_argument("--micro-batches", default=None, help="comma-separated sequences per GPU (default: train's); "
                                                         "those that do not fit the device are marked")
    p.add_argument("--device", default=None, help="a labkit.study.plan.DEVICES name (default: [plan] device), or cpu: "
                                                  "the step time is measured here, in this process, its load shown")
    p.add_argument("--network", default=None, help="a labkit.study.scaling.NETWORKS name (default: [plan] network)")
    p.add_argument("--mfu", type=float, default=None, help="assumed MFU of the compute (default: [plan] mfu, 0.4)")
    p.add_argument("--step-time-s", type=float, default=None,
                   help="a measured one-rank step time in seconds (one micro-batch) instead of the planned one")
    p.add_argument("--critical-batch", default=None, metavar="PARQUET",
                   help="B_crit, its bootstrap range and E_min from a `labkit sweep batch` table "
                        "(<workdir>/sweeps/critical_batch.parquet): the time then has a range")
    p.add_argument("--b-crit-tokens", type=float, default=None,
                   help="the critical batch at the target in tokens (default: Kaplan et al.'s B_crit(L), an assumption)")
    p.add_argument("--target-loss", type=float, default=2.0, help="nats, for the default B_crit(L) (default 2.0)")
    p.add_argument("--tokens", type=float, default=None,
                   help="E_min: tokens a small-batch run needs to the target (default 20 per parameter, an assumption)")
    p.add_argument("--growth", type=float, default=0.0,
                   help="B_crit grows as progress^GROWTH during the run (default 0: constant)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.set_defaults(func=_command("forecast"))


def _add_sweep(sub, debug: argparse.ArgumentParser) -> None:
    """``labkit sweep KIND``: its options (each says which kinds read it)."""
    p = _sub(sub, "sweep", "scaling sweeps: ranks, micro-batch, DataLoader workers, a shaped network (notebook 04), "
                           "data x tensor x pipeline splits (notebook 06), the critical batch by whole runs (batch) "
                           "and by branching from a run's checkpoints (branch; notebook 07)", debug)
    p.add_argument("kind", choices=("ranks", "micro-batch", "loaders", "network", "parallel", "batch", "branch"))
    _add_common(p)
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="ranks: the rank counts (default 1..engines)")
    p.add_argument("--models", nargs="+", default=None, help="micro-batch: model presets (default: train.model)")
    p.add_argument("--budget-gib", type=float, default=2.0,
                   help="micro-batch: GiB (2**30 bytes) per rank; 0 = the GPU until OOM")
    p.add_argument("--budget-gb", type=float, default=None, help=argparse.SUPPRESS)  # refused: GB is plan's unit
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="loaders: worker counts")
    p.add_argument("--step-time-s", type=float, default=0.05, help="loaders: the consumer's step time (s)")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="parallel: micro-batches per step and data-parallel replica (the pipeline's m)")
    p.add_argument("--steps", type=int, default=None, help="parallel: optimiser steps per split (default 8); "
                                                           "network: per run, the first 2 untimed (default 6)")
    p.add_argument("--rates-mbit", type=float, nargs="+", default=[0, 1000, 200, 50],
                   help="network: link settings in Mbit/s between the two hosts, 0 = unshaped (root)")
    p.add_argument("--compression", nargs="+", default=["none"], choices=("none", "bf16", "powersgd"),
                   help="network: train.parallel.grad_compression values, each at every setting")
    _add_batch_sweep_args(p)
    p.add_argument("--critical-batch", default=None, metavar="PARQUET",
                   help="ranks: B_noise of the statistical goodput column from a `labkit sweep batch` table "
                        "(<workdir>/sweeps/critical_batch.parquet: its B_crit); default: the in-run B_simple of the "
                        "run with the most ranks. branch: the B_crit shown beside (default: that file, if any)")
    p.add_argument("--force", action="store_true", help="rerun points already in the sweep's table")
    p.set_defaults(func=_command("sweep"))


def _ranks(args: argparse.Namespace) -> int:
    """``labkit ranks RUN_DIR``: ``labkit.cluster.stuck.report``'s lines (``--json``: the rest of
    its dict); status 1 when a rank holds the others up (stuck or slow)."""
    from labkit.cluster.stuck import report
    from labkit.readout import Output

    found = report(args.run_dir)
    with Output(args.json) as out:
        out.show({k: v for k, v in found.items() if k != "lines"}, found["lines"])
    return 1 if found["state"] in ("stuck", "slow") else 0


def _add_ranks(sub: argparse._SubParsersAction, debug: argparse.ArgumentParser) -> None:
    p = _sub(sub, "ranks", "each rank of a running run: host, step, collective; names the rank the others wait "
                           "for when a step stalls (labkit.cluster.stuck)", debug)
    p.add_argument("run_dir", help="the run directory (its ranks/ holds one status file per rank)")
    _add_json(p)
    p.set_defaults(func=_ranks)


def build_parser() -> argparse.ArgumentParser:
    """The ``labkit`` argument parser (every subcommand's ``--help`` ends with an example)."""
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full traceback of an error")
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.split("\n\n")[0], parents=[debug],
                                     epilog="\n".join(f"  {e}" for e in EXAMPLES.values()),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = _sub(sub, "prepare", "corpus, cleaning, tokenizer and shards on the engines (notebook 01)", debug)
    _add_common(p)
    p.add_argument("--force", action="store_true", help="redo every stage even if its artifact is complete")
    p.set_defaults(func=_command("prepare"))
    p = _sub(sub, "stage", "copy the shards to node-local disk, verifying checksums (notebook 02)", debug)
    _add_common(p)
    p.set_defaults(func=_command("stage"))
    p = _sub(sub, "train", "train under DDP on the engines (notebook 03), with a progress bar over the steps; on "
                           "train.stop_after or Ctrl-C it names the last checkpoint and the command that continues it",
             debug)
    _add_common(p)
    p.add_argument("--no-stage", action="store_true", help="read data_dir directly instead of staged copies")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (train.parallel.tp; sharding fsdp or "
                   "replicate: replicate when unset and the engines hold one copy)")
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree (train.parallel.pp; micro-batches: "
                                                        "train.batch.grad_accum_steps)")
    p.set_defaults(func=_command("train"))
    p = _sub(sub, "resume", "continue a run from its newest checkpoint with its saved config, on as many engines as "
                            "it ran on", debug)
    p.add_argument("run_dir")
    _add_common(p, config=False, engines_help="number of engines (default: as many as the run ran on, its "
                                              "config.json's world size; [cluster] engines when it has none)")
    p.set_defaults(func=_resume)
    _add_sweep(sub, debug)
    _add_plan(sub, debug)
    _add_forecast(sub, debug)
    p = _sub(sub, "export", "write a run's model, tokenizer and model card for transformers", debug)
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run's tokenizer_path)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT")
    _add_json(p)
    p.set_defaults(func=_command("export"))
    _add_checkpoint(sub, debug)

    _add_ranks(sub, debug)

    p = _sub(sub, "demo", "the end-to-end lab on local engines, CPU, real ELF binaries", debug)
    p.add_argument("--workdir", default="work/demo", help="where every artifact goes (default: work/demo)")
    p.add_argument("--engines", type=int, default=2, help="local ipyparallel engines (default: 2)")
    p.add_argument("--max-functions", type=int, default=None,
                   help="functions to disassemble (default: 30000, CorpusConfig.max_functions)")
    p.add_argument("--paths", nargs="*", default=None,
                   help="ELF files or directories (default: CorpusConfig.paths, the system's /usr/lib, /usr/bin, ...)")
    p.add_argument("--steps", type=int, default=None, help="DDP training steps (default: 40, DemoConfig.train_steps)")
    p.add_argument("--no-reports", action="store_true", help="skip executing the notebooks")
    p.add_argument("--force", action="store_true", help="redo every stage, the training run and the sweeps, even "
                                                        "those whose artifacts match the settings")
    p.add_argument("--json", action="store_true", help="print the summary (demo.json) as JSON on standard output; "
                                                       "the progress lines go to stderr")
    p.set_defaults(func=_demo)
    p = _sub(sub, "verify", "check a shard set's index and the sha256 of every shard and the held-out file", debug)
    p.add_argument("shard_dir")
    _add_json(p)
    p.set_defaults(func=_verify)
    p = _sub(sub, "report", "execute a notebook and export it as self-contained HTML", debug)
    p.add_argument("notebook")
    p.add_argument("out")
    p.add_argument("--param", action="append", default=[], help="key=value (JSON value) for the parameters cell")
    _add_json(p)
    p.set_defaults(func=_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``labkit`` console script; returns the exit status."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    from labkit.env import COMMAND_ENV

    before = os.environ.get(COMMAND_ENV)
    os.environ[COMMAND_ENV] = shlex.join(["labkit", *argv])  # engines inherit it: provenance's command line
    try:
        return _guarded(f"labkit {args.command}", args.func, args, _input_errors)
    finally:  # main() called in-process (tests, notebooks) must not leave it for later runs
        if "labkit.commands" in sys.modules:  # nor notes of a refused command
            sys.modules["labkit.commands"]._NOTES.clear()
        if before is None:
            os.environ.pop(COMMAND_ENV, None)
        else:
            os.environ[COMMAND_ENV] = before


if __name__ == "__main__":
    sys.exit(main())
