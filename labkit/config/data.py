"""Configuration of the data stages: corpus, cleaning and dedup, tokenizer, shards, staging."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from labkit.config.base import SPECIAL_TOKENS, _one_of, _require, to_dict  # noqa: F401

__all__ = ["DEFAULT_ELF_PATHS", "DEFAULT_TEXT_BLOCKLIST", "DEFAULT_TEXT_BOILERPLATE", "CleanConfig", "CorpusConfig",
           "DedupConfig", "ShardConfig", "StageConfig", "TokenizerConfig"]


DEFAULT_ELF_PATHS: tuple[str, ...] = ("/usr/lib", "/usr/bin", "/usr/sbin", "/usr/libexec", "/lib")


@dataclass(kw_only=True)
class CorpusConfig:
    """Where documents come from: functions disassembled from ELF files (one per function) and
    text documents (plain text, JSONL, Parquet; ``labkit.data.sources``).

    Without any text source the corpus is this machine's ELF files (``DEFAULT_ELF_PATHS``); with
    a text source and no ``paths`` it is text only. Mixing needs both: ``paths`` and a text source.
    """

    paths: tuple[str, ...] | None = None
    """Files or directories (searched recursively, symlinks not followed) holding ELF files.
    None: ``DEFAULT_ELF_PATHS`` when no text source is given, else none (a text-only corpus);
    () reads no ELF file."""
    max_files: int | None = None
    """Read at most this many ELF files (after the seeded shuffle); None reads all that are needed."""
    max_functions: int | None = 30_000
    """Stop after this many functions in total (a bounded sample); None extracts everything."""
    min_function_bytes: int = 4
    """Functions with fewer machine-code bytes than this are skipped at extraction."""
    max_function_bytes: int = 64 * 1024
    """Functions with more machine-code bytes than this are skipped at extraction."""
    max_file_bytes: int = 256 * 1024 * 1024
    """ELF files larger than this are skipped (counted under 'too_large')."""
    max_file_seconds: float = 120.0
    """Seconds one ELF file may take (parsing and disassembly); a file over it is skipped and
    counted under 'timeout', so a hostile file cannot stall an engine."""
    normalize: bool = True
    """Abstract addresses, immediates and jump targets into a few classes (so the vocabulary
    generalises across binaries); False keeps capstone's operand text unchanged."""
    seed: int = 0
    """Seed of the shuffle that picks which files are read first."""
    max_functions_per_file: int | None = 1000
    """Take at most this many functions (the lowest addresses) from one file, so a few large
    libraries cannot fill the corpus; None takes all."""
    text_paths: tuple[str, ...] = ()
    """Plain-text files or directories (walked for text_suffixes): one document per file
    (``labkit.data.sources``)."""
    jsonl_paths: tuple[str, ...] = ()
    """JSONL files or directories (*.jsonl, *.ndjson, *.json): one document per line whose
    text_field is a string."""
    parquet_paths: tuple[str, ...] = ()
    """Parquet files or directories (*.parquet): one document per row with a Utf8 text_field."""
    text_field: str = "text"
    """Field (JSONL) or column (Parquet) holding a document's text."""
    id_field: str = "id"
    """Field or column, if present, whose value becomes the document's ``name`` (part of its id)."""
    text_suffixes: tuple[str, ...] = (".txt", ".md", ".rst", ".text")
    """File-name endings taken when a text_paths entry is a directory."""
    max_doc_bytes: int = 16 * 1024 * 1024
    """Text documents (a file, a JSONL line, a Parquet value) larger than this are skipped at
    reading ('too_large') without being decoded."""

    def __post_init__(self) -> None:
        if self.paths is None:  # text sources alone mean a text-only corpus; nothing means this machine's ELF
            text = self.text_paths or self.jsonl_paths or self.parquet_paths
            self.paths = () if text else DEFAULT_ELF_PATHS
        _require(self.max_functions_per_file is None or self.max_functions_per_file > 0,
                 "max_functions_per_file", "must be positive or None")
        _require(len(self.paths) + len(self.text_paths) + len(self.jsonl_paths) + len(self.parquet_paths) > 0,
                 "paths", "give at least one file or directory (paths, text_paths, jsonl_paths or parquet_paths)")
        _require(self.max_doc_bytes > 0, "max_doc_bytes", "must be positive")
        _require(self.max_files is None or self.max_files > 0, "max_files", "must be positive or None")
        _require(self.max_functions is None or self.max_functions > 0, "max_functions", "must be positive or None")
        _require(0 < self.min_function_bytes <= self.max_function_bytes, "min_function_bytes",
                 "must be positive and at most max_function_bytes")


