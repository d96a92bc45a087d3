"""The gradient noise scale of a run, measured inside its gradient collective.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training"
(arXiv:1812.06162), App. A.1: with G the true (expected) gradient, Σ the covariance of the
per-example gradient and G_B the mean gradient of a batch of B independent examples,
E|G_B|² = |G|² + tr(Σ)/B. Two batch sizes B_small < B_big, measured on the same weights, give
unbiased estimates

    |G|²  ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

each smoothed by its own bias-corrected EMA; the simple noise scale is their ratio
B_simple = tr(Σ)/|G|² (the ratio of single-step estimates is biased and very noisy).

Where the two batches come from (``NoiseScale.for_run``):

- DDP (ddp, zero1), R ranks, local batch b, accumulation k: the comm hook's bucket before the
  all-reduce is this rank's gradient of b·k sequences, the averaged bucket after it the gradient
  of R·b·k. ``|G_small|²`` is the mean over ranks of the local squared norm. (k-diffusion's
  ``k_diffusion/gns.py``, ``DDPGradientStatsHook``, takes the same two sums in a hook.)
- FSDP2: each micro-batch's reduce-scatter; its input is this rank's gradient of b sequences,
  its output a shard of the average over ranks (R·b); shard squared norms add up over ranks. Under
  pp FSDP2 reduces once per step, at the end of the pipeline schedule: b·k against R·b·k.
- ``sharding="replicate"`` (split runs): the replicas' all-reduce after the backward, b·k against R·b·k.
- dp = 1: the micro-batches of an accumulated step (``grad_accum_steps >= 2``), each a batch of
  b, against their sum (b·k). ``Runtime.forward_backward`` feeds them (``micro=True``).

Split runs: every rank's squared norms are summed over the world (``step_fields``), so each
replica's norm is that of its tp slices and pipeline stages together; a parameter a tp group holds
whole on each rank (a replicated norm or bias) is weighted 1/tp (``labkit.train.runtime``). What
backward leaves as partial sums on several ranks (the sequence-parallel norms' and biases' gradients
over tp, the tied embedding's two pipeline stages) is reduced over dp before those sums are taken,
so its pieces count separately: |G_small|² and |G_big|² then lack the pieces' cross terms (exact
without sequence parallelism and, under pp, with untied embeddings).

What an example is, for MLM: a sequence. labkit's loss is the mean CE over the masked tokens of
the global batch (``labkit.train.runtime``: each micro-batch's loss is scaled by dp /
n_masked_global), so every gradient the observer sees is (sum of the per-sequence loss-sum
gradients s_i of its batch) / (its number of sequences × m̂), with m̂ = n_masked_global / (global
batch) the step's masked tokens per sequence, the same for both batches. The per-example
gradient is therefore g_i = s_i / m̂, and no renormalisation by the local masked count is needed.
B_simple in masked tokens is B_simple (sequences) × m̂ (averaged like the rest). Under fp16 the
loss scale multiplies both squared norms of a step alike; B_simple is invariant to it, the
|G|² and tr(Σ) fields are not (they are reported unscaled only for fp32/bf16).

Definitions and their sources: docs/measurement.md. Tests: tests/train/test_gns.py (against exact
per-example gradients from ``torch.func``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from labkit.train.comm import GradientObserver

__all__ = ["BiasCorrectedEMA", "NoiseScale", "squared_norm", "two_batch_estimates"]

EMA_BETA = 0.95  # each estimate's EMA: ~20 steps of memory, bias-corrected (Adam's correction)


def squared_norm(t: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Σ t² of a tensor as a 0-d fp32 tensor on its device (one reduction, no host sync); with
    ``weights`` (fp32, a length dividing t's) Σ w t² over ``t.view(-1, len(weights))``'s rows."""
    if weights is None:
        return torch.linalg.vector_norm(t, dtype=torch.float32).square()
    return (t.reshape(-1, weights.numel()).float().square() * weights).sum()


