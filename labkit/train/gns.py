"""The gradient noise scale of a run, measured inside its gradient collective, with its interval.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training"
(arXiv:1812.06162), App. A.1: with G the true (expected) gradient, Σ the covariance of the
per-example gradient and G_B the mean gradient of a batch of B independent examples,
E|G_B|² = |G|² + tr(Σ)/B. Two batch sizes B_small < B_big, measured on the same weights, give
unbiased estimates

    |G|²  ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

each smoothed by its own bias-corrected EMA; the simple noise scale is their ratio
B_simple = tr(Σ)/|G|² (the ratio of single-step estimates is biased and very noisy).

Its interval (``fieller_interval``): the two EMAs are weighted means of the per-step estimates
(weights w_t, Σw = 1), whose covariance is Σw² times the steps' own weighted covariance; Fieller's
theorem (Fieller 1954, "Some problems in interval estimation", JRSS B 16(2):175-185) turns that
into an interval for their ratio, a Student-t quantile at Kish's effective number of steps
1/Σw². Unlike the delta method (its first-order form) it stays honest when the |G|² average is
barely above its error: the interval is then long or open above.

Where the two batches come from (``NoiseScale.for_run``):

- DDP (ddp, zero1), R ranks, local batch b, accumulation k (kind "params"): |G_small|² is the
  mean over ranks of the squared norm of this rank's gradient of b·k sequences, taken per
  parameter by a post-accumulate-grad hook on the step's synchronising backward (``local``: the
  hook runs after the parameter's gradient is accumulated and before DDP's own hook marks it ready,
  so the tensor is this rank's local sum, read while it is still in cache, where a pass over the
  bucket inside DDP's comm hook reads it back from memory: docs/measurement.md). |G_big|², the squared norm of
  the averaged gradient (R·b·k sequences), every rank holds whole after the all-reduce: it is the
  step's clip norm squared (``reduced_norm``, ``labkit.train.runtime.Runtime.clip_grad_norm``),
  which the step computes anyway, so it costs no pass of its own. Per-parameter sums in the order
  of the parameters' names (and the clip's per-parameter norms in the parameters' order) are the
  same bits whatever DDP's bucket layout, which DDP lays out anew after a run's first step: a
  resumed run's noise scale (and a ``critical`` batch ramp's decisions, ``labkit.train.ramp``) is the
  uninterrupted run's on CPU. (k-diffusion's ``k_diffusion/gns.py``, ``DDPGradientStatsHook``,
  takes the same two sums in DDP's comm hook.)
- The replicas' all-reduce (``sharding="replicate"``, kind "average"): the local flat gradient
  before it, b·k; each rank's 1/R slice of the averaged one after it (the sum over ranks is the
  whole), R·b·k.
- DDP under PowerSGD: the averaged bucket is the compressed one, so both norms come from a count
  sketch (``CountSketch``) of each local bucket before compression, m bins each; the sketches
  are linear, so their sum over ranks is the sketch of the uncompressed mean: |G_small|² =
  mean_r |S g_r|², |G_big|² = |mean_r S g_r|², with E_S|S x|² = |x|². The sums ride the step's
  small all-reduce (below), a few KB, not a second all-reduce of the gradient.
- FSDP2: each micro-batch's reduce-scatter; its input is this rank's gradient of b sequences,
  its output a shard of the average over ranks (R·b); shard squared norms add up over ranks. Under
  pp FSDP2 reduces once per step, at the end of the pipeline schedule: b·k against R·b·k.
- dp = 1: the micro-batches of an accumulated step (``grad_accum_steps >= 2``), each a batch of
  b, against their sum (b·k). ``Runtime.forward_backward`` feeds them (``micro=True``).

Split runs: every rank's squared norms are summed over the world (the sideband, or ``step_fields``),
so each replica's norm is that of its tp slices and pipeline stages together; a parameter a tp group holds
whole on each rank (a replicated norm or bias) is weighted 1/tp (``labkit.train.runtime``). What
backward leaves as partial sums on several ranks (the sequence-parallel norms' and biases' gradients
over tp, the tied embedding's two pipeline stages) is reduced over dp before those sums are taken,
so its pieces count separately: |G_small|² and |G_big|² then lack the pieces' cross terms (exact
without sequence parallelism and, under pp, with untied embeddings).

No collective of its own: ``sideband()`` gives the step's sums (a float64 vector) to the caller,
which sums them over the ranks inside the step's all-reduce of the loss
(``labkit.train.comm.CommTimer.sideband``) and hands them back with ``receive``; only a caller
that does not do so makes ``step_fields`` all-reduce them itself.

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
per-example gradients from ``torch.func``; the interval's coverage; PowerSGD against the plain
all-reduce on the same batches).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import torch
import torch.distributed as dist

from labkit.train.comm import GradientObserver

__all__ = ["BiasCorrectedEMA", "CountSketch", "NoiseScale", "fieller_interval", "squared_norm", "t_quantile",
           "two_batch_estimates"]

EMA_BETA = 0.95  # each estimate's EMA: ~20 steps of memory, bias-corrected (Adam's correction)
INTERVAL_LEVEL = 0.90  # two-sided level of b_simple_low .. b_simple_high
MIN_INTERVAL_STEPS = 10  # no interval before this many steps are folded in (Kish's n_eff ~ 10)
SKETCH_BINS = 4096  # count-sketch bins per bucket under PowerSGD: relative error of |S x|² ≲ √(2/m) = 2.2 % a step


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


def t_quantile(p: float, dof: float) -> float:
    """Student-t quantile at probability ``p`` with ``dof`` degrees of freedom (> 0), from the
    normal one by the Cornish-Fisher expansion (Abramowitz & Stegun 26.7.5; within 0.3 % for
    dof >= 5, the normal quantile as dof -> inf)."""
    z = NormalDist().inv_cdf(p)
    return (z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * dof ** 3))


def fieller_interval(num: float, den: float, v_num: float, v_den: float, cov: float,
                     q: float) -> tuple[float, float | None]:
    """Fieller's interval (Fieller 1954, JRSS B 16(2):175-185) for the ratio num/den of two
    estimates with variances ``v_num``, ``v_den`` and covariance ``cov``, at quantile ``q`` (1.645:
    90 % two-sided): the ρ with (num − ρ·den)² ≤ q²·Var(num − ρ·den). Returns (low, high), clipped
    at 0 below (a ratio of positive quantities); high is None where the set is open above (``den``
    not clearly above its error: q²·v_den ≥ den²), and low is then the smallest positive member."""
    a = den * den - q * q * v_den
    b = -2.0 * (num * den - q * q * cov)
    c = num * num - q * q * v_num
    disc = b * b - 4 * a * c
    if a > 0:  # a bounded interval around num/den (disc >= 0 whenever the variances are a covariance)
        root = math.sqrt(max(disc, 0.0))
        return max(0.0, (-b - root) / (2 * a)), max(0.0, (-b + root) / (2 * a))
    if disc <= 0 or a == 0:  # every ratio (or a one-sided set): nothing excluded
        return 0.0, None
    r1, r2 = sorted(((-b - math.sqrt(disc)) / (2 * a), (-b + math.sqrt(disc)) / (2 * a)))
    return (max(r2, 0.0) if r1 <= 0 else 0.0), None  # (-inf, r1] ∪ [r2, inf), positive part's hull


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

    def weight_sq(self) -> float:
        """Σ w_i² of the normalised weights w_i = β^(n−i)(1−β)/(1−β^n): (1−β)(1+β^n) / ((1+β)(1−β^n));
        1/Σw² is Kish's effective number of values (1 after one update, (1+β)/(1−β) in the limit)."""
        b, n = self.beta, self.n
        return (1 - b) * (1 + b ** n) / ((1 + b) * (1 - b ** n)) if n else 1.0


