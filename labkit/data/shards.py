"""The labkit token-shard format: packed fixed-length sequences in flat binary files + index.json.

Layout of a shard directory::

    shard-00000.bin  shard-00001.bin  ...  index.json   (index.json written last)

- A shard is a flat little-endian array of token ids, dtype ``uint16`` when the vocabulary has
  at most 65,536 ids, else ``uint32``, shape ``[n_sequences, seq_len]`` row-major; every shard
  holds ``ShardConfig.sequences_per_shard`` rows except possibly the last.
- Packing (as HF ``run_mlm.py`` without ``line_by_line``, plus BERT's specials): the documents'
  ids (no special tokens) are concatenated in file order, each document followed by [SEP] (3);
  the stream is cut into rows of ``seq_len - 1`` tokens, each row prefixed by [CLS] (2); the
  last partial row is padded with [PAD] (0). A document may continue in the next row. Real
  tokens are the non-PAD ones. The result does not depend on ``ShardConfig.batch_docs``.
- Writing (``write_shards``, or ``encode_part`` on engines + ``finish_shards``) encodes row
  ranges ("parts") into ``<out_dir>.parts/part-XXXXX.ids/.lens`` with a completion marker each, then packs
  them in one pass in row order; finished parts and shards are skipped by a re-run.
- ``index.json`` (fields in ``write_shards``) is written after every shard, by temp file and atomic
  rename (``labkit.io``); its presence means the set is complete, and a directory without it is never
  read (``read_index`` raises ``ShardError``). Compare: mosaicml/streaming MDS ``index.json``,
  Megatron-LM ``.bin``/``.idx``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import polars as pl

from labkit.config import SPECIAL_TOKENS, ShardConfig
from labkit.io import atomic_write, atomic_write_bytes, sha256_bytes, sha256_file
from labkit.data.tokenize import (LineCache, encode_flat, line_separable, load_tokenizer, text_row_count,
                                  tokenizer_sha256)

FORMAT = "labkit-shards"
VERSION = 1
INDEX_NAME = "index.json"
PAD_ID, CLS_ID, SEP_ID = (SPECIAL_TOKENS.index(t) for t in ("[PAD]", "[CLS]", "[SEP]"))
_REQUIRED = ("dtype", "seq_len", "vocab_size", "tokenizer_sha256", "special_ids", "n_documents",
             "n_sequences", "n_tokens", "n_bytes", "shards")
_SHARD_RE = re.compile(r"shard-\d{5}\.bin")
_TMP_RE = re.compile(r"\.(shard-\d{5}\.bin|index\.json)\..+\.tmp")  # labkit.io's temporary names


class ShardError(ValueError):
    """A shard set is incomplete, corrupt, or not the one expected; the message names the file
    or field."""


def shard_dtype(vocab_size: int) -> np.dtype:
    """Little-endian ``uint16`` when ids fit (vocab_size <= 65536), else ``uint32``."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def doc_stream(ids_per_doc: list) -> np.ndarray:
    """Concatenate documents' ids (sequences of ints), each followed by [SEP]: int64 [sum(len)+n].
    ``np.fromiter`` over ``itertools.chain`` keeps the per-token loop in C."""
    lengths = np.fromiter((len(d) for d in ids_per_doc), dtype=np.int64, count=len(ids_per_doc))
    flat = np.fromiter(itertools.chain.from_iterable(ids_per_doc), dtype=np.int64, count=int(lengths.sum()))
    out = np.full(len(flat) + len(lengths), SEP_ID, dtype=np.int64)
    is_token = np.ones(len(out), dtype=bool)
    is_token[np.cumsum(lengths + 1) - 1] = False  # the [SEP] after each document
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


