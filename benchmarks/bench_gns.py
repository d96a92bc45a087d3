"""Overhead of the gradient noise scale statistics (labkit/train/gns.py) on a 2-rank DDP step.

The statistics are one squared norm per gradient bucket before the all-reduce and one after it
(inside DDP's composed comm hook, labkit/train/comm.py), plus one all-reduce of two scalars per
step. This benchmark runs ``train()`` on 2 spawned gloo ranks (CPU, one thread each, rank r
pinned to core r as in bench_ddp.py) with the statistics on and off, in paired rounds inside
one process group (the order flips every round); "off" replaces ``NoiseScale.for_run`` by a
function returning None in the worker, which is exactly a run without the observer. The step
time is rank 0's median ``step_time_s`` over the timed steps of each run; the overhead is the
median over rounds of the paired ratio on/off − 1 (a round whose two runs met different load
moves together), with its spread; ``ratio_of_medians`` is median(on)/median(off).
Goal: <= 2 % of the step. On a shared machine the paired ratio's spread can exceed the
overhead itself, so the statistics' own work is also timed directly, without the noise of a
whole step: two ``gns.squared_norm`` passes over a buffer of the model's parameter count (one
thread, median of 20), as a fraction of the step (``norm_fraction``). The machine's load
average is printed with the result.

Run: ``python benchmarks/bench_gns.py`` from the repository root. JSON lines; the last line is
one JSON object.
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

import torch.multiprocessing as mp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_ddp import _free_port, spread, write_shards  # noqa: E402
from labkit.config import TrainConfig, from_dict, to_dict  # noqa: E402


def _worker(rank: int, world: int, port: int, cfgs_json: str) -> None:
    """One process group; train() every config in turn (each dict carries ``gns``: on/off)."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch

    from labkit.train import dist, gns, train

    for_run = gns.NoiseScale.for_run
    assert dist.init_distributed("gloo", 600.0, torch.device("cpu"))
    try:
        for item in json.loads(cfgs_json):
            gns.NoiseScale.for_run = for_run if item["gns"] else (lambda **_: None)
            train(from_dict(TrainConfig, item["cfg"]))
    finally:
        gns.NoiseScale.for_run = for_run
        dist.teardown()


def norm_seconds(n_params: int, repeats: int = 20) -> float:
    """Median seconds of what the observer adds to one rank's step on CPU: ``gns.squared_norm``
    over ``n_params`` fp32 gradients before the all-reduce and again after it (one thread)."""
    import torch

    from labkit.train.gns import squared_norm

    torch.set_num_threads(1)
    grads = torch.randn(n_params)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        squared_norm(grads).item()
        squared_norm(grads).item()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mini")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0, load0 = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_gns_") as tmp:
        data = pathlib.Path(tmp) / "shards"
        write_shards(data, n_sequences=2 * args.micro_batch * args.steps + 8, seq_len=args.seq_len,
                     vocab_size=args.vocab)
        runs = []
        for rnd in range(args.rounds + 1):  # round 0: warm-up
            for on in ((True, False) if rnd % 2 == 0 else (False, True)):
                cfg = TrainConfig(data_dir=str(data), run_dir=f"{tmp}/run-{rnd}-{int(on)}", model=args.model,
                                  max_steps=args.steps, num_threads=1, device="cpu", timeout_s=600, resume=False,
                                  batch={"micro_batch_size": args.micro_batch}, schedule={"warmup_steps": 1},
                                  measure={"timing_warmup_steps": args.warmup_steps, "trackers": ()},
                                  checkpoint={"enabled": False})
                runs.append({"round": rnd, "gns": on, "cfg": to_dict(cfg)})
        mp.spawn(_worker, args=(2, _free_port(), json.dumps(runs)), nprocs=2, join=True)
        step = {True: [], False: []}
        b_simple = []
        for item in runs:
            records = [json.loads(line) for line in
                       pathlib.Path(item["cfg"]["run_dir"], "metrics.jsonl").read_text().splitlines()]
            med = statistics.median(r["step_time_s"] for r in records[args.warmup_steps:])
            has = any("b_simple" in r for r in records)
            assert has == item["gns"], "the switch did not take"
            print(json.dumps({"round": item["round"], "gns": item["gns"], "step_time_s": med,
                              "b_simple": records[-1].get("b_simple"), "load_avg_1m": os.getloadavg()[0]}), flush=True)
            if item["round"] > 0:
                step[item["gns"]].append(med)
                if item["gns"]:
                    b_simple.append(records[-1].get("b_simple"))
        n_params = json.loads(pathlib.Path(runs[-1]["cfg"]["run_dir"], "result.json").read_text())["params"]
    on, off = statistics.median(step[True]), statistics.median(step[False])
    norm_s = norm_seconds(n_params)
    per_round = [a / b - 1 for a, b in zip(step[True], step[False])]
    overhead = statistics.median(per_round)
    out = {"benchmark": "gns", "metric": "step_time_overhead", "value": overhead,
           "baseline": "the same 2-rank DDP run without the noise-scale observer", "baseline_value": off,
           "ratio": 1 + overhead, "ratio_of_medians": on / off, "goal": 0.02, "higher_is_better": False,
           "step_time_s_on": on, "step_time_s_off": off, "per_round_overhead": per_round,
           "overhead_spread": spread(per_round), "b_simple_last": b_simple, "params": n_params,
           "norm_s": norm_s, "norm_fraction": norm_s / off,
           "model": args.model, "seq_len": args.seq_len, "micro_batch_per_rank": args.micro_batch, "ranks": 2,
           "steps": args.steps, "timed_steps": args.steps - args.warmup_steps, "rounds": args.rounds,
           "cpu_count": os.cpu_count(), "load_avg_1m_start": load0, "load_avg_1m": os.getloadavg()[0],
           "wall_s": round(time.time() - t0, 1)}
    s = out["overhead_spread"]
    print(f"overhead {100 * out['value']:+.2f} % (per round min {100 * s['min']:+.2f} median {100 * s['median']:+.2f} "
          f"max {100 * s['max']:+.2f} %) over {args.rounds} paired rounds; the two squared norms alone "
          f"{1e3 * norm_s:.2f} ms = {100 * out['norm_fraction']:.2f} % of the step; load average {out['load_avg_1m']:.1f}",
          flush=True)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
