"""Memory planning: how large a micro-batch fits in a per-rank memory budget.

Memory of one DDP rank = model state + activations saved for backward (+ transient buffers and
allocator slack, not modelled; keep 10-20 % headroom, REFERENCES.md C4).

- model state: 16 bytes per parameter, fp32 weights + fp32 grads + AdamW's two fp32 moments
  (ZeRO, arXiv:1910.02054 section 3.1 counts 16 Psi for mixed-precision Adam; with autocast the
  weights and grads stay fp32, which is also 16 B/param; REFERENCES.md C4).
- activations: measured, not estimated: the bytes of the distinct tensor storages autograd
  saves for backward during one training-mode forward at micro-batch b
  (``torch.autograd.graph.saved_tensors_hooks``), parameters and buffers excluded.

Activations grow linearly in b, so two measurements (b = 2, 3) give the per-sample slope and the
fixed part; ``max_micro_batch`` solves for b and then verifies the answer by measuring it (and
b + 1) directly.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.config import ModelConfig
from labkit.model import BertMLM, count_parameters

STATE_BYTES_PER_PARAM = 16
"""fp32 weights (4) + fp32 grads (4) + AdamW exp_avg (4) + exp_avg_sq (4); arXiv:1910.02054."""


def _saved_bytes(model: torch.nn.Module, cfg: ModelConfig, seq_len: int, micro_batch: int, mlm_probability: float) -> int:
    """Bytes of unique storages saved for backward by one forward of ``model`` (train mode) on
    a synthetic batch int64[micro_batch, seq_len] with exactly round(mlm_probability * seq_len)
    masked positions per sequence (so the sparse MLM head sees a count proportional to b)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size, (micro_batch, seq_len), generator=g)
    labels = torch.full_like(ids, -100)
    n_mask = max(1, round(mlm_probability * seq_len))
    labels[:, 1:1 + n_mask] = ids[:, 1:1 + n_mask]
    mask = torch.ones_like(ids, dtype=torch.bool)
    state_ptrs = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in state_ptrs and storage.nbytes() > 0:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, attention_mask=mask, labels=labels)
    # every saved storage is held by the graph until ``out`` is dropped, so no address is reused
    del out
    return sum(seen.values())


def activation_bytes(model_cfg: ModelConfig, seq_len: int, micro_batch: int, *,
                     mlm_probability: float = 0.15) -> int:
    """Bytes autograd keeps for backward after one forward of ``BertMLM(model_cfg)`` (fp32, train
    mode, dropout on) at ``micro_batch`` sequences of ``seq_len`` tokens: the sum over distinct
    storages (``untyped_storage().data_ptr()``) passed to ``saved_tensors_hooks``, excluding
    parameters and buffers. Measured exactly on CPU; transient buffers freed during the forward
    are not counted. Raises ``ValueError`` for non-positive sizes."""
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch/seq_len: must be positive, got {micro_batch}/{seq_len}")
    torch.manual_seed(0)
    return _saved_bytes(BertMLM(model_cfg), model_cfg, seq_len, micro_batch, mlm_probability)


def model_state_bytes(model_cfg: ModelConfig) -> int:
    """Model-state bytes of one DDP rank: 16 B per parameter (fp32 weights, grads and AdamW's two
    moments; arXiv:1910.02054, REFERENCES.md C4). Tied weights count once."""
    return STATE_BYTES_PER_PARAM * int(count_parameters(model_cfg)["total"])


def max_micro_batch(model_cfg: ModelConfig, seq_len: int, budget_bytes: int, *, name: str | None = None,
                    mlm_probability: float = 0.15) -> dict[str, Any]:
    """Largest micro-batch b with model_state_bytes + activation_bytes(b) <= budget_bytes.

    Measures b = 2 and b = 3 to get the per-sample slope and fixed part (activations are linear
    in b from b = 2; b = 1 can sit off the line), solves for b, then checks it by measurement: steps down while the measured b exceeds
    the budget and up while b + 1 fits, so the answer is exact for this measurement.
    Returns {model, params, seq_len, budget_bytes, state_bytes, act_bytes_per_sample,
    act_bytes_fixed, act_bytes (at the answer), max_micro_batch}; max_micro_batch is 0 when even
    b = 1 does not fit. ``name`` labels the report (default "<L>L/<H>H").
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
    torch.manual_seed(0)
    model = BertMLM(model_cfg)
    cache: dict[int, int] = {}

    def act(b: int) -> int:
        if b not in cache:
            cache[b] = _saved_bytes(model, model_cfg, seq_len, b, mlm_probability)
        return cache[b]

    state = model_state_bytes(model_cfg)
    # slope from b = 2 and 3: b = 1 sits off the line (measured: tiny model, T 32, 32 KiB above;
    # some kernels take other paths at batch 1); the answer is verified by measurement below
    per_sample = act(3) - act(2)
    fixed = act(2) - 2 * per_sample
    if per_sample <= 0:
        raise RuntimeError(f"activation bytes did not grow with the micro-batch ({act(2)} -> {act(3)})")
    b = max(0, (budget_bytes - state - fixed) // per_sample)
    while b > 0 and state + act(b) > budget_bytes:
        b -= 1
    while state + act(b + 1) <= budget_bytes:
        b += 1
    return {"model": name or f"{model_cfg.num_layers}L/{model_cfg.hidden_size}H",
            "params": int(count_parameters(model_cfg)["total"]), "seq_len": seq_len,
            "budget_bytes": int(budget_bytes), "state_bytes": state, "act_bytes_per_sample": per_sample,
            "act_bytes_fixed": fixed, "act_bytes": act(b) if b else 0, "max_micro_batch": int(b)}
