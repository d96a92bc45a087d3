"""Data-parallel scaling model: how step time grows with the number of GPUs.

step time(n) = compute time of one rank's step + the exposed part of the gradient all-reduce.

- all-reduce: DDP reduces gradients in buckets of 25 MB (``bucket_cap_mb``; PyTorch DDP docs)
  with a ring: each bucket of S bytes over n ranks takes 2(n-1)/n · S/B + 2(n-1)·alpha (Patarasuk
  & Yuan, JPDC 2009; docs/references.md C5), B the per-node network bandwidth, alpha the per-hop
  latency. In a ring ordered by node every inter-node link carries the full 2(n-1)/n · S, so
  several GPUs per node share one NIC without changing the bandwidth term; inside one node the
  intra-node link (NVLink/PCIe) is used instead.
- overlap: buckets are reduced while backward still runs. A fraction ``overlap`` of the backward
  time (2/3 of compute: backward = 2 x forward, Kaplan arXiv:2001.08361 eq. 2.2) can hide
  communication; the last bucket can only start when backward ends, so it is always exposed.
  exposed = max(last bucket, comm - overlap x backward). For labkit's model the last bucket is
  the word embedding's (``embedding_bucket_bytes``: ready only when backward reaches the lookup).
- gradient accumulation of k micro-batches multiplies compute by k and communicates once.
- calibration: compute time is a measured single-rank step time (``step_time_1``), or is
  planned from a model's FLOPs per token at an assumed MFU (``compute_time``).

  (``exposed_s``; bucketed overlap as in Li et al., "PyTorch Distributed", VLDB 2020,
  arXiv:2006.15704 section 3.2). Calibrated against the measured ``comm_exposed_s`` of DDP
  runs (tests/study/test_scaling.py: 2 gloo ranks, two bucket sizes, the per-bucket all-reduce
  and backward times measured in the same run); ``fit_overlap`` turns a measured exposed time
  into the ``overlap`` that reproduces it.

efficiency(n) = step time(1) / step time(n) (weak scaling, docs/measurement.md).
``comm_hidden`` and the network limit are read from the exposed time: the all-reduce is hidden
when only the bucket ready last is exposed (every other bucket finished behind backward) and that
bucket is under half of the all-reduce; a model whose gradients fit one bucket hides nothing
(exposed = comm). The network becomes the limit at the smallest n where it is not hidden, and
efficiency falls after it.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "BUCKET_BYTES", "INTRA_NODE", "NETWORKS", "STUDY_PRECISIONS", "bucketed_allreduce", "calibrate", "comm_hidden",
    "compute_time", "peak_of", "efficiency_table", "embedding_bucket_bytes", "exposed_s", "fit_overlap",
    "network_limit", "one_story", "precision_experiment", "precision_summary", "ring_allreduce_time", "step_time",
    "study_scaling", "compressed_grad_bytes", "compression_table", "link_step_time", "model_scaling"
]

NETWORKS: dict[str, dict[str, Any]] = {
    "25GbE": {"bandwidth": 25e9 / 8, "latency": 20e-6,
              "source": "25 Gb/s Ethernet per node, the study's network (docs/references.md A, unconfirmed); "
                        "latency 20 us per hop is a lab parameter (TCP/RoCE), unconfirmed"},
    "100GbE": {"bandwidth": 100e9 / 8, "latency": 10e-6, "source": "100 Gb/s Ethernet; latency a lab parameter"},
    "IB-HDR": {"bandwidth": 200e9 / 8, "latency": 3e-6,
               "source": "InfiniBand HDR 200 Gb/s per node; latency a lab parameter"},
    "IB-NDR": {"bandwidth": 400e9 / 8, "latency": 3e-6,
               "source": "InfiniBand NDR 400 Gb/s per node; latency a lab parameter"},
}
"""Per-node network options: bandwidth in bytes/s, per-hop latency alpha in seconds."""

INTRA_NODE = {"bandwidth": 300e9, "latency": 5e-6,
              "source": "NVLink bridge between the two H100 NVL of a node: 600 GB/s bidirectional "
                        "(https://www.nvidia.com/en-us/data-center/h100/), 300 GB/s each way"}
"""The link between GPUs of one node, used while all ranks sit on one node."""

BUCKET_BYTES = 25 * 2**20
"""DDP's default gradient bucket, ``bucket_cap_mb=25`` (torch.nn.parallel.DistributedDataParallel)."""


