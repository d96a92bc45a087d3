"""The labkit token-shard format: packed fixed-length sequences in flat binary files + index.json.

Layout of a shard directory::

    shard-00000.bin  shard-00001.bin  ...  index.json   (index.json written last)

- A shard is a flat little-endian array of token ids, dtype ``uint16`` when the vocabulary has
  at most 65,536 ids, else ``uint32``, shape ``[n_sequences, seq_len]`` row-major; every shard
  holds ``ShardConfig.sequences_per_shard`` rows except possibly the last.
- Rows, by ``ShardConfig.packing``. "packed" (default; HF ``run_mlm.py`` without
  ``line_by_line``, plus BERT's specials): the documents' ids (no special tokens) are
  concatenated in file order, each document followed by [SEP] (3); the stream is cut into rows
  of ``seq_len - 1`` tokens, each row prefixed by [CLS] (2); the last partial row is padded with
  [PAD] (0). A document may continue in the next row, and the documents of a row attend to each
  other. "padded" (the study's samples): one row per document with a token, its first
  ``seq_len`` ids then [PAD], no [CLS]/[SEP]; no attention across documents; a longer
  document's tail is dropped. Real tokens are the non-PAD ones; index.json's "packing" gives
  the mode, the packing efficiency (real tokens / positions), whether documents attend across
  boundaries and what truncation dropped (``packing_info``). The result does not depend on
  ``ShardConfig.batch_docs``.
- Writing (``write_shards``, or ``encode_part`` on engines + ``finish_shards``) encodes row
  ranges ("parts") into ``<out_dir>.parts/part-XXXXX.ids/.lens`` with a completion marker each, then packs
  them in one pass in row order; finished parts and shards are skipped by a re-run.
- ``index.json`` (fields in ``write_shards``) is written after every shard, by temp file +
  rename (``labkit.io``); its presence means the set is complete, and a directory without it is never
  read (``read_index`` raises ``ShardError``). Compare: mosaicml/streaming MDS ``index.json``,
  Megatron-LM ``.bin``/``.idx``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import polars as pl

from labkit.config import SPECIAL_TOKENS, ShardConfig
from labkit.data.heldout import split_keep, write_heldout
from labkit.io import atomic_write, atomic_write_bytes, atomic_write_npy, sha256_bytes, sha256_file
from labkit.data.pack import (CLS_ID, PAD_ID, SEP_ID, doc_stream, pack_documents, pack_group, pack_rows,  # noqa: F401
                              plan_groups)
from labkit.data.tokenize import (encode_flat, line_separable, load_tokenizer, process_line_cache, special_ids,
                                  text_row_count, tokenizer_sha256)

__all__ = [
    "CROSS_DOCUMENT_ATTENTION", "FORMAT", "INDEX_NAME", "VERSION", "check_entries", "check_shards",
    "check_tokenizer", "encode_part", "finish_shards", "id_bound", "packing_info", "packing_of", "parts_dir_for",
    "plan_parts", "plan_shards", "read_index", "rows_per_shard", "SequenceReader", "shard_dtype", "ShardError",
    "verify_shards", "write_index", "write_rows", "write_shards", "ShardSet", "load_index", "open_shards"
]

FORMAT = "labkit-shards"
VERSION = 1
INDEX_NAME = "index.json"
_REQUIRED = ("dtype", "seq_len", "vocab_size", "tokenizer_sha256", "special_ids", "n_documents",
             "n_sequences", "n_tokens", "n_bytes", "shards")
_SHARD_RE = re.compile(r"shard-\d{5}\.bin")
_TMP_RE = re.compile(r"\.(shard-\d{5}\.bin|index\.json)\..+\.tmp")  # labkit.io's temporary names


class ShardError(ValueError):
    """A shard set is incomplete, corrupt, or not the one expected; the message names the file
    or field."""


def shard_dtype(vocab_size: int) -> np.dtype:
    """Little-endian ``uint16`` when ids 0..vocab_size-1 fit (vocab_size <= 65536), else
    ``uint32``; ``ShardError`` when they fit neither (vocab_size > 2^32). Pass the largest id
    the tokenizer can emit plus one (``id_bound``), not its count of ids."""
    if vocab_size > 2**32:
        raise ShardError(f"vocab_size: ids up to {vocab_size - 1} fit neither uint16 nor uint32")
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def id_bound(tokenizer) -> int:
    """The largest id a HF ``tokenizers.Tokenizer`` can emit, plus one: what the shard dtype and
    a model's embedding must hold. Equals ``get_vocab_size()`` for a tokenizer with ids
    0..n-1; larger for one with gaps in its ids (a vocabulary edited by hand, merged or pruned)."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1



def parts_dir_for(out_dir: str | os.PathLike) -> Path:
    """Where the encoded parts and completion markers of ``out_dir`` live: the sibling directory
    ``<out_dir>.parts`` (outside the shard set, so copying or listing the set never sees them)."""
    out = Path(out_dir).absolute()
    return out.with_name(out.name + ".parts")


def plan_parts(n_docs: int, part_docs: int) -> list[tuple[int, int]]:
    """Row ranges ``[(start, stop), ...]`` of ``part_docs`` rows each (the last may be shorter)
    covering ``n_docs`` rows: the encoding parts, fixed by the input, not by the engines."""
    return [(s, min(s + part_docs, n_docs)) for s in range(0, n_docs, part_docs)]


def _part_files(parts_dir: Path, part: int) -> tuple[Path, Path, Path]:
    stem = f"part-{part:05d}"
    return parts_dir / f"{stem}.ids", parts_dir / f"{stem}.lens", parts_dir / f"{stem}.json"


def _part_is_done(marker: Path, start: int, stop: int, tok_sha: str) -> dict | None:
    """The marker of a finished part if it matches (rows, tokenizer) and its files have the
    recorded sizes and sha256; else None."""
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if (info.get("start"), info.get("stop"), info.get("tokenizer_sha256")) != (start, stop, tok_sha):
        return None
    for key in ("ids", "lens"):
        path = marker.parent / info[key]["file"]
        if not path.is_file() or path.stat().st_size != info[key]["n_bytes"] or sha256_file(path) != info[key]["sha256"]:
            return None
    return info


