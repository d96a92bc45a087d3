"""``labkit checkpoint upgrade RUN_DIR``: rewrite a run's format-1 checkpoints in the format of today.

Format 1 is how labkit checkpointed before torch.distributed.checkpoint (``checkpoint.FORMAT`` 2):

- a data-parallel run: ``model.safetensors`` (the whole model) and state.pt holding the whole
  AdamW state (``optimizer.state_dict()`` by parameter index; by name under FSDP2) and per rank
  ``{"rng", "sampler": {"epoch", "position"}}``, written by one world size;
- a split run (tp or pp > 1): a DCP directory of {"model", "optim"} by name, as today, but no
  ``COMPLETE`` marker and per-rank sampler positions.

The training loop reads only format 2 (``labkit.train.resume.RunState``). ``upgrade`` rewrites
each format-1 step directory once, in one process, without the shards' data: the weights and
AdamW state as DCP files by name, state.pt with the run's split, the global sampler state
(``RankSampler.state_at`` of the old world size over the shard index's sequence count, which it
reads from the run's ``data_dir``), the ranks' RNG states, and the marker last; each directory is
built beside the old one and swapped in only when complete (``checkpoint._replacing``). The run
then resumes, at its old split or any other.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import torch

from labkit.train.checkpoint import FORMAT, MARKER, _quiet, _replacing, checkpoint_steps, read_state

__all__ = ["upgrade"]


def upgrade(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Rewrite every format-1 checkpoint of ``run_dir`` (module docstring); returns one
    {"step", "kind": "data parallel" | "split", "path"} per directory rewritten ([] when there is
    none). ValueError (one line) when run_dir has no config.json, or its shard index (which places
    the sampler) cannot be read."""
    run_dir = pathlib.Path(run_dir)
    config = run_dir / "config.json"
    if not config.is_file():
        raise ValueError(f"run_dir: {run_dir} has no config.json (not a labkit run directory)")
    saved = json.loads(config.read_text())
    done = []
    for step in checkpoint_steps(run_dir):
        path = run_dir / "checkpoints" / f"step-{step}"
        if (path / MARKER).is_file():
            continue  # already format 2
        state = read_state(path)
        kind = "data parallel" if (path / "model.safetensors").is_file() else "split"
        with _replacing(path) as built:
            tensors = _whole_run_tensors(path, saved, state) if kind == "data parallel" else None
            _write(built, path, tensors, _state(saved, state))
        done.append({"step": step, "kind": kind, "path": str(path)})
    return done


def _flat(saved: dict[str, Any]) -> dict[str, Any]:
    """config.json's fields by their dotted names (``labkit.config.train.dotted``: a config.json
    from before the sections reads the same)."""
    from labkit.config.train import dotted

    return dotted(saved)


def _whole_run_tensors(path: pathlib.Path, saved: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """{"model", "optim"} of a data-parallel format-1 directory as DCP state dicts by name: the
    model built as the run built it, ``model.safetensors`` loaded, AdamW over it (the run's groups,
    ``build_optimizer``) given the saved whole state (by index, or by name as FSDP2 saved it)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_optimizer_state_dict)

    from labkit.config import TrainConfig
    from labkit.model import BertMLM
    from labkit.train.optim import build_optimizer
    from labkit.train.run_config import model_config_of

    weights = load_file(str(path / "model.safetensors"))
    flat = _flat(saved)
    cfg = TrainConfig(data_dir="-", run_dir="-", model=flat.get("model", "mini"),
                      model_overrides=flat.get("model_overrides") or {},
                      activation_checkpointing=bool(flat.get("activation_checkpointing", False)),
                      optim={k: flat[f"optim.{k}"] for k in ("lr", "weight_decay", "beta1", "beta2")
                             if f"optim.{k}" in flat})
    model = BertMLM(model_config_of(cfg, int(weights["word.weight"].shape[0])))
    model.load_state_dict(weights, strict=True)
    optimizer = build_optimizer(model, cfg)
    if any(isinstance(k, str) for k in state["optimizer"].get("state", {})):  # FSDP2's: by name
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state["optimizer"])
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return {"model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, optimizer, options=options)}


def _state(saved: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """state.pt of format 2 from format 1's: the split (data parallel: (1, world, 1)), the global batch,
    the global sampler state of data-parallel rank 0 (every rank of a run consumed as many
    batches: the same place in the same epoch, ``RankSampler.load_state_dict``), the ranks' RNG states."""
    from labkit.data.mlm import RankSampler
    from labkit.data.shards import read_index

    flat = _flat(saved)
    split = state.get("split") or {"dp": len(state["ranks"]), "tp": 1, "pp": 1}
    micro = int(flat.get("batch.micro_batch_size", 16))
    accum = int(flat.get("batch.grad_accum_steps", 1))
    data_dir = saved.get("data_dir")
    try:
        n = int(read_index(data_dir)["n_sequences"])
    except Exception as err:  # noqa: BLE001 (any unreadable index: one line naming it)
        raise ValueError(f"data_dir: upgrade reads the run's shard index to place the sampler, and {data_dir} "
                         f"gives {type(err).__name__}: {err}".splitlines()[0]) from None
    sampler = RankSampler(n, rank=0, world_size=split["dp"], batch_size=micro)
    sampler.load_state_dict({"epoch": state["epoch"], "position": state["ranks"][0]["sampler"]["position"]})
    sharding = state.get("sharding") or flat.get("parallel.sharding", "ddp")
    return {"format": FORMAT, "run_id": saved.get("run_id"), "step": state["step"], "epoch": state["epoch"],
            "tokens": state["tokens"], "lr": state.get("lr"), "world_size": len(state["ranks"]),
            "global_batch_size": micro * accum * split["dp"], "sharding": sharding,
            "split": {"pp_schedule": flat.get("parallel.pp_schedule", "1f1b"),
                      "pp_virtual_stages": flat.get("parallel.pp_virtual_stages", 1),
                      "sequence_parallel": flat.get("parallel.sequence_parallel", False), **split},
            "sampler": sampler.state_dict(), "scaler": state["scaler"], "noise": None, "hook": None,
            "ranks": [{"rng": r["rng"]} for r in state["ranks"]]}


def _write(built: pathlib.Path, old: pathlib.Path, tensors: dict[str, Any] | None, state: dict[str, Any]) -> None:
    """Fill the new step directory ``built``: the DCP files (written from ``tensors``, or copied from
    ``old`` for a split run's, already by name), state.pt, the marker last."""
    import shutil

    import torch.distributed.checkpoint as dcp

    if tensors is not None:
        _quiet(dcp.save, tensors, checkpoint_id=str(built), no_dist=True)
    else:
        for f in old.iterdir():
            if f.name == ".metadata" or f.suffix == ".distcp":
                shutil.copy2(f, built / f.name)
    torch.save(state, built / "state.pt")
    (built / MARKER).write_text(json.dumps({"step": state["step"], "run_id": state["run_id"],
                                            "world_size": state["world_size"], "format": FORMAT,
                                            "upgraded_from": 1}) + "\n")
