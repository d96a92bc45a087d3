"""Cost of the TensorBoard tracker in the loss sweeps' tiny runs (issue 37).

Notebook 07's batch sweep (``labkit.study.critical_batch``) trains the ``tiny`` model at global
batch 4 for 512 steps (micro-batch 2, 2 accumulation steps): the steps are small, so what runs
around each one counts. This trains that run (``batch_config(batch_base(...), 4)``, 2,048
sequences unless ``--examples``) in this process with ``measure.trackers`` ("tensorboard",), the
default, and () (what ``batch_base`` sets now), in paired rounds (the order flips every round),
and reports per round the CPU seconds (``time.process_time``: this process and its threads, the
TensorBoard writer's included) and wall seconds of ``train()``, and the medians over rounds of the
paired ratios without/with. The held-out losses of the two runs must be equal (the tracker only
reads the records); the script fails otherwise.

Run: ``python benchmarks/bench_trackers.py --workdir work/demo`` from the repository root after
``make demo`` (it reads ``<workdir>/shards``; runs go to a temporary directory). JSON lines; the
last line is one JSON object.
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

from bench_ddp import spread  # noqa: E402


def one_run(workdir: str, tmp: str, trackers: tuple[str, ...], examples: int) -> dict:
    """Train the batch sweep's batch-4 run with ``trackers``; its CPU and wall seconds and held-out losses."""
    from labkit.study.critical_batch import batch_base, batch_config
    from labkit.study.points import fresh_run_dir
    from labkit.train import train

    cfg = batch_config(batch_base(workdir, model="tiny", micro_batch=8, lr=2e-3), tmp, 4, max_examples=examples)
    cfg = fresh_run_dir(cfg.replace(measure={"trackers": trackers}))
    cpu, wall = time.process_time(), time.perf_counter()
    train(cfg)
    took = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}
    records = [json.loads(line) for line in pathlib.Path(cfg.run_dir, "metrics.jsonl").read_text().splitlines()]
    return took | {"steps": cfg.max_steps, "eval_loss": [r["eval_loss"] for r in records if r.get("eval_loss") is not None]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="work/demo", help="a work directory with shards/ (default: work/demo)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--examples", type=int, default=2048, help="sequences the run trains on (default: 2048)")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.workdir, "shards", "index.json")):
        raise SystemExit(f"--workdir: no shards/index.json under {args.workdir} (run make demo first)")
    os.environ.setdefault("TQDM_DISABLE", "1")
    ratios: dict[str, list[float]] = {"cpu": [], "wall": []}
    with tempfile.TemporaryDirectory(prefix="bench_trackers_") as tmp:
        for r in range(args.rounds):
            order = [("tensorboard",), ()] if r % 2 == 0 else [(), ("tensorboard",)]
            runs = {t: one_run(args.workdir, tmp, t, args.examples) for t in order}
            on, off = runs[("tensorboard",)], runs[()]
            if on["eval_loss"] != off["eval_loss"]:
                raise SystemExit(f"round {r}: held-out losses differ with and without the tracker")
            ratios["cpu"].append(off["cpu_s"] / on["cpu_s"])
            ratios["wall"].append(off["wall_s"] / on["wall_s"])
            print(json.dumps({"round": r, "steps": on["steps"], "tensorboard_cpu_s": round(on["cpu_s"], 2),
                              "none_cpu_s": round(off["cpu_s"], 2), "tensorboard_wall_s": round(on["wall_s"], 2),
                              "none_wall_s": round(off["wall_s"], 2), "load_avg_1m": round(os.getloadavg()[0], 2)}),
                  flush=True)
    print(json.dumps({"bench": "trackers", "rounds": args.rounds, "examples": args.examples,
                      "cpu_ratio_none_over_tensorboard": round(statistics.median(ratios["cpu"]), 3),
                      "cpu_ratio_spread": {k: round(v, 3) for k, v in spread(ratios["cpu"]).items()},
                      "wall_ratio_none_over_tensorboard": round(statistics.median(ratios["wall"]), 3),
                      "cpu_count": len(os.sched_getaffinity(0))}))


if __name__ == "__main__":
    main()
