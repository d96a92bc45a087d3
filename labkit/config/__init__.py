"""Configuration for every labkit stage: keyword-only dataclasses with documented fields.

Every field has a one-line docstring under it. ``__post_init__`` validates and raises
``ValueError`` naming the field and what is allowed. Presets are plain functions; a variant is
``dataclasses.replace(preset(), field=...)``. Every stage saves the config it ran with
(``to_dict``), and ``from_dict`` reads it back.

Nothing here touches the machine: no device probing, no environment reads at import.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

SPECIAL_TOKENS: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""Special tokens of every labkit tokenizer, in id order: [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3,
[MASK]=4 (BERT's names, arXiv:1810.04805 section 3)."""


def _require(ok: bool, name: str, message: str) -> None:
    """Raise ``ValueError("<name>: <message>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}: {message}")


def _one_of(value: Any, name: str, allowed: tuple) -> None:
    _require(value in allowed, name, f"got {value!r}; allowed values are {', '.join(map(repr, allowed))}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-serialisable dict of a config dataclass (tuples become lists)."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build ``cls`` from ``to_dict`` output; unknown keys raise ``ValueError`` naming them."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    _require(not unknown, cls.__name__, f"unknown fields {unknown}; known fields are {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        if isinstance(value, list) and "tuple" in str(names[key].type):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# Data preparation
# --------------------------------------------------------------------------------------------

DEFAULT_ELF_PATHS: tuple[str, ...] = ("/usr/lib", "/usr/bin", "/usr/sbin", "/usr/libexec", "/lib")


@dataclass(kw_only=True)
class CorpusConfig:
    """Where documents come from: functions disassembled from ELF files (one per function)."""

    paths: tuple[str, ...] = DEFAULT_ELF_PATHS
    """Files or directories (searched recursively, symlinks not followed) holding ELF files."""
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
    batch_rows: int = 16_384
    """Documents whose texts are read and hashed at once (signatures): bounds memory, never
    changes the result."""
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

    kind: Literal["wordpiece", "bpe", "unigram"] = "wordpiece"
    """WordPiece (BERT), byte-level BPE (GPT-2/RoBERTa) or Unigram (SentencePiece)."""
    vocab_size: int = 8192
    """Target vocabulary size, special tokens included."""
    min_frequency: int = 2
    """Pairs/pieces seen fewer times than this are not merged into the vocabulary."""
    max_train_docs: int = 50_000
    """Train on at most this many documents: a sample drawn with ``seed`` (deterministic), so the
    trainer's memory (word counts of the sample) does not grow with the corpus; slices of the
    documents without a sampled row are not read."""
    seed: int = 0
    """Seed of the training sample."""
    held_out_docs: int = 2000
    """Documents kept out of training (at most a tenth of the corpus) on which the UNK rate is
    measured (``tokenizer.stats.json``)."""
    initial_alphabet: str = "".join(chr(c) for c in range(33, 127))
    """Characters always in the vocabulary (WordPiece: also as ``##c`` continuation pieces;
    Unigram: as pieces), so words made of them, such as long hex strings, never become [UNK]."""
    max_word_chars: int = 100
    """WordPiece: longer runs of word characters are split into pieces of this many before
    WordPiece sees them (a longer word would be one [UNK]); HF's default limit is 100."""

    def __post_init__(self) -> None:
        _require(self.held_out_docs >= 0, "held_out_docs", "must be >= 0")
        _require(self.max_word_chars > 0, "max_word_chars", "must be positive")
        _one_of(self.kind, "kind", ("wordpiece", "bpe", "unigram"))
        _require(self.vocab_size > len(SPECIAL_TOKENS), "vocab_size",
                 f"must exceed the {len(SPECIAL_TOKENS)} special tokens {SPECIAL_TOKENS}")