def encode_part(docs_path: str, tokenizer_path: str, parts_dir: str, part: int, start: int, stop: int, *,
                batch_docs: int = 4096) -> dict:
    """Encode rows ``[start, stop)`` of the ``text`` column of ``docs_path`` into
    ``parts_dir/part-<part>.ids`` (flat little-endian ids, shard dtype, no special tokens, the
    documents back to back) and ``part-<part>.lens`` (int32 [stop - start], tokens per row, -1 for
    a null text), then the marker ``part-<part>.json`` last (all via temp file + rename).

    What each engine runs on its parts. A finished part -- marker present, same rows and
    tokenizer sha256, files of the recorded size and sha256 -- is not encoded again; the marker
    is returned with ``"skipped": True``. Reads ``batch_docs`` rows per polars slice and encodes
    them with ``labkit.data.tokenize.encode_flat``: for a line-separable WordPiece tokenizer each
    distinct line once per process (``process_line_cache``), else one ``encode_batch`` call.
    Returns the marker: {"part", "start", "stop", "n_docs"
    (non-null), "n_tokens", "dtype", "tokenizer_sha256", "ids": {"file", "n_bytes", "sha256"},
    "lens": {...}, "skipped"}.
    """
    tok_sha = tokenizer_sha256(tokenizer_path)
    out = Path(parts_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids_path, lens_path, marker = _part_files(out, part)
    done = _part_is_done(marker, start, stop, tok_sha)
    if done is not None:
        return done | {"skipped": True}
    marker.unlink(missing_ok=True)
    tok = _checked_tokenizer(tokenizer_path)
    separable, cache = line_separable(tok), process_line_cache(tok_sha)
    bound = id_bound(tok)
    dtype = shard_dtype(bound)
    lf = pl.scan_parquet(docs_path).select("text")
    lens_all: list[np.ndarray] = []
    n_tokens = 0

    def write_ids(tmp: Path) -> None:
        nonlocal n_tokens
        with open(tmp, "wb") as f:
            for lo in range(start, stop, batch_docs):
                col = lf.slice(lo, min(batch_docs, stop - lo)).collect().get_column("text")
                lens = np.full(len(col), -1, dtype=np.int32)
                valid = col.is_not_null().to_numpy()
                flat, lens[valid] = encode_flat(tok, col.drop_nulls().to_list(), separable=separable, cache=cache)
                if flat.size and (flat.min() < 0 or flat.max() >= bound):
                    raise ShardError(f"{tokenizer_path}: emitted id {int(flat.max())} outside 0..{bound - 1} "
                                     f"(rows {lo}.. of {docs_path})")
                f.write(flat.astype(dtype).tobytes())
                n_tokens += len(flat)
                lens_all.append(lens)

    atomic_write(ids_path, write_ids)
    lens = np.concatenate(lens_all) if lens_all else np.empty(0, dtype=np.int32)
    if len(lens) != stop - start:
        raise ValueError(f"{docs_path}: rows {start}..{stop} requested, {len(lens)} read")
    lens_bytes = lens.astype("<i4").tobytes()
    atomic_write_bytes(lens_path, lens_bytes)
    info = {"part": part, "dir": str(out.absolute()), "start": start, "stop": stop,
            "n_docs": int((lens >= 0).sum()), "n_tokens": n_tokens,
            "dtype": dtype.name, "tokenizer_sha256": tok_sha,
            "ids": {"file": ids_path.name, "n_bytes": n_tokens * dtype.itemsize, "sha256": sha256_file(ids_path)},
            "lens": {"file": lens_path.name, "n_bytes": len(lens_bytes),
                     "sha256": sha256_bytes(lens_bytes)}}
    atomic_write_bytes(marker, (json.dumps(info, indent=1) + "\n").encode())
    return info | {"skipped": False}


def _checked_tokenizer(tokenizer_path: str):
    """The tokenizer at ``tokenizer_path``, its special tokens checked (``tokenize.special_ids``:
    ShardError naming the file and the token) and special-token strings in texts encoded as text."""
    tok = load_tokenizer(tokenizer_path)
    try:
        special_ids(tok, name=str(tokenizer_path))
    except ValueError as err:
        raise ShardError(str(err)) from None
    tok.encode_special_tokens = True
    return tok


def rows_per_shard(cfg: ShardConfig, dtype: np.dtype) -> int:
    """Sequences per shard: ``cfg.sequences_per_shard``, or as many as fit in ``cfg.shard_bytes``."""
    if cfg.sequences_per_shard is not None:
        return cfg.sequences_per_shard
    return max(1, cfg.shard_bytes // (cfg.seq_len * np.dtype(dtype).itemsize))


def plan_shards(docs_path: str, tokenizer_path: str, out_dir: str, cfg: ShardConfig, parts: list[dict], *,
                groups: int = 1) -> dict:
    """Everything packing needs, decided before any shard is written: select documents
    (``labkit.data.balance``; the choice saved as ``<out_dir>.parts/keep.npy``), cut the rows
    into ``groups`` contiguous ranges and count each one's rows and shards
    (``labkit.data.pack.plan_groups``); ``parts`` are the ``encode_part`` markers, any order. Removes ``index.json``
    (the set is incomplete until ``write_index``). Returns a small JSON-able plan for
    ``pack.pack_group`` (one call per group, any engine) and ``write_index``.

    Raises ShardError naming a part encoded with another tokenizer, or the tokenizer when it can
    emit an id >= ``cfg.model_vocab_size``; ``ValueError`` naming ``docs_path`` when there are no
    documents or the parts do not tile its rows.
    """
    from labkit.data.balance import select_documents

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts_dir = parts_dir_for(out_dir)
    parts_dir.mkdir(parents=True, exist_ok=True)
    tok_sha = tokenizer_sha256(tokenizer_path)
    parts = sorted(parts, key=lambda p: p["start"])
    for p in parts:
        if p["tokenizer_sha256"] != tok_sha:
            raise ShardError(f"{Path(p['dir']) / p['ids']['file']}: encoded with tokenizer {p['tokenizer_sha256'][:12]}..., "
                             f"not {tokenizer_path} ({tok_sha[:12]}...)")
    ranges = [(p["start"], p["stop"]) for p in parts]
    n_rows = text_row_count(docs_path)
    edges = [0] + [r for a, b in zip(ranges, ranges[1:]) for r in (a[1], a[1])] + [n_rows]
    if n_rows and [r for pair in ranges for r in pair] != edges:
        raise ValueError(f"parts: row ranges {ranges} do not tile the {n_rows} rows of {docs_path}")
    if sum(p["n_docs"] for p in parts) == 0 or not n_rows:
        raise ValueError(f"{docs_path}: no documents to write shards from")
    tok = _checked_tokenizer(tokenizer_path)
    vocab_size = id_bound(tok)
    if cfg.model_vocab_size is not None and vocab_size > cfg.model_vocab_size:
        raise ShardError(f"{tokenizer_path}: emits ids up to {vocab_size - 1}, not below the model's vocabulary "
                         f"size {cfg.model_vocab_size} (ShardConfig.model_vocab_size)")
    dtype = shard_dtype(vocab_size)
    lens = np.concatenate([np.fromfile(Path(p["dir"]) / p["lens"]["file"], dtype="<i4")
                           for p in parts]).astype(np.int64)
    keep, balance = select_documents(docs_path, lens, cfg)
    keep, heldout = split_keep(keep, cfg.heldout_fraction, cfg.heldout_seed)  # labkit.data.heldout
    heldout_entry = write_heldout(parts, lens, heldout, out, seq_len=cfg.seq_len, dtype=dtype,
                                  fraction=cfg.heldout_fraction, seed=cfg.heldout_seed, packing=cfg.packing)
    per_shard = rows_per_shard(cfg, dtype)
    keep_sha = sha256_bytes(np.packbits(keep).tobytes())
    plan_hash = sha256_bytes(json.dumps([tok_sha, cfg.seq_len, per_shard, dtype.name, groups,
                                         [p["ids"]["sha256"] for p in parts], keep_sha]
                                        + ([cfg.packing] if cfg.packing != "packed" else [])).encode())
    kept = lens[keep]
    truncated = kept > cfg.seq_len if cfg.packing == "padded" else np.zeros(len(kept), dtype=bool)
    keep_path = parts_dir / "keep.npy"
    atomic_write_npy(keep_path, keep)
    (out / INDEX_NAME).unlink(missing_ok=True)  # incomplete from here until the new index is written
    for old in out.iterdir():
        if _TMP_RE.fullmatch(old.name):
            old.unlink()
    return {"out_dir": str(out.absolute()), "parts_dir": str(parts_dir), "keep_path": str(keep_path),
            "hash": plan_hash, "seq_len": cfg.seq_len, "rows_per_shard": per_shard, "dtype": dtype.name,
            "vocab_size": vocab_size, "tokenizer_sha256": tok_sha, "special_ids": special_ids(tok),
            "n_documents": int(keep.sum()),
            "balance": balance, "parts": parts, "heldout": heldout_entry, "packing": cfg.packing,
            "truncated": [int(truncated.sum()), int((kept[truncated] - cfg.seq_len).sum())],
            "groups": plan_groups(parts, lens, keep, cfg.seq_len, per_shard, groups, packing=cfg.packing)}


def write_rows(out_dir: str | os.PathLike, rows: np.ndarray, *, vocab_size: int, tokenizer_sha256: str,
               rows_per_shard: int, n_documents: int | None = None) -> dict:
    """Write already packed rows ``[n_sequences, seq_len]`` (ints, [CLS]-prefixed as ``pack_rows``
    makes them) as a complete shard set: ``shard-NNNNN.bin`` of ``rows_per_shard`` rows each, in
    the dtype ``shard_dtype(vocab_size)`` gives, then ``index.json`` last, all through
    ``labkit.io``. For sets whose rows come from elsewhere than a tokenizer (tests, benchmarks,
    synthetic loads). ``n_documents`` defaults to the number of rows. Returns the index.
    ShardError when an id is not below ``vocab_size``; ValueError for an empty ``rows``."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or not len(rows):
        raise ValueError(f"rows: need a non-empty [n_sequences, seq_len] array, got shape {rows.shape}")
    if rows.min() < 0 or rows.max() >= vocab_size:
        raise ShardError(f"rows: id {int(rows.max())} is not below vocab_size {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = shard_dtype(vocab_size)
    shards = []
    for k, start in enumerate(range(0, len(rows), rows_per_shard)):
        block = np.ascontiguousarray(rows[start:start + rows_per_shard], dtype=dtype)
        data = block.tobytes()
        atomic_write_bytes(out / f"shard-{k:05d}.bin", data)
        shards.append({"file": f"shard-{k:05d}.bin", "n_sequences": len(block), "n_bytes": len(data),
                       "sha256": sha256_bytes(data), "n_tokens": int(np.count_nonzero(block != PAD_ID))})
    index = {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "seq_len": int(rows.shape[1]),
             "vocab_size": int(vocab_size), "tokenizer_sha256": tokenizer_sha256,
             "special_ids": {t: i for i, t in enumerate(SPECIAL_TOKENS)},
             "n_documents": len(rows) if n_documents is None else int(n_documents),
             "n_sequences": len(rows), "n_tokens": sum(s.pop("n_tokens") for s in shards),
             "n_bytes": sum(s["n_bytes"] for s in shards), "shards": shards}
    atomic_write_bytes(out / INDEX_NAME, (json.dumps(index, indent=1) + "\n").encode())
    return index


CROSS_DOCUMENT_ATTENTION = {"packed": True, "padded": False}
"""Whether a token attends to tokens of other documents, per packing mode: packed rows hold
several documents under one attention mask of non-[PAD] tokens (no block-diagonal mask), padded
rows hold one document each."""


def packing_info(mode: str, *, n_tokens: int, positions: int, truncated: list[int]) -> dict:
    """index.json's "packing": {"mode", "efficiency" (real (non-[PAD]) tokens / positions, the
    share of computed positions that carry a token), "cross_document_attention"
    (``CROSS_DOCUMENT_ATTENTION``), "truncated_documents", "truncated_tokens" (the tails a padded
    row cut off; 0 when packed)}. ``truncated``: [documents, tokens]."""
    return {"mode": mode, "efficiency": n_tokens / positions if positions else 0.0,
            "cross_document_attention": CROSS_DOCUMENT_ATTENTION[mode],
            "truncated_documents": truncated[0], "truncated_tokens": truncated[1]}


def packing_of(index: dict) -> dict:
    """The "packing" entry of a shard index; for a set written before it existed (always packed),
    the same entry computed from the index's counts."""
    return index.get("packing") or packing_info("packed", n_tokens=index["n_tokens"],
                                                positions=index["n_sequences"] * index["seq_len"], truncated=[0, 0])


