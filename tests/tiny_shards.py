"""A tiny shard set in the contract's format (docs/formats.md, labkit/data/shards.py), written
directly so cluster tests need no tokenizer: uint16 rows [CLS] ids... [SEP]..., the last row
padded with [PAD], sha256 per shard, index.json written last."""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np


def write_tiny_shards(out_dir: pathlib.Path, *, n_sequences: int = 64, seq_len: int = 32,
                      vocab_size: int = 96, seed: int = 0) -> pathlib.Path:
    """Documents of repeated Zipf-distributed motifs (learnable by an MLM), packed in 2 shards."""
    rng = np.random.default_rng(seed)
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
    arr = np.asarray(rows[:n_sequences], dtype="<u2")
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
    (out_dir / "index.json").write_text(json.dumps(index))
    return out_dir
