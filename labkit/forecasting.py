"""What ``labkit forecast CONFIG`` does: time and GPU-hours to a target loss per GPU count.

The config's own model at its own vocabulary and sequence length ([plan] vocab_size, else its
shards'; [train] seq_len, else the shards', else [shards] seq_len: the model ``labkit train
CONFIG`` builds), the step time planned from the device's peak at the config's
precision, or on ``--device cpu`` measured here, in this process, with the machine's load
recorded and shown (``labkit.study.forecast.measure_step_time``), or given (``--step-time-s``).
The critical batch is Kaplan et al.'s assumption unless ``--critical-batch`` reads a
``labkit sweep batch`` table, whose bootstrap range gives the time a range. Micro-batches that do
not fit the device (the planner's largest, ``labkit plan CONFIG``) are marked in every output.
Every value is checked before anything is printed; lines by default, ``--json`` one object.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from labkit.planning import check_network, config_vocab, print_table

__all__ = ["duration", "forecast", "read_critical_batch", "sig3"]


def duration(seconds: float) -> str:
    """Seconds as a reader's duration, 3 significant digits: '41.2 s', '7.50 min', '3.10 h', '2.40 d'."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def sig3(value: float) -> str:
    """``value`` to 3 significant digits for a table: '0.0995', '13.1', '1,120', '47,100'."""
    return f"{float(f'{value:.3g}'):,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def read_critical_batch(path: str, seq_len: int) -> dict[str, Any]:
    """The critical batch a ``labkit sweep batch`` table (sweeps/critical_batch.parquet) measured,
    in tokens (its sequences x ``seq_len``, the config's): {"b_crit_tokens", "range_tokens" (its
    bootstrap range), "e_min_tokens", "level", "target_eval_loss", "source"}. ValueError naming the
    file when it is missing, is not such a table, or holds no fit (fewer than 3 batch sizes
    reached the target)."""
    import polars as pl

    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"--critical-batch: {path} does not exist (`labkit sweep batch CONFIG` writes "
                         "<workdir>/sweeps/critical_batch.parquet)")
    row = pl.read_parquet(file).row(0, named=True)
    missing = [k for k in ("b_crit", "b_crit_low", "b_crit_high", "e_min", "target_eval_loss") if k not in row]
    if missing:
        raise ValueError(f"--critical-batch: {path} is not a `labkit sweep batch` table (no {missing[0]} column)")
    if row["b_crit"] is None:
        raise ValueError(f"--critical-batch: {path} holds no fit (fewer than 3 batch sizes reached the target)")
    return {"b_crit_tokens": row["b_crit"] * seq_len, "e_min_tokens": row["e_min"] * seq_len,
            "range_tokens": (row["b_crit_low"] * seq_len, row["b_crit_high"] * seq_len), "level": 0.9,
            "target_eval_loss": row["target_eval_loss"], "source": str(file)}


def _ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: positive integers, got {text!r}")
    return sorted(set(values))


