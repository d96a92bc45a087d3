"""Subword tokenizers for disassembly, trained with HF ``tokenizers`` on a sample of documents.

Four kinds (``TokenizerConfig.kind``); every one has the special tokens
``SPECIAL_TOKENS`` = [PAD] [UNK] [CLS] [SEP] [MASK] [NEXT] at ids 0..5 (checked after
training; tokenizers from before [NEXT] have ids 0..4 and are still accepted, ``special_ids``):

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
- ``"instruction"``: the study's tokenizer for disassembly (``labkit.data.instructions``):
  texts are pre-tokenized in Python into whole pieces with decimal immediates, a BPE covers
  the immediates, [NEXT] separates instructions; every function here goes through
  ``encode_flat`` / ``unk_report``, which pre-tokenize for it.

Training reads the ``text`` column of a Parquet file (or glob) in polars slices, so memory is
bounded by one slice and the trainer's word counts, never the whole corpus; the sample is
``cfg.max_train_docs`` documents drawn without replacement with
``numpy.random.default_rng(cfg.seed)`` (all documents when there are fewer).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import polars as pl
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from labkit.config import LEGACY_SPECIAL_TOKENS, SPECIAL_TOKENS, TokenizerConfig
from labkit.data import instructions
from labkit.io import atomic_write_text, sha256_file

__all__ = ["MAX_CACHED_LINES", "UNK_ID", "corpus_alphabet", "encode_flat", "iter_texts", "line_separable", "LineCache",
           "load_tokenizer", "process_line_cache", "script_of", "special_ids", "split_rows", "text_row_count",
           "tokenizer_sha256", "train_tokenizer", "unk_rate", "unk_report"]

UNK_ID = SPECIAL_TOKENS.index("[UNK]")

def _wordpiece_split(max_word_chars: int) -> str:
    """Pieces kept by the WordPiece pre-tokeniser: runs of at most ``max_word_chars`` word
    characters, single punctuation characters, newlines."""
    return rf"\w{{1,{max_word_chars}}}|[^\w\s]|\n"


def special_ids(tokenizer: Tokenizer, *, name: str = "tokenizer") -> dict[str, int]:
    """{token: id} of the special tokens ``tokenizer`` has: ``SPECIAL_TOKENS`` at ids 0..5, or,
    for a tokenizer written before [NEXT] existed, ``LEGACY_SPECIAL_TOKENS`` at ids 0..4 (its id 5
    is then an ordinary token). ValueError naming ``name`` and the first token at another id."""
    for i, token in enumerate(LEGACY_SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != i:
            raise ValueError(f"{name}: {token} has id {tokenizer.token_to_id(token)}, expected {i}")
    next_id = tokenizer.token_to_id("[NEXT]")
    if next_id is None:
        return {t: i for i, t in enumerate(LEGACY_SPECIAL_TOKENS)}
    if next_id != SPECIAL_TOKENS.index("[NEXT]"):
        raise ValueError(f"{name}: [NEXT] has id {next_id}, expected {SPECIAL_TOKENS.index('[NEXT]')}")
    return {t: i for i, t in enumerate(SPECIAL_TOKENS)}


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
        if rows is not None:
            lo, hi = np.searchsorted(rows, [start, start + batch_docs])
            if lo == hi:
                continue  # no sampled row here: not read at all
            col = lf.slice(start, batch_docs).collect().get_column("text").gather(rows[lo:hi] - start)
        else:
            col = lf.slice(start, batch_docs).collect().get_column("text")
        yield col.drop_nulls().to_list()


def _normalizer(kind: str):
    """The normaliser of a ``kind`` tokenizer (the module docstring): NFC for "wordpiece" and
    "unigram", None for the others. ``_untrained`` installs it and ``corpus_alphabet`` counts
    characters in its output, so the alphabet holds what the model will be asked to encode."""
    return normalizers.NFC() if kind in ("wordpiece", "unigram") else None


def corpus_alphabet(docs_path: str, cfg: TokenizerConfig, *, rows: np.ndarray | None = None) -> str:
    """The non-ASCII characters of the ``text`` of the documents of ``docs_path`` (Parquet file or
    glob; ``rows``: sorted row numbers to read, None: every row; ``train_tokenizer`` passes all
    rows but the held-out ones, not only the training sample), as the tokenizer's normaliser
    (``_normalizer``: NFC) produces them, so text stored in any Unicode normalisation form
    (NFD's "a" + U+0303 becomes "ã") gives the characters the tokenizer will see. Most frequent
    first (ties by code point), at most ``cfg.alphabet_limit`` and at most
    ``(vocab_size // 2 - 2 * len(initial_alphabet)) // 2`` (WordPiece adds each as c and ##c: the
    alphabet stays within half the vocabulary). Read in slices; only documents holding a
    non-ASCII character are normalised (an ASCII corpus, disassembly, costs one regex pass).
    "" for ``alphabet_limit`` 0."""
    room = (cfg.vocab_size // 2 - 2 * len(cfg.initial_alphabet)) // 2
    limit = min(cfg.alphabet_limit, max(0, room))
    if limit == 0:
        return ""
    norm = _normalizer(cfg.kind)
    counts: collections.Counter[str] = collections.Counter()
    for batch in iter_texts(docs_path, batch_docs=65_536, rows=rows):
        texts = pl.Series(batch, dtype=pl.String)
        for text in texts.filter(texts.str.contains(r"[^\x00-\x7f]")):
            counts.update(c for c in (norm.normalize_str(text) if norm else text) if c > "\x7f")
    known = set(cfg.initial_alphabet)
    ranked = sorted((c for c in counts if c not in known and not c.isspace()), key=lambda c: (-counts[c], c))
    return "".join(ranked[:limit])


def _untrained(cfg: TokenizerConfig) -> tuple[Tokenizer, trainers.Trainer]:
    """An untrained tokenizer of ``cfg.kind`` (pipeline as in the module docstring) and its trainer
    (``cfg.initial_alphabet``: the caller's, with ``corpus_alphabet`` added)."""
    specials = list(SPECIAL_TOKENS)
    if cfg.kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = _normalizer(cfg.kind)
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(_wordpiece_split(cfg.max_word_chars)), behavior="removed",
                                                 invert=True)
        tok.decoder = decoders.WordPiece(prefix="##")
        trainer = trainers.WordPieceTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                            special_tokens=specials, show_progress=False,
                                            initial_alphabet=list(cfg.initial_alphabet))
    elif cfg.kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                      special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif cfg.kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = _normalizer(cfg.kind)
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=cfg.vocab_size, special_tokens=specials, unk_token="[UNK]",
                                          show_progress=False, initial_alphabet=list(cfg.initial_alphabet))
    else:
        raise ValueError(f"kind: got {cfg.kind!r}; allowed values are 'wordpiece', 'bpe', 'unigram'")
    return tok, trainer


