"""The optimiser and the learning-rate schedule: AdamW with decoupled decay on matrices, and
``lr_at`` (warm-up then linear, cosine, warmup-stable-decay or transformers' linear schedule), a pure
function of the step."""

from __future__ import annotations

import math
import warnings

import torch

from labkit.config import TrainConfig

with warnings.catch_warnings():
    # torch.distributed.optim's __init__ compiles its functional optimisers with torch.jit.script,
    # each raising torch 2.13's own DeprecationWarning at import (torch's call, not labkit's)
    warnings.filterwarnings("ignore", r"`torch\.jit\.(script|interface)` is deprecated", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["build_optimizer", "lr_at"]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimiser step ``step`` (0-based) under ``cfg.schedule.kind``.

    Warm-up: ``lr * (step + 1) / warmup_steps`` for step < warmup_steps (linear, never 0).
    Then, with progress p = (step - warmup) / (last - warmup) in [0, 1], last = max_steps - 1
    (the run's last step, which therefore uses min_lr) and min_lr = lr * min_lr_ratio: linear
    ``min_lr + (lr - min_lr)(1 - p)``; cosine ``min_lr + (lr - min_lr)(1 + cos(pi p)) / 2``
    (arXiv:1608.03983); wsd: lr until the last ``wsd_decay_fraction * max_steps`` steps, then
    linear to min_lr at the last step (warmup-stable-decay, arXiv:2404.06395).

    ``hf_linear`` is transformers' ``get_linear_schedule_with_warmup(opt, warmup_steps,
    max_steps)`` with ``scheduler.step()`` after each ``optimizer.step()``, step for step:
    ``lr * step / warmup_steps`` in warm-up (0 at step 0), then ``lr * (max_steps - step) /
    (max_steps - warmup_steps)`` (the last step, max_steps - 1, gets lr / (max_steps - warmup)
    and the schedule reaches 0 only after the run). It ignores min_lr_ratio.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    last = cfg.max_steps - 1
    if cfg.schedule.kind == "hf_linear":  # transformers.optimization._get_linear_schedule_with_warmup_lr_lambda
        if step < cfg.warmup_steps:
            return peak * step / max(1, cfg.warmup_steps)
        return peak * max(0.0, (cfg.max_steps - step) / max(1, cfg.max_steps - cfg.warmup_steps))
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule.kind == "wsd":
        decay_start = max(cfg.warmup_steps, cfg.max_steps - round(cfg.wsd_decay_fraction * cfg.max_steps))
        p = min(1.0, (step - decay_start) / max(1, last - decay_start)) if step >= decay_start else 0.0
        return floor + (peak - floor) * (1.0 - p)
    p = min(1.0, (step - cfg.warmup_steps) / max(1, last - cfg.warmup_steps))
    if cfg.schedule.kind == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
    return floor + (peak - floor) * (1.0 - p)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (arXiv:1711.05101) with weight decay on matrices only: biases (of any shape) and
    parameters with ndim < 2 (norm weights) get none. Tied parameters appear once. With ``cfg.sharding ==
    "zero1"`` and a process group, the same two groups go to ``ZeroRedundancyOptimizer``
    (ZeRO stage 1: each rank holds and steps the AdamW state of its partition of the
    parameters, then broadcasts them); its ``param_groups`` are the whole groups, so setting
    the lr there reaches every partition at ``step()``. Under fsdp the parameters are DTensor
    shards and plain AdamW steps each rank's shard. On CPU and CUDA (ddp, zero1 and single
    process, fsdp and split runs alike) AdamW is torch's fused implementation (``fused=True``: one
    kernel per dtype and device for all parameters, the same update; on CPU since torch 2.4, about
    a quarter of the for-loop's CPU time: docs/training.md). It takes DTensor parameters when all
    of them are DTensors on one mesh (fsdp's shards; a split run's, where every parameter is a
    DTensor: ``labkit.train.tensor_parallel``), not a mix of Tensor and DTensor, and not fsdp under
    fp16 (``ShardedGradScaler``'s found-inf flag has a shape the fused step refuses, torch 2.13):
    those keep the default implementation."""
    from torch.distributed.tensor import DTensor

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    decay = [_decays(n, p) for n, p in named]  # a fused bias ([3, H]: labkit.model.encoder.FusedLinear) is 2-D
    groups = [{"params": [p for p, d in zip(params, decay) if d], "weight_decay": cfg.weight_decay},
              {"params": [p for p, d in zip(params, decay) if not d], "weight_decay": 0.0}]
    n_dtensor = sum(isinstance(p, DTensor) for p in params)
    # fused: not over a mix of Tensor and DTensor, nor DTensors under fp16 (ShardedGradScaler's found_inf is
    # [1]-shaped; fused AdamW's step update refuses it: "output with shape [] doesn't match the broadcast shape [1]")
    fusable = params and n_dtensor in (0, len(params)) and not (n_dtensor and cfg.precision == "fp16")
    fused = {"fused": True} if fusable else {}
    if cfg.sharding == "zero1" and torch.distributed.is_initialized():
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=cfg.lr,
                                       betas=(cfg.beta1, cfg.beta2), **fused)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **fused)


def _decays(name: str, p: torch.Tensor) -> bool:
    """Whether parameter ``name`` gets weight decay: matrices (ndim >= 2) that are not a bias."""
    return p.ndim >= 2 and not name.endswith("bias")
