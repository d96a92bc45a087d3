"""Checkpoints: ``checkpoints/step-N/`` = model.safetensors (whole, unsharded weights) + state.pt.

state.pt holds the optimiser, scaler, step, token count and, per rank, the RNG states and the
sampler position, as tensors, numbers and lists, so ``torch.load(weights_only=True)`` reads it.
A checkpoint is built under a temporary name and renamed into place (``labkit.io.atomic_dir``):
a directory named ``step-N`` is always complete. Every rank calls ``save_checkpoint`` (it gathers
states); rank 0 writes.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import shutil
import time
import uuid
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import load_model, save_file, save_model

from labkit.io import atomic_dir, replace
from labkit.train import dist


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


# ------------------------------------------------------------------------------------------
# Run identity: which run a run directory and each of its checkpoints belong to
# ------------------------------------------------------------------------------------------

RUN_FILES = ("checkpoints", "metrics.jsonl", "result.json", "config.json", "data.json", "configs", "tensorboard")
"""What a run leaves in its run_dir; a new run in a used run_dir moves these to ``previous/``."""

PREVIOUS_DIR = "previous"
"""run_dir/previous/<UTC start>-<run id>/: the files of earlier runs set aside by ``plan_run``."""


def new_run_id() -> str:
    """A fresh run id: the UTC start time and 12 hex digits of a uuid4, e.g. ``20261201T182300Z-3f2a9c1e4b7d``
    (sortable by start; the random part tells apart runs started in the same second)."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:12]}"


def saved_run_id(run_dir: str | os.PathLike) -> str | None:
    """The ``run_id`` in run_dir/config.json (None: no config.json, or one from before run ids)."""
    path = pathlib.Path(run_dir) / "config.json"
    if not path.exists():
        return None
    import json

    return json.loads(path.read_text()).get("run_id")


def checkpoint_run_id(path: str | os.PathLike) -> str | None:
    """The ``run_id`` stored in checkpoint directory ``path`` (None: a checkpoint from before run ids)."""
    return read_state(path).get("run_id")


def is_used(run_dir: str | os.PathLike) -> bool:
    """Whether ``run_dir`` holds any file a run leaves (``RUN_FILES``)."""
    return any((pathlib.Path(run_dir) / name).exists() for name in RUN_FILES)


def set_aside(run_dir: str | os.PathLike) -> pathlib.Path | None:
    """Move the files of the run in ``run_dir`` (``RUN_FILES``) into
    ``run_dir/previous/<UTC now>-<its run id, or "unnamed">/`` (renames: nothing copied, nothing
    deleted). Returns that directory, or None when run_dir holds none of them."""
    run_dir = pathlib.Path(run_dir)
    present = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = run_dir / PREVIOUS_DIR / f"{stamp}-{saved_run_id(run_dir) or 'unnamed'}"
    k = 1
    while dest.exists():  # two set-asides in one second
        dest, k = dest.with_name(f"{dest.name.split('~')[0]}~{k}"), k + 1
    dest.mkdir(parents=True)
    for path in present:
        os.replace(path, dest / path.name)
    return dest