def write_index(plan: dict, group_shards: list[list[dict]]) -> dict:
    """Merge the shard infos ``pack_group`` returned for each group of ``plan`` (in group order),
    remove shards of an earlier, longer run and write ``index.json`` last. Returns the index."""
    out, parts_dir = Path(plan["out_dir"]), Path(plan["parts_dir"])
    shards = [s for group in group_shards for s in group]
    if [s["file"] for s in shards] != [f"shard-{k:05d}.bin" for k in range(len(shards))]:
        raise ShardError(f"{out}: the groups' shards are not numbered 0..{len(shards) - 1} in order")
    for old in out.iterdir():  # shards of an earlier, longer run
        if _SHARD_RE.fullmatch(old.name) and int(old.name[6:11]) >= len(shards):
            old.unlink()
            (parts_dir / f"{old.name[:-4]}.json").unlink(missing_ok=True)
    index = {
        "format": FORMAT, "version": VERSION, "dtype": plan["dtype"], "seq_len": plan["seq_len"],
        "vocab_size": plan["vocab_size"], "tokenizer_sha256": plan["tokenizer_sha256"],
        "special_ids": plan["special_ids"], "n_documents": plan["n_documents"],
        "n_sequences": sum(s["n_sequences"] for s in shards),
        "n_tokens": sum(s["n_tokens"] for s in shards),
        "n_bytes": sum(s["n_bytes"] for s in shards),
        "pack_groups": len(plan["groups"]),
        "packing": packing_info(plan.get("packing", "packed"), n_tokens=sum(s["n_tokens"] for s in shards),
                                positions=sum(s["n_sequences"] for s in shards) * plan["seq_len"],
                                truncated=plan.get("truncated", [0, 0])),
        "shards": [{k: s[k] for k in ("file", "n_sequences", "n_bytes", "sha256")} for s in shards],
        "balance": plan["balance"],
    }
    if plan.get("heldout"):
        index["heldout"] = plan["heldout"]  # written by plan_shards (labkit.data.heldout)
    atomic_write_bytes(out / INDEX_NAME, (json.dumps(index, indent=1) + "\n").encode())
    return index


