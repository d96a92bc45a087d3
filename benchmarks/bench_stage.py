"""Benchmark `stage`: labkit.data.stage.stage_shards (copy + sha256 of every shard against
index.json, temp dir + rename) vs `cp -r` followed by `sha256sum` of the same files.

Three shard sets in the labkit format (random token ids, written here through
``labkit.data.shards.write_rows``):

- ``demo``: the demo's layout, one shard of 100,107 sequences x 128 tokens (25.6 MB, below
  ``ShardConfig.shard_bytes``, 32 MiB), the shard set ``make demo`` stages (docs/data/demo.json);
- ``48x4MiB``: 48 shards of 4 MiB (201 MB), the set of the previous rounds;
- ``2000x100KiB``: 2,000 shards of 100 rows x 512 tokens (102 KB each, 205 MB): per-file costs.

Each set is staged into a fresh directory per run on this machine's disk, alternating ours and
the baseline after one warm-up of each (so both read the source from the page cache); medians
of ``REPEATS`` rounds and the spread of the per-round (paired) ratios. ratio = baseline seconds
/ our seconds (higher is better; goal 4.0). The copies of a set are removed only after its last
run (and ``os.sync()`` runs before each timed run, outside the clock, so that no run is slowed
by writing back the copies before it): ext4 skips inodes freed in the last 30 s when it allocates one (``recently_deleted`` in
fs/ext4/ialloc.c), scanning past each of them, so creating 2,000 files just after deleting
2,000 took seconds on either side (a profile of the create: ``perf record`` on
``recently_deleted``). ``create_us_per_file``: the mean microseconds to create one of as many
empty files as the set has, in a fresh directory beside it, measured after its runs; where it
is large, creating the files costs both sides the same and pulls the ratio of a many-file set
towards 1.

One JSON line per set, then the summary (last line): ``ratio`` is the smallest set ratio.
Run from the repository root: python benchmarks/bench_stage.py
"""

from __future__ import annotations

import json
import os
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

VOCAB, GOAL = 8192, 4.0
REPEATS = int(os.environ.get("BENCH_STAGE_REPEATS", "5"))
ONLY = os.environ.get("BENCH_STAGE_SETS")  # comma-separated set names (default: all)
SETS = {  # name: (shards, sequences per shard, sequence length)
    "demo": (1, 100_107, 128),
    "48x4MiB": (48, 4 * 2**20 // (2 * 512), 512),
    "2000x100KiB": (2000, 100, 512),
}


def write_set(out: Path, shards: int, rows: int, seq_len: int) -> int:
    """A valid labkit shard set of random uint16 ids; returns its size in bytes (with index)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(5, VOCAB, size=(shards * rows, seq_len), dtype=np.uint16)
    write_rows(out, ids, vocab_size=VOCAB, tokenizer_sha256=sha256_bytes(b"bench"), rows_per_shard=rows)
    return sum(p.stat().st_size for p in out.iterdir())


def ours(src: Path, root: Path) -> float:
    t0 = time.perf_counter()
    report = stage_shards(str(src), local_root=str(root), verify=True)
    seconds = time.perf_counter() - t0
    assert report["copied"], report
    return seconds


def baseline(src: Path, root: Path) -> float:
    root.mkdir(parents=True)
    dst = root / src.name
    t0 = time.perf_counter()
    subprocess.run(f"cp -r '{src}' '{dst}' && sha256sum '{dst}'/* > '{root}/sums.txt'", shell=True, check=True)
    return time.perf_counter() - t0


def create_us_per_file(where: Path, n: int) -> float:
    """Mean microseconds to create (O_CREAT) and close one empty file, over ``n`` files created
    in a fresh directory under ``where`` (removed afterwards): what creating a set's files costs
    either side on this file system now."""
    d = Path(tempfile.mkdtemp(dir=where, prefix="create-"))
    t0 = time.perf_counter()
    for i in range(n):
        os.close(os.open(d / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
    seconds = time.perf_counter() - t0
    shutil.rmtree(d)
    return round(seconds / n * 1e6, 1)


def spread(values: list[float]) -> dict[str, float]:
    """{"min", "p25", "median", "p75", "max"} of ``values``, rounded to 3 places."""
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) >= 2 else [values[0]] * 3
    return {k: round(v, 3) for k, v in zip(("min", "p25", "median", "p75", "max"),
                                            (min(values), q[0], q[1], q[2], max(values)))}


def bench_set(tmp: Path, name: str, shards: int, rows: int, seq_len: int) -> dict:
    src = tmp / name / "shared" / "shards"
    n_bytes = write_set(src, shards, rows, seq_len)
    n_files = shards + 1  # with index.json
    print(f"{name}: {n_files} files, {n_bytes / 1e6:.1f} MB in {src}", flush=True)
    ours(src, tmp / name / "a-warm"), baseline(src, tmp / name / "b-warm")  # warm-up: page cache, imports
    t_ours, t_base = [], []
    for r in range(REPEATS):
        os.sync()  # outside the clock: no run is throttled by the previous runs' dirty pages
        t_ours.append(ours(src, tmp / name / f"a-{r}"))
        os.sync()
        t_base.append(baseline(src, tmp / name / f"b-{r}"))
        print(f"  repeat {r}: labkit {t_ours[-1]:.3f} s ({n_bytes / 1e6 / t_ours[-1]:.0f} MB/s), "
              f"cp -r + sha256sum {t_base[-1]:.3f} s ({n_bytes / 1e6 / t_base[-1]:.0f} MB/s)", flush=True)
    create_us = create_us_per_file(tmp / name, n_files)
    shutil.rmtree(tmp / name)
    ours_s, base_s = statistics.median(t_ours), statistics.median(t_base)
    return {"benchmark": "stage", "set": name, "metric": "MB/s", "value": round(n_bytes / 1e6 / ours_s, 1),
            "baseline": "cp -r + sha256sum", "baseline_value": round(n_bytes / 1e6 / base_s, 1),
            "ratio": round(base_s / ours_s, 3), "ratio_paired_spread": spread([b / a for a, b in zip(t_ours, t_base)]),
            "goal": GOAL, "higher_is_better": True, "n_files": n_files, "n_shards": shards,
            "bytes": n_bytes, "shard_bytes": rows * seq_len * 2, "seconds": round(ours_s, 4),
            "baseline_seconds": round(base_s, 4), "repeats": REPEATS, "create_us_per_file": create_us,
            "load_avg_1m": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count()}


def main() -> None:
    lines = []
    with tempfile.TemporaryDirectory(prefix="bench-stage-", dir="/tmp") as tmp:
        for name, (shards, rows, seq_len) in SETS.items():
            if ONLY and name not in ONLY.split(","):
                continue
            line = bench_set(Path(tmp), name, shards, rows, seq_len)
            print(json.dumps(line), flush=True)
            lines.append(line)
    worst = min(lines, key=lambda r: r["ratio"])
    print(json.dumps({"benchmark": "stage", "set": "all", "metric": "ratio (smallest over sets)",
                      "value": worst["ratio"], "baseline": "cp -r + sha256sum", "ratio": worst["ratio"],
                      "goal": GOAL, "met": worst["ratio"] >= GOAL, "higher_is_better": True,
                      "worst_set": worst["set"], "ratios": {r["set"]: r["ratio"] for r in lines},
                      "n_files": {r["set"]: r["n_files"] for r in lines},
                      "bytes": {r["set"]: r["bytes"] for r in lines},
                      "load_avg_1m": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
