"""Packing encoded documents into fixed-length rows and shard files, one group of parts per engine.

Two modes (``ShardConfig.packing``; ``labkit.data.shards`` describes the format). "packed" (HF
``run_mlm.py`` grouping plus BERT's specials): documents' ids back to back, each followed by
[SEP]; the stream cut into rows of ``seq_len - 1`` tokens, each prefixed by [CLS]; the last
partial row padded with [PAD]. "padded" (the study's: one function per sample, padded and
truncated to the sequence length): one row per document with at least one token, its first
``seq_len`` ids then [PAD] (``pad_rows``); no [CLS] or [SEP].

Parallel packing: the document rows are cut into ``groups`` contiguous ranges (``group_rows``),
whatever the encoded parts (row ranges each engine encoded) are. Each group is one stream of its own, so its row
and shard counts follow from the token counts alone (``plan_groups``) before anything is
packed: group g writes shards ``first_shard .. first_shard + n_shards - 1`` and nothing else,
and any engine can pack any group (``pack_group``). A group's last row is padded and its last
shard may be short. The output is a pure function of the documents, the tokenizer, the packing
settings and the group count; for any group count the shards hold the same multiset of
document tokens (only where rows break, and so [CLS]/[PAD] counts, differ). One group is the
former single-stream packing, byte for byte.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from labkit.config import SPECIAL_TOKENS
from labkit.io import atomic_write_bytes, sha256_bytes, sha256_file

__all__ = ["SLICE_DOCS", "doc_stream", "group_rows", "pack_documents", "pack_group", "pack_rows", "pad_rows",
           "plan_groups", "with_seps"]

PAD_ID, CLS_ID, SEP_ID = (SPECIAL_TOKENS.index(t) for t in ("[PAD]", "[CLS]", "[SEP]"))
SLICE_DOCS = 4096
"""Documents of a part read and packed at once by ``pack_group`` (bounds its memory)."""


def doc_stream(ids_per_doc: list) -> np.ndarray:
    """Concatenate documents' ids (sequences of ints), each followed by [SEP]: int64 [sum(len)+n].
    ``np.fromiter`` over ``itertools.chain`` keeps the per-token loop in C."""
    lengths = np.fromiter((len(d) for d in ids_per_doc), dtype=np.int64, count=len(ids_per_doc))
    flat = np.fromiter(itertools.chain.from_iterable(ids_per_doc), dtype=np.int64, count=int(lengths.sum()))
    return with_seps(flat, lengths)


def with_seps(flat: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Documents' ids back to back (``flat``) with [SEP] inserted after each: int64 [len(flat) + len(lens)]."""
    out = np.full(len(flat) + len(lens), SEP_ID, dtype=np.int64)
    is_token = np.ones(len(out), dtype=bool)
    is_token[np.cumsum(lens + 1) - 1] = False  # the [SEP] after each document
    out[is_token] = flat
    return out


def pack_rows(stream: np.ndarray, seq_len: int, *, final: bool) -> tuple[np.ndarray, np.ndarray]:
    """Cut ``stream`` (1-D ids) into rows ``[n, seq_len]``: [CLS] + ``seq_len - 1`` stream tokens.
    Returns (rows, rest): with ``final=False`` the incomplete tail is returned as ``rest`` (the
    carry-over into the next batch); with ``final=True`` it becomes one [PAD]-padded row and
    ``rest`` is empty."""
    body = seq_len - 1
    n = len(stream) // body
    if final and len(stream) % body:
        stream = np.concatenate([stream, np.full(body - len(stream) % body, PAD_ID, dtype=stream.dtype)])
        n += 1
    rows = np.empty((n, seq_len), dtype=stream.dtype)
    rows[:, 0] = CLS_ID
    rows[:, 1:] = stream[: n * body].reshape(n, body)  # [n * body] -> [n, body]
    return rows, stream[n * body:]


def pad_rows(flat: np.ndarray, lens: np.ndarray, seq_len: int) -> np.ndarray:
    """One row per document, int64 [len(lens), seq_len]: document d's first min(lens[d], seq_len)
    ids of ``flat`` (the documents back to back), then [PAD]. The study's samples (undertale
    be7ec98, tokenizer.py ``load``: ``enable_padding(length=512)``, ``enable_truncation(512)``)."""
    lens = np.asarray(lens, dtype=np.int64)
    rows = np.full((len(lens), seq_len), PAD_ID, dtype=np.int64)
    kept = np.minimum(lens, seq_len)
    pos = np.arange(int(kept.sum())) - np.repeat(np.cumsum(kept) - kept, kept)  # position in its row
    doc = np.repeat(np.arange(len(lens)), kept)
    rows[doc, pos] = flat[np.repeat(np.cumsum(lens) - lens, kept) + pos]
    return rows


def pack_documents(ids_per_doc: list, seq_len: int) -> np.ndarray:
    """The packed rows ``[n_sequences, seq_len]`` (int64) of whole documents, as written to shards."""
    return pack_rows(doc_stream(ids_per_doc), seq_len, final=True)[0]


