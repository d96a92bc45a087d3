"""labkit.model.attention against naive O(T^2) references, and each family inside the model."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.model.attention import (apply_rotary, attention_span, full_attention, layer_attention, linear_attention,
                              linformer_attention, rotary_tables, sliding_window_attention)
from labkit.model import BertMLM, count_parameters, flops_per_token, model_config

V = 97
KINDS = ["full", "sliding_window", "linformer", "linear"]


pytestmark = pytest.mark.torch_threads(2)


def qkv(b=2, nh=2, t=12, q=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, nh, t, q, generator=g, dtype=torch.float64) for _ in range(3)]


def key_mask(b=2, t=12):
    m = torch.ones(b, t, dtype=torch.bool)
    m[1, 7:] = False
    return m[:, None, None, :]


def naive_softmax(q, k, v, allowed):
    """softmax over allowed keys, written out: allowed bool broadcastable to [B, nh, Tq, T]."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    w = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return w @ v


def test_full_attention_matches_naive_and_padded_rows_stay_finite():
    q, k, v = qkv()
    m = key_mask()
    torch.testing.assert_close(full_attention(q, k, v, m), naive_softmax(q, k, v, m))
    assert torch.isfinite(full_attention(q, k, v, torch.zeros_like(m))).all()


def test_sliding_window_matches_naive_band_and_query_subset():
    q, k, v = qkv()
    m = key_mask()
    pos = torch.arange(12)
    band = (pos[:, None] - pos).abs() <= 2  # window 4: two keys each side
    ref = naive_softmax(q, k, v, band & m)
    out = sliding_window_attention(q, k, v, m, window=4)
    seen = (band & m).any(-1)[..., None].expand_as(ref)  # row 1, queries 9-11: only padding in reach
    assert (~seen).sum() == 3 * 2 * 8 and torch.isfinite(out).all()
    torch.testing.assert_close(out[seen], ref[seen])
    q_pos = torch.tensor([[0, 5, 11], [2, 3, 6]])
    sub = sliding_window_attention(q.gather(2, q_pos[:, None, :, None].expand(-1, 2, -1, 8)), k, v, m,
                                   window=4, q_pos=q_pos)
    torch.testing.assert_close(sub, out.gather(2, q_pos[:, None, :, None].expand(-1, 2, -1, 8)))
    with pytest.raises(ValueError, match="window_size: 13 exceeds seq_len 12"):
        sliding_window_attention(q, k, v, m, window=13)


def test_linformer_matches_naive_projection_and_ignores_padding():
    q, k, v = qkv()
    m = key_mask()
    g = torch.Generator().manual_seed(1)
    e, f = torch.randn(5, 20, generator=g, dtype=torch.float64), torch.randn(5, 20, generator=g, dtype=torch.float64)
    keep = m.transpose(-1, -2).double()
    kp, vp = e[:, :12] @ (k * keep), f[:, :12] @ (v * keep)  # [B, nh, 5, Q]
    ref = torch.softmax(q @ kp.transpose(-1, -2) / math.sqrt(8), dim=-1) @ vp
    torch.testing.assert_close(linformer_attention(q, k, v, m, e, f), ref)
    # row 1 has 7 real tokens: its output equals running on those 7 alone
    short = linformer_attention(q[1:, :, :7], k[1:, :, :7], v[1:, :, :7], None, e, f)
    torch.testing.assert_close(linformer_attention(q, k, v, m, e, f)[1:, :, :7], short)


def test_linear_attention_matches_quadratic_form():
    q, k, v = qkv()
    m = key_mask()
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    w = (phi(q) @ phi(k).transpose(-1, -2)) * m  # [B, nh, T, T] unnormalised, padded keys 0
    ref = (w @ v) / w.sum(-1, keepdim=True)
    torch.testing.assert_close(linear_attention(q, k, v, m, eps=0.0), ref)
    assert torch.isfinite(linear_attention(q, k, v, torch.zeros_like(m))).all()


def test_rotary_scores_depend_only_on_relative_position():
    q, k, _ = qkv(b=1, nh=1, t=6, q=8)
    pos = torch.arange(6)
    def scores(p):
        cos, sin = rotary_tables(p, 8, 10_000.0)
        return apply_rotary(q, cos, sin) @ apply_rotary(k, cos, sin).mT

    a, b = scores(pos), scores(pos + 37)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # tables are fp32
    assert not torch.allclose(a, q @ k.mT)  # it does rotate
    x = torch.randn(6, 8, dtype=torch.float64)  # rotation keeps the norm of each position
    torch.testing.assert_close(apply_rotary(x, *rotary_tables(pos, 8, 100.0)).norm(dim=-1), x.norm(dim=-1))


