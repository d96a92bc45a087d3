"""The study's tokenizer for disassembly: whole instruction pieces, BPE over the immediates only.

The study (arXiv:2509.05258) tokenizes with the authors' ITEM tokenizer (undertale-re/undertale,
commit be7ec98, ``undertale/models/item/tokenizer.py``: ``pretokenize`` and ``train``). labkit's
version, ``TokenizerConfig.kind = "instruction"``, follows it in two steps:

1. **Pre-tokenization** (``pretokenize``, Python): each instruction line becomes its pieces --
   prefixes (``lock``, ``rep``, ``bnd``, ``notrack``, ``xacquire``, ...), the mnemonic, each
   operand's register, size directive (``qword``; the word ``ptr`` is dropped), segment (``fs``;
   the ``:`` is dropped) and memory-operand pieces (``[``, base, ``+``/``-``/``*``, index,
   scale, displacement, ``]``), with operand commas dropped -- and every immediate is written
   in decimal (``0x10`` -> ``16``). The pieces are joined by single spaces and the
   instructions by `` [NEXT] `` (no [NEXT] after the last). This "normalised text" is what
   the tokenizer sees; ``tokenizer.decode(ids)`` gives it back exactly.
2. **Vocabulary** (``train_instruction_tokenizer``, HF ``tokenizers``): a BPE model
   (``BpeTrainer``, ``TokenizerConfig.vocab_size`` entries with the special tokens; the study:
   4096) trained on the immediates alone, and every other piece seen in the training sample
   added whole (``add_tokens``, ``single_word``: a piece never matches inside a longer one).
   A piece not seen in training is [UNK] (one per run of unknown characters, ``fuse_unk``).

Differences from the authors' code, each deliberate: [NEXT] sits between every two
instructions (theirs appends none after an instruction without operands such as ``ret``: a
``continue`` skips it, so such an instruction shares its index with the next); a negative
immediate is the piece ``-`` followed by its magnitude (``-0x10`` -> ``- 16``; the authors'
BPE pre-tokenizer split ``-16`` the same way, so the token ids agree); operands that hold spaces (AVX-512 masks such as
``zmm0 {k1} {z}``) are split into pieces where the authors' code stops with an assertion;
aarch64's ``#`` is a piece of its own; the BPE's continuation pieces (``__0`` .. ``__9``) are
all in the vocabulary, so every decimal encodes without [UNK]; and the decoder
(``decoders.WordPiece`` with prefix ``__``) rejoins them, which makes the round trip exact.
The Rizin-specific ``arg``/``var`` rewriting of the authors' code does not apply to capstone.

In labkit the separator is inserted by id, not by text: ``labkit.data.tokenize.encode_flat``
encodes each distinct instruction once (``pretokenize_lines``) and ``assemble`` puts ``NEXT_ID``
between them, the same ids as ``tokenizer.encode(pretokenize(text))``
(tests/data/test_instructions.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import numpy as np
import polars as pl
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from labkit.config import SPECIAL_TOKENS, TokenizerConfig

__all__ = ["CONTINUE", "NEXT", "NEXT_ID", "PREFIXES", "assemble", "instruction_pieces", "is_immediate",
           "is_instruction_tokenizer", "line_table", "pretokenize", "pretokenize_lines", "train_instruction_tokenizer"]

NEXT = "[NEXT]"
NEXT_ID = SPECIAL_TOKENS.index(NEXT)
CONTINUE = "__"
"""BPE continuation prefix (the authors' ``continuing_subword_prefix``)."""

PREFIXES = frozenset({"lock", "rep", "repe", "repz", "repne", "repnz", "bnd", "notrack", "xacquire", "xrelease",
                      "data16", "addr32"})
"""Instruction prefixes capstone prints before the mnemonic; each is a piece of its own."""

_SCAN = re.compile(r"\{[^}]*\}|[\[\]+\-*:,#]|[^\s\[\]+\-*:,#{}]+")
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|[0-9]+")
_DROPPED = frozenset({",", ":", "ptr"})


def instruction_pieces(line: str) -> list[str]:
    """The pieces of one instruction line (capstone's ``"mnemonic operands"``, Intel syntax):
    prefixes, mnemonic, then each operand's pieces with ``ptr``, ``:`` and ``,`` dropped and
    every hex or decimal immediate as a decimal string, its sign a ``-`` piece before it.
    ``"mov qword ptr fs:[rax + 0x10], -0x1"`` -> ``["mov", "qword", "fs", "[", "rax", "+",
    "16", "]", "-", "1"]``. An empty line gives []."""
    pieces = []
    for raw in _SCAN.findall(line):
        if raw in _DROPPED:
            continue
        if _NUMBER.fullmatch(raw):
            raw = str(int(raw, 16)) if raw[:2] in ("0x", "0X") else str(int(raw))
        pieces.append(raw)
    return pieces


def pretokenize(text: str) -> str:
    """The normalised text of a function (module docstring): the ``instruction_pieces`` of each
    line that is not only whitespace, joined by spaces, the instructions by `` [NEXT] ``."""
    return f" {NEXT} ".join(" ".join(instruction_pieces(line)) for line in text.split("\n") if line.strip())


def is_immediate(piece: str) -> bool:
    """True for a piece the BPE model encodes: a decimal number (all digits)."""
    return piece.isascii() and piece.isdigit()


def line_table(texts: list[str]) -> pl.DataFrame:
    """One row per non-empty instruction line of ``texts``: doc (UInt32, index into texts), line
    (Utf8), in text order. Lines that are only whitespace are dropped."""
    return (pl.DataFrame({"text": pl.Series(texts, dtype=pl.Utf8)}).with_row_index("doc")
            .select("doc", pl.col("text").str.split("\n").alias("line")).explode("line")
            .filter(pl.col("line").str.strip_chars().str.len_bytes() > 0))


def pretokenize_lines(lines: list[str]) -> list[str]:
    """``instruction_pieces`` of each line, joined by spaces: the strings the HF tokenizer
    encodes (per distinct line: the caller deduplicates)."""
    return [" ".join(instruction_pieces(line)) for line in lines]


def _complete_digits(tok: Tokenizer) -> None:
    """Give the trained BPE model every digit as a first piece and as a ``__`` continuation
    piece (the trainer adds only those it saw; at most 20 entries beyond ``vocab_size``), so
    any decimal encodes without [UNK]."""
    spec = json.loads(tok.to_str())["model"]
    vocab = dict(spec["vocab"])
    for piece in [d for d in "0123456789"] + [f"{CONTINUE}{d}" for d in "0123456789"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok.model = models.BPE(vocab, merges, unk_token="[UNK]", continuing_subword_prefix=CONTINUE, fuse_unk=True)


def train_instruction_tokenizer(texts: Iterable[str], cfg: TokenizerConfig) -> Tokenizer:
    """Train the study's tokenizer (module docstring) on ``texts`` (functions' disassembly).

    Counts every instruction piece of the texts (each distinct line pre-tokenized once); trains
    the BPE model (``cfg.vocab_size``, ``cfg.min_frequency``; specials at ids 0..5) on the
    immediates with their counts; then adds every other piece whole, in sorted order (the ids
    do not depend on the order the texts came in). Raises ValueError when the texts hold no
    instruction."""
    lines = line_table(list(texts)).group_by("line").len()
    if not lines.height:
        raise ValueError("instruction tokenizer: the training texts hold no instruction")
    pieces = lines.with_columns(piece=pl.Series(pretokenize_lines(lines["line"].to_list())).str.split(" "))
    counts = pieces.explode("piece").group_by("piece").agg(pl.col("len").sum()).sort("piece")
    digits = counts["piece"].str.contains(r"^[0-9]+$")
    immediates, words = counts.filter(digits), counts.filter(~digits & (pl.col("piece") != ""))
    tok = Tokenizer(models.BPE(unk_token="[UNK]", continuing_subword_prefix=CONTINUE, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix=CONTINUE, cleanup=False)
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), continuing_subword_prefix=CONTINUE,
                                  initial_alphabet=list("0123456789"), show_progress=False)

    def corpus() -> Iterable[str]:  # each immediate as often as it occurs, in batches of a few thousand
        for piece, n in immediates.iter_rows():
            for start in range(0, n, 4096):
                yield " ".join([piece] * min(4096, n - start))

    tok.train_from_iterator(corpus(), trainer=trainer)
    _complete_digits(tok)
    tok.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in words["piece"].to_list()])
    return tok