DEFAULT_TEXT_BOILERPLATE: tuple[str, ...] = (
    r"(?i)^\s*(?:copyright|\(c\)|©).*(?:\d{4}|all rights reserved)",
    r"(?i)^\s*all rights reserved\.?\s*$",
    r"(?i)^\s*page \d+(?: of \d+)?\s*$",
    r"(?i)^\s*(?:home|about|contact|login|sign in|sign up|subscribe|privacy policy|terms of (?:use|service)|cookie policy)"
    r"(?:\s*[|·•/]\s*(?:home|about|contact|login|sign in|sign up|subscribe|privacy policy|terms of (?:use|service)|cookie policy))*\s*$",
    r"(?i)^\s*(?:click here|read more|share this|follow us|skip to (?:main )?content)\b.*$",
    r"(?i)^\s*this (?:site|website) uses cookies",
)
"""Header/footer line patterns for text documents (after C4's line rules, arXiv:1910.10683
section 2.2, and Gopher's, arXiv:2112.11446 appendix A)."""


DEFAULT_TEXT_BLOCKLIST: tuple[str, ...] = (
    r"(?i)\b(?:kill|hang) yoursel(?:f|ves)\b",
    r"(?i)\bk y s\b",
    r"(?i)\bfaggots?\b",
    r"(?i)\bniggers?\b",
    r"(?i)\bchild porn(?:ography)?\b",
    r"(?i)\bcunts?\b",
)
"""A short default blocklist for text: slurs, self-harm incitement and CSAM terms (a small
subset in the spirit of LDNOOBW's list, github.com/LDNOOBW). Extend it through ``blocklist``."""


@dataclass(kw_only=True)
class DedupConfig:
    """Near-duplicate removal with MinHash LSH (``labkit.data.dedup``).

    Defaults: word 5-gram shingles and 14 bands x 8 rows = 112 permutations, as datatrove's
    MinHash deduplication (huggingface/datatrove, pipeline/dedup/minhash.py: candidate pairs
    from Jaccard about 0.72 up); a candidate counts as a duplicate when its estimated Jaccard
    similarity is at least 0.8 (Lee et al. 2022, arXiv:2107.06499, section 4.1).
    """

    shingle_size: int = 5
    """Words (whitespace-separated tokens: mnemonics and operands for code) per shingle."""
    bands: int = 14
    """LSH bands."""
    rows: int = 8
    """Rows (hash values) per band; num_perm = bands * rows."""
    threshold: float = 0.8
    """Estimated Jaccard similarity at or above which a candidate is a near duplicate."""
    seed: int = 1
    """Seed of the MinHash permutations."""
    batch_rows: int = 4096
    """Documents whose texts are read at once (filters, signatures; ``labkit.data.dedup.signatures``
    then hashes 512 of them at a time): bounds memory, never changes the result."""
    max_bucket: int = 64
    """LSH buckets are sorted by document (corpus order); each document is compared with the
    next ``max_bucket`` documents of its bucket (every pair when a bucket holds at most
    ``max_bucket + 1``): bounds the pairs of a huge bucket (``labkit.data.dedup.bucket_pairs``)."""
    memory_mb: int = 256
    """Memory budget per engine of the distributed near-dedup steps (band buckets of one
    partition and their pairs): sets the number of partitions (``labkit.data.partitioned``)."""

    def __post_init__(self) -> None:
        _require(self.shingle_size >= 1, "shingle_size", "must be at least 1")
        _require(self.max_bucket >= 1, "max_bucket", "must be at least 1")
        _require(self.memory_mb >= 1, "memory_mb", "must be at least 1")
        _require(self.batch_rows > 0, "batch_rows", "must be positive")
        _require(self.bands >= 1 and self.rows >= 1, "bands", "bands and rows must be at least 1")
        _require(0.0 < self.threshold <= 1.0, "threshold", "must be in (0, 1]")

    @property
    def num_perm(self) -> int:
        """Permutations per signature: bands * rows."""
        return self.bands * self.rows


