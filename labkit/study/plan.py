"""Memory planning from formulas: the terms that explain what a rank holds, for any size.

The count of what a real model keeps (any model, on fake or CPU tensors) is
``labkit.study.memory.plan_model``; this module is its explanation for labkit's own model and
its reach beyond what a CPU can count quickly: ``activation_terms`` (Korthikanti et al.
arXiv:2205.05198, written for labkit's model and tested equal to the count for every option),
``zero_state_bytes`` (ZeRO arXiv:1910.02054), ``memory_plan`` (one GPU under DP x TP x PP and
ZeRO 0-3, with the GPipe bubble), ``planned_max_micro_batch`` on a ``DEVICES`` entry, and the one
micro-batch search ``largest_fitting``. ``labkit.study.parallel`` builds the study tables on it.

The study's model options (configs/study.toml) in ``activation_terms``: without
``attention_output_dropout`` one dropout mask per layer less (m·sbh, m·qh in a sparse last
layer); pre-norm without ``final_norm`` has no final-norm term; instruction positions keep three
id tensors (token, instruction, argument); ``attention_backend`` "eager" is planned as
``attention="eager"`` (its copies of Q, K, V and the kept probabilities are the math path's).
Equal to the count on CPU (tests/study/test_study_plan.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from labkit import measure as _measure
from labkit.config import ModelConfig
from labkit.model import count_parameters
from labkit.model.attention import layer_attention

__all__ = ["ATTENTION", "DEVICES", "PRECISIONS", "STUDY_MICRO_BATCH", "STUDY_VOCAB", "activation_terms", "device_info",
           "largest_fitting", "memory_plan", "pipeline_bubble", "planned_max_micro_batch", "saved_activation_bytes",
           "zero_state_bytes"]


def largest_fitting(fits: Callable[[int], bool], *, limit: int, start: int = 1) -> int:
    """Largest b in [0, limit] with ``fits(b)``, for a monotone ``fits`` (True up to some b, False above).

    The one micro-batch search of labkit: the counted planner (``labkit.study.memory.plan_model``), the
    analytic planner (``planned_max_micro_batch``) and the CUDA out-of-memory search
    (``labkit.study.gpu.max_micro_batch_cuda``) all call it. From ``start`` (a guess; exact
    guesses cost two calls) it gallops upward with doubling steps while ``fits`` holds, or takes
    [0, start) when it does not, then bisects. Returns 0 when even b = 1 does not fit. Raises
    ValueError when limit < 1.
    """
    if limit < 1:
        raise ValueError(f"limit: must be >= 1, got {limit}")
    lo, hi = 0, limit + 1  # fits(lo) holds (or lo = 0); fits(hi) fails (or hi = limit + 1)
    b = max(1, min(start, limit))
    if fits(b):
        lo, step = b, 1
        while lo < limit:
            nxt = min(limit, lo + step)
            if not fits(nxt):
                hi = nxt
                break
            lo, step = nxt, step * 2
        else:
            return lo
    else:
        hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# --------------------------------------------------------------------------------------------
# The analytic planner: memory per GPU from formulas, for sizes no CPU can measure
# --------------------------------------------------------------------------------------------

DEVICES = _measure.DEVICES
"""``labkit.measure.DEVICES``, the one device table (memory, bandwidth, peaks, sources); its
aliases (``labkit.measure.DEVICE_ALIASES``: "A100") are accepted by ``device_info`` too."""

STUDY_MICRO_BATCH = {"bert-120m": 184, "bert-350m": 20}
"""Per-GPU micro-batches the study reports on H100 NVL (arXiv:2509.05258; docs/references.md A,
unconfirmed against the full text). Sequence length, vocabulary and precision are not reported."""

STUDY_VOCAB = 45_000
"""(derived) The vocabulary at which BERT-Base/Large shapes have 120.6M and 350.0M parameters
(``count_parameters``), i.e. the study's two names; the study does not give its vocabulary."""

