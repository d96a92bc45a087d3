"""Shared input of the data-preparation benchmarks: a real corpus from this machine's ELF files.

``demo_docs(root, max_functions)`` extracts functions with labkit's corpus stage (default
CorpusConfig paths), cleans and exactly deduplicates them, and trains the default WordPiece
tokenizer; it returns (kept-documents Parquet, tokenizer.json). Cached under ``root``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.config import CleanConfig, CorpusConfig, TokenizerConfig  # noqa: E402
from labkit.data.clean import clean_corpus  # noqa: E402
from labkit.data.corpus import build_corpus  # noqa: E402
from labkit.data.tokenize import train_tokenizer  # noqa: E402


def demo_docs(root: Path, max_functions: int = 30_000) -> tuple[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    docs, tok = root / "clean" / "docs.parquet", root / "tokenizer.json"
    if not (root / "corpus" / "corpus.json").exists():
        build_corpus(CorpusConfig(max_functions=max_functions), str(root / "corpus"), n_parts=1)
    if not docs.exists():
        clean_corpus(str(root / "corpus" / "part-*.parquet"), str(docs), CleanConfig())
    if not tok.exists():
        train_tokenizer(str(docs), TokenizerConfig(), str(tok))
    return str(docs), str(tok)