def forecast(args) -> int:
    """``labkit forecast CONFIG``: time and GPU-hours to the target per GPU count and micro-batch
    (``labkit.study.forecast.study_forecast``), the knee's rule and the knee per micro-batch in a
    sentence true of any table (``knee_sentence``), the assumptions labelled; ``--json``: one JSON
    object."""
    import dataclasses

    from labkit.config.tomlfile import load
    from labkit.study.forecast import measure_step_time, study_forecast
    from labkit.study.plan import device_info
    from labkit.study.scaling import peak_of
    from labkit.train.run_config import model_config_of

    lab = load(args.config, args.set)
    gpus = _ints("--gpus", args.gpus)
    mbs = _ints("--micro-batches", args.micro_batches) if args.micro_batches else [lab.train.batch.micro_batch_size]
    device = args.device or lab.plan.device
    network = args.network or lab.plan.network
    mfu = args.mfu if args.mfu is not None else lab.plan.mfu
    check_network(network)
    if device != "cpu":
        device_info(device)  # ValueError naming the known devices
    if args.step_time_s is not None and (args.step_time_s <= 0 or len(mbs) > 1):
        raise ValueError(f"--step-time-s: one positive measured step time of one micro-batch, got {args.step_time_s} "
                         f"for micro-batches {mbs}")
    if device != "cpu" and args.step_time_s is None:
        peak_of(device, lab.train.precision)  # ValueError: no such peak on this device
    vocab, vocab_from = config_vocab(lab, lab.plan.vocab_size, args.config)
    mcfg = model_config_of(lab.train, vocab)
    index = pathlib.Path(lab.workdir, "shards", "index.json")
    seq_len = lab.train.data.seq_len or (json.loads(index.read_text())["seq_len"] if index.is_file() else lab.shards.seq_len)
    crit = read_critical_batch(args.critical_batch, seq_len) if args.critical_batch else None
    gpus_per_node = 1 if device == "cpu" else lab.plan.gpus_per_node
    compute_s, source, measured = None, None, {}
    if args.step_time_s is not None:
        compute_s = {mbs[0]: args.step_time_s}
        source = f"given: {args.step_time_s:.3g} s per step at micro-batch {mbs[0]} (--step-time-s)"
    elif device == "cpu":
        measured = {b: measure_step_time(mcfg, micro_batch=b, seq_len=seq_len, precision=lab.train.precision,
                                         mlm_probability=lab.train.data.mlm_probability, threads=lab.train.num_threads)
                    for b in mbs}
        compute_s = {b: m["step_s"] for b, m in measured.items()}
        m = next(iter(measured.values()))
        source = ("measured here, in this process: " + ", ".join(
            f"{v['step_s']:.3g} s at micro-batch {b}" for b, v in measured.items())
            + f" (mean of {m['steps']} steps after {m['warmup']} untimed, {m['threads']} torch thread(s), "
            f"load average {m['load_avg_1m'][0]:.2f} -> {m['load_avg_1m'][1]:.2f} on {m['cpu_count']} CPUs)")
    given = {"e_min_tokens": args.tokens, "b_crit_tokens": args.b_crit_tokens, "b_crit_range_tokens": None}
    if crit is not None:
        given = {"e_min_tokens": crit["e_min_tokens"], "b_crit_tokens": crit["b_crit_tokens"],
                 "b_crit_range_tokens": crit["range_tokens"]}
    out = study_forecast(mcfg, gpus=gpus, micro_batches=mbs, seq_len=seq_len, network=network, device=device, mfu=mfu,
                         precision=lab.train.precision, growth=args.growth, target_loss=args.target_loss,
                         gpus_per_node=gpus_per_node, compute_s=compute_s, compute_source=source, **given)
    if crit is not None:
        out["assumptions"].insert(1, f"B_crit {crit['b_crit_tokens']:,.0f} tokens ({crit['level']:.0%} bootstrap range "
                                     f"{crit['range_tokens'][0]:,.0f}-{crit['range_tokens'][1]:,.0f}) and E_min "
                                     f"{crit['e_min_tokens']:.3g} tokens, measured to held-out loss "
                                     f"{crit['target_eval_loss']:.3f} by `labkit sweep batch` ({crit['source']})")
    out |= {"config": str(args.config), "vocab_size": vocab, "vocab_from": vocab_from, "step_time": measured or None}
    if args.json:
        print(json.dumps(out, default=str))
        return 0
    _print_forecast(out, lab, dataclasses.replace(lab.plan, device=device, network=network), mcfg, seq_len=seq_len,
                    gpus_per_node=gpus_per_node)
    return 0


def _print_forecast(out: dict, lab, pc, mcfg, *, seq_len: int, gpus_per_node: int) -> None:
    """``forecast``'s lines: the model, where the step time comes from, the micro-batches that do
    not fit, the table (rounded, units in the names), the knee's rule, one sentence per
    micro-batch, the assumptions."""
    import polars as pl

    from labkit.study.forecast import knee_sentence

    inputs, cpu = out["inputs"], pc.device == "cpu"
    print(f"{out['config']}: {lab.train.model} + model_overrides at vocabulary {out['vocab_size']:,} "
          f"({out['vocab_from']}): {out['params'] / 1e6:.3g} M parameters, seq {seq_len}, {inputs['precision']}, "
          f"on {pc.device}{' ranks' if cpu else ''}, {gpus_per_node} per node, over {pc.network}")
    print(f"step time: {out['assumptions'][0]}; at n {'ranks' if cpu else 'GPUs'} plus the exposed all-reduce "
          f"of fp32 gradients over {pc.network} (labkit.study.scaling.step_time)")
    best = out["max_micro_batch"]
    for b in sorted({r["micro_batch"] for r in out["table"] if not r["fits"]}):
        print(f"micro-batch {b} does NOT fit the {pc.device}: the planner's largest at seq {seq_len}, "
              f"{inputs['precision']} is {best} (labkit plan CONFIG); its rows (fits false) forecast a run that "
              "would not start")
    df = pl.DataFrame(out["table"])
    cols = [pl.col("n_gpus").alias("ranks" if cpu else "GPUs"), pl.col("micro_batch").alias("micro-batch"),
            pl.col("global_batch").alias("global batch"), pl.col("steps").round().cast(pl.Int64),
            pl.col("step_s").round_sig_figs(3),
            pl.Series("time", [duration(3600 * h) for h in df["hours"]])]
    if "hours_low" in df.columns:
        cols.append(pl.Series("time range", [f"{duration(3600 * lo)} - {duration(3600 * hi)}"
                                             for lo, hi in zip(df["hours_low"], df["hours_high"])]))
    cols += [pl.Series("rank-hours" if cpu else "GPU-hours", [sig3(v) for v in df["gpu_hours"]]),
             pl.col("batch_over_b_crit").round_sig_figs(3).alias("B / B_crit"),
             pl.col("statistical_efficiency").round(3).alias("E(B)"),
             pl.Series("goodput seq/s", [sig3(v) for v in df["goodput"]]), "fits"]
    print_table(df.select(cols))
    print(out["rule"])
    for b, k in out["knee"].items():
        print(knee_sentence(k, int(b), min_gain=inputs["min_gain"], unit="ranks" if cpu else "GPUs")
              + ("" if best is None or int(b) <= best else " (does NOT fit)"))
    print("assumptions:\n  " + "\n  ".join(out["assumptions"][1:]))
