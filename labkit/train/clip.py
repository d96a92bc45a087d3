"""One gradient clip for every split: the global L2 norm over every mesh dimension and pipeline stage.

torchtitan's ``clip_grad_norm_`` (``pytorch/torchtitan: torchtitan/distributed/utils.py``) takes
the total norm of the gradients with ``torch.nn.utils.get_total_norm`` (a DTensor norm, reduced
over the parameters' mesh), all-reduces the stages' squared norms over the pipeline mesh, and
scales every gradient by ``torch.nn.utils.clip_grads_with_norm_``'s factor
``min(1, max_norm / (norm + 1e-6))``. Its DTensor step needs every parameter on ONE mesh; a labkit
split run holds parameters on several (the tp mesh, the dp mesh, (dp, tp) under FSDP2 with tensor
parallelism, none for a DDP replica), and ``torch.stack`` of norms on different meshes fails
(``All operands in aten.stack.default must have the same mesh``). So the reduction is written out:
each rank sums the squares of the parts it holds (``to_local``), each divided by the number of
ranks that hold the same values (``copies``), and one all-reduce over the world gives the squared
norm of every parameter counted once, across tp, dp and pp alike. The factor is torch's.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from labkit.model.encoder import local

__all__ = ["clip_grad_norm_", "copies_of"]


def copies_of(p: torch.Tensor, holders: int) -> float:
    """How many ranks hold the same values as this rank's part of parameter ``p``, when ``holders``
    ranks hold some part of it (the world's ranks of its pipeline stage, times 2 for a tied
    embedding held by the first and last stage): ``holders`` / the number of distinct shards, the
    product of the mesh sizes of ``p``'s ``Shard`` placements (1 for a plain tensor, whose every
    holder has all of it). ValueError when the shards do not divide ``holders``."""
    distinct = 1
    if isinstance(p, DTensor):  # Shard, or FSDP2's _StridedShard over a tp Shard (not a Shard subclass)
        for size, placement in zip(p.device_mesh.shape, p.placements):
            distinct *= 1 if placement.is_replicate() else size
    if holders % distinct:
        raise ValueError(f"holders: {holders} ranks cannot hold {distinct} distinct shards evenly")
    return holders / distinct


def clip_grad_norm_(params: Iterable[tuple[torch.Tensor, float]], max_norm: float) -> float:
    """Clip the gradients of ``params`` ((parameter, copies) pairs, ``copies_of``; parameters
    without a gradient are skipped) to a global L2 norm of ``max_norm`` (``inf``: measure only) and
    return the norm before clipping, a float, the same on every rank.

    Collective when a process group is initialised (every rank calls, one fp64 scalar all-reduce
    over the world). The squared norm is summed in fp64. Scaling is in place on each rank's local
    part, by ``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grads_with_norm_``'s factor),
    and only when it is below 1. A non-finite gradient gives a non-finite norm and leaves the
    gradients unscaled (the caller skips the step)."""
    grads, total, device = [], None, None
    for p, copies in params:
        device = local(p).device
        if p.grad is None:
            continue
        g = local(p.grad)
        grads.append(g)
        term = g.detach().double().pow(2).sum() / copies
        total = term if total is None else total + term
    if total is None:
        total = torch.zeros((), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total)
    norm = math.sqrt(total.item()) if total.item() >= 0 else float("nan")
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)
    return norm
