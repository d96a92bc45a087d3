"""A run's state: everything that shapes its next step, saved and loaded as one.

``RunState`` is what a checkpoint holds (``labkit.train.checkpoint.Checkpointer.save`` / ``load``,
torch.distributed.checkpoint with each rank its own part, state.pt from rank 0):

- the weights and the AdamW state, by ``BertMLM`` parameter name (each rank the names and slices it
  holds: DCP reshards them at another world size, sharding or split);
- the schedule position: ``step`` (the learning rate is a pure function of it, ``lr_at``);
- the data position: ``epoch``, the batches of it consumed (``position``) and the sampler's global
  state (``RankSampler.state_at``), which continues the same global sample order at any dp;
  ``tokens`` seen;
- the fp16 grad scaler's scale and growth tracker;
- the comm hook's state: PowerSGD's step counter and, per rank, its error feedback and warm-start
  memories by parameter name (``labkit.train.powersgd``; loaded at the same layout only: another
  rank's error is no one's);
- the gradient noise scale's moving averages (``labkit.train.gns.NoiseScale.state_dict``);
- the batch ramp (``labkit.train.ramp.BatchRamp``: the starting and current global batch, the
  decision pending for the next step, the changes so far), continued only by the run that saved it
  (a branch, ``checkpoint.init_from``, starts its own at its config's batch);
- RNG: every rank's streams, continued by the rule of ``labkit.train.rng`` (the same layout: each
  rank its own; another: derived from the old layout's replicated streams).

``state_dict()`` returns {"tensors": the DCP part of this rank, "run": the shared fields of
state.pt, "rank": this rank's entry of state.pt's "ranks"}; ``load_state_dict`` takes the same
with "ranks" (every rank's entries) in place of "rank". A checkpoint of labkit's format 1 (before
torch.distributed.checkpoint) is refused in one line: ``labkit checkpoint upgrade RUN_DIR``
(``labkit.train.upgrade``) rewrites it.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.config import TrainConfig
from labkit.train import dist, rng
from labkit.train.optim import lr_at
from labkit.train.ramp import BatchRamp
from labkit.train.runtime import Runtime

__all__ = ["RunState"]

_KERNEL_CHOICES = ("fused", "foreach", "capturable", "differentiable")
"""AdamW param-group settings that choose the implementation, not the update: a loaded checkpoint
keeps the run's own (``labkit.train.optim.optimizer_kind``: a fused run's checkpoint must not make an
fp16 run under ShardedGradScaler fused, whose found-inf flag the fused step refuses)."""


def _options() -> Any:
    """Sharded state dicts (DTensors stay sharded: FSDP2 and tensor-parallel parameters), AdamW
    state flattened by parameter name (``state.<fqn>.exp_avg``), so any rank of any split, data
    parallel or not, loads the names and slices it holds whatever wrote them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimiser holding this rank's state: ZeRO-1's local AdamW over its partition, else itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


