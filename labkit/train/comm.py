"""Timing of the gradient collectives of a step: what ``comm_exposed_s`` is measured from.

``time_gradient_collectives(model, device)`` installs a ``CommTimer`` on a model wrapped by
``labkit.train.dist.wrap_model``: for DDP (ddp, zero1) a comm hook around torch's default
averaging all-reduce (the same collective DDP runs without a hook), for FSDP2 (fsdp) a timed
reduce-scatter on every ``FSDPModule``. ``labkit.measure.StepTimer(device, comm=timer)`` resets
it per step and turns its records into ``comm_exposed_s`` (``labkit.measure.comm_exposed_s``,
docs/measurement.md). Tests: tests/train/test_dist.py (every record of 2-rank ddp, zero1 and
fsdp runs), tests/study/test_scaling.py (the overlap model against it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.train.dist import is_fsdp

__all__ = ["CommTimer", "time_gradient_collectives"]


class CommTimer:
    """Start and end of every gradient collective of one optimiser step, for
    ``labkit.measure.comm_exposed_s``. ``time_gradient_collectives`` installs it.

    On CPU the clock is ``time.perf_counter`` read when a collective is launched and in its
    completion callback. On CUDA it is ``torch.cuda.Event``\ s recorded on the launching stream
    (after the gradient kernels) and on the stream the completion runs on, read after the step
    synchronised (``StepTimer.stop``). ``blocking``: the collectives run on the backward thread
    and stall it (FSDP2 on CPU)."""

    def __init__(self, device: torch.device, *, blocking: bool = False) -> None:
        self.device, self.blocking = device, blocking
        self._records: list[tuple[Any, Any, int]] = []

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
        """Forget the last step's collectives (call before the step)."""
        self._records = []

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


def _timed_allreduce_hook(timer, bucket):  # no annotations: DDP checks them against dist.GradBucket
    """DDP comm hook (timer: CommTimer, bucket: dist.GradBucket -> Future): torch's default averaging all-reduce
    (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``, the same
    division by the world size, then ``all_reduce``), with its launch and completion timed."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    start, buffer = timer.now(), bucket.buffer()
    nbytes = buffer.numel() * buffer.element_size()

    def done(fut: torch.futures.Future) -> torch.Tensor:
        timer.add(start, timer.now(), nbytes)
        return fut.value()

    return allreduce_hook(None, bucket).then(done)


def _timed_reduce_scatter(timer: CommTimer) -> Any:
    """FSDP2's default reduce-scatter with its call timed (FSDP2 calls it synchronously, on the
    reduce-scatter stream on CUDA, on the backward thread on CPU). The comm interface lives in
    the private module ``torch.distributed.fsdp._fully_shard._fsdp_collectives`` (torch 2.13);
    ``FSDPModule.set_custom_reduce_scatter`` is public."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001
            start = timer.now()
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)  # FSDP2: async_op False
            timer.add(start, timer.now(), input_tensor.numel() * input_tensor.element_size())
            return work

    return TimedReduceScatter()


def time_gradient_collectives(model: torch.nn.Module, device: torch.device) -> CommTimer | None:
    """Install a ``CommTimer`` on the gradient collectives of a wrapped ``model`` and return it
    (None without a process group): a DDP comm hook around the default all-reduce (ddp, zero1),
    or a timed reduce-scatter on every FSDP2 module (fsdp; blocking on CPU, where FSDP2 runs it
    on the backward thread). Call once, after ``wrap_model`` and before the first step."""
    if not dist.is_initialized():
        return None
    if is_fsdp(model):
        timer = CommTimer(device, blocking=device.type != "cuda")
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(_timed_reduce_scatter(timer))
        return timer
    if isinstance(model, DDP):
        timer = CommTimer(device)
        model.register_comm_hook(timer, _timed_allreduce_hook)
        return timer
    return None
