"""The configuration a run directory was started with, and the refusal to resume it under another.

A run directory keeps ``config.json`` (the ``TrainConfig``) and ``data.json`` (what the
run's data was: ``data_identity``). Resuming from one of its checkpoints compares both with
the new run's, field by field (``config_drift``, on dotted names such as ``optim.lr``; a
config.json from before the sections, with flat names, reads the same through
``labkit.config.dotted``). Each field declares in its metadata whether it may change
(``labkit.config.resume_policy``):

- ``FREE_FIELDS`` never matter: where things are (run_dir, data_dir, data.tokenizer_path; the
  data and tokenizer themselves are compared by hash instead), how the process runs (threads,
  loader workers, backend, timeout, verification, metric trackers, asynchronous checkpoints),
  ``stop_after`` (a simulated interruption: the schedule follows max_steps), the resume switches,
  and the records config.json carries besides the fields (provenance, run_id).
- ``SAFE_FIELDS`` change what is logged, saved or how far the run goes, not the steps already
  taken: more steps (``max_steps``; with a decaying schedule the LR of the remaining steps
  follows the new max_steps), log, checkpoint and evaluation settings, the split and the
  data-parallel sharding. They may differ only with ``TrainConfig.allow_safe_changes=True``.
- Every other field changes the result (model and its overrides, optimiser, schedule, batch,
  masking, precision, seed, ...), as do the data's shard hashes, the tokenizer hash and the
  sequence length: such a resume is refused.

The refusal is one line naming every differing field with both values. Earlier configurations
are kept: before a different config.json is written, the old one is moved to
``configs/config-<k>.json`` (k = 1, 2, ...).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from labkit.config import dotted, resume_policy
from labkit.io import sha256_bytes

__all__ = [
    "FREE_FIELDS", "SAFE_FIELDS", "check_resume", "config_drift", "data_identity", "model_config_of",
    "save_run_config", "finished_run", "trained_seconds", "with_segments"
]

FREE_FIELDS = frozenset({k for k, v in resume_policy().items() if v == "free"} | {"provenance", "run_id"})
"""TrainConfig fields (dotted) that never change a run's result, and config.json's other records."""

SAFE_FIELDS = frozenset(k for k, v in resume_policy().items() if v == "safe")
"""TrainConfig fields (dotted) that may change on resume with ``allow_safe_changes=True``. The
model-parallel split and the data-parallel sharding change how a step is computed, not what (the
same loss to rounding: a checkpoint loads at another split, sharding or world size, with the
global batch kept, ``labkit.train.checkpoint.Checkpointer.load``)."""


def data_identity(index: dict) -> dict[str, Any]:
    """What a shard set is, from its ``index.json`` dict: {"data_sha256" (sha256 of the ordered
    shard sha256s, held-out file included), "tokenizer_sha256", "seq_len", "vocab_size"}."""
    files = [s["sha256"] for s in index["shards"]] + [s["sha256"] for s in index.get("heldout", {}).get("shards", [])]
    return {"data_sha256": sha256_bytes(json.dumps(files).encode()),
            "tokenizer_sha256": index["tokenizer_sha256"], "seq_len": index["seq_len"],
            "vocab_size": index["vocab_size"]}


def config_drift(saved: dict, new: dict, saved_data: dict | None, new_data: dict, *,
                 allow_safe_changes: bool, free: frozenset[str] = frozenset()) -> list[str]:
    """The differences that forbid a resume, each "field: old -> new" (fields dotted, sorted):
    result-changing ``TrainConfig`` fields and data identity fields always, ``SAFE_FIELDS`` unless
    ``allow_safe_changes``. ``saved``/``new``: ``to_dict`` of the configs (a saved one may have the
    flat names of before the sections); ``saved_data`` None (a run directory from before
    data.json) skips the data comparison; ``free``: more dotted fields not compared."""
    saved, new = (dotted(json.loads(json.dumps(c))) for c in (saved, new))  # as config.json holds them: lists
    out = []
    for key in sorted(set(saved) | set(new)):
        if key in FREE_FIELDS or key in free or (allow_safe_changes and key in SAFE_FIELDS) or key not in saved:
            continue  # a field missing from the saved config is newer than the run: not compared
        if saved.get(key) != new.get(key):
            out.append(f"{key}: {saved.get(key)!r} -> {new.get(key)!r}")
    for key in sorted(new_data) if saved_data is not None else ():
        if saved_data.get(key) != new_data[key]:
            out.append(f"{key}: {saved_data.get(key)!r} -> {new_data[key]!r}")
    return out


def check_resume(run_dir: str | os.PathLike, new: dict, new_data: dict, *, allow_safe_changes: bool,
                 same_global_batch: bool = False) -> None:
    """Raise ValueError (one line) when ``run_dir``'s saved config.json / data.json differ from
    ``new`` / ``new_data`` in a way ``config_drift`` forbids; nothing when they agree or when
    there is no saved config. ``same_global_batch``: the new run's micro-batch x accumulation x dp
    is the checkpoint's global batch, so ``batch.grad_accum_steps`` may differ (the same step,
    split differently: a move to another dp that sets it by hand)."""
    run_dir = pathlib.Path(run_dir)
    path = run_dir / "config.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text())
    data_path = run_dir / "data.json"
    saved_data = json.loads(data_path.read_text()) if data_path.exists() else None
    drift = config_drift(saved, new, saved_data, new_data, allow_safe_changes=allow_safe_changes,
                         free=frozenset({"batch.grad_accum_steps"} if same_global_batch else ()))
    if drift:
        safe_only = all(d.split(":")[0] in SAFE_FIELDS for d in drift)
        hint = ("set allow_safe_changes=True (on the command line: --set train.allow_safe_changes=true) to resume "
                "with them" if safe_only else "use another run_dir (--set train.run_dir=...), or resume=False to "
                f"start a new run there (the old run's files move to {run_dir / 'previous'}/)")
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


# ------------------------------------------------------------------------------------------
# A finished run is never redone, and a continued one is summed over its segments
# ------------------------------------------------------------------------------------------


def finished_run(cfg: Any, *, say: bool = True) -> dict | None:
    """The saved result of ``cfg.run_dir`` when it holds a finished run of this same config,
    else None. Finished: result.json exists, its ``steps`` equals its ``max_steps`` and
    ``cfg.max_steps``, and ``cfg.stop_after`` does not stop earlier. Same config: config.json
    differs from ``to_dict(cfg)`` in no field but ``FREE_FIELDS`` (``resume`` among them), and
    data.json equals the identity of ``cfg.data_dir``'s shard set (``data_identity``).

    Called before anything is opened or written (``labkit.train.loop.train``; ``labkit train``
    before it starts engines), for a config with ``resume=True`` only (``resume=False`` asks for
    a new run: the finished one is moved aside, ``checkpoint.plan_run``): training it again would
    only overwrite result.json with the numbers of zero steps. Nothing is written or touched; with ``say`` one line on stderr says
    so and how to train further (``max_steps`` and ``allow_safe_changes`` on resume). A changed
    config is not finished: it goes on to ``check_resume``, which refuses or continues it."""
    from labkit.config import to_dict
    from labkit.data.shards import ShardError, read_index

    run_dir = pathlib.Path(cfg.run_dir)
    try:
        result = json.loads((run_dir / "result.json").read_text())
        saved = json.loads((run_dir / "config.json").read_text())
        saved_data = json.loads((run_dir / "data.json").read_text())
        identity = data_identity(read_index(cfg.data_dir))
    except (OSError, ValueError, KeyError, ShardError):
        return None
    stop = min(cfg.max_steps, cfg.stop_after or cfg.max_steps)
    if not (result.get("steps") == result.get("max_steps") == cfg.max_steps == stop):
        return None
    if config_drift(saved, to_dict(cfg), saved_data, identity, allow_safe_changes=False):
        return None
    if say and _is_main():
        import sys

        end = (result.get("provenance") or {}).get("end_time")
        print(f"train: {run_dir} already finished ({result['steps']} of {cfg.max_steps} steps, ended {end}) with this "
              "config and data: nothing to do, every file left as is. To train further: labkit resume "
              f"{run_dir} --set train.max_steps=N --set train.allow_safe_changes=true", file=sys.stderr, flush=True)
    return result


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


SEGMENT_FIELDS = ("start_step", "end_step", "start_time", "end_time", "command", "wall_s", "world_size",
                  "timed_steps", "timed_seconds", "tokens_per_s", "samples_per_s", "data_wait_fraction",
                  "comm_exposed_s", "mfu", "packing_efficiency")
"""What result.json's ``segments`` keeps of each invocation of a run."""


