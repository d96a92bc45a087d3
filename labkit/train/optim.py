"""The optimiser and the learning-rate schedule: AdamW with decoupled decay on matrices, and
``lr_at`` (warm-up then linear, cosine, warmup-stable-decay or transformers' linear schedule), a pure
function of the step."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from labkit.config import TrainConfig

with warnings.catch_warnings():
    # torch.distributed.optim's __init__ compiles its functional optimisers with torch.jit.script,
    # each raising torch 2.13's own DeprecationWarning at import (torch's call, not labkit's)
    warnings.filterwarnings("ignore", r"`torch\.jit\.(script|interface)` is deprecated", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["LR_RULES", "build_optimizer", "lr_at", "lr_for_batch", "optimizer_kind"]

LR_RULES = ("sqrt", "linear", "constant")
"""The rules ``lr_for_batch`` knows (``TrainConfig.batch.lr_rule``)."""


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
    peak, floor = cfg.optim.lr, cfg.optim.lr * cfg.schedule.min_lr_ratio
    last = cfg.max_steps - 1
    if cfg.schedule.kind == "hf_linear":  # transformers.optimization._get_linear_schedule_with_warmup_lr_lambda
        if step < cfg.schedule.warmup_steps:
            return peak * step / max(1, cfg.schedule.warmup_steps)
        return peak * max(0.0, (cfg.max_steps - step) / max(1, cfg.max_steps - cfg.schedule.warmup_steps))
    if step < cfg.schedule.warmup_steps:
        return peak * (step + 1) / cfg.schedule.warmup_steps
    if cfg.schedule.kind == "wsd":
        decay = round(cfg.schedule.wsd_decay_fraction * cfg.max_steps)
        decay_start = max(cfg.schedule.warmup_steps, cfg.max_steps - decay)
        p = min(1.0, (step - decay_start) / max(1, last - decay_start)) if step >= decay_start else 0.0
        return floor + (peak - floor) * (1.0 - p)
    p = min(1.0, (step - cfg.schedule.warmup_steps) / max(1, last - cfg.schedule.warmup_steps))
    if cfg.schedule.kind == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
    return floor + (peak - floor) * (1.0 - p)


def lr_for_batch(base_lr: float, base_batch: int, batch: int, rule: str = "sqrt") -> float:
    """The learning rate at global ``batch`` (sequences) from ``base_lr`` at ``base_batch``:
    ``sqrt`` (lr ∝ √B, the rule for Adam: Malladi et al. 2022, arXiv:2205.10287), ``linear``
    (lr ∝ B, Goyal et al. 2017, arXiv:1706.02677, for SGD) or ``constant``. Raises ValueError on an
    unknown rule or a non-positive batch."""
    if rule not in LR_RULES:
        raise ValueError(f"lr rule: must be one of {LR_RULES}, got {rule!r}")
    if batch <= 0 or base_batch <= 0:
        raise ValueError(f"lr_for_batch: batches must be positive, got {base_batch} and {batch}")
    ratio = batch / base_batch
    return base_lr * {"sqrt": math.sqrt(ratio), "linear": ratio, "constant": 1.0}[rule]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, *, group: Any = None,
                    sharded_scaler: bool = False) -> torch.optim.Optimizer:
    """AdamW (arXiv:1711.05101) with weight decay on matrices only: biases (of any shape) and
    parameters with ndim < 2 (norm weights) get none. Tied parameters appear once. With ``cfg.parallel.sharding ==
    "zero1"`` and a process group, the same two groups go to ``ZeroRedundancyOptimizer`` over
    ``group`` (the dp group; None: the world): ZeRO stage 1, each rank holds and steps the AdamW state
    of its partition of the parameters, then broadcasts them; its ``param_groups`` are the whole
    groups, so setting the lr there reaches every partition at ``step()``.

    The implementation is torch's fused AdamW (``fused=True``: one kernel per dtype and device for
    all parameters, the same update; on CPU since torch 2.4, about a quarter of the for-loop's CPU
    time: docs/training.md) on CPU and CUDA alike, for plain tensors (one process, ddp, zero1) and for
    DTensors (FSDP2's shards, tensor-parallel slices: every parameter on one mesh,
    ``labkit.train.parallel``), with two exceptions that keep torch's default implementation
    (foreach on CUDA, the for-loop on CPU): a mix of Tensor and DTensor parameters, and fp16 with
    ``sharded_scaler`` (the run's scaler is ``ShardedGradScaler``: FSDP2, tensor or pipeline
    parallelism), whose found-inf flag is [1]-shaped where the fused step wants a scalar ("output
    with shape [] doesn't match the broadcast shape [1]", torch 2.13). ``optimizer_kind`` names the
    choice."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    decay = [_decays(n, p) for n, p in named]  # a fused bias ([3, H]: labkit.model.encoder.FusedLinear) is 2-D
    groups = [{"params": [p for p, d in zip(params, decay) if d], "weight_decay": cfg.optim.weight_decay},
              {"params": [p for p, d in zip(params, decay) if not d], "weight_decay": 0.0}]
    fused = {"fused": True} if optimizer_kind(params, sharded_scaler=sharded_scaler and cfg.precision == "fp16") \
        == "fused" else {}
    if cfg.parallel.sharding == "zero1" and torch.distributed.is_initialized():
        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=cfg.optim.lr, process_group=group,
                                       betas=(cfg.optim.beta1, cfg.optim.beta2), **fused)
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), **fused)


def optimizer_kind(params: list[torch.Tensor], *, sharded_scaler: bool = False) -> str:
    """"fused" where ``build_optimizer`` runs torch's fused AdamW over ``params``, else "default"
    (torch's default: foreach on CUDA, the for-loop on CPU): a mix of Tensor and DTensor, or an fp16
    ``ShardedGradScaler`` stepping it (``sharded_scaler``; ``build_optimizer``)."""
    from torch.distributed.tensor import DTensor

    n_dtensor = sum(isinstance(p, DTensor) for p in params)
    return "fused" if params and n_dtensor in (0, len(params)) and not sharded_scaler else "default"


def _decays(name: str, p: torch.Tensor) -> bool:
    """Whether parameter ``name`` gets weight decay: matrices (ndim >= 2) that are not a bias."""
    return p.ndim >= 2 and not name.endswith("bias")
