"""What ``labkit plan`` does (``labkit.cli`` parses its options): a preset or a CONFIG file's run.

No cluster is needed: the planner's formulas (``labkit.study.plan``, ``parallel``, ``scaling``).
A user's own model (``--model-module``) is ``labkit.model_module``; ``labkit forecast`` is
``labkit.forecasting``. Every value is checked, and every number computed, before anything is
printed, so a refusal is one line with nothing above it. Output is lines for a reader by default
(tables rounded, units in the column names, each scaling table saying which precision and peak
it used); ``--json`` prints one JSON object of the raw values instead.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

__all__ = ["GPU_COUNTS", "PRESET_DEFAULTS", "SCALING_NOTE", "check_network", "config_vocab", "peak_text", "plan",
           "plan_config", "preset_defaults", "print_json", "print_plan", "print_table", "scaling_view"]

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""The GPU counts of the scaling tables, up to ``--gpus``."""


def print_json(obj: Any) -> None:
    """One JSON object on stdout (``--json``)."""
    print(json.dumps(obj, indent=2, default=str))


def print_table(df) -> None:
    """A polars table in full, without its shape and dtypes (a reader's terminal)."""
    import polars as pl

    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, tbl_hide_dataframe_shape=True,
                   tbl_hide_column_data_types=True, tbl_hide_dtype_separator=True):
        print(df)


def check_network(network: str) -> None:
    """ValueError naming the known networks unless ``network`` is a ``labkit.study.scaling.NETWORKS`` name."""
    from labkit.study.scaling import NETWORKS

    if network not in NETWORKS:
        raise ValueError(f"network: unknown {network!r}; known networks are {sorted(NETWORKS)}")


def peak_text(device: str, precision: str, mfu: float) -> str:
    """'40 % MFU of the H100 NVL's dense fp32 peak (60 TFLOP/s)'; ValueError without such a peak."""
    from labkit.study.scaling import peak_of

    return f"{mfu:.0%} MFU of the {device}'s dense {precision} peak ({peak_of(device, precision) / 1e12:g} TFLOP/s)"


def scaling_view(table):
    """An ``efficiency_table`` as printed: seconds to 3 significant digits, efficiency to 3 decimals."""
    import polars as pl

    return table.select("n_gpus", "nodes", *[pl.col(c).round_sig_figs(3) for c in ("compute_s", "comm_s",
                                                                                    "exposed_s", "step_s")],
                        pl.col("efficiency").round(3), "comm_hidden")


SCALING_NOTE = ("comm_hidden: only the bucket ready last is exposed after backward, and it is under half the\n"
                "all-reduce (a model whose gradients fit one bucket never hides it); seconds per optimiser step")


PRESET_DEFAULTS = {"model": "bert-120m", "gpus": 256, "gpus_per_node": 2, "seq_len": 512, "micro_batch": 16,
                   "device": "H100 NVL", "precision": "bf16", "network": "25GbE", "top": 8}
"""``labkit plan``'s defaults without a CONFIG (a preset, or ``--model-module``)."""


def preset_defaults(args) -> set[str]:
    """Fill ``args``' unset options from ``PRESET_DEFAULTS``; returns the options the command line set.
    Raises ValueError naming the option when a count (``--gpus``, ``--gpus-per-node``, ``--seq-len``,
    ``--micro-batch``) is below 1."""
    given = {key for key in PRESET_DEFAULTS if getattr(args, key, None) is not None}
    for key, value in PRESET_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key in ("gpus", "gpus_per_node", "seq_len", "micro_batch"):
        value = getattr(args, key, None)
        if isinstance(value, int) and value < 1:
            raise ValueError(f"--{key.replace('_', '-')}: must be >= 1, got {value}")
    return given


def plan(args) -> int:
    """The planner at a chosen scale (notebook 04's second half), for a model preset: memory per
    GPU term by term under plain data parallelism, the largest micro-batch that fits, the dp x tp x
    pp x ZeRO splits that fit, and the predicted data-parallel scaling from 1 GPU to ``args.gpus``
    at ``args.precision``'s peak (``print_plan``). No cluster needed. With a CONFIG file,
    ``plan_config`` plans that file's run instead. (``--model-module``, a user's own model, is
    ``labkit.model_module.plan_model_module``, which ``labkit.cli`` calls.)"""
    from labkit.model import model_config
    from labkit.study import plan as lp

    if getattr(args, "config", None):
        return plan_config(args)
    preset_defaults(args)
    if getattr(args, "budget_gb", None) is not None or args.device == "cpu":
        raise ValueError("--budget-gb and --device cpu plan a counted model: give --model-module FILE.py:FACTORY "
                         "(a preset is planned for a device from the table, at that device's memory)")
    cfg = model_config(args.model, args.vocab_size or lp.STUDY_VOCAB,
                       max_position_embeddings=max(512, args.seq_len))
    print_plan(cfg, args, name=args.model)
    return 0


