"""The step of every run: one forward/backward body, the clip and the per-step measures.

``build_runtime(cfg, model, device)`` builds every run the same way (``labkit.train.parallel.build``
over the run's (pp, dp, tp) ``Mesh``) and returns its ``Runtime``, which ``labkit.train.loop`` calls
the same way whatever the split, as torchtitan's trainer does (``pytorch/torchtitan:
torchtitan/trainer.py``, ``train_step`` and ``forward_backward_step``, which branches on pp only):

- ``forward_backward(micro_batches)``: the masked and real tokens of every micro-batch of the step
  counted over the dp group once, before the forwards; then, at pp = 1, each micro-batch forward
  and backward through the stage (DDP all-reduces on the last only), at pp > 1 the micro-batches
  through the pipeline schedule; every micro-batch's loss is ``loss`` (written once: the summed CE x
  dp / the global masked count, through the fp16 scaler). Then what backward left partial is summed:
  the replicas over dp (``sharding="replicate"``), the sequence-parallel gradients over tp, the tied
  embedding's two copies over the first and last stage.
- ``clip_grad_norm(max_norm)``: ``labkit.train.clip.clip_grad_norm_`` (torchtitan's) over every
  parameter, the pipeline stages summed, the tied copy counted once.
- ``comm``: the ``labkit.train.comm.CommTimer`` of the gradient collectives over dp: DDP's comm hook
  (with ``cfg.parallel.grad_compression``'s inner hook), FSDP2's timed reduce-scatters, or the replicas'
  all-reduce. ``StepTimer(comm=...)`` turns it into ``comm_exposed_s``.
- ``noise``: the gradient noise scale (``labkit.train.gns.NoiseScale.for_run``) for every dp > 1,
  an observer inside those collectives (under DDP fed instead by a post-accumulate-grad hook on
  every parameter and by ``clip_grad_norm``), and at dp = 1 and pp = 1 from the micro-batches.
- ``step_measures(step_timer)``: collective, once per step on every rank: ``comm_exposed_s``,
  ``pipeline_bubble`` and ``tp_comm_s`` (0.0 where the run is not split that way), the comm timer's
  fields and the noise scale's.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor

from labkit.config import TrainConfig
from labkit.measure import StepTimer, bubble_fraction
from labkit.model.encoder import local
from labkit.train import dist, pipeline
from labkit.train.clip import clip_grad_norm_
from labkit.train.comm import (CommTimer, GradientObserver, compression_hook, install_ddp_hook, time_reduce_scatters,
                               timed_all_reduce)
from labkit.train.gns import NoiseScale
from labkit.train.parallel import Mesh, ModelParts, build
from labkit.train.tensor_parallel import sync_sequence_parallel_grads

__all__ = ["AUTOCAST_DTYPES", "build_runtime", "Runtime"]

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_runtime(cfg: TrainConfig, model: torch.nn.Module, device: torch.device, *,
                  observers: tuple[GradientObserver, ...] = ()) -> Runtime:
    """The ``Runtime`` of a run of ``cfg`` on this process's rank (RANK / WORLD_SIZE from the
    environment, ``dist.dist_info``): its ``Mesh``, then ``parallel.build`` of ``model`` (a
    ``BertMLM`` built alike on every rank). Collective with a process group."""
    rank, _, world = dist.dist_info()
    mesh = Mesh(cfg, world, rank, device)
    parts, optimizer, scaler = build(cfg, model, device, mesh)
    return Runtime(cfg, parts, optimizer, scaler, observers=observers)


class Runtime:
    """The step machinery of one run (module docstring) over ``parts`` (``parallel.build``'s, with
    its ``optimizer`` and fp16 ``scaler``); ``observers``: extra ``labkit.train.comm.GradientObserver``\\ s
    inside the dp gradient collectives. Build it once, before the first step: it installs the
    collectives' timing and builds the pipeline schedule."""

    def __init__(self, cfg: TrainConfig, parts: ModelParts, optimizer: Any, scaler: Any, *,
                 observers: tuple[GradientObserver, ...] = ()) -> None:
        self.cfg, self.parts, self.optimizer, self.scaler = cfg, parts, optimizer, scaler
        self.mesh, self.device = parts.mesh, parts.device
        self.dp, self.dp_rank = self.mesh.dp, self.mesh.dp_rank
        self.autocast = AUTOCAST_DTYPES[cfg.precision]
        self.noise = self._noise_scale()
        self.weights = _piece_weights(parts)  # None: every parameter's gradient counts whole on its rank
        # the noise scale observes the collectives, or (micro) is fed by the step; either way its sums ride the
        # loop's step all-reduce as the comm timer's sideband (labkit.train.comm.all_reduce_with_sideband)
        observers = [*observers, self.noise] if self.noise is not None else list(observers)
        self.hook_state = None  # DDP's composed comm hook (labkit.train.comm.HookState)
        self.comm = self._time_collectives(observers)
        self._syncing = False  # in the backward that DDP reduces (the step's last micro-batch)
        if self.noise is not None and self.noise.kind == "params":
            self._hook_local_gradients()
        self.schedule = self._schedule() if self.mesh.pp > 1 else None
        self._denominator = torch.ones((), dtype=torch.int64)
        self._last = {"busy": 0.0, "span": 0.0, "tp_comm": 0.0}

    # -- one optimiser step's forwards and backwards ---------------------------------------------

    def forward_backward(self, micro_batches: list[dict[str, Any]], mark: Callable[[str], None] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimiser step's forwards and backwards over this rank's ``micro_batches`` (those of
        its dp rank, the same on its tp and pp ranks): each holds input_ids int64[B,T], labels
        int64[B,T] (-100 = not masked), attention_mask bool[B,T] on the device, and may hold what the
        host knew before the copy (``labkit.train.loop.to_device``: ``all_real``, no [PAD], so the
        model gets no mask; ``max_masked``, the sparse head's gather size), so a pp = 1 forward needs
        no host sync. Returns (loss_sum: this rank's summed CE, fp32, detached, nonzero on one rank
        per replica, so the sum over all ranks is the global batch's; n_masked_global;
        n_tokens_global: int64, summed over the dp group before the forwards). ``mark(phase)``
        (``labkit.train.timeline.Timeline.mark``) is told when the count's all-reduce ("sync"), each
        forward and each backward end (a pipeline's schedule: one "backward")."""
        counts = torch.stack([torch.stack([(b["labels"] != -100).sum(), b["attention_mask"].sum()])
                              for b in micro_batches]).sum(0).to(torch.int64)
        if self.mesh.device_mesh is not None:
            tdist.all_reduce(counts, group=self.mesh.group("dp"))
        mark = mark or _no_mark
        mark("sync")
        n_masked, n_tokens = counts[0], counts[1]
        self._denominator = n_masked.clamp(min=1)
        if self.noise is not None:
            self.noise.count(n_masked)
        t0 = time.perf_counter()
        if self.schedule is None:
            loss_sum = self._micro_batches(micro_batches, mark)
        else:
            loss_sum = self._pipeline(micro_batches, n_masked)
            mark("backward")
        span = time.perf_counter() - t0
        self._after_backward()
        timers = self.parts.timers
        busy, reduce_s = timers["busy"].take()[0], timers["reduce"].take()[0]
        self._last = {"busy": busy, "span": span - reduce_s, "tp_comm": timers["tp"].take()[0]}
        return (loss_sum if self.parts.representative else torch.zeros_like(loss_sum)), n_masked, n_tokens

    def loss(self, loss_sum: torch.Tensor, target: Any = None) -> torch.Tensor:
        """The loss backpropagated for one micro-batch: its summed CE x dp / the step's global masked
        count (the dp reduction averages, so the gradient is that of the global batch's mean CE;
        torchtitan's global-token normalisation), through the fp16 scaler; the pipeline schedule's
        loss_fn on the last stage too (``target`` unused: the labels reach the stage as an argument)."""
        return self.scaler.scale(loss_sum.float() * self.dp / self._denominator)

    def _micro_batches(self, micro_batches: list[dict[str, Any]], mark: Callable[[str], None]) -> torch.Tensor:
        """pp = 1: each micro-batch forward and backward through the one stage (DDP's gradient
        all-reduce on the last only, ``no_sync`` on the others; FSDP2 reduce-scatters each); with the
        micro-batch noise scale each one's gradient goes to it first. Returns the summed CE."""
        stage, last = self.parts.stages[0], len(micro_batches) - 1
        micro = self.noise is not None and self.noise.micro
        acc: dict[torch.nn.Parameter, torch.Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float32, device=micro_batches[0]["input_ids"].device)
        for i, batch in enumerate(micro_batches):
            self._syncing = i == last
            with dist.no_sync(stage, sync=i == last):
                with self._autocast():
                    mask = None if batch.get("all_real") else batch["attention_mask"]  # host facts: no sync
                    out = stage(batch["input_ids"], attention_mask=mask, labels=batch["labels"],
                                max_masked=batch.get("max_masked"))
                mark("forward")
                self.loss(out.loss_sum).backward()
                mark("backward")
            if micro:
                acc = self._accumulate_micro(acc, last=i == last)
            loss_sum += out.loss_sum.detach().float()
        self._syncing = False
        return loss_sum

    def _pipeline(self, micro_batches: list[dict[str, Any]], n_masked: torch.Tensor) -> torch.Tensor:
        """pp > 1: the step's micro-batches through the pipeline schedule (torch's; the attention mask
        and labels go to every stage as keyword arguments, split per micro-batch). Returns the summed
        CE of this rank's last stage (0 elsewhere), from the schedule's losses unscaled."""
        whole = {k: torch.cat([b[k] for b in micro_batches]) for k in ("input_ids", "attention_mask", "labels")}
        args = (whole["input_ids"],) if self.parts.has_first else ()
        losses: list[torch.Tensor] = []  # the micro-batches' losses (not those of shape inference)
        with self._autocast():
            self.schedule.step(*args, attention_mask=whole["attention_mask"], labels=whole["labels"],
                               target=whole["labels"] if self.parts.has_last else None, losses=losses,
                               return_outputs=False)
        if not losses:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else 1.0
        total = torch.stack([loss.detach().double() for loss in losses]).sum()
        return (total * self._denominator.double() / (self.dp * scale)).float()

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = self.autocast
        return torch.autocast(self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)

    def _accumulate_micro(self, acc: dict[torch.nn.Parameter, torch.Tensor], *,
                          last: bool) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Give the noise scale the squared norm of this micro-batch's gradient (the .grad fields hold
        it alone), add it to ``acc`` (parameter -> running sum) and clear .grad; on the ``last`` put
        the sums back and give it their squared norm (``gns``: G_small = k·d_j, G_big = Σ d_j)."""
        fresh = [(p, p.grad) for p in self.parts.parameters() if p.grad is not None]
        self.noise.add_small(self._squared(fresh))
        for p, g in fresh:
            if p in acc:
                acc[p].add_(g)
            else:
                acc[p] = g
            p.grad = None
        if last:
            for p, a in acc.items():
                p.grad = a
            self.noise.add_big(self._squared(list(acc.items())))
        return acc

    def _squared(self, pairs: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> torch.Tensor:
        """Σ over (parameter, gradient) of this rank's share of the squared norm (``_piece_weights``):
        each gradient's fp32 norm in one ``torch._foreach_norm`` call (as torch's
        ``clip_grad_norm_`` takes them, rather than a ``squared_norm`` call per tensor), squared,
        weighted, summed."""
        sq = torch.stack(torch._foreach_norm([local(g) for _, g in pairs], 2, dtype=torch.float32)).square()
        if self.weights:
            sq = sq * torch.tensor([self.weights.get(p, 1.0) for p, _ in pairs], dtype=torch.float32, device=sq.device)
        return sq.sum()

    def _after_backward(self) -> None:
        """Sum what backward left partial: the replicas over dp (``sharding="replicate"``, averaged,
        one timed flat all-reduce, the observers inside), the sequence-parallel gradients over tp, the
        tied embedding's two copies over the first and last stage (Megatron-LM's embedding group)."""
        parts = self.parts
        if parts.replicas is not None and self.dp > 1:
            pairs = [(p, local(p.grad)) for p in parts.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for _, g in pairs])
            w = None if self.weights is None else torch.cat(
                [torch.full((g.numel(),), self.weights.get(p, 1.0), device=g.device) for p, g in pairs])
            dtype = torch.bfloat16 if self.cfg.parallel.grad_compression == "bf16" else None
            timed_all_reduce(self.comm, flat, parts.replicas, self.dp, weights=w, dtype=dtype)
            for (_, g), part in zip(pairs, flat.split([g.numel() for _, g in pairs])):
                g.copy_(part.view_as(g))
        if parts.sp_names:
            sync_sequence_parallel_grads([parts.get_parameter(n) for n in parts.sp_names], parts.tp_comm)
        if parts.embedding_group is not None and parts.word is not None and parts.word.weight.grad is not None:
            tdist.all_reduce(local(parts.word.weight.grad), group=parts.embedding_group)

    def set_grad_accum_steps(self, k: int) -> None:
        """Accumulate ``k`` micro-batches per step from the next one on (a batch ramp,
        ``labkit.train.ramp``): ``cfg`` and the noise scale's two batch sizes follow, its averages kept
        (unbiased at any batch: ``labkit.train.gns``), so the runtime is the one ``build_runtime`` gives
        at ``k``. ValueError at pp > 1 (the pipeline schedule fixes its micro-batches)."""
        if self.mesh.pp > 1:
            raise ValueError("batch.grad_accum_steps: a pipeline schedule fixes its micro-batches when built; "
                             "it cannot change during a run at parallel.pp > 1")
        self.cfg = self.cfg.replace(batch={"grad_accum_steps": k})
        old, new = self.noise, self._noise_scale()
        if old is not None and new is not None:
            new.load_state_dict(old.state_dict())
        observers = self.comm.observers if self.comm is not None else []
        if old in observers:
            observers.remove(old)
        if new is not None and self.comm is not None:
            observers.append(new)
        self.noise = new

    def _noise_scale(self) -> NoiseScale | None:
        """The noise scale of this run at ``cfg``'s accumulation (``NoiseScale.for_run``), or None."""
        cfg = self.cfg
        return NoiseScale.for_run(micro_batch_size=cfg.batch.micro_batch_size,
                                  grad_accum_steps=cfg.batch.grad_accum_steps, dp=self.dp,
                                  sharding=cfg.parallel.sharding if self.dp > 1 else "none", dp_rank=self.dp_rank,
                                  compression=cfg.parallel.grad_compression, pp=self.mesh.pp)

    # -- the clip and the measures -----------------------------------------------------------------

    def clip_grad_norm(self, max_norm: float) -> float:
        """Collective: clip every gradient to a global L2 norm of ``max_norm`` (``inf``: measure only)
        and return the norm before clipping, the same on every rank (``labkit.train.clip``). Under DDP
        the norm is also the noise scale's |G_big| (``gns.NoiseScale.reduced_norm``)."""
        norm = clip_grad_norm_(self.parts.parameters(), max_norm, counted_elsewhere=self.parts.tied_copy,
                               pp_group=self.mesh.group("pp") if self.mesh.pp > 1 else None)
        if self.noise is not None and self.noise.kind == "params":
            self.noise.reduced_norm(norm, self.scaler.get_scale() if self.scaler.is_enabled() else 1.0)
        return norm

    def step_measures(self, timer: StepTimer) -> dict[str, Any]:
        """Collective, once per step on every rank, after ``timer.stop()``: {"comm_exposed_s" (this
        rank's, ``timer.comm_exposed_s`` from ``comm``; 0.0 without dp collectives), "pipeline_bubble"
        (``labkit.measure.bubble_fraction`` of every rank's stage compute against world x the longest
        rank's schedule time; 0.0 at pp = 1), "tp_comm_s" (mean over ranks of the seconds in
        tensor-parallel collectives; 0.0 at tp = 1), "comm_bytes", "comm_bucket_bytes" and the
        observers' fields (``CommTimer.step_fields``: the noise scale's among them; without a process
        group the micro-batch noise scale's, ``gns.NoiseScale.step_fields``)}."""
        fields = self.comm.step_fields() if self.comm is not None else {}
        if self.comm is None and self.noise is not None:  # one process: the noise scale from the micro-batches
            fields |= self.noise.step_fields()
            self.noise.reset()
        return {"comm_exposed_s": timer.comm_exposed_s, **self._split_measures(), **fields}

    def _split_measures(self) -> dict[str, float]:
        """The pipeline bubble and the tp time of the last step (collective where there is one to take)."""
        mesh = self.mesh
        if mesh.pp == 1 and mesh.tp == 1:  # nothing timed: no stage chunks, no tp collectives
            return {"pipeline_bubble": 0.0, "tp_comm_s": 0.0}
        sums = torch.tensor([self._last["busy"], self._last["tp_comm"]], dtype=torch.float64)
        span = torch.tensor(self._last["span"], dtype=torch.float64)
        tdist.all_reduce(sums)
        tdist.all_reduce(span, op=tdist.ReduceOp.MAX)
        busy, tp_comm = sums.tolist()
        bubble = bubble_fraction(busy, mesh.world * span.item()) if mesh.pp > 1 and span.item() > 0 else 0.0
        return {"pipeline_bubble": bubble, "tp_comm_s": tp_comm / mesh.world}

    # -- set-up ------------------------------------------------------------------------------------

    def _time_collectives(self, observers: list[GradientObserver]) -> CommTimer | None:
        """The ``CommTimer`` of the dp gradient collectives with ``observers`` inside (None without a
        process group): DDP's one comm hook around ``cfg.parallel.grad_compression``'s inner hook
        (``labkit.train.comm.compression_hook``), or FSDP2's timed reduce-scatters and the replicas'
        all-reduce, which block the backward thread on CPU (and the replicas' everywhere)."""
        if self.mesh.device_mesh is None:
            return None
        stage = self.parts.stages[0]
        if isinstance(stage, torch.nn.parallel.DistributedDataParallel):
            timer = CommTimer(self.device, observers=observers)
            names = {p: n for n, p in self.parts.named_parameters()}
            self.hook_state = install_ddp_hook(stage, timer, *compression_hook(self.cfg, self.mesh.group("dp")),
                                               names=names)
            return timer
        blocking = self.device.type != "cuda" or self.cfg.parallel.sharding == "replicate"
        timer = CommTimer(self.device, blocking=blocking, observers=observers)
        time_reduce_scatters([m for chunk in self.parts.chunks for m in chunk.modules()], timer, self.weights)
        return timer

    def _hook_local_gradients(self) -> None:
        """DDP's noise scale (kind "params", ``labkit.train.gns``): a post-accumulate-grad hook on every
        parameter gives the noise scale its local gradient on the synchronising backward, after the
        gradient is accumulated and before DDP's own hook marks it ready for the all-reduce (torch runs
        a tensor's post-accumulate-grad hooks inside AccumulateGrad, DDP's reducer hooks after it)."""
        for name, p in self.parts.named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_local_gradient_hook(weakref.ref(self), name))

    def _schedule(self) -> Any:
        """Torch's pipeline schedule over this rank's stages (``pipeline.build_schedule``), each a
        ``pipeline.TimedStage`` timing its compute and its FSDP2 reduction, with ``loss`` as loss_fn."""
        parts = self.parts
        stages = [pipeline.TimedStage(c, c.index, parts.n_stages, self.device, group=self.mesh.group("pp"),
                                      busy=parts.timers["busy"], reduce=parts.timers["reduce"]) for c in parts.chunks]
        return pipeline.build_schedule(stages, self.cfg.batch.grad_accum_steps, self.cfg.parallel.pp_schedule,
                                       self.loss)


