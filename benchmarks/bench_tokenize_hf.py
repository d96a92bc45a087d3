"""Benchmark `tokenize_hf`: labkit's ``write_shards`` vs the common alternative, HF ``datasets``
``map(batched=True)`` with transformers' ``PreTrainedTokenizerFast`` (the run_mlm.py recipe:
``Dataset.from_parquet`` -> tokenize map -> concatenate + chunk), producing the same packed
sequences: each document's ids followed by [SEP], rows of [CLS] + seq_len - 1 tokens, the last
row [PAD]-padded -- checked equal to labkit's shards after every run.

Input: this machine's ELF functions (labkit corpus + clean stages, default WordPiece
tokenizer), built once under ``$TMPDIR/labkit-bench-prep``. Alternating, after one warm-up of
each; medians of REPEATS; datasets' cache goes to a fresh temp dir each run. Value and baseline
are tokens/s (document tokens); ratio = labkit / datasets, goal 2.0.
Needs the ``bench`` extra (datasets). Run from the repository root: python benchmarks/bench_tokenize_hf.py
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

import numpy as np  # noqa: E402

from labkit.config import ShardConfig  # noqa: E402
from labkit.data.shards import CLS_ID, PAD_ID, SEP_ID, SequenceReader, parts_dir_for, write_shards  # noqa: E402

REPEATS, MAX_FUNCTIONS, SEQ_LEN = 3, int(os.environ.get("BENCH_FUNCTIONS", 30_000)), 128


def hf(docs: str, tok_path: str) -> tuple[float, int, np.ndarray]:
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    cache = tempfile.mkdtemp(prefix="bench-hf-cache-")
    try:
        t0 = time.perf_counter()
        tok = PreTrainedTokenizerFast(tokenizer_file=tok_path)
        ds = datasets.Dataset.from_parquet(docs, cache_dir=cache, columns=["text"])
        ds = ds.map(lambda b: {"input_ids": [ids + [SEP_ID] for ids in
                                             tok(b["text"], add_special_tokens=False)["input_ids"]]},
                    batched=True, batch_size=1000, remove_columns=["text"], load_from_cache_file=False)
        stream = np.concatenate(ds.with_format("numpy")["input_ids"]).astype(np.int64)
        body = SEQ_LEN - 1
        n = -(-len(stream) // body)
        stream = np.concatenate([stream, np.full(n * body - len(stream), PAD_ID, dtype=np.int64)])
        rows = np.concatenate([np.full((n, 1), CLS_ID), stream.reshape(n, body)], axis=1).astype(np.uint16)
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return seconds, int(len(stream) - np.count_nonzero(stream == PAD_ID)), rows


def ours(docs: str, tok_path: str, out: Path) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(parts_dir_for(out), ignore_errors=True)
    t0 = time.perf_counter()
    index = write_shards(docs, tok_path, str(out), ShardConfig(seq_len=SEQ_LEN), progress=False)
    return time.perf_counter() - t0, index["n_tokens"] - index["n_sequences"]  # minus [CLS]


def main() -> None:
    docs, tok_path = demo_docs(Path(tempfile.gettempdir()) / "labkit-bench-prep", MAX_FUNCTIONS)
    out = Path(tempfile.mkdtemp(prefix="bench-tokenize-hf-")) / "shards"
    hf(docs, tok_path), ours(docs, tok_path, out)  # warm-up
    base, mine = [], []
    for _ in range(REPEATS):
        s, n, rows = hf(docs, tok_path)
        base.append(n / s)
        s, m = ours(docs, tok_path, out)
        mine.append(m / s)
        r = SequenceReader(out)
        assert m == n and len(r) == len(rows)
        np.testing.assert_array_equal(np.concatenate([np.fromfile(out / s["file"], dtype="<u2")
                                                      for s in r.index["shards"]]).reshape(-1, SEQ_LEN), rows)
    shutil.rmtree(out.parent, ignore_errors=True)
    shutil.rmtree(parts_dir_for(out), ignore_errors=True)
    value, baseline = statistics.median(mine), statistics.median(base)
    print(f"{n:,} tokens (+[SEP]); labkit {mine}, datasets.map {base}")
    print(json.dumps({"benchmark": "tokenize_hf", "metric": "tokens/s", "value": round(value),
                      "baseline": "datasets.Dataset.map(batched=True) + PreTrainedTokenizerFast + numpy packing "
                                  "(identical sequences)",
                      "baseline_value": round(baseline), "ratio": round(value / baseline, 3), "goal": 2.0,
                      "higher_is_better": True}))


if __name__ == "__main__":
    main()
