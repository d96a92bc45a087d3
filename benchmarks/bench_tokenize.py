"""Benchmark `tokenize`: labkit's tokenization pipeline (``write_shards``: read Parquet in polars
slices, encode in batches, write part files with sha256, pack into sequences, write shards and
index.json) vs the raw ``Tokenizer.encode_batch`` on the same texts already loaded in memory.

Input: this machine's ELF functions (labkit corpus + clean stages, default WordPiece
tokenizer), built once under ``$TMPDIR/labkit-bench-prep``; the first N_DOCS documents. Runs
alternate baseline and pipeline after one warm-up of each; medians of REPEATS. Value and
baseline are tokens/s (document tokens, no specials); ratio = pipeline / baseline, goal 0.85.
The pipeline encodes each distinct line once (``encode_flat``; the WordPiece tokenizer is
line-separable) with ``encode_batch_fast``; the JSON also gives the ratio against
``encode_batch_fast`` and the ratio of the pipeline forced to encode document by document. Run from the repository root: python benchmarks/bench_tokenize.py
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _prep import demo_docs  # noqa: E402

import polars as pl  # noqa: E402

from labkit.config import ShardConfig  # noqa: E402
from labkit.data.shards import parts_dir_for, write_shards  # noqa: E402
from labkit.data.tokenize import line_separable, load_tokenizer  # noqa: E402

REPEATS, MAX_FUNCTIONS, N_DOCS, BATCH = 3, int(os.environ.get("BENCH_FUNCTIONS", 30_000)), 8000, 4096


def raw(tok, texts: list[str], method: str) -> tuple[float, int]:
    encode = getattr(tok, method)
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(texts), BATCH):
        n += sum(len(e.ids) for e in encode(texts[i:i + BATCH], add_special_tokens=False))
    return time.perf_counter() - t0, n


def pipeline(docs: str, tok_path: str, out: Path, *, per_document: bool = False) -> tuple[float, int]:
    import labkit.data.shards as shards

    shards.line_separable = (lambda tok: False) if per_document else line_separable
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(parts_dir_for(out), ignore_errors=True)  # no resumed parts: encode everything
    t0 = time.perf_counter()
    index = write_shards(docs, tok_path, str(out), ShardConfig(batch_docs=BATCH), progress=False)
    seconds = time.perf_counter() - t0
    return seconds, index["n_tokens"] - index["n_sequences"] - index["n_documents"]  # minus [CLS], [SEP]


def main() -> None:
    corpus, tok_path = demo_docs(Path(tempfile.gettempdir()) / "labkit-bench-prep", MAX_FUNCTIONS)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    docs = str(tmp / "docs.parquet")
    pl.read_parquet(corpus).head(N_DOCS).write_parquet(docs)
    texts = pl.read_parquet(docs, columns=["text"])["text"].to_list()
    tok = load_tokenizer(tok_path)
    tok.encode_special_tokens = True
    fast = "encode_batch_fast" if hasattr(tok, "encode_batch_fast") else "encode_batch"
    out = tmp / "shards"
    raw(tok, texts[:1000], "encode_batch"), pipeline(docs, tok_path, out)  # warm-up
    base, base_fast, ours, per_doc = [], [], [], []
    for _ in range(REPEATS):
        s, n = raw(tok, texts, "encode_batch")
        base.append(n / s)
        s, m = pipeline(docs, tok_path, out)
        ours.append(m / s)
        s, n_fast = raw(tok, texts, fast)
        base_fast.append(n_fast / s)
        s, m2 = pipeline(docs, tok_path, out, per_document=True)
        per_doc.append(m2 / s)
        assert m == m2 == n == n_fast, (m, m2, n, n_fast)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(parts_dir_for(out), ignore_errors=True)
    value, baseline = statistics.median(ours), statistics.median(base)
    print(f"{len(texts)} documents, {n:,} tokens; pipeline {ours}, pipeline encoding per document {per_doc}, "
          f"encode_batch {base}, {fast} {base_fast}")
    print(json.dumps({"benchmark": "tokenize", "metric": "tokens/s", "value": round(value),
                      "baseline": "tokenizers.Tokenizer.encode_batch on pre-loaded texts (same tokens)",
                      "baseline_value": round(baseline), "ratio": round(value / baseline, 3), "goal": 0.85,
                      "higher_is_better": True,
                      "ratio_vs_encode_batch_fast": round(value / statistics.median(base_fast), 3),
                      "ratio_encoding_per_document": round(statistics.median(per_doc) / baseline, 3)}))


if __name__ == "__main__":
    main()
