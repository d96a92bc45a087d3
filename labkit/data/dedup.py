"""Near-duplicate removal with MinHash LSH (datasketch).

Three steps, so the expensive one spreads over engines and the result does not depend on how:

1. ``signatures(texts, cfg)`` -> uint32 array [n_docs, num_perm]: word-shingle MinHash per
   document with datasketch's affine32 permutations, vectorised over documents (pure per
   document: any split of the documents gives the same rows);
2. ``near_duplicates(ids, sigs, cfg)``: documents are visited in ascending id order; each is
   queried against the LSH index of the documents kept so far; a candidate whose estimated
   Jaccard similarity is >= ``cfg.threshold`` makes it a duplicate of that candidate, else it
   is inserted and kept. Visiting by id makes the kept set the same for any input order or
   engine count: of a group of near duplicates the smallest id survives;
3. ``near_dedup(lf, cfg)``: both on a LazyFrame with ``id`` and ``text``, returning it with a
   ``drop_reason`` of "near_duplicate" (and ``duplicate_of``) on the dropped rows.

Banding: with b bands of r rows a pair of Jaccard s becomes a candidate with probability
1 - (1 - s^r)^b (Leskovec, Rajaraman, Ullman, Mining of Massive Datasets, section 3.4).
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path
from typing import Iterable

import numpy as np
import polars as pl
from datasketch import LeanMinHash, MinHash, MinHashLSH

from labkit.io import atomic_write
from labkit.config import DedupConfig

_P = 0x9E3779B97F4A7C15
"""Odd 64-bit multiplier of the shingle hash (the golden-ratio constant)."""
_SCHEME = "affine32"
"""datasketch's hashing scheme, fixed so signatures from any engine are comparable."""


def shingles(text: str, size: int) -> set[bytes]:
    """Word ``size``-grams of ``text`` (whitespace-split), UTF-8 encoded; a text shorter than
    ``size`` words gives one shingle of all its words; an empty text gives an empty set."""
    words = text.split()
    if len(words) <= size:
        return {" ".join(words).encode()} if words else set()
    return {" ".join(words[i:i + size]).encode() for i in range(len(words) - size + 1)}


