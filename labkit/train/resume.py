"""Where a run starts from: the model wrapped for its split and a checkpoint loaded into it, with
the scaler, sampler and RNG states restored (``labkit.train.loop.train`` calls these, so the loop
itself holds no branch on the kind of split).

Every checkpoint of ``labkit.train.checkpoint.FORMAT`` 2 is a torch.distributed.checkpoint
directory that each rank reads its part of, at any world size, sharding or split; the global
sampler state continues the same global sample order. Format-1 checkpoints (whole weights +
state.pt, or a split run's DCP at the same dp) load as before or are refused naming both splits
(``parallel.refuse_checkpoint``).
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

import torch

from labkit.config import TrainConfig
from labkit.model import BertMLM
from labkit.train import dist, parallel, rng
from labkit.train.checkpoint import _set_rng_state, is_legacy, load, load_checkpoint
from labkit.train.optim import build_optimizer

__all__ = ["load_and_wrap", "parallelize", "restore", "resume_rng"]


def parallelize(cfg: TrainConfig, model: torch.nn.Module, device: torch.device) -> tuple[Any, Any, Any, str]:
    """Applied from outside the model, in this order: move to ``device``, ``torch.compile``
    (``cfg.compile``; in place, so state-dict keys keep their names), wrap for data parallelism
    (DDP, or FSDP2 ``fully_shard``), then the optimiser (AdamW, or ZeRO-1) and the fp16 grad
    scaler. Returns (model, optimizer, scaler, sharding in effect: "none" in one process)."""
    model = model.to(device)
    if cfg.compile:
        model.compile()  # in place: state_dict keys unchanged (no _orig_mod prefix)
    model = dist.wrap_model(model, cfg, device)  # DDP, or FSDP2 fully_shard (in place)
    optimizer = build_optimizer(model, cfg)  # AdamW, or ZeroRedundancyOptimizer (zero1)
    scaler = dist.grad_scaler(model, device, enabled=cfg.precision == "fp16")
    sharding = cfg.sharding if torch.distributed.is_initialized() else "none"  # one process: nothing to shard
    return model, optimizer, scaler, sharding


def load_and_wrap(cfg: TrainConfig, model: BertMLM, device: torch.device, split: parallel.Split | None,
                   ckpt: pathlib.Path | None, world: int) -> tuple[Any, Any, Any, str, dict | None]:
    """The model wrapped for this run (``parallelize``, or ``parallel.build`` for a split), then
    the checkpoint ``ckpt`` (None: a fresh run) loaded into it through torch.distributed.checkpoint
    (``checkpoint.load``: each rank reads what it holds, at any world size, sharding or split).
    Returns (model, optimizer, scaler, sharding, state.pt or None). A format-1 checkpoint
    (``checkpoint.is_legacy``) loads as before: whole weights into the one-device model, or a split
    run's DCP at the same dp; another kind is refused naming both splits (``parallel.refuse_checkpoint``)."""
    legacy = ckpt is not None and is_legacy(ckpt)
    if legacy:
        parallel.refuse_checkpoint(ckpt, split, world)
        if split is None:
            state = load_checkpoint(ckpt, model)
            return (*parallelize(cfg, model, device), state)
    if split is not None:
        model, optimizer, scaler, sharding, state = parallel.build(cfg, model, device, split, ckpt if legacy else None)
    else:
        (model, optimizer, scaler, sharding), state = parallelize(cfg, model, device), None
    if ckpt is not None and not legacy:
        state = load(ckpt, model, optimizer)  # collective
    return model, optimizer, scaler, sharding, state


def restore(state: dict | None, model: torch.nn.Module, optimizer: Any, scaler: Any, sampler: Any, *,
             rank: int, world: int, sharding: str, where: str) -> tuple[int, int, int, int]:
    """Scaler and sampler state from a checkpoint's ``state`` (None: a fresh run); the weights and
    optimiser state were loaded with it (``checkpoint.load``). Returns (step, epoch, position in
    the epoch, tokens seen). A ``checkpoint.FORMAT`` 2 state holds the global sampler state, which
    continues the same global sample order at any world size (``RankSampler.load_state_dict``:
    ValueError, one line, where it cannot). A format-1 checkpoint (``where`` names it): the
    whole optimiser state is loaded here, and another world size or sharding is a ValueError; a
    split model's rank entry is ``parallel.rank_entry``'s. Rank 0 says on stderr that the run
    resumes, and from which checkpoint and step (one line)."""
    if state is None:
        sampler.set_epoch(0)
        return 0, 0, 0, 0
    dist.print0(f"train: resuming from step {state['step']} (checkpoint {where})", file=sys.stderr)  # one line
    if state.get("format", 1) >= 2:
        scaler.load_state_dict(state["scaler"])
        sampler.load_state_dict(state["sampler"])  # the global sample position: any world size
        return state["step"], sampler.epoch, sampler.position, state["tokens"]
    if isinstance(model, parallel.ParallelModel):
        mine = parallel.rank_entry(state, rank, model.split)
        scaler.load_state_dict(state["scaler"])
        sampler.load_state_dict(mine["sampler"] | {"epoch": state["epoch"]})
        return state["step"], sampler.epoch, sampler.position, state["tokens"]
    if len(state["ranks"]) != world:
        raise ValueError(f"resume: checkpoint {where} was written by "
                         f"{len(state['ranks'])} ranks; this run has {world} (set resume=False)")
    if state.get("sharding", sharding) != sharding:
        raise ValueError(f"sharding: checkpoint {where} was written with "
                         f"{state.get('sharding')!r}, this run uses {sharding!r} (set resume=False)")
    dist.load_optimizer_state_dict(model, optimizer, state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    mine = state["ranks"][rank]
    sampler.load_state_dict(mine["sampler"] | {"epoch": state["epoch"]})
    return state["step"], sampler.epoch, sampler.position, state["tokens"]


def resume_rng(state: dict, rank: int, world: int, split: parallel.Split | None, cfg: TrainConfig,
               device: torch.device) -> None:
    """This rank's RNG states from ``state`` where the checkpoint was written at the same
    layout (the same world size, data parallel only; or both split: ``parallel.rank_entry``).
    At another layout no saved stream is this rank's: the dropout streams restart from
    ``cfg.seed`` and the step (``rng.seed_streams``: per tp rank and shared), so they never repeat step 0's."""
    saved_split = state.get("split")
    same = split is not None and saved_split is not None and len(state["ranks"]) == world and \
        (saved_split["dp"], saved_split["tp"], saved_split["pp"]) == (split.dp, split.tp, split.pp)
    if same:  # the same split: each rank its own streams (another one has no saved stream of this rank)
        _set_rng_state(parallel.rank_entry(state, rank, split)["rng"])
    elif saved_split is None and split is None and len(state["ranks"]) == world:
        _set_rng_state(state["ranks"][rank]["rng"])
    else:  # another layout: fresh streams (per tp rank and shared, labkit.train.rng) that never repeat step 0's
        rng.seed_streams((cfg.seed + 1) * 1_000_003 + state["step"], rank, world, cfg.tp, device)