def split_rows(n: int, cfg: TokenizerConfig) -> tuple[np.ndarray | None, np.ndarray]:
    """(training rows or None for all the others, held-out rows), both sorted: ``h`` =
    min(cfg.held_out_docs, n // 10) rows are held out and at most ``cfg.max_train_docs`` of the
    rest train, drawn without replacement by ``numpy.random.default_rng(cfg.seed)``."""
    h = min(cfg.held_out_docs, n // 10)
    if h == 0 and n <= cfg.max_train_docs:
        return None, np.empty(0, dtype=np.int64)
    take = min(n, h + cfg.max_train_docs)
    rows = np.random.default_rng(cfg.seed).choice(n, size=take, replace=False)
    return np.sort(rows[h:]), np.sort(rows[:h])


def _complete_wordpiece(tok: Tokenizer, cfg: TokenizerConfig) -> None:
    """Give the trained WordPiece model every ``cfg.initial_alphabet`` character as a piece and
    as a ``##`` continuation piece (HF's trainer adds only those it saw), dropping the
    last-learned pieces if that would exceed ``cfg.vocab_size``, and set its per-word limit to
    ``cfg.max_word_chars``."""
    vocab = tok.get_vocab()
    missing = [p for c in cfg.initial_alphabet for p in (c, f"##{c}") if p not in vocab]
    ordered = sorted(vocab, key=vocab.get)[: max(len(SPECIAL_TOKENS), cfg.vocab_size - len(missing))]
    tok.model = models.WordPiece({t: i for i, t in enumerate(ordered + missing)}, unk_token="[UNK]",
                                 max_input_chars_per_word=cfg.max_word_chars)


def train_tokenizer(docs_path: str, cfg: TokenizerConfig, out_path: str) -> str:
    """Train a ``cfg.kind`` tokenizer on the ``text`` column of ``docs_path`` and save it as
    ``tokenizer.json`` at ``out_path`` (atomically, ``labkit.io``). Returns ``out_path``.

    The training sample and held-out documents come from ``split_rows`` (read in file order).
    WordPiece and Unigram start from ``cfg.initial_alphabet`` plus the characters of every
    document but the held-out ones (``corpus_alphabet``), so the held-out documents are text the
    tokenizer never saw, its alphabet included: a character or script found only there is [UNK]
    and counts in their rate. After saving, the UNK rate on the held-out documents
    (``unk_report``: overall and per script), the alphabet's size and the split sizes are written
    to ``<out_path stem>.stats.json`` beside it. Raises ``ValueError`` when the sample holds no
    text, and ``RuntimeError`` if the trained vocabulary does not put SPECIAL_TOKENS at ids 0..5.
    """
    n = text_row_count(docs_path)
    rows, held = split_rows(n, cfg)
    if rows is None and len(held) == 0:
        rows_iter, n_sample = None, n
    else:
        if rows is None:
            rows = np.setdiff1d(np.arange(n), held)
        rows_iter, n_sample = rows, len(rows)
    if n_sample == 0:
        raise ValueError(f"{docs_path}: no documents to train a tokenizer on")
    if cfg.kind == "instruction":
        texts = (t for batch in iter_texts(docs_path, batch_docs=4096, rows=rows_iter) for t in batch)
        tok = instructions.train_instruction_tokenizer(texts, cfg)
    else:
        seen = np.setdiff1d(np.arange(n), held) if len(held) else None  # every row but the held-out ones
        extra = corpus_alphabet(docs_path, cfg, rows=seen) if cfg.kind in ("wordpiece", "unigram") else ""
        cfg = dataclasses.replace(cfg, initial_alphabet=cfg.initial_alphabet + extra)
        tok, trainer = _untrained(cfg)
        tok.train_from_iterator(iter_texts(docs_path, batch_docs=4096, rows=rows_iter), trainer=trainer,
                                length=n_sample)
    if cfg.kind == "wordpiece":
        _complete_wordpiece(tok, cfg)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"trained {cfg.kind} tokenizer has {name} at id {tok.token_to_id(name)}, not {i}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    held_texts = [t for batch in iter_texts(docs_path, batch_docs=4096, rows=held) for t in batch] if len(held) else []
    stats = {"kind": cfg.kind, "vocab_size": tok.get_vocab_size(), "documents": n, "train_docs": n_sample,
             "held_out_docs": len(held_texts), "alphabet": len(cfg.initial_alphabet) if cfg.kind != "bpe" else 256,
             **unk_report(tok, held_texts)}
    for path, text in ((out, tok.to_str(pretty=True)), (out.with_name(f"{out.stem}.stats.json"),
                                                       json.dumps(stats, indent=1) + "\n")):
        atomic_write_text(path, text)
    return out_path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a ``tokenizer.json``; ``FileNotFoundError`` naming ``path`` if it is missing."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return Tokenizer.from_file(str(path))


def tokenizer_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of the ``tokenizer.json`` file bytes: the tokenizer's identity in shard indexes."""
    return sha256_file(path)


def unk_rate(tokenizer: Tokenizer, texts: Iterable[str]) -> float:
    """Share of [UNK] (id 1) among the ids of ``texts`` (no special tokens added); 0.0 for no
    tokens. Byte-level BPE always gives 0.0; a high rate means the vocabulary misses characters."""
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    total = sum(len(e.ids) for e in encodings)
    unk = sum(e.ids.count(UNK_ID) for e in encodings)
    return unk / total if total else 0.0


@functools.lru_cache(maxsize=1 << 16)
def script_of(span: str) -> str:
    """The script of a piece of text, for the UNK rate per script: named after the first letter
    in ``span`` by the first word of its Unicode name (``unicodedata.name``), title-cased:
    "Latin" (ASCII letters too), "Cyrillic", "Greek", "Arabic", "Hangul", "Hiragana", ..., and
    "Han" for the CJK ideographs (the Script property's name for them); "Common" when ``span``
    holds no letter (digits, punctuation, symbols: the Script property's value for characters
    every script shares; Unicode Standard Annex #24). An approximation of the Script property
    from the standard library: the rare letter whose name starts with another word
    ("ª FEMININE ORDINAL INDICATOR") is named by that word."""
    letter = next((c for c in span if c.isalpha()), None)
    if letter is None:
        return "Common"
    if letter.isascii():
        return "Latin"
    word = unicodedata.name(letter, "UNNAMED").split()[0]
    return "Han" if word == "CJK" else word.title()


def unk_report(tokenizer: Tokenizer, texts: list[str], *, top: int = 10) -> dict:
    """UNK rate of ``texts`` and what became [UNK]: {"tokens", "unk_tokens", "unk_rate",
    "unk_examples": {text span: count} of the ``top`` most frequent spans mapped to [UNK],
    "by_script": {script: {"tokens", "unk_tokens", "unk_rate"}} for every script the texts hold,
    each token counted under ``script_of`` the text span it encodes (an [UNK] under the script of
    the text it replaced; [NEXT] separators under "Common"), the most tokens first}. For a
    ``line_separable`` tokenizer each distinct line is encoded once and counted with its number
    of occurrences (the same numbers, far fewer encodings on disassembly); for an instruction
    tokenizer each distinct pre-tokenized instruction, its [NEXT] separators counted as
    tokens, and the spans are pieces of the pre-tokenized text. Raises TypeError naming the
    first text that is not a str."""
    texts, weights, extra = list(texts), None, 0
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise TypeError(f"unk_report: texts[{bad}] is {type(texts[bad]).__name__}, not str")
    if texts and instructions.is_instruction_tokenizer(tokenizer):  # distinct pre-tokenized lines + [NEXT]s
        table = instructions.line_table(texts)
        lines = table.group_by("line").len().sort("line")
        extra = table.height - table["doc"].n_unique()  # one [NEXT] between consecutive lines
        texts = instructions.pretokenize_lines(lines["line"].to_list())
        weights = lines["len"].to_list()
    elif texts and line_separable(tokenizer):  # each distinct line once, weighted by its count: the same sums
        lines = (pl.DataFrame({"text": pl.Series(texts, dtype=pl.Utf8)})
                 .select(pl.col("text").str.split("\n", inclusive=True).alias("line")).explode("line")
                 .drop_nulls("line").group_by("line").len().sort("line"))
        texts, weights = lines["line"].to_list(), lines["len"].to_list()
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    counts: dict[str, int] = {}
    scripts: dict[str, list[int]] = {"Common": [extra, 0]} if extra else {}
    total = unk = 0
    for k, (text, enc) in enumerate(zip(texts, encodings)):
        w = 1 if weights is None else weights[k]
        total += w * len(enc.ids)
        for t, (a, b) in zip(enc.ids, enc.offsets):
            tally = scripts.setdefault(script_of(text[a:b]), [0, 0])
            tally[0] += w
            if t == UNK_ID:
                unk += w
                tally[1] += w
                span = text[a:b][:40]
                counts[span] = counts.get(span, 0) + w
    examples = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top])
    total += extra
    by_script = {name: {"tokens": n, "unk_tokens": u, "unk_rate": u / n if n else 0.0}
                 for name, (n, u) in sorted(scripts.items(), key=lambda kv: (-kv[1][0], kv[0]))}
    return {"tokens": total, "unk_tokens": unk, "unk_rate": unk / total if total else 0.0, "unk_examples": examples,
            "by_script": by_script}


