"""Benchmark `cpu_rss`: how far a CPU training step's resident memory runs above the planner's
count of its tensor bytes (``labkit.study.memory.plan_model`` on device "cpu", whose budget is
tensor bytes), the caveat ``labkit plan --device cpu`` prints (``labkit.measure.CPU_RSS_OVERHEAD``).

For each labkit preset (seq 128, fp32, one process, no DDP: sharding "none"), the planner's
largest micro-batch under BUDGET_GIB is trained for 3 steps (forward, backward, fused AdamW,
``zero_grad``) in a fresh process. Measured: that process's peak RSS (``VmHWM``) less its RSS just
before the model was built (interpreter, torch and labkit already loaded), against the planner's
``total_at(plan, b)``. The ratio is how much more the process holds than the tensors: glibc's
heap keeps freed blocks, and torch's CPU allocator rounds and caches. Reported with the load
average (no goal). Run from the repository root: python benchmarks/bench_cpu_rss.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = os.environ.get("BENCH_MODELS", "tiny,mini,small").split(",")
BUDGET_GIB = float(os.environ.get("BENCH_BUDGET_GIB", "1.0"))
SEQ_LEN, VOCAB, STEPS = 128, 8192, 3


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def child(name: str) -> dict:
    import torch

    from labkit.config import TrainConfig
    from labkit.measure import peak_rss_bytes
    from labkit.model import model_config
    from labkit.study.memory import labkit_model, plan_model, total_at
    from labkit.train.optim import build_optimizer

    torch.manual_seed(0)
    cfg = model_config(name, VOCAB)
    make_model, make_batch = labkit_model(cfg, SEQ_LEN)
    plan = plan_model(make_model, make_batch, device="cpu", precision="fp32", sharding="none",
                      budget_bytes=int(BUDGET_GIB * 2**30), name=name)
    b = plan["max_micro_batch"]
    planned = total_at(plan, b)
    batch = make_batch(b)
    import gc

    gc.collect()
    base = _rss()
    model = make_model()
    opt = build_optimizer(model, TrainConfig(data_dir="d", run_dir="r"))
    for _ in range(STEPS):
        out = model(**batch)
        loss = out.loss if hasattr(out, "loss") else out.loss_sum
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    grown = peak_rss_bytes() - base
    return {"model": name, "params": plan["params"], "micro_batch": b, "planned_bytes": planned,
            "rss_growth_bytes": grown, "ratio": round(grown / planned, 3)}


def main() -> None:
    rows = []
    for name in MODELS:
        out = subprocess.run([sys.executable, __file__, "--child", name], cwd=ROOT, capture_output=True, text=True,
                             check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    ratios = [r["ratio"] for r in rows]
    print(json.dumps({"benchmark": "cpu_rss", "budget_gib": BUDGET_GIB, "seq_len": SEQ_LEN, "torch_threads": None,
                      "loadavg": os.getloadavg(), "ratio_min": min(ratios), "ratio_max": max(ratios), "rows": rows}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
    else:
        main()
