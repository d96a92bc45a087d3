"""Benchmark `stream_memory`: peak resident memory of the clean and near-dedup stages, streamed
(``clean_corpus`` with ``CleanConfig.batch_rows``; ``signature_part`` with
``DedupConfig.batch_rows``) against the whole-corpus way they ran before (``clean`` over the
scanned glob collected at once; signatures of every text at once), at two corpus sizes.

Input: this machine's libc functions (``tests.data.test_shards.libc_functions``) repeated with a
distinct last line per copy until the corpus holds N documents, written as Parquet parts of
PART_ROWS rows. Each measurement runs in a fresh process; the number is its own peak RSS (``labkit.measure.peak_rss_bytes``, MiB),
which includes the interpreter and libraries (the ``baseline`` row: imports and the read of the
ids only). Reported (no goal). Run from the repository root:
python benchmarks/bench_stream_memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = [int(s) for s in os.environ.get("BENCH_DOCS", "20000,80000").split(",")]
PART_ROWS, BATCH = 20_000, 2048


def make_corpus(root: Path, n: int) -> str:
    import polars as pl

    from tests.data.test_shards import libc_functions

    base = libc_functions(400)
    d = root / f"corpus-{n}"
    if not d.exists():
        d.mkdir(parents=True)
        for k, lo in enumerate(range(0, n, PART_ROWS)):
            rows = range(lo, min(n, lo + PART_ROWS))
            pl.DataFrame({"id": [f"{i:016x}" for i in rows],
                          "text": [f"{base[i % len(base)]}\nmov eax, {i:#x}" for i in rows]}
                         ).write_parquet(d / f"part-{k:05d}.parquet")
    return str(d / "part-*.parquet")


def child(mode: str, corpus_glob: str, out: str) -> None:
    import numpy as np
    import polars as pl

    from labkit.config import CleanConfig, DedupConfig
    from labkit.data.clean import clean, clean_corpus
    from labkit.data.dedup import signature_part, signatures
    from labkit.measure import peak_rss_bytes

    if mode == "baseline":
        pl.scan_parquet(corpus_glob).select("id").collect()
    elif mode == "clean_whole":
        marked = clean(pl.scan_parquet(corpus_glob), CleanConfig()).collect()
        marked.filter(pl.col("drop_reason").is_null()).drop("drop_reason").write_parquet(out)
    elif mode == "clean_streamed":
        clean_corpus(corpus_glob, out, CleanConfig(batch_rows=BATCH))
    elif mode == "signatures_whole":
        texts = pl.scan_parquet(corpus_glob).select("text").collect()["text"].to_list()
        np.save(out, signatures(texts, DedupConfig()))
    elif mode == "signatures_streamed":
        n = pl.scan_parquet(corpus_glob).select(pl.len()).collect().item()
        signature_part(corpus_glob, 0, n, DedupConfig(batch_rows=BATCH), out)
    print(json.dumps({"mode": mode, "peak_mib": round(peak_rss_bytes() / 2**20, 1)}))


def main() -> None:
    root = Path(tempfile.gettempdir()) / "labkit-bench-stream"
    rows = []
    for n in SIZES:
        corpus_glob = make_corpus(root, n)
        text_mib = sum(os.path.getsize(p) for p in Path(corpus_glob).parent.glob("*.parquet")) / 2**20
        for mode in ("baseline", "clean_whole", "clean_streamed", "signatures_whole", "signatures_streamed"):
            out = str(root / f"out-{n}-{mode}" / ("docs.parquet" if "clean" in mode else "sig.npy"))
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            res = subprocess.run([sys.executable, __file__, mode, corpus_glob, out], capture_output=True, text=True,
                                 check=True, cwd=ROOT)
            rows.append({"documents": n, "parquet_mib": round(text_mib, 1), **json.loads(res.stdout.splitlines()[-1])})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"benchmark": "stream_memory", "batch_rows": BATCH, "part_rows": PART_ROWS, "rows": rows},
                     indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 4:
        child(*sys.argv[1:])
    else:
        main()