@dataclass(kw_only=True)
class ShardConfig:
    """Packing token ids into fixed-length sequences in flat binary shards (``labkit.data.shards``)."""

    seq_len: int = 128
    """Tokens per sequence, [CLS] included."""
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


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ModelConfig:
    """Shape and options of the BERT-style encoder (``labkit.model``). With the defaults it is
    BERT (arXiv:1810.04805) and loads into transformers' ``BertForMaskedLM``."""

    vocab_size: int
    """Vocabulary size; comes from the tokenizer."""
    hidden_size: int = 256
    """Width of the residual stream (BERT's H)."""
    num_layers: int = 4
    """Transformer blocks (BERT's L)."""
    num_heads: int = 4
    """Attention heads (BERT's A); must divide hidden_size."""
    intermediate_size: int | None = None
    """Width of the feed-forward layer; None means 4 * hidden_size."""
    max_position_embeddings: int = 512
    """Longest sequence the learned position table holds."""
    type_vocab_size: int = 2
    """Token-type (segment) embeddings, kept for BERT checkpoint compatibility."""
    hidden_dropout: float = 0.1
    """Dropout after embeddings, attention output and feed-forward output."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    norm_eps: float = 1e-12
    """Epsilon of the normalisation layers (BERT: 1e-12)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation (BERT: 0.02)."""
    tie_embeddings: bool = True
    """Tie the MLM decoder weight to the input word embedding (as BERT)."""
    sparse_head: bool = True
    """Compute vocabulary logits only at masked positions."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in backward instead of keeping them."""
    norm_position: Literal["post", "pre"] = "post"
    """"post": x = norm(x + f(x)) (BERT); "pre": x = x + f(norm(x)) with a final norm after the
    last layer (GPT-2, Xiong et al. arXiv:2002.04745)."""
    norm_type: Literal["layernorm", "rmsnorm"] = "layernorm"
    """LayerNorm (BERT) or RMSNorm (Zhang & Sennrich arXiv:1910.07467), for every norm."""
    init: Literal["normal", "xavier", "kaiming"] = "normal"
    """Linear weights: normal(0, init_std) (BERT), Xavier/Glorot uniform, or Kaiming/He normal
    (fan_in). Embeddings are always normal(0, init_std)."""
    scale_residual_init: bool = False
    """Scale the weights of the two residual output projections (attention output, FFN output) by
    1/sqrt(2 * num_layers) at init (GPT-2, Radford et al. 2019, section 2.3)."""
    position_embedding: Literal["absolute", "rotary"] = "absolute"
    """Learned absolute position table (BERT) or rotary embeddings on queries and keys
    (RoFormer, Su et al. arXiv:2104.09864; no position table)."""
    rope_theta: float = 10_000.0
    """Base of the rotary frequencies theta_i = rope_theta^(-2i/head_dim) (RoFormer eq. 15)."""
    activation: Literal["gelu", "geglu", "swiglu"] = "gelu"
    """FFN: GELU (BERT) or gated GEGLU / SwiGLU (Shazeer arXiv:2002.05202); gated variants have
    two input projections of width intermediate_size (Shazeer uses 2/3 of 4H to keep the count)."""
    bias: bool = True
    """Biases in every Linear, norm and the decoder (BERT); False drops them all."""
    attention: Literal["full", "sliding_window", "linformer", "linear"] = "full"
    """Attention family: full softmax (BERT), sliding-window local with global layers every
    ``global_every`` layers, Linformer low-rank keys/values, or linear (elu+1 feature map).
    See ``labkit.model.attention``."""
    window_size: int = 64
    """Sliding window: each query sees keys within window_size // 2 positions on each side
    (window_size + 1 keys in all); must not exceed the sequence length at forward time."""
    global_every: int = 0
    """Sliding window: every global_every-th layer (layers k-1, 2k-1, ...) uses full attention;
    0 means none."""
    linformer_k: int = 64
    """Linformer: keys and values are projected along the sequence to this many rows."""

    def __post_init__(self) -> None:
        _require(self.vocab_size > len(SPECIAL_TOKENS), "vocab_size",
                 f"must exceed the {len(SPECIAL_TOKENS)} special tokens {SPECIAL_TOKENS}, got {self.vocab_size}")
        for name in ("hidden_size", "num_layers", "num_heads"):
            _require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        _require(self.hidden_size % self.num_heads == 0, "num_heads",
                 f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                 "allowed values are divisors of hidden_size")
        _require(0.0 <= self.hidden_dropout < 1.0, "hidden_dropout", "must be in [0, 1)")
        _require(0.0 <= self.attention_dropout < 1.0, "attention_dropout", "must be in [0, 1)")
        _one_of(self.norm_position, "norm_position", ("post", "pre"))
        _one_of(self.norm_type, "norm_type", ("layernorm", "rmsnorm"))
        _one_of(self.init, "init", ("normal", "xavier", "kaiming"))
        _one_of(self.position_embedding, "position_embedding", ("absolute", "rotary"))
        _one_of(self.activation, "activation", ("gelu", "geglu", "swiglu"))
        _one_of(self.attention, "attention", ("full", "sliding_window", "linformer", "linear"))
        _require(self.position_embedding != "rotary" or self.head_dim % 2 == 0, "position_embedding",
                 f"rotary needs an even head_dim, got {self.head_dim}")
        _require(self.rope_theta > 1.0, "rope_theta", f"must be > 1, got {self.rope_theta}")
        _require(0 < self.window_size <= self.max_position_embeddings, "window_size",
                 f"must be in [1, max_position_embeddings={self.max_position_embeddings}], got {self.window_size}")
        _require(self.global_every >= 0, "global_every",
                 f"must be >= 0 (0 = no global layers), got {self.global_every}")
        _require(0 < self.linformer_k <= self.max_position_embeddings, "linformer_k",
                 f"must be in [1, max_position_embeddings={self.max_position_embeddings}], got {self.linformer_k}")

    @property
    def ffn_size(self) -> int:
        """Feed-forward width: ``intermediate_size`` or 4 * hidden_size."""
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """Per-head width Q = hidden_size / num_heads."""
        return self.hidden_size // self.num_heads


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrainConfig:
    """One MLM pretraining run (``labkit.train.train``). Rank and world size come from the
    environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as under torchrun.

    global batch size = micro_batch_size * grad_accum_steps * world size (sequences).
    """

    data_dir: str
    """Shard directory (holding index.json), usually the node-local staged copy."""
    run_dir: str
    """Where config.json, metrics.jsonl, checkpoints/ and result.json go (rank 0 writes)."""
    model: str = "mini"
    """Model size preset name from ``labkit.model.MODEL_SIZES``."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of ``ModelConfig`` that replace the preset's (vocab_size comes from the shards)."""
    micro_batch_size: int = 16
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimiser step."""
    max_steps: int = 100
    """Optimiser steps in the run."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to lr."""
    schedule: Literal["linear", "cosine", "wsd"] = "linear"
    """Decay after warm-up: linear, cosine, or warmup-stable-decay."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.98
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    mlm_probability: float = 0.15
    """Masking probability (BERT, arXiv:1810.04805 section 3.1)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype; weights stay fp32. fp16 uses a gradient scaler."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda:LOCAL_RANK when CUDA is available, else cpu."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto: nccl on cuda, gloo on cpu."""
    num_threads: int | None = None
    """torch intra-op threads per rank (CPU); None leaves torch's default."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    seed: int = 0
    """Seed of model init, data order and masking."""
    log_every: int = 1
    """Write one metrics record every this many optimiser steps."""
    timing_warmup_steps: int = 2
    """Steps excluded from throughput averages in result.json."""
    ckpt_every: int = 0
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Keep the newest this many checkpoints."""
    checkpoints: bool = True
    """False: write no checkpoint at all (sweep runs: metrics.jsonl and result.json only; such a
    run cannot be resumed)."""
    resume: bool = True
    """Continue from the newest checkpoint in run_dir/checkpoints if there is one."""
    on_nonfinite: Literal["skip", "raise"] = "raise"
    """A non-finite loss either skips the optimiser step or stops with an error."""
    timeout_s: float = 300.0
    """Timeout of collectives and process-group setup, in seconds."""
    wsd_decay_fraction: float = 0.2
    """wsd schedule: share of max_steps (at the end) spent decaying linearly to min_lr; the
    rest after warm-up stays at lr (arXiv:2404.06395 MiniCPM; arXiv:2405.18392 uses 20 %)."""
    stop_after: int | None = None
    """Stop (checkpointing) after this many optimiser steps as if interrupted; the schedule still
    follows max_steps, so a resumed run continues it exactly. None runs to max_steps."""
    sharding: Literal["ddp", "zero1", "fsdp"] = "ddp"
    """Data-parallel memory strategy (ZeRO stages, arXiv:1910.02054): ddp replicates everything;
    zero1 shards the AdamW moments (torch's ZeroRedundancyOptimizer); fsdp shards parameters,
    gradients and moments with FSDP2 ``fully_shard`` (ZeRO-3, or ZeRO-2-style with
    fsdp_reshard_after_forward=False). Ignored in a single process."""
    fsdp_reshard_after_forward: bool = True
    """fsdp: free the gathered parameters after each layer's forward (ZeRO-3) or keep them until
    backward (False: ZeRO-2-style, more memory, one all-gather less per layer)."""
    activation_checkpointing: bool = False
    """Recompute each encoder layer's activations in backward (sets ModelConfig's field; the
    same as model_overrides={"activation_checkpointing": True})."""
    seq_len: int | None = None
    """Sequence length the run expects; shards of another length are refused before training
    (labkit.data.shards.check_shards). None takes the shards' length."""
    tokenizer_path: str | None = None
    """tokenizer.json the run expects; shards built with a tokenizer of another sha256 are
    refused before training. None skips the check."""
    verify_data: bool = False
    """Recompute every shard's sha256 against index.json before training (a staged copy was
    already verified when it was made)."""
    compile: bool = False
    """``torch.compile`` the model's forward (``nn.Module.compile``, in place, so parameter
    names and checkpoints stay the same) before wrapping it for data parallelism."""
    allow_safe_changes: bool = False
    """Resume even though fields that leave the steps already taken unchanged differ from the
    run directory's saved config (max_steps, log/checkpoint/eval intervals:
    ``labkit.train.run_config.SAFE_FIELDS``). Result-changing differences are refused regardless."""
    eval_every: int = 0
    """Evaluate the held-out loss (``labkit.train.evaluation``) every this many optimiser steps and at
    the end; 0: at the end only, and only when the shards have a held-out split (with
    eval_every > 0 shards without one are refused)."""
    eval_sequences: int = 256
    """Held-out sequences in the fixed evaluation set (the first ones of the split)."""
    eval_batch_size: int | None = None
    """Sequences per evaluation forward per rank; None: micro_batch_size."""
    trackers: tuple[str, ...] = ("tensorboard",)
    """Metric sinks rank 0 sends every record to besides metrics.jsonl (``labkit.train.sinks.SINKS``):
    "tensorboard" writes event files under run_dir/tensorboard; () writes none."""

    def __post_init__(self) -> None:
        _one_of(self.sharding, "sharding", ("ddp", "zero1", "fsdp"))
        for name in ("micro_batch_size", "grad_accum_steps", "max_steps", "log_every", "keep_checkpoints"):
            _require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        _require(self.lr > 0, "lr", "must be positive")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        _require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        _one_of(self.schedule, "schedule", ("linear", "cosine", "wsd"))
        _one_of(self.precision, "precision", ("fp32", "bf16", "fp16"))
        _one_of(self.device, "device", ("auto", "cpu", "cuda"))
        _one_of(self.backend, "backend", ("auto", "gloo", "nccl"))
        _one_of(self.on_nonfinite, "on_nonfinite", ("skip", "raise"))
        _require(0.0 < self.mlm_probability < 1.0, "mlm_probability", "must be in (0, 1)")
        _require(self.ckpt_every >= 0, "ckpt_every", "must be >= 0")
        _require(self.timeout_s > 0, "timeout_s", "must be positive")
        _require(0.0 < self.wsd_decay_fraction <= 1.0, "wsd_decay_fraction", "must be in (0, 1]")
        _require(self.stop_after is None or self.stop_after > 0, "stop_after", "must be positive or None")
        _require(self.eval_every >= 0, "eval_every", f"must be >= 0, got {self.eval_every}")
        _require(self.eval_sequences > 0, "eval_sequences", f"must be positive, got {self.eval_sequences}")
        _require(self.eval_batch_size is None or self.eval_batch_size > 0, "eval_batch_size",
                 f"must be positive or None, got {self.eval_batch_size}")


