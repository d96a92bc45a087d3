"""Configuration of the encoder: shape, norms, positions, activation, attention, head and init."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from labkit.config.base import SPECIAL_TOKENS, _one_of, _require, to_dict  # noqa: F401

__all__ = ["ModelConfig"]


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
    """Token-type (segment) embeddings, kept for BERT checkpoint compatibility; 0: no token-type
    table (the study's model, whose embedding is token + positions only)."""
    hidden_dropout: float = 0.1
    """Dropout after embeddings, attention output and feed-forward output."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    attention_output_dropout: bool = True
    """Dropout (hidden_dropout) on the attention block's output, before the residual add
    (BERT). False: none there; the study's model drops out only after the embeddings and the
    FFN."""
    attention_backend: Literal["sdpa", "eager"] = "sdpa"
    """Full attention through ``F.scaled_dot_product_attention`` (fused kernels where available)
    or "eager": softmax(q k^T / sqrt(Q)) v written out, so autograd keeps the [T, T]
    probabilities of every head (transformers' "eager"; the study's per-head ``bmm``)."""
    norm_eps: float = 1e-12
    """Epsilon of the normalisation layers (BERT: 1e-12)."""
    block_norm_eps: float | None = None
    """Epsilon of the two norms inside each block, when it differs from ``norm_eps``; None:
    norm_eps. The study's model keeps torch's default 1e-5 there and 1e-12 for the embedding and
    head norms (undertale be7ec98, undertale/models/item/model.py)."""
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
    last layer (GPT-2, Xiong et al. arXiv:2002.04745) unless ``final_norm`` is False."""
    final_norm: bool = True
    """Pre-norm only: a norm after the last layer (GPT-2). False: none, the head's own norm
    being the first after the last block (the study's model). Post-norm has no final norm."""
    norm_type: Literal["layernorm", "rmsnorm"] = "layernorm"
    """LayerNorm (BERT) or RMSNorm (Zhang & Sennrich arXiv:1910.07467), for every norm."""
    init: Literal["normal", "xavier", "kaiming"] = "normal"
    """Linear weights: normal(0, init_std) (BERT), Xavier/Glorot uniform, or Kaiming/He normal
    (fan_in). Embeddings are always normal(0, init_std)."""
    scale_residual_init: bool = False
    """Scale the weights of the two residual output projections (attention output, FFN output) by
    1/sqrt(2 * num_layers) at init (GPT-2, Radford et al. 2019, section 2.3)."""
    position_embedding: Literal["absolute", "rotary", "instruction"] = "absolute"
    """Learned absolute position table (BERT), rotary embeddings on queries and keys (RoFormer,
    Su et al. arXiv:2104.09864; no position table), or the study's instruction positions: two
    learned tables of max_position_embeddings rows, indexed by the instruction a token belongs
    to (the number of [NEXT] tokens before it) and by its place within that instruction
    (undertale be7ec98, undertale/models/item/model.py, ``PositionEmbedding``)."""
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
        _one_of(self.position_embedding, "position_embedding", ("absolute", "rotary", "instruction"))
        _one_of(self.attention_backend, "attention_backend", ("sdpa", "eager"))
        _require(self.attention_backend == "sdpa" or self.attention == "full", "attention_backend",
                 f"'eager' is written for attention='full', got attention={self.attention!r}")
        _require(self.final_norm or self.norm_position == "pre", "final_norm",
                 "False needs norm_position='pre' (post-norm has no final norm)")
        _require(self.type_vocab_size >= 0, "type_vocab_size", f"must be >= 0, got {self.type_vocab_size}")
        _require(self.block_norm_eps is None or self.block_norm_eps > 0, "block_norm_eps",
                 f"must be positive or None, got {self.block_norm_eps}")
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
