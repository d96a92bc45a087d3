"""The BERT encoder with an MLM head, written for one device (parallelism is applied from outside).

With the default options the architecture is transformers' ``BertForMaskedLM`` (BERT,
arXiv:1810.04805): learned absolute positions + token-type embeddings (type 0 everywhere),
post-norm blocks (LayerNorm eps ``cfg.norm_eps``), exact-erf GELU, and the MLM head dense -> GELU
-> LayerNorm -> decoder tied to the word embedding with its own bias. With weights copied across
(``load_hf_state_dict`` / ``to_hf_state_dict``) the logits agree with ``BertForMaskedLM`` to 1e-5
in fp32 (eval mode).

Options, one ``ModelConfig`` field each (see its docstrings): pre-norm, RMSNorm, Xavier/Kaiming
init and depth-scaled residual init, rotary positions, GEGLU/SwiGLU, no biases, dropout, and the
attention families of ``labkit.attention`` (sliding window with global layers, Linformer, linear).

Differences that change speed, not results: Q/K/V are one fused ``Linear`` (HF has three),
attention runs through ``F.scaled_dot_product_attention``, and with ``cfg.sparse_head`` the last
layer and the head run only at positions whose label is not -100 (the head part as NVIDIA's
BERT, MosaicBERT and ModernBERT do; the last layer's queries as the same argument allows).
Activation-memory terms for the planner: ``activation_bytes_per_layer`` and
``activation_bytes_outside_layers`` (Korthikanti et al. arXiv:2205.05198).
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit.attention import (apply_rotary, attention_span, full_attention, layer_attention, linear_attention,
                              linformer_attention, rotary_tables, sliding_window_attention)
from labkit.config import SPECIAL_TOKENS, ModelConfig

IGNORE_INDEX = -100
"""Label of positions that carry no MLM loss (PyTorch's cross_entropy default)."""

MODEL_SIZES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256,
                 source="labkit test size (no paper)"),
    "mini": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024,
                 source="BERT-Mini, Turc et al. arXiv:1908.08962 (L=4, H=256)"),
    "small": dict(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=2048,
                  source="Turc et al. arXiv:1908.08962 grid L=6, H=512 (their named BERT-Small is L=4)"),
    "bert-120m": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
                      source="BERT-Base, arXiv:1810.04805 (110M at vocab 30,522); the 120M model of "
                             "arXiv:2509.05258 (its exact shape is not published)"),
    "bert-350m": dict(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096,
                      source="BERT-Large, arXiv:1810.04805 (340M at vocab 30,522); the 350M model of "
                             "arXiv:2509.05258 (its exact shape is not published)"),
    "bert-1.3b": dict(hidden_size=2048, num_layers=24, num_heads=32, intermediate_size=8192,
                      source="Megatron-LM BERT 1.3B, arXiv:1909.08053 table 4 (24 layers, 2048 hidden, 32 heads)"),
}
"""Named shapes: hidden_size, num_layers, num_heads, intermediate_size and where each comes from."""


class MLMOutput(NamedTuple):
    """What ``BertMLM.forward`` returns."""

    loss_sum: torch.Tensor | None
    """fp32 scalar: sum of cross-entropy over positions with label != -100 (None without labels)."""
    n_masked: torch.Tensor
    """int64 scalar: number of positions with label != -100 (0 without labels)."""
    logits: torch.Tensor
    """[n_masked, V] with the sparse head and labels, else [B, T, V]."""


def model_config(name: str, vocab_size: int, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of preset ``name`` at ``vocab_size``; ``overrides`` replace fields.

    Raises ValueError for an unknown name (listing the known ones) or an unknown override field.
    """
    if name not in MODEL_SIZES:
        raise ValueError(f"model: unknown size {name!r}; known sizes are {sorted(MODEL_SIZES)}")
    fields = {k: v for k, v in MODEL_SIZES[name].items() if k != "source"}
    known = set(ModelConfig.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"model_overrides: unknown fields {unknown}; known fields are {sorted(known)}")
    return ModelConfig(**{**fields, "vocab_size": vocab_size, **overrides})


def _validate(cfg: ModelConfig) -> None:
    """Checks beyond ``ModelConfig.__post_init__``; ValueError naming the field."""
    checks = [
        (cfg.num_layers > 0, "num_layers", "must be positive"),
        (cfg.num_heads > 0, "num_heads", "must be positive"),
        (cfg.intermediate_size is None or cfg.intermediate_size > 0, "intermediate_size", "must be positive or None"),
        (cfg.max_position_embeddings > 0, "max_position_embeddings", "must be positive"),
        (cfg.type_vocab_size >= 1, "type_vocab_size", "must be at least 1"),
        (cfg.norm_eps > 0, "norm_eps", "must be positive"),
        (cfg.init_std > 0, "init_std", "must be positive"),
    ]
    for ok, name, message in checks:
        if not ok:
            raise ValueError(f"{name}: {message}, got {getattr(cfg, name)!r}")


def _norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm or RMSNorm over hidden_size (no bias with ``cfg.bias`` False)."""
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)


