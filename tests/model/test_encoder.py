"""labkit.model against transformers' BertForMaskedLM, closed forms and its own dense path."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import transformers

from labkit.model.attention import rotary_tables
from labkit.model import (MODEL_SIZES, BertMLM, count_parameters, export_hf, flops_per_token, hf_config,
                          load_hf_state_dict, model_config, to_hf_state_dict)
from labkit.study import plan

V = 97


pytestmark = pytest.mark.torch_threads(2)


def tiny(**overrides):
    return model_config("tiny", V, hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64,
                        **overrides)


def batch(b=3, t=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 13:] = 0
    mask[2, 6:] = 0
    ids[mask == 0] = 0
    labels = torch.where(torch.rand(b, t, generator=g) < 0.3, ids, -100)
    labels[mask == 0] = -100
    return ids, mask, labels


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    return transformers.BertForMaskedLM(hf_config(cfg)).eval()


def hf_logits(hf, ids, mask):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("tie", [True, False])
def test_hf_weights_into_ours_give_hf_logits(tie):
    cfg = tiny(tie_embeddings=tie, sparse_head=False)
    hf = hf_model(cfg)
    ours = BertMLM(cfg).eval()
    load_hf_state_dict(ours, hf.state_dict())
    ids, mask, labels = batch()
    with torch.no_grad():
        out = ours(ids, mask, labels)
    ref = hf_logits(hf, ids, mask)
    assert out.logits.shape == (3, 20, V)
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], ref[real], atol=1e-5, rtol=0)
    ref_loss = torch.nn.functional.cross_entropy(ref.view(-1, V), labels.view(-1), reduction="sum")
    torch.testing.assert_close(out.loss_sum, ref_loss, atol=1e-4, rtol=1e-6)
    assert out.n_masked.item() == int((labels != -100).sum())


def test_our_weights_into_hf_give_our_logits():
    cfg = tiny(sparse_head=False)
    torch.manual_seed(1)
    ours = BertMLM(cfg).eval()
    hf = hf_model(cfg, seed=2)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours), strict=False)
    assert not unexpected and all("position_ids" in k for k in missing)
    ids, mask, _ = batch(seed=3)
    with torch.no_grad():
        mine = ours(ids, mask).logits
    torch.testing.assert_close(hf_logits(hf, ids, mask)[mask.bool()], mine[mask.bool()], atol=1e-5, rtol=0)


def test_export_hf_loads_with_from_pretrained(tmp_path):
    cfg = tiny(sparse_head=False)
    torch.manual_seed(4)
    ours = BertMLM(cfg).eval()
    out = export_hf(ours, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.BertForMaskedLM.from_pretrained(out).eval()
    ids, mask, _ = batch(seed=5)
    with torch.no_grad():
        mine = ours(ids, mask).logits
    torch.testing.assert_close(hf_logits(hf, ids, mask)[mask.bool()], mine[mask.bool()], atol=1e-5, rtol=0)
    assert hf.cls.predictions.decoder.weight.data_ptr() == hf.bert.embeddings.word_embeddings.weight.data_ptr()


EXPORT_OPTIONS = [({"tie_embeddings": True}, None), ({"tie_embeddings": False}, None),
                  ({"bias": False}, "bias"), ({"norm_type": "rmsnorm"}, "norm_type"),
                  ({"norm_position": "pre"}, "norm_position"), ({"activation": "geglu"}, "activation"),
                  ({"activation": "swiglu"}, "activation"), ({"position_embedding": "rotary"}, "position_embedding"),
                  ({"attention": "linformer", "linformer_k": 8}, "attention"),
                  ({"attention": "sliding_window", "window_size": 4}, "attention"), ({"attention": "linear"}, "attention")]
"""Every model option that changes the parameters (their set or shapes): exported and reloaded, or refused."""


@pytest.mark.parametrize("overrides, refused", EXPORT_OPTIONS, ids=[str(o) for o, _ in EXPORT_OPTIONS])
def test_export_reload_round_trip_for_every_parameter_option(tmp_path, overrides, refused):
    cfg = tiny(sparse_head=False, **overrides)
    torch.manual_seed(6)
    ours = BertMLM(cfg).eval()
    with torch.no_grad():  # non-zero decoder bias and norm biases, so a dropped one shows
        for name, p in ours.named_parameters():
            if name.endswith("bias") or name == "decoder_bias":
                p.normal_(0, 0.5)
    if refused:
        with pytest.raises(ValueError, match=rf"{refused}: BertForMaskedLM interop needs .* cannot express"):
            export_hf(ours, tmp_path / "hf")
        assert not (tmp_path / "hf" / "model.safetensors").exists()
        return
    out = export_hf(ours, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, info = transformers.BertForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"], info
    ids, mask, _ = batch(seed=7)
    with torch.no_grad():
        mine = ours(ids, mask).logits
    torch.testing.assert_close(hf_logits(hf.eval(), ids, mask)[mask.bool()], mine[mask.bool()], atol=1e-5, rtol=0)
    back = BertMLM(cfg).eval()  # and back into labkit from the reloaded transformers model
    load_hf_state_dict(back, hf.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(back(ids, mask).logits, mine, atol=1e-5, rtol=0)


def test_load_hf_state_dict_names_missing_and_misshapen_keys():
    cfg = tiny()
    sd = dict(to_hf_state_dict(BertMLM(cfg)))
    del sd["bert.encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match="layer.1.output.dense.bias"):
        load_hf_state_dict(BertMLM(cfg), sd)
    sd = to_hf_state_dict(BertMLM(model_config("tiny", V + 1)))
    with pytest.raises(ValueError, match="word.weight"):
        load_hf_state_dict(BertMLM(cfg), sd)


def test_sparse_and_dense_heads_agree():
    torch.manual_seed(6)
    dense = BertMLM(tiny(sparse_head=False)).eval()
    sparse = BertMLM(tiny(sparse_head=True)).eval()
    sparse.load_state_dict(dense.state_dict())
    ids, mask, labels = batch(seed=7)
    d, s = dense(ids, mask, labels), sparse(ids, mask, labels)
    keep = labels != -100
    assert s.logits.shape == (int(keep.sum()), V) and d.logits.shape == (3, 20, V)
    torch.testing.assert_close(s.logits, d.logits[keep], atol=1e-6, rtol=0)
    torch.testing.assert_close(s.loss_sum, d.loss_sum, atol=1e-5, rtol=1e-6)
    assert s.loss_sum.dtype == torch.float32 and s.n_masked.dtype == torch.int64
    assert s.n_masked == d.n_masked == keep.sum()
    s.loss_sum.backward()
    d.loss_sum.backward()
    for (name, a), b in zip(sparse.named_parameters(), dense.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_no_labels_and_no_masked_positions():
    model = BertMLM(tiny()).eval()
    ids, mask, labels = batch()
    out = model(ids, mask)
    assert out.loss_sum is None and out.n_masked.item() == 0 and out.logits.shape == (3, 20, V)
    out = model(ids, mask, torch.full_like(labels, -100))
    assert out.loss_sum.item() == 0.0 and out.logits.shape == (0, V)


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(8)
    plain = BertMLM(tiny()).train()
    ckpt = BertMLM(tiny(activation_checkpointing=True)).train()
    ckpt.load_state_dict(plain.state_dict())
    ids, mask, labels = batch(seed=9)
    saved = {}
    for m in (plain, ckpt):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            loss = m(ids, mask, labels).loss_sum
        saved[m] = sum(sizes)
        loss.backward()
    assert saved[ckpt] < saved[plain] / 2  # the layers' activations really were not kept
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6, msg=name)


def test_checkpointing_with_dropout_replays_the_same_masks():
    cfg = model_config("tiny", V, max_position_embeddings=64)  # dropout 0.1
    plain = BertMLM(cfg).train()
    ckpt = BertMLM(dataclasses.replace(cfg, activation_checkpointing=True)).train()
    ckpt.load_state_dict(plain.state_dict())
    ids, mask, labels = batch(seed=10)
    for m in (plain, ckpt):
        torch.manual_seed(11)
        m(ids, mask, labels).loss_sum.backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_padding_does_not_change_real_positions():
    model = BertMLM(tiny(sparse_head=False)).eval()
    ids, mask, _ = batch()
    padded_ids = torch.cat([ids, torch.zeros(3, 7, dtype=ids.dtype)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(3, 7, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        a = model(ids, mask).logits
        b = model(padded_ids, padded_mask).logits
    torch.testing.assert_close(b[:, :20][mask.bool()], a[mask.bool()], atol=1e-5, rtol=0)
    # and a padded key must matter: without the mask the real positions do change
    with torch.no_grad():
        c = model(padded_ids).logits
    assert (c[:, :20][mask.bool()] - a[mask.bool()]).abs().max() > 1e-3


def test_fully_padded_row_stays_finite():
    model = BertMLM(tiny()).eval()
    ids, mask, _ = batch()
    mask[0] = 0
    with torch.no_grad():
        assert torch.isfinite(model(ids, mask).logits).all()


def test_init_matches_bert():
    cfg = model_config("mini", 2000)
    model = BertMLM(cfg)
    w = model.layers[0].ffn_in.weight
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    assert (model.layers[1].qkv.bias == 0).all() and (model.decoder_bias == 0).all()
    assert (model.layers[2].attn_norm.weight == 1).all() and (model.embed_norm.bias == 0).all()
    assert (model.word.weight[0] == 0).all()


@pytest.mark.parametrize("name", ["bert-120m", "bert-350m"])
def test_parameter_counts_closed_form(name):
    size = MODEL_SIZES[name]
    h, layers, v = size["hidden_size"], size["num_layers"], 30522
    cfg = model_config(name, v)
    per_layer = 4 * h * h + 4 * h + 2 * h * 4 * h + 4 * h + h + 4 * h  # attn (4 h^2 + 4h), ffn, 2 LayerNorms
    non_embedding = layers * per_layer + 2 * h + h * h + h + 2 * h + v
    total = non_embedding + (v + 512 + 2) * h
    assert count_parameters(cfg) == {"total": total, "non_embedding": non_embedding}
    with torch.device("meta"):
        model = BertMLM(cfg)
        hf = transformers.BertForMaskedLM(hf_config(cfg))
    assert count_parameters(model) == count_parameters(cfg)
    assert sum(p.numel() for p in hf.parameters()) == total  # HF counts the tied decoder once too
    untied = dataclasses.replace(cfg, tie_embeddings=False)
    with torch.device("meta"):
        assert count_parameters(BertMLM(untied)) == count_parameters(untied) == {
            "total": total + v * h, "non_embedding": non_embedding}
    if name == "bert-120m":
        assert total == 109_514_298  # transformers' bert-base-uncased BertForMaskedLM


def test_flops_per_token_counts_the_mlm_output_layer():
    dense = model_config("bert-120m", 30522, sparse_head=False)
    assert count_parameters(dense)["non_embedding"] == 85_678_650
    # the worked value: 6 N + 6 V H + 12 L H T, BERT-base shape, dense head
    assert flops_per_token(dense, 512) == 711_340_380
    assert flops_per_token(dense, 512) - flops_per_token(dense, 128) == 12 * 12 * 768 * 384
    sparse = model_config("bert-120m", 30522, sparse_head=True)
    # the sparse head computes logits, the head transform and the last layer's queries, output
    # projection and FFN at the masked fraction of positions only (tests/model/test_flops.py)
    last = 768 * 768 + 768 + 2 * 2 * 768 + 2 * 768 * 3072 + 3072 + 768  # out, 2 norms, FFN
    head = 768 * 768 + 768 + 2 * 768 + 30522  # head dense, head norm, decoder bias
    assert flops_per_token(sparse, 512, mlm_probability=0.15) == pytest.approx(
        711_340_380 - 0.85 * (6 * 30522 * 768 + 6 * (last + head) + 12 * 768 * 512))
    assert flops_per_token(sparse, 512, mlm_probability=0.3) > flops_per_token(sparse, 512, mlm_probability=0.15)
    assert flops_per_token(dense, 512, mlm_probability=0.3) == flops_per_token(dense, 512)
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(dense, 513)
    with pytest.raises(ValueError, match="mlm_probability"):
        flops_per_token(dense, 512, mlm_probability=0.0)


def test_presets_build_and_errors_name_the_field():
    for name in MODEL_SIZES:
        assert MODEL_SIZES[name]["source"]
        cfg = model_config(name, 1000)
        assert cfg.hidden_size == MODEL_SIZES[name]["hidden_size"] and cfg.ffn_size == 4 * cfg.hidden_size
    with pytest.raises(ValueError, match="bert-120m"):
        model_config("bert-base", 1000)
    with pytest.raises(ValueError, match="hidden"):
        model_config("tiny", 1000, hiden_size=3)
    with pytest.raises(ValueError, match="num_heads"):
        model_config("tiny", 1000, num_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        model_config("tiny", 5)
    with pytest.raises(ValueError, match="intermediate_size"):
        BertMLM(model_config("tiny", 1000, intermediate_size=-1))
    with pytest.raises(ValueError, match="norm_eps"):
        BertMLM(model_config("tiny", 1000, norm_eps=0.0))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        BertMLM(tiny())(torch.zeros(1, 65, dtype=torch.long))


def test_bf16_autocast_keeps_an_fp32_loss_close_to_fp32():
    torch.manual_seed(12)
    model = BertMLM(tiny(activation_checkpointing=True)).train()
    ids, mask, labels = batch(seed=13)
    ref = model(ids, mask, labels).loss_sum
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, mask, labels)
    assert out.logits.dtype == torch.bfloat16 and out.loss_sum.dtype == torch.float32
    torch.testing.assert_close(out.loss_sum, ref, rtol=2e-2, atol=0)
    out.loss_sum.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_matches_fp32(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(14)
    model = BertMLM(tiny()).cuda().eval()
    ids, mask, labels = (t.cuda() for t in batch(seed=15))
    mask[0] = 0  # a fully padded row must stay finite in 16-bit
    with torch.no_grad():
        ref = model(ids, mask, labels).loss_sum
        with torch.autocast("cuda", dtype=dtype):
            out = model(ids, mask, labels)
    assert torch.isfinite(out.logits).all()
    torch.testing.assert_close(out.loss_sum, ref, rtol=2e-2, atol=0)


# --------------------------------------------------------------------------------------------
# Activation memory terms against closed forms and saved-tensor measurements
# --------------------------------------------------------------------------------------------


def saved_bytes(module, *args):
    """Bytes of the unique non-parameter storages autograd keeps for backward of module(*args)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    store = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            store[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args)
    return sum(store.values())