def _segment(result: dict, timing_warmup_steps: int) -> dict:
    """One invocation's segment from the result.json it wrote (its own means and times): the
    timed steps are its steps after ``timing_warmup_steps`` (all when it had no more), the timed
    seconds its ``timed_seconds`` (``timed_steps * global_batch_size / samples_per_s`` for a result
    written before that field: a batch ramp's global batch is its last one)."""
    prov = result.get("provenance") or {}
    start = result.get("resumed_from_step") or 0
    n = result["steps"] - start
    timed = n - timing_warmup_steps if n > timing_warmup_steps else n
    sps = result.get("samples_per_s")
    seconds = result.get("timed_seconds") or (timed * result["global_batch_size"] / sps if sps else 0.0)
    return {"start_step": start, "end_step": result["steps"], "start_time": prov.get("start_time"),
            "end_time": prov.get("end_time"), "command": prov.get("command"), "wall_s": result.get("wall_s"),
            "world_size": result.get("world_size"), "timed_steps": timed if sps else 0, "timed_seconds": seconds,
            **{k: result.get(k) for k in ("tokens_per_s", "samples_per_s", "data_wait_fraction", "comm_exposed_s",
                                          "mfu", "packing_efficiency")}}


def _segments_from_metrics(path: pathlib.Path, upto: int) -> list[dict]:
    """The segment of steps 1..``upto`` of a run interrupted before it wrote result.json, from
    the wall-clock ``time`` of its metric records (the first is logged after step 1, so the start
    is late by one step); no throughput (timed_seconds 0) and no command. [] without records."""
    import datetime

    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
    times = [r["time"] for r in records if r.get("step", upto + 1) <= upto and r.get("time") is not None]
    if not times:
        return []

    def iso(t: float) -> str:
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")

    return [{"start_step": 0, "end_step": upto, "start_time": iso(min(times)), "end_time": iso(max(times)),
             "command": None, "wall_s": max(times) - min(times), "world_size": records[-1].get("world_size"),
             "timed_steps": 0, "timed_seconds": 0.0, "tokens_per_s": None, "samples_per_s": None,
             "data_wait_fraction": None, "comm_exposed_s": None, "mfu": None, "packing_efficiency": None,
             "from": "metrics.jsonl"}]


