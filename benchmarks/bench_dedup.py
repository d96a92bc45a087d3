"""Benchmark `dedup`: labkit's near-duplicate pass (vectorised word-5-gram MinHash with
datasketch's affine32 permutations + LSH band buckets, verified pairs and connected components,
``labkit.data.dedup``)
in documents/s on the demo corpus, vs the textbook datasketch recipe on the same documents:
``MinHash.bulk`` over each document's set of UTF-8 shingles (sha1 per shingle) and the same LSH
pass. Both find near duplicates with the same DedupConfig; the JSON gives how many each found.

Input: this machine's ELF functions after filters and exact dedup (labkit corpus + clean stages,
30,000 functions), built once under ``$TMPDIR/labkit-bench-prep``. Alternating after a warm-up
on 1,000 documents; medians of REPEATS. Reported (no goal). Run from the repository root:
python benchmarks/bench_dedup.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _prep import demo_docs  # noqa: E402

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
from datasketch import MinHash  # noqa: E402

from labkit.config import DedupConfig  # noqa: E402
from labkit.data.dedup import near_duplicates, shingles, signatures  # noqa: E402

REPEATS, MAX_FUNCTIONS = 3, int(os.environ.get("BENCH_FUNCTIONS", 30_000))


def ours(ids: list[str], texts: list[str], cfg: DedupConfig) -> tuple[float, int]:
    t0 = time.perf_counter()
    dup = near_duplicates(ids, signatures(texts, cfg), cfg)
    return time.perf_counter() - t0, len(dup)


def textbook(ids: list[str], texts: list[str], cfg: DedupConfig) -> tuple[float, int]:
    t0 = time.perf_counter()
    mhs = MinHash.bulk([shingles(t, cfg.shingle_size) for t in texts], num_perm=cfg.num_perm, seed=cfg.seed,
                       scheme="affine32")
    sigs = np.stack([m.hashvalues for m in mhs]).astype(np.uint32)
    dup = near_duplicates(ids, sigs, cfg)
    return time.perf_counter() - t0, len(dup)


def main() -> None:
    docs, _ = demo_docs(Path(tempfile.gettempdir()) / "labkit-bench-prep", MAX_FUNCTIONS)
    frame = pl.read_parquet(docs, columns=["id", "text"])
    ids, texts = frame["id"].to_list(), frame["text"].to_list()
    cfg = DedupConfig()
    ours(ids[:1000], texts[:1000], cfg), textbook(ids[:1000], texts[:1000], cfg)  # warm-up
    mine, base = [], []
    for _ in range(REPEATS):
        s, found_base = textbook(ids, texts, cfg)
        base.append(len(ids) / s)
        s, found = ours(ids, texts, cfg)
        mine.append(len(ids) / s)
    value, baseline = statistics.median(mine), statistics.median(base)
    print(f"{len(ids)} documents; near duplicates found: labkit {found}, textbook {found_base}; "
          f"labkit {mine} docs/s, textbook {base} docs/s")
    print(json.dumps({"benchmark": "dedup", "metric": "documents/s", "value": round(value, 1),
                      "baseline": "datasketch MinHash.bulk over sha1-hashed shingle sets + the same MinHashLSH pass",
                      "baseline_value": round(baseline, 1), "ratio": round(value / baseline, 3), "goal": None,
                      "higher_is_better": True, "documents": len(ids), "near_duplicates": found,
                      "near_duplicates_baseline": found_base}))


if __name__ == "__main__":
    main()
