"""Near-duplicate removal with MinHash LSH (datasketch).

Three steps, so the expensive one spreads over engines and the result does not depend on how:

1. ``signatures(texts, cfg)`` -> uint64 array [n_docs, num_perm]: word-shingle MinHash per
   document (pure per document: any split of the documents gives the same rows);
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

from typing import Iterable

import numpy as np
import polars as pl
from datasketch import LeanMinHash, MinHash, MinHashLSH

from labkit.config import DedupConfig

_SCHEME = "affine32"
"""datasketch's hashing scheme, fixed so signatures from any engine are comparable."""


def shingles(text: str, size: int) -> set[bytes]:
    """Word ``size``-grams of ``text`` (whitespace-split), UTF-8 encoded; a text shorter than
    ``size`` words gives one shingle of all its words; an empty text gives an empty set."""
    words = text.split()
    if len(words) <= size:
        return {" ".join(words).encode()} if words else set()
    return {" ".join(words[i:i + size]).encode() for i in range(len(words) - size + 1)}


def signatures(texts: Iterable[str], cfg: DedupConfig = DedupConfig()) -> np.ndarray:
    """MinHash signatures, uint64 array of shape [n_docs, cfg.num_perm]."""
    sets = [shingles(t, cfg.shingle_size) for t in texts]
    mhs = MinHash.bulk(sets, num_perm=cfg.num_perm, seed=cfg.seed, scheme=_SCHEME)
    if not mhs:
        return np.zeros((0, cfg.num_perm), dtype=np.uint64)
    return np.stack([m.hashvalues.astype(np.uint64) for m in mhs])


def candidate_probability(jaccard: float, cfg: DedupConfig = DedupConfig()) -> float:
    """Probability that a pair of Jaccard similarity ``jaccard`` shares at least one LSH band:
    1 - (1 - s^rows)^bands."""
    return 1.0 - (1.0 - jaccard**cfg.rows) ** cfg.bands


def near_duplicates(ids: list[str], sigs: np.ndarray, cfg: DedupConfig = DedupConfig()) -> dict[str, str]:
    """Map each near-duplicate id to the kept id it duplicates (see module docstring).

    ``sigs[i]`` is the signature of ``ids[i]``; raises ValueError if the shapes disagree or an
    id repeats.
    """
    if sigs.shape != (len(ids), cfg.num_perm):
        raise ValueError(f"sigs: expected shape ({len(ids)}, {cfg.num_perm}), got {sigs.shape}")
    if len(set(ids)) != len(ids):
        raise ValueError("ids: document ids must be unique")
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm, params=(cfg.bands, cfg.rows))
    kept_sigs: dict[str, np.ndarray] = {}
    dup_of: dict[str, str] = {}
    for i in np.argsort(np.asarray(ids, dtype=object), kind="stable"):
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

    Adds ``duplicate_of`` (Utf8, null when kept) and sets ``drop_reason`` to "near_duplicate"
    on duplicates (keeping an existing non-null ``drop_reason``; rows already dropped take no
    part). Collects ``id`` and ``text`` of the candidate rows once to compute signatures.
    """
    has_reason = "drop_reason" in lf.collect_schema().names()
    live = lf.filter(pl.col("drop_reason").is_null()) if has_reason else lf
    docs = live.select("id", "text").collect()
    dup_of = near_duplicates(docs["id"].to_list(), signatures(docs["text"].to_list(), cfg), cfg)
    mapping = pl.LazyFrame({"id": list(dup_of), "duplicate_of": list(dup_of.values())},
                           schema={"id": pl.Utf8, "duplicate_of": pl.Utf8})
    out = lf.join(mapping, on="id", how="left")
    reason = pl.when(pl.col("duplicate_of").is_not_null()).then(pl.lit("near_duplicate"))
    if has_reason:
        return out.with_columns(pl.coalesce(pl.col("drop_reason"), reason.otherwise(None)).alias("drop_reason"))
    return out.with_columns(reason.otherwise(None).cast(pl.Utf8).alias("drop_reason"))
