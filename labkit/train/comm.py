"""Timing of the gradient collectives of a step: what ``comm_exposed_s`` is measured from.

``time_gradient_collectives(model, device)`` installs a ``CommTimer`` on a model wrapped by
``labkit.train.parallel.build``: for DDP (ddp, zero1) a comm hook around torch's default
averaging all-reduce (the same collective DDP runs without a hook), for FSDP2 (fsdp) a timed
reduce-scatter on every ``FSDPModule``; a split run (``labkit.train.runtime.Runtime``) times its dp
collectives the same way: ``time_reduce_scatters`` on its stages' FSDP2 modules, or
``timed_all_reduce`` for the replicas' gradient mean. ``labkit.measure.StepTimer(device, comm=timer)`` resets
it per step and turns its records into ``comm_exposed_s`` (``labkit.measure.comm_exposed_s``,
docs/measurement.md). Tests: tests/train/test_dist.py (every record of 2-rank ddp, zero1 and
fsdp runs), tests/study/test_scaling.py (the overlap model against it).

DDP takes ONE comm hook (a second ``register_comm_hook`` raises), so the timing, the gradient
compression and any per-bucket statistics are one composed hook (``_composed_hook``):

    observers.before(bucket)  ->  timer start  ->  reduce(state, bucket)  ->  timer end  ->  observers.after

``reduce`` is a torch DDP comm hook (``default_hooks.allreduce_hook`` unless a compression is
chosen); ``wire_bytes(bucket)`` is the number of bytes that hook puts on the wire for the bucket
(the timer records it). Observers (``GradientObserver``) see each bucket's local gradient before
the reduction and the averaged one after; FSDP2 gives them the reduce-scatter's input (this rank's
unsharded gradients) and output shard. (The noise scale under DDP reads each parameter's
gradient in the backward instead, while it is still in cache, and the step's clip norm:
``labkit.train.gns``; under PowerSGD it sketches the buckets here.) ``CommTimer.step_fields()``
gathers what the observers add to a metrics record, once per step, on every rank. An observer that needs sums over the ranks
(the noise scale's) adds no collective of its own: ``CommTimer.sideband(device)`` concatenates
the observers' per-step vectors, the training loop sums them over the ranks inside the step's
all-reduce of the loss (``all_reduce_with_sideband``, called by ``labkit.train.loop``), and
``CommTimer.receive(summed)`` hands each observer its part back before ``step_fields`` (an
observer not given its sums all-reduces them there itself).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.train.dist import is_fsdp

__all__ = [
    "CommTimer", "all_reduce_with_sideband", "fully_shard_world", "time_gradient_collectives", "GradientObserver",
    "HookState", "compression_hook", "install_ddp_hook", "powersgd_wire_bytes", "time_reduce_scatters",
    "timed_all_reduce"
]


class GradientObserver:
    """Per-bucket statistics taken inside the gradient collective (the base class does nothing).

    ``before(bucket_index, local, weights)`` gets this rank's flattened gradient bucket (a 1-D tensor,
    the gradient of the local batch, before any division); ``after(bucket_index, reduced, weights)``
    gets the averaged bucket (DDP, the replicas' all-reduce) or this rank's reduce-scatter shard
    (FSDP2, ``sharded=True``). ``weights``: None, or a 1-D fp32 tensor whose length divides the
    bucket's, one weight per element of each of its rows (``local.view(-1, len(weights))``): the
    share of the element's value this rank counts when the other ranks of its tp group hold the same
    value (1/tp for a tensor-parallel run's replicated parameters; ``labkit.train.runtime``). Both run
    on the communication path: keep them to a few device ops (no host sync on CUDA).
    ``step_fields()`` is called once per optimiser step on every rank, after the step, and returns
    the fields it adds to the metrics record; ``reset()`` is called before each step.
    ``sideband(device)``: a 1-D float64 tensor on ``device`` (or None) that the caller sums over every
    rank once per step, after the backward, inside a collective it makes anyway, and returns through
    ``receive(summed)`` before ``step_fields`` (which all-reduces the sideband itself only when
    nothing was received)."""

    sharded = False

    def before(self, bucket_index: int, local: torch.Tensor, weights: torch.Tensor | None = None) -> None:  # noqa: D102
        return None

    def after(self, bucket_index: int, reduced: torch.Tensor,  # noqa: D102
              weights: torch.Tensor | None = None) -> None:
        return None

    def reset(self) -> None:  # noqa: D102
        return None

    def step_fields(self) -> dict[str, Any]:  # noqa: D102
        return {}

    def sideband(self, device: torch.device) -> torch.Tensor | None:  # noqa: D102
        return None

    def receive(self, summed: torch.Tensor) -> None:  # noqa: D102
        return None


class CommTimer:
    """Start and end of every gradient collective of one optimiser step, for
    ``labkit.measure.comm_exposed_s``. ``time_gradient_collectives`` installs it.

    On CPU the clock is ``time.perf_counter`` read when a collective is launched and in its
    completion callback. On CUDA it is ``torch.cuda.Event`` objects recorded on the launching stream
    (after the gradient kernels) and on the stream the completion runs on, read after the step
    synchronised (``StepTimer.stop``). ``blocking``: the collectives run on the backward thread
    and stall it (FSDP2 on CPU)."""

    def __init__(self, device: torch.device, *, blocking: bool = False,
                 observers: tuple[GradientObserver, ...] | list[GradientObserver] = ()) -> None:
        self.device, self.blocking = device, blocking
        self.observers = list(observers)
        self._records: list[tuple[Any, Any, int]] = []
        self._sideband: list[tuple[GradientObserver, int]] = []

    def now(self) -> Any:
        """A time stamp: seconds (CPU) or a recorded CUDA event."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        import time

        return time.perf_counter()

    def add(self, start: Any, end: Any, nbytes: int) -> None:
        """Record one collective of ``nbytes`` bytes (called from the communication thread)."""
        self._records.append((start, end, nbytes))

    def reset(self) -> None:
        """Forget the last step's collectives (call before the step); resets the observers."""
        self._records = []
        for observer in self.observers:
            observer.reset()

    def sent_bytes(self) -> int:
        """Bytes the step's gradient collectives put on the wire (after any compression), summed
        over the collectives this rank launched."""
        return sum(n for _, _, n in self._records)

    def step_fields(self) -> dict[str, Any]:
        """What the step adds to its metrics record: ``comm_bytes`` (``sent_bytes``),
        ``comm_bucket_bytes`` (each collective's bytes in launch order: DDP's buckets, the last one
        holding the word embedding; ``labkit.study.scaling.link_step_time`` models them) and each
        observer's ``step_fields()``. Collective when an observer's is (it received no sideband):
        call on every rank."""
        fields: dict[str, Any] = {"comm_bytes": self.sent_bytes(),
                                  "comm_bucket_bytes": [c["bytes"] for c in self.collectives()]}
        for observer in self.observers:
            fields |= observer.step_fields()
        return fields

    def sideband(self, device: torch.device) -> torch.Tensor:
        """The observers' per-step vectors to sum over the ranks (``GradientObserver.sideband``),
        concatenated: float64 [n] on ``device``, empty when none has any. Call on every rank after
        the backward, sum the result over all ranks within the step's own all-reduce, then pass it
        to ``receive``."""
        parts = [(o, o.sideband(device)) for o in self.observers]
        self._sideband = [(o, v.numel()) for o, v in parts if v is not None]
        return torch.cat([torch.zeros(0, dtype=torch.float64, device=device),
                          *[v.to(torch.float64) for _, v in parts if v is not None]])

    def receive(self, summed: torch.Tensor) -> None:
        """``sideband``'s vector summed over the ranks: each observer gets its slice."""
        start = 0
        for observer, n in self._sideband:
            observer.receive(summed[start:start + n])
            start += n

    def collectives(self) -> list[dict[str, float]]:
        """[{"start_s", "end_s", "bytes"}] of the step, in launch order; times in seconds from the
        first launch. On CUDA the step must have been synchronised."""
        if not self._records:
            return []
        if self.device.type == "cuda":  # events: in the order they were recorded
            ref = self._records[0][0]
            seconds = [(ref.elapsed_time(a) / 1e3, ref.elapsed_time(b) / 1e3, n) for a, b, n in self._records]
        else:
            records = sorted(self._records, key=lambda r: r[0])
            seconds = [(a - records[0][0], b - records[0][0], n) for a, b, n in records]
        return [{"start_s": a, "end_s": b, "bytes": n} for a, b, n in seconds]

    def exposed_s(self) -> float:
        """``labkit.measure.comm_exposed_s`` of the step's collectives (0.0 when there were none)."""
        from labkit.measure import comm_exposed_s

        return comm_exposed_s([(c["start_s"], c["end_s"]) for c in self.collectives()], blocking=self.blocking)


class HookState:
    """The composed DDP comm hook's state: the ``timer``, the inner ``reduce`` hook and its own
    ``reduce_state`` (e.g. a ``PowerSGDState``; None for the default all-reduce),
    ``wire_bytes(bucket) -> int`` (bytes the inner hook sends for the bucket), ``names`` (parameter ->
    name) and, for PowerSGD with names, ``named``: its state by parameter name
    (``labkit.train.powersgd.NamedPowerSGD``, what a checkpoint keeps; None otherwise)."""

    def __init__(self, timer: CommTimer, reduce: Any = None, reduce_state: Any = None, wire_bytes: Any = None,
                 names: dict[torch.nn.Parameter, str] | None = None) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        from labkit.train.powersgd import NamedPowerSGD

        self.timer, self.reduce, self.reduce_state, self.names = timer, reduce or allreduce_hook, reduce_state, names
        self.wire_bytes = wire_bytes or (lambda bucket: bucket.buffer().numel() * bucket.buffer().element_size())
        self.named = NamedPowerSGD(reduce_state, names) if isinstance(reduce_state, PowerSGDState) and names else None

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's hook state to checkpoint (``NamedPowerSGD.state_dict``), None without one."""
        return self.named.state_dict() if self.named is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s output (ValueError when this hook keeps no state)."""
        if self.named is None:
            raise ValueError("grad_compression: the checkpoint holds PowerSGD's state, this run's hook keeps none")
        self.named.load_state_dict(state)


def all_reduce_with_sideband(values: torch.Tensor, timer: CommTimer | None) -> torch.Tensor:
    """Sum ``values`` (float64 [n]) over all ranks in ONE all-reduce together with ``timer``'s
    sideband (``CommTimer.sideband``: the observers' per-step sums), hand the summed sideband back
    to the observers (``CommTimer.receive``) and return the summed ``values``. The training loop's
    step all-reduce of the loss; identity without a process group (the observers still get theirs)."""
    extra = timer.sideband(values.device) if timer is not None else values.new_zeros(0)
    both = torch.cat([values, extra])
    if dist.is_initialized():
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    if timer is not None:
        timer.receive(both[values.numel():])
    return both[:values.numel()]


def _composed_hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
    """DDP comm hook (state: HookState, bucket: dist.GradBucket -> Future): the observers see the
    local bucket, then the inner ``reduce`` hook runs (torch's default averaging all-reduce,
    ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``, unless a
    compression hook was chosen) with its launch and completion timed, then the observers see the
    averaged bucket."""
    timer, index = state.timer, bucket.index()
    if state.named is not None:  # PowerSGD's state follows the bucket's parameters (labkit.train.powersgd)
        state.named.prepare(bucket)
    for observer in timer.observers:
        observer.before(index, bucket.buffer())
    start, nbytes = timer.now(), state.wire_bytes(bucket)

    def done(fut: torch.futures.Future) -> torch.Tensor:
        timer.add(start, timer.now(), nbytes)
        reduced = fut.value()
        for observer in timer.observers:
            observer.after(index, reduced)
        return reduced

    return state.reduce(state.reduce_state, bucket).then(done)


def _timed_reduce_scatter(timer: CommTimer, weights: dict[int, torch.Tensor]) -> Any:
    """FSDP2's default reduce-scatter with its call timed (FSDP2 calls it synchronously, on the
    reduce-scatter stream on CUDA, on the backward thread on CPU); the observers see its input and
    output with the row ``weights`` of the parameter group whose input has that many elements
    (``weights``: {input numel: row weights}; none: every weight 1). The comm interface lives in the
    private module ``torch.distributed.fsdp._fully_shard._fsdp_collectives`` (torch 2.13);
    ``FSDPModule.set_custom_reduce_scatter`` is public."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001
            w = weights.get(input_tensor.numel())
            for observer in timer.observers:
                observer.before(0, input_tensor, w)
            start = timer.now()
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)  # FSDP2: async_op False
            timer.add(start, timer.now(), input_tensor.numel() * input_tensor.element_size())
            for observer in timer.observers:
                observer.after(0, output_tensor, w)
            return work

    return TimedReduceScatter()


def _row_weights(module: FSDPModule, weights: dict[torch.nn.Parameter, float] | None,
                 world: int) -> dict[int, torch.Tensor]:
    """{reduce-scatter input numel: the weights of one row} of each FSDP2 parameter group of
    ``module`` whose parameters do not all weigh 1 (``weights``: parameter -> weight, absent = 1).
    FSDP2 lays the input out as ``world`` rows, each the concatenation of every parameter's dim-0
    chunk padded to its sharded size (``foreach_reduce_scatter_copy_in``: ``chunk_cat``), so a row's
    weights repeat each parameter's weight over its padded sharded numel (``FSDPParam``, torch 2.13)."""
    from torch.distributed.fsdp import fully_shard

    out: dict[int, torch.Tensor] = {}
    if not weights:
        return out
    for group in fully_shard.state(module)._fsdp_param_groups:
        sizes = [(weights.get(fp.sharded_param, 1.0), fp.padded_sharded_param_size.numel()) for fp in group.fsdp_params]
        if all(w == 1.0 for w, _ in sizes):
            continue
        row = torch.cat([torch.full((n,), w, dtype=torch.float32) for w, n in sizes])
        out[world * row.numel()] = row.to(group.device)
    return out


def time_gradient_collectives(model: torch.nn.Module, device: torch.device, *, reduce: Any = None,
                              reduce_state: Any = None, wire_bytes: Any = None,
                              observers: tuple[GradientObserver, ...] | list[GradientObserver] = ()
                              ) -> CommTimer | None:
    """Install a ``CommTimer`` on the gradient collectives of one data-parallel ``model`` and return
    it (None without a process group): DDP's one comm hook, composed (``_composed_hook``: the
    observers, the timing, the inner ``reduce`` hook with ``reduce_state``, torch's default
    all-reduce when None), for ddp and zero1; or a timed reduce-scatter on every FSDP2 module
    (fsdp; blocking on CPU, where FSDP2 runs it on the backward thread; ``reduce`` must be None
    there: ValueError). Call once, after wrapping and before the first step. A run's step
    (``labkit.train.runtime.Runtime``) installs its own through ``install_ddp_hook`` and
    ``time_reduce_scatters``."""
    if not dist.is_initialized():
        return None
    if is_fsdp(model):
        if reduce is not None:
            raise ValueError("grad_compression: a compression hook applies to DDP (ddp, zero1), not to FSDP2's "
                             "reduce-scatter")
        timer = CommTimer(device, blocking=device.type != "cuda", observers=observers)
        time_reduce_scatters(model.modules(), timer)
        return timer
    if isinstance(model, DDP):
        timer = CommTimer(device, observers=observers)
        install_ddp_hook(model, timer, reduce, reduce_state, wire_bytes)
        return timer
    return None


def install_ddp_hook(model: DDP, timer: CommTimer, reduce: Any = None, reduce_state: Any = None,
                     wire_bytes: Any = None, names: dict[torch.nn.Parameter, str] | None = None) -> HookState:
    """Register DDP's one comm hook on ``model``: ``_composed_hook`` with ``timer`` (its observers)
    around the inner ``reduce`` hook (``compression_hook``'s triple; None: torch's averaging
    all-reduce); ``names`` (parameter -> name) keeps PowerSGD's state by name. Returns the hook's state."""
    state = HookState(timer, reduce, reduce_state, wire_bytes, names)
    model.register_comm_hook(state, _composed_hook)
    return state


def time_reduce_scatters(modules: Any, timer: CommTimer, weights: dict[torch.nn.Parameter, float] | None = None) -> int:
    """Give every FSDP2 module among ``modules`` (an iterable of modules) the reduce-scatter timed
    by ``timer`` (``_timed_reduce_scatter``: FSDP2's default, with the observers around it, each
    group's elements weighted by ``weights``: parameter -> weight, ``_row_weights``); returns how
    many there were. ``labkit.train.runtime`` calls it on every stage's modules, which FSDP2 shards
    over the dp mesh."""
    count = 0
    for module in modules:
        if isinstance(module, FSDPModule):
            world = fully_shard_world(module)
            module.set_custom_reduce_scatter(_timed_reduce_scatter(timer, _row_weights(module, weights, world)))
            count += 1
    return count


def fully_shard_world(module: FSDPModule) -> int:
    """The number of ranks FSDP2 shards ``module`` over (its dp mesh's size)."""
    from torch.distributed.fsdp import fully_shard

    groups = fully_shard.state(module)._fsdp_param_groups
    return groups[0].mesh_info.shard_mesh_size if groups else 1


def timed_all_reduce(timer: CommTimer | None, flat: torch.Tensor, group: Any, divide_by: int, *,
                     weights: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """All-reduce the flat gradient ``flat`` over ``group`` in place and divide it by
    ``divide_by`` (the replicas' mean), as one timed collective of ``timer`` (None: untimed) with its
    observers before (the local gradient) and after (the mean), ``weights`` per element
    (``GradientObserver``). ``dtype`` (bfloat16: ``grad_compression="bf16"``): the wire carries
    ``flat`` cast to it, summed in it and cast back (torch's ``bf16_compress_hook`` does the same for
    DDP). The data-parallel gradient reduction of ``sharding="replicate"``, which runs on the calling
    thread after the backward (make that timer ``blocking``). Returns ``flat``."""
    observers = timer.observers if timer is not None else []
    for observer in observers:
        observer.before(0, flat, weights)
    start = timer.now() if timer is not None else None
    wire = flat if dtype is None else flat.to(dtype)
    dist.all_reduce(wire, group=group)
    if wire is not flat:
        flat.copy_(wire)
    if timer is not None:
        timer.add(start, timer.now(), wire.numel() * wire.element_size())
    flat /= divide_by
    for observer in observers:
        observer.after(0, flat, weights)
    return flat


def powersgd_wire_bytes(state: Any, bucket: Any) -> int:
    """Bytes torch's ``powerSGD_hook`` puts on the wire for ``bucket`` at ``state.iter`` (a
    ``PowerSGDState``): the whole fp32 bucket during the ``start_powerSGD_iter`` warm-up steps, then
    the uncompressed tensors (vectors, and matrices whose rank-r factors would not be
    ``min_compression_rate`` times smaller) plus P (n x r) and Q (m x r) of each compressed n x m
    matrix, r = min(n, m, rank). The same split as ``powerSGD_hook``
    (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, Step I), so the count follows
    torch's rule, not a copy of the compression."""
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        return buffer.numel() * buffer.element_size()
    elements = 0
    for tensor in bucket.gradients():
        n = tensor.shape[0] if tensor.dim() else 1
        m = tensor.numel() // max(n, 1)
        r = min(n, m, state.matrix_approximation_rank)
        elements += (n + m) * r if (n + m) * r * state.min_compression_rate < n * m else n * m
    return elements * buffer.element_size()


def compression_hook(cfg: Any, process_group: Any = None) -> tuple[Any, Any, Any]:
    """The inner ``reduce`` hook of ``time_gradient_collectives`` for ``cfg.parallel.grad_compression``
    (a ``TrainConfig``): ``(reduce, reduce_state, wire_bytes)``.

    - "none": (None, None, None): torch's default averaging all-reduce of the fp32 bucket;
    - "bf16": torch's ``default_hooks.bf16_compress_hook`` with ``process_group`` as its state (None:
      the default group); each bucket is cast to bfloat16, all-reduced, divided by the world size
      and cast back, so the wire carries 2 bytes per gradient element;
    - "powersgd": torch's ``powerSGD_hook.powerSGD_hook`` with a ``PowerSGDState(process_group,
      matrix_approximation_rank=cfg.parallel.powersgd_rank,
      start_powerSGD_iter=cfg.parallel.powersgd_start_iter)``
      (error feedback and warm start on, torch's defaults; Vogels et al. 2019, arXiv:1905.13727),
      bytes from ``powersgd_wire_bytes``.

    Without a process group (one process) there is nothing to reduce: (None, None, None). Raises
    ValueError for another value (TrainConfig refuses it first)."""
    kind = cfg.parallel.grad_compression
    if kind == "none" or not dist.is_initialized():
        return None, None, None
    if kind == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        return bf16_compress_hook, process_group, lambda bucket: bucket.buffer().numel() * 2
    if kind == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group, matrix_approximation_rank=cfg.parallel.powersgd_rank,
                                   start_powerSGD_iter=cfg.parallel.powersgd_start_iter)
        return psgd.powerSGD_hook, state, lambda bucket: powersgd_wire_bytes(state, bucket)
    raise ValueError(f"grad_compression: unknown {kind!r}; choose 'none', 'bf16' or 'powersgd'")