def ring_allreduce_time(nbytes: float, n: int, *, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``n`` ranks: 2(n-1)/n · S/B + 2(n-1)·alpha
    (Patarasuk & Yuan 2009). 0 for n = 1. Raises ValueError for n < 1 or bandwidth <= 0."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    if bandwidth <= 0:
        raise ValueError(f"bandwidth: must be positive, got {bandwidth}")
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def bucketed_allreduce(grad_bytes: float, n: int, *, bandwidth: float, latency: float,
                       bucket_bytes: float = BUCKET_BYTES) -> dict[str, float]:
    """All-reduce of ``grad_bytes`` in buckets of ``bucket_bytes`` (the last one smaller), each a
    ring all-reduce. Returns {"buckets", "total_s", "last_bucket_s"}."""
    full, rest = divmod(grad_bytes, bucket_bytes)
    sizes = [bucket_bytes] * int(full) + ([rest] if rest else [])
    times = [ring_allreduce_time(s, n, bandwidth=bandwidth, latency=latency) for s in sizes]
    return {"buckets": len(sizes), "total_s": sum(times), "last_bucket_s": times[-1] if times else 0.0}


def exposed_s(*, comm_s: float, last_bucket_s: float, backward_s: float, overlap: float = 1.0) -> float:
    """Exposed all-reduce seconds of one step (module docstring): max(last bucket, comm - overlap x
    backward). ``comm_s``: all buckets' all-reduce seconds; ``last_bucket_s``: the last one's,
    which starts only when backward ends; ``backward_s``: the backward time that can hide the
    rest. ``step_time`` uses it; tests/study/test_scaling.py checks it against DDP's measured
    ``comm_exposed_s`` with the inputs measured in the same run."""
    return max(last_bucket_s, comm_s - overlap * backward_s)


def fit_overlap(*, comm_s: float, backward_s: float, exposed_s: float) -> float:
    """The ``overlap`` of ``step_time``'s closed form (exposed = comm - overlap x backward) that
    reproduces a measured exposed time: (comm - exposed) / backward, clipped to [0, 1]. Raises
    ValueError for a non-positive backward time."""
    if not backward_s > 0:
        raise ValueError(f"backward_s: must be positive, got {backward_s}")
    return min(1.0, max(0.0, (comm_s - exposed_s) / backward_s))
def embedding_bucket_bytes(cfg, *, grad_dtype_bytes: int = 4, bucket_bytes: float = BUCKET_BYTES) -> float:
    """Bytes of the DDP bucket reduced last for labkit's model ``cfg``: the one holding the word
    embedding. Its gradient is complete only when backward reaches the embedding lookup (with
    tied weights the decoder's share arrives first), so it is ready last; DDP buckets the
    parameters defined first (the embeddings) apart and reduces that bucket last, and a
    parameter larger than the cap fills a bucket alone (torch/nn/parallel/distributed.py,
    ``_compute_bucket_assignment_by_size``, reversed). The embedding-side parameters (word,
    position, token-type tables, embedding norm) at ``grad_dtype_bytes`` each, at least one full
    bucket (or every gradient when the model is smaller)."""
    from labkit.model import count_parameters

    h = cfg.hidden_size
    positions = cfg.max_position_embeddings * (cfg.position_embedding == "absolute")
    tables = cfg.vocab_size + cfg.type_vocab_size + positions
    embedding = grad_dtype_bytes * (tables * h + 2 * h)
    return max(float(embedding), min(float(bucket_bytes), float(grad_dtype_bytes * count_parameters(cfg)["total"])))


def step_time(n_gpus: int, *, compute_s: float, grad_bytes: float, network: str = "25GbE",
              gpus_per_node: int = 2, overlap: float = 1.0, grad_accum: int = 1,
              bucket_bytes: float = BUCKET_BYTES, bandwidth: float | None = None,
              latency: float | None = None, last_bucket_bytes: float | None = None) -> dict[str, float]:
    """Modelled seconds of one optimiser step at ``n_gpus`` data-parallel ranks.

    ``compute_s``: one micro-batch's forward + backward on one GPU (measured at 1 rank, or
    ``compute_time``). ``grad_bytes``: bytes all-reduced per step (parameters x 4 for fp32
    gradients, x 2 with a bf16 compression hook). ``network`` names ``NETWORKS`` (``bandwidth``
    / ``latency`` override it). ``last_bucket_bytes``: the bucket whose gradients are ready last,
    exposed after backward (``embedding_bucket_bytes`` for labkit's model; None: the remainder
    bucket of ``bucketed_allreduce``). Returns {"n_gpus", "compute_s", "comm_s", "last_bucket_s",
    "exposed_s", "step_s", "comm_hidden" (``comm_hidden``: from the exposed time)}. Raises
    ValueError naming a bad argument.
    """
    if network not in NETWORKS:
        raise ValueError(f"network: unknown {network!r}; known networks are {sorted(NETWORKS)}")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap: must be in [0, 1], got {overlap}")
    if compute_s <= 0 or grad_accum < 1 or gpus_per_node < 1:
        raise ValueError(f"compute_s/grad_accum/gpus_per_node: must be positive, got {compute_s}/{grad_accum}/{gpus_per_node}")
    net = NETWORKS[network] if n_gpus > gpus_per_node else INTRA_NODE
    bw = bandwidth if bandwidth is not None and n_gpus > gpus_per_node else net["bandwidth"]
    lat = latency if latency is not None and n_gpus > gpus_per_node else net["latency"]
    comm = bucketed_allreduce(grad_bytes, n_gpus, bandwidth=bw, latency=lat, bucket_bytes=bucket_bytes)
    compute = compute_s * grad_accum
    backward = compute_s * 2 / 3  # only the last micro-batch's backward overlaps the all-reduce
    last = comm["last_bucket_s"] if last_bucket_bytes is None else \
        ring_allreduce_time(min(last_bucket_bytes, grad_bytes), n_gpus, bandwidth=bw, latency=lat)
    exposed = 0.0 if n_gpus == 1 else exposed_s(comm_s=comm["total_s"], last_bucket_s=last, backward_s=backward,
                                               overlap=overlap)
    last = 0.0 if n_gpus == 1 else last
    return {"n_gpus": n_gpus, "compute_s": compute, "comm_s": comm["total_s"], "last_bucket_s": last,
            "exposed_s": exposed, "step_s": compute + exposed,
            "comm_hidden": comm_hidden(exposed_s=exposed, last_bucket_s=last, comm_s=comm["total_s"])}


def comm_hidden(*, exposed_s: float, last_bucket_s: float, comm_s: float) -> bool:
    """Whether a step's all-reduce hides behind backward, read from its exposed time: only the
    bucket ready last is exposed (``exposed_s`` is that bucket's ``last_bucket_s``: every other
    bucket finished within backward) and that bucket is at most half of the all-reduce
    (``comm_s``). A model whose gradients fit one bucket never hides it (exposed = comm, the
    whole all-reduce after backward); a backward too short for the buckets exposes more than the
    last one. True when nothing is communicated (one rank)."""
    return exposed_s <= min(last_bucket_s, comm_s / 2)


def peak_of(device: str, precision: str) -> float:
    """Dense peak FLOP/s of one ``device`` (a ``labkit.study.plan.DEVICES`` name) at ``precision``
    ("fp32" on the CUDA cores, "tf32", "bf16", "fp16"; ``labkit.measure.DEVICES``, the one device
    table). ValueError naming the precision and the device when the table has no such peak (fp32
    on the H200 and A100 rows), or for an unknown device."""
    from labkit.study.plan import device_info

    info = device_info(device)
    peak = info["peaks"].get(precision)
    if peak is None:
        raise ValueError(f"precision: no {precision!r} peak for {info['device']} in labkit.measure.DEVICES "
                         f"(it has {', '.join(sorted(info['peaks']))})")
    return peak


def compute_time(flops_per_token: float, *, seq_len: int, micro_batch: int, peak_flops: float,
                 mfu: float = 0.4) -> float:
    """Seconds of one micro-batch's forward + backward at a given MFU: tokens x FLOPs/token /
    (MFU x peak) (PaLM arXiv:2204.02311 appendix B; docs/references.md B plans 30-45 % MFU)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu: must be in (0, 1], got {mfu}")
    return seq_len * micro_batch * flops_per_token / (mfu * peak_flops)


def efficiency_table(*, compute_s: float, grad_bytes: float, tokens_per_step: int,
                     gpus=(1, 2, 4, 8, 16, 32, 64, 128, 256), **kw):
    """Predicted weak scaling from 1 to 256 GPUs: polars DataFrame with n_gpus, nodes (n /
    gpus_per_node, at least 1), compute_s, comm_s, last_bucket_s, exposed_s, step_s, tokens_per_s
    (all ranks), ideal_tokens_per_s, efficiency = step_s(1) / step_s(n), comm_hidden
    (``comm_hidden``). ``kw`` go to ``step_time`` (network, gpus_per_node, overlap, grad_accum, ...)."""
    import polars as pl

    rows = [step_time(n, compute_s=compute_s, grad_bytes=grad_bytes, **kw) for n in gpus]
    gpn = kw.get("gpus_per_node", 2)
    accum = kw.get("grad_accum", 1)
    t1 = step_time(1, compute_s=compute_s, grad_bytes=grad_bytes, **kw)["step_s"]
    df = pl.DataFrame(rows).with_columns(
        nodes=(pl.col("n_gpus") / gpn).ceil().cast(pl.Int64),
        tokens_per_s=pl.col("n_gpus") * tokens_per_step * accum / pl.col("step_s"),
        ideal_tokens_per_s=pl.col("n_gpus") * tokens_per_step * accum / t1,
        efficiency=t1 / pl.col("step_s"))
    return df.select("n_gpus", "nodes", "compute_s", "comm_s", "last_bucket_s", "exposed_s", "step_s",
                     "tokens_per_s", "ideal_tokens_per_s", "efficiency", "comm_hidden")


def network_limit(table) -> dict[str, Any]:
    """Where the network becomes the limit in an ``efficiency_table``, read from the exposed time:
    the smallest n > 1 whose all-reduce is not hidden behind backward ("first_exposed_n":
    ``comm_hidden`` false, more than the last bucket exposed or a last bucket that is most of the
    all-reduce; None if never) and the smallest n with efficiency below 0.9 ("below_90pct_n",
    None if never)."""
    import polars as pl

    exposed = table.filter(~pl.col("comm_hidden") & (pl.col("n_gpus") > 1))
    low = table.filter(pl.col("efficiency") < 0.9)
    return {"first_exposed_n": exposed["n_gpus"].min() if exposed.height else None,
            "below_90pct_n": low["n_gpus"].min() if low.height else None}


def study_scaling(model: str, *, micro_batch: int, seq_len: int = 512, device: str = "H100 NVL",
                  mfu: float = 0.4, grad_dtype_bytes: int = 4, vocab_size: int | None = None,
                  step_time_1: float | None = None, sparse_head: bool | None = None,
                  mlm_probability: float = 0.15, precision: str = "bf16", **kw):
    """``efficiency_table`` for a named preset (``labkit.model.MODEL_SIZES``) on ``device``:
    compute from ``step_time_1`` when measured, else from FLOPs/token at ``mfu`` of the
    ``precision``'s dense peak (``peak_of``: fp32 on the CUDA cores is 14x slower than bf16 on an
    H100 NVL's tensor cores); gradients of
    all parameters at ``grad_dtype_bytes`` each (4: DDP's fp32 gradients). FLOPs/token count the
    MLM decoder at every position with the dense head (``sparse_head=False``), at the masked
    fraction ``mlm_probability`` with the sparse one; None keeps ``ModelConfig``'s default head."""
    from labkit.model import count_parameters, flops_per_token, model_config
    from labkit.study.plan import STUDY_VOCAB

    head = {} if sparse_head is None else {"sparse_head": sparse_head}
    cfg = model_config(model, vocab_size or STUDY_VOCAB, max_position_embeddings=max(512, seq_len), **head)
    fpt = flops_per_token(cfg, seq_len, mlm_probability=mlm_probability)
    kw.setdefault("last_bucket_bytes", embedding_bucket_bytes(cfg, grad_dtype_bytes=grad_dtype_bytes,
                                                              bucket_bytes=kw.get("bucket_bytes", BUCKET_BYTES)))
    return model_scaling(params=count_parameters(cfg)["total"], flops_per_token=fpt, micro_batch=micro_batch,
                         seq_len=seq_len, device=device, mfu=mfu, grad_dtype_bytes=grad_dtype_bytes,
                         step_time_1=step_time_1, precision=precision, **kw)


def model_scaling(*, params: int, flops_per_token: float, micro_batch: int, seq_len: int,
                  device: str = "H100 NVL", mfu: float = 0.4, grad_dtype_bytes: int = 4,
                  step_time_1: float | None = None, params_ready_last: int | None = None,
                  precision: str = "bf16", **kw):
    """``efficiency_table`` of any model from its parameter count and its forward + backward
    FLOPs per token (``labkit.study.memory.plan_model`` counts both; ``study_scaling`` gives a
    preset's from the formulas): compute from ``step_time_1`` when measured, else tokens x
    FLOPs/token at ``mfu`` of ``device``'s dense peak at ``precision`` (``peak_of``,
    ``compute_time``); all ``params`` gradients
    all-reduced at ``grad_dtype_bytes`` each. ``params_ready_last``: the parameters defined
    before the model's first block (its embeddings), whose bucket DDP reduces last
    (``embedding_bucket_bytes``): exposed as max(their bytes, one bucket or all gradients);
    None leaves ``last_bucket_bytes`` in ``kw`` (or the remainder bucket). ``kw`` go to
    ``step_time``. Raises ValueError for an unknown device or network, or a precision without a
    peak on ``device``."""
    compute = step_time_1 or compute_time(flops_per_token, seq_len=seq_len, micro_batch=micro_batch,
                                          peak_flops=peak_of(device, precision), mfu=mfu)
    grad_bytes = grad_dtype_bytes * params
    if params_ready_last is not None:
        kw.setdefault("last_bucket_bytes", max(float(grad_dtype_bytes * params_ready_last),
                                               min(float(kw.get("bucket_bytes", BUCKET_BYTES)), float(grad_bytes))))
    return efficiency_table(compute_s=compute, grad_bytes=grad_bytes, tokens_per_step=seq_len * micro_batch, **kw)


def calibrate(step_time_1: float) -> float:
    """The compute time of the model, from a measured single-rank step time (seconds): at one
    rank there is no all-reduce, so compute = step time. Raises ValueError if not positive."""
    if not step_time_1 > 0 or math.isnan(step_time_1):
        raise ValueError(f"step_time_1: must be a positive number of seconds, got {step_time_1}")
    return step_time_1


def one_story(*, target_efficiency: float = 0.9, n_gpus: int = 256, network: str = "25GbE",
              mfus: tuple[float, ...] = tuple(i / 100 for i in range(1, 61))):
    """Settings under which lesson 4 (data-parallel efficiency >= ``target_efficiency`` at
    ``n_gpus`` on ``network``, no gradient accumulation) and lesson 5 (the planner's largest
    micro-batch within 10 % of the study's, ``labkit.study.parallel.study_table``) hold at once.

    Memory does not depend on MFU or the network, so lesson 5 fixes the candidate settings
    (sequence length, precision, attention kernel, head) per model; for each, the largest
    achieved MFU in ``mfus`` (relative to the bf16 dense peak, FLOPs per token with the head
    counted) at which lesson 4 holds. polars DataFrame: model, seq_len, precision, attention,
    sparse_head, planned, study, max_mfu (None: no MFU in the grid), efficiency_at_max_mfu,
    shared_by_both_models (the same setting reproduces both models' micro-batches)."""
    import polars as pl

    from labkit.study.parallel import study_table
    from labkit.study.plan import STUDY_MICRO_BATCH

    table = study_table()
    ok = table.filter(pl.col("within_10pct"))
    keys = ("seq_len", "precision", "attention", "sparse_head")
    per_model = {m: {tuple(r[k] for k in keys) for r in ok.filter(pl.col("model") == m).iter_rows(named=True)}
                 for m in STUDY_MICRO_BATCH}
    shared = set.intersection(*per_model.values()) if per_model else set()
    rows = []
    for r in ok.iter_rows(named=True):
        best, eff_best = None, None
        for m in mfus:
            t = study_scaling(r["model"], micro_batch=STUDY_MICRO_BATCH[r["model"]], seq_len=r["seq_len"], mfu=m,
                              sparse_head=r["sparse_head"], network=network)
            eff = t.filter(pl.col("n_gpus") == n_gpus)["efficiency"].item()
            if eff >= target_efficiency:
                best, eff_best = m, eff
        rows.append({**{k: r[k] for k in ("model", *keys, "planned", "study")}, "max_mfu": best,
                     "efficiency_at_max_mfu": eff_best,
                     "shared_by_both_models": tuple(r[k] for k in keys) in shared})
    return pl.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# The precision experiment (lesson 4 under the study's own settings)
# --------------------------------------------------------------------------------------------

STUDY_PRECISIONS = ("fp32", "tf32", "bf16")
"""fp32 on the CUDA cores (the study's: Lightning's default 32-bit, torch's matmul precision
"highest"), TF32 and bf16 on the tensor cores; peaks ``labkit.measure.DEVICES``."""


def _precision_compute(cfg: Any, device: str, precisions: Any, *, seq_len: int, micro_batch: int, mfu: float,
                       mlm_probability: float) -> list[tuple[str, float, float]]:
    """[(precision, dense peak FLOP/s of ``device`` at it, one micro-batch's compute seconds at ``mfu``)]
    per precision (``compute_time`` of ``model.flops_per_token``; peaks from labkit.measure.DEVICES,
    the one device table). ValueError for a precision without a peak on ``device``."""
    from labkit.model import flops_per_token

    fpt = flops_per_token(cfg, seq_len, mlm_probability=mlm_probability)
    out = []
    for precision in precisions:
        peak = peak_of(device, precision)
        out.append((precision, peak, compute_time(fpt, seq_len=seq_len, micro_batch=micro_batch, peak_flops=peak,
                                                  mfu=mfu)))
    return out


def precision_experiment(cfg, *, micro_batch: int, seq_len: int, device: str = "H100 NVL", network: str = "25GbE",
                         gpus=(1, 2, 4, 8, 16, 32, 64, 128, 256), gpus_per_node: int = 2, mfu: float = 0.4,
                         precisions=STUDY_PRECISIONS, mlm_probability: float = 0.15):
    """Planned step time and data-parallel efficiency of one model (a ``ModelConfig``) at each
    precision: the same micro-batch, network and assumed MFU, compute = tokens x FLOPs per token
    / (``mfu`` x the precision's dense peak on ``device``), fp32 gradients all-reduced in DDP's
    buckets (autocast keeps them fp32 in every precision), the bucket holding the word embedding
    reduced last (``embedding_bucket_bytes``, as ``study_scaling`` and ``compression_table``).
    polars DataFrame: precision, peak_flops, the ``efficiency_table`` columns. Raises ValueError
    for a precision without a peak on ``device``."""
    import polars as pl

    from labkit.model import count_parameters

    grad_bytes = 4 * count_parameters(cfg)["total"]
    frames = []
    for precision, peak, compute in _precision_compute(cfg, device, precisions, seq_len=seq_len,
                                                       micro_batch=micro_batch, mfu=mfu,
                                                       mlm_probability=mlm_probability):
        table = efficiency_table(compute_s=compute, grad_bytes=grad_bytes, tokens_per_step=seq_len * micro_batch,
                                 gpus=gpus, network=network, gpus_per_node=gpus_per_node,
                                 last_bucket_bytes=embedding_bucket_bytes(cfg, grad_dtype_bytes=4))
        frames.append(table.select(pl.lit(precision).alias("precision"), pl.lit(peak).alias("peak_flops"),
                                   pl.all()))
    return pl.concat(frames)


def precision_summary(table, *, mfu: float = 0.4):
    """One row per precision of a ``precision_experiment`` table: compute_s (one GPU's step),
    comm_s and efficiency at its largest n_gpus, first_exposed_n / below_90pct_n
    (``network_limit``: where the network becomes the limit), and break_even_mfu: the achieved
    MFU up to which the all-reduce at the largest n hides behind backward (``comm_hidden``:
    every bucket but the last finishes within backward, 2/3 of compute; compute shrinks as MFU
    grows), ``mfu`` x compute_s / (1.5 x (comm_s - last_bucket_s)). Above 1 (100 %) no
    achievable MFU exposes it; None when the last bucket is half the all-reduce or more, which
    no MFU hides (a model whose gradients fit one bucket)."""
    import polars as pl

    rows = []
    for precision in table["precision"].unique(maintain_order=True):
        t = table.filter(pl.col("precision") == precision)
        last = t.row(t.height - 1, named=True)
        limit = network_limit(t)
        spread = last["comm_s"] - last["last_bucket_s"]  # what must finish within backward
        even = mfu * t["compute_s"][0] / (1.5 * spread) if last["last_bucket_s"] < last["comm_s"] / 2 else None
        rows.append({"precision": precision, "peak_flops": last["peak_flops"], "n_gpus": last["n_gpus"],
                     "compute_s": t["compute_s"][0], "comm_s": last["comm_s"], "efficiency": last["efficiency"],
                     **limit, "break_even_mfu": even})
    return pl.DataFrame(rows)


# --------------------------------------------------------------------------------------------
# One real link: the shaped network hosts (labkit sweep network, docs/measurement.md)
# --------------------------------------------------------------------------------------------


def link_step_time(*, compute_s: float, bucket_bytes, bandwidth: float, latency: float = 0.0, n: int = 2,
                   backward_fraction: float = 2 / 3, wire_ratio: float = 1.0,
                   collective_rate: float | None = None) -> dict[str, float]:
    """Modelled seconds of one DDP step whose gradient buckets share ONE link of ``bandwidth``
    bytes/s (the shaped h1-h2 link; every rank's NIC at large scale), one after another.

    ``compute_s``: the step's compute, measured at 1 rank under the same CPU load.
    ``bucket_bytes``: the bytes of each gradient all-reduce in launch order (``comm_bucket_bytes``
    of a metrics record: DDP's buckets after its first-step rebuild, after any compression); the
    last one holds the tied word embedding and is ready only when backward ends (docstring of
    ``embedding_bucket_bytes``). The others become ready evenly over the backward pass
    (``backward_fraction`` of compute_s, 2/3: backward = 2 x forward). Each all-reduce takes
    ``ring_allreduce_time`` of its bytes x ``wire_ratio`` (gloo's own bytes on the wire per
    gradient byte, measured from the veth's counters) and starts when it is ready and the link
    is free: the link is one queue, so a bucket that cannot finish during backward delays every
    later one (``labkit.train.buckets.queue_exposed_s``, the queue ``bucket_cap_mb="auto"`` sizes
    by). Exposed = when the link finishes minus when backward ends (>= 0).
    ``collective_rate`` (bytes/s; None: not modelled): gloo's all-reduce rate between two
    processes on one host, its CPU cost (``labkit.study.network_sweep.measure_collective_rate``);
    an all-reduce then takes the longer of its wire time and bytes / collective_rate (the CPU
    copies and sums while the link carries, so the slower of the two sets the pace). On a fast
    link that CPU time is what remains (docs/measurement.md, "A network that really limits").

    Returns {"compute_s", "comm_s" (sum of the all-reduces), "exposed_s", "step_s" (compute +
    exposed), "last_bucket_s"}. Raises ValueError for a non-positive compute time or bandwidth.
    (Bucketed overlap: Li et al. 2020, arXiv:2006.15704 section 3.2; ring: Patarasuk & Yuan 2009.)"""
    if not compute_s > 0:
        raise ValueError(f"compute_s: must be positive, got {compute_s}")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth: must be positive, got {bandwidth}")
    if collective_rate is not None and not collective_rate > 0:
        raise ValueError(f"collective_rate: must be positive or None, got {collective_rate}")
    from labkit.train.buckets import queue_exposed_s

    sizes = [float(b) * wire_ratio for b in bucket_bytes]
    backward = compute_s * backward_fraction
    times = [ring_allreduce_time(size, n, bandwidth=bandwidth, latency=latency) for size in sizes]
    if collective_rate is not None:
        times = [max(t, float(b) / collective_rate) for t, b in zip(times, bucket_bytes)]
    ready = [backward if k == len(sizes) - 1 else backward * (k + 1) / len(sizes) for k in range(len(sizes))]
    exposed = queue_exposed_s(times, ready, backward)
    return {"compute_s": compute_s, "comm_s": sum(times), "exposed_s": exposed, "step_s": compute_s + exposed,
            "last_bucket_s": times[-1] if times else 0.0}


def compressed_grad_bytes(cfg, compression: str, *, powersgd_rank: int = 4, min_compression_rate: float = 2.0) -> int:
    """Bytes one rank all-reduces per step for labkit's model ``cfg`` under
    ``TrainConfig.parallel.grad_compression``: "none" 4 per parameter (fp32 gradients), "bf16" 2, "powersgd"
    (after its warm-up) the rank-r factors P (n x r) and Q (m x r) of each n x m gradient matrix
    worth compressing and every other tensor whole, in fp32, r = min(n, m, ``powersgd_rank``), by
    torch's rule (``labkit.train.comm.powersgd_wire_bytes``, whose 2-rank runs it matches). The
    model is built on the meta device (no memory). Raises ValueError for another compression."""
    import torch

    from labkit.model import BertMLM

    if compression not in ("none", "bf16", "powersgd"):
        raise ValueError(f"compression: unknown {compression!r}; choose 'none', 'bf16' or 'powersgd'")
    with torch.device("meta"):
        params = [p for p in BertMLM(cfg).parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    if compression != "powersgd":
        return total * (4 if compression == "none" else 2)
    elements = 0
    for p in params:
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, powersgd_rank)
        elements += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return 4 * elements


def compression_table(cfg, *, micro_batch: int, seq_len: int, device: str = "H100 NVL", network: str = "25GbE",
                      n_gpus: int = 256, gpus_per_node: int = 2, mfu: float = 0.4, precisions=STUDY_PRECISIONS,
                      powersgd_rank: int = 4, mlm_probability: float = 0.15):
    """The planner's levers against the network: per precision (``precision_experiment``'s compute)
    and gradient compression ("none", "bf16", "powersgd" at ``powersgd_rank``), the bytes all-reduced
    per step (``compressed_grad_bytes``) and the efficiency and exposed all-reduce at ``n_gpus``.
    The compute does not change with the compression (the compression's own CPU/GPU time is not
    counted: small next to a step on a GPU, measured on the shaped link by bench_network).
    polars DataFrame: precision, grad_compression, grad_bytes, compute_s, exposed_s, efficiency."""
    import polars as pl

    rows = []
    for precision, _, compute in _precision_compute(cfg, device, precisions, seq_len=seq_len, micro_batch=micro_batch,
                                                    mfu=mfu, mlm_probability=mlm_probability):
        for comp in ("none", "bf16", "powersgd"):
            grad = compressed_grad_bytes(cfg, comp, powersgd_rank=powersgd_rank)
            last = embedding_bucket_bytes(cfg, grad_dtype_bytes=4 if comp == "none" else 2) if comp != "powersgd" \
                else None
            t1 = step_time(1, compute_s=compute, grad_bytes=grad, network=network, gpus_per_node=gpus_per_node)
            tn = step_time(n_gpus, compute_s=compute, grad_bytes=grad, network=network, gpus_per_node=gpus_per_node,
                           last_bucket_bytes=last)
            rows.append({"precision": precision, "grad_compression": comp, "grad_bytes": grad, "compute_s": compute,
                         "exposed_s": tn["exposed_s"], "efficiency": t1["step_s"] / tn["step_s"]})
    return pl.DataFrame(rows)