class RunState:
    """Everything that shapes the next step of a run (module docstring): ``cfg``, its ``runtime``
    (the model parts, optimiser, scaler, comm hook and noise scale), the loader's ``sampler`` and the
    run's ``run_id``; the counters ``step``, ``epoch``, ``position`` (batches of the epoch consumed)
    and ``tokens`` (real tokens seen), all 0 for a fresh run; the batch ``ramp``. ``set_batch``
    changes the global batch (and ``cfg``'s accumulation) for the steps to come."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime, sampler: Any, run_id: str) -> None:
        self.cfg, self.runtime, self.sampler, self.run_id = cfg, runtime, sampler, run_id
        self.step = self.epoch = self.position = self.tokens = 0
        self.ramp = BatchRamp(cfg, runtime.dp)

    def set_batch(self, batch: int, why: str) -> dict[str, Any]:
        """Train the next steps at global ``batch`` (sequences), through accumulation at this dp
        (``Runtime.set_grad_accum_steps``); returns the change's record (``BatchRamp.apply``)."""
        record = self.ramp.apply(self.step, batch, why, self.cfg)
        self.cfg = self.cfg.replace(batch={"grad_accum_steps": self.ramp.grad_accum_steps})
        self.runtime.set_grad_accum_steps(self.ramp.grad_accum_steps)
        return record

    # -- what a checkpoint holds ------------------------------------------------------------------

    def layout(self) -> dict[str, Any]:
        """This run's split as state.pt records it: dp, tp, pp and the pipeline's settings."""
        par, mesh = self.cfg.parallel, self.runtime.mesh
        return {"dp": mesh.dp, "tp": mesh.tp, "pp": mesh.pp, "pp_schedule": par.pp_schedule,
                "pp_virtual_stages": par.pp_virtual_stages, "sequence_parallel": par.sequence_parallel}

    def state_dict(self) -> dict[str, Any]:
        """{"tensors": {"model", "optim" (``torch.distributed.checkpoint.state_dict``'s, by name; AdamW's
        state created by a zero-lr step if it has none yet, as torch does), "hook": this rank's comm
        hook tensors, keyed "r<rank>.<name>" (PowerSGD: error feedback, Q memory)}, "run": the
        shared fields, "rank": {"rng": this rank's streams}}."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        rt, cfg = self.runtime, self.cfg
        tensors = {"model": get_model_state_dict(rt.parts, options=_options()),
                   "optim": get_optimizer_state_dict(rt.parts, _local_optimizer(rt.optimizer), options=_options())}
        hook = rt.hook_state.state_dict() if rt.hook_state is not None else None
        if hook is not None:
            tensors["hook"] = {f"r{rt.mesh.rank}.{k}": v for k, v in hook["tensors"].items()}
        batch = cfg.batch.micro_batch_size * cfg.batch.grad_accum_steps * rt.dp
        run = {"run_id": self.run_id, "step": self.step, "epoch": self.epoch, "tokens": self.tokens,
               "lr": lr_at(self.step, cfg) * self.ramp.lr_factor, "world_size": rt.mesh.world,
               "global_batch_size": batch, "ramp": self.ramp.state_dict(),
               "sharding": self.sharding, "split": self.layout(),
               "sampler": self.sampler.state_at(self.epoch, self.position), "scaler": rt.scaler.state_dict(),
               "noise": rt.noise.state_dict() if rt.noise is not None else None,
               "hook": {"iter": hook["iter"], "tensors": bool(hook["tensors"])} if hook is not None else None}
        return {"tensors": tensors, "run": run, "rank": {"rng": rng.rng_state()}}

    @property
    def sharding(self) -> str:
        """The sharding in effect, as state.pt records it ("none" with one data-parallel rank)."""
        return self.cfg.parallel.sharding if self.runtime.dp > 1 else "none"

    def same_layout(self, run: dict[str, Any]) -> bool:
        """Whether state.pt's ``run`` was written at this run's (pp, dp, tp) and sharding."""
        mesh = self.runtime.mesh
        return (*_saved_split(run), run.get("sharding")) == (mesh.pp, mesh.dp, mesh.tp, self.sharding)

    def tensors_to_load(self, run: dict[str, Any], stored: dict[str, Any]) -> dict[str, Any]:
        """The DCP part to fill from a checkpoint whose state.pt is ``run`` and whose tensors are
        ``stored`` ({key: (shape, dtype)} from its metadata): this run's model and optimiser state
        dicts, and at the same layout this rank's hook tensors."""
        sd = self.state_dict()["tensors"]
        sd.pop("hook", None)
        prefix = f"hook.r{self.runtime.mesh.rank}."
        if self.same_layout(run) and self.runtime.hook_state is not None:
            sd["hook"] = {k[len("hook."):]: torch.empty(shape, dtype=dtype)
                          for k, (shape, dtype) in stored.items() if k.startswith(prefix)}
        return sd

    # -- continuing from one ------------------------------------------------------------------------

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` = {"tensors" (``tensors_to_load``'s, filled), "run", "ranks"}: the
        weights and AdamW state (keeping this run's implementation choices, ``_KERNEL_CHOICES``), the
        counters, sampler, scaler, noise-scale averages, hook state and RNG (last: nothing after it
        here draws from the streams). ValueError (one line) for a sampler state the data cannot
        continue (``RankSampler.load_state_dict``)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        run, rt = state["run"], self.runtime
        set_model_state_dict(rt.parts, state["tensors"]["model"], options=_options())
        local = _local_optimizer(rt.optimizer)
        kernels = [{k: g[k] for k in _KERNEL_CHOICES if k in g} for g in local.param_groups]
        set_optimizer_state_dict(rt.parts, local, state["tensors"]["optim"], options=_options())
        for group, own in zip(local.param_groups, kernels):  # how this run steps, not what: keep its own
            group.update(own)
        if local is not rt.optimizer:  # ZeRO-1 (pytorch/pytorch#124133)
            dist.steps_to_param_devices(local)
        self.step, self.tokens = run["step"], run["tokens"]
        self.sampler.load_state_dict(run["sampler"])  # the global sample position: at any dp
        self.epoch, self.position = self.sampler.epoch, self.sampler.position  # this rank's next micro-batch's epoch
        rt.scaler.load_state_dict(run["scaler"])
        if rt.noise is not None and run.get("noise") is not None:
            rt.noise.load_state_dict(run["noise"])
        if run.get("ramp") is not None and run.get("run_id") == self.run_id:  # this run's own, not a branch's origin
            self.ramp.load_state_dict(run["ramp"])
        if rt.hook_state is not None and rt.hook_state.named is not None and run.get("hook") is not None:
            hook = state["tensors"].get("hook", {})
            prefix = f"r{rt.mesh.rank}."
            rt.hook_state.load_state_dict({"iter": run["hook"]["iter"],
                                           "tensors": {k[len(prefix):]: v for k, v in hook.items()}})
        rng.continue_streams([r["rng"] for r in state["ranks"]], _saved_split(run), rt.mesh, rt.device)


def _saved_split(run: dict[str, Any]) -> tuple[int, int, int]:
    """(pp, dp, tp) of state.pt's ``run`` (a data-parallel checkpoint from before every run recorded
    its split: (1, world size, 1))."""
    split = run.get("split") or {"pp": 1, "dp": len(run["ranks"]), "tp": 1}
    return split["pp"], split["dp"], split["tp"]
