"""Benchmark "planner": the analytic activation-memory model against the bytes autograd really
keeps for backward.

For the small presets (tiny, mini, small) at several micro-batches and sequence lengths, with
the sparse and the dense MLM head, the planner's ``saved_activation_bytes`` (fp32 on CPU, the
terms of Korthikanti et al. arXiv:2205.05198 written for this model) is compared with
``labkit.study.plan.activation_bytes``: the distinct storages passed to
``torch.autograd.graph.saved_tensors_hooks`` during one training forward, counted exactly.
Goal: every point within 10 %. The last line is the JSON record every benchmark prints (docs/measurement.md, "Benchmarks"):
value = 1 - the worst relative error (1.0 = exact).

The GPU half (planned peak vs ``torch.cuda.max_memory_allocated`` for bert-120m and bert-350m)
is ``labkit.study.gpu.gpu_memory_check()``, called from benchmarks/gpu_check.sh.

Run from the repository root: ``python benchmarks/bench_planner.py``.
"""

from __future__ import annotations

import json
import time

import torch

from labkit.model import model_config
from labkit.study.plan import activation_bytes, saved_activation_bytes

VOCAB = 8192
POINTS = [("tiny", 64, b) for b in (1, 4, 16)] + [("mini", 128, b) for b in (1, 4, 8)] + \
         [("small", 128, b) for b in (1, 2, 4)]
GOAL = 0.10


def main() -> None:
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    worst = 0.0
    print(f"{'model':6} {'head':6} {'seq':>4} {'b':>3} {'measured B':>13} {'planned B':>13} {'ratio':>7}")
    for name, seq, b in POINTS:
        for sparse in (True, False):
            cfg = model_config(name, VOCAB, sparse_head=sparse)
            measured = activation_bytes(cfg, seq, b)
            planned = saved_activation_bytes(cfg, seq, b, precision="fp32", attention="eager", device="cpu")
            worst = max(worst, abs(planned / measured - 1))
            print(f"{name:6} {'sparse' if sparse else 'dense':6} {seq:4d} {b:3d} {measured:13,d} {planned:13,d} "
                  f"{planned / measured:7.4f}")
    print(f"{2 * len(POINTS)} points in {time.perf_counter() - t0:.1f} s; worst relative error {worst:.2%} "
          f"(goal {GOAL:.0%})")
    print(json.dumps({"benchmark": "planner", "metric": "1 - worst relative error of planned activation bytes",
                      "value": round(1 - worst, 5),
                      "baseline": "bytes saved for backward, counted exactly with saved_tensors_hooks (CPU, fp32)",
                      "baseline_value": 1.0, "ratio": round(1 - worst, 5), "goal": 1 - GOAL,
                      "higher_is_better": True}))


if __name__ == "__main__":
    main()
