"""Attention families, rotary and instruction positions for ``labkit.model``, as plain functions.

Shapes: q [B, nh, Tq, Q], k and v [B, nh, T, Q] (nh heads of width Q); ``key_mask`` bool
[B, 1, 1, T] (True = real token) or None. Tq == T except in the last layer with the sparse MLM
head, where only the masked positions ``q_pos`` [B, Tq] are queried. Every function returns
[B, nh, Tq, Q] and gives padded keys no weight, so appending padding never changes a real
position's output. Costs are per head, for one sequence of length T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.config import ModelConfig

__all__ = ["apply_rotary", "attention_span", "eager_attention", "full_attention", "instruction_positions",
           "layer_attention", "linear_attention", "linformer_attention", "rotary_tables", "sliding_window_attention"]


def layer_attention(cfg: ModelConfig, index: int) -> str:
    """The attention of layer ``index`` (0-based): cfg.attention, except that with
    "sliding_window" every ``global_every``-th layer (index k-1, 2k-1, ...) is "full"."""
    if cfg.attention == "sliding_window" and cfg.global_every and (index + 1) % cfg.global_every == 0:
        return "full"
    return cfg.attention


def attention_span(cfg: ModelConfig, index: int, seq_len: int) -> float:
    """Keys per query of layer ``index`` at length T = ``seq_len``, averaged over the positions:
    the attention pattern's own size. Full attention T; sliding window the keys with
    |i - j| <= r = window // 2 inside the sequence: (2r + 1) - r(r + 1)/T when 2r + 1 <= T, else T
    (an odd window w has w keys, an even one w + 1; labkit's band mask still computes all T);
    Linformer k (the projected rows); linear attention 0 (no score matrix: Q x Q products,
    ``labkit.model.counts.flops_per_token``)."""
    kind = layer_attention(cfg, index)
    if kind == "sliding_window":
        r, t = cfg.window_size // 2, seq_len
        return sum(min(i + r, t - 1) - max(i - r, 0) + 1 for i in range(t)) / t
    if kind == "linformer":
        return float(min(cfg.linformer_k, seq_len))
    if kind == "linear":
        return 0.0
    return float(seq_len)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = attend) -> 0 / finfo.min in ``dtype``: a row with no allowed key stays
    finite (uniform weights) instead of NaN."""
    return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def full_attention(q, k, v, key_mask, *, dropout_p: float = 0.0) -> torch.Tensor:
    """Softmax attention softmax(q k^T / sqrt(Q)) v (Vaswani et al. arXiv:1706.03762) through
    ``F.scaled_dot_product_attention`` (fused flash / memory-efficient kernels where available).
    Time O(T^2·Q); memory O(T^2) for the math path, O(T) with the fused kernels."""
    mask = None if key_mask is None else _additive(key_mask, q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def eager_attention(q, k, v, key_mask, *, dropout_p: float = 0.0, training: bool = True) -> torch.Tensor:
    """Softmax attention written out: softmax(q k^T / sqrt(Q)) v with padded keys set to the
    dtype's lowest value before the softmax, and dropout on the probabilities. The same result
    as ``full_attention``; autograd keeps the [B, nh, Tq, T] probabilities for backward, as the
    study's model does (undertale be7ec98, undertale/models/item/model.py
    ``scaled_dot_product_attention``: one ``bmm`` per head, ``masked_fill(-1e9)``, softmax,
    ``bmm``) and transformers' "eager" attention. Time O(T^2·Q), memory O(T^2)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, nh, Tq, T]
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p, training=training)
    return torch.matmul(probs, v)


def instruction_positions(input_ids: torch.Tensor, next_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The study's positions (undertale be7ec98, undertale/models/item/model.py
    ``PositionEmbedding``): for input_ids int64 [B, T], (instruction, argument), each int64
    [B, T]: instruction = the number of ``next_id`` ([NEXT]) tokens before the position (a
    [NEXT] belongs to the instruction it ends), argument = the position's place within its
    instruction, counting from 0. Both are below T."""
    t = input_ids.shape[1]
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == next_id  # a token after [NEXT] starts an instruction
    instruction = starts.cumsum(dim=1)
    pos = torch.arange(t, device=input_ids.device).expand_as(input_ids)
    first = torch.where(starts, pos, torch.zeros_like(pos)).cummax(dim=1).values  # its instruction's first position
    return instruction, pos - first


def sliding_window_attention(q, k, v, key_mask, *, window: int, q_pos: torch.Tensor | None = None,
                             dropout_p: float = 0.0) -> torch.Tensor:
    """Local attention: query i sees keys j with |i - j| <= window // 2 (Longformer, Beltagy et
    al. arXiv:2004.05150 section 3.1; the local pattern of the Sparse Transformer, Child et al.
    arXiv:1904.10509). Global information flows through the full-attention layers placed every
    ``global_every`` layers (``layer_attention``), a layer-wise stand-in for Longformer's global
    tokens.

    The pattern costs O(T·w) time and memory (w = window + 1 keys per query). This
    implementation passes a boolean band mask [Tq, T] (combined with padding) to SDPA, so it
    materialises O(T^2) mask entries and executes O(T^2·Q) work: SDPA has no banded kernel, and
    the mask must cover every (query, key) pair it computes. It is exact, and the right choice
    at the lengths here; a blocked kernel (Longformer's sliding chunks, FlexAttention) would
    realise the O(T·w) cost. Raises ValueError if window > T.
    """
    t = k.shape[-2]
    if window > t:
        raise ValueError(f"window_size: {window} exceeds seq_len {t}; allowed values are 1..{t}")
    pos = torch.arange(t, device=q.device)
    qp = pos[None, :] if q_pos is None else q_pos  # [1 or B, Tq]
    band = (qp[:, :, None] - pos).abs() <= window // 2  # [1 or B, Tq, T]
    mask = band[:, None]  # [1 or B, 1, Tq, T]
    if key_mask is not None:
        mask = mask & key_mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_additive(mask, q.dtype), dropout_p=dropout_p)


def linformer_attention(q, k, v, key_mask, e: torch.Tensor, f: torch.Tensor, *,
                        dropout_p: float = 0.0) -> torch.Tensor:
    """Linformer (Wang et al. arXiv:2006.04768 eq. 7): keys and values are projected along the
    sequence, K' = E K and V' = F V with E, F [k, T] shared across heads (the paper's headwise
    sharing), then softmax(q K'^T / sqrt(Q)) V'. Time and memory O(T·k·Q) and O(T·k), linear in
    T for fixed k. ``e`` and ``f`` are [k, max_position_embeddings]; their first T columns are
    used. Padded keys and values are zeroed before projecting, so appended padding changes
    nothing."""
    t = k.shape[-2]
    if key_mask is not None:
        keep = key_mask.transpose(-1, -2).to(k.dtype)  # [B, 1, T, 1]
        k, v = k * keep, v * keep
    k = torch.matmul(e[:, :t], k)  # [B, nh, k, Q]
    v = torch.matmul(f[:, :t], v)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)