def print_plan(cfg, args, *, name: str) -> None:
    """Print the planner's tables for the ModelConfig ``cfg`` under ``args`` (gpus, gpus_per_node,
    seq_len, micro_batch, device, precision, network, top, json): memory per GPU term by term in GB
    under plain data parallelism, the largest micro-batch that fits the device
    (``labkit.study.plan.planned_max_micro_batch``), the dp x tp x pp x ZeRO splits that fit, and
    the predicted data-parallel scaling from 1 GPU to ``args.gpus`` with the compute at
    ``args.precision``'s peak. With ``args.json`` one JSON object with the raw values (bytes)
    instead. Every value is checked and every table computed before the first line."""
    import polars as pl

    from labkit.study import parallel, scaling
    from labkit.study import plan as lp

    check_network(args.network)
    peak = peak_text(args.device, args.precision, 0.4)
    mem = lp.memory_plan(cfg, seq_len=args.seq_len, micro_batch=args.micro_batch, precision=args.precision,
                         dp=args.gpus)
    cap = lp.device_info(args.device)["memory_bytes"]
    best = lp.planned_max_micro_batch(cfg, device=args.device, seq_len=args.seq_len, precision=args.precision,
                                      dp=args.gpus)
    plans = parallel.parallel_plans(cfg, n_gpus=args.gpus, seq_len=args.seq_len, micro_batch=args.micro_batch,
                                    device=args.device, gpus_per_node=args.gpus_per_node, precision=args.precision)
    table = scaling.study_scaling(name, micro_batch=args.micro_batch, seq_len=args.seq_len, device=args.device,
                                  vocab_size=cfg.vocab_size, gpus=tuple(g for g in GPU_COUNTS if g <= args.gpus),
                                  network=args.network, gpus_per_node=args.gpus_per_node, precision=args.precision)
    fits = plans.filter(pl.col("fits")).head(args.top)
    if getattr(args, "json", False):
        print_json({"memory": mem | {"fits": mem["total"] <= cap, "capacity_bytes": cap},
                    "max_micro_batch": best["max_micro_batch"],
                    "max_micro_batch_capacity_bytes": best["capacity_bytes"],
                    "splits_that_fit": fits.to_dicts(), "scaling": table.to_dicts(),
                    "scaling_inputs": {"precision": args.precision, "mfu": 0.4,
                                       "peak_flops": scaling.peak_of(args.device, args.precision)}})
        return
    print(f"memory per GPU: {name} on {args.device} ({cap / 1e9:.0f} GB), data parallel over {args.gpus} GPUs, "
          f"micro-batch {args.micro_batch} x {args.seq_len} tokens, {args.precision} (GB = 1e9 bytes):")
    _print_memory(mem)
    verdict = "fits" if mem["total"] <= cap else "does NOT fit"
    print(f"{mem['total'] / 1e9:.2f} GB of {cap / 1e9:.0f} GB: {verdict}. Largest micro-batch that fits: "
          f"{best['max_micro_batch']} sequences of {args.seq_len} tokens "
          f"({best['capacity_bytes'] / 1e9:.0f} GB usable, "
          "1 GiB kept for the CUDA context)")
    print("\nsplits that fit (dp x tp x pp, ZeRO stage), least model parallelism first:")
    print_table(fits.select("dp", "tp", "pp", "zero_stage", (pl.col("total") / 1e9).round(2).alias("GB per GPU"),
                            pl.col("bubble").round(3), "tp_within_node"))
    print(f"\npredicted data-parallel scaling over {args.network}, {args.gpus_per_node} GPUs per node, compute at "
          f"{peak}:")
    print_table(scaling_view(table))
    print(SCALING_NOTE)


def _print_memory(mem: dict) -> None:
    """A ``labkit.study.plan.memory_plan`` as a table: each term in GB (1e9 bytes) and its share
    of the total (``--json`` keeps the bytes)."""
    import polars as pl

    terms = [k for k in ("params", "grads", "optimizer", "autocast_copies", "activations", "logits", "head_backward")
             if k in mem]
    print_table(pl.DataFrame({"term": terms + ["total"], "GB": [round(mem[k] / 1e9, 3) for k in terms + ["total"]],
                              "share": [round(mem[k] / mem["total"], 3) for k in terms] + [1.0]}))