def finish_shards(docs_path: str, tokenizer_path: str, out_dir: str, cfg: ShardConfig, parts: list[dict], *,
                  progress: bool = True, groups: int = 1) -> dict:
    """Select documents and pack the encoded ``parts`` (the markers ``encode_part`` returned,
    any order) into shards in this process, then write ``index.json``: ``plan_shards``,
    ``pack.pack_group`` for each of the ``groups`` groups, ``write_index`` -- the steps
    ``labkit.lab.build_shards`` spreads over engines, so both give identical bytes.

    Each shard is followed by a marker ``<out_dir>.parts/shard-<k>.json`` naming the plan it
    belongs to (a hash of tokenizer, parts, packing settings, group count and selection); a
    re-run does not write a shard again whose marker names the same plan and whose file has
    the size and sha256 of the bytes it would write. Shards and markers beyond the new count
    are removed. Errors as ``plan_shards``. ``progress``: a tqdm bar (stderr) over the groups.
    """
    from tqdm.std import tqdm

    plan = plan_shards(docs_path, tokenizer_path, out_dir, cfg, parts, groups=groups)
    done = []
    with tqdm(total=sum(p["n_docs"] for p in plan["parts"]), unit="doc", desc="shards: packing", file=sys.stderr,
              disable=not progress, mininterval=2.0) as bar:
        for g, group in enumerate(plan["groups"]):
            done.append(pack_group(plan, g))
            bar.update(sum(plan["parts"][i]["n_docs"] for i in group["parts"]))
    return write_index(plan, done)


