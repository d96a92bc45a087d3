"""Benchmark `reader`: batches of random sequences gathered from a shard set by
labkit.data.shards.ShardSet (os.preadv on file descriptors, each shard's identity checked after
its reads: a shard that changes underneath raises ShardError instead of SIGBUS) vs the
memory-map gather labkit's reader used before (numpy.memmap per shard, one fancy-index read per
shard touched), in the same process.

Data: 12 shards x 1,024 sequences x 512 uint16 ids (random ids, written by labkit's writer), in
the page cache. Each round gathers the same 300 batches of 32 random sequence ids with each
reader, alone ("gather") and followed by labkit's MLM masking (``MLMCollator``, "gather+mask",
what one loader worker does per batch); the readers alternate for ROUNDS rounds; medians.
ratio = ShardSet / memmap samples/s (goal: >= 0.9, the protection costs at most 10 %).
Run from the repository root: python benchmarks/bench_reader.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.data.mlm import MLMCollator  # noqa: E402
from labkit.data.shards import open_shards, write_rows  # noqa: E402

N_SHARDS, PER_SHARD, SEQ_LEN, BATCH, N_BATCHES, ROUNDS = 12, 1024, 512, 32, 300, 7


class MemmapReader:
    """The baseline: one read-only numpy.memmap per shard, [n_sequences, seq_len]; ``rows(ids)``
    gathers with one fancy-index read per shard touched."""

    def __init__(self, shards) -> None:
        self.maps = [np.memmap(p, dtype="<u2", mode="r", shape=(s["n_sequences"], shards.seq_len))
                     for p, s in zip(shards.paths, shards.index["shards"])]
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])

    def rows(self, ids: np.ndarray) -> np.ndarray:
        which = np.searchsorted(self.starts, ids, side="right") - 1
        out = np.empty((len(ids), self.maps[0].shape[1]), dtype="<u2")
        for k in np.unique(which):
            sel = which == k
            out[sel] = self.maps[k][ids[sel] - self.starts[k]]
        return out


def rate(reader, batches: list[np.ndarray], collate) -> float:
    t0 = time.perf_counter()
    for b in batches:
        x = reader.rows(b)
        if collate is not None:
            collate(x)
    return len(batches) * BATCH / (time.perf_counter() - t0)


def main() -> None:
    import torch

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-reader-", dir="/tmp") as tmp:
        rng = np.random.default_rng(0)
        rows = rng.integers(5, 8192, size=(N_SHARDS * PER_SHARD, SEQ_LEN))
        rows[:, 0] = 2
        write_rows(Path(tmp), rows, vocab_size=8192, tokenizer_sha256="0" * 64, rows_per_shard=PER_SHARD)
        ours = open_shards(tmp)
        base = MemmapReader(ours)
        batches = [rng.integers(0, len(ours), BATCH) for _ in range(N_BATCHES)]
        for b in batches:  # the same bytes, and every page in the cache
            assert (ours.rows(b) == base.rows(b)).all()
        collate = MLMCollator(vocab_size=8192, seed=0)
        result = {}
        for name, c in (("gather", None), ("gather+mask", collate)):
            r_ours, r_base = [], []
            for _ in range(ROUNDS):
                r_ours.append(rate(ours, batches, c))
                r_base.append(rate(base, batches, c))
            result[name] = (statistics.median(r_ours), statistics.median(r_base))
            print(f"{name}: ShardSet {result[name][0]:,.0f} samples/s, memmap {result[name][1]:,.0f} samples/s")
    ours_v, base_v = result["gather+mask"]
    print(json.dumps({"benchmark": "reader", "metric": "samples/s, gather + MLM masking, batch 32 x 512",
                      "value": round(ours_v, 1), "baseline": "numpy.memmap gather (labkit's reader before)",
                      "baseline_value": round(base_v, 1), "ratio": round(ours_v / base_v, 3), "goal": 0.9,
                      "higher_is_better": True,
                      "gather_ratio": round(result["gather"][0] / result["gather"][1], 3),
                      "gather_samples_per_s": round(result["gather"][0], 1),
                      "gather_baseline_samples_per_s": round(result["gather"][1], 1),
                      "load_before": load_before, "load_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
