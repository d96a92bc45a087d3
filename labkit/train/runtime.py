"""One runtime for every run: the step, the gradient clip and the per-step measures over a (pp, dp, tp) mesh.

Every run is a (pp, dp, tp) mesh (``labkit.config.split.Split``, tp innermost); data parallelism
alone is pp = tp = 1, dp = world. ``Runtime`` is built for every run once its model is wrapped,
and ``labkit.train.loop`` calls it the same way whatever the split (torchtitan's one
``train_step``, ``pytorch/torchtitan: torchtitan/train.py``):

- ``forward_backward(micro_batches)``: one optimiser step's forwards and backwards, the masked
  tokens counted over the dp group once first. Data parallel alone: ``forward_backward`` below
  (DDP, the study's setting, or FSDP2 / ZeRO-1). Tensor or pipeline parallel: the split model's
  (``labkit.train.parallel.ParallelModel``: the pipeline schedule, tp-split stages, FSDP2 or
  replicas over dp).
- ``clip_grad_norm(max_norm)``: ``labkit.train.clip.clip_grad_norm_`` over every parameter, counted
  once across tp, dp and pp (DTensor shards, plain replicas, the tied embedding's two stages).
- ``comm``: the ``labkit.train.comm.CommTimer`` of the gradient collectives over dp, in every mode:
  DDP's composed comm hook, FSDP2's timed reduce-scatter (data parallel alone, or on the dp mesh of
  a split run), or the replicas' timed all-reduce (``sharding="replicate"``). ``StepTimer(comm=...)``
  turns it into ``comm_exposed_s``; a split run without dp > 1 has no such collective (0.0).
- ``step_measures(step_timer)``: collective, once per step on every rank: ``comm_exposed_s``,
  ``pipeline_bubble`` and ``tp_comm_s`` (None where the run is not split that way), and the comm
  timer's fields (``comm_bytes``, its observers': the gradient noise scale, ``labkit.train.gns``,
  in every data-parallel run, from the micro-batches in one process). Peak memory is ``labkit.measure.PeakWindows``',
  the same in every mode.
- ``dp``, ``dp_rank``: the data follows the dp rank (sampler, held-out set, global batch).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from labkit.config import TrainConfig
from labkit.measure import StepTimer
from labkit.train import dist, gns
from labkit.train.clip import clip_grad_norm_, copies_of
from labkit.train.comm import (CommTimer, GradientObserver, compression_hook, time_gradient_collectives,
                               time_reduce_scatters)
from labkit.train.gns import NoiseScale
from labkit.train.parallel import ParallelModel, split_of

__all__ = ["Runtime", "forward_backward"]

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def forward_backward(model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], *,
                     world_size: int, precision: str = "fp32",
                     scaler: torch.amp.GradScaler | None = None,
                     noise: NoiseScale | None = None,
                     mark: Callable[[str], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accumulate the gradients of one optimiser step over ``micro_batches`` (this rank's), data
    parallel alone (``Runtime.forward_backward`` of such a run).

    Each batch holds input_ids int64[B,T], labels int64[B,T] (-100 = not masked) and
    attention_mask bool[B,T], on the model's device, and may hold what the host knew before the
    copy (``labkit.train.loop.to_device``): ``all_real`` (no [PAD]: the model gets no mask) and ``max_masked``
    (the sparse head's gather size), so the forward needs no host sync. The masked and real-token counts of all
    micro-batches on all ranks are all-reduced once before the forwards; gradient all-reduce
    (DDP) happens on the last micro-batch only (``no_sync`` on the others). Returns
    ``(loss_sum, n_masked_global, n_tokens_global)``: this rank's summed CE (fp32, detached),
    the global masked count and the global real-token count (int64).
    ``noise`` (``labkit.train.gns.NoiseScale``) is told the masked count; with ``noise.micro`` (one
    process) each micro-batch's gradient share goes to it (its squared norm before the next is
    added, the accumulation done here), then their sum. ``mark(phase)`` (``labkit.train.timeline.Timeline.mark``)
    is told when the count's all-reduce ("sync"), each forward and each backward end.
    """
    counts = torch.stack([torch.stack([(b["labels"] != -100).sum(), b["attention_mask"].sum()])
                          for b in micro_batches]).sum(0).to(torch.int64)
    dist.all_reduce_sum(counts)
    mark = mark or _no_mark
    mark("sync")
    n_masked_global, n_tokens_global = counts[0], counts[1]
    if noise is not None:
        noise.count(n_masked_global)
    micro = noise is not None and noise.micro and len(micro_batches) > 1
    acc: dict[torch.nn.Parameter, torch.Tensor] = {}
    dtype = AUTOCAST_DTYPES[precision]
    device_type = micro_batches[0]["input_ids"].device.type
    loss_sum = torch.zeros((), dtype=torch.float32, device=counts.device)
    for i, batch in enumerate(micro_batches):
        with dist.no_sync(model, sync=i == len(micro_batches) - 1):
            with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                mask = None if batch.get("all_real") else batch["attention_mask"]  # host facts: no sync
                out = model(batch["input_ids"], attention_mask=mask, labels=batch["labels"],
                            max_masked=batch.get("max_masked"))
            loss = out.loss_sum.float() * world_size / n_masked_global.clamp(min=1)
            mark("forward")
            (scaler.scale(loss) if scaler is not None else loss).backward()
            mark("backward")
        if micro:  # one process: micro-batch i's share of the gradient, summed here (gns.py)
            acc = _accumulate_micro(model, acc, noise, i, last=i == len(micro_batches) - 1)
        loss_sum += out.loss_sum.detach().float()
    return loss_sum, n_masked_global, n_tokens_global