def test_activation_terms_reduce_to_korthikanti_for_bert():
    """bf16 on CUDA, eager attention, dropout on, f = 4h: the paper's 34·sbh + 5·a·s²·b per layer
    (arXiv:2205.05198 eq. 1) plus 4·sbh because autocast keeps the two LayerNorm inputs in fp32
    (2 x 2 bytes more than the paper's 2-byte inputs) and 16·sb of norm statistics."""
    cfg = model_config("bert-120m", 30522, sparse_head=False)  # dropout 0.1, a = 12, h = 768
    s, b, h, a, L = 512, 8, 768, 12, 12
    t = plan.activation_terms(cfg, s, b, precision="bf16", attention="eager", device="cuda")
    assert t["layers"] == L * ((34 + 4) * s * b * h + 16 * s * b)
    assert t["attention_scores"] == L * 5 * a * s * s * b
    flash = plan.activation_terms(cfg, s, b, precision="bf16", attention="flash", device="cuda")
    assert flash["layers"] == t["layers"] and flash["attention_scores"] == L * 4 * a * s * b  # selective recompute
    ckpt = plan.activation_terms(dataclasses.replace(cfg, activation_checkpointing=True), s, b)
    assert ckpt["layers"] == L * 4 * s * b * h and ckpt["attention_scores"] == 0  # full recompute: layer inputs