PRECISIONS = ("fp32", "bf16", "fp16")
ATTENTION = ("flash", "eager")


def device_info(name: str) -> dict[str, Any]:
    """``DEVICES[name]`` (a table name or an alias, ``labkit.measure.device_name``) plus
    memory_bytes, peak_flops (bf16) and peaks (FLOP/s by precision). Raises ValueError listing
    the known devices."""
    if name not in DEVICES and name not in _measure.DEVICE_ALIASES:
        raise ValueError(f"device: unknown {name!r}; known devices are {sorted(DEVICES)}")
    name = _measure.device_name(name)
    d = DEVICES[name]
    return {"device": name, **{k: v for k, v in d.items() if k != "peak_flops"},
            "memory_bytes": int(d["memory_gb"] * 1e9), "peak_flops": d["peak_flops"].get("bf16"),
            "peaks": dict(d["peak_flops"])}


def _check_options(precision: str, attention: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: got {precision!r}; allowed values are {PRECISIONS}")
    if attention not in ATTENTION:
        raise ValueError(f"attention: got {attention!r}; allowed values are {ATTENTION}")


def activation_terms(cfg: ModelConfig, seq_len: int, micro_batch: int, *, precision: str = "bf16",
                     attention: str = "flash", device: str = "cuda", tp: int = 1,
                     mlm_probability: float = 0.15, sequence_parallel: bool = False) -> dict[str, int]:
    """Bytes kept for backward by ``BertMLM(cfg)`` at one micro-batch, term by term: what
    ``labkit.study.memory.plan_model`` counts, equal to it for every option, both heads, on CPU
    and as CUDA keeps it (``labkit.study.cuda_like.CudaLike``) (tests/study/test_plan.py).

    After Korthikanti et al. 2022 (arXiv:2205.05198, section 4.1), written for this model
    (post-norm, fused QKV, SDPA, GELU, dropout, and with ``cfg.sparse_head`` a last layer that
    runs its queries only at the masked positions). s = seq_len, b = micro_batch, h = hidden,
    a = heads, f = ffn width, V = vocabulary. d = bytes of the compute dtype (fp32 4; bf16/fp16 2
    under autocast with fp32 weights), m = dropout-mask bytes (1 on CUDA, d on CPU; 0 without
    dropout), g = LayerNorm input bytes (4: the residual stream stays fp32 under autocast). With
    the sparse head and labels the last layer has q = b·k query rows, k = max(1, round(p·s)) (the
    most masked positions in a row; exact for ``labkit.study.memory.labkit_model``'s batch, which
    masks k per row). Terms:

    - ``layers``, every layer but a sparse last one: QKV input, the fused Q/K/V (one storage) and
      output-projection input 5·d·sbh, FFN input d·sbh, GELU input and output 2·d·sbf, two
      LayerNorm inputs 2·g·sbh, two dropout masks 2·m·sbh, norm mean/rstd 16·sb. For d = 2,
      m = 1, g = 2, f = 4h this is the paper's 34·sbh. (SDPA's math path saves its own copies
      of Q, K, V instead of the fused storage: the same 3·d·sbh.)
    - the sparse last layer (model.py ``Layer.forward`` with ``select``; counted, not from the
      paper): the layer input g·sbh and the whole fused QKV output 3·d·sbh (the two ``gather``
      calls save their sources), the QKV projection's input (post-norm: under autocast the
      16-bit copy of the layer input, d·sbh; pre-norm: the norm's output, d·sbh), the gather
      index 8·sb (``select`` is a slice of the [b, s] int64 sort indices, which stay alive
      whole), then at q rows: output-projection input, FFN input 2·d·qh, GELU 2·d·qf, norm inputs
      2·g·qh (pre-norm: the FFN norm's only), masks 2·m·qh, norm statistics; and its attention:
      "flash" keeps the gathered Q and the SDPA output 2·d·qh (a separate storage from the
      output-projection input here, as the output follows Q's layout); "eager" keeps a Q copy
      d·qh and K, V copies of all s positions 2·d·sbh.
    - ``attention_scores``: "flash" (fused kernels, the paper's selective recompute; on CPU the
      fused path runs when attention dropout is off, as the model passes no mask for a batch
      without padding) keeps the log-sum-exp, 4·a·s·b per layer (4·a·q for the sparse last
      layer; in fp32 on CUDA, whose memory-efficient kernel rounds each sequence's rows up to a
      multiple of 32, 4·a·b·32·ceil(s/32)). "eager" (SDPA's math path, which CPU takes when
      attention dropout is on) keeps softmax output, dropout mask and dropped probabilities
      (2d + m)·a·s²·b, d·a·s²·b without attention dropout: the paper's 5·a·s²·b; the sparse
      last layer a·q·s instead of a·s²·b. (Counted on CPU, math path at b = 1: V's reshape is a
      view, so the whole fused QKV storage is saved instead of a V copy, +2·d·sh per full layer;
      in the sparse last layer that storage is already counted and the V copy is gone, -d·sh.)
    - the model options' own terms per layer: ``_layer_bytes``.
    - with ``cfg.activation_checkpointing``: each layer's input g·sbh (no scores), plus the
      gather index 8·sb with the sparse head (``checkpoint`` saves ``select`` as an input).
    - ``embedding``: token and position ids (8·sb + 8·s; instruction positions 24·sb), norm input
      g·sbh and statistics 8·sb, dropout mask m·sbh (RMSNorm: its normalised copy, g·sbh more,
      and 4·sb of statistics); rotary positions look no position up (-8·s) and keep their fp32
      cos/sin tables 8·s·Q, under autocast each layer's 16-bit copies of them for Q and for K,
      4·L·s·Q·d.
    - ``head`` at n positions (n = q with ``cfg.sparse_head``, else s·b): dense input, GELU
      input, decoder input 3·d·nh, the head norm's input (GELU's output) d·nh, on CUDA g·nh
      (its autocast runs layer_norm in fp32), head-norm statistics 8·n, fp32 log-softmax 4·nV,
      target indices 8·n, the loss's 4-byte total weight; with the sparse head also the bool
      ``valid`` mask that picks the real rows, q bytes; RMSNorm's copy g·nh; with pre-norm the
      final norm before the head at the rows the last layer returns, g·nh (2·g·nh with RMSNorm)
      and its statistics.
    - ``logits`` (held by the returned output, not saved): d·nV.

    ``tp`` > 1 divides the width terms by t, not indices and statistics, and the residual stream's
    (``_layer_bytes``; checkpointed layer inputs) only with ``sequence_parallel`` (arXiv:2205.05198
    4.2.2; 4.2.1 without). Raises ValueError for unknown precision/attention or non-positive sizes.
    """
    _check_options(precision, attention)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device: must be 'cuda' or 'cpu', got {device!r}")
    if seq_len < 1 or micro_batch < 1 or tp < 1:
        raise ValueError(f"seq_len/micro_batch/tp: must be positive, got {seq_len}/{micro_batch}/{tp}")
    s, b, h, v, L = seq_len, micro_batch, cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    d = 4 if precision == "fp32" else 2
    g = 4
    sparse = cfg.sparse_head
    q = max(1, round(mlm_probability * s)) * b if sparse else 0  # query rows of the sparse last layer
    index = 8 * s * b if sparse else 0  # [b, s] int64 sort indices behind ``select``
    env = {"s": s, "b": b, "d": d, "g": g, "device": device, "eager": attention == "eager",
           "m": (1 if device == "cuda" else d) if cfg.hidden_dropout > 0 else 0}
    per_layer = [_layer_bytes(cfg, layer_attention(cfg, i), rows=q if sparse and i == L - 1 else s * b, **env)
                 for i in range(L)]
    width, score, stats, whole = (sum(col) for col in zip(*per_layer))  # whole: the residual stream's part
    if cfg.activation_checkpointing:
        layers, scores = L * g * s * b * h // (tp if sequence_parallel else 1) + index, 0
    else:
        layers, scores = (width - whole) // tp + whole // (tp if sequence_parallel else 1) + stats + index, score // tp
    n = q if sparse else s * b
    rms = cfg.norm_type == "rmsnorm"  # torch's RMSNorm keeps a normalised copy of its input
    stat = 4 if rms else 8  # per norm row: RMSNorm's rstd, LayerNorm's mean and rstd (fp32)
    rotary = cfg.position_embedding == "rotary"
    # rotary: no position ids to look up; the fp32 cos/sin tables [s, Q] (under autocast each
    # layer's 16-bit copies of them, for q and for k) instead
    tables = (2 * s * cfg.head_dim * 4 if d == 4 else 4 * L * s * cfg.head_dim * d) - 8 * s
    ids = 24 * s * b if cfg.position_embedding == "instruction" else 8 * s * b + 8 * s  # + instruction, argument
    embedding = ids + (g + env["m"]) * s * b * h + stat * s * b + g * s * b * h * rms + tables * rotary
    n_final = n if sparse else s * b  # pre-norm's final norm runs after the (sparse) last layer
    final_norm = (g * n_final * h * (1 + rms) + stat * n_final) if cfg.norm_position == "pre" and cfg.final_norm \
        else 0
    head_norm_in = g if device == "cuda" else d  # GELU's output: CUDA's autocast runs the norm in fp32
    head = ((3 * d + head_norm_in) * n * h + 4 * n * v + g * n * h * rms) // tp + (stat + 8) * n + 4 \
        + (n if sparse else 0) + final_norm
    return {"layers": int(layers), "attention_scores": int(scores), "embedding": int(embedding),
            "head": int(head), "logits": int(d * n * v // tp)}


def _layer_bytes(cfg: ModelConfig, kind: str, *, rows: int, s: int, b: int, d: int, g: int, m: int,
                 device: str, eager: bool) -> tuple[int, int, int, int]:
    """(bytes that scale with the width, attention-score bytes, statistics bytes, the part of the
    width bytes on the residual stream) one layer of attention ``kind`` keeps, its queries at
    ``rows`` positions (s·b, or q for the sparse last layer, whose keys and values still come
    from all s·b). Terms in ``activation_terms``'
    docstring; the options' own, counted on CPU and under ``labkit.study.cuda_like.CudaLike``:

    - rotary: the rotated Q and K, 2·d·sbh (SDPA's math path copies Q and K itself: 0 there, and
      -2·d·sbh in a sparse last layer, whose gathers then save no fused QKV);
    - RMSNorm: a normalised copy of each norm's input, and 4 bytes of statistics per row (not 8);
    - gated FFN (GEGLU, SwiGLU): value, gate, act(gate) and product, 4·d·rows·f (GELU's 2·d·rows·f);
    - sliding window: the additive band mask fused kernels keep, d·s² per layer whatever b (d·q·s
      in a sparse last layer, [b, 1, k, s]); the math path keeps none;
    - Linformer: contiguous K and V for the sequence projection 2·d·sbh (not on the math path) and
      the projected K', V' 2·d·b·k·h;
    - linear attention (no SDPA, no scores): phi(k) and its transposed copy 2·d·sbh; phi(q), the
      numerator and the quotient 3·d·rows·h; the [Q, Q] state d·b·h·Q, the denominator d·a·rows
      and z d·b·a·Q;
    - ``attention_backend`` "eager" (the model's own softmax, the study's): the math path's terms,
      except that on CUDA in 16 bits autocast runs the softmax in fp32, so each score keeps fp32
      probabilities, their 16-bit copy for the product with V (and the dropout mask), 4 + d (+ 1).

    The residual stream's part is what tensor parallelism without sequence parallelism keeps
    whole on every tp rank (arXiv:2205.05198 section 4.2.1): the QKV projection's input, the FFN
    input, the norms' inputs (and RMSNorm's copies), the dropout masks after the two row-parallel
    products, and in the sparse last layer its input; the rest runs between a column- and a
    row-parallel product (fused Q/K/V, scores, attention output, the FFN's inner tensors) and is
    split.
    """
    h, f, a, hq = cfg.hidden_size, cfg.ffn_size, cfg.num_heads, cfg.head_dim
    sb, sbh = s * b, s * b * h
    last = rows != sb
    pre, rms = cfg.norm_position == "pre", cfg.norm_type == "rmsnorm"
    stat = 4 if rms else 8
    cast = 0 if d == g else d  # a 16-bit copy of an fp32 input, beside the input itself
    math_b1 = device == "cpu" and b == 1 and eager and cfg.attention_dropout > 0 and kind != "linear"
    eager = eager and kind != "linear"
    # the input, the QKV projection's input and the fused Q/K/V (one storage)
    width = (g + (d if pre else cast) + 3 * d) * sbh if last else 4 * d * sbh
    whole = (g + (d if pre else cast)) * sbh if last else d * sbh  # all but the fused Q/K/V
    # at the query rows: output-projection and FFN inputs, GELU (or gated) tensors, the FFN output's
    # dropout mask and (``attention_output_dropout``) the attention output's
    masks = (1 + cfg.attention_output_dropout) * m
    width += 2 * d * rows * h + 2 * d * rows * f * (2 if cfg.activation != "gelu" else 1) + masks * rows * h
    whole += d * rows * h + masks * rows * h  # the FFN input and the masks (not the output projection's input)
    if not last:  # both norms' inputs (and RMSNorm's copies) at every position
        norms = 2 * g * sbh * (1 + rms)
        stats = 2 * stat * sb
    elif pre:  # the attention norm's input is the layer input (counted above); its copy at every position
        norms = g * rows * h * (1 + rms) + g * sbh * rms
        stats = stat * (sb + rows)
    else:
        norms = 2 * g * rows * h * (1 + rms)
        stats = 2 * stat * rows
    width += norms
    whole += norms
    rotary = cfg.position_embedding == "rotary"
    if kind == "linear":
        width += 2 * d * sbh + 3 * d * rows * h + d * b * h * hq + d * a * rows + d * b * a * hq
        return width, 0, stats, whole
    if last:  # the gathered Q and the SDPA output (fused); a Q copy and K, V of every position (math path)
        width += (d * rows * h + 2 * d * sbh - d * s * h * math_b1) if eager else 2 * d * rows * h
    else:
        width += 2 * d * sbh * math_b1  # b = 1 on CPU's math path: the whole fused storage for V
    width += (2 * d * sbh if not eager else -2 * d * sbh if last else 0) * rotary
    keys = s
    if kind == "sliding_window":
        width += 0 if eager else (d * rows * s if last else d * s * s)
    elif kind == "linformer":
        keys = min(cfg.linformer_k, s)
        width += 2 * d * sbh * (not eager) + 2 * d * b * keys * h
    if eager:
        per_score = (2 * d + (1 if device == "cuda" else d)) if cfg.attention_dropout > 0 else d
        if cfg.attention_backend == "eager" and device == "cuda" and d == 2:
            # the model's own softmax under CUDA's autocast: fp32 probabilities (4), their 16-bit
            # copy for the product with V (d), and the dropout mask between (1)
            per_score = 4 + d + (cfg.attention_dropout > 0)
        return width, a * rows * keys * per_score, stats, whole
    # fused kernels keep an fp32 log-sum-exp per query row; CUDA's memory-efficient kernel (the one
    # fp32 gets) rounds each sequence's rows up to a multiple of 32 (cuda_like.cuda_attention_kernel)
    per_seq = rows // b
    lse_rows = 32 * math.ceil(per_seq / 32) if device == "cuda" and d == 4 else per_seq
    return width, 4 * a * b * lse_rows, stats, whole


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
    """Parameters the worst GPU holds under labkit's split (``labkit.train.tensor_parallel``,
    ``labkit.train.pipeline``): its stage's layers (ceil(L/pp)), plus the embeddings on the first
    stage and the head on the last (the worse of the two; both with pp = 1; with tied embeddings
    the last stage holds a copy of the word embedding). Tensor parallelism divides by tp the QKV,
    FFN and output-projection weights, the column-parallel biases and the vocabulary rows (word
    embedding, decoder, decoder bias; the first slice's ceil(V/tp) rows), and keeps the norms, the
    row-parallel biases, the position (or instruction and argument) and token-type tables and the
    head's dense layer whole on every rank."""
    h, f, v, bias = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size, int(cfg.bias)
    total = count_parameters(cfg)["total"]
    per_layer = count_parameters(dataclasses.replace(cfg, num_layers=2))["total"] - \
        count_parameters(dataclasses.replace(cfg, num_layers=1))["total"]
    f_in = 2 * f if cfg.activation != "gelu" else f
    split_layer = 3 * h * h + 3 * h * bias + f_in * h + f_in * bias + h * h + f * h
    layer = per_layer - split_layer + split_layer / tp
    norm = h * (2 if cfg.norm_type == "layernorm" and cfg.bias else 1)
    tables = {"absolute": 1, "instruction": 2}.get(cfg.position_embedding, 0)  # the study's: instruction, argument
    positions = tables * cfg.max_position_embeddings * h
    vt = math.ceil(v / tp)  # vocabulary rows of the first (largest) slice
    first = vt * h + positions + cfg.type_vocab_size * h + norm
    head_split = (0 if cfg.tie_embeddings else v * h) + v * bias
    head_whole = total - cfg.num_layers * per_layer - (v * h + positions + cfg.type_vocab_size * h + norm) - head_split
    last = head_whole + head_split * vt / v
    other = first + last if pp == 1 else max(first, last + (vt * h if cfg.tie_embeddings else 0))
    return math.ceil(cfg.num_layers / pp) * layer + other


def memory_plan(cfg: ModelConfig, *, seq_len: int, micro_batch: int, precision: str = "bf16",
                attention: str = "flash", zero_stage: int = 0, dp: int = 1, tp: int = 1, pp: int = 1,
                pipeline_microbatches: int = 1, device: str = "cuda", mlm_probability: float = 0.15,
                layout: tuple[float, float, float] = (4, 4, 8), pipeline_schedule: str = "1f1b",
                sequence_parallel: bool = False) -> dict[str, Any]:
    """Planned peak memory of one GPU, in bytes, term by term.

    params / grads / optimizer: ``zero_state_bytes`` of this GPU's parameters
    (``_params_per_gpu``: its pipeline stage, its 1/tp slice), ZeRO-sharded over ``dp``.
    autocast_copies: the bf16/fp16 weight copies autocast caches during forward and backward
    (2 B per local parameter; 0 in fp32; sharded with ZeRO-3, which casts as FSDP's mixed
    precision does, one layer's gathered weights at a time). activations: ``activation_terms`` with the layers of
    one stage; with pp > 1 the first stage holds ceil(L/pp) full layers and the embedding, the
    last stage L // pp layers (the sparse head's last layer among them) and the head; 1F1B
    (``pipeline_schedule`` "1f1b", and "interleaved_1f1b" counted the same) keeps min(pp, m)
    micro-batches in flight on the first stage and one on the last (Narayanan et al.
    arXiv:2104.04473 section 2.2.1), GPipe all m on every stage; the worse stage is counted.
    logits: held output (0 with pp > 1: labkit's last stage returns only the loss).
    With activation checkpointing one layer's full activations are added (its recompute in
    backward). head_backward: two fp32 [n, V] gradient buffers alive when backward starts. Grads are
    counted as allocated throughout (an upper estimate when they are set to None between steps).
    ``bubble``: GPipe's idle fraction (p - 1) / (m + p - 1) (Huang et al. arXiv:1811.06965).
    ``sequence_parallel`` (with tp > 1; ``TrainConfig.parallel.sequence_parallel``, off by default as
    there): whether the residual stream's activations are split over tp too
    (``activation_terms``). Returns the terms, "total", and the inputs.
    """
    if pipeline_microbatches < 1 or pp < 1:
        raise ValueError(f"pipeline_microbatches/pp: must be >= 1, got {pipeline_microbatches}/{pp}")
    state = zero_state_bytes(_params_per_gpu(cfg, tp, pp), zero_stage=zero_stage, dp=dp, layout=layout)
    t = activation_terms(cfg, seq_len, micro_batch, precision=precision, attention=attention,
                         device=device, tp=tp, mlm_probability=mlm_probability,
                         sequence_parallel=sequence_parallel)
    if pipeline_schedule not in ("gpipe", "1f1b", "interleaved_1f1b"):
        raise ValueError(f"pipeline_schedule: got {pipeline_schedule!r}; allowed values are 'gpipe', '1f1b', "
                         "'interleaved_1f1b'")
    L = cfg.num_layers
    recompute = 0.0
    if cfg.activation_checkpointing:  # backward recomputes one layer at a time: its activations come back
        full = activation_terms(dataclasses.replace(cfg, activation_checkpointing=False), seq_len, micro_batch,
                                precision=precision, attention=attention, device=device, tp=tp,
                                mlm_probability=mlm_probability, sequence_parallel=sequence_parallel)
        recompute = (full["layers"] + full["attention_scores"]) / L
    if pp == 1:
        acts = t["layers"] + t["attention_scores"] + recompute + t["embedding"] + t["head"]
        logits = t["logits"]
    else:
        dense = activation_terms(dataclasses.replace(cfg, sparse_head=False), seq_len, micro_batch,
                                 precision=precision, attention=attention, device=device, tp=tp,
                                 mlm_probability=mlm_probability, sequence_parallel=sequence_parallel)
        per_layer = (dense["layers"] + dense["attention_scores"]) / L  # a full (not sparse) layer
        n_first, n_last = math.ceil(L / pp), L // pp
        last_layers = t["layers"] + t["attention_scores"] - per_layer * (L - n_last)
        m = pipeline_microbatches
        in_flight = (m, m) if pipeline_schedule == "gpipe" else (min(pp, m), 1)
        first = in_flight[0] * (per_layer * n_first + recompute + t["embedding"])
        last = in_flight[1] * (last_layers + recompute + t["head"])
        acts, logits = max(first, last), 0
    n_positions = round(mlm_probability * seq_len) * micro_batch if cfg.sparse_head else seq_len * micro_batch
    out = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
           "autocast_copies": 0 if precision == "fp32" else 2 * _params_per_gpu(cfg, tp, pp) / (dp if zero_stage == 3 else 1),
           "activations": acts, "logits": logits, "head_backward": 8 * n_positions * cfg.vocab_size / tp}
    out = {k: int(v) for k, v in out.items()}
    out["total"] = sum(out.values())
    out.update(seq_len=seq_len, micro_batch=micro_batch, precision=precision, attention=attention,
               zero_stage=zero_stage, dp=dp, tp=tp, pp=pp, sequence_parallel=sequence_parallel and tp > 1,
               pipeline_microbatches=pipeline_microbatches,
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
    guess = max(1, min(limit, int((cap - (2 * one - two)) // max(1, two - one))))
    b = largest_fitting(lambda n: memory_plan(cfg, seq_len=seq_len, micro_batch=n, **kw)["total"] <= cap,
                        start=guess, limit=limit)
    return {"max_micro_batch": b, "capacity_bytes": cap,
            "plan": memory_plan(cfg, seq_len=seq_len, micro_batch=max(b, 1), **kw)}
