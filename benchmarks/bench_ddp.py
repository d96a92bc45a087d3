"""Weak-scaling efficiency of labkit's training step from 1 to 2 ranks (CPU, gloo), with the
exposed communication and the per-rank CPU time that attribute the loss.

Each rank keeps the same micro-batch (weak scaling), runs with one torch thread pinned to its
own core (rank r on core r, as bench_prep_scale pins engines; the 1-rank run on core 0), and
the throughput is ``train()``'s own tokens/s (real tokens, all ranks, warm-up steps excluded;
labkit/measure.py). After one warm-up run of each, 1-rank and 2-rank runs alternate for
``--rounds`` paired rounds (the order flips every round, so neither size always runs first);
efficiency = median tokens/s(2) / (2 x median tokens/s(1)) (``measure.scaling_efficiency``;
docs/measurement.md), and the spread of the per-round (paired) efficiencies is printed: min,
quartiles, max. The 1-rank run is a plain process (no process group, no DDP), so the DDP
wrapper and its all-reduce count against the 2-rank run.

Attribution (rank 0's metrics records, timed steps, medians over rounds): ``comm_exposed_s``
(gradient all-reduce not hidden behind backward, ``labkit.measure.comm_exposed_s``) and its
share of the step; ``thread_cpu_s`` (CPU seconds of the training thread per step): at 2 ranks
over 1 rank it is the slowdown of the same work when both cores run (memory bandwidth, shared
caches: ``compute_slowdown``); ``other_threads_cpu_s`` (``cpu_s - thread_cpu_s``: gloo's
threads, on the rank's own core). ``step_loss_s`` = step(2) - step(1) splits into
``compute_s`` (the thread's extra CPU), ``exposed_s`` and ``rest_s`` (waiting for a core or the
other rank).

``--bucket-caps 1,5,25,100`` also runs 2-rank runs at each ``TrainConfig.parallel.bucket_cap_mb`` and
prints one line per size (tokens/s, exposed communication): the measurement that chooses the
default (TrainConfig.parallel.bucket_cap_mb).
``--baseline-commit REF`` instead compares this checkout's 2-rank data-parallel step with the step
of commit REF (a ``git worktree`` of it in a temporary directory): every round runs the same 2-rank
run once on each code (the order flips every round), each from the same driver script in a fresh
process, and prints the median of the per-round ratios of the median timed step time (this / REF;
goal: at most 1.02, issue 34) with their spread.

The machine's load average is printed with the result. Run: ``python benchmarks/bench_ddp.py``
from the repository root. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch.multiprocessing as mp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _prep import free_port  # noqa: E402
from labkit.config import TrainConfig, from_dict, to_dict  # noqa: E402
from labkit.config.sections import ParallelConfig  # noqa: E402
from labkit.data.shards import write_rows  # noqa: E402
from labkit.measure import scaling_efficiency  # noqa: E402
from labkit.study.scaling import fit_overlap  # noqa: E402


def write_shards(out_dir: pathlib.Path, *, n_sequences: int, seq_len: int, vocab_size: int, seed: int = 0) -> None:
    """A random shard set in labkit's format (docs/formats.md): [CLS] + ids, no padding; uint16."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(5, vocab_size, size=(n_sequences, seq_len), dtype=np.uint16)
    arr[:, 0] = 2
    write_rows(out_dir, arr, vocab_size=vocab_size, tokenizer_sha256="0" * 64, rows_per_shard=n_sequences)


def spread(values: list[float]) -> dict[str, float]:
    """{"min", "p25", "median", "p75", "max"} of ``values`` (quartiles: statistics.quantiles,
    inclusive method; with fewer than 2 values the quartiles are the median)."""
    med = statistics.median(values)
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) >= 2 else [med, med, med]
    return {"min": min(values), "p25": q[0], "median": med, "p75": q[2], "max": max(values)}


def _worker(rank: int, world: int, port: int, cfg_json: str) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # one core per rank (threads started later inherit it)
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    from labkit.train import train

    cfg = from_dict(TrainConfig, json.loads(cfg_json))
    cpu0 = time.process_time()
    train(cfg)
    pathlib.Path(cfg.run_dir, f"cpu-{rank}.json").write_text(json.dumps(time.process_time() - cpu0))


def _allreduce_worker(rank: int, world: int, port: int, n_floats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(n_floats)
    times = []
    for _ in range(4):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(statistics.median(times[1:])))
    dist.destroy_process_group()