def write_shards(docs_path: str, tokenizer_path: str, out_dir: str, cfg: ShardConfig, *,
                 progress: bool = True, groups: int = 1) -> dict:
    """Tokenize the ``text`` column of ``docs_path`` (Parquet file or glob) with the tokenizer at
    ``tokenizer_path`` and write packed shards + ``index.json`` (last) to ``out_dir``: in one
    process, ``encode_part`` for every part of ``plan_parts`` then ``finish_shards`` -- the same
    steps ``labkit.lab.build_shards`` spreads over engines, so both give identical bytes.

    ``groups``: packing groups (``labkit.data.pack``; ``build_shards`` uses one per engine).
    Memory is bounded by one part (``cfg.part_docs`` rows of ids) and one ``cfg.batch_docs``
    slice of text; neither changes the output. Special-token strings in the text are encoded as
    text, so only packing inserts ids 0, 2, 3. Resumable: finished parts (``parts_dir_for(out_dir)``) and
    shards are not redone (see ``encode_part``, ``finish_shards``). A tqdm bar (stderr) counts
    documents when ``progress``.

    Returns the index dict: {"format": "labkit-shards", "version": 1, "dtype": "uint16"|"uint32",
    "seq_len", "vocab_size", "tokenizer_sha256", "special_ids": {"[PAD]": 0, ..., "[NEXT]": 5},
    "n_documents", "n_sequences", "n_tokens" (non-PAD ids), "n_bytes" (all shards),
    "packing": ``packing_info`` (mode, efficiency, cross_document_attention, truncation),
    "shards": [{"file", "n_sequences", "n_bytes", "sha256"}, ...], "balance": token shares per
    source group before/after balancing (``labkit.data.balance.select_documents``), "heldout":
    the held-out split by document (``labkit.data.heldout``; absent when none)}.
    Raises ``ValueError`` naming ``docs_path`` when it holds no documents and ``ShardError``
    naming the tokenizer when its special tokens are not at ids 0..5 (0..4 for a tokenizer from
    before [NEXT]: ``special_ids`` records which).
    """
    from tqdm.std import tqdm

    _checked_tokenizer(tokenizer_path)
    n_rows = text_row_count(docs_path)
    parts_dir = parts_dir_for(out_dir)
    parts = []
    with tqdm(total=n_rows, unit="doc", desc="shards: encoding", file=sys.stderr, disable=not progress,
              mininterval=2.0) as bar:
        for i, (start, stop) in enumerate(plan_parts(n_rows, cfg.part_docs)):
            parts.append(encode_part(docs_path, tokenizer_path, str(parts_dir), i, start, stop,
                                     batch_docs=cfg.batch_docs))
            bar.update(stop - start)
    return finish_shards(docs_path, tokenizer_path, out_dir, cfg, parts, progress=progress, groups=groups)


def check_tokenizer(data_dir: str | os.PathLike, tokenizer_path: str | os.PathLike) -> dict:
    """Refuse a tokenizer other than the one the shards in ``data_dir`` were built with:
    ``ShardError`` naming both files and both sha256 when the file hashes differ. Returns the index."""
    index = read_index(data_dir)
    _check_tokenizer_of(index, data_dir, tokenizer_path)
    return index


def read_index(data_dir: str | os.PathLike) -> dict:
    """The ``index.json`` of a complete shard set. ``ShardError`` naming the file when it is
    missing, not JSON, of another format or version, or lacks a field."""
    return load_index(data_dir)[0]


def load_index(data_dir: str | os.PathLike) -> tuple[dict, str]:
    """``(index, sha256)``: the checked ``index.json`` of a complete shard set (as ``read_index``)
    and the hex SHA-256 of its bytes, read in one ``open``. The hash is the set's identity: the
    index lists every shard's sha256, size and count, so equal hashes mean equal contents
    (``labkit.data.stage`` keys staged copies by it). Errors as ``read_index``."""
    path = Path(data_dir) / INDEX_NAME
    if not Path(data_dir).is_dir():
        raise ShardError(f"not a shard set: directory {data_dir} does not exist")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ShardError(f"not a complete shard set: {INDEX_NAME} missing in {data_dir}") from None
    except IsADirectoryError:
        raise ShardError(f"not a complete shard set: {path} is not a file") from None
    try:
        index = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardError(f"{path}: malformed JSON ({e})") from e
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise ShardError(f"{path}: format is {found!r}, expected {FORMAT!r}")
    if index.get("version") != VERSION:
        raise ShardError(f"{path}: unknown version {index.get('version')!r}; this labkit reads version {VERSION}")
    missing = [k for k in _REQUIRED if k not in index]
    if missing:
        raise ShardError(f"{path}: missing fields {missing}")
    if index["dtype"] not in ("uint16", "uint32"):
        raise ShardError(f"{path}: dtype {index['dtype']!r}, expected 'uint16' or 'uint32'")
    return index, sha256_bytes(raw)


def check_entries(data_dir: str | os.PathLike, index: dict) -> list[Path]:
    """Everything a reader needs of a shard set, without reading its bytes; the shard paths in
    order. ``ShardError`` naming the file (or ``index.json``) when: the dtype cannot hold ids up
    to ``vocab_size - 1``; an entry is not a ``shard-NNNNN.bin`` name, is listed twice, holds no
    sequence (an empty shard: a set lists only shards with rows) or gives n_bytes other than n_sequences *
    seq_len * itemsize; a shard file is missing, has another size or is not a whole number of
    sequences; a ``shard-NNNNN.bin`` in the directory is not in the index; the entries'
    n_sequences do not sum to ``n_sequences``. ``verify_shards`` and ``SequenceReader`` both call
    it, so every set verify accepts can be read and every one the reader refuses verify refuses."""
    d = Path(data_dir)
    index_path = d / INDEX_NAME
    itemsize = np.dtype(index["dtype"]).itemsize
    if index["vocab_size"] > 256 ** itemsize:
        raise ShardError(f"{index_path}: dtype {index['dtype']} cannot hold ids up to vocab_size - 1 = "
                         f"{index['vocab_size'] - 1}")
    row_bytes = index["seq_len"] * itemsize
    paths, seen = [], set()
    for shard in index["shards"]:
        name = shard.get("file")
        if not isinstance(name, str) or not _SHARD_RE.fullmatch(name):
            raise ShardError(f"{index_path}: entry {name!r} is not a shard file name (shard-NNNNN.bin)")
        path = d / name
        if name in seen:
            raise ShardError(f"{path}: listed twice in {INDEX_NAME}")
        seen.add(name)
        if shard["n_sequences"] <= 0:
            raise ShardError(f"{path}: empty shard ({shard['n_sequences']} sequences) in {INDEX_NAME}")
        if shard["n_bytes"] != shard["n_sequences"] * row_bytes:
            raise ShardError(f"{path}: index gives {shard['n_bytes']} bytes for {shard['n_sequences']} sequences")
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ShardError(f"{path}: shard file missing") from None
        if size != shard["n_bytes"]:
            partial = (f"; not a whole number of {index['seq_len']}-token {index['dtype']} sequences"
                       if size % row_bytes else "")
            raise ShardError(f"{path}: {size} bytes on disk, index says {shard['n_bytes']}{partial}")
        paths.append(path)
    extra = sorted(e.name for e in os.scandir(d) if _SHARD_RE.fullmatch(e.name) and e.name not in seen)
    if extra:
        raise ShardError(f"{d / extra[0]}: shard file not listed in {INDEX_NAME} ({len(extra)} such files)")
    if sum(s["n_sequences"] for s in index["shards"]) != index["n_sequences"]:
        raise ShardError(f"{index_path}: shard n_sequences do not sum to n_sequences")
    return paths