@pytest.mark.parametrize("overrides, attention", [
    ({}, "eager"),  # dropout on: CPU SDPA takes its math path and keeps the scores
    ({"hidden_dropout": 0.0, "attention_dropout": 0.0}, "flash"),
    ({"attention_dropout": 0.0, "norm_position": "pre", "position_embedding": "rotary"}, "flash"),
    ({"attention_dropout": 0.0, "activation": "geglu", "norm_type": "rmsnorm", "bias": False}, "flash"),
    ({"attention_dropout": 0.0, "attention": "sliding_window", "window_size": 32}, "flash"),
    ({"attention_dropout": 0.0, "attention": "linformer", "linformer_k": 32}, "flash"),
    ({"attention_dropout": 0.0, "attention": "linear"}, "flash"),
])
def test_activation_terms_per_layer_match_saved_tensors(overrides, attention):
    """One layer's planned bytes (``labkit.study.plan.activation_terms`` of a 1-layer model)
    against the storages autograd saves in that layer, for every attention family and option."""
    cfg = model_config("tiny", V, max_position_embeddings=64, sparse_head=False, **overrides)
    s, b = 64, 3
    layer = BertMLM(cfg).layers[0].train()
    x = torch.randn(b, s, cfg.hidden_size, requires_grad=True)
    rope = rotary_tables(torch.arange(s), cfg.head_dim, cfg.rope_theta) if "position_embedding" in overrides else None
    measured = saved_bytes(layer, x, None, rope)  # no padding: the model passes no mask (encoder.forward)
    one = plan.activation_terms(dataclasses.replace(cfg, num_layers=1), s, b, precision="fp32",
                                attention=attention, device="cpu")
    assert measured == pytest.approx(one["layers"] + one["attention_scores"], rel=0.03)