@dataclass(kw_only=True)
class CleanConfig:
    """Document filters; each drop is counted under its reason (see ``labkit.data.clean``)."""

    min_chars: int = 32
    """Documents shorter than this many characters are dropped ('too_short')."""
    max_chars: int = 200_000
    """Documents longer than this many characters are dropped ('too_long')."""
    min_lines: int = 3
    """Documents with fewer lines (instructions, for code) are dropped ('too_few_lines'): PLT
    stubs and trivial thunks are one or two instructions."""
    max_nonprintable_ratio: float = 0.01
    """Documents whose share of non-printable characters exceeds this are dropped ('nonprintable')."""
    max_repeated_line_ratio: float = 0.8
    """Documents in which more than this share of lines repeat an earlier line are dropped
    ('repeated_lines'). 0.8, not text pipelines' usual 0.3-0.5: after normalisation lines such
    as ``call ADDR`` legitimately repeat (0.5 dropped 8.5 % of real functions, 0.8 drops 0.3 %)."""
    drop_plt_stubs: bool = True
    """Drop functions named ``*@plt`` or in ``.plt`` sections ('boilerplate')."""
    blocklist: tuple[str, ...] = ()
    """Regular expressions; a document matching any is dropped ('blocklist')."""
    exact_dedup: bool = True
    """Drop exact duplicates of the text, keeping the smallest id ('exact_duplicate')."""
    max_line_chars: int = 20_000
    """Documents with a line longer than this many characters are dropped ('badly_formatted'):
    minified or binary data, a whole file on one line."""
    text_boilerplate: tuple[str, ...] = DEFAULT_TEXT_BOILERPLATE
    """Regular expressions of header/footer lines (copyright, page numbers, navigation) in text
    documents (arch "text"); see max_boilerplate_line_ratio."""
    max_boilerplate_line_ratio: float = 0.5
    """Text documents in which more than this share of lines match text_boilerplate are dropped
    ('boilerplate')."""
    text_blocklist: tuple[str, ...] = DEFAULT_TEXT_BLOCKLIST
    """Regular expressions applied to text documents (arch "text") only ('blocklist'); the
    default is a short list of slurs and abuse; () turns it off. ``blocklist`` applies to all."""
    near_dedup: DedupConfig | None = field(default_factory=DedupConfig)
    """Near-duplicate removal after exact dedup ('near_duplicate', ``labkit.data.dedup``); None
    turns it off."""
    batch_rows: int = 16_384
    """Documents read and filtered at once by ``clean_corpus`` (each of its two passes): bounds
    memory, never changes the result."""
    memory_mb: int = 256
    """Memory budget per engine of distributed exact dedup (the hash keys of one partition):
    sets the number of partitions (``labkit.data.partitioned``); never changes the result."""

    def __post_init__(self) -> None:
        _require(self.batch_rows > 0, "batch_rows", "must be positive")
        _require(self.memory_mb >= 1, "memory_mb", "must be at least 1")
        if isinstance(self.near_dedup, dict):  # from_dict / config.json
            self.near_dedup = DedupConfig(**self.near_dedup)
        _require(self.max_line_chars > 0, "max_line_chars", "must be positive")
        _require(0.0 <= self.max_boilerplate_line_ratio <= 1.0, "max_boilerplate_line_ratio", "must be in [0, 1]")
        _require(0 <= self.min_chars <= self.max_chars, "min_chars", "must be in [0, max_chars]")
        _require(0.0 <= self.max_nonprintable_ratio <= 1.0, "max_nonprintable_ratio", "must be in [0, 1]")
        _require(0.0 <= self.max_repeated_line_ratio <= 1.0, "max_repeated_line_ratio", "must be in [0, 1]")


