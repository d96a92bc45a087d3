"""The demo's first input step, cold and warm: ``labkit.data.corpus.find_elf_files`` over the
default corpus paths (``CorpusConfig().paths``), which opens every regular file under them and
reads its first 4 bytes for the ELF magic.

On a fresh machine those files are not in the page cache, and the walk is disk reads, not CPU:
that is why ``labkit demo`` walks them in a thread while its engines start
(``labkit.demo._find_elf_files``, ``labkit.lab.build_corpus(elf_files=)``). Each round drops the
page cache (``/proc/sys/vm/drop_caches``: root only; without it the benchmark says so and exits
2), times one cold walk in a fresh interpreter, then one warm walk right after it, also in a fresh
interpreter. Each line printed is one round's cold and warm seconds and the 1-minute load before
it. Last line: one JSON object: value = median cold seconds, baseline = median warm seconds,
ratio = cold / warm, files (regular files checked), elf (ELF files found), rounds.

Run: ``python benchmarks/bench_elf_walk.py [--rounds 3]`` from the repository root, with nothing
else using the disk (dropping the page cache slows whatever else runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, time
from labkit.config import CorpusConfig
from labkit.data import corpus
walked = []  # the (path, dev, inode) list find_elf_files fills, root by root
orig = corpus._regular_files
def keep(root, out):
    walked.append(out)
    orig(root, out)
corpus._regular_files = keep
t = time.perf_counter()
elf = corpus.find_elf_files(CorpusConfig())
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "elf": len(elf), "files": len({p for p, _, _ in walked[0]}) if walked else 0}))
"""


def _walk() -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        print("bench_elf_walk: needs root to drop the page cache (/proc/sys/vm/drop_caches)", file=sys.stderr)
        return 2
    _walk()  # the interpreter's own files warm, so that a cold round times the walk, not imports
    cold, warm = [], []
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        # the interpreter, torch-free labkit modules and the venv come back from disk here too; the
        # child times find_elf_files alone, after its imports
        c, w = _walk(), _walk()
        cold.append(c["seconds"])
        warm.append(w["seconds"])
        print(f"round {r}: cold {c['seconds']:.2f} s, warm {w['seconds']:.2f} s, {c['files']:,} files, "
              f"{c['elf']:,} ELF, 1-minute load {load:.2f}", flush=True)
    value, base = statistics.median(cold), statistics.median(warm)
    print(json.dumps({"value": round(value, 3), "baseline": round(base, 3), "ratio": round(value / base, 2),
                      "unit": "s", "files": c["files"], "elf": c["elf"], "rounds": args.rounds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
