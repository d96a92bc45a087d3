"""What made an artifact: the settings that shaped it and the identity of its inputs.

Every stage of the lab (corpus, clean and dedup, tokenizer, shards, each sweep point) writes a
``made_by`` record with its artifact, inside the metadata file it already writes last
(``corpus.json``, ``docs.drops.json``, ``tokenizer.stats.json``, ``shards.parts/config.json``,
a sweep table's ``made_by`` column), so the record and the artifact are completed by the same
atomic rename (``labkit.io``)::

    {"stage": "tokenizer", "settings": {"vocab_size": 1024, ...},
     "inputs": {"clean": "<sha256 of docs.drops.json>"}, "made_at": "2026-12-01T18:00:00+00:00",
     "load_avg_1m": 0.4, "cpu_count": 2}

An input's identity is the sha256 of the file its stage wrote last (its statistics, which hold
the stage's wall time, so a rebuilt input never hashes like the old one), or for the corpus the
path, size and modification time of every input file found.

On the next run ``reuse`` compares the saved record with the one the stage would write now:
equal settings and inputs reuse the artifact (one line saying so, and when it was made);
anything else rebuilds it, with one line naming each change (``tokenizer: vocab_size 1024 ->
512, rebuilding``). Data artifacts are rebuilt, never refused: each is a pure function of its
record, so changing the setting back rebuilds the old one. What cannot be rebuilt by a setting
-- a finished training run -- is protected instead (``labkit.train.run_config.finished_run``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any, Iterable

from labkit.io import sha256_file

__all__ = ["changes", "describe", "file_identity", "files_identity", "plain", "read_record", "record", "reuse", "say"]


def _now_iso() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _load() -> dict[str, Any]:
    """This host's 1-minute load average and usable CPU count (when the artifact was made)."""
    one = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"load_avg_1m": None if one is None else round(one, 2), "cpu_count": cpus}


def plain(obj: Any) -> Any:
    """``obj`` as JSON holds it (tuples as lists, paths as strings), so a saved record and a new
    one compare equal when their settings are equal."""
    return json.loads(json.dumps(obj, default=str))


def record(stage: str, settings: dict, inputs: dict[str, Any]) -> dict[str, Any]:
    """The ``made_by`` record of an artifact of ``stage`` made now from ``settings`` (a dict of
    the settings that shape the bytes, e.g. ``labkit.config.to_dict(cfg)``) and ``inputs``
    ({name: identity}: sha256 hex digests or small dicts). Adds ``made_at`` (ISO 8601 UTC) and
    the host's load (``load_avg_1m``, ``cpu_count``)."""
    return {"stage": stage, "settings": plain(settings), "inputs": plain(inputs), "made_at": _now_iso(), **_load()}


def file_identity(path: str | os.PathLike) -> str | None:
    """sha256 hex digest of the file at ``path`` (None when it does not exist)."""
    return sha256_file(path) if os.path.isfile(path) else None


def files_identity(files: Iterable[str | os.PathLike]) -> dict[str, Any]:
    """The identity of a list of input files without reading them: ``{"files": n, "sha256":
    sha256 of the sorted (path, size, mtime_ns) triples}``. A file added, removed, replaced or
    modified changes it; a missing file counts with size and mtime -1."""
    entries = []
    for f in files:
        try:
            st = os.stat(f)
            entries.append((str(f), st.st_size, st.st_mtime_ns))
        except OSError:
            entries.append((str(f), -1, -1))
    entries.sort()
    return {"files": len(entries), "sha256": hashlib.sha256(json.dumps(entries).encode()).hexdigest()}


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: d}


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 120 else text[:58] + "..." + text[-58:]


def changes(old: dict | None, new: dict) -> list[str]:
    """What differs between a saved ``made_by`` record ``old`` and ``new``, one phrase each:
    ``"vocab_size 1024 -> 512"`` for a setting (nested keys dotted: ``near_dedup.threshold``),
    ``"input clean changed"`` for an input. ``old`` None (an artifact made before records were
    kept, or by an unfinished run): ``["no record of its settings"]``. Empty when they agree."""
    if not old or "settings" not in old:
        return ["no record of its settings"]
    out = []
    a, b = _flat(old.get("settings", {})), _flat(new["settings"])
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            out.append(f"{key} {_short(a.get(key, '<unset>'))} -> {_short(b.get(key, '<unset>'))}")
    ins_a, ins_b = old.get("inputs", {}), new["inputs"]
    for key in sorted(set(ins_a) | set(ins_b)):
        if ins_a.get(key) != ins_b.get(key):
            out.append(f"input {key} changed")
    return out


def describe(old: dict) -> str:
    """When and at what load a saved record was made: ``"made 2026-12-01T18:00:00+00:00 at load
    0.4 on 2 CPUs"``."""
    load = old.get("load_avg_1m")
    at = f" at load {load} on {old.get('cpu_count')} CPUs" if load is not None else ""
    return f"made {old.get('made_at', 'at an unknown time')}{at}"


def say(message: str) -> None:
    """One line on stderr (stdout stays the command's JSON or table)."""
    print(message, file=sys.stderr, flush=True)


def reuse(stage: str, where: str, old: dict | None, new: dict, *, force: bool = False) -> bool:
    """Whether the artifact of ``stage`` at ``where`` (its saved record ``old``; None: none, or
    no complete artifact) may be reused for the record ``new``; prints one line either way:
    ``tokenizer: reusing work/x/tokenizer (same settings and inputs; made ...)`` or
    ``tokenizer: vocab_size 1024 -> 512, rebuilding``. ``force`` always rebuilds."""
    if force:
        say(f"{stage}: --force, rebuilding {where}")
        return False
    diff = changes(old, new)
    if not diff:
        say(f"{stage}: reusing {where} (same settings and inputs; {describe(old or {})})")
        return True
    say(f"{stage}: {'; '.join(diff)}, rebuilding")
    return False


def read_record(path: str | os.PathLike, key: str = "made_by") -> dict | None:
    """The ``made_by`` record inside the JSON file at ``path`` (``key``), None when the file is
    missing, unreadable or has none."""
    try:
        with open(path) as f:
            return json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
