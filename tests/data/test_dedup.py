"""MinHash LSH near-dedup: threshold behaviour, determinism, banding probability."""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest

from labkit.config import DedupConfig
from labkit.data.dedup import candidate_probability, near_dedup, near_duplicates, shingles, signatures


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