def linear_attention(q, k, v, key_mask, *, eps: float = 1e-6) -> torch.Tensor:
    """Linear attention with the feature map phi(x) = elu(x) + 1 (Katharopoulos et al.
    arXiv:2006.16236 eq. 4-7): out_i = phi(q_i)^T S / (phi(q_i)^T z) with S = sum_j phi(k_j)
    v_j^T [Q, Q] and z = sum_j phi(k_j), no softmax. Time O(T·Q^2), memory O(T·Q + Q^2): linear
    in T. Padded keys get phi = 0. There is no attention matrix, so no attention dropout."""
    q, k = F.elu(q) + 1, F.elu(k) + 1
    if key_mask is not None:
        k = k * key_mask.transpose(-1, -2).to(k.dtype)
    s = torch.matmul(k.transpose(-1, -2), v)  # [B, nh, Q, Q]
    z = k.sum(dim=-2)  # [B, nh, Q]
    return torch.matmul(q, s) / (torch.matmul(q, z.unsqueeze(-1)) + eps)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """(cos, sin), each fp32 [T, head_dim], for integer ``positions`` [T]: angle position * theta^(-2i/Q)
    for i < Q/2, repeated for the two halves (RoFormer, Su et al. arXiv:2104.09864 eq. 15)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv  # [T, Q/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [..., T, Q] by the tables of ``rotary_tables``. Dimension i is paired with i + Q/2
    (the GPT-NeoX / Llama layout), a fixed permutation of RoFormer's adjacent pairs; q·k after
    rotation depends on positions only through their difference."""
    a, b = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + torch.cat([-b, a], dim=-1) * sin
