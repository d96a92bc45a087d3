"""A tiny shard set in the contract's format (docs/formats.md, labkit/data/shards.py), written
directly so cluster tests need no tokenizer: uint16 rows [CLS] ids... [SEP]..., the last row
padded with [PAD], sha256 per shard, index.json written last."""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np


def _rows(rng: np.random.Generator, n_sequences: int, seq_len: int, vocab_size: int) -> tuple[np.ndarray, int]:
    """Packed uint16 rows [n_sequences, seq_len] of motif documents and the number of documents."""
    stream: list[int] = []
    n_docs = 0
    while len(stream) < n_sequences * (seq_len - 1) - seq_len // 2:
        motif = (rng.zipf(1.3, size=4) % (vocab_size - 5) + 5).tolist()
        stream += motif * int(rng.integers(1, 4)) + [3]
        n_docs += 1
    rows = []
    for i in range(0, len(stream), seq_len - 1):
        body = stream[i:i + seq_len - 1]
        rows.append([2] + body + [0] * (seq_len - 1 - len(body)))
    return np.asarray(rows[:n_sequences], dtype="<u2"), n_docs


def write_tiny_shards(out_dir: pathlib.Path, *, n_sequences: int = 64, seq_len: int = 32,
                      vocab_size: int = 96, seed: int = 0, heldout_sequences: int = 0) -> pathlib.Path:
    """Documents of repeated Zipf-distributed motifs (learnable by an MLM), packed in 2 shards;
    with ``heldout_sequences`` also a held-out file of other documents (labkit.data.heldout)."""
    rng = np.random.default_rng(seed)
    arr, n_docs = _rows(rng, n_sequences, seq_len, vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards, half = [], len(arr) // 2
    for k, part in enumerate((arr[:half], arr[half:])):
        name = f"shard-{k:05d}.bin"
        (out_dir / name).write_bytes(part.tobytes())
        shards.append({"file": name, "n_sequences": len(part), "n_bytes": part.nbytes,
                       "sha256": hashlib.sha256(part.tobytes()).hexdigest()})
    index = {"format": "labkit-shards", "version": 1, "dtype": "uint16", "seq_len": seq_len,
             "vocab_size": vocab_size, "tokenizer_sha256": "ab" * 32,
             "special_ids": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4},
             "n_documents": n_docs, "n_sequences": len(arr), "n_tokens": int((arr != 0).sum()),
             "n_bytes": int(arr.nbytes), "shards": shards}
    if heldout_sequences:
        held, n_held = _rows(rng, heldout_sequences, seq_len, vocab_size)
        (out_dir / "heldout-00000.bin").write_bytes(held.tobytes())
        index["heldout"] = {"rule": "tiny test set: separately drawn documents", "fraction": None, "seed": seed,
                            "n_documents": n_held, "n_sequences": len(held), "n_tokens": int((held != 0).sum()),
                            "shards": [{"file": "heldout-00000.bin", "n_sequences": len(held),
                                        "n_bytes": int(held.nbytes),
                                        "sha256": hashlib.sha256(held.tobytes()).hexdigest()}]}
    (out_dir / "index.json").write_text(json.dumps(index))
    return out_dir