def plan_config(args) -> int:
    """``labkit plan CONFIG``: the file's [train] model (preset + model_overrides) at its
    micro-batch, sequence length and precision, on the [plan] device, GPUs and network (each
    also an option of the command; the vocabulary: [plan] vocab_size, else the work
    directory's shards). Prints the memory per GPU term by term, the largest micro-batch that
    fits (``study.plan.planned_max_micro_batch``; with ``--count`` the count of what the step
    keeps, ``study.memory.plan_model``) beside the file's, and the precision experiment
    (``study.scaling.precision_experiment``: step time and DP efficiency at 1..gpus in fp32,
    TF32 and bf16, those the device has a peak for) with the gradient compressions. ``--json``:
    one JSON summary instead (also written to ``--out``)."""
    import dataclasses

    from labkit.config.tomlfile import load
    from labkit.study import plan as lp
    from labkit.study import scaling
    from labkit.train.run_config import model_config_of

    lab = load(args.config, args.set)
    pc = dataclasses.replace(lab.plan, **{k: v for k, v in (("device", args.device), ("gpus", args.gpus),
                                                            ("gpus_per_node", args.gpus_per_node),
                                                            ("network", args.network),
                                                            ("vocab_size", args.vocab_size)) if v is not None})
    check_network(pc.network)
    peaks = lp.device_info(pc.device)["peaks"]  # ValueError for an unknown device
    precisions = tuple(p for p in scaling.STUDY_PRECISIONS if p in peaks)
    vocab, vocab_from = config_vocab(lab, pc.vocab_size, args.config)
    cfg = model_config_of(lab.train, vocab)
    seq_len, batch = args.seq_len or lab.shards.seq_len, args.micro_batch or lab.train.batch.micro_batch_size
    precision = args.precision or lab.train.precision
    attention = "eager" if cfg.attention_backend == "eager" else "flash"
    mem = lp.memory_plan(cfg, seq_len=seq_len, micro_batch=batch, precision=precision, attention=attention,
                         dp=pc.gpus)
    if getattr(args, "count", False):  # count what the step keeps (any model; about a minute on a CPU)
        from labkit.study import memory

        make_model, make_batch = memory.labkit_model(cfg, seq_len, mlm_probability=lab.train.data.mlm_probability)
        fit = memory.plan_model(make_model, make_batch, device=pc.device, precision=precision, sharding="ddp",
                                dp=pc.gpus)
        method = "counted (study.memory.plan_model)"
    else:
        fit = lp.planned_max_micro_batch(cfg, device=pc.device, seq_len=seq_len, precision=precision,
                                         attention=attention, dp=pc.gpus)
        method = "planned (study.plan.planned_max_micro_batch)"
    cap = lp.device_info(pc.device)["memory_bytes"]
    gpus = tuple(g for g in GPU_COUNTS if g <= pc.gpus)
    kw = dict(micro_batch=batch, seq_len=seq_len, device=pc.device, network=pc.network, gpus_per_node=pc.gpus_per_node,
              mfu=pc.mfu, precisions=precisions)
    table = scaling.precision_experiment(cfg, gpus=gpus, **kw)
    summary_table = scaling.precision_summary(table, mfu=pc.mfu)
    levers = scaling.compression_table(cfg, n_gpus=gpus[-1], **kw)
    rows = list(summary_table.iter_rows(named=True))
    best = fit["max_micro_batch"]
    summary = {"config": str(args.config), "vocab_size": vocab, "vocab_from": vocab_from, "max_micro_batch": best,
               "method": method, "micro_batch_size": batch, "within_10pct": abs(best - batch) <= 0.1 * batch,
               "efficiency_at_max_gpus": {r["precision"]: round(r["efficiency"], 3) for r in rows},
               "n_gpus": gpus[-1], "network": pc.network, "mfu": pc.mfu,
               "peak_flops": {r["precision"]: r["peak_flops"] for r in rows},
               "network_limit_from_n": {r["precision"]: r["first_exposed_n"] for r in rows},
               "break_even_mfu": {r["precision"]: None if r["break_even_mfu"] is None else round(r["break_even_mfu"], 3)
                                  for r in rows},
               "efficiency_compressed": {p: {r["grad_compression"]: round(r["efficiency"], 3)
                                             for r in levers.iter_rows(named=True) if r["precision"] == p}
                                         for p in levers["precision"].unique(maintain_order=True)}}
    if getattr(args, "out", None):
        from labkit.io import atomic_write_json

        atomic_write_json(pathlib.Path(args.out), summary)
    if getattr(args, "json", False):
        print_json(summary)
        return 0
    _print_config_plan(args.config, lab, pc, summary, mem=mem, cap=cap, table=table, summary_table=summary_table,
                       levers=levers, precision=precision, attention=attention, seq_len=seq_len)
    return 0


