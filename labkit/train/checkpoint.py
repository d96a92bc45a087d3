"""Checkpoints: ``checkpoints/step-N/`` = model.safetensors (whole, unsharded weights) + state.pt.

state.pt holds the optimiser, scaler, step, token count and, per rank, the RNG states and the
sampler position, as tensors, numbers and lists, so ``torch.load(weights_only=True)`` reads it.
A checkpoint is built under a temporary name and renamed into place (``labkit.io.atomic_dir``):
a directory named ``step-N`` is always complete. Every rank calls ``save_checkpoint`` (it gathers
states); rank 0 writes.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_file, save_model

from labkit.io import atomic_dir
from labkit.train import dist

__all__ = ["checkpoint_steps", "is_split_checkpoint", "load_checkpoint", "load_split_checkpoint", "read_state",
           "save_checkpoint", "save_split_checkpoint"]


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors/lists/numbers (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                       "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
             "python": {"version": version, "internal": list(internal), "gauss": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints in run_dir/checkpoints (``step-N`` dirs), ascending.
    Temp dirs of an interrupted write (``.step-N.*.tmp``) are ignored."""
    ckdir = pathlib.Path(run_dir) / "checkpoints"
    if not ckdir.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in ckdir.iterdir() if p.name.startswith("step-") and p.name[5:].isdigit())


def save_checkpoint(run_dir: str | os.PathLike, step: int, model: torch.nn.Module, state: dict[str, Any],
                    per_rank: dict[str, Any], *, keep: int) -> pathlib.Path | None:
    """Collective (every rank calls): gather ``per_rank`` (RNG, sampler position) from all ranks;
    rank 0 writes {model.safetensors, state.pt} into a temporary directory, renames it to step-N and
    deletes all but the newest ``keep``. Weights are the whole unsharded model's: via
    safetensors' ``save_model`` on the unwrapped module (it drops the duplicate name of tied
    tensors, where ``save_file`` refuses shared storage), or under fsdp the full state dict
    gathered to rank 0 (``dist.model_state_dict``). state.pt holds ``state`` (its optimiser
    state already gathered with ``dist.optimizer_state_dict``) plus ``ranks`` = [per_rank of
    rank 0, 1, ...]. Returns the directory on rank 0, None elsewhere."""
    weights = dist.model_state_dict(model) if dist.is_fsdp(model) else None  # collective
    ranks = dist.all_gather_object(per_rank)
    final = None
    if dist.is_main():
        ckdir = pathlib.Path(run_dir) / "checkpoints"
        final = ckdir / f"step-{step}"
        shutil.rmtree(final, ignore_errors=True)
        with atomic_dir(final) as tmp:
            if weights is None:
                save_model(dist.unwrap(model), str(tmp / "model.safetensors"), force_contiguous=True)
            else:
                save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
            torch.save({**state, "ranks": ranks}, tmp / "state.pt")
        for old in checkpoint_steps(run_dir)[:-keep]:
            shutil.rmtree(ckdir / f"step-{old}", ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module) -> dict[str, Any]:
    """Load model.safetensors into ``model`` (unwrapped, strict) and return state.pt, read with
    ``torch.load(weights_only=True)`` on CPU."""
    path = pathlib.Path(path)
    load_model(dist.unwrap(model), str(path / "model.safetensors"), strict=True)
    return torch.load(path / "state.pt", map_location="cpu", weights_only=True)


# ------------------------------------------------------------------------------------------
# Split models (tensor / pipeline parallel): torch.distributed.checkpoint
# ------------------------------------------------------------------------------------------

def _split_options():
    """Sharded state dicts (DTensors stay sharded), AdamW state flattened by parameter name, so
    a pipeline rank loads the names it holds whatever the split that wrote them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _split_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model, options=_split_options()),
            "optim": get_optimizer_state_dict(model, optimizer, options=_split_options())}


def is_split_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` (a step-N directory) was written by ``save_split_checkpoint``."""
    return (pathlib.Path(path) / ".metadata").is_file()


def save_split_checkpoint(run_dir: str | os.PathLike, step: int, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer, state: dict[str, Any], per_rank: dict[str, Any], *,
                          keep: int) -> pathlib.Path | None:
    """Collective: checkpoint step-N of a split model (``labkit.train.parallel.ParallelModel``) as a
    ``torch.distributed.checkpoint`` directory: {"model": parameters, "optim": AdamW state} under the
    ``BertMLM`` names, each rank writing its own shards (every rank's files go to run_dir, which a
    multi-node run must share), plus state.pt from rank 0 (``state`` and ``ranks`` = [per_rank of
    rank 0, 1, ...], as ``save_checkpoint``). Built under a temporary name that rank 0 renames
    into place after every rank has written; returns the directory on rank 0, None elsewhere."""
    import contextlib

    import torch.distributed.checkpoint as dcp

    ranks = dist.all_gather_object(per_rank)
    ckdir = pathlib.Path(run_dir) / "checkpoints"
    final = ckdir / f"step-{step}"
    with contextlib.ExitStack() as stack:
        tmp = None
        if dist.is_main():
            shutil.rmtree(final, ignore_errors=True)
            tmp = stack.enter_context(atomic_dir(final))
        box = [str(tmp) if tmp is not None else None]
        torch.distributed.broadcast_object_list(box, src=0)
        dcp.save(_split_state_dict(model, optimizer), checkpoint_id=box[0])
        if dist.is_main():
            torch.save({**state, "ranks": ranks}, pathlib.Path(box[0]) / "state.pt")
    if dist.is_main():
        for old in checkpoint_steps(run_dir)[:-keep]:
            shutil.rmtree(ckdir / f"step-{old}", ignore_errors=True)
    dist.barrier()
    return final if dist.is_main() else None


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """state.pt of checkpoint directory ``path`` (``torch.load(weights_only=True)`` on CPU)."""
    return torch.load(pathlib.Path(path) / "state.pt", map_location="cpu", weights_only=True)


def load_split_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: load a ``save_split_checkpoint`` directory into a split model and its optimiser
    (any split: each rank reads the shards of the names and slices it holds) and return state.pt.
    The optimiser's state is created first with a zero step (lr 0), as torch's ``get_optimizer_state_dict`` does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    sd = _split_state_dict(model, optimizer)
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(model, sd["model"], options=_split_options())
    set_optimizer_state_dict(model, optimizer, sd["optim"], options=_split_options())
    return read_state(path)