@pytest.mark.parametrize("overrides", [
    {},
    {"attention_dropout": 0.0, "norm_position": "pre", "position_embedding": "rotary", "activation": "swiglu",
     "intermediate_size": 170, "norm_type": "rmsnorm"},
])
def test_activation_terms_add_up_to_a_whole_dense_model(overrides):
    cfg = model_config("tiny", 300, max_position_embeddings=64, sparse_head=False, **overrides)
    s, b = 64, 3
    _, _, labels = batch(b, s, seed=16)
    model = BertMLM(cfg).train()
    measured = saved_bytes(model, torch.randint(5, 300, (b, s)), torch.ones(b, s, dtype=torch.long), labels)
    planned = plan.saved_activation_bytes(cfg, s, b, precision="fp32", device="cpu",
                                          attention="eager" if cfg.attention_dropout > 0 else "flash")
    assert measured == pytest.approx(planned, rel=0.03)


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------

OPTIONS = [
    {"norm_position": "pre"},
    {"norm_type": "rmsnorm"},
    {"init": "xavier"},
    {"init": "kaiming", "scale_residual_init": True},
    {"position_embedding": "rotary"},
    {"activation": "geglu"},
    {"activation": "swiglu", "intermediate_size": 170},
    {"bias": False},
    {"bias": False, "norm_type": "rmsnorm", "norm_position": "pre", "activation": "swiglu",
     "position_embedding": "rotary", "tie_embeddings": False},
    {"attention": "sliding_window", "window_size": 8, "global_every": 2},
    {"attention": "linformer", "linformer_k": 8},
    {"attention": "linear"},
]