def with_segments(run_dir: str | os.PathLike, result: dict, timing_warmup_steps: int) -> dict:
    """``result`` (this invocation's, about to be written to result.json) covering the whole run.

    Each invocation of a run is a segment (``SEGMENT_FIELDS``: its steps, start and end time,
    command, its own throughput means). A run resumed from step k keeps the segments of the run
    directory's previous result.json that began before k (the last one cut at k: its means are
    then unknown and not counted) and appends this one; ``result["segments"]`` lists them and
    ``result["provenance"]["segments"]`` their times and commands. The throughput fields become
    the whole run's, weighted by each segment's timed seconds: tokens_per_s = sum(tokens_per_s_i
    x s_i) / sum(s_i), likewise samples_per_s, data_wait_fraction, packing_efficiency (by timed
    samples) and mfu (tokens_per_s x the last timed segment's mfu / tokens_per_s, when the world
    size is unchanged); comm_exposed_s is the mean per timed step and comm_exposed_fraction its share of
    the timed time; wall_s the sum. A fresh run (not resumed) is one segment, its fields as is."""
    segments = []
    start = result.get("resumed_from_step") or 0
    if start:
        try:
            old = json.loads((pathlib.Path(run_dir) / "result.json").read_text())
        except (OSError, ValueError):
            old = None
        if old is not None and old.get("steps"):
            segments = [s for s in old.get("segments") or [_segment(old, timing_warmup_steps)]
                        if s["start_step"] < start]
        else:  # interrupted before it wrote a result: its times from its metric records
            segments = _segments_from_metrics(pathlib.Path(run_dir) / "metrics.jsonl", start)
            if segments and segments[-1]["end_step"] > start:  # cut at the checkpoint: its means are not this part's
                segments[-1] = segments[-1] | {"end_step": start, "timed_steps": 0, "timed_seconds": 0.0}
    segments.append(_segment(result, timing_warmup_steps))
    out = dict(result)
    out["segments"] = segments
    out["provenance"] = dict(result.get("provenance") or {}) | {
        "segments": [{k: s.get(k) for k in ("start_step", "end_step", "start_time", "end_time", "command")}
                     for s in segments]}
    if len(segments) == 1:
        return out
    timed = [s for s in segments if s["timed_seconds"] and s["tokens_per_s"] is not None]
    seconds = sum(s["timed_seconds"] for s in timed)
    out["wall_s"] = sum(s["wall_s"] or 0.0 for s in segments)
    if not seconds:
        return out

    def weighted(key: str) -> float | None:
        have = [s for s in timed if s.get(key) is not None]
        return sum(s[key] * s["timed_seconds"] for s in have) / sum(s["timed_seconds"] for s in have) if have else None

    tps = weighted("tokens_per_s")
    out |= {"tokens_per_s": tps, "samples_per_s": weighted("samples_per_s"),
            "data_wait_fraction": weighted("data_wait_fraction")}
    samples = [(s["samples_per_s"] * s["timed_seconds"], s) for s in timed if s.get("packing_efficiency") is not None]
    if samples:
        out["packing_efficiency"] = sum(n * s["packing_efficiency"] for n, s in samples) / sum(n for n, _ in samples)
    comm = [s for s in timed if s.get("comm_exposed_s") is not None]
    if comm:
        steps = sum(s["timed_steps"] for s in comm)
        total = sum(s["comm_exposed_s"] * s["timed_steps"] for s in comm)
        out["comm_exposed_s"] = total / steps if steps else None
        out["comm_exposed_fraction"] = total / sum(s["timed_seconds"] for s in comm)
    ref = next((s for s in reversed(timed) if s.get("mfu") is not None and s.get("tokens_per_s")), None)
    if ref is not None and all(s["world_size"] == ref["world_size"] for s in timed):  # mfu / tokens_per_s: fixed
        out["mfu"] = tps * ref["mfu"] / ref["tokens_per_s"]
    return out


def trained_seconds(result: dict) -> float | None:
    """Seconds a run spent training, summed over its segments (``with_segments``; each from its
    provenance start to end time); a result without segments counts its one start-to-end span.
    None when no time is recorded."""
    import datetime

    prov = result.get("provenance") or {}
    spans = prov.get("segments") or [prov]
    total, known = 0.0, False
    for s in spans:
        try:
            a = datetime.datetime.fromisoformat(s["start_time"])
            b = datetime.datetime.fromisoformat(s["end_time"])
        except (KeyError, TypeError, ValueError):
            continue
        total += (b - a).total_seconds()
        known = True
    return total if known else None
