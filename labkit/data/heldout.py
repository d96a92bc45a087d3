"""The held-out split of a shard set: whole documents set aside for evaluation.

Rule (deterministic, by document): document row r of the documents file is held out iff
``numpy.random.default_rng(seed).random(n_rows)[r] < fraction`` and it was kept by the
balancing selection. Held-out documents are removed from the training shards and packed, by
the same rule as the shards (``labkit.data.pack``: "packed", [CLS] + ids, [SEP] after each
document, the last row [PAD]-padded; or "padded", one document per row), into one file ``heldout-00000.bin`` beside them, so no
document has tokens on both sides. ``index.json`` records it under "heldout":

    {"rule", "fraction", "seed", "n_documents", "n_sequences", "n_tokens",
     "shards": [{"file", "n_sequences", "n_bytes", "sha256"}]}

The training shards' ``n_documents`` etc. count the training side only. ``fraction`` 0 (or a
corpus so small that no document is drawn) writes no held-out file and no "heldout" key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from labkit.data.pack import PAD_ID, pack_rows, pad_rows, with_seps
from labkit.io import atomic_write_bytes, sha256_bytes

__all__ = ["HELDOUT_FILE", "RULE", "heldout_documents", "HeldoutError", "read_heldout", "split_keep", "write_heldout"]

HELDOUT_FILE = "heldout-00000.bin"
RULE = "document row r is held out iff numpy.random.default_rng(seed).random(n_rows)[r] < fraction"


def heldout_documents(n_rows: int, fraction: float, seed: int) -> np.ndarray:
    """bool [n_rows]: True for the document rows drawn into the held-out split (see the module
    rule). Depends only on (n_rows, fraction, seed). ValueError unless 0 <= fraction < 1."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"heldout_fraction: must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return np.zeros(n_rows, dtype=bool)
    return np.random.default_rng(seed).random(n_rows) < fraction


def split_keep(keep: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout) bool masks over document rows from the balancing selection ``keep``:
    disjoint, and together exactly ``keep``."""
    drawn = heldout_documents(len(keep), fraction, seed)
    return keep & ~drawn, keep & drawn


def write_heldout(parts: list[dict], lengths: np.ndarray, heldout: np.ndarray, out_dir: str | os.PathLike, *,
                  seq_len: int, dtype: np.dtype, fraction: float, seed: int, packing: str = "packed") -> dict | None:
    """Pack the ``heldout`` documents (bool mask over rows) of the encoded ``parts`` (markers of
    ``labkit.data.shards.encode_part``, sorted by start) into ``out_dir/heldout-00000.bin``
    (``packing`` as the training shards: "packed" or "padded", ``labkit.data.pack``),
    written atomically; returns the index entry (module docstring) or None when no document is
    held out (a stale file is removed). ``lengths``: int64 [n_rows] ids per row (-1 = null text)."""
    path = Path(out_dir) / HELDOUT_FILE
    if not heldout.any():
        path.unlink(missing_ok=True)
        return None
    streams = []
    for p in parts:
        lens, sel = lengths[p["start"]:p["stop"]], heldout[p["start"]:p["stop"]]
        if not sel.any():
            continue
        valid = lens >= 0
        ids = np.fromfile(Path(p["dir"]) / p["ids"]["file"], dtype=np.dtype(p["dtype"]).newbyteorder("<"))
        token_keep = np.repeat(sel[valid], lens[valid])
        if packing == "padded":
            streams.append(pad_rows(ids[token_keep].astype(np.int64), lens[sel], seq_len)[lens[sel] > 0])
        else:
            streams.append(with_seps(ids[token_keep].astype(np.int64), lens[sel]))
    rows = np.concatenate(streams) if packing == "padded" else pack_rows(np.concatenate(streams), seq_len, final=True)[0]
    data = np.ascontiguousarray(rows, dtype=dtype).tobytes()
    atomic_write_bytes(path, data)
    return {"rule": RULE, "fraction": fraction, "seed": seed, "n_documents": int(heldout.sum()),
            "n_sequences": len(rows), "n_tokens": int(np.count_nonzero(rows != PAD_ID)),
            "shards": [{"file": HELDOUT_FILE, "n_sequences": len(rows), "n_bytes": len(data),
                        "sha256": sha256_bytes(data)}]}


class HeldoutError(ValueError):
    """A shard set has no held-out split, or its file is not as index.json says."""


def read_heldout(data, max_sequences: int | None = None) -> np.ndarray:
    """The held-out sequences of a shard set: array [n, seq_len] of the index's dtype, the first
    ``max_sequences`` rows when given. ``data``: the set's directory, or a
    ``labkit.data.shards.ShardSet`` already opened (``ShardSet.heldout_rows``: its index is not
    read again, and a file changed since the set was opened raises ``ShardError`` naming it).
    ``HeldoutError`` (a ValueError) when the index records no held-out split, or its file is
    missing or of another size than the index says; the index itself is checked by
    ``labkit.data.shards.read_index`` before training."""
    if hasattr(data, "heldout_rows"):  # a ShardSet (labkit.data.shards imports this module)
        return data.heldout_rows(max_sequences)
    data_dir = data
    index = json.loads((Path(data_dir) / "index.json").read_text())
    entry = index.get("heldout")
    if not entry:
        raise HeldoutError(f"{Path(data_dir) / 'index.json'}: no held-out split (rebuild the shards with "
                         "ShardConfig.heldout_fraction > 0, or set eval_every=0)")
    shard = entry["shards"][0]
    path = Path(data_dir) / shard["file"]
    if not path.is_file() or path.stat().st_size != shard["n_bytes"]:
        raise HeldoutError(f"{path}: held-out file missing or not {shard['n_bytes']} bytes as index.json says")
    rows = np.fromfile(path, dtype=np.dtype(index["dtype"]).newbyteorder("<")).reshape(-1, index["seq_len"])
    return rows[:max_sequences] if max_sequences else rows