def group_rows(n_rows: int, groups: int) -> list[tuple[int, int]]:
    """Contiguous document row ranges ``[(start, stop), ...]``, ``min(groups, n_rows)`` of them
    (at least one), sizes differing by at most one: the packing groups, fixed by the row count
    and the group count alone (not by how the rows were encoded in parts)."""
    g = max(1, min(groups, n_rows))
    bounds = [n_rows * i // g for i in range(g + 1)]
    return list(zip(bounds, bounds[1:]))


def plan_groups(parts: list[dict], lengths: np.ndarray, keep: np.ndarray, seq_len: int, rows_per_shard: int,
                groups: int, *, packing: str = "packed") -> list[dict]:
    """Rows and shards of each packing group before packing. ``parts``: ``encode_part`` markers
    sorted by row (they tile the rows); ``lengths`` (int64 [n_rows], tokens per row, -1 for
    none) and ``keep`` (bool [n_rows]) over all rows. "packed": a group's stream has the kept
    documents' tokens plus one [SEP] each, so ceil(that / (seq_len - 1)) rows; "padded": one row
    per kept document with a token. Then ceil(rows / rows_per_shard) shards. Returns [{"start",
    "stop" (rows), "parts": [indices of the parts overlapping them], "n_rows", "first_shard",
    "n_shards"}, ...]."""
    out, first = [], 0
    for a, b in group_rows(len(lengths), groups):
        sel = keep[a:b]
        stream = int(lengths[a:b][sel].sum()) + int(sel.sum())
        n_rows = -(-stream // (seq_len - 1)) if packing == "packed" else int((sel & (lengths[a:b] > 0)).sum())
        n_shards = -(-n_rows // rows_per_shard)
        overlap = [i for i, p in enumerate(parts) if p["start"] < b and p["stop"] > a]
        out.append({"start": a, "stop": b, "parts": overlap, "n_rows": n_rows, "first_shard": first,
                    "n_shards": n_shards})
        first += n_shards
    return out


def _write_shard(plan: dict, k: int, block: np.ndarray) -> dict:
    """Write shard k (unless its marker names this plan and the file holds these bytes); its info."""
    out, parts_dir = Path(plan["out_dir"]), Path(plan["parts_dir"])
    name = f"shard-{k:05d}.bin"
    marker = parts_dir / f"shard-{k:05d}.json"
    data = np.ascontiguousarray(block, dtype=np.dtype(plan["dtype"]).newbyteorder("<")).tobytes()
    sha = sha256_bytes(data)
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        info = None
    if not (info and info.get("plan") == plan["hash"] and info.get("sha256") == sha and (out / name).is_file()
            and (out / name).stat().st_size == len(data) and sha256_file(out / name) == sha):
        marker.unlink(missing_ok=True)
        atomic_write_bytes(out / name, data)
        info = {"plan": plan["hash"], "file": name, "n_sequences": len(block), "n_bytes": len(data), "sha256": sha,
                "n_tokens": int(np.count_nonzero(block != PAD_ID))}
        atomic_write_bytes(marker, (json.dumps(info) + "\n").encode())
    return info


def pack_group(plan: dict, group: int) -> list[dict]:
    """Pack the parts of ``plan["groups"][group]`` (a plan from ``labkit.data.shards.plan_shards``)
    into its shards, in part order; what each engine runs. A shard whose marker
    (``<parts_dir>/shard-<k>.json``) names this plan and whose file has the bytes it would
    write is not written again. Returns the shards' infos {"plan", "file", "n_sequences",
    "n_bytes", "sha256", "n_tokens"} in order. Memory: ``SLICE_DOCS`` documents' ids plus one
    shard of rows, whatever the part and corpus sizes."""
    g = plan["groups"][group]
    seq_len, per_shard = plan["seq_len"], plan["rows_per_shard"]
    padded = plan.get("packing", "packed") == "padded"
    keep = np.load(plan["keep_path"], mmap_mode="r")
    dtype = np.dtype(plan["dtype"])
    shards: list[dict] = []
    pending = np.empty((0, seq_len), dtype=dtype)
    carry = np.empty(0, dtype=np.int64)

    def flush(rows: np.ndarray, final: bool) -> np.ndarray:
        while len(rows) >= per_shard or (final and len(rows)):
            shards.append(_write_shard(plan, g["first_shard"] + len(shards), rows[:per_shard]))
            rows = rows[per_shard:]
        return rows

    for i in g["parts"]:
        p = plan["parts"][i]
        lens = np.fromfile(Path(p["dir"]) / p["lens"]["file"], dtype="<i4").astype(np.int64)
        rows = np.arange(p["start"], p["stop"])
        sel = np.asarray(keep[p["start"]:p["stop"]]) & (rows >= g["start"]) & (rows < g["stop"])
        ids_dtype = np.dtype(p["dtype"]).newbyteorder("<")
        first_token = np.concatenate([[0], np.cumsum(np.maximum(lens, 0))])  # [rows + 1]
        for a in range(0, len(lens), SLICE_DOCS):  # the stream is cut the same wherever slices end
            b = min(a + SLICE_DOCS, len(lens))
            if not sel[a:b].any():
                continue
            n_tokens, skip = int(first_token[b] - first_token[a]), int(first_token[a]) * ids_dtype.itemsize
            ids = np.fromfile(Path(p["dir"]) / p["ids"]["file"], dtype=ids_dtype, count=n_tokens, offset=skip)
            token_keep = np.repeat(sel[a:b], np.maximum(lens[a:b], 0))  # [tokens of rows a..b]
            if padded:  # one row per document with a token, no carry-over
                doc_lens = lens[a:b][sel[a:b]]
                packed = pad_rows(ids[token_keep].astype(np.int64), doc_lens, seq_len)[doc_lens > 0]
            else:
                stream = np.concatenate([carry, with_seps(ids[token_keep].astype(np.int64), lens[a:b][sel[a:b]])])
                packed, carry = pack_rows(stream, seq_len, final=False)
            pending = flush(np.concatenate([pending, packed.astype(dtype)]), final=False)
    flush(np.concatenate([pending, pack_rows(carry, seq_len, final=True)[0].astype(dtype)]), final=True)
    if len(shards) != g["n_shards"]:
        raise RuntimeError(f"pack_group {group}: wrote {len(shards)} shards, planned {g['n_shards']}")
    return shards