class CountSketch:
    """A linear sketch S: R^n -> R^m (m = min(``bins``, n)) with E|S x|² = |x|² for every x: the
    AMS / count-sketch second-moment estimator (Alon, Matias, Szegedy 1996, "The space complexity of
    approximating the frequency moments"; Charikar, Chen, Farach-Colton 2002): element i goes to
    bin i mod m with a random sign, so |S x|² = |x|² + Σ over pairs sharing a bin of ±2·x_i·x_j, whose
    signs average out; its variance is at most 2|x|⁴/m when no bin holds much of |x|². With
    n <= m it is exact. The signs come from a generator seeded with ``seed`` (the same on every rank:
    the sketch must be the same linear map everywhere), as a float buffer of the largest n + bins
    seen; call ``offset`` k (0 <= k < bins) reads the signs from position k, a fresh sketch
    (uncorrelated errors) for each k at no cost. Input: a 1-D tensor; output: fp32 [m], same device."""

    def __init__(self, bins: int = SKETCH_BINS, seed: int = 0) -> None:
        if bins < 1:
            raise ValueError(f"CountSketch: bins must be >= 1, got {bins}")
        self.bins, self.seed = bins, seed
        self._signs: torch.Tensor | None = None

    def _sign_buffer(self, n: int, device: torch.device) -> torch.Tensor:
        need = n + self.bins
        if self._signs is None or self._signs.numel() < need or self._signs.device != device:
            size = max(need, self._signs.numel() if self._signs is not None else 0)
            g = torch.Generator().manual_seed(self.seed)
            self._signs = (torch.randint(0, 2, (size,), generator=g, dtype=torch.int8) * 2 - 1).float().to(device)
        return self._signs

    def __call__(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        x = x.reshape(-1)
        n = x.numel()
        m = min(self.bins, n)
        k = offset % self.bins
        y = x.float() * self._sign_buffer(n, x.device)[k:k + n]
        full = n - n % m
        out = y[:full].view(-1, m).sum(0)
        if full < n:
            out[:n - full] += y[full:]
        return out


class NoiseScale(GradientObserver):
    """The simple gradient noise scale B_simple of a run, from the gradient collective.

    ``b_small`` and ``b_big``: the two batch sizes in sequences (``for_run`` derives them);
    ``ranks`` the data-parallel ranks, ``rank`` this one's place among them; ``kind`` where the two
    batches come from (``KINDS``). Per step, ``before`` sums the squared norm of every local bucket
    (``scale_small`` × the mean over ranks of the sum is |G_small|²); ``after`` that of this rank's
    share of every reduced bucket (kind "average": its 1/R slice of the replicas' average; "shard":
    its FSDP2 shard; ``scale_big`` × the sum over ranks is |G_big|²). Kind "params" (DDP) ignores
    both: ``local(name, grad)`` takes each parameter's local gradient on the synchronising backward
    and ``reduced_norm`` the step's clip norm of the averaged gradient (module docstring; a step
    without it, one the loop skipped before its clip, is not folded in: ``gns_sq_big`` None). Kind
    "sketch" (PowerSGD: the reduced bucket is the compressed one): ``before`` keeps a
    ``CountSketch`` of ``SKETCH_BINS`` bins of each local bucket instead and ``after`` is ignored.
    Kind "micro": the caller adds the micro-batches' norms itself (``add_small``, ``add_big``).
    ``count(n_masked_global)`` gives the step's masked tokens (``n_sequences`` per step) for the
    token unit. ``sideband``/``receive`` carry the step's sums through the caller's all-reduce.
    ``step_fields()`` returns the record fields:

    - ``b_simple``: tr(Σ)/|G|² from the two EMAs, in sequences (None while the |G|² EMA is <= 0);
    - ``b_simple_low``, ``b_simple_high``: its ``INTERVAL_LEVEL`` (90 %) Fieller interval from the
      steps' spread (module docstring; None before ``MIN_INTERVAL_STEPS`` steps; high None: open);
    - ``b_simple_tokens``: B_simple in masked tokens;
    - ``gns_grad_sq``, ``gns_trace_cov``: the EMAs of |G|² and tr(Σ);
    - ``gns_sq_small``, ``gns_sq_big``, ``gns_b_small``, ``gns_b_big``: this step's raw inputs;
      ``gns_sketch_bins``: the sketch's bins per bucket (None: exact norms).

    ``state_dict()``/``load_state_dict()``: the averages and the sketch's step count (a resumed run
    continues both)."""

    KINDS = ("params", "average", "shard", "sketch", "micro")
    """Where the two batches come from: DDP's parameters' local gradients and the clip norm of their
    average, the replicas' all-reduce (before, and its average after), FSDP2's reduce-scatter shard,
    a count sketch of DDP's local buckets (PowerSGD), the micro-batches."""

    def __init__(self, b_small: int, b_big: int, *, n_sequences: int | None = None, ranks: int = 1, rank: int = 0,
                 kind: str = "average", scale_small: float = 1.0, scale_big: float = 1.0) -> None:
        if not 0 < b_small < b_big:
            raise ValueError(f"NoiseScale: need 0 < b_small < b_big sequences, got {b_small} and {b_big}")
        if not 0 <= rank < ranks:
            raise ValueError(f"NoiseScale: rank must be in [0, ranks), got {rank} of {ranks}")
        if kind not in self.KINDS:
            raise ValueError(f"NoiseScale: kind must be one of {self.KINDS}, got {kind!r}")
        self.b_small, self.b_big, self.ranks, self.rank = b_small, b_big, ranks, rank
        self.kind, self.sharded, self.micro = kind, kind == "shard", kind == "micro"
        self.scale_small, self.scale_big = scale_small, scale_big
        self.n_sequences = n_sequences or b_big
        self.sketch = CountSketch(SKETCH_BINS) if kind == "sketch" else None
        self.means = {k: BiasCorrectedEMA(EMA_BETA) for k in ("g", "s", "gg", "ss", "gs")}  # per-step moments
        self.masked = BiasCorrectedEMA(EMA_BETA)
        self.steps = 0  # reset() calls: the sketch's offset, the same on every rank
        self.reset()

    @classmethod
    def for_run(cls, *, micro_batch_size: int, grad_accum_steps: int, dp: int, sharding: str,
                dp_rank: int | None = None, compression: str = "none", pp: int = 1) -> "NoiseScale | None":
        """The observer of a run of ``dp`` data-parallel replicas (``sharding``: "ddp", "zero1",
        "fsdp", "replicate"; "none" with one data-parallel rank; ``dp_rank`` this rank's place, default
        the process group's rank) and ``pp`` pipeline stages, or None where no two batch sizes exist:

        - FSDP2 at pp = 1 reduce-scatters every micro-batch: b against dp·b, k per step;
        - every other dp > 1 reduces once per step (DDP, the replicas' all-reduce, FSDP2 at the end
          of a pipeline step): b·k against dp·b·k; DDP ("ddp", "zero1") by its parameters' hooks
          and the clip norm (kind "params"), unless it sketches;
        - dp = 1 at pp = 1 with ``grad_accum_steps >= 2`` and no DDP (which keeps the gradients in
          its buckets): the micro-batches, b against b·k (``micro=True``);
        - otherwise (one micro-batch, or a pipeline's micro-batches inside its schedule): None.

        ``compression`` (``TrainConfig.parallel.grad_compression``): "powersgd" sketches the local
        buckets (class docstring); "none" and "bf16" use the reduced bucket (bf16's rounding moves its
        squared norm by ~2^-16 relative)."""
        b, k = micro_batch_size, grad_accum_steps
        rank = dp_rank if dp_rank is not None else (dist.get_rank() % dp if dist.is_initialized() and dp > 1 else 0)
        if dp > 1 and sharding == "fsdp" and pp == 1:  # one reduce-scatter per micro-batch: b against dp·b, k per step
            return cls(b, dp * b, n_sequences=dp * b * k, ranks=dp, rank=rank, kind="shard", scale_small=k,
                       scale_big=k)
        if dp > 1:
            kind = ("shard" if sharding == "fsdp" else "sketch" if compression == "powersgd"
                    else "params" if sharding in ("ddp", "zero1") else "average")
            return cls(b * k, dp * b * k, ranks=dp, rank=rank, kind=kind)
        if k >= 2 and pp == 1 and sharding not in ("ddp", "zero1"):  # G_small = k·d_j, G_big = Σ d_j
            return cls(b, b * k, n_sequences=b * k, scale_small=k, kind="micro")
        return None

    def reset(self) -> None:
        """Zero the step's sums (called before every step)."""
        self._small: Any = 0.0
        self._big: Any = 0.0
        self._masked: Any = None
        self._sketches: dict[int, torch.Tensor] = {}
        self._named: dict[str, torch.Tensor] = {}  # kind "params": parameter name -> its local gradient's norm
        self._reduced: float | None = None  # kind "params": the averaged gradient's squared norm (the clip's)
        self._received: torch.Tensor | None = None
        self.steps += 1

    def before(self, bucket_index: int, local: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add the (weighted: ``GradientObserver``) squared norm of this rank's local gradient bucket
        (before the reduction), or, sketching, keep the bucket's sketch (kind "params": nothing)."""
        if self.kind == "params":
            return
        if self.sketch is not None:
            s = self.sketch(local, offset=self.steps * 2654435761 + 977 * bucket_index)  # fresh per step and bucket
            self._sketches[bucket_index] = s
            self.add_small(squared_norm(s))
        else:
            self.add_small(squared_norm(local, weights))

    def after(self, bucket_index: int, reduced: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add the (weighted) squared norm of this rank's share of the reduced bucket: the FSDP2 shard,
        or its 1/R slice of the replicas' average (kinds "params" and "sketch": nothing)."""
        if self.kind in ("params", "sketch"):
            return
        if not self.sharded and self.ranks > 1:
            n = reduced.numel()
            lo, hi = self.rank * n // self.ranks, (self.rank + 1) * n // self.ranks
            reduced = reduced.reshape(-1)[lo:hi]
            weights = None if weights is None else weights.reshape(-1)[lo:hi]  # per element: the replicas' flat
        self.add_big(squared_norm(reduced, weights))

    def local(self, name: str, grad: torch.Tensor) -> None:
        """Kind "params": parameter ``name``'s local gradient on the step's synchronising backward (its
        post-accumulate-grad hook, before DDP averages it); its norm is kept by name, and the squares
        are summed in the order of the names in ``sideband``. Other kinds: nothing."""
        if self.kind == "params":  # the norm (squared in sideband, all at once: the same bits, one op)
            self._named[name] = torch.linalg.vector_norm(grad, dtype=torch.float32)

    def reduced_norm(self, norm: float, loss_scale: float = 1.0) -> None:
        """Kind "params": the L2 norm of the step's averaged gradient (the clip's, unscaled) and the
        fp16 loss scale the local gradients carry (1.0 otherwise): |G_big|² = (norm·loss_scale)², in
        the local norms' units. A step without it is not folded in. Other kinds: nothing."""
        if self.kind == "params":
            self._reduced = (norm * loss_scale) ** 2

    def add_small(self, sq: torch.Tensor | float) -> None:
        """Add a squared norm (0-d tensor or float) to the step's local (small-batch) sum."""
        self._small = self._small + sq

    def add_big(self, sq: torch.Tensor | float) -> None:
        """Add a squared norm to the step's reduced (big-batch) sum."""
        self._big = self._big + sq

    def count(self, n_masked_global: torch.Tensor | int) -> None:
        """The step's masked tokens over all ranks (a tensor is read only in ``step_fields``)."""
        self._masked = n_masked_global

    def sideband(self, device: torch.device) -> torch.Tensor:
        """The step's sums to add up over the ranks, float64 on ``device``: [Σ local squared norms,
        Σ this rank's share of the reduced squared norms, *the buckets' sketches in bucket order]."""
        small = self._small
        if self._named:  # in the order of the names: the same bits whatever the hooks' order
            small = small + torch.stack([self._named[n] for n in sorted(self._named)]).square().sum()
        sums = [v.reshape(1) if isinstance(v, torch.Tensor) else torch.tensor([float(v)]) for v in (small, self._big)]
        sketches = [self._sketches[i] for i in sorted(self._sketches)]
        return torch.cat([v.to(device=device, dtype=torch.float64) for v in [*sums, *sketches]])

    def receive(self, summed: torch.Tensor) -> None:
        """The sideband summed over the ranks (``sideband``'s layout)."""
        self._received = summed

    def step_fields(self) -> dict[str, Any]:
        """Fold in this step and return the record fields (class docstring). Without ``receive``
        this step, all-reduces the sideband itself over the world (every rank's piece: its dp
        replica, tp slice, pipeline stage). A step with a non-finite norm is not folded in."""
        summed = self._received
        if summed is None:
            summed = self.sideband(self._device())
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        summed = summed.cpu()
        sq_small = float(summed[0]) / self.ranks * self.scale_small
        if self.sketch is not None:  # |mean over ranks of the sketches|²
            sq_big = float(summed[2:].square().sum()) / self.ranks ** 2 * self.scale_big
        elif self.kind == "params":  # every rank holds the whole average: its clip norm
            sq_big = math.nan if self._reduced is None else self._reduced * self.scale_big
        else:
            sq_big = float(summed[1]) * self.scale_big
        fields: dict[str, Any] = {"gns_sq_small": sq_small, "gns_sq_big": None if math.isnan(sq_big) else sq_big,
                                  "gns_b_small": self.b_small, "gns_b_big": self.b_big,
                                  "gns_sketch_bins": self.sketch.bins if self.sketch else None}
        if math.isfinite(sq_small) and math.isfinite(sq_big) and (sq_small or sq_big):
            g2, trace = two_batch_estimates(sq_small, sq_big, self.b_small, self.b_big)
            for key, v in (("g", g2), ("s", trace), ("gg", g2 * g2), ("ss", trace * trace), ("gs", g2 * trace)):
                self.means[key].update(v)
            if self._masked is not None:
                self.masked.update(float(self._masked) / self.n_sequences)
        g2, trace, per_seq = self.means["g"].get(), self.means["s"].get(), self.masked.get()
        b_simple = trace / g2 if g2 is not None and trace is not None and g2 > 0 else None
        low, high = self.interval()
        return fields | {"gns_grad_sq": g2, "gns_trace_cov": trace, "b_simple": b_simple,
                         "b_simple_low": low, "b_simple_high": high,
                         "b_simple_tokens": b_simple * per_seq if b_simple is not None and per_seq else None}

    def interval(self, level: float = INTERVAL_LEVEL) -> tuple[float | None, float | None]:
        """(low, high) of B_simple at two-sided ``level`` (module docstring; ``fieller_interval``
        with the t quantile at Kish's n_eff − 1 degrees of freedom); (None, None) before
        ``MIN_INTERVAL_STEPS`` steps."""
        m = {k: e.get() for k, e in self.means.items()}
        n = self.means["g"].n
        if n < MIN_INTERVAL_STEPS:
            return None, None
        w2 = self.means["g"].weight_sq()  # Var(weighted mean) = Σw² · (weighted variance, unbiased)
        scale = w2 / (1.0 - w2)
        v_g = max(m["gg"] - m["g"] ** 2, 0.0) * scale
        v_s = max(m["ss"] - m["s"] ** 2, 0.0) * scale
        cov = (m["gs"] - m["g"] * m["s"]) * scale
        q = t_quantile(0.5 + level / 2, 1.0 / w2 - 1.0)
        return fieller_interval(m["s"], m["g"], v_s, v_g, cov, q)

    def _device(self) -> torch.device:
        for v in (self._small, self._big, *self._named.values()):
            if isinstance(v, torch.Tensor):
                return v.device
        return torch.device("cpu")

    def state_dict(self) -> dict[str, Any]:
        """The averages and the step count, plain Python numbers (torch.save/JSON-able)."""
        return {"means": {k: [e.value, e.n] for k, e in self.means.items()},
                "masked": [self.masked.value, self.masked.n], "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s output; ValueError naming a missing field."""
        for key in ("means", "masked", "steps"):
            if key not in state:
                raise ValueError(f"NoiseScale.load_state_dict: missing {key!r}")
        for k, e in self.means.items():
            if k not in state["means"]:
                raise ValueError(f"NoiseScale.load_state_dict: missing means[{k!r}]")
            e.value, e.n = float(state["means"][k][0]), int(state["means"][k][1])
        self.masked.value, self.masked.n = float(state["masked"][0]), int(state["masked"][1])
        self.steps = int(state["steps"])
