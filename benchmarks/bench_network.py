"""Lesson 4 on a link that really limits: 2 ranks across the network hosts h1/h2 (root), the
link shaped with tbf to 4+ bandwidths, each measured step time against the network model's
prediction (``labkit.study.scaling.link_step_time``, through ``labkit.study.network_sweep``).

Each round runs the sweep once: the 1-rank compute time (two 1-rank runs, one per host at once,
so the CPU is shared as in the 2-rank runs), then one 2-rank run per bandwidth, each beside the
link's measured TCP goodput. Per round and bandwidth a JSON line: measured step time, predicted,
ratio, efficiency (1-rank compute / 2-rank step), exposed communication, bytes per step. Then
per bandwidth the spread of the ratio over rounds (min, quartiles, max). The rounds pair the
1-rank and 2-rank measurements (same minutes of machine load). Goal: the median ratio within
0.85-1.15 at every bandwidth, one of which has efficiency below 0.6.

``--compression``: on the setting ``--compression-rate`` (Mbit/s; default 50, where fp32 mini
is well below 0.6 efficient), ``grad_compression`` "bf16" and "powersgd" against "none" in each
round (PowerSGD's warm-up is 2 steps there and the timed steps are compressed); the efficiency
gain (compressed / none, per round) with its spread. What each costs in learning is not measured
here (on random tokens every run sits at the uniform floor): benchmarks/compression_learning.py
measures it on real data.

``--bucket-auto``: at every ``--rates-mbit`` setting, ``bucket_cap_mb="auto"`` (the bucket sized
at start-up from a measured backward and two measured all-reduces on the run's own process group,
``labkit.train.buckets``) against torch's 25 MiB, paired per round: efficiency and exposed
communication, the buckets each sent, and the cap auto chose with what it measured (its
bucket_auto.json). Goal: auto's 2-rank step at least as fast as 25 MiB's at every setting (the
median over rounds of 25 MiB's step / auto's, paired by round, >= 1). The efficiency gain is printed
beside it but is not the goal: each efficiency divides by a 1-rank compute time measured beside its
own sweep (0.12-0.18 s across the runs of one idle-machine benchmark), whose noise it carries.

Random token shards (bench_ddp's) unless ``--data-dir``. The machine's load average is printed
beside every line. Run as root from the repository root: ``python benchmarks/bench_network.py``
(about 3 min a round for mini). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_ddp import spread, write_shards  # noqa: E402

from labkit.study.network_sweep import run_network_sweep  # noqa: E402


def _config(tmp: pathlib.Path, model: str, micro_batch: int, data: str) -> str:
    path = tmp / "bench_network.toml"
    path.write_text(f'workdir = "{tmp}"\n[train]\nmodel = "{model}"\nmicro_batch_size = {micro_batch}\n'
                    f'data_dir = "{data}"\nrun_dir = "{tmp}/run"\nlr = 1e-3\nwarmup_steps = 2\n')
    return str(path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mini")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rates-mbit", type=float, nargs="+", default=[0, 1000, 200, 50], help="0: unshaped")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="optimiser steps per run, the first --warmup-steps untimed")
    p.add_argument("--warmup-steps", type=int, default=2, help="at least 2: DDP buckets the whole model as one until step 3")
    p.add_argument("--data-dir", default=None, help="shards to train on (default: random tokens)")
    p.add_argument("--compression", action="store_true", help="bf16 and PowerSGD against none (see docstring)")
    p.add_argument("--compression-rate", type=float, default=50.0)
    p.add_argument("--bucket-auto", action="store_true", help="bucket_cap_mb auto against 25 (see docstring)")
    args = p.parse_args(argv)
    t0 = time.time()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_network_") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        data = args.data_dir
        if data is None:
            data = str(tmp / "shards")
            write_shards(pathlib.Path(data), n_sequences=2 * args.micro_batch * args.steps + 8,
                         seq_len=args.seq_len, vocab_size=args.vocab)
        config = _config(tmp, args.model, args.micro_batch, data)
        if args.compression:
            out = _compression(args, tmp, config)
        elif args.bucket_auto:
            out = _bucket_auto(args, tmp, config)
        else:
            out = _model_check(args, tmp, config)
    out |= {"model": args.model, "micro_batch": args.micro_batch, "rounds": args.rounds, "steps": args.steps,
            "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(out), flush=True)
    return out


def _model_check(args, tmp: pathlib.Path, config: str) -> dict:
    rates = [r or None for r in args.rates_mbit]
    per_rate: dict = {r: {"ratio": [], "efficiency": [], "row": None} for r in rates}
    for rnd in range(args.rounds):
        df = run_network_sweep(config, tmp / f"round-{rnd}", models=(args.model,), rates_mbit=rates,
                               steps=args.steps, warmup_steps=args.warmup_steps)
        for row in df.iter_rows(named=True):
            line = {"round": rnd, **{k: row[k] for k in ("rate_mbit", "link_mbit", "comm_bytes", "buckets", "wire_ratio",
                                                            "collective_mbyte_s",
                                                            "compute_s", "step_s", "predicted_step_s",
                                                            "predicted_ratio", "efficiency", "comm_exposed_s",
                                                            "predicted_exposed_s", "bandwidth_ratio", "load_avg_1m")}}
            print(json.dumps(line), flush=True)
            d = per_rate[row["rate_mbit"]]
            d["ratio"].append(row["predicted_ratio"])
            d["efficiency"].append(row["efficiency"])
    settings = []
    for rate, d in per_rate.items():
        s = {"rate_mbit": rate, "ratio_spread": spread(d["ratio"]), "efficiency_spread": spread(d["efficiency"])}
        print(json.dumps({"setting": rate, **s}), flush=True)
        settings.append(s)
    medians = [s["ratio_spread"]["median"] for s in settings]
    worst = max(medians, key=lambda m: abs(m - 1))
    return {"benchmark": "network", "metric": "measured_over_predicted_step_time_worst", "value": worst,
            "baseline": "labkit.study.scaling.link_step_time from the 1-rank compute, buckets, measured link",
            "baseline_value": 1.0, "ratio": worst, "goal": [0.85, 1.15],
            "within_goal_every_setting": all(0.85 <= m <= 1.15 for m in medians),
            "lowest_efficiency": min(s["efficiency_spread"]["median"] for s in settings),
            "settings": settings}


def _compression(args, tmp: pathlib.Path, config: str) -> dict:
    rate = args.compression_rate
    kinds = ("none", "bf16", "powersgd")
    eff: dict[str, list[float]] = {k: [] for k in kinds}
    exposed: dict[str, list[float]] = {k: [] for k in kinds}
    sent: dict[str, float] = {}
    for rnd in range(args.rounds):
        df = run_network_sweep(config, tmp / f"round-{rnd}", models=(args.model,), rates_mbit=(rate,),
                               compressions=kinds, steps=max(args.steps, 5), warmup_steps=2,
                               overrides=["train.parallel.powersgd_start_iter=2"])
        for row in df.iter_rows(named=True):
            k = row["grad_compression"]
            eff[k].append(row["efficiency"])
            exposed[k].append(row["comm_exposed_s"])
            sent[k] = row["comm_bytes"]
            print(json.dumps({"round": rnd, "grad_compression": k, "rate_mbit": rate,
                              **{c: row[c] for c in ("efficiency", "step_s", "comm_exposed_s", "comm_bytes",
                                                     "predicted_step_s", "predicted_ratio", "load_avg_1m")}}),
                  flush=True)
    gains = {k: spread([c / n for c, n in zip(eff[k], eff["none"])]) for k in kinds if k != "none"}
    for k, g in gains.items():
        print(json.dumps({"grad_compression": k, "efficiency_gain_spread": g}), flush=True)
    return {"benchmark": "network_compression", "metric": "efficiency_gain_bf16", "value": gains["bf16"]["median"],
            "baseline": f"grad_compression none at {rate:g} Mbit/s", "baseline_value": 1.0,
            "ratio": gains["bf16"]["median"], "higher_is_better": True, "rate_mbit": rate,
            "efficiency": {k: spread(v) for k, v in eff.items()},
            "comm_exposed_s": {k: statistics.median(v) for k, v in exposed.items()},
            "comm_bytes": sent, "efficiency_gain": gains}


def _bucket_auto(args, tmp: pathlib.Path, config: str) -> dict:
    """``bucket_cap_mb="auto"`` against 25 MiB at every ``--rates-mbit`` setting, paired per round
    (the order of the two alternating), with the cap auto chose and what it measured."""
    rates = [r or None for r in args.rates_mbit]
    caps = ("25", '"auto"')
    eff: dict = {(c, r): [] for c in caps for r in rates}
    exposed: dict = {(c, r): [] for c in caps for r in rates}
    step: dict = {(c, r): [] for c in caps for r in rates}
    buckets: dict = {}
    chosen: dict = {r: [] for r in rates}
    for rnd in range(args.rounds):
        for cap in (caps if rnd % 2 == 0 else caps[::-1]):
            name = cap.strip(chr(34))
            df = run_network_sweep(config, tmp / f"round-{rnd}-{name}", models=(args.model,), rates_mbit=rates,
                                   steps=args.steps, warmup_steps=args.warmup_steps,
                                   overrides=[f"train.parallel.bucket_cap_mb={cap}"])
            for row in df.iter_rows(named=True):
                rate = row["rate_mbit"]
                eff[cap, rate].append(row["efficiency"])
                exposed[cap, rate].append(row["comm_exposed_s"])
                step[cap, rate].append(row["step_s"])
                setting = "unshaped" if rate is None else f"{rate:g}mbit"
                run = tmp / f"round-{rnd}-{name}" / "sweeps" / "network-runs" / f"{args.model}-{setting}-none"
                last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
                buckets[name, rate] = last["comm_bucket_bytes"]
                auto = json.loads((run / "bucket_auto.json").read_text()) if cap != "25" else None
                if auto:
                    chosen[rate].append(auto)
                print(json.dumps({"round": rnd, "bucket_cap_mb": name, "rate_mbit": rate,
                                  **{c: row[c] for c in ("efficiency", "step_s", "comm_exposed_s", "predicted_step_s",
                                                         "predicted_ratio", "load_avg_1m")},
                                  "buckets": buckets[name, rate],
                                  **({"auto": {k: auto[k] for k in ("bucket_cap_mb", "backward_s", "latency_s",
                                                                     "s_per_byte", "exposed_s", "exposed_s_at_25mib")}}
                                     if auto else {})}), flush=True)
    settings = []
    for rate in rates:
        gain = spread([a / b for a, b in zip(eff['"auto"', rate], eff["25", rate])])
        faster = spread([b / a for a, b in zip(step['"auto"', rate], step["25", rate])])
        s = {"rate_mbit": rate, "step_time_ratio_spread": faster, "efficiency_gain_spread": gain,
             "efficiency": {c.strip(chr(34)): spread(eff[c, rate]) for c in caps},
             "comm_exposed_s": {c.strip(chr(34)): spread(exposed[c, rate]) for c in caps},
             "auto_cap_mb": [a["bucket_cap_mb"] for a in chosen[rate]],
             "buckets": {c.strip(chr(34)): buckets.get((c.strip(chr(34)), rate)) for c in caps}}
        print(json.dumps({"setting": rate, **s}), flush=True)
        settings.append(s)
    worst = min(s["step_time_ratio_spread"]["median"] for s in settings)
    return {"benchmark": "network_bucket_auto", "metric": "step_time_ratio_worst_setting", "value": worst,
            "baseline": "bucket_cap_mb 25 (torch's default) at each link setting: its 2-rank step / auto's",
            "baseline_value": 1.0, "ratio": worst, "higher_is_better": True, "goal": 1.0,
            "efficiency_gain_worst_setting": min(s["efficiency_gain_spread"]["median"] for s in settings),
            "settings": settings}


if __name__ == "__main__":
    main()