def two_batch_estimates(sq_small: float, sq_big: float, b_small: float, b_big: float) -> tuple[float, float]:
    """McCandlish et al. 2018 (arXiv:1812.06162) App. A.1: unbiased (|G|², tr(Σ)) from the squared
    norms of two mean gradients of batches of ``b_small`` < ``b_big`` examples at the same weights.
    Units: squared gradient units; tr(Σ) is per example. Raises ValueError unless
    0 < b_small < b_big."""
    if not 0 < b_small < b_big:
        raise ValueError(f"two_batch_estimates: need 0 < b_small < b_big, got {b_small}, {b_big}")
    g2 = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


class BiasCorrectedEMA:
    """Exponential moving average with Adam's bias correction: after n updates the value is
    Σ β^(n−i)(1−β)x_i / (1−β^n), so the first value is x_1 itself."""

    def __init__(self, beta: float = EMA_BETA) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"BiasCorrectedEMA: beta must be in [0, 1), got {beta}")
        self.beta, self.value, self.n = beta, 0.0, 0

    def update(self, x: float) -> float:
        """Add ``x``; return the corrected average."""
        self.n += 1
        self.value = self.beta * self.value + (1.0 - self.beta) * x
        return self.get()

    def get(self) -> float | None:
        """The corrected average (None before the first update)."""
        return self.value / (1.0 - self.beta ** self.n) if self.n else None