class Layer(nn.Module):
    """One block. Post-norm (BERT): x = N(x + attn(x)); x = N(x + ffn(x)). Pre-norm:
    x = x + attn(N(x)); x = x + ffn(N(x)). Attention per ``labkit.attention.layer_attention``."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        self.cfg = cfg
        self.kind = layer_attention(cfg, index)
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.bias)  # rows: query, key, value (HF's three Linears stacked)
        self.attn_out = nn.Linear(h, h, bias=cfg.bias)
        self.attn_norm = _norm(cfg)
        self.ffn_in = nn.Linear(h, 2 * f if cfg.activation != "gelu" else f, bias=cfg.bias)  # gated: [W (activated); V]
        self.ffn_out = nn.Linear(f, h, bias=cfg.bias)
        self.ffn_norm = _norm(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        if self.kind == "linformer":  # E, F of Linformer eq. 7, shared by the heads
            self.proj_k = nn.Parameter(torch.empty(cfg.linformer_k, cfg.max_position_embeddings))
            self.proj_v = nn.Parameter(torch.empty(cfg.linformer_k, cfg.max_position_embeddings))

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H]: GELU, or GEGLU / SwiGLU = (act(x W) * x V) W2 (Shazeer arXiv:2002.05202)."""
        y = self.ffn_in(x)
        if self.cfg.activation == "gelu":
            return self.ffn_out(F.gelu(y))
        a, b = y.chunk(2, dim=-1)
        return self.ffn_out((F.gelu(a) if self.cfg.activation == "geglu" else F.silu(a)) * b)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, rope: tuple | None = None,
                select: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H]; mask bool [B, 1, 1, T] (True = real token) or None; rope (cos, sin) [T, Q]
        or None; select int64 [B, m] or None: only these positions' outputs are wanted (the keys
        and values still come from all T), and the result is [B, m, H]."""
        cfg, (b, t, h) = self.cfg, x.shape
        pre = cfg.norm_position == "pre"
        q, k, v = self.qkv(self.attn_norm(x) if pre else x).view(b, t, 3, cfg.num_heads, cfg.head_dim).permute(
            2, 0, 3, 1, 4)  # 3 x [B, nh, T, Q]
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if select is not None:
            x = x.gather(1, select[:, :, None].expand(-1, -1, h))
            q = q.gather(2, select[:, None, :, None].expand(-1, cfg.num_heads, -1, cfg.head_dim))
        p = cfg.attention_dropout if self.training else 0.0
        if self.kind == "full":
            a = full_attention(q, k, v, mask, dropout_p=p)
        elif self.kind == "sliding_window":
            a = sliding_window_attention(q, k, v, mask, window=cfg.window_size, q_pos=select, dropout_p=p)
        elif self.kind == "linformer":
            a = linformer_attention(q, k, v, mask, self.proj_k, self.proj_v, dropout_p=p)
        else:
            a = linear_attention(q, k, v, mask)
        a = self.dropout(self.attn_out(a.transpose(1, 2).reshape(b, -1, h)))  # [B, Tq, H]
        if pre:
            x = x + a
            return x + self.dropout(self.ffn(self.ffn_norm(x)))
        x = self.attn_norm(x + a)
        return self.ffn_norm(x + self.dropout(self.ffn(x)))


class BertMLM(nn.Module):
    """BERT encoder + MLM head. ``forward(input_ids [B,T] int64, attention_mask [B,T] | None,
    labels [B,T] int64 | None) -> MLMOutput``; see the module docstring for the architecture."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        _validate(cfg)
        self.cfg = cfg
        h, v = cfg.hidden_size, cfg.vocab_size
        self.word = nn.Embedding(v, h, padding_idx=SPECIAL_TOKENS.index("[PAD]"))
        self.position = nn.Embedding(cfg.max_position_embeddings, h) if cfg.position_embedding == "absolute" else None
        self.token_type = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = _norm(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = _norm(cfg) if cfg.norm_position == "pre" else None
        self.head_dense = nn.Linear(h, h, bias=cfg.bias)
        self.head_norm = _norm(cfg)
        self.decoder = None if cfg.tie_embeddings else nn.Parameter(torch.empty(v, h))
        self.decoder_bias = nn.Parameter(torch.zeros(v)) if cfg.bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Init per ``cfg.init``: Linear weights normal(0, init_std) (BERT), Xavier-uniform
        (Glorot & Bengio 2010) or Kaiming-normal fan_in with the ReLU gain sqrt(2) (He et al.
        arXiv:1502.01852); embeddings and an untied decoder normal(0, init_std); biases 0; norms
        1/0; the [PAD] embedding row 0; Linformer E, F normal(0, 1/sqrt(k)). With
        ``scale_residual_init`` the attention-output and FFN-output weights are then multiplied by
        1/sqrt(2 L) (GPT-2, Radford et al. 2019 section 2.3)."""
        cfg = self.cfg
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if cfg.init == "xavier":
                    nn.init.xavier_uniform_(m.weight)
                elif cfg.init == "kaiming":
                    nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
                else:
                    nn.init.normal_(m.weight, std=cfg.init_std)
            if isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=cfg.init_std)
            if isinstance(m, (nn.Linear, nn.LayerNorm)) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(m.weight)
            if isinstance(m, Layer) and m.kind == "linformer":
                nn.init.normal_(m.proj_k, std=cfg.linformer_k ** -0.5)
                nn.init.normal_(m.proj_v, std=cfg.linformer_k ** -0.5)
        if cfg.scale_residual_init:  # after the loop, which visits a Layer before its Linears
            for layer in self.layers:
                layer.attn_out.weight.mul_((2 * cfg.num_layers) ** -0.5)
                layer.ffn_out.weight.mul_((2 * cfg.num_layers) ** -0.5)
        if self.word.padding_idx is not None and not self.word.weight.is_meta:
            self.word.weight[self.word.padding_idx].zero_()
        if self.decoder is not None:
            nn.init.normal_(self.decoder, std=cfg.init_std)
        if self.decoder_bias is not None:
            nn.init.zeros_(self.decoder_bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> MLMOutput:
        """input_ids int64 [B, T]; attention_mask [B, T] (1/True = real token; None = all real);
        labels int64 [B, T] (-100 = no loss). With ``cfg.sparse_head`` and labels, the last layer
        computes its outputs only at positions with label != -100 (its keys and values still
        from all positions; exact, as only those positions reach the loss) and the head runs
        there only: logits [n_masked, V] (a host sync for the count). Raises ValueError if T
        exceeds ``max_position_embeddings`` or a sliding window exceeds T."""
        cfg, (b, t) = self.cfg, input_ids.shape
        if t > cfg.max_position_embeddings:
            raise ValueError(f"max_position_embeddings: sequence length {t} exceeds {cfg.max_position_embeddings}")
        if cfg.attention == "sliding_window" and cfg.window_size > t:
            raise ValueError(f"window_size: {cfg.window_size} exceeds seq_len {t}; allowed values are 1..{t}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.word(input_ids) + self.token_type.weight[0]  # [B, T, H]
        rope = None
        if self.position is not None:
            x = x + self.position(pos)
        else:
            rope = rotary_tables(pos, cfg.head_dim, cfg.rope_theta)
        x = self.dropout(self.embed_norm(x))
        mask = None  # bool [B, 1, 1, T]; None when every token is real (packed shards: almost every
        if attention_mask is not None and not bool(attention_mask.bool().all()):  # batch), so SDPA
            mask = attention_mask.bool()[:, None, None, :]  # may pick a fused kernel (a host sync)
        n_masked = torch.zeros((), dtype=torch.int64, device=x.device)
        select = valid = None
        if labels is not None:
            keep = labels != IGNORE_INDEX
            counts = keep.sum(dim=1)  # [B]
            n_masked = counts.sum()
            m = int(counts.max()) if cfg.sparse_head else 0  # host sync
            if m > 0:  # masked positions first in each row, in order; valid marks the real ones
                select = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :m]
                valid = torch.arange(m, device=x.device) < counts[:, None]  # [B, m]
        for i, layer in enumerate(self.layers):
            sel = select if i == len(self.layers) - 1 else None
            if cfg.activation_checkpointing and self.training:
                x = checkpoint(layer, x, mask, rope, sel, use_reentrant=False)
            else:
                x = layer(x, mask, rope, sel)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if labels is not None and cfg.sparse_head:
            x, labels = (x[valid], labels[keep]) if select is not None else (x[keep], labels[keep])
        logits = self._head(x)
        loss_sum = None
        if labels is not None:
            loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                       reduction="sum", ignore_index=IGNORE_INDEX)
        return MLMOutput(loss_sum, n_masked, logits)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]: dense, GELU, norm, decoder (tied or own weight) + bias."""
        x = self.head_norm(F.gelu(self.head_dense(x)))
        weight = self.word.weight if self.decoder is None else self.decoder
        return F.linear(x, weight, self.decoder_bias)


# --------------------------------------------------------------------------------------------
# Parameters and FLOPs
# --------------------------------------------------------------------------------------------


def count_parameters(cfg_or_model: ModelConfig | nn.Module) -> dict[str, int]:
    """{"total", "non_embedding"} parameter counts (a tied decoder counted once).

    Convention (Kaplan arXiv:2001.08361 section 2.1): non_embedding = total minus the lookup
    tables: word, position (absolute only) and token-type embeddings, and the decoder weight when
    untied (a second vocabulary matrix). Biases, norms, Linformer projections and the head
    transform count as non-embedding. For a ``ModelConfig`` the closed form is used; for a model
    the real (unique) parameters are summed.
    """
    if isinstance(cfg_or_model, nn.Module):
        params = {id(p): p for p in cfg_or_model.parameters()}
        total = sum(p.numel() for p in params.values())
        m = cfg_or_model
        tables = [m.word.weight, m.token_type.weight] + [t for t in (m.decoder,) if t is not None]
        if m.position is not None:
            tables.append(m.position.weight)
        return {"total": total, "non_embedding": total - sum(t.numel() for t in tables)}
    cfg = cfg_or_model
    _validate(cfg)
    h, f, v, bias = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size, int(cfg.bias)
    norm = h * (2 if cfg.norm_type == "layernorm" and cfg.bias else 1)
    gates = 1 if cfg.activation == "gelu" else 2
    per_layer = ((3 * h * h + 3 * h * bias) + (h * h + h * bias) + 2 * norm  # attention, norms
                 + gates * (h * f + f * bias) + (f * h + h * bias))  # FFN
    linformer = sum(2 * cfg.linformer_k * cfg.max_position_embeddings
                    for i in range(cfg.num_layers) if layer_attention(cfg, i) == "linformer")
    non_embedding = (norm + cfg.num_layers * per_layer + linformer + norm * (cfg.norm_position == "pre")
                     + (h * h + h * bias) + norm + v * bias)  # embed norm, layers, final norm, head, bias
    tables = (v + cfg.type_vocab_size + cfg.max_position_embeddings * (cfg.position_embedding == "absolute")) * h
    untied = 0 if cfg.tie_embeddings else v * h
    return {"total": tables + untied + non_embedding, "non_embedding": non_embedding}


def flops_per_token(cfg: ModelConfig, seq_len: int, *, mlm_probability: float = 0.15) -> float:
    """Training FLOPs per token (per sequence position) = 6 N + 12 L H Q T + 6 V H f.

    N = non-embedding parameters (``count_parameters``), L layers, H heads, Q head dim, T =
    ``seq_len``, V vocabulary, H_model = hidden_size. Sources: PaLM arXiv:2204.02311 appendix B
    (6N + 12·L·H·Q·T; 6 = forward 2 + backward 4, Kaplan arXiv:2001.08361 eq. 2.2) and
    Megatron-LM (Narayanan et al. arXiv:2104.04473 section 5.1, whose per-token count includes the
    output layer's 6·V·h). Attention is counted in full (no causal halving), right for an encoder;
    for efficient attention each layer's T is ``labkit.attention.attention_span``.

    The decoder (the V x H_model output matmul, an embedding table excluded from N) costs
    6·V·H_model at every position where logits are computed: f = 1 with the dense head (every
    position), f = ``mlm_probability`` with ``cfg.sparse_head`` (the masked positions only, in
    expectation). Worked value: BERT-base shape (L 12, H 768, V 30,522, T 512, N = 85,678,650),
    dense head: 6·85,678,650 + 6·30,522·768 + 12·12·768·512 = 711,340,380 FLOPs per token.
    Raises ValueError if seq_len is not in [1, max_position_embeddings] or mlm_probability not
    in (0, 1].
    """
    if not 0 < seq_len <= cfg.max_position_embeddings:
        raise ValueError(f"seq_len: must be in [1, {cfg.max_position_embeddings}], got {seq_len}")
    if not 0.0 < mlm_probability <= 1.0:
        raise ValueError(f"mlm_probability: must be in (0, 1], got {mlm_probability}")
    n = count_parameters(cfg)["non_embedding"]
    span = sum(attention_span(cfg, i, seq_len) for i in range(cfg.num_layers))
    logits_fraction = mlm_probability if cfg.sparse_head else 1.0
    decoder = 6 * cfg.vocab_size * cfg.hidden_size * logits_fraction
    return float(6 * n + 12 * cfg.num_heads * cfg.head_dim * span + decoder)


RECOMPUTE = ("none", "selective", "full")
"""Activation-recompute modes of ``activation_bytes_per_layer`` (Korthikanti et al. section 5)."""


def activation_bytes_per_layer(cfg: ModelConfig, seq_len: int, micro_batch: int, *, dtype_bytes: int = 2,
                               recompute: str = "none", mask_bytes: int = 1, layer: int = 0) -> int:
    """Bytes one layer keeps for backward, after Korthikanti et al. arXiv:2205.05198 section 4.1.

    s = seq_len, b = micro_batch, h = hidden, a = heads, f = ffn width, d = dtype_bytes, m =
    mask_bytes (dropout masks: 1 byte on CUDA, where native dropout keeps a bool mask; on CPU
    torch keeps them in the activation dtype, so pass m = d). Terms, as this module computes:
    attention 5·d·sbh (QKV input, Q, K, V, output-projection input) + m·sbh (output dropout
    mask); FFN d·sbh (input) + 2·d·sbf (activation input and output; gated 4·d·sbf: value and
    gate, act(gate), product) + m·sbh; two norm inputs 2·d·sbh. For BERT (f = 4h, dropout on,
    d = 2, m = 1) this is the paper's sbh·(34 + 5·a·s/h). Dropout masks count only when their
    dropout is > 0. Options add: rotary 2·d·sbh (rotated Q, K); RMSNorm 2·d·sbh (torch's RMSNorm
    keeps a normalised copy); sliding window d·b·s² (the additive band mask SDPA keeps: the O(T²)
    price of the mask implementation); Linformer 2·d·sbh + 2·d·b·k·h (masked and projected K, V);
    linear attention 5·d·sbh + d·b·h·Q (feature maps, numerator and the output copy).

    ``recompute``: "none" = eager attention that keeps the scores: + (2·d + m)·a·s·n·b with
    attention dropout (softmax output, mask, dropped-out probabilities), d·a·s·n·b without,
    n = keys per query (s; Linformer k; 0 for linear attention); this is also what SDPA does on
    CPU when attention dropout is on (its math path). "selective" = the paper's selective
    recompute, which SDPA's fused kernels give for free: no s x s scores, 34·sbh for BERT.
    "full" = per-layer checkpointing (``activation_checkpointing``): the layer input only, d·sbh.
    Neglected: O(s·b) terms (norm statistics, log-sum-exp, padding mask, RoPE tables). Checked
    against saved-tensor measurements in tests/test_model.py. ``layer`` (0-based) picks the
    layer's attention (``labkit.attention.layer_attention``: global layers are full). Raises
    ValueError for an unknown ``recompute``.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute: got {recompute!r}; allowed values are {', '.join(map(repr, RECOMPUTE))}")
    s, b, h, a, f, d = seq_len, micro_batch, cfg.hidden_size, cfg.num_heads, cfg.ffn_size, dtype_bytes
    sbh = s * b * h
    if recompute == "full":
        return d * sbh
    hidden_mask = mask_bytes * sbh if cfg.hidden_dropout > 0 else 0
    attention = 5 * d * sbh + hidden_mask
    attention += 2 * d * sbh * (cfg.position_embedding == "rotary")
    k, kind = min(cfg.linformer_k, s), layer_attention(cfg, layer)
    attention += {"full": 0, "sliding_window": d * b * s * s, "linformer": 2 * d * sbh + 2 * d * b * k * h,
                  "linear": 5 * d * sbh + d * b * h * cfg.head_dim}[kind]
    if recompute == "none":
        keys = {"full": s, "sliding_window": s, "linformer": k, "linear": 0}[kind]
        attention += a * s * keys * b * (2 * d + mask_bytes if cfg.attention_dropout > 0 else d)
    ffn = d * sbh + (4 if cfg.activation != "gelu" else 2) * d * s * b * f + hidden_mask
    norms = (2 if cfg.norm_type == "layernorm" else 4) * d * sbh
    return attention + ffn + norms


def activation_bytes_outside_layers(cfg: ModelConfig, seq_len: int, micro_batch: int, *, dtype_bytes: int = 2,
                                    mask_bytes: int = 1, mlm_probability: float = 0.15) -> dict[str, int]:
    """Bytes kept for backward outside the layers: {"embedding", "head"}.

    embedding: the norm input d·sbh plus its dropout mask m·sbh (the dropout output is the first
    layer's input, counted there). head, at n = mlm_probability·s·b positions with the sparse
    head (s·b dense): dense input, GELU input and output, norm output, each d·nh, and the fp32
    log-softmax 4·nV of the fp32 loss (the logits themselves are not kept). With the sparse head
    the last layer also runs its queries at n positions only, so it keeps less than
    ``activation_bytes_per_layer`` says (that stays an upper bound for it).
    """
    s, b, h, v, d = seq_len, micro_batch, cfg.hidden_size, cfg.vocab_size, dtype_bytes
    n = round(mlm_probability * s * b) if cfg.sparse_head else s * b
    embedding = d * s * b * h + (mask_bytes * s * b * h if cfg.hidden_dropout > 0 else 0)
    head = 4 * d * n * h + 4 * n * v
    return {"embedding": embedding, "head": head}


# --------------------------------------------------------------------------------------------
# transformers interop (transformers is a test/bench dependency: imported inside functions)
# --------------------------------------------------------------------------------------------


BERT_OPTIONS = {"norm_position": "post", "norm_type": "layernorm", "position_embedding": "absolute",
                "activation": "gelu", "bias": True, "attention": "full"}
"""Option values under which the model is BERT and maps onto ``BertForMaskedLM``."""


def _require_bert(cfg: ModelConfig) -> None:
    """ValueError naming the first option that ``BertForMaskedLM`` cannot represent."""
    for name, value in BERT_OPTIONS.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"{name}: BertForMaskedLM interop needs {value!r}, got {getattr(cfg, name)!r} "
                             "(transformers' BERT cannot express this option)")


def hf_config(cfg: ModelConfig):
    """The ``transformers.BertConfig`` of the same shape (GELU, absolute positions, pad id 0).
    Raises ValueError if an option is not BERT's (``BERT_OPTIONS``)."""
    from transformers import BertConfig

    _require_bert(cfg)
    return BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.ffn_size, hidden_act="gelu",
        hidden_dropout_prob=cfg.hidden_dropout, attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_position_embeddings, type_vocab_size=cfg.type_vocab_size,
        initializer_range=cfg.init_std, layer_norm_eps=cfg.norm_eps, pad_token_id=0,
        tie_word_embeddings=cfg.tie_embeddings,
    )


def _name_map(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> BertForMaskedLM's (fused qkv handled separately)."""
    m = {
        "word.weight": "bert.embeddings.word_embeddings.weight",
        "position.weight": "bert.embeddings.position_embeddings.weight",
        "token_type.weight": "bert.embeddings.token_type_embeddings.weight",
        "embed_norm.weight": "bert.embeddings.LayerNorm.weight",
        "embed_norm.bias": "bert.embeddings.LayerNorm.bias",
        "head_dense.weight": "cls.predictions.transform.dense.weight",
        "head_dense.bias": "cls.predictions.transform.dense.bias",
        "head_norm.weight": "cls.predictions.transform.LayerNorm.weight",
        "head_norm.bias": "cls.predictions.transform.LayerNorm.bias",
        "decoder_bias": "cls.predictions.bias",
    }
    if not cfg.tie_embeddings:
        m["decoder"] = "cls.predictions.decoder.weight"
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for a, b in [("attn_out", "attention.output.dense"), ("attn_norm", "attention.output.LayerNorm"),
                     ("ffn_in", "intermediate.dense"), ("ffn_out", "output.dense"), ("ffn_norm", "output.LayerNorm")]:
            for p in ("weight", "bias"):
                m[f"{ours}{a}.{p}"] = f"{hf}{b}.{p}"
    return m


def to_hf_state_dict(model: BertMLM) -> dict[str, torch.Tensor]:
    """``BertForMaskedLM`` state dict (detached tensors; tied keys share storage as in HF)."""
    _require_bert(model.cfg)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {hf: sd[ours] for ours, hf in _name_map(model.cfg).items()}
    for i in range(model.cfg.num_layers):
        for p in ("weight", "bias"):
            q, k, v = sd[f"layers.{i}.qkv.{p}"].chunk(3, dim=0)
            for name, t in zip(("query", "key", "value"), (q, k, v)):
                out[f"bert.encoder.layer.{i}.attention.self.{name}.{p}"] = t
    if model.cfg.tie_embeddings:
        out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
    out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    return out


def load_hf_state_dict(model: BertMLM, sd: dict[str, torch.Tensor]) -> None:
    """Copy a ``BertForMaskedLM`` state dict into ``model`` in place.

    Buffers (position_ids) and pooler weights are ignored. Raises ValueError naming the missing
    keys, or the key whose shape differs.
    """
    _require_bert(model.cfg)
    names = _name_map(model.cfg)
    needed = list(names.values()) + [f"bert.encoder.layer.{i}.attention.self.{n}.{p}"
                                     for i in range(model.cfg.num_layers)
                                     for n in ("query", "key", "value") for p in ("weight", "bias")]
    missing = [k for k in needed if k not in sd]
    if missing:
        raise ValueError(f"state dict: missing BertForMaskedLM keys {missing[:5]} ({len(missing)} in all)")
    ours = {ours: sd[hf] for ours, hf in names.items()}
    for i in range(model.cfg.num_layers):
        for p in ("weight", "bias"):
            ours[f"layers.{i}.qkv.{p}"] = torch.cat(
                [sd[f"bert.encoder.layer.{i}.attention.self.{n}.{p}"] for n in ("query", "key", "value")])
    target = model.state_dict()
    for k, v in ours.items():
        if tuple(v.shape) != tuple(target[k].shape):
            raise ValueError(f"state dict: {k} has shape {tuple(v.shape)}, model expects {tuple(target[k].shape)}")
    model.load_state_dict(ours, strict=True)


def export_hf(model: BertMLM, out_dir: str | os.PathLike) -> pathlib.Path:
    """Write ``out_dir/model.safetensors`` then ``out_dir/config.json`` (each atomically), a
    directory that ``BertForMaskedLM.from_pretrained(out_dir)`` loads offline with no missing
    key, tied or untied embeddings (logits equal to 1e-5 in fp32, tests/test_model.py). Returns
    out_dir. Raises ValueError naming the option for a model transformers' BERT cannot express
    (``BERT_OPTIONS``: pre-norm, RMSNorm, no biases, gated activations, rotary positions,
    efficient attention)."""
    from safetensors.torch import save_file

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in to_hf_state_dict(model).items():
        if k == "cls.predictions.decoder.weight" and model.cfg.tie_embeddings:
            continue  # the word embedding: HF re-ties it on load
        # decoder.bias is written even though it equals cls.predictions.bias: with untied
        # embeddings transformers does not re-tie it and would leave it at its initial zeros
        tensors[k] = v.to("cpu", torch.float32, copy=True).contiguous()
    _atomic_write(out / "model.safetensors", lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    config = json.loads(hf_config(model.cfg).to_json_string())
    config["architectures"] = ["BertForMaskedLM"]
    _atomic_write(out / "config.json", lambda p: pathlib.Path(p).write_text(json.dumps(config, indent=2)))
    return out


def _atomic_write(path: pathlib.Path, write) -> None:
    """Call ``write(tmp)`` on a temp file beside ``path``, then rename it onto ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