def _no_mark(phase: str) -> None:
    return None


def _accumulate_micro(model: torch.nn.Module, acc: dict[torch.nn.Parameter, torch.Tensor], noise: NoiseScale,
                      i: int, *, last: bool) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Give ``noise`` the squared norm of micro-batch ``i``'s gradient (the .grad fields hold it
    alone), add it to ``acc`` (parameter -> running sum) and clear .grad; on the ``last`` put the
    sums back and give ``noise`` their squared norm."""
    fresh = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    noise.add_small(torch.stack([gns.squared_norm(g) for _, g in fresh]).sum())
    for p, g in fresh:
        if p in acc:
            acc[p].add_(g)
        else:
            acc[p] = g
        p.grad = None
    if last:
        for p, a in acc.items():
            p.grad = a
        noise.add_big(torch.stack([gns.squared_norm(a) for a in acc.values()]).sum())
    return acc


class Runtime:
    """The step machinery of one run on its (pp, dp, tp) mesh (module docstring).

    ``model``: the wrapped model (DDP, FSDP2 or plain for data parallel alone; a ``ParallelModel``
    otherwise), ``scaler`` the fp16 grad scaler (disabled: a pass-through), ``world`` and ``rank``
    this process's place (``split_of(cfg, world, rank)``: ValueError when tp x pp does not divide
    the world). ``observers``: ``labkit.train.comm.GradientObserver``\\ s inside the dp gradient
    collectives (every mode); ``reduce``, ``reduce_state``, ``wire_bytes``: DDP's inner comm hook
    (a compression; ``labkit.train.comm.time_gradient_collectives``; None: ``cfg.grad_compression``'s,
    ``labkit.train.comm.compression_hook``), for data parallelism alone
    (ValueError for a split run, whose dp reduction is FSDP2's or the replicas' all-reduce). Build it
    once, after wrapping and before the first step."""

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, scaler: Any, device: torch.device, *,
                 world: int, rank: int, observers: tuple[GradientObserver, ...] | list[GradientObserver] = (),
                 reduce: Any = None, reduce_state: Any = None, wire_bytes: Any = None):
        self.cfg, self.model, self.scaler, self.device, self.world = cfg, model, scaler, device, world
        self.mesh = split_of(cfg, world, rank)
        self.dp, self.dp_rank = self.mesh.dp, self.mesh.dp_rank
        self._split = model if isinstance(model, ParallelModel) else None
        self.noise: NoiseScale | None = None  # the gradient noise scale (labkit.train.gns), data parallel alone
        if self._split is None:
            sharding = cfg.sharding if torch.distributed.is_initialized() else "none"
            self.noise = NoiseScale.for_run(micro_batch_size=cfg.micro_batch_size, grad_accum_steps=cfg.grad_accum_steps,
                                            dp=self.dp, sharding=sharding, dp_rank=self.dp_rank,
                                            compression=cfg.grad_compression)
            if self.noise is not None and not self.noise.micro:  # an observer of the collective
                observers = [*observers, self.noise]
            if reduce is None:  # cfg.grad_compression's hook (torch's bf16 / PowerSGD; None: the plain all-reduce)
                reduce, reduce_state, wire_bytes = compression_hook(cfg)
            self.comm = time_gradient_collectives(model, device, reduce=reduce, reduce_state=reduce_state,
                                                  wire_bytes=wire_bytes, observers=observers)
            self._copies = [(p, copies_of(p, world)) for p in model.parameters()]
        else:
            if reduce is not None or getattr(cfg, "grad_compression", "none") != "none":
                raise ValueError("grad_compression: a compression hook applies to DDP (ddp, zero1), not to a "
                                 f"split run (tp {cfg.tp}, pp {cfg.pp})")
            self.comm = self._time_split(observers) if torch.distributed.is_initialized() else None
            self._copies = self._split.grad_copies()

    def _time_split(self, observers: Any) -> CommTimer:
        """The split model's dp collectives timed: FSDP2's reduce-scatters on its stages (blocking on
        CPU, where FSDP2 runs them on the backward thread), or the replicas' all-reduce after the
        backward (always blocking)."""
        blocking = self.device.type != "cuda" or self.cfg.sharding == "replicate"
        timer = CommTimer(self.device, blocking=blocking, observers=observers)
        time_reduce_scatters(self._split.dp_modules(), timer)
        self._split.dp_timer = timer
        return timer

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]],
                         mark: Callable[[str], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimiser step's forwards and backwards over this rank's ``micro_batches`` (the
        batches of its dp rank); returns (loss_sum: this rank's share, detached fp32, whose sum over
        all ranks is the global batch's summed CE; n_masked_global; n_tokens_global, int64). ``mark``: the
        timeline's phase clock (``forward_backward``; a split run's schedule is one "backward" mark)."""
        if self._split is not None:
            out = self._split.forward_backward(micro_batches, dtype=AUTOCAST_DTYPES[self.cfg.precision])
            if mark is not None:
                mark("backward")
            return out
        return forward_backward(self.model, micro_batches, world_size=self.world, precision=self.cfg.precision,
                                scaler=self.scaler, noise=self.noise, mark=mark)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Collective: clip every gradient to a global L2 norm of ``max_norm`` (``inf``: measure only)
        and return the norm before clipping (``labkit.train.clip.clip_grad_norm_``)."""
        return clip_grad_norm_(self._copies, max_norm)

    def step_measures(self, timer: StepTimer) -> dict[str, Any]:
        """Collective, once per step on every rank, after ``timer.stop()``: {"comm_exposed_s" (this
        rank's, ``timer.comm_exposed_s`` from ``comm``; 0.0 without dp collectives), "pipeline_bubble",
        "tp_comm_s" (``ParallelModel.take_measures``; None when not split that way), "comm_bytes" and
        the observers' fields (``CommTimer.step_fields``; absent without a process group)}."""
        split = self._split.take_measures() if self._split is not None else {"pipeline_bubble": None,
                                                                              "tp_comm_s": None}
        fields = self.comm.step_fields() if self.comm is not None else {}
        if self.noise is not None and self.noise.micro:  # one process: the noise scale from the micro-batches
            fields |= self.noise.step_fields()
            self.noise.reset()
        return {"comm_exposed_s": timer.comm_exposed_s, **split, **fields}