def _check_content(path: Path, shard: dict, index: dict, digest: str, top: int) -> None:
    """ShardError naming ``path`` when its sha256 is not the index entry's or it holds an id
    >= vocab_size."""
    if digest != shard["sha256"]:
        raise ShardError(f"{path}: sha256 {digest} does not match index.json ({shard['sha256']})")
    if top >= index["vocab_size"]:
        raise ShardError(f"{path}: holds id {top}, not below the index's vocab_size {index['vocab_size']}")


def verify_shards(data_dir: str | os.PathLike, *, tokenizer_path: str | os.PathLike | None = None) -> dict:
    """``check_entries``, then every shard's sha256 and largest id, compared with ``index.json``,
    and the same for the held-out file (``labkit.data.heldout``: its size too) when the index
    records one; returns the index. ``ShardError`` naming the first file (shard or held-out)
    that is missing, differs, or holds an id >= ``vocab_size``, or the index when
    ``tokenizer_path`` is given and is not the tokenizer the set was built with
    (``check_tokenizer``)."""
    index = read_index(data_dir)
    if tokenizer_path is not None:
        _check_tokenizer_of(index, data_dir, tokenizer_path)
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    files = list(zip(index["shards"], check_entries(data_dir, index)))
    for held in (index.get("heldout") or {}).get("shards", []):
        path = Path(data_dir) / held["file"]
        size = path.stat().st_size if path.is_file() else None
        if size != held["n_bytes"]:
            raise ShardError(f"{path}: held-out file " + ("missing" if size is None else f"has {size} bytes")
                             + f", index says {held['n_bytes']}")
        files.append((held, path))
    for shard, path in files:
        tops = [0]
        # blocks of 4 MiB, a multiple of 4 bytes: whole ids
        digest = sha256_file(path, chunk=1 << 22,
                             on_block=lambda b: tops.append(int(np.frombuffer(b, dtype=dtype).max())))
        _check_content(path, shard, index, digest, max(tops))
    return index


def _check_tokenizer_of(index: dict, data_dir: str | os.PathLike, tokenizer_path: str | os.PathLike) -> None:
    sha = tokenizer_sha256(tokenizer_path)
    if sha != index["tokenizer_sha256"]:
        raise ShardError(f"{tokenizer_path} (sha256 {sha}) is not the tokenizer the shards in {data_dir} were "
                         f"built with (index.json: tokenizer_sha256 {index['tokenizer_sha256']})")


def check_shards(data: str | os.PathLike | ShardSet, *, seq_len: int | None = None, dtype: str | None = None,
                 vocab_size: int | None = None, tokenizer_sha256: str | None = None,
                 verify: bool = False) -> dict:
    """Check a shard set against what a reader expects, before anything trains; returns its index.
    The one compatibility check of a shard set (``labkit.data.mlm.make_loader`` and training call it).

    ``data``: the set's directory, or a ``ShardSet`` already opened (``open_shards``), whose
    index is then not read again. ``ShardError`` (a ValueError) naming ``<data_dir>/index.json``
    and every field that differs (expected vs found) for seq_len, dtype ("uint16"/"uint32"),
    tokenizer_sha256, and vocab_size (the run's must be at least the shards'); ShardError naming
    the file for a missing or malformed index or shard; with ``verify`` every shard's sha256 is
    recomputed too (once per opened ``ShardSet``: it remembers that it was verified).
    """
    if isinstance(data, ShardSet):
        if verify:
            data.verify()
        index, data_dir = data.index, data.data_dir
    else:
        index, data_dir = (verify_shards(data) if verify else read_index(data)), data
    wanted = {"seq_len": seq_len, "dtype": dtype, "tokenizer_sha256": tokenizer_sha256}
    diffs = [f"{k}: run expects {v!r}, shards have {index.get(k)!r}" for k, v in wanted.items()
             if v is not None and index.get(k) != v]
    if vocab_size is not None and vocab_size < index["vocab_size"]:
        diffs.append(f"vocab_size: run has {vocab_size}, smaller than the shards' {index['vocab_size']}")
    if diffs:
        raise ShardError(f"{Path(data_dir) / INDEX_NAME}: " + "; ".join(diffs))
    return index


def _file_id(st: os.stat_result) -> tuple[int, int, int, int]:
    """What "the same file, unchanged" means to a reader: (size, inode, device, mtime in ns)."""
    return (st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns)


def _what_changed(path: Path, before: tuple[int, int, int, int], now: tuple[int, int, int, int] | None) -> str:
    """One-line ShardError message: ``path`` and what differs between two ``_file_id`` s."""
    if now is None:
        return f"{path}: removed since the shard set was opened"
    what = []
    if now[0] != before[0]:
        what.append(f"size {before[0]} -> {now[0]} bytes")
    if now[1:3] != before[1:3]:
        what.append(f"replaced (inode {before[1]} -> {now[1]})")
    if now[3] != before[3]:
        what.append(f"modified (mtime {before[3] / 1e9:.6f} -> {now[3] / 1e9:.6f})")
    return f"{path}: changed since the shard set was opened: " + ", ".join(what)


