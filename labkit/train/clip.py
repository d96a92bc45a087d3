"""The one gradient clip of every run: torchtitan's ``clip_grad_norm_``.

``pytorch/torchtitan: torchtitan/distributed/utils.py`` ``clip_grad_norm_``: the total L2 norm of
the gradients is ``torch.nn.utils.get_total_norm`` (for DTensor gradients a DTensor norm, reduced
over the parameters' mesh by ``full_tensor()``), the pipeline stages' squared norms are summed over
the pp group, and ``torch.nn.utils.clip_grads_with_norm_`` scales every gradient by
``min(1, max_norm / (norm + 1e-6))``. Every parameter of a labkit run sits on one mesh: plain tensors
under DDP, ZeRO-1 and one process (every rank holds the whole averaged gradient), DTensors on the dp
mesh under FSDP2, on the tp mesh with tensor parallelism and on the (dp, tp) mesh with both
(tests/train/test_parallel.py checks it for every split case). Under pp with tied
embeddings the last stage holds a copy of the word embedding whose gradient equals the first
stage's after the step's sum (``labkit.train.runtime``): it is left out of the norm, so the tied
weight is counted once, and clipped with the rest.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, *, pp_group: dist.ProcessGroup | None = None,
                    counted_elsewhere: torch.Tensor | None = None) -> float:
    """Clip the gradients of ``parameters`` (those without a gradient are skipped) to a global L2
    norm of ``max_norm`` (``inf``: measure only) and return the norm before clipping, a float, the
    same on every rank.

    Collective: ``full_tensor()`` of a DTensor norm reduces over the parameters' mesh, and with
    ``pp_group`` (pp > 1) the squared norms are summed over the pipeline stages (fp64).
    ``counted_elsewhere``: a parameter whose gradient another stage already counts (the tied
    embedding's copy), left out of the norm and clipped. The norm is torch's (fp32 per tensor);
    the gradients are scaled in place by ``min(1, max_norm / (norm + 1e-6))`` (torch's
    ``clip_grads_with_norm_``) only when that is below 1; a non-finite norm leaves them unscaled
    (the caller skips the step)."""
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None and p is not counted_elsewhere]
    total = torch.nn.utils.get_total_norm(grads) if grads else None
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if total is None:
        device = params[0].device if params else torch.device("cpu")
        total = torch.zeros((), device=device)
    if pp_group is not None:
        squared = total.double().square()
        dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    norm = float(total)
    if math.isfinite(norm) and max_norm / (norm + 1e-6) < 1.0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.float())
    return norm