def is_instruction_tokenizer(tokenizer: Tokenizer) -> bool:
    """True for a tokenizer ``train_instruction_tokenizer`` built: a BPE model with the ``__``
    continuation prefix behind a ``WhitespaceSplit`` pre-tokenizer, and [NEXT] at ``NEXT_ID``.
    labkit pre-tokenizes the texts it gives such a tokenizer (``labkit.data.tokenize.encode_flat``,
    ``unk_report``)."""
    spec = json.loads(tokenizer.to_str())
    return (spec["model"]["type"] == "BPE" and spec["model"].get("continuing_subword_prefix") == CONTINUE
            and (spec.get("pre_tokenizer") or {}).get("type") == "WhitespaceSplit"
            and tokenizer.token_to_id(NEXT) == NEXT_ID)


def assemble(line_ids: np.ndarray, line_lengths: np.ndarray, code: np.ndarray, doc: np.ndarray,
             n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents' ids from their lines' ids: the ids of line occurrence i are those of distinct
    line ``code[i]`` (``line_ids`` back to back, ``line_lengths`` each), occurrences in document
    order with ``doc[i]`` their document; ``NEXT_ID`` goes between consecutive lines of one
    document. Returns (ids int64 [total], lengths int64 [n_docs])."""
    counts = line_lengths[code]  # tokens of each occurrence
    last = np.ones(len(doc), dtype=bool)
    last[:-1] = doc[1:] != doc[:-1]  # the last line of its document: no [NEXT] after it
    width = counts + ~last  # tokens + the [NEXT] after them
    out_start = np.cumsum(width) - width
    piece_start = np.cumsum(line_lengths) - line_lengths
    out = np.full(int(width.sum()), NEXT_ID, dtype=np.int64)
    src = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - piece_start[code], counts)
    dst = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - out_start, counts)
    out[dst] = line_ids[src]
    lengths = np.bincount(doc, weights=width, minlength=n_docs).astype(np.int64)
    return out, lengths