def allreduce_seconds(n_floats: int) -> float:
    """Median seconds of one gloo all-reduce of ``n_floats`` fp32 values over 2 ranks on this
    host: the communication a DDP step adds (one all-reduce of every gradient, C5)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/t.json"
        mp.spawn(_allreduce_worker, args=(2, free_port(), n_floats, out), nprocs=2, join=True)
        return json.loads(pathlib.Path(out).read_text())


def run(cfg: TrainConfig, world: int) -> dict:
    """One fresh run of ``cfg`` on ``world`` spawned ranks: its result.json plus ``cpu_s``, the
    CPU seconds of ``train()`` summed over ranks (all steps, model build and checkpoint too)."""
    mp.spawn(_worker, args=(world, free_port(), json.dumps(to_dict(cfg))), nprocs=world, join=True)
    run_dir = pathlib.Path(cfg.run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    result["cpu_s"] = sum(json.loads((run_dir / f"cpu-{r}.json").read_text()) for r in range(world))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = records[cfg.measure.timing_warmup_steps:] or records
    for key in ("step_time_s", "comm_exposed_s", "cpu_s", "thread_cpu_s"):
        result[f"median_{key}"] = statistics.median(r[key] for r in timed)
    return result


DRIVER = """
import json, os, socket, sys
import torch.multiprocessing as mp


def _worker(rank, world, port, forms):
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    from labkit.config import TrainConfig, from_dict
    from labkit.train import train
    try:  # a TrainConfig in sections, less the fields an older labkit does not have
        cfg = from_dict(TrainConfig, _known(forms["nested"], rank))
    except (ImportError, TypeError, ValueError):  # an older labkit still: the flat fields
        cfg = TrainConfig(**forms["flat"])
    train(cfg)


def _known(nested, rank):
    \"\"\"``nested`` without the keys this labkit's TrainConfig and sections lack (features newer than
    it, left at their defaults by the benchmark's config); rank 0 names them on stderr.\"\"\"
    import dataclasses
    from labkit.config import TrainConfig
    from labkit.config.train import TRAIN_SECTIONS

    top = {f.name for f in dataclasses.fields(TrainConfig)}
    out, dropped = {}, []
    for key, value in nested.items():
        if key not in top:
            dropped.append(key)
        elif key in TRAIN_SECTIONS and isinstance(value, dict):
            have = {f.name for f in dataclasses.fields(TRAIN_SECTIONS[key])}
            out[key] = {k: v for k, v in value.items() if k in have}
            dropped += [f"{key}.{k}" for k in value if k not in have]
        else:
            out[key] = value
    if dropped and rank == 0:
        print(f"baseline labkit lacks (left out): {', '.join(dropped)}", file=sys.stderr)
    return out


if __name__ == "__main__":
    fields, world = json.loads(sys.argv[1]), int(sys.argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, fields), nprocs=world, join=True)