@dataclass(kw_only=True)
class TokenizerConfig:
    """A subword tokenizer trained with HF tokenizers on a sample of the cleaned documents."""

    kind: Literal["wordpiece", "bpe", "unigram", "instruction"] = "wordpiece"
    """WordPiece (BERT), byte-level BPE (GPT-2/RoBERTa), Unigram (SentencePiece), or the study's
    tokenizer for disassembly: mnemonics, registers and operand syntax kept whole, immediates in
    decimal through a BPE, [NEXT] between instructions (``labkit.data.instructions``)."""
    vocab_size: int = 8192
    """Target vocabulary size, special tokens included. "instruction": the size of the BPE over
    the immediates (the study's 4096); every other piece seen in training is added on top."""
    min_frequency: int = 2
    """Pairs/pieces seen fewer times than this are not merged into the vocabulary."""
    max_train_docs: int = 50_000
    """Train on at most this many documents: a sample drawn with ``seed`` (deterministic), so the
    trainer's memory (word counts of the sample) does not grow with the corpus; slices of the
    documents without a sampled row are not read."""
    seed: int = 0
    """Seed of the training sample."""
    held_out_docs: int = 2000
    """Documents kept out of training and out of the alphabet (at most a tenth of the corpus) on
    which the UNK rate is measured, overall and per script (``tokenizer.stats.json``)."""
    initial_alphabet: str = "".join(chr(c) for c in range(33, 127))
    """Characters always in the vocabulary (WordPiece: also as ``##c`` continuation pieces;
    Unigram: as pieces), so words made of them, such as long hex strings, never become [UNK]."""
    alphabet_limit: int = 1000
    """WordPiece and Unigram: the non-ASCII characters of the whole corpus but the held-out
    documents (every other document, not only the training sample: a user's "João" or "café" in a
    few documents), as the tokenizer's NFC normaliser produces them (text stored as NFD, NFKC or
    NFKD gives the characters the tokenizer sees), join ``initial_alphabet``, the most frequent
    first, at most this many, and at most as many as keep the alphabet's pieces (WordPiece: c and
    ##c) within half of vocab_size (``labkit.data.tokenize.corpus_alphabet``); 0:
    ``initial_alphabet`` only (ASCII). 1000 is the ``limit_alphabet`` of HF tokenizers'
    ``BertWordPieceTokenizer``."""
    max_word_chars: int = 100
    """WordPiece: longer runs of word characters are split into pieces of this many before
    WordPiece sees them (a longer word would be one [UNK]); HF's default limit is 100."""

    def __post_init__(self) -> None:
        _require(self.held_out_docs >= 0, "held_out_docs", "must be >= 0")
        _require(self.max_word_chars > 0, "max_word_chars", "must be positive")
        _require(self.alphabet_limit >= 0, "alphabet_limit", "must be >= 0")
        _one_of(self.kind, "kind", ("wordpiece", "bpe", "unigram", "instruction"))
        _require(self.vocab_size > len(SPECIAL_TOKENS), "vocab_size",
                 f"must exceed the {len(SPECIAL_TOKENS)} special tokens {SPECIAL_TOKENS}")


