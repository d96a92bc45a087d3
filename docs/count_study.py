"""Count the study's two models with ``labkit.study.memory.plan_model`` and write the result to
docs/data/plan_counted.jsonl (one JSON line per setting), which docs/generate.py reads for the
lesson-5 table of docs/results.md.

Settings: bert-120m and bert-350m at vocabulary ``plan.STUDY_VOCAB``, seq 512, on an H100 NVL,
bf16 and fp32, sparse and dense MLM head, one DDP rank with AdamW, counted on fake tensors as CUDA
would keep them (``labkit.study.cuda_like.CudaLike``). Run from the repository root:
``python docs/count_study.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "data" / "plan_counted.jsonl"


def main() -> None:
    import torch

    from labkit.model import model_config
    from labkit.study import plan
    from labkit.study.memory import labkit_model, plan_model

    torch.set_num_threads(os.cpu_count() or 1)
    lines = []
    for name in plan.STUDY_MICRO_BATCH:
        for precision in ("bf16", "fp32"):
            for sparse in (True, False):
                t0 = time.perf_counter()
                cfg = model_config(name, plan.STUDY_VOCAB, sparse_head=sparse)
                p = plan_model(*labkit_model(cfg, 512), device="H100 NVL", precision=precision, name=name)
                row = {"model": name, "seq_len": 512, "precision": precision, "sparse_head": sparse,
                       "device": "H100 NVL", "max_micro_batch": p["max_micro_batch"],
                       "activation_bytes_per_sequence": p["activation_bytes_per_sequence"],
                       "activation_bytes_fixed": p["activation_bytes_fixed"], "state_bytes": p["state_bytes"],
                       "transient_bytes": p["transient_bytes"], "total_bytes": p["total_bytes"],
                       "capacity_bytes": p["capacity_bytes"], "flops_per_token": p["flops_per_token"],
                       "method": p["method"], "corrections": p["corrections"],
                       "seconds": round(time.perf_counter() - t0, 1), "load_average_1m": round(os.getloadavg()[0], 2)}
                print(json.dumps(row), flush=True)
                lines.append(json.dumps(row))
    OUT.write_text("".join(line + "\n" for line in lines))
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
