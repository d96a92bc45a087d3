"""A tiny shard set for cluster and training tests, built by labkit's own packer and writer
(``labkit.data.shards.pack_documents`` and ``write_rows``) from synthetic documents, so those
tests need no tokenizer: rows [CLS] ids... [SEP]..., the last row padded with [PAD], 2 shards;
optionally a held-out file of other documents (``labkit.data.heldout``)."""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from labkit.data.shards import pack_documents, write_rows


def _docs(rng: np.random.Generator, n_sequences: int, seq_len: int, vocab_size: int) -> list[list[int]]:
    """Documents of repeated Zipf-distributed motifs, enough to fill ``n_sequences`` rows."""
    docs: list[list[int]] = []
    n_tokens = 0
    while n_tokens < n_sequences * (seq_len - 1) - seq_len // 2:
        motif = (rng.zipf(1.3, size=4) % (vocab_size - 5) + 5).tolist()
        docs.append(motif * int(rng.integers(1, 4)))
        n_tokens += len(docs[-1]) + 1  # the [SEP] after each document
    return docs


def write_tiny_shards(out_dir: pathlib.Path, *, n_sequences: int = 64, seq_len: int = 32,
                      vocab_size: int = 96, seed: int = 0, heldout_sequences: int = 0) -> pathlib.Path:
    """Documents of repeated Zipf-distributed motifs (learnable by an MLM), packed in 2 shards;
    with ``heldout_sequences`` also ``heldout-00000.bin`` of other documents, in index.json."""
    rng = np.random.default_rng(seed)
    docs = _docs(rng, n_sequences, seq_len, vocab_size)
    rows = pack_documents(docs, seq_len)[:n_sequences]
    index = write_rows(out_dir, rows, vocab_size=vocab_size, tokenizer_sha256="ab" * 32,
                       rows_per_shard=(len(rows) + 1) // 2, n_documents=len(docs))
    if heldout_sequences:
        held_docs = _docs(rng, heldout_sequences, seq_len, vocab_size)
        held = pack_documents(held_docs, seq_len)[:heldout_sequences].astype("<u2")
        (out_dir / "heldout-00000.bin").write_bytes(held.tobytes())
        index["heldout"] = {"rule": "tiny test set: separately drawn documents", "fraction": None, "seed": seed,
                            "n_documents": len(held_docs), "n_sequences": len(held),
                            "n_tokens": int((held != 0).sum()),
                            "shards": [{"file": "heldout-00000.bin", "n_sequences": len(held),
                                        "n_bytes": int(held.nbytes),
                                        "sha256": hashlib.sha256(held.tobytes()).hexdigest()}]}
        (out_dir / "index.json").write_text(json.dumps(index))
    return out_dir