@pytest.mark.parametrize("overrides", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_each_option_forward_backward_and_parameter_count(overrides):
    cfg = model_config("tiny", V, max_position_embeddings=64, **overrides)  # dropout on
    torch.manual_seed(17)
    model = BertMLM(cfg).train()
    assert count_parameters(model) == count_parameters(cfg)
    ids, mask, labels = batch(seed=18)
    out = model(ids, mask, labels)
    assert out.logits.shape == (int((labels != -100).sum()), V)
    assert out.loss_sum.item() / out.n_masked.item() == pytest.approx(math.log(V), rel=0.15)  # near-uniform at init
    out.loss_sum.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().amax() > 0, name


def test_pre_norm_with_zeroed_residual_branches_is_the_identity():
    model = BertMLM(tiny(norm_position="pre", sparse_head=False)).eval()
    with torch.no_grad():
        for layer in model.layers:
            for lin in (layer.attn_out, layer.ffn_out):
                lin.weight.zero_()
                lin.bias.zero_()
    ids, mask, _ = batch()
    captured = {}
    model.final_norm.register_forward_hook(lambda m, i, o: captured.update(x=i[0]))
    with torch.no_grad():
        model(ids, mask)
        emb = model.embed_norm(model.word(ids) + model.position.weight[:20] + model.token_type.weight[0])
    torch.testing.assert_close(captured["x"], emb)  # x = x + 0 through every layer
    assert model.final_norm is not None and BertMLM(tiny()).final_norm is None


def test_rmsnorm_gives_unit_rms():
    model = BertMLM(tiny(norm_type="rmsnorm", norm_eps=1e-6))
    assert isinstance(model.embed_norm, torch.nn.RMSNorm) and isinstance(model.layers[0].ffn_norm, torch.nn.RMSNorm)
    x = torch.randn(5, 64) * 3 + 1
    y = model.embed_norm(x)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(5), atol=1e-4, rtol=0)
    torch.testing.assert_close(y, x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())


