"""MinHash LSH near-dedup: threshold behaviour, determinism, banding probability."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import polars as pl
import pytest

from labkit.config import DedupConfig
from labkit.data.dedup import (candidate_probability, near_dedup, near_dedup_parquet, near_duplicates, shingle_hashes,
                               shingles, signature_part, signatures)


def _doc(rng: random.Random, n: int = 200) -> list[str]:
    ops = ["mov", "add", "sub", "xor", "lea", "cmp", "jne", "call", "push", "pop"]
    regs = ["rax", "rbx", "rcx", "rdx", "rsi", "rdi", "r8", "r9"]
    return [f"{rng.choice(ops)} {rng.choice(regs)}, {rng.choice(regs)}" for _ in range(n)]


def _jaccard(a: str, b: str, k: int) -> float:
    sa, sb = shingles(a, k), shingles(b, k)
    return len(sa & sb) / len(sa | sb)


def _variant_with_jaccard(base: list[str], target: float, rng: random.Random, k: int) -> tuple[str, float]:
    """Append fresh lines to ``base`` until the shingle Jaccard with it falls to ``target``."""
    a = "\n".join(base)
    lines = list(base)
    while True:
        lines.append(f"nop {rng.random():.12f}")
        b = "\n".join(lines)
        j = _jaccard(a, b, k)
        if j <= target:
            return b, j


def test_pairs_just_above_and_just_below_the_threshold():
    cfg = DedupConfig(bands=32, rows=8, threshold=0.8)  # 256 permutations: std of the estimate ~0.025
    rng = random.Random(0)
    base = _doc(rng, 300)
    above, j_above = _variant_with_jaccard(base, 0.90, rng, cfg.shingle_size)
    below, j_below = _variant_with_jaccard(base, 0.65, rng, cfg.shingle_size)
    assert 0.85 < j_above <= 0.90 and 0.6 < j_below <= 0.65
    texts = ["\n".join(base), above, below]
    dup = near_duplicates(["a", "b", "c"], signatures(texts, cfg), cfg)
    assert dup == {"b": "a"}


def test_exact_copies_are_near_duplicates_and_unrelated_docs_are_not():
    rng = random.Random(1)
    docs = ["\n".join(_doc(rng)) for _ in range(20)]
    texts = docs + [docs[3], docs[7]]
    ids = [f"{i:03d}" for i in range(len(texts))]
    assert near_duplicates(ids, signatures(texts)) == {"020": "003", "021": "007"}


def test_smallest_id_survives_whatever_the_order_and_split():
    rng = random.Random(2)
    base = ["\n".join(_doc(rng)) for _ in range(10)]
    texts = base + base[:5]
    ids = [f"id{i:02d}" for i in range(len(texts))]
    frame = pl.DataFrame({"id": ids, "text": texts})
    ref = near_dedup(frame.lazy()).collect().sort("id")
    shuffled = frame.sample(fraction=1.0, shuffle=True, seed=3)
    # signatures computed in two halves, as two engines would
    half = len(texts) // 2
    sigs = np.concatenate([signatures(shuffled["text"][:half].to_list()), signatures(shuffled["text"][half:].to_list())])
    assert near_duplicates(shuffled["id"].to_list(), sigs) == {f"id{10 + i:02d}": f"id{i:02d}" for i in range(5)}
    assert ref.filter(pl.col("drop_reason") == "near_duplicate")["id"].to_list() == [f"id{10 + i:02d}" for i in range(5)]


def test_already_dropped_rows_keep_their_reason_and_take_no_part():
    rng = random.Random(4)
    t = "\n".join(_doc(rng))
    lf = pl.LazyFrame({"id": ["a", "b", "c"], "text": [t, t, t], "drop_reason": ["too_short", None, None]})
    out = near_dedup(lf).collect().sort("id")
    assert out["drop_reason"].to_list() == ["too_short", None, "near_duplicate"]
    assert out["duplicate_of"].to_list() == [None, None, "b"]


def test_candidate_probability_closed_form():
    cfg = DedupConfig()
    assert cfg.num_perm == 112
    # REFERENCES D: a pair at Jaccard 0.8 is caught with P = 1 - (1 - 0.8^8)^14 ~ 0.92
    assert candidate_probability(0.8, cfg) == pytest.approx(1 - (1 - 0.8**8) ** 14)
    assert candidate_probability(0.8, cfg) == pytest.approx(0.92, abs=0.01)


def test_bad_input():
    with pytest.raises(ValueError, match="threshold"):
        DedupConfig(threshold=0)
    with pytest.raises(ValueError, match="sigs"):
        near_duplicates(["a"], np.zeros((2, 112), dtype=np.uint64))
    with pytest.raises(ValueError, match="unique"):
        near_duplicates(["a", "a"], np.zeros((2, 112), dtype=np.uint64))


def _real_functions(n: int) -> list[str]:
    from tests.data.real_corpus import libc_functions

    return libc_functions(n)


def test_vectorised_signatures_equal_datasketch_minhash():
    """Each row equals datasketch's own MinHash (affine32, same seed) fed that document's shingle
    hashes; the shingle hashes number exactly the distinct word 5-grams of ``shingles``."""
    from datasketch import MinHash

    cfg = DedupConfig()
    texts = _real_functions(60) + ["", "ret", "a b c d", "a b c d e", "  spaced\n\nout  words here now ok"]
    hashes, offsets = shingle_hashes(texts, cfg.shingle_size)
    sigs = signatures(texts, cfg, chunk_shingles=97)  # tiny chunks: documents straddle none, results identical
    assert sigs.dtype == np.uint32 and sigs.shape == (len(texts), cfg.num_perm)
    np.testing.assert_array_equal(sigs, signatures(texts, cfg))
    np.testing.assert_array_equal(sigs, signatures(texts, cfg, chunk_docs=7))  # chunks of documents: the same rows
    for i, text in enumerate(texts):
        mine = hashes[offsets[i]:offsets[i + 1]]
        assert len(set(mine.tolist())) == len(shingles(text, cfg.shingle_size)), i
        ref = MinHash(num_perm=cfg.num_perm, seed=cfg.seed, scheme="affine32", hashfunc=int)
        ref.update_batch([int(h) for h in mine])
        np.testing.assert_array_equal(ref.hashvalues, sigs[i])
    assert (sigs[len(texts) - 5] == np.iinfo(np.uint32).max).all()  # empty document


def test_engine_split_keeps_the_same_documents(tmp_path):
    """Signatures of 1 or 3 row ranges (as engines compute them) give the same kept file."""
    texts = _real_functions(120)
    texts = texts + texts[:10] + [t + "\nnop" for t in texts[10:20]]  # exact and near copies
    ids = [hashlib.sha1(str(i).encode()).hexdigest()[:16] for i in range(len(texts))]
    pl.DataFrame({"id": ids, "text": texts}).write_parquet(tmp_path / "docs.parquet")
    cfg = DedupConfig()
    results = {}
    for split in ([(0, 140)], [(0, 50), (50, 51), (51, 140)]):
        paths = []
        for k, (s, e) in enumerate(split):
            paths.append(str(tmp_path / f"{len(split)}" / f"sig-{k}.npy"))
            signature_part(str(tmp_path / "docs.parquet"), s, e, cfg, paths[-1])
        out = tmp_path / f"{len(split)}" / "kept.parquet"
        results[len(split)] = near_dedup_parquet(str(tmp_path / "docs.parquet"), paths, str(out), cfg)
        np.testing.assert_array_equal(np.concatenate([np.load(p) for p in paths]), signatures(texts, cfg))
    assert results[1] | {"seconds": 0, "docs_per_s": 0} == results[3] | {"seconds": 0, "docs_per_s": 0}
    kept = [pl.read_parquet(tmp_path / f"{k}" / "kept.parquet") for k in (1, 3)]
    assert kept[0].equals(kept[1]) and results[1]["near_duplicate"] >= 10
    pairs = pl.read_parquet(tmp_path / "1" / "kept.near_duplicates.parquet")
    # exact copies are found, and each duplicate points at the smaller id of its pair
    copies = {ids[120 + i]: ids[i] for i in range(10)}
    found = dict(zip(pairs["id"], pairs["duplicate_of"]))
    assert all(found.get(a) == min(a, b) or found.get(b) == min(a, b) for a, b in copies.items())
    assert (pairs["duplicate_of"] < pairs["id"]).all()
    with pytest.raises(ValueError, match="sig_paths: 50 signature rows for 140 documents"):
        near_dedup_parquet(str(tmp_path / "docs.parquet"), paths[:1], str(tmp_path / "x.parquet"), cfg)
