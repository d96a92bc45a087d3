"""The optimiser: AdamW with decoupled decay on matrices (plain, fused, or ZeRO-1). The
learning-rate schedule (``lr_at``, ``lr_for_batch``) lives in ``labkit.train.lr``, without torch,
and is re-exported here."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from labkit.config import TrainConfig
from labkit.train.lr import LR_RULES, lr_at, lr_for_batch  # noqa: F401 (the optimiser's schedule, re-exported)

with warnings.catch_warnings():
    # torch.distributed.optim's __init__ compiles its functional optimisers with torch.jit.script,
    # each raising torch 2.13's own DeprecationWarning at import (torch's call, not labkit's)
    warnings.filterwarnings("ignore", r"`torch\.jit\.(script|interface)` is deprecated", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["LR_RULES", "build_optimizer", "lr_at", "lr_for_batch", "optimizer_kind"]


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