def pack_documents(ids_per_doc: list, seq_len: int) -> np.ndarray:
    """The packed rows ``[n_sequences, seq_len]`` (int64) of whole documents, as written to shards."""
    return pack_rows(doc_stream(ids_per_doc), seq_len, final=True)[0]


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
    them with ``labkit.data.tokenize.encode_flat`` (each distinct line once for a line-separable
    WordPiece tokenizer, else one ``encode_batch`` call). Returns the marker: {"part", "start", "stop", "n_docs"
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
    separable, cache = line_separable(tok), LineCache()
    dtype = shard_dtype(tok.get_vocab_size(with_added_tokens=True))
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
    tok = load_tokenizer(tokenizer_path)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise ShardError(f"{tokenizer_path}: {name} has id {tok.token_to_id(name)}, expected {i}")
    tok.encode_special_tokens = True
    return tok


def _with_seps(flat: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Documents' ids back to back (``flat``) with [SEP] inserted after each: [len(flat) + len(lens)]."""
    out = np.full(len(flat) + len(lens), SEP_ID, dtype=np.int64)
    is_token = np.ones(len(out), dtype=bool)
    is_token[np.cumsum(lens + 1) - 1] = False  # the [SEP] after each document
    out[is_token] = flat
    return out


def finish_shards(docs_path: str, tokenizer_path: str, out_dir: str, cfg: ShardConfig, parts: list[dict], *,
                  progress: bool = True) -> dict:
    """Select documents (``labkit.data.balance``) and pack the encoded ``parts`` (the markers
    ``encode_part`` returned, any order) in row order into shards, then write ``index.json``.

    One sequential pass, so the output is the same whatever engines encoded the parts. Each
    shard is followed by a marker ``<out_dir>.parts/shard-<k>.json`` naming the plan it belongs to (a
    hash of tokenizer, parts, packing settings and selection); a re-run does not write a shard
    again whose marker names the same plan and whose file has the size and sha256 of the bytes
    it would write. Shards and markers of other plans beyond the new count are removed. Raises
    ShardError naming a part encoded with another tokenizer, ``ValueError`` naming
    ``docs_path`` when there are no documents.
    """
    from tqdm.std import tqdm

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
    vocab_size = load_tokenizer(tokenizer_path).get_vocab_size(with_added_tokens=True)
    dtype = shard_dtype(vocab_size)
    lengths = np.concatenate([np.fromfile(Path(p["dir"]) / p["lens"]["file"], dtype="<i4")
                              for p in parts]).astype(np.int64)
    keep, balance = select_documents(docs_path, lengths, cfg)
    plan = sha256_bytes(json.dumps([tok_sha, cfg.seq_len, cfg.sequences_per_shard, dtype.name,
                                    [p["ids"]["sha256"] for p in parts],
                                    sha256_bytes(np.packbits(keep).tobytes())]).encode())
    (out / INDEX_NAME).unlink(missing_ok=True)  # incomplete from here until the new index is written
    for old in out.iterdir():
        if _TMP_RE.fullmatch(old.name):
            old.unlink()

    shards: list[dict] = []
    pending: list[np.ndarray] = []
    carry = np.empty(0, dtype=np.int64)

    def flush(final: bool) -> None:
        rows = np.concatenate(pending) if pending else np.empty((0, cfg.seq_len), dtype=dtype)
        pending.clear()
        while len(rows) >= cfg.sequences_per_shard or (final and len(rows)):
            block, rows = rows[: cfg.sequences_per_shard], rows[cfg.sequences_per_shard:]
            name = f"shard-{len(shards):05d}.bin"
            marker = parts_dir / f"{name[:-4]}.json"
            data = np.ascontiguousarray(block, dtype=dtype).tobytes()
            sha = sha256_bytes(data)
            try:
                info = json.loads(marker.read_text())
            except (OSError, json.JSONDecodeError):
                info = None
            if not (info and info["plan"] == plan and info["sha256"] == sha and (out / name).is_file()
                    and (out / name).stat().st_size == len(data) and sha256_file(out / name) == sha):
                marker.unlink(missing_ok=True)
                atomic_write_bytes(out / name, data)
                info = {"plan": plan, "file": name, "n_sequences": len(block), "n_bytes": len(data), "sha256": sha,
                        "n_tokens": int(np.count_nonzero(block != PAD_ID))}
                atomic_write_bytes(marker, (json.dumps(info) + "\n").encode())
            shards.append(info)
        if len(rows):
            pending.append(rows)

    with tqdm(total=sum(p["n_docs"] for p in parts), unit="doc", desc="shards: packing", file=sys.stderr,
              disable=not progress, mininterval=2.0) as bar:
        for p in parts:
            lens = lengths[p["start"]:p["stop"]]
            sel = keep[p["start"]:p["stop"]]
            valid = lens >= 0
            ids = np.fromfile(Path(p["dir"]) / p["ids"]["file"], dtype=np.dtype(p["dtype"]).newbyteorder("<"))
            token_keep = np.repeat(sel[valid], lens[valid])  # [n_tokens of the part]
            stream = np.concatenate([carry, _with_seps(ids[token_keep].astype(np.int64), lens[sel])])
            rows, carry = pack_rows(stream, cfg.seq_len, final=False)
            pending.append(rows.astype(dtype))
            flush(final=False)
            bar.update(p["n_docs"])
    pending.append(pack_rows(carry, cfg.seq_len, final=True)[0].astype(dtype))
    flush(final=True)
    for old in out.iterdir():  # shards of an earlier, longer run
        m = _SHARD_RE.fullmatch(old.name)
        if m and int(old.name[6:11]) >= len(shards):
            old.unlink()
            (parts_dir / f"{old.name[:-4]}.json").unlink(missing_ok=True)

    index = {
        "format": FORMAT, "version": VERSION, "dtype": dtype.name, "seq_len": cfg.seq_len,
        "vocab_size": vocab_size, "tokenizer_sha256": tok_sha,
        "special_ids": {t: i for i, t in enumerate(SPECIAL_TOKENS)}, "n_documents": int(keep.sum()),
        "n_sequences": sum(s["n_sequences"] for s in shards),
        "n_tokens": sum(s["n_tokens"] for s in shards),
        "n_bytes": sum(s["n_bytes"] for s in shards),
        "shards": [{k: s[k] for k in ("file", "n_sequences", "n_bytes", "sha256")} for s in shards],
        "balance": balance,
    }
    atomic_write_bytes(out / INDEX_NAME, (json.dumps(index, indent=1) + "\n").encode())
    return index


def write_shards(docs_path: str, tokenizer_path: str, out_dir: str, cfg: ShardConfig, *,
                 progress: bool = True) -> dict:
    """Tokenize the ``text`` column of ``docs_path`` (Parquet file or glob) with the tokenizer at
    ``tokenizer_path`` and write packed shards + ``index.json`` (last) to ``out_dir``: in one
    process, ``encode_part`` for every part of ``plan_parts`` then ``finish_shards`` -- the same
    steps ``labkit.lab.build_shards`` spreads over engines, so both give identical bytes.

    Memory is bounded by one part (``cfg.part_docs`` rows of ids) and one ``cfg.batch_docs``
    slice of text; neither changes the output. Special-token strings in the text are encoded as
    text, so only packing inserts ids 0, 2, 3. Resumable: finished parts (``parts_dir_for(out_dir)``) and
    shards are not redone (see ``encode_part``, ``finish_shards``). A tqdm bar (stderr) counts
    documents when ``progress``.

    Returns the index dict: {"format": "labkit-shards", "version": 1, "dtype": "uint16"|"uint32",
    "seq_len", "vocab_size", "tokenizer_sha256", "special_ids": {"[PAD]": 0, ...},
    "n_documents", "n_sequences", "n_tokens" (non-PAD ids), "n_bytes" (all shards),
    "shards": [{"file", "n_sequences", "n_bytes", "sha256"}, ...], "balance": token shares per
    source group before/after balancing (``labkit.data.balance.select_documents``)}.
    Raises ``ValueError`` naming ``docs_path`` when it holds no documents and ``ShardError``
    naming the tokenizer when its special tokens are not at ids 0..4.
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
    return finish_shards(docs_path, tokenizer_path, out_dir, cfg, parts, progress=progress)


def check_tokenizer(data_dir: str | os.PathLike, tokenizer_path: str | os.PathLike) -> dict:
    """Refuse a tokenizer other than the one the shards in ``data_dir`` were built with:
    ``ShardError`` naming both files and both sha256 when the file hashes differ. Returns the index."""
    index = read_index(data_dir)
    sha = tokenizer_sha256(tokenizer_path)
    if sha != index["tokenizer_sha256"]:
        raise ShardError(f"{tokenizer_path} (sha256 {sha}) is not the tokenizer the shards in {data_dir} were "
                         f"built with (index.json: tokenizer_sha256 {index['tokenizer_sha256']})")
    return index


def read_index(data_dir: str | os.PathLike) -> dict:
    """The ``index.json`` of a complete shard set. ``ShardError`` naming the file when it is
    missing, not JSON, of another format or version, or lacks a field."""
    path = Path(data_dir) / INDEX_NAME
    if not Path(data_dir).is_dir():
        raise ShardError(f"not a shard set: directory {data_dir} does not exist")
    if not path.is_file():
        raise ShardError(f"not a complete shard set: {INDEX_NAME} missing in {data_dir}")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
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
    return index


def _check_size(data_dir: Path, shard: dict) -> Path:
    path = data_dir / shard["file"]
    if not path.is_file():
        raise ShardError(f"{path}: shard file missing")
    size = path.stat().st_size
    if size != shard["n_bytes"]:
        raise ShardError(f"{path}: {size} bytes on disk, index says {shard['n_bytes']}")
    return path


def verify_shards(data_dir: str | os.PathLike) -> dict:
    """Recompute every shard's size and sha256 and compare with ``index.json``; returns the index.
    ``ShardError`` naming the first shard that differs (or the index on inconsistent totals)."""
    index = read_index(data_dir)
    itemsize = np.dtype(index["dtype"]).itemsize
    for shard in index["shards"]:
        path = _check_size(Path(data_dir), shard)
        if shard["n_bytes"] != shard["n_sequences"] * index["seq_len"] * itemsize:
            raise ShardError(f"{path}: index gives {shard['n_bytes']} bytes for {shard['n_sequences']} sequences")
        digest = sha256_file(path)
        if digest != shard["sha256"]:
            raise ShardError(f"{path}: sha256 {digest} does not match index.json ({shard['sha256']})")
    if sum(s["n_sequences"] for s in index["shards"]) != index["n_sequences"]:
        raise ShardError(f"{Path(data_dir) / INDEX_NAME}: shard n_sequences do not sum to n_sequences")
    return index


def check_compatible(index: dict, *, seq_len: int | None = None, vocab_size: int | None = None,
                     tokenizer_sha256: str | None = None) -> None:
    """``ShardError`` naming each given field whose value in ``index`` differs (expected vs found)."""
    wanted = {"seq_len": seq_len, "vocab_size": vocab_size, "tokenizer_sha256": tokenizer_sha256}
    diffs = [f"{k}: expected {v!r}, found {index.get(k)!r}" for k, v in wanted.items()
             if v is not None and index.get(k) != v]
    if diffs:
        raise ShardError("shard set is not compatible: " + "; ".join(diffs))


class SequenceReader:
    """Random access to the sequences of a complete shard set through one ``np.memmap`` per shard.

    ``len(r)`` is ``n_sequences``; ``r[i]`` is a copy of sequence i, shape ``[seq_len]``, dtype of
    the index (uint16/uint32); negative i counts from the end. Opening checks each shard's size
    against the index (``ShardError`` naming the file); ``verify=True`` also checks sha256;
    ``tokenizer_path`` refuses (``check_tokenizer``) a tokenizer the shards were not built with.
    Pickles small (directory + index), so it can go to DataLoader workers under spawn.
    """

    def __init__(self, data_dir: str | os.PathLike, *, verify: bool = False,
                 tokenizer_path: str | os.PathLike | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.index = verify_shards(data_dir) if verify else read_index(data_dir)
        if tokenizer_path is not None:
            check_tokenizer(data_dir, tokenizer_path)
        self.seq_len: int = self.index["seq_len"]
        self.vocab_size: int = self.index["vocab_size"]
        self._open()

    def _open(self) -> None:
        dtype = np.dtype(self.index["dtype"]).newbyteorder("<")
        self._maps = []
        for shard in self.index["shards"]:
            path = _check_size(self.data_dir, shard)
            if shard["n_bytes"] != shard["n_sequences"] * self.seq_len * dtype.itemsize:
                raise ShardError(f"{path}: index gives {shard['n_bytes']} bytes for {shard['n_sequences']} sequences")
            self._maps.append(np.memmap(path, dtype=dtype, mode="r", shape=(shard["n_sequences"], self.seq_len)))
        self._starts = np.cumsum([0] + [s["n_sequences"] for s in self.index["shards"]])

    def __getstate__(self) -> dict:
        """Pickle the directory and index only (a memmap would pickle its data); the copy in a
        DataLoader worker reopens the files, checking sizes again."""
        return {"data_dir": self.data_dir, "index": self.index}

    def __setstate__(self, state: dict) -> None:
        self.data_dir, self.index = state["data_dir"], state["index"]
        self.seq_len, self.vocab_size = self.index["seq_len"], self.index["vocab_size"]
        self._open()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.data_dir}")
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return np.array(self._maps[k][i - self._starts[k]])
