"""Parameter counts and training FLOPs per token of ``BertMLM``, in closed form from its config."""

from __future__ import annotations

from torch import nn

from labkit.config import ModelConfig
from labkit.model.attention import attention_span, layer_attention
from labkit.model.encoder import _validate

__all__ = ["count_parameters", "flops_per_token"]


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
    """Training FLOPs per token (per sequence position): forward + backward = 3 x the forward's
    matmul FLOPs (backward = 2 x forward, Kaplan arXiv:2001.08361 eq. 2.2), each part at the
    positions where it runs.

    Dense head, full attention: 6N + 12·L·H·Q·T + 6·V·h (PaLM arXiv:2204.02311 appendix B; the
    output layer's 6·V·h per position as Megatron-LM, Narayanan et al. arXiv:2104.04473 section
    5.1), N = non-embedding parameters (``count_parameters``), L layers, H heads of width Q,
    h = hidden size, T = ``seq_len``, V the vocabulary. Worked value, BERT-base shape (L 12,
    h 768, V 30,522, T 512, N = 85,678,650): 711,340,380.

    Parts at other positions, with p = ``mlm_probability`` (the expected masked fraction):

    - ``cfg.sparse_head``: the decoder and the head transform (dense, norm, decoder bias) run at
      the masked positions, and so do the last layer's attention queries (scores and mixing),
      output projection, FFN and norms, and pre-norm's final norm; the last layer's fused QKV
      projection runs at every position (its K and V are needed there). All at p·T.
    - attention per layer (``labkit.model.attention.layer_attention``): full 12·h·T;
      sliding window 12·h·w̄ with w̄ = ``attention_span``, the pattern's mean keys per query
      (labkit computes the masked full T x T product: the count is the model's, MFU not HFU);
      Linformer 12·h·k for projecting K and V along the sequence (E, F: excluded from N, they are
      not per-position weights) plus 12·h·k for scores and mixing; linear attention 6·h·Q for
      sum_j phi(k_j) v_j^T, and 6·h·Q + 6·h per query for phi(q) S and phi(q) z.

    Checked against ``torch.utils.flop_counter.FlopCounterMode`` (forward + backward) for every
    option, both heads, two sequence lengths, within 2 % (tests/model/test_flops.py).
    Raises ValueError if seq_len is not in [1, max_position_embeddings] or mlm_probability not
    in (0, 1].
    """
    if not 0 < seq_len <= cfg.max_position_embeddings:
        raise ValueError(f"seq_len: must be in [1, {cfg.max_position_embeddings}], got {seq_len}")
    if not 0.0 < mlm_probability <= 1.0:
        raise ValueError(f"mlm_probability: must be in (0, 1], got {mlm_probability}")
    h, f, v, bias, L = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size, int(cfg.bias), cfg.num_layers
    norm = h * (2 if cfg.norm_type == "layernorm" and cfg.bias else 1)
    gates = 1 if cfg.activation == "gelu" else 2
    qkv = 3 * h * h + 3 * h * bias
    rest = (h * h + h * bias) + 2 * norm + gates * (h * f + f * bias) + (f * h + h * bias)  # out, norms, FFN
    head = (h * h + h * bias) + norm + v * bias  # head dense, head norm, decoder bias
    frac = mlm_probability if cfg.sparse_head else 1.0  # where the last layer's queries and the head run
    per_pos = norm + (L - 1) * (qkv + rest) + qkv + frac * (rest + norm * (cfg.norm_position == "pre") + head)
    attention = 0.0
    for i in range(L):
        rows = frac if i == L - 1 else 1.0
        kind = layer_attention(cfg, i)
        if kind == "linformer":
            k = min(cfg.linformer_k, seq_len)
            attention += 12 * h * k * (1 + rows)
        elif kind == "linear":
            attention += 6 * h * cfg.head_dim + rows * (6 * h * cfg.head_dim + 6 * h)
        else:
            attention += 12 * h * attention_span(cfg, i, seq_len) * rows
    return float(6 * per_pos + attention + 6 * v * h * frac)