def config_vocab(lab, vocab_size: int | None, config: str) -> tuple[int, str]:
    """(the vocabulary of CONFIG's model, where it comes from): ``vocab_size`` (the [plan] table or
    ``--vocab-size``), else the work directory's shards (index.json), the vocabulary the run
    trains with. ValueError in one line when neither exists."""
    from labkit.data.shards import read_index

    if vocab_size:
        return vocab_size, "the [plan] vocab_size"
    shards = pathlib.Path(lab.workdir) / "shards"
    if not (shards / "index.json").is_file():
        raise ValueError(f"plan.vocab_size: {config} sets none and {shards} holds no shard set; run `labkit prepare "
                         f"{config}` first, or set the vocabulary (--set plan.vocab_size=N)")
    return int(read_index(shards)["vocab_size"]), f"the shards in {shards}"


def _print_config_plan(config, lab, pc, summary: dict, *, mem, cap, table, summary_table, levers, precision: str,
                       attention: str, seq_len: int) -> None:
    """``plan_config``'s lines: the memory table, the largest micro-batch, the precision
    experiment (each precision at its own peak, named), its summary with the break-even MFU in
    words, and the compression table, rounded and with units."""
    import polars as pl

    batch, best = summary["micro_batch_size"], summary["max_micro_batch"]
    print(f"{config}: {lab.train.model} + model_overrides, vocabulary {summary['vocab_size']:,} "
          f"({summary['vocab_from']}), seq {seq_len} ({lab.shards.packing}), {precision}, {attention} attention, "
          f"DDP over {pc.gpus} GPUs on {pc.device}")
    print(f"memory per GPU at micro-batch {batch} (GB = 1e9 bytes): {mem['total'] / 1e9:.2f} GB of {cap / 1e9:.0f} GB, "
          + ("fits" if mem["total"] <= cap else "does NOT fit"))
    _print_memory(mem)
    print(f"largest micro-batch that fits ({precision}, {summary['method']}): {best} (the file's micro_batch_size "
          f"{batch}: {(best - batch) / batch:+.1%})")
    peaks = ", ".join(f"{p} {v / 1e12:g}" for p, v in summary["peak_flops"].items())
    absent = [p for p in ("fp32", "tf32", "bf16") if p not in summary["peak_flops"]]
    peaks += f"; no {' or '.join(absent)} peak in labkit.measure.DEVICES" if absent else ""
    print(f"\nplanned data-parallel efficiency over {pc.network}, {pc.gpus_per_node} GPUs per node, micro-batch {batch}, "
          f"compute at {pc.mfu:.0%} MFU of each precision's dense peak on the {pc.device} (TFLOP/s: {peaks}):")
    print_table(table.pivot(on="precision", index="n_gpus", values="efficiency").with_columns(
        pl.exclude("n_gpus").round(3)))
    hidden = [("never" if r["break_even_mfu"] is None else f"{r['break_even_mfu']:.0%}" + (" (any)" if
              r["break_even_mfu"] >= 1 else "")) for r in summary_table.iter_rows(named=True)]
    print_table(summary_table.select(
        "precision", (pl.col("peak_flops") / 1e12).alias("peak TFLOP/s"), pl.col("compute_s").round_sig_figs(3),
        pl.col("comm_s").round_sig_figs(3), pl.col("efficiency").round(3),
        *[pl.col(c).cast(pl.Utf8).fill_null("never").alias(name) for c, name in (
            ("first_exposed_n", "exposed from n"), ("below_90pct_n", "eff < 0.9 from n"))]).with_columns(
        pl.Series("hidden to MFU", hidden)))
    print(f"compute_s: one GPU's step; comm_s, efficiency: at {summary['n_gpus']} GPUs; exposed from n: the fewest GPUs "
          "whose all-reduce does not hide behind backward (comm_hidden false); hidden to MFU: the achieved MFU up to "
          f"which the all-reduce at {summary['n_gpus']} GPUs hides (the break-even; 'any' above 100 %: no achievable "
          "MFU exposes it; never: its last bucket is most of it)")
    print(f"\ngradient compression (train.parallel.grad_compression; powersgd at rank 4) at {summary['n_gpus']} GPUs over "
          f"{pc.network}:")
    print_table(levers.select("precision", "grad_compression", (pl.col("grad_bytes") / 1e6).round(1).alias("grad MB"),
                              pl.col("compute_s").round_sig_figs(3), pl.col("exposed_s").round_sig_figs(3),
                              pl.col("efficiency").round(3)))
