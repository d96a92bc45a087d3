"""Near-duplicate removal with MinHash LSH (datasketch).

Three steps, so the expensive one spreads over engines and the result does not depend on how:

1. ``signatures(texts, cfg)`` -> uint32 array [n_docs, num_perm]: word-shingle MinHash per
   document with datasketch's affine32 permutations, vectorised over documents (pure per
   document: any split of the documents gives the same rows);
2. ``near_duplicates(ids, sigs, cfg)``: each signature is cut into ``cfg.bands`` bands, each
   band hashed to a 64-bit key (``band_hashes``); documents sharing a key are candidate pairs
   (``bucket_pairs``); a candidate pair whose estimated Jaccard similarity is >= ``cfg.threshold``
   is an edge (``similar_pairs``); of each connected component of the edges (``components``)
   the smallest id is kept, the others are near duplicates of it. This is how datatrove
   (``MinhashDedupBuckets`` -> ``MinhashDedupCluster``) and NeMo Curator (LSH buckets ->
   Jaccard check -> connected components) deduplicate at scale; ``labkit.data.partitioned``
   runs the same steps over engines with the band keys hash-partitioned on disk and gives the
   same kept set for any engine count. (Until 2026-11-30 this step was greedy: documents in id
   order, each checked against the LSH index of those kept so far. A chain a~b~c with a and c
   dissimilar then kept a and c; connected components keep a only. docs/log.md.)
3. ``near_dedup(lf, cfg)``: both on a LazyFrame with ``id`` and ``text``, returning it with a
   ``drop_reason`` of "near_duplicate" (and ``duplicate_of``) on the dropped rows.

Banding: with b bands of r rows a pair of Jaccard s becomes a candidate with probability
1 - (1 - s^r)^b (Leskovec, Rajaraman, Ullman, Mining of Massive Datasets, section 3.4).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import polars as pl
from datasketch import MinHash

from labkit.config import DedupConfig
from labkit.io import atomic_write, atomic_write_npy

__all__ = ["band_hashes", "bucket_pairs", "candidate_probability", "components", "near_dedup", "near_dedup_parquet",
           "near_duplicates", "shingle_hashes", "shingles", "signature_part", "signatures", "similar_pairs"]

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


def signatures(texts: Iterable[str], cfg: DedupConfig = DedupConfig(), *, chunk_docs: int = 512,
               chunk_shingles: int = 1 << 11) -> np.ndarray:
    """MinHash signatures, uint32 array of shape [n_docs, cfg.num_perm]: per permutation
    (a, b) of datasketch's ``MinHash(num_perm, seed, scheme="affine32").permutations``, the
    minimum over the document's shingle hashes h of a * fmix32(h) + b mod 2^32 -- exactly what
    ``datasketch.MinHash(hashfunc=int, scheme="affine32").update_batch(hashes)`` computes
    (tests/data/test_dedup.py checks it), done for many documents at once. A document without
    words gets all 2^32 - 1 (datasketch's empty MinHash).

    Memory, whatever the number of texts: the shingle arrays of ``chunk_docs`` documents and
    ``chunk_shingles`` * num_perm * 4 bytes (1 MiB at the defaults, the size of one core's L2
    cache on this kind of machine) for the permuted hashes. Neither chunk size changes the result.
    """
    texts = list(texts)
    a, b = MinHash(num_perm=cfg.num_perm, seed=cfg.seed, scheme=_SCHEME).permutations
    a, b = a.astype(np.uint32), b.astype(np.uint32)
    out = np.full((len(texts), cfg.num_perm), np.uint32(0xFFFFFFFF), dtype=np.uint32)
    for first in range(0, len(texts), chunk_docs):
        hashes, offsets = shingle_hashes(texts[first:first + chunk_docs], cfg.shingle_size)
        _min_permuted(_fmix32(hashes), offsets, a, b, out[first:first + chunk_docs], chunk_shingles)
    return out


def _min_permuted(mixed: np.ndarray, offsets: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray,
                  chunk_shingles: int) -> None:
    """``out[d] = min over document d's hashes h of a * h + b mod 2^32`` (uint32, in place), for
    the documents of ``offsets`` (int64 [n + 1]); ``out`` rows of documents without shingles are
    left as they are. ``chunk_shingles`` hashes at a time."""
    n = len(offsets) - 1
    doc = 0
    while doc < n:
        stop = int(np.searchsorted(offsets, offsets[doc] + chunk_shingles, side="right")) - 1
        stop = min(max(stop, doc + 1), n)
        lo, hi = offsets[doc], offsets[stop]
        if hi > lo:
            phv = mixed[lo:hi, None] * a[None, :] + b[None, :]  # [n_shingles, num_perm], wraps mod 2^32
            nonempty = np.flatnonzero(offsets[doc + 1:stop + 1] > offsets[doc:stop]) + doc
            out[nonempty] = np.minimum.reduceat(phv, offsets[nonempty] - lo, axis=0)
        doc = stop


def candidate_probability(jaccard: float, cfg: DedupConfig = DedupConfig()) -> float:
    """Probability that a pair of Jaccard similarity ``jaccard`` shares at least one LSH band:
    1 - (1 - s^rows)^bands."""
    return 1.0 - (1.0 - jaccard**cfg.rows) ** cfg.bands


_MIX = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(h: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea, Flood 2014) on uint64 arrays: a well-spread 64-bit hash."""
    with np.errstate(over="ignore"):
        h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def band_hashes(sigs: np.ndarray, cfg: DedupConfig = DedupConfig()) -> np.ndarray:
    """uint64 [n_docs, bands]: one 64-bit key per LSH band of each signature (``sigs`` uint32
    [n_docs, bands * rows]). Band b's key hashes b and its ``rows`` values (FNV-style
    multiply-xor, then SplitMix64), so equal bands of different band numbers never share a key;
    two different bands share one with probability 2^-64. Pure per document."""
    n = len(sigs)
    s = sigs.reshape(n, cfg.bands, cfg.rows).astype(np.uint64)
    h = np.broadcast_to(_splitmix64(np.arange(1, cfg.bands + 1, dtype=np.uint64)), (n, cfg.bands)).copy()
    with np.errstate(over="ignore"):
        for j in range(cfg.rows):
            h = (h ^ s[:, :, j]) * _MIX
    return _splitmix64(h)


def bucket_pairs(keys: np.ndarray, docs: np.ndarray, max_bucket: int) -> np.ndarray:
    """Candidate pairs from LSH band entries: int64 [n_pairs, 2], each row (a, b) with a < b, unique.

    ``keys`` (uint64) and ``docs`` (int64, a document number in corpus order) are one entry per
    (document, band). A bucket is the entries of one key; after sorting by (key, doc), each
    document pairs with the next ``max_bucket`` documents of its bucket -- every pair of a bucket
    of at most ``max_bucket + 1`` documents. Depends only on the entries of each bucket, so any
    partition of the keys over engines gives the same pairs."""
    keys, docs = np.asarray(keys, dtype=np.uint64), np.asarray(docs, dtype=np.int64)
    order = np.lexsort((docs, keys))
    keys, docs = keys[order], docs[order]
    shared = np.zeros(len(keys), dtype=bool)  # entries whose bucket holds another entry
    if len(keys) > 1:
        same = keys[1:] == keys[:-1]
        shared[1:] |= same
        shared[:-1] |= same
    keys, docs = keys[shared], docs[shared]
    pairs = []
    for d in range(1, max_bucket + 1):
        same = keys[d:] == keys[:-d]
        if not same.any():
            break
        pairs.append(np.stack([docs[:-d][same], docs[d:][same]], axis=1))
    if not pairs:
        return np.empty((0, 2), dtype=np.int64)
    p = np.concatenate(pairs)
    p = p[p[:, 0] != p[:, 1]]
    return np.unique(np.sort(p, axis=1), axis=0)


def similar_pairs(pairs: np.ndarray, gather, cfg: DedupConfig = DedupConfig(), *, chunk: int = 8192) -> np.ndarray:
    """The rows of ``pairs`` (int64 [m, 2]) whose estimated Jaccard similarity -- the share of
    equal signature values -- is at least ``cfg.threshold`` (NeMo Curator's false-positive
    check). ``gather(docs)`` returns the signatures uint32 [len(docs), num_perm] of document
    numbers ``docs``. Memory: ``chunk`` pairs of signatures at a time."""
    keep = np.zeros(len(pairs), dtype=bool)
    for lo in range(0, len(pairs), chunk):
        a, b = gather(pairs[lo:lo + chunk, 0]), gather(pairs[lo:lo + chunk, 1])
        keep[lo:lo + chunk] = (a == b).mean(axis=1) >= cfg.threshold
    return pairs[keep]


def components(pairs: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Connected components of the graph with edges ``pairs`` (int64 [m, 2] of node numbers
    0..n-1): int64 [n], each node's label = the smallest ``rank`` in its component (``rank`` a
    permutation of 0..n-1, e.g. the order of the documents' ids). Union-find by min-label
    propagation with pointer jumping (vectorised; Shiloach-Vishkin style hooking), deterministic."""
    label = np.asarray(rank, dtype=np.int64).copy()
    by_rank = np.argsort(label)  # node of each rank
    a, b = pairs[:, 0], pairs[:, 1]
    while True:
        m = np.minimum(label[a], label[b])
        new = label.copy()
        np.minimum.at(new, a, m)
        np.minimum.at(new, b, m)
        new = new[by_rank[new]]  # pointer jumping: take the label of the node holding my label
        if np.array_equal(new, label):
            return label
        label = new


def near_duplicates(ids: list[str], sigs: np.ndarray, cfg: DedupConfig = DedupConfig(), *,
                    progress: bool = False) -> dict[str, str]:
    """Map each near-duplicate id to the id kept for it (see module docstring), in memory: the
    reference the distributed steps (``labkit.data.partitioned``) reproduce.

    Candidate pairs share an LSH band (``bucket_pairs``, documents numbered in the order of
    ``ids``); pairs with estimated Jaccard >= ``cfg.threshold`` are edges (``similar_pairs``);
    of each connected component (``components``) the smallest id is kept and every other
    member maps to it. ``sigs[i]`` is the signature of ``ids[i]``; raises ValueError if the
    shapes disagree or an id repeats. ``progress`` is accepted for compatibility (no bar).
    """
    if sigs.shape != (len(ids), cfg.num_perm):
        raise ValueError(f"sigs: expected shape ({len(ids)}, {cfg.num_perm}), got {sigs.shape}")
    if len(set(ids)) != len(ids):
        raise ValueError("ids: document ids must be unique")
    keys = band_hashes(sigs, cfg)
    docs = np.repeat(np.arange(len(ids), dtype=np.int64), cfg.bands)
    edges = similar_pairs(bucket_pairs(keys.reshape(-1), docs, cfg.max_bucket), lambda d: sigs[d], cfg)
    nodes = np.unique(edges)
    if not len(nodes):
        return {}
    node_ids = np.asarray(ids, dtype=object)[nodes]
    rank = np.empty(len(nodes), dtype=np.int64)
    rank[np.argsort(node_ids, kind="stable")] = np.arange(len(nodes))
    label = components(np.searchsorted(nodes, edges), rank)
    by_rank = node_ids[np.argsort(rank)]
    return {str(node_ids[i]): str(by_rank[label[i]]) for i in range(len(nodes)) if label[i] != rank[i]}


def near_dedup(lf: pl.LazyFrame, cfg: DedupConfig = DedupConfig()) -> pl.LazyFrame:
    """Mark near duplicates in a frame with ``id`` and ``text`` columns.

    Keeps the rows in input order, adds ``duplicate_of`` (Utf8, null when kept) and sets
    ``drop_reason`` to "near_duplicate" on duplicates (keeping an existing non-null
    ``drop_reason``; rows already dropped take no part). Streams ``id`` and ``text`` of the
    candidate rows once (polars ``collect_batches``, ``cfg.batch_rows`` rows at a time) to
    compute signatures; memory: one batch of texts, the ids (one column) and the signatures,
    uint32 [n, num_perm] (448 bytes per document by default), plus the band keys and candidate
    pairs of ``near_duplicates`` (about 3 x 16 bytes per document and band).
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
    atomic_write_npy(out, sigs)
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
    by default) and the band keys and candidate pairs of ``near_duplicates`` (about 3 x 16
    bytes per document and band); grows with the corpus (one engine): the bounded, distributed
    version is ``labkit.data.partitioned``; never the texts: the kept rows are streamed from
    ``docs_path`` (``sink_parquet``, row groups of ``cfg.batch_rows`` rows).
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
