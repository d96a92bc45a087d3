"""Distributed exact and near dedup (labkit.data.partitioned) on a corpus with planted duplicate
clusters of known membership: the same kept set as the single-engine functions, for 1, 2 and 4
engines, and exactly one survivor (the smallest id) per planted cluster."""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest

from labkit.config import CleanConfig, DedupConfig
from labkit.data import partitioned
from labkit.data.clean import clean_corpus
from labkit.data.dedup import components, near_duplicates, signatures

OPS = ["mov", "add", "sub", "xor", "lea", "cmp", "and", "or", "imul", "test", "shl", "sar"]
REGS = ["rax", "rbx", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11", "r12", "r13"]


def _line(rng: random.Random) -> str:
    return f"{rng.choice(OPS)} {rng.choice(REGS)}, {rng.choice(REGS)}"


def planted_corpus(seed: int = 0, n_single: int = 150, n_clusters: int = 40):
    """(frame with id, text; clusters: list of id sets; singles: ids). Each near cluster is a
    base of 100 instructions and 1-4 variants with one line changed (shingle Jaccard about
    0.95 with the base and 0.91 between variants, far above 0.8); some members also get an exact copy. Ids
    are random hex, so the smallest id is anywhere in the cluster."""
    rng = random.Random(seed)
    new_id = lambda: f"{rng.getrandbits(64):016x}"
    rows, clusters, singles = [], [], []
    for _ in range(n_single):
        rows.append((new_id(), "\n".join(_line(rng) for _ in range(60))))
        singles.append(rows[-1][0])
    for _ in range(n_clusters):
        base = [_line(rng) for _ in range(100)]
        members = [(new_id(), "\n".join(base))]
        for _ in range(rng.randint(1, 4)):
            variant = list(base)
            variant[rng.randrange(100)] = f"nop {rng.getrandbits(32):x}"
            members.append((new_id(), "\n".join(variant)))
        for _ in range(rng.randint(0, 2)):  # exact copies of random members
            members.append((new_id(), rng.choice(members)[1]))
        rows.extend(members)
        clusters.append({m[0] for m in members})
    rng.shuffle(rows)
    return pl.DataFrame({"id": [r[0] for r in rows], "text": [r[1] for r in rows]}), clusters, singles


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    frame, clusters, singles = planted_corpus()
    d = tmp_path_factory.mktemp("planted")
    parts = []
    for k, (lo, hi) in enumerate([(0, 100), (100, 230), (230, frame.height)]):
        parts.append(str(d / "corpus" / f"part-{k:05d}.parquet"))
        (d / "corpus").mkdir(exist_ok=True)
        frame.slice(lo, hi - lo).write_parquet(parts[-1])
    return {"dir": d, "parts": parts, "frame": frame, "clusters": clusters, "singles": singles}


def _single_engine(corpus, tmp_path, cfg: CleanConfig) -> pl.DataFrame:
    """The reference: clean_corpus (filters + exact dedup, one process) then near_duplicates."""
    out = tmp_path / "single.parquet"
    clean_corpus(str(corpus["dir"] / "corpus" / "part-*.parquet"), str(out), cfg)
    kept = pl.read_parquet(out)
    dup = near_duplicates(kept["id"].to_list(), signatures(kept["text"].to_list(), cfg.near_dedup), cfg.near_dedup)
    return kept.filter(~pl.col("id").is_in(list(dup)))


@pytest.mark.parametrize("engines", [1, 2, 4])
def test_distributed_dedup_keeps_the_single_engine_set_and_one_per_planted_cluster(corpus, tmp_path, engines):
    cfg = CleanConfig()
    ref = _single_engine(corpus, tmp_path, cfg)
    stats = partitioned.dedup_corpus(corpus["parts"], cfg, str(tmp_path / "work"), str(tmp_path / "docs"),
                                     n_engines=engines)
    got = pl.read_parquet(tmp_path / "docs")
    assert got.equals(ref)  # same rows, same order (corpus order)
    assert stats["partitions"] == {"exact": engines, "near": engines}
    expected = set(corpus["singles"]) | {min(c) for c in corpus["clusters"]}
    assert set(got["id"]) == expected
    n_exact = sum(len(c) - len({t for t in corpus["frame"].filter(pl.col("id").is_in(list(c)))["text"]})
                  for c in corpus["clusters"])
    n_near = sum(len(c) for c in corpus["clusters"]) - len(corpus["clusters"]) - n_exact
    assert stats["dropped"] == {"exact_duplicate": n_exact, "near_duplicate": n_near}
    assert stats["kept"] == len(expected) and stats["input"] == corpus["frame"].height
    dups = pl.read_parquet(tmp_path / "near_duplicates.parquet")
    owner = {i: min(c) for c in corpus["clusters"] for i in c}
    assert all(owner[i] == d for i, d in dups.iter_rows())
    assert not (tmp_path / "work").exists()


def test_exact_dedup_alone_equals_clean_corpus(corpus, tmp_path):
    cfg = CleanConfig(near_dedup=None, min_lines=61)  # also drops every 60-line document ...
    cfg60 = CleanConfig(near_dedup=None)
    for c in (cfg, cfg60):
        out = tmp_path / "single.parquet"
        try:
            ref_stats = clean_corpus(str(corpus["dir"] / "corpus" / "part-*.parquet"), str(out), c)
        except ValueError:  # ... so nothing is kept: both say so by counts
            ref_stats = None
        stats = partitioned.dedup_corpus(corpus["parts"], c, str(tmp_path / "w"), str(tmp_path / "d"), n_engines=3)
        if ref_stats is None:
            assert stats["kept"] == 0 and stats["dropped"] == {"too_few_lines": corpus["frame"].height}
        else:
            assert pl.read_parquet(tmp_path / "d").equals(pl.read_parquet(out))
            assert {k: stats[k] for k in ("input", "kept", "dropped")} == ref_stats


def test_partition_count_follows_the_memory_budget():
    assert partitioned.n_partitions(1000, 200, 256, 2) == 2
    # 10 M documents at 200 B in a 256 MiB budget: 8 partitions of ~1.25 M documents (~238 MiB each)
    assert partitioned.n_partitions(10_000_000, 200, 256, 2) == 8
    assert partitioned.n_partitions(10_000_000, 200, 256, 16) == 16


def test_components_label_is_the_smallest_rank():
    # 0-1-2 chain, 3-4, 5 alone; ranks reversed: the component's largest node has the smallest rank
    pairs = np.array([[0, 1], [1, 2], [3, 4]])
    rank = np.array([5, 4, 3, 2, 1, 0])
    assert components(pairs, rank).tolist() == [3, 3, 3, 1, 1, 0]


def test_a_chain_is_one_component():
    """a~b and b~c but a, c dissimilar: greedy (the old semantics) kept a and c; components keep a."""
    rng = random.Random(5)
    a = [_line(rng) for _ in range(120)]
    b = a[:113] + [_line(rng) for _ in range(7)]  # a's last 7 lines replaced
    c = [_line(rng) for _ in range(7)] + b[7:]  # b's first 7 lines replaced
    cfg = DedupConfig(bands=64, rows=4, threshold=0.8)
    texts = ["\n".join(x) for x in (a, b, c)]
    sig = signatures(texts, cfg)
    est = lambda i, j: float((sig[i] == sig[j]).mean())
    assert est(0, 1) >= 0.8 and est(1, 2) >= 0.8 and est(0, 2) < 0.8
    dup = near_duplicates(["a", "b", "c"], signatures(texts, cfg), cfg)
    assert dup == {"b": "a", "c": "a"}


def test_slices_and_an_empty_part_do_not_change_the_result(corpus, tmp_path):
    ref = _single_engine(corpus, tmp_path, CleanConfig())
    empty = corpus["dir"] / "corpus" / "part-00009.parquet"  # sorts last: an empty part at the end
    corpus["frame"].head(0).write_parquet(empty)
    try:
        cfg = CleanConfig(batch_rows=37, near_dedup=DedupConfig(batch_rows=29))
        stats = partitioned.dedup_corpus([*corpus["parts"], str(empty)], cfg, str(tmp_path / "w"),
                                         str(tmp_path / "d"), n_engines=3)
    finally:
        empty.unlink()
    assert pl.read_parquet(tmp_path / "d").equals(ref) and stats["kept"] == ref.height
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [f"part-{k:05d}.parquet" for k in range(4)]
