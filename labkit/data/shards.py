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
- ``index.json`` (fields in ``write_shards``) is written after every shard, by temp file +
  ``os.replace``; its presence means the set is complete, and a directory without it is never
  read (``read_index`` raises ``ShardError``). Compare: mosaicml/streaming MDS ``index.json``,
  Megatron-LM ``.bin``/``.idx``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from labkit.config import SPECIAL_TOKENS, ShardConfig
from labkit.data.tokenize import file_sha256, iter_texts, load_tokenizer, text_row_count, tokenizer_sha256

FORMAT = "labkit-shards"
VERSION = 1
INDEX_NAME = "index.json"
PAD_ID, CLS_ID, SEP_ID = (SPECIAL_TOKENS.index(t) for t in ("[PAD]", "[CLS]", "[SEP]"))
_REQUIRED = ("dtype", "seq_len", "vocab_size", "tokenizer_sha256", "special_ids", "n_documents",
             "n_sequences", "n_tokens", "n_bytes", "shards")
_SHARD_RE = re.compile(r"shard-\d{5}\.bin")
_TMP_RE = re.compile(r"\.(shard-\d{5}\.bin|index\.json)\.tmp-\d+")


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


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_shards(docs_path: str, tokenizer_path: str, out_dir: str, cfg: ShardConfig, *,
                 progress: bool = True) -> dict:
    """Tokenize the ``text`` column of ``docs_path`` (Parquet file or glob) with the tokenizer at
    ``tokenizer_path`` and write packed shards + ``index.json`` (last) to ``out_dir``.

    Reads ``cfg.batch_docs`` documents (non-null ``text``) per polars slice and encodes them with
    ``Tokenizer.encode_batch`` (no special tokens added; special-token strings in the text are
    encoded as text, so only packing inserts ids 0, 2, 3). Any index.json and shard files of an
    earlier run in ``out_dir`` are removed first, so the directory is never complete-looking while
    being written. A tqdm bar (stderr) counts documents when ``progress``.

    Returns the index dict: {"format": "labkit-shards", "version": 1, "dtype": "uint16"|"uint32",
    "seq_len", "vocab_size", "tokenizer_sha256", "special_ids": {"[PAD]": 0, ...},
    "n_documents", "n_sequences", "n_tokens" (non-PAD ids), "n_bytes" (all shards),
    "shards": [{"file", "n_sequences", "n_bytes", "sha256"}, ...]}.
    Raises ``ValueError`` naming ``docs_path`` when it holds no documents and ``ShardError``
    naming the tokenizer when its special tokens are not at ids 0..4.
    """
    from tqdm.std import tqdm

    tok = load_tokenizer(tokenizer_path)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise ShardError(f"{tokenizer_path}: {name} has id {tok.token_to_id(name)}, expected {i}")
    tok.encode_special_tokens = True
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast (tokenizers >= 0.21) skips offsets
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dtype = shard_dtype(vocab_size)
    n_rows_in = text_row_count(docs_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX_NAME).unlink(missing_ok=True)
    for old in out.iterdir():  # shards of an earlier run, and temp files of a crashed one
        if _SHARD_RE.fullmatch(old.name) or _TMP_RE.fullmatch(old.name):
            old.unlink()

    shards: list[dict] = []
    tokens_per_shard: list[int] = []  # non-PAD ids
    pending: list[np.ndarray] = []  # rows not yet written, [*, seq_len] each
    carry = np.empty(0, dtype=np.int64)
    n_docs = 0

    def flush(final: bool) -> None:
        rows = np.concatenate(pending) if pending else np.empty((0, cfg.seq_len), dtype=dtype)
        pending.clear()
        while len(rows) >= cfg.sequences_per_shard or (final and len(rows)):
            block, rows = rows[: cfg.sequences_per_shard], rows[cfg.sequences_per_shard:]
            data = np.ascontiguousarray(block, dtype=dtype).tobytes()
            name = f"shard-{len(shards):05d}.bin"
            _atomic_write(out / name, data)
            shards.append({"file": name, "n_sequences": len(block), "n_bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()})
            tokens_per_shard.append(int(np.count_nonzero(block != PAD_ID)))
        if len(rows):
            pending.append(rows)

    with tqdm(total=n_rows_in, unit="doc", desc="shards", file=sys.stderr, disable=not progress,
              mininterval=5.0) as bar:
        for texts in iter_texts(docs_path, batch_docs=cfg.batch_docs):
            encodings = encode(texts, add_special_tokens=False)
            stream = np.concatenate([carry, doc_stream([e.ids for e in encodings])])
            rows, carry = pack_rows(stream, cfg.seq_len, final=False)
            pending.append(rows.astype(dtype))
            n_docs += len(texts)
            flush(final=False)
            bar.update(len(texts))
    if n_docs == 0:
        raise ValueError(f"{docs_path}: no documents to write shards from")
    pending.append(pack_rows(carry, cfg.seq_len, final=True)[0].astype(dtype))
    flush(final=True)

    index = {
        "format": FORMAT, "version": VERSION, "dtype": dtype.name, "seq_len": cfg.seq_len,
        "vocab_size": vocab_size, "tokenizer_sha256": tokenizer_sha256(tokenizer_path),
        "special_ids": {t: i for i, t in enumerate(SPECIAL_TOKENS)}, "n_documents": n_docs,
        "n_sequences": sum(s["n_sequences"] for s in shards),
        "n_tokens": sum(tokens_per_shard),
        "n_bytes": sum(s["n_bytes"] for s in shards), "shards": shards,
    }
    _atomic_write(out / INDEX_NAME, (json.dumps(index, indent=1) + "\n").encode())
    return index


def read_index(data_dir: str | os.PathLike) -> dict:
    """The ``index.json`` of a complete shard set. ``ShardError`` naming the file when it is
    missing, not JSON, of another format or version, or lacks a field."""
    path = Path(data_dir) / INDEX_NAME
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
        digest = file_sha256(path)
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
    against the index (``ShardError`` naming the file); ``verify=True`` also checks sha256.
    Pickles small (directory + index), so it can go to DataLoader workers under spawn.
    """

    def __init__(self, data_dir: str | os.PathLike, *, verify: bool = False) -> None:
        self.data_dir = Path(data_dir)
        self.index = verify_shards(data_dir) if verify else read_index(data_dir)
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