@pytest.mark.parametrize("activation, act", [("geglu", torch.nn.functional.gelu), ("swiglu", torch.nn.functional.silu)])
def test_gated_ffn_is_act_of_gate_times_value(activation, act):
    layer = BertMLM(tiny(activation=activation, intermediate_size=48)).layers[0]
    assert layer.ffn_in.weight.shape == (2, 48, 64) and layer.ffn_out.weight.shape == (64, 48)  # [W, V] stacked
    x = torch.randn(3, 64)
    w, b = layer.ffn_in.weight, layer.ffn_in.bias
    ref = (act(x @ w[0].T + b[0]) * (x @ w[1].T + b[1])) @ layer.ffn_out.weight.T + layer.ffn_out.bias
    torch.testing.assert_close(layer.ffn(x), ref)


def test_bias_off_leaves_no_bias_anywhere():
    model = BertMLM(tiny(bias=False))
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if "bias" in n] and model.decoder_bias is None
    with_bias = count_parameters(tiny())["total"] - count_parameters(tiny(bias=False))["total"]
    h, f, layers = 64, 256, 2
    assert with_bias == layers * (3 * h + h + f + h + 2 * h) + h + h + h + V  # linears, norms; embed, head, decoder


@pytest.mark.parametrize("init, std", [("normal", 0.02), ("xavier", math.sqrt(2 / (64 + 256))),
                                       ("kaiming", math.sqrt(2 / 64))])
def test_init_schemes_and_depth_scaling(init, std):
    cfg = model_config("tiny", 2000, hidden_size=64, num_layers=8, intermediate_size=256, init=init)
    torch.manual_seed(19)
    model = BertMLM(cfg)
    w = model.layers[0].ffn_in.weight  # [256, 64]
    assert w.std().item() == pytest.approx(std, rel=0.05)
    torch.manual_seed(19)
    scaled = BertMLM(dataclasses.replace(cfg, scale_residual_init=True))
    torch.testing.assert_close(scaled.layers[3].ffn_out.weight, model.layers[3].ffn_out.weight / 4.0)  # 1/sqrt(2*8)
    torch.testing.assert_close(scaled.layers[3].attn_out.weight, model.layers[3].attn_out.weight / 4.0)
    torch.testing.assert_close(scaled.layers[3].ffn_in.weight, model.layers[3].ffn_in.weight)
    assert model.word.weight[1:].std().item() == pytest.approx(0.02, rel=0.05)  # embeddings always normal


