"""Tests of labkit/plan.py: measured activation bytes and the largest micro-batch in a budget."""

from __future__ import annotations

import pytest
import torch

from labkit.model import BertMLM, model_config
from labkit.plan import activation_bytes, max_micro_batch, model_state_bytes

SEQ = 32


@pytest.fixture(autouse=True)
def _two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _cfg(**kw):
    return model_config("tiny", 128, **kw)


def test_activation_bytes_grow_linearly_with_micro_batch():
    sizes = [activation_bytes(_cfg(), SEQ, b) for b in (1, 2, 3, 4, 6)]
    per_sample = sizes[2] - sizes[1]
    assert per_sample > 0
    assert sizes[3] - sizes[2] == per_sample and sizes[4] - sizes[3] == 2 * per_sample, sizes  # exact
    # b = 1 sits off the line (measured: 32 KiB above it here), by well under a sample
    assert abs(sizes[0] - (sizes[1] - per_sample)) <= 0.1 * per_sample, sizes
    # dropout masks are saved for backward: turning dropout off saves less
    assert activation_bytes(_cfg(hidden_dropout=0.0, attention_dropout=0.0), SEQ, 2) < sizes[1]
    # longer sequences save more per sample
    assert activation_bytes(_cfg(), 2 * SEQ, 1) > sizes[0]


def test_activation_checkpointing_saves_less():
    full = activation_bytes(_cfg(), SEQ, 2)
    ckpt = activation_bytes(_cfg(activation_checkpointing=True), SEQ, 2)
    assert ckpt < full / 2


def test_model_state_is_16_bytes_per_unique_parameter():
    model = BertMLM(_cfg())
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model_state_bytes(_cfg()) == 16 * sum(unique.values())


def test_max_micro_batch_respects_the_budget():
    cfg = _cfg()
    state = model_state_bytes(cfg)
    a3, a4 = activation_bytes(cfg, SEQ, 3), activation_bytes(cfg, SEQ, 4)
    budget = state + (a3 + a4) // 2
    rep = max_micro_batch(cfg, SEQ, budget, name="tiny")
    assert rep["max_micro_batch"] == 3
    assert rep["state_bytes"] + activation_bytes(cfg, SEQ, 3) <= budget < state + activation_bytes(cfg, SEQ, 4)
    assert rep["act_bytes"] == a3 and rep["model"] == "tiny" and rep["seq_len"] == SEQ
    assert rep["act_bytes_per_sample"] == a4 - a3
    assert set(rep) >= {"model", "params", "seq_len", "budget_bytes", "state_bytes",
                        "act_bytes_per_sample", "max_micro_batch"}
    # exactly at the boundary b = 4 fits; one byte less it does not
    assert max_micro_batch(cfg, SEQ, state + a4)["max_micro_batch"] == 4
    assert max_micro_batch(cfg, SEQ, state + a4 - 1)["max_micro_batch"] == 3
    # not even one sequence fits
    assert max_micro_batch(cfg, SEQ, state + activation_bytes(cfg, SEQ, 1) - 1)["max_micro_batch"] == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        max_micro_batch(cfg, SEQ, 0)


@pytest.mark.gpu
def test_activation_bytes_match_cuda_allocations():
    """Reference: bytes the CUDA allocator holds after a training forward, minus the weights."""
    cfg = model_config("mini", 1024)
    torch.manual_seed(0)
    model = BertMLM(cfg).cuda().train()
    ids = torch.randint(5, cfg.vocab_size, (8, 128), device="cuda")
    labels = torch.full_like(ids, -100)
    labels[:, 1:20] = ids[:, 1:20]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = model(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), labels=labels)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - ids.numel() * 8
    measured = activation_bytes(cfg, 128, 8, mlm_probability=19 / 128)
    assert out.loss_sum is not None
    assert measured == pytest.approx(held, rel=0.05)
