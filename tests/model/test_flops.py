"""FLOPs per token (labkit/model/counts.py) against what executes: torch's FlopCounterMode over a
training forward + backward of BertMLM on real MLM batches, every option, both heads, two
sequence lengths. Attention dropout is on, so CPU's SDPA takes its math path, whose matmuls
FlopCounterMode counts (it counts 0 for CPU's fused kernel)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labkit.data.mlm import MLMCollator
from labkit.model import BertMLM, flops_per_token, model_config
from labkit.model.attention import attention_span, layer_attention
from labkit.study.counting import count_steps

pytestmark = pytest.mark.torch_threads(1)

V, B = 1000, 16
OPTIONS = [
    {}, {"norm_position": "pre"}, {"norm_type": "rmsnorm"}, {"position_embedding": "rotary"},
    {"activation": "geglu"}, {"activation": "swiglu", "intermediate_size": 340}, {"bias": False},
    {"tie_embeddings": False}, {"activation_checkpointing": True},
    {"attention": "sliding_window", "window_size": 15, "global_every": 2},
    {"attention": "linformer", "linformer_k": 16}, {"attention": "linear"},
]


def executed(cfg, seq_len: int) -> tuple[float, float]:
    """(FlopCounterMode's forward + backward FLOPs per position, the batch's masked fraction) on
    B sequences masked by labkit's MLM collator (15 %, 80/10/10)."""
    collate = MLMCollator(vocab_size=V, seed=0)
    rows = torch.randint(5, V, (B, seq_len), generator=torch.Generator().manual_seed(1))
    batch = {k: v for k, v in collate(rows.numpy()).items()}
    masked = float((batch["labels"] != -100).float().mean())
    run = count_steps(lambda: BertMLM(cfg), lambda b: batch, (), flops_at=B, fake=False)
    return run["flops"] / run["flops_tokens"], masked


@pytest.mark.parametrize("overrides", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "bert")
def test_flops_per_token_within_2_percent_of_flop_counter(overrides):
    for sparse in (True, False):
        for seq_len in (64, 128):
            cfg = model_config("tiny", V, **({"hidden_size": 128, "num_heads": 4, "num_layers": 4,
                                              "intermediate_size": 512, "sparse_head": sparse} | overrides))
            got, masked = executed(cfg, seq_len)
            model = flops_per_token(cfg, seq_len, mlm_probability=masked)
            if cfg.activation_checkpointing:
                # backward recomputes every layer's forward: executed, but not model FLOPs (MFU);
                # the count is the plain model's
                recomputed = got
                got, _ = executed(dataclasses.replace(cfg, activation_checkpointing=False), seq_len)
                assert 1.15 * got < recomputed < 4 / 3 * got
            if cfg.attention == "sliding_window":
                # labkit runs the window as a masked full T x T product: the count stays the model's
                # (MFU, not hardware FLOPs utilisation), FlopCounterMode sees the full product
                rows = [sparse * masked if i == cfg.num_layers - 1 else 1.0 for i in range(cfg.num_layers)]
                extra = sum(12 * cfg.hidden_size * (seq_len - attention_span(cfg, i, seq_len)) * rows[i]
                            for i in range(cfg.num_layers) if layer_attention(cfg, i) == "sliding_window"
                            ) if sparse else sum(12 * cfg.hidden_size * (seq_len - attention_span(cfg, i, seq_len))
                                                 for i in range(cfg.num_layers)
                                                 if layer_attention(cfg, i) == "sliding_window")
                assert model < got
                model += extra
            assert model == pytest.approx(got, rel=0.02), (overrides, sparse, seq_len, model / got)


def test_the_sparse_head_discounts_the_last_layer_and_the_head_transform():
    """BERT-base shape, T 512: the sparse head's count is 1/1.06 of the old one (which discounted
    the decoder only), and the dense count is the worked value."""
    dense = model_config("bert-120m", 30522, sparse_head=False)
    sparse = model_config("bert-120m", 30522)
    assert flops_per_token(dense, 512) == 711_340_380
    old = 711_340_380 - 6 * 30522 * 768 * 0.85
    assert old / flops_per_token(sparse, 512) == pytest.approx(1.0616, abs=1e-3)


def test_window_span_and_linformer_counted_once():
    odd = model_config("tiny", V, attention="sliding_window", window_size=7)
    even = model_config("tiny", V, attention="sliding_window", window_size=8)
    t = 10_000
    assert attention_span(odd, 0, t) == pytest.approx(7, rel=1e-3)  # |i - j| <= 3: 7 keys, not 8
    assert attention_span(even, 0, t) == pytest.approx(9, rel=1e-3)
    assert attention_span(odd, 0, 4) == (4 + 4 + 4 + 4) / 4  # every key within 3 of every query
    lin = model_config("tiny", V, attention="linformer", linformer_k=8, sparse_head=False)
    full = model_config("tiny", V, sparse_head=False)
    # the E, F parameters are not per-position weights: Linformer costs its projections only
    assert flops_per_token(lin, 128) - flops_per_token(full, 128) == 2 * 12 * 64 * (2 * 8 - 128)