_SEPARABLE_SPLIT = re.compile(r"\\w\{1,\d+\}\|\[\^\\w\\s\]\|\\n|\\w\+\|\[\^\\w\\s\]\|\\n")


def line_separable(tokenizer: Tokenizer) -> bool:
    """True when the ids of a text equal the concatenated ids of its lines, each line keeping its
    ``"\\n"`` -- so every distinct line need be encoded once (``encode_flat``). Holds for labkit's
    WordPiece pipeline: normaliser NFC or none (a newline is a normalisation boundary), the
    pre-tokeniser that keeps ``"\\n"`` as its own piece (``_wordpiece_split``), WordPiece applied
    per piece, and no added token containing a newline. Byte-level BPE and Unigram (whose pieces
    may span newlines) are not treated as separable."""
    spec = json.loads(tokenizer.to_str())
    pre, norm = spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    return (spec["model"]["type"] == "WordPiece"
            and (norm is None or norm.get("type") == "NFC")
            and pre.get("type") == "Split" and pre.get("behavior") == "Removed" and pre.get("invert") is True
            and bool(_SEPARABLE_SPLIT.fullmatch(pre.get("pattern", {}).get("Regex", "")))
            and not spec.get("post_processor")
            and all("\n" not in t["content"] for t in spec.get("added_tokens", [])))


