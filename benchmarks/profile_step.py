"""Where a training step spends its time: torch.profiler's operator table for labkit's paths and
transformers' BertForMaskedLM (SDPA), the models and batches of ``bench_model.py``.

For each path: ``--steps`` forward + backward steps after two warm-up steps, profiled on the
CPU (``torch.profiler``, ``ProfilerActivity.CPU``); prints the ``--rows`` operators with the
most self CPU time, then one JSON line per path with the share of self CPU time in matrix
products (aten::mm, addmm, bmm) and the process CPU seconds per step. Not a benchmark (no
baseline ratio): the profile behind the choices in docs/model.md.

Run from the repository root: ``python benchmarks/profile_step.py --preset mini --seq-len 128``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import bench_model as bm  # noqa: E402
from labkit.train.loop import to_device  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mini")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--paths", default="dense,sparse,hf_sdpa")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    _, ours, hf = bm.make_models(args.preset, args.vocab_size, args.seq_len)
    batches = bm.make_batches(args.vocab_size, args.seq_len, args.batch_size, args.steps + 2)
    for name in args.paths.split(","):
        model = {**ours, **hf}[name]
        step, feed = (bm.step_hf, batches) if name.startswith("hf") else (
            bm.step_ours, [to_device(b, torch.device("cpu")) for b in batches])
        for b in feed[:2]:
            step(model, b)
        cpu = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for b in feed[2:]:
                c0 = time.process_time()
                step(model, b)
                cpu.append(time.process_time() - c0)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        mm = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
        print(f"=== {name}: {args.preset}, seq {args.seq_len} x batch {args.batch_size}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(json.dumps({"path": name, "preset": args.preset, "seq_len": args.seq_len, "batch_size": args.batch_size,
                          "steps": args.steps, "matmul_share_of_self_cpu": round(mm / total, 3),
                          "cpu_s_per_step": round(statistics.median(cpu), 4), "threads": args.threads,
                          "load_avg_1m": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
