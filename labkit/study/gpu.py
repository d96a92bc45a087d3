"""The planner against a real GPU: peak memory and the largest micro-batch measured with CUDA.

Both need a CUDA device (they raise RuntimeError without one); ``benchmarks/gpu_check.py`` runs
them. The CPU-side logic is tested with stand-ins in tests/test_gpu_check.py.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.config import ModelConfig
from labkit.model import BertMLM, count_parameters
from labkit.study.plan import STUDY_VOCAB, largest_fitting, memory_plan


def gpu_memory_check(models=(("bert-120m", 64), ("bert-350m", 16)), *, seq_len: int = 512,
                     vocab_size: int = STUDY_VOCAB, precision: str = "bf16", tolerance: float = 0.10,
                     steps: int = 3) -> list[dict[str, Any]]:
    """The planner against a real GPU (called by benchmarks/gpu_check.py): for each (preset,
    micro-batch), train ``steps`` steps under autocast on CUDA with the optimiser training
    builds (``labkit.train.optim.build_optimizer``: AdamW, fused on CUDA) and compare
    ``memory_plan(...)["total"]`` (attention "flash": CUDA's fused SDPA kernels) with
    ``torch.cuda.max_memory_allocated`` over the last step, and the planned activations + held
    logits with the bytes allocated by the last forward. Returns one dict per model: model,
    micro_batch, planned_peak, measured_peak, peak_ratio, planned_forward, measured_forward,
    forward_ratio, ok (both ratios within ``tolerance`` of 1). Raises RuntimeError without CUDA."""
    from labkit.model import model_config

    if not torch.cuda.is_available():
        raise RuntimeError("gpu_memory_check needs a CUDA device; torch.cuda.is_available() is False")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    out = []
    for name, b in models:
        cfg = model_config(name, vocab_size)
        torch.manual_seed(0)
        model = BertMLM(cfg).cuda().train()
        from labkit.config import TrainConfig
        from labkit.train.optim import build_optimizer

        opt = build_optimizer(model, TrainConfig(data_dir="-", run_dir="-"))  # the optimiser training uses
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randint(5, vocab_size, (b, seq_len), device="cuda", generator=g)
        labels = torch.full_like(ids, -100)
        n_mask = round(0.15 * seq_len)
        labels[:, 1:1 + n_mask] = ids[:, 1:1 + n_mask]
        mask = torch.ones_like(ids, dtype=torch.bool)
        for _ in range(steps):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=dtype):
                res = model(ids, attention_mask=mask, labels=labels)
            torch.cuda.synchronize()
            forward = torch.cuda.memory_allocated() - before
            (res.loss_sum / res.n_masked).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del res
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        plan = memory_plan(cfg, seq_len=seq_len, micro_batch=b, precision=precision, attention="flash")
        planned_fwd = plan["activations"] + plan["logits"] + plan["autocast_copies"]
        row = {"model": name, "micro_batch": b, "seq_len": seq_len, "planned_peak": plan["total"],
               "measured_peak": int(peak), "peak_ratio": plan["total"] / peak, "planned_forward": planned_fwd,
               "measured_forward": int(forward), "forward_ratio": planned_fwd / max(1, forward)}
        row["ok"] = abs(row["peak_ratio"] - 1) <= tolerance and abs(row["forward_ratio"] - 1) <= tolerance
        out.append(row)
        del model, opt
        torch.cuda.empty_cache()
    return out


def max_micro_batch_cuda(model_cfg: ModelConfig, seq_len: int, *, precision: str = "bf16", limit: int = 4096,
                         mlm_probability: float = 0.15) -> dict[str, Any]:
    """Largest micro-batch whose training step (forward, backward, AdamW step under autocast)
    runs on the current CUDA device without ``torch.cuda.OutOfMemoryError``: doubling from 1,
    then bisection. Returns {"max_micro_batch", "peak_bytes" (``max_memory_allocated`` at the
    answer), "budget_bytes" (the device's total memory), "params", "seq_len"}. Raises
    RuntimeError without CUDA. The search is ``labkit.study.plan.largest_fitting``."""
    if not torch.cuda.is_available():
        raise RuntimeError("max_micro_batch_cuda needs a CUDA device; torch.cuda.is_available() is False")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
    torch.manual_seed(0)
    model = BertMLM(model_cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_mask = max(1, round(mlm_probability * seq_len))

    def fits(b: int) -> int | None:
        ids = labels = out = None
        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(5, model_cfg.vocab_size, (b, seq_len), device="cuda")
            labels = torch.full_like(ids, -100)
            labels[:, 1:1 + n_mask] = ids[:, 1:1 + n_mask]
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                out = model(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), labels=labels)
            (out.loss_sum / out.n_masked).backward()
            opt.step()
            return int(torch.cuda.max_memory_allocated())
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            del ids, labels, out
            opt.zero_grad(set_to_none=True)

    peaks: dict[int, int] = {}

    def record(b: int) -> bool:
        peak = fits(b)
        if peak is not None:
            peaks[b] = peak
        return peak is not None

    lo = largest_fitting(record, limit=limit)  # doubling from 1, then bisection
    peak = peaks.get(lo)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    del model, opt
    torch.cuda.empty_cache()
    return {"max_micro_batch": lo, "peak_bytes": peak, "budget_bytes": int(total),
            "params": int(count_parameters(model_cfg)["total"]), "seq_len": seq_len}
