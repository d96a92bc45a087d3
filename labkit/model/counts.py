"""Parameter counts and training FLOPs per token of ``BertMLM``, in closed form from its config."""

from __future__ import annotations

from torch import nn

from labkit.config import ModelConfig
from labkit.model.attention import attention_span, layer_attention
from labkit.model.encoder import _validate


def count_parameters(cfg_or_model: ModelConfig | nn.Module) -> dict[str, int]:
    """{"total", "non_embedding"} parameter counts (a tied decoder counted once).

    Convention (Kaplan arXiv:2001.08361 section 2.1): non_embedding = total minus the lookup
    tables: word, position (absolute; the instruction and argument tables of instruction
    positions) and token-type embeddings, and the decoder weight when untied (a second
    vocabulary matrix). Biases, norms, Linformer projections and the head transform count as
    non-embedding. For a ``ModelConfig`` the closed form is used; for a model the real (unique)
    parameters are summed. The study's model (configs/study.toml) has 86,434,560 + 1,537·V.
    """
    if isinstance(cfg_or_model, nn.Module):
        params = {id(p): p for p in cfg_or_model.parameters()}
        total = sum(p.numel() for p in params.values())
        m = cfg_or_model
        tables = [m.word.weight, m.decoder] + [getattr(m, name, None) for name in (
            "token_type", "position", "instruction", "argument")]
        tables = [t.weight if isinstance(t, nn.Embedding) else t for t in tables if t is not None]
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
    final = cfg.norm_position == "pre" and cfg.final_norm
    non_embedding = (norm + cfg.num_layers * per_layer + linformer + norm * final
                     + (h * h + h * bias) + norm + v * bias)  # embed norm, layers, final norm, head, bias
    positions = {"absolute": 1, "rotary": 0, "instruction": 2}[cfg.position_embedding] * cfg.max_position_embeddings
    tables = (v + cfg.type_vocab_size + positions) * h
    untied = 0 if cfg.tie_embeddings else v * h
    return {"total": tables + untied + non_embedding, "non_embedding": non_embedding}


def flops_per_token(cfg: ModelConfig, seq_len: int, *, mlm_probability: float = 0.15) -> float:
    """Training FLOPs per token (per sequence position) = 6 N + 12 L H Q T + 6 V H f.

    N = non-embedding parameters (``count_parameters``), L layers, H heads, Q head dim, T =
    ``seq_len``, V vocabulary, H_model = hidden_size. Sources: PaLM arXiv:2204.02311 appendix B
    (6N + 12·L·H·Q·T; 6 = forward 2 + backward 4, Kaplan arXiv:2001.08361 eq. 2.2) and
    Megatron-LM (Narayanan et al. arXiv:2104.04473 section 5.1, whose per-token count includes the
    output layer's 6·V·h). Attention is counted in full (no causal halving), right for an encoder;
    for efficient attention each layer's T is ``labkit.model.attention.attention_span``.

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
