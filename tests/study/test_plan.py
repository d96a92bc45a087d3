"""Tests of labkit/study/plan.py: the formulas against the count, the micro-batch search, the planner."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.model import BertMLM, model_config
from labkit.study import gpu, parallel, plan
from labkit.study.counting import count_steps
from labkit.study.memory import activation_bytes, labkit_model

SEQ = 32


pytestmark = pytest.mark.torch_threads(1)


def _cfg(**kw):
    return model_config("tiny", 128, **kw)


# ---------------------------------------------------------------------------------------------
# the analytic planner
# ---------------------------------------------------------------------------------------------


def test_planner_terms_against_hand_computed_values():
    # tiny: L 2, h 64, a 2, f 256, V 1024; s 32, b 2; bf16 autocast on CUDA, fused attention,
    # dense head (every layer full, head at all s b = 64 positions)
    dense = model_config("tiny", 1024, sparse_head=False)
    t = plan.activation_terms(dense, 32, 2, precision="bf16", attention="flash", device="cuda")
    sbh = 32 * 2 * 64  # 4096
    # per layer: (6 d + 2 g + 2 m) sbh + 2 d sbf + 16 sb with d 2, g 4, m 1 = 22 sbh + 4 * 32*2*256 + 16*64
    assert t["layers"] == 2 * (22 * 4096 + 65536 + 1024) == 313344
    assert t["attention_scores"] == 2 * 4 * 2 * 32 * 2 == 1024  # log-sum-exp, fp32, a s b per layer
    assert t["embedding"] == 8 * 64 + 8 * 32 + 5 * sbh + 8 * 64 == 21760
    # dense input, GELU input, decoder input 3 d nh; the head norm's input in fp32 (CUDA's autocast) 4 nh;
    # log-softmax 4 nV; norm stats + targets 16 n; total weight 4
    assert t["head"] == (3 * 2 + 4) * 64 * 64 + 4 * 64 * 1024 + 16 * 64 + 4 == 304132
    # Korthikanti et al. (arXiv:2205.05198 eq. 2): 34 sbh + 5 a s^2 b per layer in 16-bit with
    # 1-byte masks; this model adds fp32 LayerNorm inputs under autocast (+4 sbh) and norm stats
    eager = plan.activation_terms(dense, 32, 2, precision="bf16", attention="eager", device="cuda")
    korthikanti = 34 * sbh + 5 * 2 * 32 * 32 * 2
    assert eager["layers"] + eager["attention_scores"] == 2 * (korthikanti + 4 * sbh + 16 * 64)
    # sparse head (the default): round(0.15 * 32) = 5 masked positions per sequence -> q = 10 rows
    cfg = model_config("tiny", 1024)
    sp = plan.activation_terms(cfg, 32, 2, precision="bf16", attention="flash", device="cuda")
    full = 22 * 4096 + 65536  # layer 0 as above, without its norm statistics
    # last layer: fp32 input (gathered) g sbh, its bf16 copy (QKV input) d sbh, fused QKV 3 d sbh;
    # (2 d + 2 g + 2 m) qh + 2 d qf; gathered Q + SDPA output 2 d qh
    last = 12 * sbh + 14 * 10 * 64 + 4 * 10 * 256 + 4 * 10 * 64
    assert sp["layers"] == full + last + 16 * 64 + 16 * 10 + 8 * 64 == 228256  # + stats, gather index
    assert sp["attention_scores"] == 4 * 2 * 32 * 2 + 4 * 2 * 10 == 592
    assert sp["head"] == (3 * 2 + 4) * 10 * 64 + 4 * 10 * 1024 + 16 * 10 + 4 + 10 == 47534  # + valid mask
    assert sp["logits"] == 2 * 10 * 1024 == 20480
    # full recompute keeps the layer input only (fp32 residual stream), and the gather index
    ckpt = plan.activation_terms(model_config("tiny", 1024, activation_checkpointing=True), 32, 2)
    assert ckpt["layers"] == 2 * 4 * sbh + 8 * 64 and ckpt["attention_scores"] == 0
    # tensor + sequence parallel divides the layer terms (not the statistics and indices)
    tp_sp = plan.activation_terms(dense, 32, 2, tp=2, sequence_parallel=True)
    assert tp_sp["layers"] == 2 * (22 * 4096 + 65536) // 2 + 2 * 1024
    # tensor parallelism alone leaves the residual stream whole: QKV and FFN inputs 2 d, norm inputs
    # 2 g, masks 2 m = 14 sbh per layer; the fused QKV, output-projection input and GELU are split
    tp = plan.activation_terms(dense, 32, 2, tp=2)
    assert tp["layers"] == 2 * 14 * 4096 + 2 * (8 * 4096 + 65536) // 2 + 2 * 1024
    assert plan.activation_terms(dense, 32, 2, tp=2, sequence_parallel=False) == tp  # the default, as TrainConfig's
    # Korthikanti et al. (arXiv:2205.05198 eq. 3, tensor parallel alone): sbh (10 + 24/t) + 5 a s^2 b / t,
    # with this model's fp32 norm inputs (+4 sbh, whole) and norm stats
    eager_tp = plan.activation_terms(dense, 32, 2, precision="bf16", attention="eager", device="cuda", tp=2)
    assert eager_tp["layers"] + eager_tp["attention_scores"] == 2 * ((10 + 4 + 24 // 2) * sbh
                                                                     + 5 * 2 * 32 * 32 * 2 // 2 + 16 * 64)
    ckpt_tp = dict(tp=2, precision="bf16", device="cuda")  # recompute keeps each layer's input: split only with sp
    ckpt_dense = model_config("tiny", 1024, activation_checkpointing=True, sparse_head=False)
    assert plan.activation_terms(ckpt_dense, 32, 2, **ckpt_tp)["layers"] == 2 * 4 * sbh
    assert plan.activation_terms(ckpt_dense, 32, 2, sequence_parallel=True, **ckpt_tp)["layers"] == 4 * sbh
    with pytest.raises(ValueError, match="precision"):
        plan.activation_terms(cfg, 32, 2, precision="int8")


STUDY = {"position_embedding": "instruction", "type_vocab_size": 0, "norm_position": "pre", "final_norm": False,
         "attention_backend": "eager", "attention_dropout": 0.0, "attention_output_dropout": False,
         "block_norm_eps": 1e-5, "tie_embeddings": False}  # configs/study.toml's model options
OPTIONS = [{}, {"norm_position": "pre"}, {"norm_type": "rmsnorm"}, {"position_embedding": "rotary"},
           {"activation": "geglu"}, {"activation": "swiglu", "intermediate_size": 170}, {"bias": False},
           {"tie_embeddings": False}, {"activation_checkpointing": True},
           {"attention": "sliding_window", "window_size": 15, "global_every": 2},
           {"attention": "linformer", "linformer_k": 16}, {"attention": "linear"},
           {"norm_position": "pre", "norm_type": "rmsnorm", "position_embedding": "rotary", "activation": "swiglu"},
           STUDY, STUDY | {"attention_dropout": 0.1}]
MODES = [("cpu", "fp32", {}), ("cpu", "fp32", {"hidden_dropout": 0.0, "attention_dropout": 0.0}),
         ("cuda", "bf16", {}), ("cuda", "fp32", {})]


@pytest.mark.parametrize("overrides", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "bert")
def test_formula_equals_the_count_for_every_option(overrides):
    """``activation_terms`` explains the count exactly: every option, both heads, on CPU (fp32,
    SDPA's math path with attention dropout, its fused kernel without) and as CUDA keeps it
    (CudaLike, bf16 and fp32), at b = 2 and 3; autocast's weight copies are memory_plan's own term."""
    for sparse in (True, False):
        for device, precision, extra in MODES:
            cfg = model_config("tiny", 512, sparse_head=sparse, **{**overrides, **extra})
            run = count_steps(*labkit_model(cfg, 64), (2, 3), precision=precision, cuda=device == "cuda")
            eager = cfg.attention_backend == "eager" or (device == "cpu" and cfg.attention_dropout > 0)
            attention = "eager" if eager else "flash"
            for b, c in run["counts"].items():
                want = plan.saved_activation_bytes(cfg, 64, b, precision=precision, attention=attention, device=device)
                assert c["saved_bytes"] - c["param_cast_bytes"] == want, (sparse, device, precision, extra, b)


def test_formula_at_micro_batch_1_on_cpu():
    """b = 1 takes other CPU kernel paths (the math path saves the fused QKV storage for V); the
    formula models it, held to 5 %."""
    for kw in ({}, {"sparse_head": False}):
        cfg = _cfg(**kw)
        assert plan.saved_activation_bytes(cfg, 32, 1, precision="fp32", attention="eager", device="cpu") == \
            pytest.approx(activation_bytes(cfg, 32, 1), rel=0.05)


def test_zero_stages_match_the_paper_example():
    # ZeRO (arXiv:1910.02054) figure 1: 7.5B parameters, N_d = 64, mixed-precision Adam (K = 12)
    gb = [plan.zero_state_bytes(7.5e9, zero_stage=z, dp=64, layout=(2, 2, 12))["total"] / 1e9 for z in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)
    s2 = plan.zero_state_bytes(1e9, zero_stage=2, dp=8)
    assert (s2["params"], s2["grads"], s2["optimizer"]) == (4e9, 4e9 / 8, 8e9 / 8)
    with pytest.raises(ValueError, match="zero_stage"):
        plan.zero_state_bytes(1e9, zero_stage=4)


def test_memory_plan_adds_up_and_matches_state_bytes():
    cfg = model_config("bert-120m", 30522)
    p = plan.memory_plan(cfg, seq_len=128, micro_batch=8, precision="fp32", attention="eager")
    terms = ("params", "grads", "optimizer", "autocast_copies", "activations", "logits", "head_backward")
    assert p["total"] == sum(p[k] for k in terms)
    assert p["params"] + p["grads"] + p["optimizer"] == 16 * plan.count_parameters(cfg)["total"]
    assert p["autocast_copies"] == 0 and p["bubble"] == 0
    assert plan.memory_plan(cfg, seq_len=128, micro_batch=8)["autocast_copies"] == 2 * plan.count_parameters(cfg)["total"]
    # checkpointing: the layer inputs plus one layer's full activations during its recompute
    ck = model_config("bert-120m", 30522, activation_checkpointing=True)
    t_ck, t_full = plan.activation_terms(ck, 128, 8), plan.activation_terms(cfg, 128, 8)
    got = plan.memory_plan(ck, seq_len=128, micro_batch=8)["activations"]
    want = t_ck["layers"] + (t_full["layers"] + t_full["attention_scores"]) / 12 + t_ck["embedding"] + t_ck["head"]
    assert got == int(want)


def test_pipeline_bubble_and_first_fitting_split():
    assert plan.pipeline_bubble(1, 8) == 0
    assert plan.pipeline_bubble(4, 8) == pytest.approx(3 / 11)
    assert plan.pipeline_bubble(8, 1) == pytest.approx(7 / 8)
    # 48 layers of width 6144 (~22B parameters): 350 GB of model state, more than any one GPU
    big = model_config("bert-1.3b", 45000, hidden_size=6144, num_heads=48, num_layers=48, intermediate_size=None)
    plans = parallel.parallel_plans(big, n_gpus=16, seq_len=512, micro_batch=4, device="H100 NVL")
    ddp = plans.filter((plans["tp"] == 1) & (plans["pp"] == 1) & (plans["zero_stage"] == 0)).row(0, named=True)
    assert not ddp["fits"]
    fit = parallel.first_fit(plans)
    assert fit is not None and fit["fits"] and fit["tp"] <= 2
    before = plans.head(plans.with_row_index().filter(
        (plans["dp"] == fit["dp"]) & (plans["tp"] == fit["tp"]) & (plans["pp"] == fit["pp"])
        & (plans["zero_stage"] == fit["zero_stage"]))["index"][0])
    assert not before.filter(before["tp_within_node"])["fits"].any()  # nothing earlier fits


def test_study_table_lists_reported_micro_batches():
    t = parallel.study_table(seq_lens=(512,), precisions=("bf16",))
    assert set(t["study"].to_list()) == {184, 20}
    assert t.height == 2 * 2 * 2
    assert (t["planned"] > 0).all()
    info = plan.device_info("H100 NVL")
    assert info["memory_bytes"] == 94e9 and info["peak_flops"] == 835.5e12
    with pytest.raises(ValueError, match="device"):
        plan.device_info("V100")


@pytest.mark.gpu
def test_gpu_memory_check():
    rows = gpu.gpu_memory_check()
    assert all(r["ok"] for r in rows), rows


def _recorded(fits):
    tried: list[int] = []

    def wrapped(b: int) -> bool:
        tried.append(b)
        return fits(b)
    return wrapped, tried


@pytest.mark.parametrize("limit", [1, 7, 64, 1000])
@pytest.mark.parametrize("start", [1, 5, 2000])
def test_largest_fitting_finds_every_threshold(limit, start):
    for threshold in range(0, 130):
        fits, tried = _recorded(lambda b: b <= threshold)
        got = plan.largest_fitting(fits, limit=limit, start=start)
        assert got == min(threshold, limit), (threshold, limit, start)
        assert len(tried) == len(set(tried))  # never retries a size
        assert len(tried) <= 2 * math.ceil(math.log2(limit + 1)) + 3


def test_largest_fitting_tries_doubling_then_bisection():
    fits, tried = _recorded(lambda b: b <= 37)
    assert plan.largest_fitting(fits, limit=4096) == 37
    assert tried == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    fits, tried = _recorded(lambda b: b <= 37)  # an exact guess costs two tries
    assert plan.largest_fitting(fits, limit=4096, start=37) == 37 and tried == [37, 38]
    with pytest.raises(ValueError, match="limit"):
        plan.largest_fitting(lambda b: True, limit=0)