def test_dropout_is_random_in_training_only():
    torch.manual_seed(20)
    drop = BertMLM(model_config("tiny", V, max_position_embeddings=64, hidden_dropout=0.2, attention_dropout=0.2))
    still = BertMLM(tiny())
    still.load_state_dict(drop.state_dict())
    ids, mask, labels = batch(seed=21)
    drop.train()
    a, b = drop(ids, mask, labels).loss_sum, drop(ids, mask, labels).loss_sum
    assert abs(a.item() - b.item()) > 1e-3
    drop.eval()
    ref = drop(ids, mask, labels).loss_sum
    assert drop(ids, mask, labels).loss_sum.item() == ref.item()
    torch.testing.assert_close(still.train()(ids, mask, labels).loss_sum, ref)  # p = 0 in training = eval


def test_rotary_model_uses_order_and_has_no_position_table():
    torch.manual_seed(22)
    model = BertMLM(tiny(position_embedding="rotary", sparse_head=False)).eval()
    assert model.position is None
    with torch.no_grad():
        for layer in model.layers:
            layer.qkv.weight.mul_(20)  # sharp attention, so where a key sits matters
    no_positions = BertMLM(tiny(sparse_head=False)).eval()
    missing, _ = no_positions.load_state_dict(model.state_dict(), strict=False)
    assert missing == ["position.weight"]
    with torch.no_grad():
        no_positions.position.weight.zero_()
    ids = torch.randint(5, V, (1, 16), generator=torch.Generator().manual_seed(23))
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(24))
    with torch.no_grad():
        a, b = no_positions(ids).logits[0, perm], no_positions(ids[:, perm]).logits[0]
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # no positions: permutation-equivariant
        a, b = model(ids).logits[0, perm], model(ids[:, perm]).logits[0]
    assert (a - b).abs().amax() > 1e-2  # rotary: order matters


def test_hf_interop_refuses_options_bert_lacks():
    for overrides, field in [({"norm_position": "pre"}, "norm_position"), ({"bias": False}, "bias"),
                             ({"attention": "linear"}, "attention"), ({"position_embedding": "rotary"}, "position")]:
        cfg = tiny(**overrides)
        with pytest.raises(ValueError, match=field):
            hf_config(cfg)
        with pytest.raises(ValueError, match=field):
            to_hf_state_dict(BertMLM(cfg))


@pytest.mark.parametrize("field, value, allowed", [
    ("norm_position", "middle", "'post', 'pre'"), ("norm_type", "batchnorm", "'layernorm', 'rmsnorm'"),
    ("init", "orthogonal", "'normal', 'xavier', 'kaiming'"), ("position_embedding", "alibi", "'absolute', 'rotary'"),
    ("activation", "relu", "'gelu', 'geglu', 'swiglu'"), ("num_heads", 3, "divisors of hidden_size"),
    ("vocab_size", 5, "special tokens"), ("global_every", -1, ">= 0"), ("linformer_k", 0, "max_position_embeddings"),
])
def test_bad_options_name_the_field_and_allowed_values(field, value, allowed):
    with pytest.raises(ValueError, match=f"^{field}:.*{allowed}"):
        if field == "vocab_size":
            model_config("tiny", value)
        else:
            model_config("tiny", V, **{field: value})


# --------------------------------------------------------------------------------------------
# Layouts and split points that model parallelism relies on (labkit.train.parallel)
# --------------------------------------------------------------------------------------------


