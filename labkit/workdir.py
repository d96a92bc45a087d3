"""Where each stage's artifact lives under a work directory: the one definition of the layout.

Work directory layout (``workdir``)::

    corpus/part-00000.parquet ... corpus.json   one document per disassembled function
    clean/docs.parquet/part-00000.parquet ...   kept documents (one Parquet dataset, corpus order)
    clean/docs.drops.json  near_duplicates.parquet  drop counts per reason and stage; (id, duplicate_of)
    tokenizer/tokenizer.json  tokenizer.stats.json  HF tokenizers (WordPiece default); held-out UNK rate
    shards/shard-00000.bin ... index.json        packed token ids, index written last
    shards.parts/                               encoded parts + completion markers (resumable)
    local/<node>/...                             node-local staged copies (simulated nodes)
    runs/<name>/                                 config.json, metrics.jsonl, checkpoints/, result.json
    sweeps/ranks.parquet  sweeps/microbatch.parquet  sweeps/loader.parquet  sweeps/model_size.parquet
    reports/*.html                               executed notebooks
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["paths"]


def paths(workdir: str | os.PathLike) -> dict[str, Path]:
    """The artifact paths of ``workdir`` (nothing is created): corpus, clean (the kept-documents
    Parquet), tokenizer (tokenizer.json), shards, local, runs, sweeps, reports."""
    w = Path(workdir)
    return {
        "corpus": w / "corpus",
        "clean": w / "clean" / "docs.parquet",
        "tokenizer": w / "tokenizer" / "tokenizer.json",
        "shards": w / "shards",
        "local": w / "local",
        "runs": w / "runs",
        "sweeps": w / "sweeps",
        "reports": w / "reports",
    }