MAX_CACHED_LINES = 1 << 18
"""Distinct lines a ``LineCache`` holds before it starts over (the lines, their codes and their
ids), so its memory is bounded whatever the corpus size."""


class LineCache:
    """Ids of every distinct line encoded so far (for ``encode_flat`` on a line-separable
    tokenizer): a polars table line -> code plus the ids of all codes back to back. Holds state
    across batches, so a line is encoded once per cache; when a batch would take it past
    ``max_lines`` distinct lines it is emptied first (memory bounded, ids unchanged).
    ``encode_part`` uses one per process and tokenizer (``process_line_cache``)."""

    def __init__(self, max_lines: int = MAX_CACHED_LINES) -> None:
        self.max_lines = max_lines
        self.clear()

    def clear(self) -> None:
        """Forget every line."""
        self.table = pl.DataFrame(schema={"line": pl.Utf8, "code": pl.Int64})
        self.ids = np.empty(0, dtype=np.int64)
        self.lengths = np.empty(0, dtype=np.int64)

    def codes(self, tokenizer: Tokenizer, lines: pl.DataFrame, prepare=None) -> np.ndarray:
        """Codes (int64, one per row of ``lines``' ``line`` column), encoding unseen lines first;
        ``prepare`` (list of lines -> list of strings) turns them into what is encoded
        (``instructions.pretokenize_lines``); None encodes the lines themselves."""
        encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        unique = lines.select(pl.col("line").unique())
        new = unique.join(self.table, on="line", how="anti")
        if self.table.height and self.table.height + new.height > self.max_lines:
            self.clear()
            new = unique
        if new.height:
            batch = new["line"].to_list()
            ids = [e.ids for e in encode(prepare(batch) if prepare else batch, add_special_tokens=False)]
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
            new = new.with_columns(code=pl.int_range(self.table.height, self.table.height + new.height, dtype=pl.Int64))
            self.table = pl.concat([self.table, new])
            self.ids = np.concatenate([self.ids, flat])
            self.lengths = np.concatenate([self.lengths, lengths])
        return lines.join(self.table, on="line", how="left", maintain_order="left")["code"].to_numpy()


