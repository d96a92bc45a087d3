"""Benchmark `stage`: labkit.data.stage.stage_shards (copy + sha256 of every shard against
index.json, temp dir + rename) vs `cp -r` followed by `sha256sum` of the same files.

A shard set of N_SHARDS x SHARD_MB MiB (random token ids in the labkit format, written here) is
staged into fresh directories on this machine's disk, alternating ours and the baseline after
one warm-up of each (so both read the source from the page cache); medians of REPEATS.
ratio = baseline seconds / our seconds (higher is better; goal 1.0).
Run from the repository root: python benchmarks/bench_stage.py
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.data.shards import write_rows  # noqa: E402
from labkit.data.stage import stage_shards  # noqa: E402
from labkit.io import sha256_bytes  # noqa: E402

N_SHARDS, SHARD_MB, REPEATS, VOCAB, SEQ_LEN = 48, 4, 5, 8192, 512


def write_set(out: Path) -> int:
    """A valid labkit shard set of random uint16 ids (``labkit.data.shards.write_rows``); returns
    its size in bytes (with index)."""
    rng = np.random.default_rng(0)
    rows = SHARD_MB * 2**20 // (2 * SEQ_LEN)
    ids = rng.integers(5, VOCAB, size=(N_SHARDS * rows, SEQ_LEN), dtype=np.uint16)
    write_rows(out, ids, vocab_size=VOCAB, tokenizer_sha256=sha256_bytes(b"bench"), rows_per_shard=rows)
    return sum(p.stat().st_size for p in out.iterdir())


def ours(src: Path, root: Path) -> float:
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    report = stage_shards(str(src), local_root=str(root), verify=True)
    seconds = time.perf_counter() - t0
    assert report["copied"], report
    return seconds


def baseline(src: Path, root: Path) -> float:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    dst = root / src.name
    t0 = time.perf_counter()
    subprocess.run(f"cp -r '{src}' '{dst}' && sha256sum '{dst}'/* > '{root}/sums.txt'", shell=True, check=True)
    seconds = time.perf_counter() - t0
    return seconds


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-stage-", dir="/tmp") as tmp:
        tmp = Path(tmp)
        src = tmp / "shared" / "shards"
        n_bytes = write_set(src)
        print(f"shard set: {N_SHARDS} shards, {n_bytes / 1e6:.1f} MB in {src}")
        ours(src, tmp / "a"), baseline(src, tmp / "b")  # warm-up: page cache, imports
        t_ours, t_base = [], []
        for r in range(REPEATS):
            t_ours.append(ours(src, tmp / "a"))
            t_base.append(baseline(src, tmp / "b"))
            print(f"repeat {r}: labkit {t_ours[-1]:.3f} s ({n_bytes / 1e6 / t_ours[-1]:.0f} MB/s), "
                  f"cp -r + sha256sum {t_base[-1]:.3f} s ({n_bytes / 1e6 / t_base[-1]:.0f} MB/s)")
    ours_s, base_s = statistics.median(t_ours), statistics.median(t_base)
    print(json.dumps({"benchmark": "stage", "metric": "MB/s", "value": round(n_bytes / 1e6 / ours_s, 1),
                      "baseline": "cp -r + sha256sum", "baseline_value": round(n_bytes / 1e6 / base_s, 1),
                      "ratio": round(base_s / ours_s, 3), "goal": 1.0, "higher_is_better": True}))


if __name__ == "__main__":
    main()