class ShardSet:
    """One opened shard set: its checked ``index.json`` (read once), the index's sha256 (the
    set's identity, ``load_index``), and each file's identity at open -- size, inode, device and
    mtime (``_file_id``) of every shard and of the held-out file -- against which every read is
    checked. What a run passes down instead of a path (``open_shards``; ``make_loader``,
    ``check_shards``, ``HeldoutSet``, ``RankSampler`` take it), so the set is opened once.

    Random access: ``len(s)`` is ``n_sequences``; ``s[i]`` is a copy of sequence i, shape
    ``[seq_len]``, dtype of the index (uint16/uint32), negative i counting from the end;
    ``s.rows(ids)`` gathers many (int64 ids -> [len(ids), seq_len]); ``s.heldout_rows(n)`` the
    held-out split. Files are read with ``os.preadv`` on descriptors opened lazily and kept in an
    LRU of at most ``max_open`` (any number of shards reads under a low ``ulimit -n``); rows
    that are consecutive in a file are read by one call (``rows``).

    Data that changes underneath: a descriptor pins the inode it opened (a rename onto the path
    leaves it reading the file it opened). When a descriptor opens, its ``fstat`` must give the
    identity recorded at open, and after every read the file's ``fstat`` must still give it, and
    every read must return the bytes asked for. Otherwise ``ShardError`` names the file and what
    changed: "size A -> B bytes" (a ``cp`` of another file onto the path truncates the same
    inode), "replaced (inode ...)" (a rename, seen when a descriptor opens: in a DataLoader
    worker, or after an LRU eviction), "modified (mtime ...)" (rewritten in place at the same
    size). Reads never touch a memory map, so a file shrinking under a reader cannot raise
    SIGBUS (a load from a mapped page past the end of the file does; mmap(2)). The check is on
    metadata: a change that keeps size, inode and mtime (mtime set back by hand) is not seen;
    ``verify`` (sha256 of every shard, through the same descriptors) is the content check.

    Opening runs ``check_entries`` (sizes, names, no empty, missing, extra or duplicated shards:
    ``ShardError`` naming the file); ``verify=True`` also checks sha256 and ids;
    ``tokenizer_path`` refuses (``check_tokenizer``) a tokenizer the shards were not built with.
    Pickles small (directory, index, identities; no descriptor), so it can go to DataLoader
    workers under spawn/forkserver: a worker's copy reopens the files, checked against the
    identities recorded by the process that opened the set.
    """

    def __init__(self, data_dir: str | os.PathLike, *, verify: bool = False,
                 tokenizer_path: str | os.PathLike | None = None, max_open: int = 64) -> None:
        if max_open < 1:
            raise ValueError(f"max_open: must be at least 1, got {max_open}")
        self.data_dir = Path(data_dir)
        self.index, self.sha256 = load_index(data_dir)
        if tokenizer_path is not None:
            _check_tokenizer_of(self.index, data_dir, tokenizer_path)
        self.max_open = max_open
        self._paths = check_entries(self.data_dir, self.index)
        ids = []
        for path, shard in zip(self._paths, self.index["shards"]):
            fid = _file_id(path.stat())
            if fid[0] != shard["n_bytes"]:  # changed between check_entries and here
                raise ShardError(f"{path}: {fid[0]} bytes on disk, index says {shard['n_bytes']}")
            ids.append(fid)
        held = (self.index.get("heldout") or {}).get("shards") or []
        self._heldout_path = self.data_dir / held[0]["file"] if held else None
        try:
            ids.append(_file_id(self._heldout_path.stat()) if held else None)
        except FileNotFoundError:
            ids.append(None)  # refused when read (HeldoutError): a run without evaluation does not need it
        self._ids = ids  # [n_shards + 1]: the shards', then the held-out file's (or None)
        self.verified = False
        self._setup()
        if verify:
            self.verify()

    def _setup(self) -> None:
        from collections import OrderedDict

        self.seq_len: int = self.index["seq_len"]
        self.vocab_size: int = self.index["vocab_size"]
        self._dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
        self._row_bytes = self.seq_len * self._dtype.itemsize
        self._fds: OrderedDict[int, int] = OrderedDict()  # file number (len(shards) = held-out) -> fd
        self._starts = np.cumsum([0] + [s["n_sequences"] for s in self.index["shards"]])

    @property
    def paths(self) -> list[Path]:
        """The shard files, in index order."""
        return list(self._paths)

    def _path(self, k: int) -> Path:
        return self._paths[k] if k < len(self._paths) else self._heldout_path

    def _fd(self, k: int) -> int:
        """An open descriptor of file k (``len(paths)``: the held-out file), its identity checked
        against the one recorded at open; the least recently used beyond ``max_open`` is closed."""
        fd = self._fds.get(k)
        if fd is not None:
            self._fds.move_to_end(k)
            return fd
        while len(self._fds) >= self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        path = self._path(k)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ShardError(_what_changed(path, self._ids[k], None)) from None
        now = _file_id(os.fstat(fd))
        if now != self._ids[k]:
            os.close(fd)
            raise ShardError(_what_changed(path, self._ids[k], now))
        self._fds[k] = fd
        return fd

    def _check_after(self, k: int, fd: int, complete: bool) -> None:
        """After a read of file k: ShardError (``_what_changed``) when its identity is not the one
        recorded at open, or the read came back short."""
        now = _file_id(os.fstat(fd))
        if now != self._ids[k]:
            raise ShardError(_what_changed(self._path(k), self._ids[k], now))
        if not complete:
            raise ShardError(f"{self._path(k)}: short read within its recorded size {self._ids[k][0]} bytes")

    def _read_span(self, k: int, offset: int, out: np.ndarray) -> None:
        """Fill the C-contiguous ``out`` from byte ``offset`` of file k (one read); checked as
        ``_check_after``."""
        fd = self._fd(k)
        self._check_after(k, fd, os.preadv(fd, [out], offset) == out.nbytes)

    def verify(self) -> None:
        """sha256 and largest id of every shard, read through this set's descriptors, against the
        index (``ShardError`` naming the first that differs, as ``verify_shards``); once."""
        if self.verified:
            return
        block = max(1, (1 << 22) // self._row_bytes)  # ~4 MiB of whole rows
        for k, (shard, path) in enumerate(zip(self.index["shards"], self._paths)):
            h, top = hashlib.sha256(), 0
            for lo in range(0, shard["n_sequences"], block):
                rows = np.empty((min(block, shard["n_sequences"] - lo), self.seq_len), dtype=self._dtype)
                self._read_span(k, lo * self._row_bytes, rows)
                h.update(rows.data)
                top = max(top, int(rows.max()))
            _check_content(path, shard, self.index, h.hexdigest(), top)
        self.verified = True

    def close(self) -> None:
        """Close every open descriptor (they reopen, checked, on the next read)."""
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self) -> dict:
        """Pickle the directory, index, its sha256, the identities (int64 [n_files, 4] as bytes)
        and the limit only (no descriptor, no data); the copy reopens the files as it reads."""
        ids = np.array([fid if fid is not None else (-1, -1, -1, -1) for fid in self._ids], dtype=np.int64)
        return {"data_dir": str(self.data_dir), "index": self.index, "sha256": self.sha256,
                "max_open": self.max_open, "ids": ids.tobytes(), "verified": self.verified}

    def __setstate__(self, state: dict) -> None:
        self.data_dir, self.index, self.sha256 = Path(state["data_dir"]), state["index"], state["sha256"]
        self.max_open, self.verified = state["max_open"], state["verified"]
        ids = np.frombuffer(state["ids"], dtype=np.int64).reshape(-1, 4).tolist()
        self._ids = [tuple(fid) if fid[0] >= 0 else None for fid in ids]
        self._paths = [self.data_dir / s["file"] for s in self.index["shards"]]
        held = (self.index.get("heldout") or {}).get("shards") or []
        self._heldout_path = self.data_dir / held[0]["file"] if held else None
        self._setup()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def rows(self, ids) -> np.ndarray:
        """Sequences ``ids`` (int, any order, repeats allowed) as [len(ids), seq_len] of the
        index's dtype; IndexError naming the range for an id outside [0, len); ShardError when a
        shard changed since the set was opened (class docstring). The ids are read in ascending
        order, one ``preadv`` per run of consecutive rows of a shard, each shard's identity
        checked after its last read."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(self)
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise IndexError(f"sequence ids must be in [0, {n}) for {self.data_dir}, "
                             f"got range [{ids.min()}, {ids.max()}]")
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        which = np.searchsorted(self._starts, sorted_ids, side="right") - 1  # shards, ascending
        # a run continues while the next id is the next row of the same shard
        breaks = np.flatnonzero((np.diff(sorted_ids) != 1) | (np.diff(which) != 0)) + 1
        starts = [0] + breaks.tolist()
        offsets = ((sorted_ids - self._starts[which]) * self._row_bytes)[starts].tolist() if ids.size else []
        shards = which[starts].tolist() if ids.size else []
        buf = np.empty((len(ids), self.seq_len), dtype=self._dtype)  # rows in ascending id order
        k, fd = -1, -1
        for k_run, off, a, b in zip(shards, offsets, starts, starts[1:] + [len(ids)]):
            if k_run != k:  # runs are grouped by shard: check the last one before leaving it
                if k >= 0:
                    self._check_after(k, fd, True)
                k, fd = k_run, self._fd(k_run)
            if os.preadv(fd, [buf[a:b]], off) != (b - a) * self._row_bytes:
                self._check_after(k, fd, False)
        if k >= 0:
            self._check_after(k, fd, True)
        out = np.empty_like(buf)
        out[order] = buf
        return out

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.data_dir}")
        return self.rows([i])[0]

    def heldout_rows(self, max_sequences: int | None = None) -> np.ndarray:
        """The held-out sequences (``labkit.data.heldout``), [n, seq_len] of the index's dtype, the
        first ``max_sequences`` when given, read through the same checks as the shards.
        ``HeldoutError`` when the index records no held-out split or its file was missing or not
        of the index's size at open; ShardError when it changed since."""
        from labkit.data.heldout import HeldoutError

        entry = self.index.get("heldout")
        if not entry:
            raise HeldoutError(f"{self.data_dir / INDEX_NAME}: no held-out split (rebuild the shards with "
                               "ShardConfig.heldout_fraction > 0, or set eval_every=0)")
        shard, k = entry["shards"][0], len(self._paths)
        if self._ids[k] is None or self._ids[k][0] != shard["n_bytes"]:
            raise HeldoutError(f"{self._heldout_path}: held-out file missing or not {shard['n_bytes']} bytes "
                               "as index.json says")
        n = shard["n_bytes"] // self._row_bytes
        n = min(n, max_sequences) if max_sequences else n
        out = np.empty((n, self.seq_len), dtype=self._dtype)
        self._read_span(k, 0, out)
        return out


SequenceReader = ShardSet
"""The earlier name of ``ShardSet`` (random access to a shard set's sequences); same class."""


def open_shards(data_dir: str | os.PathLike, *, seq_len: int | None = None, dtype: str | None = None,
                vocab_size: int | None = None, tokenizer_sha256: str | None = None, verify: bool = False,
                max_open: int = 64) -> ShardSet:
    """Open the shard set in ``data_dir`` once for a run: ``ShardSet`` (index read and hashed once,
    every file's identity recorded), then ``check_shards`` against what the run expects (seq_len,
    dtype, tokenizer_sha256, vocab_size; ``verify``: every shard's sha256 and ids, read through
    the set's own descriptors). Errors: ``ShardError`` naming the file and the difference."""
    shards = ShardSet(data_dir, max_open=max_open)
    check_shards(shards, seq_len=seq_len, dtype=dtype, vocab_size=vocab_size, tokenizer_sha256=tokenizer_sha256,
                 verify=verify)
    return shards