_PROCESS_CACHE: dict[str, LineCache] = {}


def process_line_cache(tokenizer_sha256: str) -> LineCache:
    """This process's ``LineCache`` for the tokenizer with file digest ``tokenizer_sha256``: an
    engine encoding many parts encodes each distinct line once, not once per part. One tokenizer's
    cache is kept at a time (a new digest replaces it)."""
    if tokenizer_sha256 not in _PROCESS_CACHE:
        _PROCESS_CACHE.clear()
        _PROCESS_CACHE[tokenizer_sha256] = LineCache()
    return _PROCESS_CACHE[tokenizer_sha256]


def encode_flat(tokenizer: Tokenizer, texts: list[str], *, separable: bool | None = None,
                cache: LineCache | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``texts`` (no special tokens added): (ids int64 [total], lengths int64 [len(texts)]),
    document d's ids being ``ids[sum(lengths[:d]):][:lengths[d]]``.

    When the tokenizer is ``line_separable`` (checked unless given), texts are split into lines
    with polars (each keeping its ``"\\n"``), every distinct line is encoded once (per
    ``cache``, a fresh ``LineCache`` when None) and the ids are gathered back with numpy -- the
    same ids as encoding each text, far faster on disassembly, whose lines repeat (2.4 M lines,
    129 k distinct in the 30,000-function demo corpus). An instruction tokenizer
    (``labkit.data.instructions``) pre-tokenizes and encodes each distinct instruction once the
    same way and puts [NEXT] between instructions. Otherwise one ``encode_batch`` call
    (``encode_batch_fast`` when available) over the texts."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    if instructions.is_instruction_tokenizer(tokenizer):  # each distinct instruction once, [NEXT] by id
        cache = LineCache() if cache is None else cache
        lines = instructions.line_table(texts)
        code = cache.codes(tokenizer, lines, prepare=instructions.pretokenize_lines)
        return instructions.assemble(cache.ids, cache.lengths, code, lines["doc"].to_numpy().astype(np.int64),
                                     len(texts))
    if separable is None:
        separable = line_separable(tokenizer)
    if not separable:
        ids = [e.ids for e in encode(texts, add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum())), lengths
    cache = LineCache() if cache is None else cache
    lines = (pl.DataFrame({"text": pl.Series(texts, dtype=pl.Utf8)}).with_row_index("doc")
             .select("doc", pl.col("text").str.split("\n", inclusive=True).alias("line")).explode("line")
             .drop_nulls("line"))
    code = cache.codes(tokenizer, lines)
    piece_start = np.cumsum(cache.lengths) - cache.lengths
    counts = cache.lengths[code]  # tokens of each line occurrence, in document order
    out_start = np.cumsum(counts) - counts
    gather = np.arange(int(counts.sum())) - np.repeat(out_start - piece_start[code], counts)  # ragged gather
    lengths = np.bincount(lines["doc"].to_numpy(), weights=counts, minlength=len(texts)).astype(np.int64)
    return cache.ids[gather], lengths