"""
"""One run of a config on ``world`` spawned ranks, importing labkit from PYTHONPATH (``--baseline-commit``:
the same script for both codes): {"nested": ``to_dict`` of the TrainConfig, "flat": the same fields by
their names before TrainConfig had sections}."""


def baseline_rounds(args: argparse.Namespace, data: pathlib.Path, tmp: str) -> dict:
    """``--baseline-commit``: paired 2-rank rounds of this checkout and of ``args.baseline_commit``
    (module docstring). Returns the JSON summary."""
    root = pathlib.Path(__file__).resolve().parents[1]
    tree = pathlib.Path(tmp) / "baseline"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), args.baseline_commit],
                   check=True, capture_output=True)
    driver = pathlib.Path(tmp) / "driver.py"
    driver.write_text(DRIVER)
    step: dict[str, list[float]] = {"this": [], "baseline": []}
    try:
        for rnd in range(args.rounds + 1):  # round 0: warm-up
            for code in (("this", "baseline") if rnd % 2 == 0 else ("baseline", "this")):
                run_dir = pathlib.Path(tmp) / f"{code}-{rnd}"
                cfg = config(args, data, str(run_dir), args.bucket_cap_mb)
                forms = {"nested": to_dict(cfg), "flat": _flat(to_dict(cfg))}
                env = os.environ | {"PYTHONPATH": str(root if code == "this" else tree)}
                subprocess.run([sys.executable, str(driver), json.dumps(forms), "2"], check=True, env=env)
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                med = statistics.median(r["step_time_s"] for r in records[args.warmup_steps:])
                print(json.dumps({"round": rnd, "code": code, "step_time_s": med,
                                  "load_avg_1m": os.getloadavg()[0]}), flush=True)
                if rnd > 0:
                    step[code].append(med)
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], capture_output=True)
    ratios = [a / b for a, b in zip(step["this"], step["baseline"])]
    return {"benchmark": "ddp_vs_baseline", "metric": "step_time_ratio", "value": statistics.median(ratios),
            "baseline": f"the same 2-rank run at {args.baseline_commit}", "goal": 1.02, "higher_is_better": False,
            "per_round_ratio": ratios, "ratio_spread": spread(ratios),
            "step_time_s_this": statistics.median(step["this"]),
            "step_time_s_baseline": statistics.median(step["baseline"]), "model": args.model,
            "seq_len": args.seq_len, "micro_batch_per_rank": args.micro_batch, "sharding": args.sharding,
            "rounds": args.rounds, "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}


def _flat(nested: dict) -> dict:
    """``to_dict`` of a TrainConfig with its sections' fields under their names before the sections
    (``labkit.config.FLAT_KEYS``)."""
    from labkit.config.train import FLAT_KEYS, TRAIN_SECTIONS

    back = {dotted: flat for flat, dotted in FLAT_KEYS.items()}
    out = {k: v for k, v in nested.items() if k not in TRAIN_SECTIONS}
    for section in TRAIN_SECTIONS:
        out |= {back[f"{section}.{k}"]: v for k, v in nested.get(section, {}).items() if f"{section}.{k}" in back}
    return out


def config(args: argparse.Namespace, data: pathlib.Path, run_dir: str, bucket_cap_mb: float) -> TrainConfig:
    """The benchmark's run: ``args.model`` at ``args.micro_batch`` per rank, one thread, no checkpoints."""
    return TrainConfig(data_dir=str(data), run_dir=run_dir, model=args.model, max_steps=args.steps, num_threads=1,
                       device="cpu", timeout_s=600, resume=False, batch={"micro_batch_size": args.micro_batch},
                       schedule={"warmup_steps": 1},
                       measure={"timing_warmup_steps": args.warmup_steps, "trackers": ()},
                       parallel={"sharding": args.sharding, "bucket_cap_mb": bucket_cap_mb},
                       checkpoint={"enabled": False})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--rounds", type=int, default=9, help="paired rounds (3 gave 0.58-0.87 on an idle machine)")
    p.add_argument("--sharding", default="ddp", choices=["ddp", "zero1", "fsdp"])
    p.add_argument("--bucket-cap-mb", type=float, default=ParallelConfig().bucket_cap_mb,
                   help="TrainConfig.parallel.bucket_cap_mb")
    p.add_argument("--bucket-caps", default="", help="comma-separated bucket sizes (MiB) for a 2-rank sweep")
    p.add_argument("--sweep-rounds", type=int, default=3)
    p.add_argument("--baseline-commit", default="", help="compare the 2-rank step with this commit's (paired rounds)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.baseline_commit:
        with tempfile.TemporaryDirectory(prefix="bench_ddp_") as tmp:
            data = pathlib.Path(tmp) / "shards"
            write_shards(data, n_sequences=2 * args.micro_batch * args.steps + 8, seq_len=args.seq_len,
                         vocab_size=args.vocab)
            out = baseline_rounds(args, data, tmp)
        print(json.dumps(out), flush=True)
        return out
    tps: dict[int, list[float]] = {1: [], 2: []}
    cpu_per_token: dict[int, list[float]] = {1: [], 2: []}  # CPU seconds of train() / tokens
    per_step: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}  # rank 0's medians of timed steps, per round
    sweep: list[dict] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_ddp_") as tmp:
        data = pathlib.Path(tmp) / "shards"
        write_shards(data, n_sequences=2 * args.micro_batch * args.steps + 8, seq_len=args.seq_len,
                     vocab_size=args.vocab)
        k = 0
        for rnd in range(args.rounds + 1):  # round 0 is the warm-up (page cache, imports)
            for world in ((1, 2) if rnd % 2 == 0 else (2, 1)):  # alternate who goes first
                k += 1
                cfg = config(args, data, f"{tmp}/run-{k}", args.bucket_cap_mb)
                result = run(cfg, world)
                line = {"round": rnd, "ranks": world, "tokens_per_s": result["tokens_per_s"],
                        "comm_exposed_s": result["median_comm_exposed_s"], "cpu_s": result["cpu_s"],
                        "load_avg_1m": os.getloadavg()[0]}
                print(json.dumps(line), flush=True)
                if rnd > 0:
                    tps[world].append(result["tokens_per_s"])
                    cpu_per_token[world].append(result["cpu_s"] / result["tokens"])
                    for key in ("step_time_s", "comm_exposed_s", "cpu_s", "thread_cpu_s"):
                        per_step[world].setdefault(key, []).append(result[f"median_{key}"])
        for cap in [float(c) for c in args.bucket_caps.split(",") if c]:
            runs = [run(config(args, data, f"{tmp}/cap-{cap}-{r}", cap), 2) for r in range(args.sweep_rounds)]
            row = {"bucket_cap_mb": cap, "tokens_per_s_2ranks": statistics.median(x["tokens_per_s"] for x in runs),
                   "comm_exposed_s": statistics.median(x["median_comm_exposed_s"] for x in runs),
                   "step_time_s": statistics.median(x["median_step_time_s"] for x in runs),
                   "rounds": args.sweep_rounds, "load_avg_1m": os.getloadavg()[0]}
            row["comm_exposed_fraction"] = row["comm_exposed_s"] / row["step_time_s"]
            print(json.dumps({"benchmark": "ddp_bucket", **row}), flush=True)
            sweep.append(row)
        n_params = result["params"]
        step_s = args.micro_batch * args.seq_len / statistics.median(tps[1])  # 1-rank step time
    comm_s = allreduce_seconds(n_params)
    one, two = statistics.median(tps[1]), statistics.median(tps[2])
    eff = scaling_efficiency(two, one, 2)
    per_round = [scaling_efficiency(b, a, 2) for a, b in zip(tps[1], tps[2])]
    out = {"benchmark": "ddp", "metric": "scaling_efficiency", "value": eff,
           "baseline": "linear scaling: 2 x median tokens/s of 1 rank", "baseline_value": 1.0,
           "ratio": eff, "goal": 0.85, "higher_is_better": True,
           "tokens_per_s_1rank": one, "tokens_per_s_2ranks": two,
           "per_round_efficiency": per_round,
           "efficiency_spread": spread(per_round),
           "model": args.model, "seq_len": args.seq_len, "micro_batch_per_rank": args.micro_batch,
           "sharding": args.sharding, "threads_per_rank": 1, "rounds": args.rounds, "params": n_params,
           "step_s_1rank": step_s, "allreduce_grads_s": comm_s,
           "efficiency_bound_from_comm": step_s / (step_s + comm_s),
           # CPU work per token, 1 rank / 2 ranks: near 1 when the 2-rank run does no extra work,
           # i.e. a wall-clock loss then comes from ranks waiting for cores (a shared machine)
           "cpu_work_ratio": statistics.median(cpu_per_token[1]) / statistics.median(cpu_per_token[2]),
           "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "wall_s": round(time.time() - t0, 1)}
    med = {w: {k: statistics.median(v) for k, v in per_step[w].items()} for w in (1, 2)}
    step1, step2 = med[1]["step_time_s"], med[2]["step_time_s"]
    compute = med[2]["thread_cpu_s"] - med[1]["thread_cpu_s"]
    out.update({
        "bucket_cap_mb": args.bucket_cap_mb, "gradient_as_bucket_view": True, "pinned_one_core_per_rank": True,
        "comm_exposed_s": med[2]["comm_exposed_s"], "comm_exposed_fraction": med[2]["comm_exposed_s"] / step2,
        "comm_exposed_goal_fraction": 0.05,
        "step_time_s_1rank": step1, "step_time_s_2ranks": step2,
        "thread_cpu_s_1rank": med[1]["thread_cpu_s"], "thread_cpu_s_2ranks": med[2]["thread_cpu_s"],
        "compute_slowdown": med[2]["thread_cpu_s"] / med[1]["thread_cpu_s"],
        "other_threads_cpu_s_2ranks": med[2]["cpu_s"] - med[2]["thread_cpu_s"],
        "step_loss_s": step2 - step1,
        "step_loss_parts_s": {"compute_s": compute, "exposed_s": med[2]["comm_exposed_s"],
                              "rest_s": step2 - step1 - compute - med[2]["comm_exposed_s"]},
        "overlap_fitted": fit_overlap(comm_s=comm_s, backward_s=step1 * 2 / 3, exposed_s=med[2]["comm_exposed_s"]),
        "bucket_sweep": sweep,
    })
    s = out["efficiency_spread"]
    print(f"efficiency {eff:.3f}; per-round spread min {s['min']:.3f} p25 {s['p25']:.3f} median {s['median']:.3f} "
          f"p75 {s['p75']:.3f} max {s['max']:.3f} over {args.rounds} paired rounds; load average {out['load_avg_1m']:.1f}",
          flush=True)
    parts = out["step_loss_parts_s"]
    print(f"step 1 rank {step1:.3f} s, 2 ranks {step2:.3f} s: +{out['step_loss_s']:.3f} s = compute "
          f"{parts['compute_s']:+.3f} (training thread CPU x{out['compute_slowdown']:.3f}) + exposed communication "
          f"{parts['exposed_s']:.3f} ({100 * out['comm_exposed_fraction']:.1f} % of the step) + rest "
          f"{parts['rest_s']:+.3f}; gloo's threads {out['other_threads_cpu_s_2ranks']:.3f} CPU s per step", flush=True)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