def test_layer_kinds_spans_and_flops():
    cfg = model_config("tiny", V, num_layers=6, attention="sliding_window", window_size=16, global_every=3,
                       sparse_head=False)
    local = "sliding_window"
    assert [layer_attention(cfg, i) for i in range(6)] == [local, local, "full", local, local, "full"]
    # |i - j| <= 8: 17 keys away from the ends, 8 * 9 / 2 fewer at each end
    assert attention_span(cfg, 0, 128) == (17 * 128 - 2 * 36) / 128
    n = count_parameters(cfg)["non_embedding"]
    decoder = 6 * V * 64  # the dense head's logits at every position
    assert flops_per_token(cfg, 128) == pytest.approx(6 * n + 12 * 64 * (4 * attention_span(cfg, 0, 128) + 2 * 128)
                                                      + decoder)
    lin = model_config("tiny", V, attention="linformer", linformer_k=8)
    assert attention_span(lin, 0, 128) == 8 and attention_span(lin, 0, 4) == 4
    assert attention_span(model_config("tiny", V, attention="linear"), 1, 512) == 0


def tiny(kind, **kw):
    extra = dict(window_size=6, global_every=2) if kind == "sliding_window" else {}
    extra.update(linformer_k=8) if kind == "linformer" else None
    return model_config("tiny", V, hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64,
                        attention=kind, **{**extra, **kw})


def batch(b=4, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 15:] = 0
    mask[2, 9:] = 0
    ids[mask == 0] = 0
    labels = torch.where(torch.rand(b, t, generator=g) < 0.3, ids, -100)
    labels[mask == 0] = -100
    return ids, mask, labels


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("position", ["absolute", "rotary"])
def test_sparse_head_path_matches_dense_in_loss_and_gradients(kind, position):
    torch.manual_seed(2)
    dense = BertMLM(tiny(kind, sparse_head=False, position_embedding=position))
    sparse = BertMLM(tiny(kind, sparse_head=True, position_embedding=position))
    sparse.load_state_dict(dense.state_dict())
    ids, mask, labels = batch(seed=3)
    d, s = dense(ids, mask, labels), sparse(ids, mask, labels)
    torch.testing.assert_close(s.logits, d.logits[labels != -100], atol=1e-5, rtol=0)
    torch.testing.assert_close(s.loss_sum, d.loss_sum, atol=1e-4, rtol=1e-6)
    d.loss_sum.backward()
    s.loss_sum.backward()
    for (name, a), b in zip(sparse.named_parameters(), dense.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_appended_padding_changes_nothing(kind):
    model = BertMLM(tiny(kind, sparse_head=False)).eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        a = model(ids, mask).logits
        b = model(torch.cat([ids, torch.zeros(4, 9, dtype=ids.dtype)], 1),
                  torch.cat([mask, torch.zeros(4, 9, dtype=mask.dtype)], 1)).logits
    real = mask.bool()
    torch.testing.assert_close(b[:, :24][real], a[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_each_attention_family_trains(kind):
    torch.manual_seed(4)
    model = BertMLM(tiny(kind)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, mask, labels = batch(seed=5)
    ids = torch.where(labels != -100, 4, ids)  # [MASK] the targets: only context and position tell them
    losses = []
    for _ in range(20):
        out = model(ids, mask, labels)
        loss = out.loss_sum / out.n_masked
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(V), rel=0.1)  # near-uniform at init
    assert losses[-1] < 0.5 * losses[0], losses  # measured: 4.6 -> 1.0-1.2 for every family


def test_local_layers_do_not_see_past_the_window_but_global_layers_do():
    ids = torch.randint(5, V, (1, 40), generator=torch.Generator().manual_seed(6))
    far = ids.clone()
    far[0, 30] = 7 if ids[0, 30] != 7 else 8
    local = BertMLM(tiny("sliding_window", global_every=0, sparse_head=False)).eval()  # 2 layers x 3 each side
    with torch.no_grad():
        a, b = local(ids).logits, local(far).logits
    torch.testing.assert_close(a[0, :24], b[0, :24], atol=0, rtol=0)  # 30 - 2*3 = 24 is the reach
    assert (a[0, 24:] - b[0, 24:]).abs().amax() > 1e-4
    mixed = BertMLM(tiny("sliding_window", global_every=2, sparse_head=False)).eval()
    with torch.no_grad():
        assert (mixed(ids).logits[0, 0] - mixed(far).logits[0, 0]).abs().amax() > 1e-4


def test_window_larger_than_the_sequence_is_refused_at_forward():
    model = BertMLM(tiny("sliding_window", window_size=32))
    with pytest.raises(ValueError, match="window_size: 32 exceeds seq_len 24"):
        model(*batch()[:2])
    with pytest.raises(ValueError, match="window_size"):
        model_config("tiny", V, attention="sliding_window", window_size=1000)
    with pytest.raises(ValueError, match="attention: got 'sparse'; allowed values are 'full', 'sliding_window'"):
        model_config("tiny", V, attention="sparse")