def _no_mark(phase: str) -> None:
    return None


def _piece_weights(parts: ModelParts) -> dict[torch.nn.Parameter, float] | None:
    """The share of each parameter's gradient this rank counts in a squared norm summed over the world
    (the noise scale): 1/tp for a parameter every rank of the tp group holds whole and alike (a
    ``Replicate()`` DTensor on the tp dimension whose gradient is not a sequence-parallel partial sum),
    1 otherwise; None where every share is 1 (tp = 1)."""
    if parts.mesh.tp == 1:
        return None
    partial = {id(parts.get_parameter(n)) for n in parts.sp_names}
    out = {}
    for p in parts.parameters():
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        replicated = "tp" in names and p.placements[names.index("tp")].is_replicate()
        out[p] = 1.0 / parts.mesh.tp if replicated and id(p) not in partial else 1.0
    return out


def _local_gradient_hook(runtime: "weakref.ref[Runtime]", name: str) -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook of parameter ``name`` (``Runtime._hook_local_gradients``). It
    holds its runtime weakly: a tensor's hooks are held from C++, where Python's garbage collector
    cannot see them, so a strong reference would keep the runtime, its model and its process group
    alive after a failed run, and the other ranks would wait in their collectives until the timeout
    instead of failing at once when this rank's sockets close (``labkit.train.loop.train``)."""
    def hook(p: torch.Tensor) -> None:
        rt = runtime()
        if rt is not None and rt._syncing and rt.noise is not None:
            rt.noise.local(name, p.grad)
    return hook
