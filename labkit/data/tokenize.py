"""Subword tokenizers for disassembly, trained with HF ``tokenizers`` on a sample of documents.

Three kinds (``TokenizerConfig.kind``); every one has the special tokens
``SPECIAL_TOKENS`` = [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0..4 (checked after training):

- ``"wordpiece"`` (BERT, arXiv:1810.04805; WordPiece as in ``huggingface/tokenizers``):
  NFC normalisation only -- no lowercasing and no accent stripping, because disassembly is
  ASCII and case can carry meaning (symbol names, hex digits when not normalised). The
  pre-tokeniser keeps BERT's split (whitespace removed, every punctuation character its own
  piece) with one change: a newline is kept as a piece ``"\\n"``, so the end of each
  instruction is a token (BERT's normaliser would turn it into a space). Decoding joins pieces
  with spaces (BERT's clean-up then drops the one before ","), so a round trip keeps every
  character and newline but not the exact spacing.
- ``"bpe"``: byte-level BPE (GPT-2, RoBERTa): no [UNK] ever, exact round trip.
- ``"unigram"`` (Unigram LM, arXiv:1804.10959, as in SentencePiece): ``Metaspace``
  pre-tokeniser, so a space is the symbol ``"▁"`` inside pieces and a round trip is exact. A
  newline is an ordinary character, so a piece may span an instruction boundary
  (``"▁rax\\npop"``), as in SentencePiece. (Splitting newlines off first made HF's Unigram
  trainer keep far fewer pieces than asked -- 95 of 300 on 2,000 generated functions -- so it
  is not done.)

Training reads the ``text`` column of a Parquet file (or glob) in polars slices, so memory is
bounded by one slice and the trainer's word counts, never the whole corpus; the sample is
``cfg.max_train_docs`` documents drawn without replacement with
``numpy.random.default_rng(cfg.seed)`` (all documents when there are fewer).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import polars as pl
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from labkit.config import SPECIAL_TOKENS, TokenizerConfig

UNK_ID = SPECIAL_TOKENS.index("[UNK]")

_WORDPIECE_SPLIT = r"\w+|[^\w\s]|\n"
"""Pieces kept by the WordPiece pre-tokeniser: words, single punctuation characters, newlines."""


def text_row_count(docs_path: str) -> int:
    """Number of rows of the Parquet file (or glob) ``docs_path``; ``ValueError`` naming the path
    and its columns when there is no ``text`` column, ``FileNotFoundError`` when nothing exists."""
    if not any(c in docs_path for c in "*?[") and not Path(docs_path).exists():
        raise FileNotFoundError(f"documents not found: {docs_path}")
    lf = pl.scan_parquet(docs_path)
    schema = lf.collect_schema()
    if "text" not in schema:
        raise ValueError(f"{docs_path}: no 'text' column; columns are {list(schema.names())}")
    return int(lf.select(pl.len()).collect().item())


def iter_texts(docs_path: str, *, batch_docs: int, rows: np.ndarray | None = None) -> Iterator[list[str]]:
    """Yield the ``text`` column of ``docs_path`` (Parquet file or glob) in file order, as lists
    of at most ``batch_docs`` strings, reading one polars slice at a time (slice pushdown into
    the Parquet scan). ``rows``: sorted row numbers to keep (a sample); None keeps every row.
    Null texts are skipped."""
    n = text_row_count(docs_path)
    lf = pl.scan_parquet(docs_path).select("text")
    for start in range(0, n, batch_docs):
        col = lf.slice(start, batch_docs).collect().get_column("text")
        if rows is not None:
            lo, hi = np.searchsorted(rows, [start, start + batch_docs])
            if lo == hi:
                continue
            col = col.gather(rows[lo:hi] - start)
        yield col.drop_nulls().to_list()


def _untrained(cfg: TokenizerConfig) -> tuple[Tokenizer, trainers.Trainer]:
    """An untrained tokenizer of ``cfg.kind`` (pipeline as in the module docstring) and its trainer."""
    specials = list(SPECIAL_TOKENS)
    if cfg.kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(_WORDPIECE_SPLIT), behavior="removed", invert=True)
        tok.decoder = decoders.WordPiece(prefix="##")
        trainer = trainers.WordPieceTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                            special_tokens=specials, show_progress=False)
    elif cfg.kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                      special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif cfg.kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=cfg.vocab_size, special_tokens=specials, unk_token="[UNK]",
                                          show_progress=False)
    else:
        raise ValueError(f"kind: got {cfg.kind!r}; allowed values are 'wordpiece', 'bpe', 'unigram'")
    return tok, trainer


def train_tokenizer(docs_path: str, cfg: TokenizerConfig, out_path: str) -> str:
    """Train a ``cfg.kind`` tokenizer on the ``text`` column of ``docs_path`` and save it as
    ``tokenizer.json`` at ``out_path`` (temp file + ``os.replace``). Returns ``out_path``.

    The training sample is every document when there are at most ``cfg.max_train_docs``, else
    ``cfg.max_train_docs`` rows drawn without replacement by ``numpy.random.default_rng(cfg.seed)``
    (read in file order). Raises ``ValueError`` when the sample holds no text, and
    ``RuntimeError`` if the trained vocabulary does not put SPECIAL_TOKENS at ids 0..4.
    """
    n = text_row_count(docs_path)
    rows = None
    if n > cfg.max_train_docs:
        rows = np.sort(np.random.default_rng(cfg.seed).choice(n, size=cfg.max_train_docs, replace=False))
    n_sample = n if rows is None else len(rows)
    if n_sample == 0:
        raise ValueError(f"{docs_path}: no documents to train a tokenizer on")
    tok, trainer = _untrained(cfg)
    tok.train_from_iterator(iter_texts(docs_path, batch_docs=4096, rows=rows), trainer=trainer, length=n_sample)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"trained {cfg.kind} tokenizer has {name} at id {tok.token_to_id(name)}, not {i}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(tok.to_str(pretty=True), encoding="utf-8")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a ``tokenizer.json``; ``FileNotFoundError`` naming ``path`` if it is missing."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return Tokenizer.from_file(str(path))


def file_sha256(path: str | os.PathLike, *, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of the bytes of the file at ``path``, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def tokenizer_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of the ``tokenizer.json`` file bytes: the tokenizer's identity in shard indexes."""
    return file_sha256(path)


def unk_rate(tokenizer: Tokenizer, texts: Iterable[str]) -> float:
    """Share of [UNK] (id 1) among the ids of ``texts`` (no special tokens added); 0.0 for no
    tokens. Byte-level BPE always gives 0.0; a high rate means the vocabulary misses characters."""
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    total = sum(len(e.ids) for e in encodings)
    unk = sum(e.ids.count(UNK_ID) for e in encodings)
    return unk / total if total else 0.0