@dataclass(kw_only=True)
class ShardConfig:
    """Packing token ids into fixed-length sequences in flat binary shards (``labkit.data.shards``)."""

    seq_len: int = 128
    """Tokens per sequence, [CLS] included."""
    packing: Literal["packed", "padded"] = "packed"
    """How documents become rows (``labkit.data.pack``). "packed": documents back to back, each
    followed by [SEP], cut into rows of seq_len - 1 after a [CLS] (HF run_mlm.py's grouping); a
    row holds several documents, which attend to each other (no block-diagonal mask). "padded":
    the study's samples (undertale be7ec98, tokenizer.py ``load``): one document per row, its
    first seq_len ids then [PAD], no [CLS]/[SEP]; a longer document's tail is dropped (counted
    in index.json's "packing")."""
    sequences_per_shard: int | None = None
    """Sequences per shard file (a packing group's last shard may hold fewer); None: as many as
    fit in ``shard_bytes``."""
    shard_bytes: int = 32 * 2**20
    """Target shard size when ``sequences_per_shard`` is None: 32 MiB, the order of Mosaic
    streaming's 64 MB default (``size_limit``), so a 25 GB set is ~800 files, not 24,000."""
    model_vocab_size: int | None = None
    """The vocabulary size of the model the shards are for: writing refuses a tokenizer that can
    emit an id at or above it (``ShardError``); None checks nothing."""
    batch_docs: int = 4096
    """Documents encoded per batch: bounds memory, never changes the output."""
    part_docs: int = 20_000
    """Documents per encoding part: the unit spread over engines and skipped by a re-run once
    finished; never changes the output."""
    source_pattern: str = r"^/?[^/]+/[^/]+"
    """Regular expression whose first match in a document's ``source`` names its group for
    per-source token shares and balancing (default: the first two path components, /usr/lib)."""
    source_weights: dict[str, float] = field(default_factory=dict)
    """{group: w in [0, 1]}: keep the fraction w of that group's tokens ("*": every other group);
    empty keeps everything (``labkit.data.balance``)."""
    source_caps: dict[str, float] = field(default_factory=dict)
    """{group: c in (0, 1]}: that group's share of the kept tokens is at most c ("*": every other
    group); applied after the weights; empty caps nothing."""
    heldout_fraction: float = 0.0
    """Share of documents (drawn per document, after balancing) set aside as the held-out
    evaluation split, never in the training shards (``labkit.data.heldout``); 0 sets none aside.
    The demo and notebook 01 set 0.01."""
    heldout_seed: int = 0
    """Seed of the held-out draw."""

    def __post_init__(self) -> None:
        _require(self.seq_len >= 8, "seq_len", "must be at least 8")
        _one_of(self.packing, "packing", ("packed", "padded"))
        _require(self.sequences_per_shard is None or self.sequences_per_shard > 0, "sequences_per_shard",
                 "must be positive or None")
        _require(self.shard_bytes > 0, "shard_bytes", "must be positive")
        _require(self.batch_docs > 0, "batch_docs", "must be positive")
        _require(self.part_docs > 0, "part_docs", "must be positive")
        _require(0.0 <= self.heldout_fraction < 1.0, "heldout_fraction", f"must be in [0, 1), got {self.heldout_fraction}")
        _require(all(0.0 <= w <= 1.0 for w in self.source_weights.values()), "source_weights",
                 f"weights must be in [0, 1], got {self.source_weights}")
        _require(all(0.0 < c <= 1.0 for c in self.source_caps.values()), "source_caps",
                 f"caps must be in (0, 1], got {self.source_caps}")
        try:
            re.compile(self.source_pattern)
        except re.error as err:
            raise ValueError(f"source_pattern: {self.source_pattern!r} is not a regular expression: {err}") from None


@dataclass(kw_only=True)
class StageConfig:
    """Copying a shard set to each node's local disk (``labkit.data.stage``)."""

    local_root: str | None = None
    """Node-local scratch directory; None means ``$LABKIT_LOCAL_SCRATCH``, else ``$TMPDIR``, else
    ``/tmp``, with ``labkit-<user>`` appended. Resolved on the node, not here."""
    verify: bool = True
    """Check every shard's sha256 against index.json after copying (and of a copy already there)."""