# --------------------------------------------------------------------------------------------
# The main job
# --------------------------------------------------------------------------------------------


def default_workdir() -> str:
    """``$LABKIT_WORKDIR`` or ``./work`` (resolved when called, not at import)."""
    return os.environ.get("LABKIT_WORKDIR", "work")


@dataclass(kw_only=True)
class DemoConfig:
    """The end-to-end lab on the embedded default (``labkit demo``): local engines, CPU, gloo."""

    workdir: str = "work/demo"
    """Root of every artifact: corpus/, shards/, local/ (staged), runs/, sweeps/, reports/."""
    engines: int = 2
    """Local ipyparallel engines (one per simulated GPU)."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    clean: CleanConfig = field(default_factory=CleanConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shards: ShardConfig = field(default_factory=lambda: ShardConfig(heldout_fraction=0.01))
    """Packing; 1 % of the documents are held out for evaluation."""
    model: str = "mini"
    """Model preset trained by the demo."""
    train_steps: int = 60
    """Optimiser steps of the DDP training run."""
    micro_batch_size: int = 16
    """Sequences per rank per step."""
    sweep_steps: int = 8
    """Steps per point of the rank-scaling sweep (the first two are warm-up)."""
    sweep_models: tuple[str, ...] = ("mini", "small")
    """Model presets whose largest micro-batch is found under memory_budget_gb."""
    memory_budget_gb: float = 2.0
    """CPU memory budget per rank for the micro-batch sweep, in GiB (model state plus the
    activations saved for backward)."""
    reports: bool = True
    """Execute the notebooks and export HTML reports."""

    def __post_init__(self) -> None:
        _require(self.engines >= 1, "engines", "must be at least 1")
        _require(self.train_steps > 0, "train_steps", "must be positive")
        _require(self.memory_budget_gb > 0, "memory_budget_gb", "must be positive")
