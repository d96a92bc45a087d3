"""A tiny shard set for cluster and training tests, built by labkit's own packer and writer
(``labkit.data.shards.pack_documents`` and ``write_rows``) from synthetic documents, so those
tests need no tokenizer: rows [CLS] ids... [SEP]..., the last row padded with [PAD], 2 shards."""

from __future__ import annotations

import pathlib

import numpy as np

from labkit.data.shards import pack_documents, write_rows


def write_tiny_shards(out_dir: pathlib.Path, *, n_sequences: int = 64, seq_len: int = 32,
                      vocab_size: int = 96, seed: int = 0) -> pathlib.Path:
    """Documents of repeated Zipf-distributed motifs (learnable by an MLM), packed in 2 shards."""
    rng = np.random.default_rng(seed)
    docs: list[list[int]] = []
    n_tokens = 0
    while n_tokens < n_sequences * (seq_len - 1) - seq_len // 2:
        motif = (rng.zipf(1.3, size=4) % (vocab_size - 5) + 5).tolist()
        docs.append(motif * int(rng.integers(1, 4)))
        n_tokens += len(docs[-1]) + 1  # the [SEP] after each document
    rows = pack_documents(docs, seq_len)[:n_sequences]
    write_rows(out_dir, rows, vocab_size=vocab_size, tokenizer_sha256="ab" * 32,
               rows_per_shard=(len(rows) + 1) // 2, n_documents=len(docs))
    return out_dir