def _word_hashes(words: pl.Series) -> np.ndarray:
    """uint64 per word: the first 8 bytes of blake2b of its UTF-8 (stable across processes and
    versions), computed once per distinct word."""
    uniq = words.unique()
    hashed = [int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") for w in uniq.to_list()]
    table = pl.DataFrame({"w": uniq, "h": pl.Series(hashed, dtype=pl.UInt64)})
    return pl.DataFrame({"w": words}).join(table, on="w", how="left", maintain_order="left")["h"].to_numpy()


def shingle_hashes(texts: list[str], size: int) -> tuple[np.ndarray, np.ndarray]:
    """The word ``size``-grams of each text (as ``shingles``) hashed to uint32, vectorised.

    Returns (hashes: uint32 [n_shingles], offsets: int64 [n_docs + 1]); document d's shingles are
    ``hashes[offsets[d]:offsets[d + 1]]`` (repeats kept: a minimum does not care). A shingle of
    words w_0..w_{m-1} hashes to H = sum_j h(w_j) * P^j mod 2^64 (h = ``_word_hashes``, P an odd
    64-bit constant), folded to 32 bits as (H ^ H >> 32) mod 2^32.
    """
    frame = pl.DataFrame({"text": pl.Series(texts, dtype=pl.Utf8)}).with_row_index("doc")
    words = frame.select("doc", w=pl.col("text").str.extract_all(r"\S+")).explode("w").drop_nulls("w")
    n_words = np.bincount(words["doc"].to_numpy(), minlength=len(texts)).astype(np.int64)
    w = _word_hashes(words["w"])
    starts = np.concatenate([[0], np.cumsum(n_words)])[:-1]
    ends = starts + n_words
    doc_of = np.repeat(np.arange(len(texts)), n_words)
    pos = np.arange(len(w))
    first = np.zeros(len(w), dtype=bool)
    first[starts[n_words > 0]] = True
    is_start = (pos + size <= ends[doc_of]) | (first & (n_words[doc_of] < size))
    idx = pos[is_start]
    m = np.minimum(size, ends[doc_of[idx]] - idx)  # words in each shingle
    h = np.zeros(len(idx), dtype=np.uint64)
    padded = np.concatenate([w, np.zeros(size, dtype=np.uint64)])
    power = np.uint64(1)
    with np.errstate(over="ignore"):
        for j in range(size):
            h += np.where(j < m, padded[idx + j], np.uint64(0)) * power
            power = power * np.uint64(_P)
    folded = ((h ^ (h >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    per_doc = np.bincount(doc_of[idx], minlength=len(texts)) if len(idx) else np.zeros(len(texts), dtype=np.int64)
    return folded, np.concatenate([[0], np.cumsum(per_doc)]).astype(np.int64)


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser, as datasketch applies it before the affine32 permutations."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def signatures(texts: Iterable[str], cfg: DedupConfig = DedupConfig(), *, chunk_shingles: int = 1 << 16) -> np.ndarray:
    """MinHash signatures, uint32 array of shape [n_docs, cfg.num_perm]: per permutation
    (a, b) of datasketch's ``MinHash(num_perm, seed, scheme="affine32").permutations``, the
    minimum over the document's shingle hashes h of a * fmix32(h) + b mod 2^32 -- exactly what
    ``datasketch.MinHash(hashfunc=int, scheme="affine32").update_batch(hashes)`` computes
    (tests/data/test_dedup.py checks it), done for many documents at once. A document without
    words gets all 2^32 - 1 (datasketch's empty MinHash). Memory: ``chunk_shingles`` * num_perm * 4 bytes.
    """
    texts = list(texts)
    hashes, offsets = shingle_hashes(texts, cfg.shingle_size)
    a, b = MinHash(num_perm=cfg.num_perm, seed=cfg.seed, scheme=_SCHEME).permutations
    a, b = a.astype(np.uint32), b.astype(np.uint32)
    mixed = _fmix32(hashes)
    out = np.full((len(texts), cfg.num_perm), np.uint32(0xFFFFFFFF), dtype=np.uint32)
    doc = 0
    while doc < len(texts):
        stop = int(np.searchsorted(offsets, offsets[doc] + chunk_shingles, side="right")) - 1
        stop = min(max(stop, doc + 1), len(texts))
        lo, hi = offsets[doc], offsets[stop]
        if hi > lo:
            phv = mixed[lo:hi, None] * a[None, :] + b[None, :]  # [n_shingles, num_perm], wraps mod 2^32
            nonempty = np.flatnonzero(offsets[doc + 1:stop + 1] > offsets[doc:stop]) + doc
            out[nonempty] = np.minimum.reduceat(phv, offsets[nonempty] - lo, axis=0)
        doc = stop
    return out


def candidate_probability(jaccard: float, cfg: DedupConfig = DedupConfig()) -> float:
    """Probability that a pair of Jaccard similarity ``jaccard`` shares at least one LSH band:
    1 - (1 - s^rows)^bands."""
    return 1.0 - (1.0 - jaccard**cfg.rows) ** cfg.bands


def near_duplicates(ids: list[str], sigs: np.ndarray, cfg: DedupConfig = DedupConfig(), *,
                    progress: bool = False) -> dict[str, str]:
    """Map each near-duplicate id to the kept id it duplicates (see module docstring).

    ``sigs[i]`` is the signature of ``ids[i]``; raises ValueError if the shapes disagree or an
    id repeats. ``progress``: a tqdm bar (stderr) over the documents.
    """
    from tqdm.std import tqdm

    if sigs.shape != (len(ids), cfg.num_perm):
        raise ValueError(f"sigs: expected shape ({len(ids)}, {cfg.num_perm}), got {sigs.shape}")
    if len(set(ids)) != len(ids):
        raise ValueError("ids: document ids must be unique")
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm, params=(cfg.bands, cfg.rows))
    kept_sigs: dict[str, np.ndarray] = {}
    dup_of: dict[str, str] = {}
    for i in tqdm(np.argsort(np.asarray(ids, dtype=object), kind="stable"), desc="near-dedup: LSH", unit="doc",
                  disable=not progress, mininterval=2.0, file=sys.stderr):
        doc_id = ids[i]
        mh = LeanMinHash(seed=cfg.seed, hashvalues=sigs[i], scheme=_SCHEME)
        best, best_sim = None, -1.0
        for cand in sorted(lsh.query(mh)):
            sim = float(np.mean(kept_sigs[cand] == sigs[i]))
            if sim > best_sim:
                best, best_sim = cand, sim
        if best is not None and best_sim >= cfg.threshold:
            dup_of[doc_id] = best
        else:
            lsh.insert(doc_id, mh)
            kept_sigs[doc_id] = sigs[i]
    return dup_of


def near_dedup(lf: pl.LazyFrame, cfg: DedupConfig = DedupConfig()) -> pl.LazyFrame:
    """Mark near duplicates in a frame with ``id`` and ``text`` columns.

    Keeps the rows in input order, adds ``duplicate_of`` (Utf8, null when kept) and sets
    ``drop_reason`` to "near_duplicate" on duplicates (keeping an existing non-null
    ``drop_reason``; rows already dropped take no part). Streams ``id`` and ``text`` of the
    candidate rows once (polars ``collect_batches``, ``cfg.batch_rows`` rows at a time) to
    compute signatures; memory: one batch of texts, the ids (one column) and the signatures,
    uint32 [n, num_perm] (448 bytes per document by default), plus the LSH index of
    ``near_duplicates``.
    """
    has_reason = "drop_reason" in lf.collect_schema().names()
    live = lf.filter(pl.col("drop_reason").is_null()) if has_reason else lf
    ids: list[str] = []
    sigs = [np.zeros((0, cfg.num_perm), dtype=np.uint32)]
    for batch in live.select("id", "text").collect_batches(chunk_size=cfg.batch_rows):
        ids.extend(batch["id"].to_list())
        sigs.append(signatures(batch["text"].to_list(), cfg))
    dup_of = near_duplicates(ids, np.concatenate(sigs), cfg)
    mapping = pl.LazyFrame({"id": list(dup_of), "duplicate_of": list(dup_of.values())},
                           schema={"id": pl.Utf8, "duplicate_of": pl.Utf8})
    out = lf.join(mapping, on="id", how="left", maintain_order="left")  # rows in input order
    reason = pl.when(pl.col("duplicate_of").is_not_null()).then(pl.lit("near_duplicate"))
    if has_reason:
        return out.with_columns(pl.coalesce(pl.col("drop_reason"), reason.otherwise(None)).alias("drop_reason"))
    return out.with_columns(reason.otherwise(None).cast(pl.Utf8).alias("drop_reason"))


def signature_part(docs_path: str, start: int, stop: int, cfg: DedupConfig, out_path: str) -> dict:
    """Signatures of rows ``[start, stop)`` of the Parquet ``docs_path`` (column ``text``; a null
    text counts as empty) saved as ``.npy`` (uint32 [stop - start, num_perm]) at ``out_path``
    via temp file + rename: what each engine runs on its share. Reads ``cfg.batch_rows`` texts
    per polars slice, so memory is one batch of texts plus the signatures (num_perm * 4 bytes
    per row). Returns {"start", "stop", "seconds"}."""
    t0 = time.perf_counter()
    scan = pl.scan_parquet(docs_path).select(pl.col("text").fill_null(""))
    parts = [np.zeros((0, cfg.num_perm), dtype=np.uint32)]
    for lo in range(start, stop, cfg.batch_rows):
        texts = scan.slice(lo, min(cfg.batch_rows, stop - lo)).collect()["text"].to_list()
        parts.append(signatures(texts, cfg))
        if len(texts) < min(cfg.batch_rows, stop - lo):  # past the last row
            break
    sigs = np.concatenate(parts)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: tmp.write_bytes(_npy_bytes(sigs)))  # np.save(path) would add .npy
    return {"start": start, "stop": stop, "seconds": time.perf_counter() - t0}


def near_dedup_parquet(docs_path: str, sig_paths: list[str], out_path: str, cfg: DedupConfig, *,
                       progress: bool = False) -> dict:
    """Drop near duplicates from the Parquet ``docs_path`` given the signatures of its rows in
    order (``signature_part`` files, concatenated in the order given): writes the kept rows
    (input columns and order) to ``out_path`` and the pairs ``(id, duplicate_of)`` to
    ``<out_path stem>.near_duplicates.parquet``, both via temp file + rename.

    Returns {"input", "kept", "near_duplicate", "seconds" (LSH pass), "docs_per_s"}. Raises
    ValueError naming ``sig_paths`` when the signature rows do not match the documents.

    Memory: the ids (one column), the signatures (uint32 [n, num_perm], 448 bytes per document
    by default) and the LSH index (datasketch ``MinHashLSH``: Python objects per kept document
    and band, measured about 4.7 KB per kept document with the default 14 bands; the largest
    term); never the texts: the kept rows are streamed from ``docs_path`` (``sink_parquet``,
    row groups of ``cfg.batch_rows`` rows).
    """
    t0 = time.perf_counter()
    ids = pl.scan_parquet(docs_path).select("id").collect()["id"].to_list()
    sigs = np.concatenate([np.load(p) for p in sig_paths]) if sig_paths else np.zeros((0, cfg.num_perm), np.uint32)
    if len(sigs) != len(ids):
        raise ValueError(f"sig_paths: {len(sigs)} signature rows for {len(ids)} documents in {docs_path}")
    dup_of = near_duplicates(ids, sigs, cfg, progress=progress)
    pairs = pl.DataFrame({"id": list(dup_of), "duplicate_of": list(dup_of.values())},
                         schema={"id": pl.Utf8, "duplicate_of": pl.Utf8})
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    for frame, path in ((pl.scan_parquet(docs_path).filter(~pl.col("id").is_in(pairs["id"].implode())), out),
                        (pairs.lazy(), out.with_name(f"{out.stem}.near_duplicates.parquet"))):
        # bounded: rows buffer per row group
        atomic_write(path, lambda tmp, frame=frame: frame.sink_parquet(tmp, row_group_size=cfg.batch_rows))
    seconds = time.perf_counter() - t0
    return {"input": len(ids), "kept": len(ids) - len(dup_of), "near_duplicate": len(dup_of),
            "seconds": round(seconds, 3), "docs_per_s": round(len(ids) / seconds, 1) if seconds else None}


def _npy_bytes(array: np.ndarray) -> bytes:
    """``array`` in NumPy's .npy format, as bytes."""
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()