class NoiseScale(GradientObserver):
    """The simple gradient noise scale B_simple of a run, from the gradient collective.

    ``b_small`` and ``b_big``: the two batch sizes in sequences (``for_run`` derives them).
    Per step, ``before`` sums the squared norm of every local bucket (``scale_small`` × the sum is
    |G_small|², averaged over ranks in ``step_fields``), ``after`` that of every reduced bucket or
    shard (``scale_big`` × the sum is |G_big|²; shard norms add over ranks with ``sharded``).
    ``count(n_masked_global)`` gives the step's masked tokens (``n_sequences`` per step) for the
    token unit. ``step_fields()`` all-reduces two scalars and returns the record fields:

    - ``b_simple``: tr(Σ)/|G|² from the two EMAs, in sequences (None while the |G|² EMA is <= 0);
    - ``b_simple_tokens``: the same in masked tokens;
    - ``gns_grad_sq``, ``gns_trace_cov``: the EMAs of |G|² and tr(Σ);
    - ``gns_sq_small``, ``gns_sq_big``, ``gns_b_small``, ``gns_b_big``: this step's raw inputs.
    """

    def __init__(self, b_small: int, b_big: int, *, n_sequences: int | None = None, ranks: int = 1,
                 sharded: bool = False, scale_small: float = 1.0, scale_big: float = 1.0, micro: bool = False,
                 beta: float = EMA_BETA) -> None:
        if not 0 < b_small < b_big:
            raise ValueError(f"NoiseScale: need 0 < b_small < b_big sequences, got {b_small} and {b_big}")
        self.b_small, self.b_big, self.ranks, self.sharded, self.micro = b_small, b_big, ranks, sharded, micro
        self.scale_small, self.scale_big = scale_small, scale_big
        self.n_sequences = n_sequences or b_big
        self.grad_sq, self.trace, self.masked = BiasCorrectedEMA(beta), BiasCorrectedEMA(beta), BiasCorrectedEMA(beta)
        self.reset()

    @classmethod
    def for_run(cls, *, micro_batch_size: int, grad_accum_steps: int, dp: int, sharding: str,
                pp: int = 1) -> "NoiseScale | None":
        """The observer of a run of ``dp`` data-parallel replicas (``sharding``: "ddp", "zero1",
        "fsdp", "replicate"; "none" without a process group) and ``pp`` pipeline stages, or None where
        no two batch sizes exist:

        - FSDP2 at pp = 1 reduce-scatters every micro-batch: b against dp·b, k per step;
        - every other dp > 1 reduces once per step (DDP's hook, the replicas' all-reduce, FSDP2 at
          the end of a pipeline step): b·k against dp·b·k;
        - dp = 1 at pp = 1 with ``grad_accum_steps >= 2`` and no DDP (which keeps the gradients in
          its buckets): the micro-batches, b against b·k (``micro=True``);
        - otherwise (one micro-batch, or a pipeline's micro-batches inside its schedule): None."""
        b, k = micro_batch_size, grad_accum_steps
        if dp > 1 and sharding == "fsdp" and pp == 1:  # one reduce-scatter per micro-batch
            return cls(b, dp * b, n_sequences=dp * b * k, ranks=dp, sharded=True, scale_small=k, scale_big=k)
        if dp > 1:
            return cls(b * k, dp * b * k, ranks=dp, sharded=sharding == "fsdp")
        if k >= 2 and pp == 1 and sharding not in ("ddp", "zero1"):  # G_small = k·d_j, G_big = Σ d_j
            return cls(b, b * k, n_sequences=b * k, scale_small=k, sharded=True, micro=True)
        return None

    def reset(self) -> None:
        """Zero the step's sums (called before every step)."""
        self._small: Any = 0.0
        self._big: Any = 0.0
        self._masked: Any = None

    def before(self, bucket_index: int, local: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add the (weighted: ``GradientObserver``) squared norm of this rank's local gradient bucket
        (before the reduction)."""
        self.add_small(squared_norm(local, weights))

    def after(self, bucket_index: int, reduced: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add the (weighted) squared norm of the reduced bucket (the average) or shard (FSDP2)."""
        self.add_big(squared_norm(reduced, weights))

    def add_small(self, sq: torch.Tensor | float) -> None:
        """Add a squared norm (0-d tensor or float) to the step's local (small-batch) sum."""
        self._small = self._small + sq

    def add_big(self, sq: torch.Tensor | float) -> None:
        """Add a squared norm to the step's reduced (big-batch) sum."""
        self._big = self._big + sq

    def count(self, n_masked_global: torch.Tensor | int) -> None:
        """The step's masked tokens over all ranks (a tensor is read only in ``step_fields``)."""
        self._masked = n_masked_global

    def step_fields(self) -> dict[str, Any]:
        """Fold in this step (all-reduces [Σ local, Σ reduced] once when distributed) and return
        the record fields (class docstring). A step with a non-finite norm is not folded in."""
        sums = [v if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in (self._small, self._big)]
        both = torch.stack([v.to(device=sums[0].device, dtype=torch.float64) for v in sums])
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank's piece: tp slices, pp stages too
            dist.all_reduce(both, op=dist.ReduceOp.SUM)
            both[0] /= self.ranks
            if not self.sharded:  # every replica holds the whole average: its norm counted R times
                both[1] /= self.ranks
        both = both.cpu()
        sq_small, sq_big = float(both[0]) * self.scale_small, float(both[1]) * self.scale_big
        fields: dict[str, Any] = {"gns_sq_small": sq_small, "gns_sq_big": sq_big,
                                  "gns_b_small": self.b_small, "gns_b_big": self.b_big}
        if math.isfinite(sq_small) and math.isfinite(sq_big) and (sq_small or sq_big):
            g2, trace = two_batch_estimates(sq_small, sq_big, self.b_small, self.b_big)
            self.grad_sq.update(g2)
            self.trace.update(trace)
            if self._masked is not None:
                self.masked.update(float(self._masked) / self.n_sequences)
        g2, trace, per_seq = self.grad_sq.get(), self.trace.get(), self.masked.get()
        b_simple = trace / g2 if g2 is not None and trace is not None and g2 > 0 else None
        return fields | {"gns_grad_sq": g2, "gns_trace_cov": trace, "b_simple": b_simple,
                         "b_simple_tokens": b_simple * per_seq if b_simple is not None and per_seq else None}
