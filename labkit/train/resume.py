"""Where a run starts from: its ``Runtime`` built and a checkpoint loaded into it, with the scaler,
sampler and RNG states restored (``labkit.train.loop.train`` calls these).

Every checkpoint of ``labkit.train.checkpoint.FORMAT`` 2 is a torch.distributed.checkpoint
directory that each rank reads its part of, at any world size, sharding or split; the global
sampler state continues the same global sample order. Format-1 checkpoints (whole weights +
state.pt, or a split run's DCP at the same dp) load as before or are refused naming both splits.
"""

from __future__ import annotations

import pathlib
from typing import Any

import torch

from labkit.config import TrainConfig
from labkit.model import BertMLM
from labkit.train import dist, rng
from labkit.train.checkpoint import _set_rng_state, is_legacy, load, load_checkpoint, read_state
from labkit.train.parallel import Mesh
from labkit.train.runtime import Runtime, build_runtime

__all__ = ["load_and_wrap", "restore", "resume_rng"]


def load_and_wrap(cfg: TrainConfig, model: BertMLM, device: torch.device, ckpt: pathlib.Path | None,
                  world: int) -> tuple[Runtime, dict | None]:
    """The run's ``Runtime`` (``build_runtime``: the one builder), then the checkpoint ``ckpt`` (None:
    a fresh run) loaded into it through torch.distributed.checkpoint (``checkpoint.load``: each rank
    reads what it holds, at any world size, sharding or split). Returns (runtime, state.pt or None).
    A format-1 checkpoint (``checkpoint.is_legacy``) loads as before: whole weights into the
    one-device model, or a split run's DCP at the same dp; another kind is refused naming both
    splits."""
    state = None
    if ckpt is not None and is_legacy(ckpt):
        _refuse_format_1(ckpt, cfg, world)
        if read_state(ckpt).get("split") is None:
            state = load_checkpoint(ckpt, model)  # whole weights, before the model is split or sharded
    runtime = build_runtime(cfg, model, device)
    if ckpt is not None and state is None:
        state = load(ckpt, runtime.parts, runtime.optimizer)  # collective
    return runtime, state


def _describe(record: dict[str, Any] | None, world: int | None = None) -> str:
    if record is None:
        return f"dp {world} x tp 1 x pp 1 (data parallel only)"
    return f"dp {record['dp']} x tp {record['tp']} x pp {record['pp']}"


def _refuse_format_1(path: Any, cfg: TrainConfig, world: int) -> None:
    """ValueError (one line naming both splits) when format-1 checkpoint ``path`` cannot resume this
    run: a split one loads at any split with the same dp, a data-parallel-only one only into such a run."""
    state = read_state(path)
    saved = state.get("split")
    par = cfg.parallel
    now = {"dp": world // (par.tp * par.pp), "tp": par.tp, "pp": par.pp} if par.tp * par.pp > 1 else None
    if (saved is None) != (now is None) or (saved is not None and saved["dp"] != now["dp"]):
        raise ValueError(f"resume: checkpoint {path} was written at {_describe(saved, state.get('world_size'))}; "
                         f"this run is {_describe(now, world)}: a checkpoint loads at another split with the same "
                         "dp (and both split or both data parallel only); set the split it was written at, or "
                         "resume=False")


def restore(state: dict | None, runtime: Runtime, sampler: Any, *, world: int, sharding: str,
            where: str) -> tuple[int, int, int, int]:
    """Scaler and sampler state from a checkpoint's ``state`` (None: a fresh run); the weights and
    optimiser state were loaded with it (``checkpoint.load``). Returns (step, epoch, position in
    the epoch, tokens seen). A ``checkpoint.FORMAT`` 2 state holds the global sampler state, which
    continues the same global sample order at any world size (``RankSampler.load_state_dict``:
    ValueError, one line, where it cannot). A format-1 checkpoint (``where`` names it): the
    whole optimiser state is loaded here, and another world size or sharding is a ValueError."""
    if state is None:
        sampler.set_epoch(0)
        return 0, 0, 0, 0
    runtime.scaler.load_state_dict(state["scaler"])
    sampler.set_epoch(state["epoch"])
    if state.get("format", 1) >= 2:
        sampler.load_state_dict(state["sampler"])
        return state["step"], state["epoch"], sampler.position, state["tokens"]
    if state.get("split") is not None:
        mine = state["ranks"][_split_rank(state, runtime.mesh)]
    else:
        if len(state["ranks"]) != world:
            raise ValueError(f"resume: checkpoint {where} was written by "
                             f"{len(state['ranks'])} ranks; this run has {world} (set resume=False)")
        if state.get("sharding", sharding) != sharding:
            raise ValueError(f"sharding: checkpoint {where} was written with "
                             f"{state.get('sharding')!r}, this run uses {sharding!r} (set resume=False)")
        dist.load_optimizer_state_dict(runtime.parts.chunks[0], runtime.optimizer, state["optimizer"])
        mine = state["ranks"][runtime.mesh.rank]
    sampler.load_state_dict(mine["sampler"])
    return state["step"], state["epoch"], mine["sampler"]["position"], state["tokens"]


def _split_rank(state: dict[str, Any], mesh: Mesh) -> int:
    """The rank of a format-1 split checkpoint whose sampler (and RNG) state rank ``mesh.rank``
    continues: the same rank at the same split, else the saved split's (first stage, tp 0) rank of
    the same data-parallel rank (every rank of a replica consumed the same batches)."""
    saved = state["split"]
    if (saved["dp"], saved["tp"], saved["pp"]) == (mesh.dp, mesh.tp, mesh.pp):
        return mesh.rank
    return mesh.dp_rank * saved["tp"]


def resume_rng(state: dict, mesh: Mesh, cfg: TrainConfig, device: torch.device) -> None:
    """This rank's RNG states from ``state`` where the checkpoint was written at the same layout
    (the same pp, dp and tp); at another layout no saved stream is this rank's: the dropout streams
    restart from ``cfg.seed`` and the step (``rng.seed_streams``: per tp rank and shared), so they
    never repeat step 0's."""
    saved = state.get("split") or {"dp": len(state["ranks"]), "tp": 1, "pp": 1}
    if (saved["dp"], saved["tp"], saved["pp"]) == (mesh.dp, mesh.tp, mesh.pp):
        entry = state["ranks"][mesh.rank if state.get("format", 1) >= 2 or state.get("split") is None
                               else _split_rank(state, mesh)]
        _set_rng_state(entry["rng"])
    else:
        rng.seed_streams((cfg.seed + 1) * 1_000_003 + state["step"], mesh.rank, mesh.world, cfg.parallel.tp, device)
