"""The configuration a run directory was started with, and the refusal to resume it under another.

A run directory keeps ``config.json`` (the ``TrainConfig``) and ``data.json`` (what the
run's data was: ``data_identity``). Resuming from one of its checkpoints compares both with
the new run's, field by field (``config_drift``):

- ``FREE_FIELDS`` never matter: where things are (run_dir, data_dir, tokenizer_path; the data
  and tokenizer themselves are compared by hash instead), how the process runs (threads,
  loader workers, backend, timeout, verification, metric trackers, the provenance record that
  config.json carries), ``stop_after`` (a simulated interruption:
  the schedule follows max_steps) and this module's own switch.
- ``SAFE_FIELDS`` change what is logged, saved or how far the run goes, not the steps already
  taken: more steps (``max_steps``; with a decaying schedule the LR of the
  remaining steps follows the new max_steps), log, checkpoint and evaluation intervals, the
  tensor/pipeline split. They may differ only with ``TrainConfig.allow_safe_changes=True``.
- Every other field changes the result (model and its overrides, optimiser, schedule, batch,
  masking, precision, sharding, seed, ...), as do the data's shard hashes, the tokenizer hash
  and the sequence length: such a resume is refused.

The refusal is one line naming every differing field with both values. Earlier configurations
are kept: before a different config.json is written, the old one is moved to
``configs/config-<k>.json`` (k = 1, 2, ...).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from labkit.io import sha256_bytes

__all__ = ["FREE_FIELDS", "SAFE_FIELDS", "check_resume", "config_drift", "data_identity", "model_config_of",
           "save_run_config"]

FREE_FIELDS = frozenset({"run_dir", "data_dir", "tokenizer_path", "num_workers", "num_threads", "backend",
                         "timeout_s", "verify_data", "resume", "allow_safe_changes", "stop_after", "trackers",
                         "provenance"})
"""TrainConfig fields that never change a run's result."""

SAFE_FIELDS = frozenset({"max_steps", "checkpoints", "log_every", "ckpt_every", "keep_checkpoints", "eval_every",
                         "eval_sequences", "eval_batch_size", "timing_warmup_steps",
                         "tp", "pp", "pp_schedule", "pp_virtual_stages", "sequence_parallel"})
"""TrainConfig fields that may change on resume with ``allow_safe_changes=True``. The model-parallel
split changes how a step is computed, not what (the same loss to rounding; a split checkpoint
loads at another split with the same dp, ``labkit.train.parallel.refuse_checkpoint``)."""


def data_identity(index: dict) -> dict[str, Any]:
    """What a shard set is, from its ``index.json`` dict: {"data_sha256" (sha256 of the ordered
    shard sha256s, held-out file included), "tokenizer_sha256", "seq_len", "vocab_size"}."""
    files = [s["sha256"] for s in index["shards"]] + [s["sha256"] for s in index.get("heldout", {}).get("shards", [])]
    return {"data_sha256": sha256_bytes(json.dumps(files).encode()),
            "tokenizer_sha256": index["tokenizer_sha256"], "seq_len": index["seq_len"],
            "vocab_size": index["vocab_size"]}


def config_drift(saved: dict, new: dict, saved_data: dict | None, new_data: dict, *,
                 allow_safe_changes: bool) -> list[str]:
    """The differences that forbid a resume, each "field: old -> new": result-changing
    ``TrainConfig`` fields and data identity fields always, ``SAFE_FIELDS`` unless
    ``allow_safe_changes``. ``saved``/``new``: ``to_dict`` of the configs; ``saved_data`` None
    (a run directory from before data.json) skips the data comparison."""
    out = []
    for key in sorted(set(saved) | set(new)):
        if key in FREE_FIELDS or (allow_safe_changes and key in SAFE_FIELDS) or key not in saved:
            continue  # a field missing from the saved config is newer than the run: not compared
        if saved.get(key) != new.get(key):
            out.append(f"{key}: {saved.get(key)!r} -> {new.get(key)!r}")
    for key in sorted(new_data) if saved_data is not None else ():
        if saved_data.get(key) != new_data[key]:
            out.append(f"{key}: {saved_data.get(key)!r} -> {new_data[key]!r}")
    return out


def check_resume(run_dir: str | os.PathLike, new: dict, new_data: dict, *, allow_safe_changes: bool) -> None:
    """Raise ValueError (one line) when ``run_dir``'s saved config.json / data.json differ from
    ``new`` / ``new_data`` in a way ``config_drift`` forbids; nothing when they agree or when
    there is no saved config."""
    run_dir = pathlib.Path(run_dir)
    path = run_dir / "config.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text())
    data_path = run_dir / "data.json"
    saved_data = json.loads(data_path.read_text()) if data_path.exists() else None
    drift = config_drift(saved, new, saved_data, new_data, allow_safe_changes=allow_safe_changes)
    if drift:
        safe_only = all(d.split(":")[0] in SAFE_FIELDS for d in drift)
        hint = ("set allow_safe_changes=True (on the command line: --set train.allow_safe_changes=true) to resume "
                "with them" if safe_only else "use another run_dir (--set train.run_dir=...), or resume=False to "
                "start over")
        raise ValueError(f"resume: {run_dir} was started with another configuration: {'; '.join(drift)} ({hint})")


def _comparable(config: dict) -> dict:
    """A saved config without its provenance record (host, device, times: different every run)."""
    return {k: v for k, v in config.items() if k != "provenance"}


def save_run_config(run_dir: str | os.PathLike, new: dict, new_data: dict, write_json) -> None:
    """Write config.json and data.json into ``run_dir`` with ``write_json(path, obj)`` (atomic);
    a config.json that differs from ``new`` is first moved to configs/config-<k>.json."""
    run_dir = pathlib.Path(run_dir)
    path = run_dir / "config.json"
    if path.exists():
        old = json.loads(path.read_text())
        if _comparable(old) != _comparable(new):
            history = run_dir / "configs"
            history.mkdir(exist_ok=True)
            k = 1 + max((int(p.stem.split("-")[1]) for p in history.glob("config-*.json")
                         if p.stem.split("-")[1].isdigit()), default=0)
            write_json(history / f"config-{k}.json", old)
    write_json(path, new)
    write_json(run_dir / "data.json", new_data)


def model_config_of(cfg: Any, vocab_size: int) -> Any:
    """The ``ModelConfig`` a run of ``cfg`` (a ``TrainConfig``) builds for a vocabulary of
    ``vocab_size``: the preset ``cfg.model`` with ``cfg.model_overrides``, and activation
    checkpointing on when ``cfg.activation_checkpointing`` is set. The one place the rule is
    written (training and export both build the model from it)."""
    from labkit.model import model_config

    overrides = {**cfg.model_overrides, **({"activation_checkpointing": True} if cfg.activation_checkpointing else {})}
    return model_config(cfg.model, vocab_size, **overrides)
