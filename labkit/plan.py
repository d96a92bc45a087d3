"""Memory planning: how large a micro-batch fits in a per-rank memory budget.

Two halves. The first measures (CPU, exact): ``activation_bytes``, ``model_state_bytes``,
``max_micro_batch``. The second plans from formulas, for sizes and devices no CPU can measure:
``activation_terms`` (Korthikanti et al. arXiv:2205.05198, written for labkit's model and
checked exactly against the measurement), ``zero_state_bytes`` (ZeRO arXiv:1910.02054),
``memory_plan`` (one GPU under DP x TP x PP and ZeRO 0-3, with the GPipe bubble),
``planned_max_micro_batch`` on a ``DEVICES`` entry, ``study_table`` (the study's reported
micro-batches beside the plan), ``parallel_plans`` / ``first_fit``, and ``gpu_memory_check``
(plan vs ``torch.cuda.max_memory_allocated``, for benchmarks/gpu_check.sh).

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

import dataclasses
import math
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


# --------------------------------------------------------------------------------------------
# The analytic planner: memory per GPU from formulas, for sizes no CPU can measure
# --------------------------------------------------------------------------------------------

DEVICES: dict[str, dict[str, Any]] = {
    "H100 SXM": {"memory_gb": 80, "bandwidth_tb_s": 3.35, "peak_kind": "H100 SXM",
                 "source": "https://www.nvidia.com/en-us/data-center/h100/ (80 GB HBM3, 3.35 TB/s)"},
    "H100 NVL": {"memory_gb": 94, "bandwidth_tb_s": 3.9, "peak_kind": "H100 NVL",
                 "source": "https://www.nvidia.com/en-us/data-center/h100/ (H100 NVL: 94 GB HBM3, 3.9 TB/s)"},
    "H200": {"memory_gb": 141, "bandwidth_tb_s": 4.8, "peak_kind": "H200",
             "source": "https://www.nvidia.com/en-us/data-center/h200/ (141 GB HBM3e, 4.8 TB/s)"},
    "A100 40GB": {"memory_gb": 40, "bandwidth_tb_s": 1.6, "peak_kind": "A100",
                  "source": "https://www.nvidia.com/en-us/data-center/a100/ (40 GB HBM2, 1.6 TB/s)"},
    "A100 80GB": {"memory_gb": 80, "bandwidth_tb_s": 2.0, "peak_kind": "A100",
                  "source": "https://www.nvidia.com/en-us/data-center/a100/ (80 GB HBM2e, 2.0 TB/s)"},
}
"""GPU memory (NVIDIA's nominal GB, taken as 1e9 bytes: the conservative reading) and memory
bandwidth with the page they come from; dense bf16 peaks are ``labkit.measure.PEAK_FLOPS``
under ``peak_kind`` (REFERENCES.md C2)."""

STUDY_MICRO_BATCH = {"bert-120m": 184, "bert-350m": 20}
"""Per-GPU micro-batches the study reports on H100 NVL (arXiv:2509.05258; REFERENCES.md A,
unconfirmed against the full text). Sequence length, vocabulary and precision are not reported."""

STUDY_VOCAB = 45_000
"""(derived) The vocabulary at which BERT-Base/Large shapes have 120.6M and 350.0M parameters
(``count_parameters``), i.e. the study's two names; the study does not give its vocabulary."""

PRECISIONS = ("fp32", "bf16", "fp16")
ATTENTION = ("flash", "eager")


def device_info(name: str) -> dict[str, Any]:
    """``DEVICES[name]`` plus memory_bytes and peak_flops (bf16, from measure.PEAK_FLOPS).
    Raises ValueError listing the known devices."""
    from labkit.measure import PEAK_FLOPS

    if name not in DEVICES:
        raise ValueError(f"device: unknown {name!r}; known devices are {sorted(DEVICES)}")
    d = DEVICES[name]
    return {"device": name, **d, "memory_bytes": int(d["memory_gb"] * 1e9),
            "peak_flops": PEAK_FLOPS.get((d["peak_kind"], "bf16"))}


def _check_options(precision: str, attention: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: got {precision!r}; allowed values are {PRECISIONS}")
    if attention not in ATTENTION:
        raise ValueError(f"attention: got {attention!r}; allowed values are {ATTENTION}")


def activation_terms(cfg: ModelConfig, seq_len: int, micro_batch: int, *, precision: str = "bf16",
                     attention: str = "flash", device: str = "cuda", tp: int = 1,
                     mlm_probability: float = 0.15) -> dict[str, int]:
    """Bytes kept for backward by ``BertMLM(cfg)`` at one micro-batch, term by term.

    After Korthikanti et al. 2022 (arXiv:2205.05198, section 4.1), written for this model
    (post-norm, fused QKV, SDPA, GELU, dropout, and with ``cfg.sparse_head`` a last layer that
    runs its queries only at the masked positions). s = seq_len, b = micro_batch, h = hidden,
    a = heads, f = ffn width, V = vocabulary. d = bytes of the compute dtype (fp32 4; bf16/fp16 2
    under autocast with fp32 weights), m = dropout-mask bytes (1 on CUDA, d on CPU; 0 without
    dropout), g = LayerNorm input bytes (4: autocast runs LayerNorm in fp32 and the residual
    stream stays fp32). With the sparse head and labels the last layer has q = b·k query rows,
    k = max(1, round(p·s)) (the most masked positions in a row; exact for the synthetic batch of
    ``_saved_bytes``, which masks k per row). Terms:

    - ``layers``, every layer but a sparse last one: QKV input, the fused Q/K/V (one storage) and
      output-projection input 5·d·sbh, FFN input d·sbh, GELU input and output 2·d·sbf, two
      LayerNorm inputs 2·g·sbh, two dropout masks 2·m·sbh, norm mean/rstd 16·sb. For d = 2,
      m = 1, g = 2, f = 4h this is the paper's 34·sbh. (SDPA's math path saves its own copies
      of Q, K, V instead of the fused storage: the same 3·d·sbh.)
    - the sparse last layer (model.py ``Layer.forward`` with ``select``; measured on CPU, not
      from the paper): the layer input d·sbh and the whole fused QKV output 3·d·sbh (the two
      ``gather`` calls save their sources), the gather index 8·sb (``select`` is a slice of the
      [b, s] int64 sort indices, which stay alive whole), then at q rows: output-projection
      input, FFN input 2·d·qh, GELU 2·d·qf, norm inputs 2·g·qh, masks 2·m·qh, norm statistics
      16·q; and its attention: "flash" keeps the gathered Q and the SDPA output 2·d·qh (a
      separate storage from the output-projection input here, as the output follows Q's
      layout); "eager" keeps a Q copy d·qh and K, V copies of all s positions 2·d·sbh.
    - ``attention_scores``: "flash" (fused kernels, the paper's selective recompute; on CPU the
      fused path runs when attention dropout is off, as the model passes no mask for a batch
      without padding) keeps the log-sum-exp, 4·a·s·b per layer (4·a·q for the sparse last
      layer). "eager" (SDPA's math path, which CPU takes when attention dropout is on) keeps
      softmax output, dropout mask and dropped probabilities (2d + m)·a·s²·b, d·a·s²·b without
      attention dropout: the paper's 5·a·s²·b; the sparse last layer a·q·s instead of a·s²·b.
      (Measured on CPU, math path at b = 1: V's reshape is a view, so the whole fused QKV
      storage is saved instead of a V copy, +2·d·sh per full layer; in the sparse last layer
      that storage is already counted and the V copy is gone, -d·sh. Counted in ``layers``.)
    - with ``cfg.activation_checkpointing``: each layer's input g·sbh (no scores), plus the
      gather index 8·sb with the sparse head (``checkpoint`` saves ``select`` as an input).
    - ``embedding``: token and position ids (8·sb + 8·s), norm input g·sbh and statistics 8·sb,
      dropout mask m·sbh.
    - ``head`` at n positions (n = q with ``cfg.sparse_head``, else s·b): dense input, GELU
      input/output, decoder input 4·d·nh, head-norm statistics 8·n, fp32 log-softmax 4·nV,
      target indices 8·n, the loss's 4-byte total weight; with the sparse head also the bool
      ``valid`` mask that picks the real rows, q bytes.
    - ``logits`` (held by the returned output, not saved): d·nV.

    ``tp`` > 1 divides the activation terms that scale with h, f or V by t (tensor + sequence
    parallel, arXiv:2205.05198 section 4.2.2); index and statistics terms are not divided. The
    same terms serve device="cuda" (only m and the b = 1 math-path correction differ), where the
    sparse last layer is likewise modelled as the gathers and SDPA save it. Checked exactly
    against saved-tensor counts on CPU (fp32) in tests/test_plan.py and
    benchmarks/bench_planner.py. ``labkit.model.activation_bytes_per_layer`` /
    ``activation_bytes_outside_layers`` are the paper-level estimate (no norm statistics, no
    sparse last layer); this function is the one checked exactly. Raises ValueError for unknown
    precision/attention or non-positive sizes.
    """
    _check_options(precision, attention)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device: must be 'cuda' or 'cpu', got {device!r}")
    if seq_len < 1 or micro_batch < 1 or tp < 1:
        raise ValueError(f"seq_len/micro_batch/tp: must be positive, got {seq_len}/{micro_batch}/{tp}")
    s, b, h, a, f, v, L = seq_len, micro_batch, cfg.hidden_size, cfg.num_heads, cfg.ffn_size, cfg.vocab_size, cfg.num_layers
    d = 4 if precision == "fp32" else 2
    m = (1 if device == "cuda" else d) if cfg.hidden_dropout > 0 else 0
    ma = 1 if device == "cuda" else d
    g = 4
    sbh = s * b * h
    sparse = cfg.sparse_head
    q = max(1, round(mlm_probability * s)) * b if sparse else 0  # query rows of the sparse last layer
    index = 8 * s * b if sparse else 0  # [b, s] int64 sort indices behind ``select``
    eager = attention == "eager"
    cpu_math_b1 = device == "cpu" and b == 1 and eager and cfg.attention_dropout > 0
    per_score = (2 * d + ma) if cfg.attention_dropout > 0 else d  # bytes per eager score element
    full_layer = (6 * d + 2 * g + 2 * m) * sbh + 2 * d * s * b * f + 2 * d * sbh * cpu_math_b1
    full_scores = a * s * s * b * per_score if eager else 4 * a * s * b
    if cfg.activation_checkpointing:
        layers, scores = L * g * sbh // tp + index, 0
    elif not sparse:
        layers = L * full_layer // tp + L * 16 * s * b
        scores = L * full_scores // tp
    else:
        last = 4 * d * sbh + (2 * d + 2 * g + 2 * m) * q * h + 2 * d * q * f
        last += (d * q * h + 2 * d * sbh - d * s * h * cpu_math_b1) if eager else 2 * d * q * h
        layers = ((L - 1) * full_layer + last) // tp + (L - 1) * 16 * s * b + 16 * q + index
        scores = ((L - 1) * full_scores + (a * q * s * per_score if eager else 4 * a * q)) // tp
    n = q if sparse else s * b
    embedding = 8 * s * b + 8 * s + (g + m) * sbh + 8 * s * b
    head = (4 * d * n * h + 4 * n * v) // tp + 16 * n + 4 + (n if sparse else 0)
    return {"layers": int(layers), "attention_scores": int(scores), "embedding": int(embedding),
            "head": int(head), "logits": int(d * n * v // tp)}


def saved_activation_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, **kw) -> int:
    """Planned bytes saved for backward (all ``activation_terms`` except the held logits): the
    quantity ``activation_bytes`` measures."""
    t = activation_terms(cfg, seq_len, micro_batch, **kw)
    return t["layers"] + t["attention_scores"] + t["embedding"] + t["head"]


def zero_state_bytes(n_params: float, *, zero_stage: int = 0, dp: int = 1,
                     layout: tuple[float, float, float] = (4, 4, 8)) -> dict[str, float]:
    """Model-state bytes per GPU under ZeRO (Rajbhandari et al., arXiv:1910.02054, section 5.1,
    figure 1): ``layout`` = bytes per parameter of (parameters, gradients, optimizer states).
    Stage 1 shards the optimizer states over ``dp`` ranks, stage 2 also the gradients, stage 3
    also the parameters. The paper's mixed-precision Adam is (2, 2, 12): 16 Psi for DDP,
    4 Psi + 12 Psi/N_d, 2 Psi + 14 Psi/N_d, 16 Psi/N_d. labkit trains with fp32 weights under
    autocast and AdamW: (4, 4, 8), also 16 B/param. Returns {"params", "grads", "optimizer",
    "total"}. Raises ValueError for a stage outside 0-3 or dp < 1."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage: must be 0, 1, 2 or 3, got {zero_stage}")
    if dp < 1:
        raise ValueError(f"dp: must be >= 1, got {dp}")
    p, g, o = (x * n_params for x in layout)
    out = {"params": p / dp if zero_stage >= 3 else p, "grads": g / dp if zero_stage >= 2 else g,
           "optimizer": o / dp if zero_stage >= 1 else o}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def _params_per_gpu(cfg: ModelConfig, tp: int, pp: int) -> float:
    """Parameters one GPU holds: its pipeline stage's layers (ceil(L/pp)) plus the embeddings
    and head (worst stage), divided over tp tensor-parallel ranks."""
    total = count_parameters(cfg)["total"]
    per_layer = count_parameters(dataclasses.replace(cfg, num_layers=2))["total"] - \
        count_parameters(dataclasses.replace(cfg, num_layers=1))["total"]
    other = total - cfg.num_layers * per_layer
    return (math.ceil(cfg.num_layers / pp) * per_layer + other) / tp


def memory_plan(cfg: ModelConfig, *, seq_len: int, micro_batch: int, precision: str = "bf16",
                attention: str = "flash", zero_stage: int = 0, dp: int = 1, tp: int = 1, pp: int = 1,
                pipeline_microbatches: int = 1, device: str = "cuda", mlm_probability: float = 0.15,
                layout: tuple[float, float, float] = (4, 4, 8)) -> dict[str, Any]:
    """Planned peak memory of one GPU, in bytes, term by term.

    params / grads / optimizer: ``zero_state_bytes`` of this GPU's parameters
    (``_params_per_gpu``: its pipeline stage, its 1/tp slice), ZeRO-sharded over ``dp``.
    autocast_copies: the bf16/fp16 weight copies autocast caches during forward and backward
    (2 B per local parameter; 0 in fp32; sharded with ZeRO-3, which casts as FSDP's mixed
    precision does, one layer's gathered weights at a time). activations: ``activation_terms`` with the layers of
    one stage; pipeline parallel with the 1F1B schedule keeps min(pp, m) micro-batches in
    flight on the first stage (Narayanan et al. arXiv:2104.04473 section 2.2.1), the embedding
    on the first stage and the head on the last, the worse stage counted. logits: held output.
    With activation checkpointing one layer's full activations are added (its recompute in
    backward). head_backward: two fp32 [n, V] gradient buffers alive when backward starts. Grads are
    counted as allocated throughout (an upper estimate when they are set to None between steps).
    ``bubble``: GPipe's idle fraction (p - 1) / (m + p - 1) (Huang et al. arXiv:1811.06965).
    Returns the terms, "total", and the inputs.
    """
    if pipeline_microbatches < 1 or pp < 1:
        raise ValueError(f"pipeline_microbatches/pp: must be >= 1, got {pipeline_microbatches}/{pp}")
    state = zero_state_bytes(_params_per_gpu(cfg, tp, pp), zero_stage=zero_stage, dp=dp, layout=layout)
    t = activation_terms(cfg, seq_len, micro_batch, precision=precision, attention=attention,
                         device=device, tp=tp, mlm_probability=mlm_probability)
    stage_layers = math.ceil(cfg.num_layers / pp) / cfg.num_layers
    per_mb = (t["layers"] + t["attention_scores"]) * stage_layers
    if cfg.activation_checkpointing:  # backward recomputes one layer at a time: its activations come back
        full = activation_terms(dataclasses.replace(cfg, activation_checkpointing=False), seq_len, micro_batch,
                                precision=precision, attention=attention, device=device, tp=tp,
                                mlm_probability=mlm_probability)
        per_mb += (full["layers"] + full["attention_scores"]) / cfg.num_layers
    if pp == 1:
        acts = per_mb + t["embedding"] + t["head"]
        logits = t["logits"]
    else:
        first = min(pp, pipeline_microbatches) * (per_mb + t["embedding"])
        last = per_mb + t["head"] + t["logits"]
        acts, logits = max(first, last), 0  # the last stage's count includes its logits
    n_positions = round(mlm_probability * seq_len) * micro_batch if cfg.sparse_head else seq_len * micro_batch
    out = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
           "autocast_copies": 0 if precision == "fp32" else 2 * _params_per_gpu(cfg, tp, pp) / (dp if zero_stage == 3 else 1),
           "activations": acts, "logits": logits, "head_backward": 8 * n_positions * cfg.vocab_size / tp}
    out = {k: int(v) for k, v in out.items()}
    out["total"] = sum(out.values())
    out.update(seq_len=seq_len, micro_batch=micro_batch, precision=precision, attention=attention,
               zero_stage=zero_stage, dp=dp, tp=tp, pp=pp, pipeline_microbatches=pipeline_microbatches,
               bubble=pipeline_bubble(pp, pipeline_microbatches),
               sparse_head=cfg.sparse_head, checkpointing=cfg.activation_checkpointing)
    return out


def pipeline_bubble(p: int, m: int) -> float:
    """Idle fraction of a GPipe/1F1B pipeline of p stages and m micro-batches: (p - 1)/(m + p - 1)
    (Huang et al. arXiv:1811.06965; Narayanan et al. arXiv:2104.04473 eq. 1 in this form)."""
    if p < 1 or m < 1:
        raise ValueError(f"p/m: must be >= 1, got {p}/{m}")
    return (p - 1) / (m + p - 1)


def planned_max_micro_batch(cfg: ModelConfig, *, device: str = "H100 NVL", seq_len: int,
                            reserve_bytes: int = 2**30, limit: int = 1 << 16, **kw) -> dict[str, Any]:
    """Largest micro-batch b whose ``memory_plan(...)["total"]`` fits the device's memory less
    ``reserve_bytes`` (CUDA context and allocator slack; 1 GiB by default). Memory grows
    linearly in b, so it is solved from b = 1 and 2 and checked at the answer. Returns
    {"max_micro_batch", "capacity_bytes", "plan" (at the answer, or at b = 1 when nothing fits)}."""
    cap = device_info(device)["memory_bytes"] - reserve_bytes
    one = memory_plan(cfg, seq_len=seq_len, micro_batch=1, **kw)["total"]
    two = memory_plan(cfg, seq_len=seq_len, micro_batch=2, **kw)["total"]
    b = max(0, min(limit, int((cap - (2 * one - two)) // max(1, two - one))))
    while b > 0 and memory_plan(cfg, seq_len=seq_len, micro_batch=b, **kw)["total"] > cap:
        b -= 1
    while b < limit and memory_plan(cfg, seq_len=seq_len, micro_batch=b + 1, **kw)["total"] <= cap:
        b += 1
    return {"max_micro_batch": b, "capacity_bytes": cap,
            "plan": memory_plan(cfg, seq_len=seq_len, micro_batch=max(b, 1), **kw)}


def study_table(*, seq_lens=(128, 256, 512, 1024, 2048), precisions=("bf16", "fp32"),
                attentions=ATTENTION, heads=(True, False), device: str = "H100 NVL",
                vocab_size: int = STUDY_VOCAB):
    """Planned largest micro-batch of the study's two models on ``device`` for every setting
    the study leaves open (sequence length, precision, attention kernel, sparse or dense head),
    beside the reported ``STUDY_MICRO_BATCH``. polars DataFrame: model, params, seq_len,
    precision, attention, sparse_head, planned, study, ratio (planned / study), within_10pct."""
    import polars as pl

    from labkit.model import model_config

    rows = []
    for name, reported in STUDY_MICRO_BATCH.items():
        for s in seq_lens:
            for prec in precisions:
                for att in attentions:
                    for sparse in heads:
                        cfg = model_config(name, vocab_size, sparse_head=sparse,
                                           max_position_embeddings=max(512, s))
                        got = planned_max_micro_batch(cfg, device=device, seq_len=s, precision=prec,
                                                      attention=att)["max_micro_batch"]
                        rows.append({"model": name, "params": count_parameters(cfg)["total"], "seq_len": s,
                                     "precision": prec, "attention": att, "sparse_head": sparse,
                                     "planned": got, "study": reported})
    return pl.DataFrame(rows).with_columns(ratio=pl.col("planned") / pl.col("study")).with_columns(
        within_10pct=(pl.col("ratio") - 1).abs() <= 0.1)


def parallel_plans(cfg: ModelConfig, *, n_gpus: int, seq_len: int, micro_batch: int, device: str = "H100 NVL",
                   gpus_per_node: int = 2, pipeline_microbatches: int = 8, reserve_bytes: int = 2**30, **kw):
    """Memory per GPU for every split dp x tp x pp = n_gpus and ZeRO stage 0-3.

    polars DataFrame, one row per split, in the order a planner would try them (the least
    model parallelism first, then the lowest ZeRO stage): dp, tp, pp, zero_stage, the
    ``memory_plan`` terms in bytes, total, fits (total <= device memory - reserve),
    tp_within_node (tensor parallelism across nodes is slow), bubble ((p - 1)/(m + p - 1)).
    tp must divide the heads and pp at most the layers; other splits are left out."""
    import polars as pl

    cap = device_info(device)["memory_bytes"] - reserve_bytes
    rows = []
    for tp in (t for t in range(1, n_gpus + 1) if n_gpus % t == 0 and cfg.num_heads % t == 0):
        for pp in (p for p in range(1, n_gpus // tp + 1) if (n_gpus // tp) % p == 0 and p <= cfg.num_layers):
            dp = n_gpus // (tp * pp)
            for zero in (0, 1, 2, 3):
                if zero and dp == 1:
                    continue
                plan = memory_plan(cfg, seq_len=seq_len, micro_batch=micro_batch, zero_stage=zero, dp=dp,
                                   tp=tp, pp=pp, pipeline_microbatches=pipeline_microbatches, **kw)
                rows.append({k: plan[k] for k in ("dp", "tp", "pp", "zero_stage", "params", "grads", "optimizer",
                                                  "autocast_copies", "activations", "logits", "head_backward",
                                                  "total", "bubble")}
                            | {"fits": plan["total"] <= cap, "tp_within_node": tp <= gpus_per_node})
    return pl.DataFrame(rows).sort(pl.col("tp") * pl.col("pp"), "pp", "zero_stage")


def first_fit(plans) -> dict | None:
    """The first row of ``parallel_plans(...)`` that fits with tensor parallelism inside a node
    (None when none does): the split to use when data parallelism alone cannot hold the model."""
    import polars as pl

    ok = plans.filter(pl.col("fits") & pl.col("tp_within_node"))
    return ok.row(0, named=True) if ok.height else None


def gpu_memory_check(models=(("bert-120m", 64), ("bert-350m", 16)), *, seq_len: int = 512,
                     vocab_size: int = STUDY_VOCAB, precision: str = "bf16", tolerance: float = 0.10,
                     steps: int = 3) -> list[dict[str, Any]]:
    """The planner against a real GPU (called by benchmarks/gpu_check.py): for each (preset,
    micro-batch), train ``steps`` steps under autocast on CUDA with the optimiser training
    builds (``labkit.train.build_optimizer``: AdamW, fused on CUDA) and compare
    ``memory_plan(...)["total"]`` (attention "flash": CUDA's fused SDPA kernels) with
    ``torch.cuda.max_memory_allocated`` over the last step, and the planned activations + held
    logits with the bytes allocated by the last forward. Returns one dict per model: model,
    micro_batch, planned_peak, measured_peak, peak_ratio, planned_forward, measured_forward,
    forward_ratio, ok (both ratios within ``tolerance`` of 1). Raises RuntimeError without CUDA."""
    from labkit.model import model_config

    if not torch.cuda.is_available():
        raise RuntimeError("gpu_memory_check needs a CUDA device; torch.cuda.is_available() is False")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    out = []
    for name, b in models:
        cfg = model_config(name, vocab_size)
        torch.manual_seed(0)
        model = BertMLM(cfg).cuda().train()
        from labkit.config import TrainConfig
        from labkit.train import build_optimizer

        opt = build_optimizer(model, TrainConfig(data_dir="-", run_dir="-"))  # the optimiser training uses
        g = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randint(5, vocab_size, (b, seq_len), device="cuda", generator=g)
        labels = torch.full_like(ids, -100)
        n_mask = round(0.15 * seq_len)
        labels[:, 1:1 + n_mask] = ids[:, 1:1 + n_mask]
        mask = torch.ones_like(ids, dtype=torch.bool)
        for _ in range(steps):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=dtype):
                res = model(ids, attention_mask=mask, labels=labels)
            torch.cuda.synchronize()
            forward = torch.cuda.memory_allocated() - before
            (res.loss_sum / res.n_masked).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del res
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        plan = memory_plan(cfg, seq_len=seq_len, micro_batch=b, precision=precision, attention="flash")
        planned_fwd = plan["activations"] + plan["logits"] + plan["autocast_copies"]
        row = {"model": name, "micro_batch": b, "seq_len": seq_len, "planned_peak": plan["total"],
               "measured_peak": int(peak), "peak_ratio": plan["total"] / peak, "planned_forward": planned_fwd,
               "measured_forward": int(forward), "forward_ratio": planned_fwd / max(1, forward)}
        row["ok"] = abs(row["peak_ratio"] - 1) <= tolerance and abs(row["forward_ratio"] - 1) <= tolerance
        out.append(row)
        del model, opt
        torch.cuda.empty_cache()
    return out


def max_micro_batch_cuda(model_cfg: ModelConfig, seq_len: int, *, precision: str = "bf16", limit: int = 4096,
                         mlm_probability: float = 0.15) -> dict[str, Any]:
    """Largest micro-batch whose training step (forward, backward, AdamW step under autocast)
    runs on the current CUDA device without ``torch.cuda.OutOfMemoryError``: doubling from 1,
    then bisection. Returns {"max_micro_batch", "peak_bytes" (``max_memory_allocated`` at the
    answer), "budget_bytes" (the device's total memory), "params", "seq_len"}. Raises
    RuntimeError without CUDA. The GPU counterpart of ``max_micro_batch``'s budget search."""
    if not torch.cuda.is_available():
        raise RuntimeError("max_micro_batch_cuda needs a CUDA device; torch.cuda.is_available() is False")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
    torch.manual_seed(0)
    model = BertMLM(model_cfg).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_mask = max(1, round(mlm_probability * seq_len))

    def fits(b: int) -> int | None:
        ids = labels = out = None
        try:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(5, model_cfg.vocab_size, (b, seq_len), device="cuda")
            labels = torch.full_like(ids, -100)
            labels[:, 1:1 + n_mask] = ids[:, 1:1 + n_mask]
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                out = model(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), labels=labels)
            (out.loss_sum / out.n_masked).backward()
            opt.step()
            return int(torch.cuda.max_memory_allocated())
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            del ids, labels, out
            opt.zero_grad(set_to_none=True)

    lo, peak, b = 0, None, 1
    while b <= limit and (p := fits(b)) is not None:
        lo, peak, b = b, p, b * 2
    hi = min(b, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = fits(mid)
        if p is None:
            hi = mid
        else:
            lo, peak = mid, p
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    del model, opt
    torch.cuda.empty_cache()
    return {"max_micro_batch": lo, "peak_bytes": peak, "budget_bytes": int(total),
            "params": int(count_parameters(model_cfg)["total"]), "seq_len": seq_len}
