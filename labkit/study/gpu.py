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

__all__ = ["flops_check", "gpu_memory_check", "hf_bert_mlm", "max_micro_batch_cuda", "measured_step_peak",
           "plan_model_check"]


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


def hf_bert_mlm(seq_len: int = 512, vocab_size: int = 30522, attn: str = "sdpa", **shape):
    """``(make_model, make_batch)`` for transformers' ``BertForMaskedLM`` built from a
    ``BertConfig`` (BERT-base shape unless ``shape`` overrides it; no hub), 15 % of each row masked."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=vocab_size, max_position_embeddings=max(512, seq_len), attn_implementation=attn,
                     **shape)
    k = max(1, round(0.15 * seq_len))

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(5, vocab_size, (b, seq_len), generator=torch.Generator().manual_seed(0))
        labels = torch.full_like(ids, -100)
        labels[:, 1:1 + k] = ids[:, 1:1 + k]
        return {"input_ids": ids, "labels": labels}

    return (lambda: BertForMaskedLM(cfg)), make_batch


def measured_step_peak(make_model, make_batch, b: int, *, device: torch.device, precision: str = "bf16",
                       steps: int = 3) -> int:
    """``max_memory_allocated`` over the last of ``steps`` training steps (autocast forward,
    backward, the AdamW labkit's ``build_optimizer`` makes: fused on CUDA, then
    ``zero_grad(set_to_none=True)``) of ``make_model()`` at micro-batch b, on ``device`` (CUDA)."""
    from labkit.config import TrainConfig
    from labkit.study.counting import AUTOCAST, loss_of
    from labkit.train.optim import build_optimizer

    torch.manual_seed(0)
    model = make_model().to(device).train()
    opt = build_optimizer(model, TrainConfig(data_dir="-", run_dir="-"))
    batch = {k: v.to(device) for k, v in make_batch(b).items()}
    dtype = AUTOCAST[precision]
    for _ in range(steps):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(**batch)
        loss_of(out).float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out
        torch.cuda.synchronize(device)
    peak = int(torch.cuda.max_memory_allocated(device))
    del model, opt, batch
    torch.cuda.empty_cache()
    return peak


def plan_model_check(cases, *, precision: str = "bf16", tolerance: float = 0.10) -> list[dict[str, Any]]:
    """``labkit.study.memory.plan_model`` (counted on this machine's CPU as CUDA keeps it) against
    ``measured_step_peak`` on the current CUDA device. ``cases``: (name, make_model, make_batch,
    micro-batches). One dict per (case, micro-batch): planned, measured, ratio, ok (within
    ``tolerance``), and the plan's method and corrections. Raises RuntimeError without CUDA."""
    from labkit.measure import device_kind
    from labkit.study.memory import plan_model, total_at
    from labkit.study.plan import DEVICES

    if not torch.cuda.is_available():
        raise RuntimeError("plan_model_check needs a CUDA device; torch.cuda.is_available() is False")
    device = torch.device("cuda", torch.cuda.current_device())
    kind = device_kind(torch.cuda.get_device_name(device))
    total = torch.cuda.get_device_properties(device).total_memory
    rows = []
    for name, make_model, make_batch, micro_batches in cases:
        plan = plan_model(make_model, make_batch, device=kind if kind in DEVICES else "H100 NVL", precision=precision,
                          budget_bytes=total, sharding="none", name=name)
        for b in micro_batches:
            measured = measured_step_peak(make_model, make_batch, b, device=device, precision=precision)
            planned = total_at(plan, b)
            rows.append({"model": name, "micro_batch": b, "planned": planned, "measured": measured,
                         "ratio": planned / measured, "ok": abs(planned / measured - 1) <= tolerance,
                         "method": plan["method"], "corrections": plan["corrections"],
                         "planned_max_micro_batch": plan["max_micro_batch"]})
    return rows


def flops_check(cfgs, *, seq_len: int = 512, micro_batch: int = 4, tolerance: float = 0.02) -> list[dict[str, Any]]:
    """``labkit.model.flops_per_token`` against ``FlopCounterMode`` over a bf16 training forward +
    backward of ``BertMLM(cfg)`` on the current device, per (name, cfg) in ``cfgs``. On CUDA the
    fused SDPA backward is counted by torch with its recompute of the scores (one more Q K^T),
    which model FLOPs leave out: ``model_flops`` takes it off (torch/utils/flop_counter.py,
    ``sdpa_backward_flop_count``). One dict per config: flops_per_token, counted_per_token,
    ratio, ok."""
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.model import BertMLM, flops_per_token
    from labkit.study.memory import labkit_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name, cfg in cfgs:
        torch.manual_seed(0)
        model = BertMLM(cfg).to(device).train()
        batch = {k: v.to(device) for k, v in labkit_model(cfg, seq_len)[1](micro_batch).items()}
        with FlopCounterMode(display=False) as counter:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(**batch)
            out.loss_sum.float().backward()
        counts = counter.get_flop_counts()["Global"]
        recompute = sum(v for k, v in counts.items() if "attention_backward" in str(k)) / 5
        counted = (counter.get_total_flops() - recompute) / (micro_batch * seq_len)
        masked = float((batch["labels"] != -100).float().mean())
        fpt = flops_per_token(cfg, seq_len, mlm_probability=masked)
        rows.append({"model": name, "seq_len": seq_len, "flops_per_token": fpt, "counted_per_token": counted,
                     "ratio": fpt / counted, "ok": abs(fpt / counted - 1) <= tolerance})
        del model, out
    return rows