def plan_run(run_dir: str | os.PathLike, resume: bool) -> dict[str, Any]:
    """Rank 0, before anything is written: which run this is and where it starts.

    With ``resume`` and a complete checkpoint in ``run_dir``, the newest one: its run id must be
    run_dir/config.json's (a checkpoint without an id, from before run ids, is taken as the run's).
    Otherwise a new run: a fresh ``new_run_id``, and a used run_dir's files are first moved aside
    (``set_aside``). Returns {"step": resume step (0: fresh), "run_id", "set_aside": the directory
    the old run went to or None, "error": a one-line refusal or None}; the error is returned, not
    raised, so that rank 0 can hand it to every rank (``agree_on_plan``) instead of leaving them
    waiting in a collective."""
    run_dir = pathlib.Path(run_dir)
    plan: dict[str, Any] = {"step": 0, "run_id": None, "set_aside": None, "error": None}
    try:
        steps = checkpoint_steps(run_dir) if resume else []
        if steps:
            path = run_dir / "checkpoints" / f"step-{steps[-1]}"
            ckpt_id, dir_id = checkpoint_run_id(path), saved_run_id(run_dir)
            if ckpt_id is not None and dir_id is not None and ckpt_id != dir_id:
                plan["error"] = (f"resume: checkpoint {path} belongs to run {ckpt_id}, but {run_dir} holds run "
                                 f"{dir_id} (config.json); move that checkpoint away, or set resume=False to set "
                                 "both aside and start a new run")
            return plan | {"step": steps[-1], "run_id": ckpt_id or dir_id or new_run_id()}
        aside = set_aside(run_dir) if is_used(run_dir) else None
        return plan | {"run_id": new_run_id(), "set_aside": None if aside is None else str(aside)}
    except (OSError, ValueError, RuntimeError) as err:  # e.g. an unreadable state.pt
        return plan | {"error": f"resume: cannot plan the run in {run_dir}: {type(err).__name__}: {err}".splitlines()[0]}


def agree_on_plan(plan: dict[str, Any] | None, run_dir: str | os.PathLike) -> dict[str, Any]:
    """Collective: rank 0's ``plan_run`` result on every rank; then every rank confirms that it
    can read the chosen checkpoint (``is_complete`` on its own view of run_dir, all-reduced)
    before any rank loads it. Raises ValueError (one line, the same on every rank) with rank 0's
    refusal, or naming the ranks that cannot read the step (a run_dir that is not shared, or a
    stale listing of a shared file system). Without a process group: ``plan`` checked alone."""
    import torch.distributed as tdist

    if tdist.is_initialized():
        box = [plan]
        tdist.broadcast_object_list(box, src=0)
        plan = box[0]
    assert plan is not None
    if plan["error"]:
        raise ValueError(plan["error"])
    if plan["step"]:
        path = pathlib.Path(run_dir) / "checkpoints" / f"step-{plan['step']}"
        rank, _, world = dist.dist_info()
        missing = torch.zeros(world, dtype=torch.int64)
        missing[rank] = 0 if is_complete(path) else 1
        if tdist.is_initialized() and tdist.get_backend() == "nccl":
            missing = missing.cuda()
        dist.all_reduce_sum(missing)
        bad = [r for r in range(world) if missing[r]]
        if bad:
            raise ValueError(f"resume: rank(s) {bad} cannot read checkpoints/step-{plan['step']} in their run_dir, "
                             "the checkpoint rank 0 chose to resume from (every rank must see the same run_dir: "
                             "use a shared file system)")
    return plan


def is_complete(path: str | os.PathLike) -> bool:
    """Whether checkpoint directory ``path`` is complete: its files are all there (a
    ``step-N`` directory is published by rename only once complete, so this checks what this
    process can see of it)."""
    path = pathlib.Path(path)
    return (path / "state.pt").is_file() and ((path / "model.safetensors").is_file() or (path / ".metadata").is_file())


@contextlib.contextmanager
def _replacing(final: pathlib.Path) -> Iterator[pathlib.Path]:
    """``labkit.io.atomic_dir(final)`` that may replace an existing ``final``: the new directory is
    built and made durable under a temporary name first; only then is the old one renamed away
    (``.step-N.*.old``, ignored by ``checkpoint_steps``), the new one renamed into place and the
    old one deleted. A crash at any point leaves a complete step-N or the previous steps."""
    if not final.exists():
        with atomic_dir(final) as tmp:
            yield tmp
        return
    with atomic_dir(final.parent / f".{final.name}.new") as tmp:
        yield tmp
    # the complete new copy is now at .step-N.new; swap it in
    old = final.parent / f".{final.name}.{os.getpid()}.old"
    os.replace(final, old)
    replace(final.parent / f".{final.name}.new", final)
    shutil.rmtree(old, ignore_errors=True)


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
        with _replacing(final) as tmp:
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
            tmp = stack.enter_context(_replacing(final))
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