def test_fused_linear_is_nn_linear_on_the_same_memory():
    """FusedLinear's flattened weight is the [parts·out, in] matrix nn.Linear holds: the same seed
    gives the same weights, the forward is bit-equal, and a Linear's flat state dict loads."""
    from labkit.model.encoder import FusedLinear

    torch.manual_seed(30)
    ref = torch.nn.Linear(64, 3 * 32)
    torch.manual_seed(30)
    fused = FusedLinear(64, 32, 3, bias=True)
    assert fused.weight.shape == (3, 32, 64) and fused.bias.shape == (3, 32)
    assert torch.equal(fused.weight.flatten(0, 1), ref.weight) and torch.equal(fused.bias.flatten(), ref.bias)
    x = torch.randn(5, 64)
    assert torch.equal(fused(x), ref(x))
    other = FusedLinear(64, 32, 3, bias=True)
    other.load_state_dict(ref.state_dict())  # [96, 64] / [96] through the pre-hook
    assert torch.equal(other.weight, fused.weight) and torch.equal(other.bias, fused.bias)


@pytest.mark.parametrize("overrides", [{}, {"activation": "swiglu", "norm_position": "pre"}])
def test_flat_fused_checkpoints_load_into_the_stacked_layout(overrides):
    """A state dict in the layout before the stacked one (qkv [3H, H], gated ffn_in [2F, H]) loads
    into the model and gives bit-equal logits."""
    torch.manual_seed(31)
    model = BertMLM(tiny(**overrides)).eval()
    flat = {k: (v.flatten(0, 1) if k.endswith((".qkv.weight", ".qkv.bias")) or (
        k.endswith((".ffn_in.weight", ".ffn_in.bias")) and v.ndim > (1 if k.endswith("bias") else 2)) else v)
        for k, v in model.state_dict().items()}
    assert flat["layers.0.qkv.weight"].shape == (192, 64)
    back = BertMLM(tiny(**overrides)).eval()
    back.load_state_dict(flat)
    ids, mask, labels = batch(seed=32)
    with torch.no_grad():
        assert torch.equal(back(ids, mask, labels).logits, model(ids, mask, labels).logits)


def test_split_points_compose_to_the_forward():
    """embed -> encode (in two ranges, as two pipeline stages) -> head_loss is the forward, bit for bit."""
    torch.manual_seed(33)
    model = BertMLM(tiny(num_layers=3)).eval()
    ids, mask, labels = batch(seed=34)
    with torch.no_grad():
        ref = model(ids, mask, labels)
        ctx = model.context(ids.shape, mask, labels, device=ids.device)
        x = model.encode(model.embed(ids), ctx, range(0, 2))
        assert x.shape == (3, 20, 64)
        out = model.head_loss(model.encode(x, ctx, range(2, 3)), ctx, labels)
    assert torch.equal(out.loss_sum, ref.loss_sum) and torch.equal(out.logits, ref.logits)
    assert int(out.n_masked) == int((labels != -100).sum())


def test_a_layer_runs_on_a_slice_of_its_heads():
    """Local heads: two layers holding heads 0-1 and 2-3 of one 4-head layer (QKV rows of dim 1,
    attention-output columns) give attention outputs that sum to the whole layer's."""
    cfg = tiny(num_heads=4)
    torch.manual_seed(35)
    whole = BertMLM(cfg).layers[0].eval()
    halves = [BertMLM(cfg).layers[0].eval() for _ in range(2)]
    outs = {}
    for name, layer in [("whole", whole), ("a", halves[0]), ("b", halves[1])]:
        layer.attn_out.register_forward_hook(lambda m, i, o, name=name: outs.update({name: o}))
    with torch.no_grad():
        for k, layer in enumerate(halves):
            cols = slice(32 * k, 32 * (k + 1))
            layer.qkv.weight = torch.nn.Parameter(whole.qkv.weight[:, cols].clone())
            layer.qkv.bias = torch.nn.Parameter(whole.qkv.bias[:, cols].clone())
            layer.attn_out.weight = torch.nn.Parameter(whole.attn_out.weight[:, cols].clone())
            layer.attn_out.bias.copy_(whole.attn_out.bias if k == 0 else torch.zeros(64))
        x = torch.randn(2, 12, 64)
        for layer in (whole, *halves):
            layer(x, None)
    torch.testing.assert_close(outs["a"] + outs["b"], outs["whole"], atol=1e-6, rtol=0)
