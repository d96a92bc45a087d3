"""Benchmark `copy`: staging's per-shard copy, one pass (``labkit.io.copy_and_hash``: read once,
hashed as written) against the copy it replaced (``shutil.copyfile``, a kernel copy, then the
copy read back through ``labkit.io.sha256_file``), both on 2 threads as ``stage_shards`` runs
them, on bench_stage's 48 x 4 MiB and 2,000 x 100 KiB sets, in a directory under the repository
(this machine's disk).

Paired rounds: each round copies the whole set with both methods, into fresh directories,
alternating which goes first, after ``os.sync()`` outside the clock; ratio = the old method's
median seconds / the new one's (higher is better). Creating the files costs both the same (see
bench_stage's ``create_us_per_file``), so this isolates the copy and hash. One JSON line per set.
Run from the repository root: python benchmarks/bench_copy.py
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_stage import SETS, write_set  # noqa: E402
from labkit.io import copy_and_hash, sha256_file  # noqa: E402
from labkit.study.sweeps import machine_load  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_COPY_ROUNDS", "5"))


def copy_then_read_back(src: Path, dst: Path) -> str:
    shutil.copyfile(src, dst)
    dst.stat()
    return sha256_file(dst)


def one_pass(src: Path, dst: Path) -> str:
    return copy_and_hash(src, dst)[1]


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-copy-", dir=Path(__file__).resolve().parents[1]))
    try:
        for name in ("48x4MiB", "2000x100KiB"):
            src = root / name
            write_set(src, *SETS[name])
            files = sorted(p for p in src.iterdir() if p.suffix == ".bin")
            seconds: dict[str, list[float]] = {"copy_then_read_back": [], "one_pass": []}
            methods = {"copy_then_read_back": copy_then_read_back, "one_pass": one_pass}
            for r in range(ROUNDS):
                order = list(methods) if r % 2 == 0 else list(methods)[::-1]
                for method in order:
                    dst = root / f"{name}-{method}-{r}"
                    dst.mkdir()
                    os.sync()
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(2) as pool:
                        list(pool.map(lambda f: methods[method](f, dst / f.name), files))
                    seconds[method].append(time.perf_counter() - t0)
            old, new = (statistics.median(seconds[m]) for m in ("copy_then_read_back", "one_pass"))
            print(json.dumps({"benchmark": "copy", "set": name, "metric": "seconds", "value": round(new, 4),
                              "baseline": "shutil.copyfile + sha256 of the copy read back",
                              "baseline_value": round(old, 4), "ratio": round(old / new, 3), "higher_is_better": True,
                              "seconds": {m: [round(s, 4) for s in v] for m, v in seconds.items()},
                              "n_files": len(files), "bytes": sum(f.stat().st_size for f in files),
                              "rounds": ROUNDS, "threads": 2, **machine_load()}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
