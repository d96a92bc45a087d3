"""Planning any model: how large a micro-batch fits on one rank, counted rather than estimated.

``plan_model(make_model, make_batch, device=..., precision=...)`` takes any ``torch.nn.Module``
and a function giving its forward's keyword arguments for micro-batch b, and answers the
largest micro-batch with every term behind it:

    peak of one rank = state + max(activations(b) + transients(b), optimizer-step temporaries)

(the step's own peak, forward and backward, against the optimiser step's, after backward has
freed the activations; FSDP's gathered units are among the transients)

- state (``state_bytes``): parameters, gradients, DDP's buckets and the optimiser's state, per
  rank, as labkit's training really holds them (labkit/train/dist.py, labkit/train/optim.py):
  DDP with ``gradient_as_bucket_view=True`` (the gradients are views of the buckets, so no
  second copy), ZeRO-1 with ``ZeroRedundancyOptimizer``'s own greedy partition, FSDP2 with its
  per-parameter padding, AdamW's two fp32 moments and its fp32 ``step`` per tensor. Checked
  against the tensors each rank of a 2-rank gloo run holds (tests/train/test_sharded_state.py).
- activations (``labkit.study.counting.count_steps``): the bytes autograd saves, counted at
  b = 2 and 3 (linear from there on; b = 1 can sit off the line: some kernels take other paths)
  on fake tensors where the model allows it, else on CPU tensors; on a GPU device the count
  keeps what CUDA keeps (``cuda_like.CudaLike``: its attention kernel, 1-byte dropout masks,
  its fp32 autocast ops), and the choices are stated in ``corrections``; FSDP in bf16 is
  counted on bf16 parameters, as its mixed-precision policy runs the forward.
- transients: the rest of the step's counted peak (the held logits, their gradient and the
  other backward temporaries), the AdamW step's temporaries of the implementation labkit runs
  (fused: none; foreach: a copy of the second moments; for-loop: two copies of the largest
  parameter), and under FSDP the parameters gathered per unit (the root, the unit in use and
  the one prefetched, and one unit's reduce-scatter input).

The step's peak is a maximum over time, so it is convex and piecewise linear in b (at a small b a
fixed tensor can set it, at a large one the activations): the answer is solved from the line
through b = 2, 3, then, where counting is cheap (fake tensors, or a CPU count under
``verify_limit_bytes``), from the line through the counts at the answer, and checked by counting
at b and b + 1. FLOPs per token come from ``FlopCounterMode`` over the same forward and backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from labkit.study.counting import count_steps
from labkit.study.plan import device_info, largest_fitting

__all__ = [
    "activation_bytes", "gathered_bytes", "labkit_model", "max_micro_batch", "model_state_bytes", "optimizer_impl",
    "optimizer_step_bytes", "params_before_blocks", "plan_model", "state_bytes", "total_at", "zero1_partition"
]

SHARDINGS = ("none", "ddp", "zero1", "fsdp")
STAGE_OF = {"none": 0, "ddp": 0, "zero1": 1, "fsdp": 3}
OPTIMIZERS = {"adamw": 8, "sgd": 0}
"""Optimiser state bytes per parameter: AdamW's exp_avg and exp_avg_sq in fp32 (arXiv:1711.05101);
plain SGD keeps none. AdamW also keeps a 4-byte fp32 ``step`` per parameter tensor."""

FIT_AT = (2, 3)


def _rows(d0: int, dp: int, rank: int) -> tuple[int, int]:
    """(rows this rank holds, padded rows) of a dim-0 FSDP2 shard: ``torch.chunk`` sizes
    ceil(d0 / dp), the last ranks fewer or none, each padded to the first chunk's size
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``_init_sharded_param``)."""
    chunk = math.ceil(d0 / dp) if d0 else 0
    return max(0, min(chunk, d0 - rank * chunk)), chunk


def zero1_partition(params: list[dict[str, Any]], dp: int) -> list[list[int]]:
    """Indices of ``params`` each rank's ``ZeroRedundancyOptimizer`` steps: per parameter group
    (labkit's two: matrices, then vectors; labkit/train/optim.py), largest first, each to the
    rank holding the fewest elements so far (``_partition_parameters`` in
    torch/distributed/optim/zero_redundancy_optimizer.py)."""
    sizes, out = [0] * dp, [[] for _ in range(dp)]
    groups = [[i for i, p in enumerate(params) if len(p["shape"]) >= 2 and p["requires_grad"]],
              [i for i, p in enumerate(params) if len(p["shape"]) < 2 and p["requires_grad"]]]
    for group in groups:
        for i in sorted(group, key=lambda j: params[j]["numel"], reverse=True):
            r = sizes.index(min(sizes))
            out[r].append(i)
            sizes[r] += params[i]["numel"]
    return out


def state_bytes(params: list[dict[str, Any]], *, sharding: str = "ddp", dp: int = 1, rank: int | None = None,
                zero_stage: int | None = None, optimizer: str = "adamw") -> dict[str, int]:
    """Model-state bytes one rank holds during a step: {"params", "grads", "buckets", "optimizer",
    "optimizer_steps", "total"}.

    ``params``: ``labkit.study.counting.parameter_table`` rows. ``rank``: that rank (None: the
    rank holding the most). Stages (ZeRO, arXiv:1910.02054 section 5.1): 0 replicates
    everything; 1 (zero1) shards the optimiser state by ``zero1_partition``; 2 shards the
    gradients and the optimiser state in FSDP2's dim-0 shards (labkit's fsdp with
    ``fsdp_reshard_after_forward=False``); 3 (fsdp) also the parameters. A dim-0 shard is padded
    (``_rows``) in the parameters and gradients (FSDP2's padded shard and reduce-scatter output),
    not in the moments (AdamW's ``zeros_like`` of the unpadded local shard). Gradients are fp32 as the
    parameters (FSDP2's reduce dtype is fp32 under bf16, labkit/train/dist.py); DDP's buckets
    cost nothing more with ``gradient_as_bucket_view=True``. Raises ValueError naming a bad field.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding: got {sharding!r}; allowed values are {SHARDINGS}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: got {optimizer!r}; allowed values are {tuple(OPTIMIZERS)}")
    stage = STAGE_OF[sharding] if zero_stage is None else zero_stage
    if stage not in (0, 1, 2, 3) or dp < 1:
        raise ValueError(f"zero_stage/dp: need a stage in 0-3 and dp >= 1, got {stage}/{dp}")
    if rank is None:
        per = [state_bytes(params, sharding=sharding, dp=dp, rank=r, zero_stage=stage, optimizer=optimizer)
               for r in range(dp)]
        return max(per, key=lambda s: s["total"])
    mine = set(zero1_partition(params, dp)[rank]) if stage == 1 else None
    out = dict.fromkeys(("params", "grads", "buckets", "optimizer", "optimizer_steps"), 0)
    for i, p in enumerate(params):
        d0 = p["shape"][0] if p["shape"] else 1
        per_row = p["numel"] // d0 if d0 else 0
        held, padded = _rows(d0, dp, rank) if stage >= 2 else (d0, d0)
        out["params"] += p["bytes"] * (padded * per_row if stage == 3 else p["numel"])
        if not p["requires_grad"]:
            continue
        out["grads"] += 4 * padded * per_row
        if stage != 1 or i in mine:
            out["optimizer"] += OPTIMIZERS[optimizer] * held * per_row
            out["optimizer_steps"] += 4 * (optimizer == "adamw")
    out["total"] = sum(out.values())
    return out


def optimizer_step_bytes(params: list[dict[str, Any]], impl: str, *, sharding: str = "ddp", dp: int = 1) -> int:
    """Temporaries of one AdamW step on the largest rank's share (torch/optim/adamw.py in v2.13):
    "fused" none; "foreach" ``_foreach_sqrt`` of the second moments (4 B per parameter);
    "for-loop" ``exp_avg_sq.sqrt() / bias_correction2_sqrt``: two copies of the largest parameter."""
    if impl == "fused":
        return 0
    numels = [p["numel"] for p in params if p["requires_grad"]]
    if sharding == "fsdp":
        numels = [math.ceil(p["shape"][0] / dp) * (p["numel"] // p["shape"][0]) if p["shape"] else p["numel"]
                  for p in params if p["requires_grad"]]
    elif sharding == "zero1":
        parts = zero1_partition(params, dp)
        numels = max(([params[i]["numel"] for i in part] for part in parts), key=sum)
    if impl == "foreach":
        return 4 * sum(numels)
    return 8 * max(numels, default=0)


def optimizer_impl(device: str, sharding: str, precision: str = "fp32") -> str:
    """The AdamW implementation labkit's ``build_optimizer`` runs (``labkit.train.optim.optimizer_kind``):
    torch's fused AdamW on CPU and CUDA alike, for plain tensors (one process, ddp, zero1) and FSDP2's
    DTensor shards; torch's default (foreach on CUDA, the for-loop on CPU) only under fp16 with fsdp,
    whose ``ShardedGradScaler`` found-inf flag the fused step refuses. ``device``: "cpu" or a GPU."""
    if precision == "fp16" and sharding == "fsdp":
        return "for-loop" if device == "cpu" else "foreach"
    return "fused"


def gathered_bytes(params: list[dict[str, Any]], *, precision: str, dp: int) -> int:
    """FSDP2's unsharded parameters alive at the peak (torch/distributed/fsdp/_fully_shard): the
    root's (embeddings, head: not resharded after forward), the unit running and the one
    prefetched, in the parameter dtype (bf16 under labkit's MixedPrecisionPolicy, else fp32), plus
    one unit's fp32 reduce-scatter input. 0 for dp = 1 (nothing is sharded)."""
    if dp == 1:
        return 0
    units: dict[Any, int] = {}
    for p in params:
        units[p["unit"]] = units.get(p["unit"], 0) + p["numel"]
    root = units.pop(None, 0)
    largest = max(units.values(), default=0)
    pbytes = 2 if precision == "bf16" else 4
    return pbytes * (root + 2 * largest) + 4 * largest


def _linear(counts: dict[int, dict], key: str, at: tuple[int, int] = FIT_AT) -> tuple[int, int]:
    """(per sequence, fixed) of counts[b][key] from the two micro-batches ``at``."""
    b1, b2 = at
    slope = (counts[b2][key] - counts[b1][key]) // (b2 - b1)
    return slope, counts[b1][key] - b1 * slope


def _line(counts: dict[int, dict], at: tuple[int, int]) -> dict[str, Any]:
    """The step's peak as a line through the counts at the two micro-batches ``at``."""
    slope, fixed = _linear(counts, "peak_bytes", at)
    return {"at": list(at), "per_sequence": slope, "fixed": fixed}


def plan_model(make_model: Callable[[], torch.nn.Module], make_batch: Callable[[int], dict[str, Any]], *,
               device: str, precision: str, budget_bytes: int | None = None, sharding: str = "ddp",
               zero_stage: int | None = None, optimizer: str = "adamw", reserve_bytes: int = 2**30,
               dp: int = 1, verify_limit_bytes: int = 4 * 2**30, limit: int = 1 << 16,
               name: str | None = None) -> dict[str, Any]:
    """Largest micro-batch of any model on one rank, every term counted (module docstring).

    ``make_model()`` returns any ``torch.nn.Module``; ``make_batch(b)`` the keyword arguments of
    its forward for micro-batch b (input ids int64 [b, T] among them); the forward returns the
    loss (a tensor, or an object with ``.loss`` or ``.loss_sum``). ``device``: a
    ``labkit.study.plan.DEVICES`` name (the count keeps what CUDA keeps) or "cpu" (this
    machine's kernels; needs ``budget_bytes``). ``precision``: "fp32", "bf16" or "fp16"
    (autocast, fp32 weights). ``budget_bytes`` replaces the device's memory; ``reserve_bytes``
    (CUDA context and allocator slack) is taken off a GPU's. ``sharding`` "none", "ddp", "zero1"
    or "fsdp" over ``dp`` ranks; ``zero_stage`` (0-3) overrides the stage. ``optimizer``:
    "adamw" or "sgd".

    Returns {"max_micro_batch", "capacity_bytes", "state_bytes", "state_terms",
    "activation_bytes_per_sequence", "activation_bytes_fixed", "activation_terms",
    "transient_bytes", "transient_terms", "total_bytes" (all three at the answer, b = 1 when
    nothing fits), "flops_per_token", "flops_terms", "seq_len", "params", "params_before_blocks"
    (``params_before_blocks``), "method", "corrections" (what the count changed for the device),
    "not_modelled" (what it leaves out, in words), "verified", and the inputs}. Bytes are bytes,
    FLOPs are forward + backward per position. Raises ValueError naming a bad argument; the
    model's own errors propagate.
    """
    gpu = device != "cpu"
    capacity = _capacity(device, budget_bytes, reserve_bytes, sharding)
    stage = STAGE_OF[sharding] if zero_stage is None else zero_stage
    fsdp = stage >= 2 and dp > 1
    # FSDP's MixedPrecisionPolicy (labkit/train/dist.py): the forward runs on bf16 parameters
    mixed = torch.bfloat16 if sharding == "fsdp" and precision == "bf16" else None
    count = {"precision": precision, "cuda": gpu, "param_dtype": mixed}
    run = count_steps(make_model, make_batch, FIT_AT, flops_at=FIT_AT[0], **count)
    params, counts = run["parameters"], run["counts"]
    state = state_bytes(params, sharding=sharding, dp=dp, zero_stage=zero_stage, optimizer=optimizer)
    per_seq, fixed = _linear(counts, "saved_bytes")
    impl = optimizer_impl("cuda" if gpu else "cpu", sharding, precision) if optimizer == "adamw" else "for-loop"
    step_tmp = optimizer_step_bytes(params, impl, sharding=sharding, dp=dp) if optimizer == "adamw" else 0
    gathered = gathered_bytes(params, precision=precision, dp=dp) if fsdp else 0
    lines = [_line(counts, FIT_AT)]  # the step's peak: convex in b (module docstring)
    fake = run["method"] == "fake tensors"
    cache: dict[int, dict] = dict(counts)

    def counted(n: int) -> dict[str, Any]:
        if n not in cache:
            cache[n] = count_steps(make_model, make_batch, (n,), fake=fake, **count)["counts"][n]
        return cache[n]

    def total(b: int, exact: bool = False) -> dict[str, int]:
        if exact:
            act, peak = counted(b)["saved_bytes"], counted(b)["peak_bytes"]
        else:
            act, peak = fixed + per_seq * b, max(line["fixed"] + line["per_sequence"] * b for line in lines)
        return {"activations": act, "transient": peak - act + gathered,
                "total": state["total"] + max(peak + gathered, step_tmp)}

    cheap = (lambda b: fake or lines[0]["fixed"] + lines[0]["per_sequence"] * (b + 1) <= verify_limit_bytes)
    b, verified = _search(total, counted, lines, capacity=capacity, limit=limit, cheap=cheap)
    at = total(max(b, 1), exact=verified is not None and b > 0)
    near = lines[-1]
    held_per_seq, held_fixed = _linear({n: cache[n] for n in near["at"]}, "held_bytes", near["at"])
    corrections = _corrections(counts[FIT_AT[0]], gpu, mixed is not None)
    not_modelled = _not_modelled(counts[FIT_AT[0]], gpu, precision=precision, sharding=sharding, dp=dp,
                                 reserve_bytes=reserve_bytes)
    seq_len = counts[FIT_AT[0]]["tokens"] // FIT_AT[0]
    return {"model": name or run["model_class"], "device": device,
            "precision": precision, "sharding": sharding, "dp": dp,
            "zero_stage": stage, "optimizer": optimizer,
            "optimizer_impl": impl, "seq_len": seq_len, "params": sum(p["numel"] for p in params),
            "params_before_blocks": params_before_blocks(params),
            "max_micro_batch": int(b), "capacity_bytes": capacity, "reserve_bytes": reserve_bytes if gpu else 0,
            "state_bytes": state["total"], "state_terms": state,
            "activation_bytes_per_sequence": int(per_seq), "activation_bytes_fixed": int(fixed),
            "activation_terms": {"per_sequence": int(per_seq), "fixed": int(fixed),
                                 "autocast_weight_copies": counts[FIT_AT[0]]["param_cast_bytes"],
                                 "counted_at": list(FIT_AT),
                                 "saved_at": {b_: c["saved_bytes"] for b_, c in counts.items()}},
            "transient_bytes": int(at["transient"]),
            "transient_terms": {"held_outputs_per_sequence": held_per_seq, "held_outputs_fixed": held_fixed,
                                "backward_per_sequence": near["per_sequence"] - per_seq - held_per_seq,
                                "backward_fixed": near["fixed"] - fixed - held_fixed, "fsdp_gathered": gathered,
                                "optimizer_step": step_tmp, "fitted_at": near["at"]},
            "peak_lines": lines,
            "total_bytes": int(at["total"]),
            "flops_per_token": run["flops"] / run["flops_tokens"],
            "flops_terms": {"fwd_bwd_flops": run["flops"], "positions": run["flops_tokens"],
                            "counter": "torch.utils.flop_counter.FlopCounterMode"},
            "method": run["method"], "fake_refused": run["fake_refused"], "corrections": corrections,
            "not_modelled": not_modelled, "verified": verified}


def params_before_blocks(params: list[dict[str, Any]]) -> int | None:
    """Parameters defined before the model's first block (``parameter_table`` rows up to the first
    with a ``unit``): its embeddings, whose gradients are ready last in backward, so DDP's bucket
    holding them is reduced last (``labkit.study.scaling.model_scaling``). None for a model
    without a ``ModuleList`` of blocks."""
    n = 0
    for p in params:
        if p["unit"] is not None:
            return n
        n += p["numel"]
    return None


def _capacity(device: str, budget_bytes: int | None, reserve_bytes: int, sharding: str) -> int:
    """Bytes one rank may use: the budget or the device's memory, less the reserve on a GPU.
    ValueError naming a bad device, budget or sharding."""
    if device != "cpu":
        memory = device_info(device)["memory_bytes"]  # ValueError for an unknown device
    elif budget_bytes is None:
        raise ValueError("budget_bytes: device 'cpu' plans for this machine and needs a budget in bytes")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes: must be positive, got {budget_bytes}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding: got {sharding!r}; allowed values are {SHARDINGS}")
    return int((budget_bytes if budget_bytes is not None else memory) - (reserve_bytes if device != "cpu" else 0))


def _search(total, counted, lines: list[dict], *, capacity: int, limit: int, cheap) -> tuple[int, dict | None]:
    """The largest b with ``total(b)["total"] <= capacity``: solved on the peak ``lines``; where
    ``cheap(b)``, the line through the counts at b and b + 1 is added and the answer re-solved
    until it stays, then it is walked to the edge of the counted totals (``total(b, exact=True)``)
    and the line refitted through the answer's own counts. Returns (b, verified or None)."""
    def solve() -> int:
        return largest_fitting(lambda n: total(n)["total"] <= capacity, start=1, limit=limit)

    b = solve()
    if not (b and cheap(b)):
        return b, None
    for _ in range(4):
        lines[1:] = [_line({n: counted(n) for n in (b, b + 1)}, (b, b + 1))]
        b, before = solve(), b
        if b == before or not b:
            break
    while b > 0 and total(b, exact=True)["total"] > capacity:
        b -= 1
    while b < limit and total(b + 1, exact=True)["total"] <= capacity:
        b += 1
    verified = {"micro_batch": b, "total_at_b": total(b, exact=True)["total"] if b else None,
                "total_at_b_plus_1": total(b + 1, exact=True)["total"]}
    if b:
        lines[1:] = [_line({n: counted(n) for n in (b, b + 1)}, (b, b + 1))]
    return b, verified


def total_at(plan: dict[str, Any], b: int) -> int:
    """Planned bytes of one rank at micro-batch ``b`` from a ``plan_model`` result: state +
    max(the step's peak (the largest of its ``peak_lines`` at b) + FSDP units, optimiser step)."""
    tr = plan["transient_terms"]
    peak = max(line["fixed"] + line["per_sequence"] * b for line in plan["peak_lines"])
    return int(plan["state_bytes"] + max(peak + tr["fsdp_gathered"], tr["optimizer_step"]))


def _corrections(count: dict, gpu: bool, mixed: bool) -> list[str]:
    """What the count changed from this CPU's own run, in words."""
    out = []
    if gpu:
        kernels = count["attention_kernels"]
        for kernel in sorted(set(kernels)):
            keeps = ("no s x s scores: query, key, value, output and an fp32 log-sum-exp per row"
                     if kernel != "math" else "the s x s scores, as CPU's math path")
            out.append(f"attention: CUDA's {kernel} kernel for {kernels.count(kernel)} SDPA calls ({keeps})")
        if count["dropout_calls"]:
            out.append(f"dropout: {count['dropout_calls']} calls keep CUDA's 1-byte mask per element (CPU keeps "
                       "one in the compute dtype)")
        if count["fp32_ops"]:
            out.append(f"autocast: CUDA runs {', '.join(sorted(count['fp32_ops']))} in fp32 (counted so)")
    if mixed:
        out.append("fsdp bf16: the forward runs on bf16 parameters (FSDP's MixedPrecisionPolicy): no autocast "
                   "weight copies, gathered units instead")
    return out


def _not_modelled(count: dict, gpu: bool, *, precision: str, sharding: str, dp: int, reserve_bytes: int) -> list[str]:
    """What the count leaves out for this plan, in words (docs/measurement.md, "Counting a model",
    Limits), so the answer states it where it is read."""
    out = []
    if gpu:
        out.append(f"the CUDA context, cuBLAS workspaces, NCCL buffers and the caching allocator's rounding and "
                   f"fragmentation: outside the count ({reserve_bytes / 2**30:.2f} GiB reserved off the device)")
        if precision != "fp32":
            out.append("autocast: an fp32 op called inside a C++ composite, and CUDA-only 16-bit ops (addmv, addr, "
                       "mv, RNN cells), stay as CPU's autocast leaves them")
        if "flash" in count["attention_kernels"]:
            out.append("flash attention: its padding of head dims to a multiple of 8 and its random-number state")
    else:
        out.append("the CPU allocator's own heap (process RSS above the tensors' bytes): tensor bytes only")
    if dp > 1 and sharding != "none":
        out.append(f"{sharding} over {dp} ranks: the communication buffers (DDP/NCCL) are outside the count")
    out.append("a model that takes another path on CUDA (a CUDA-only kernel or extension) is counted on the path "
               "it takes on the CPU")
    return out


# --------------------------------------------------------------------------------------------
# labkit's own model through the same counting
# --------------------------------------------------------------------------------------------


def labkit_model(cfg: Any, seq_len: int, *, mlm_probability: float = 0.15):
    """``(make_model, make_batch)`` for ``plan_model`` of ``BertMLM(cfg)``: the batch is int64
    [b, seq_len] ids (a fixed generator) with exactly k = max(1, round(mlm_probability * seq_len))
    masked positions per row (1..k: the sparse head's last layer sees b·k rows, the expected
    count) and no attention mask: what the model does with packed shards' all-real mask (it
    passes SDPA none), without the host-side check, so the dense head counts on fake tensors."""
    from labkit.model import BertMLM

    n_mask = max(1, round(mlm_probability * seq_len))

    def make_model() -> torch.nn.Module:
        return BertMLM(cfg)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(5, cfg.vocab_size, (b, seq_len), generator=g)
        labels = torch.full_like(ids, -100)
        labels[:, 1:1 + n_mask] = ids[:, 1:1 + n_mask]
        return {"input_ids": ids, "labels": labels}

    return make_model, make_batch


def activation_bytes(model_cfg: Any, seq_len: int, micro_batch: int, *, mlm_probability: float = 0.15) -> int:
    """Bytes autograd keeps for backward after one training forward of ``BertMLM(model_cfg)``
    (fp32, CPU, dropout on) at ``micro_batch`` sequences of ``seq_len`` tokens
    (``labkit_model``'s batch): ``counting.count_steps``'s saved_bytes. ValueError for
    non-positive sizes."""
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch/seq_len: must be positive, got {micro_batch}/{seq_len}")
    make_model, make_batch = labkit_model(model_cfg, seq_len, mlm_probability=mlm_probability)
    return count_steps(make_model, make_batch, (micro_batch,), fake=False)["counts"][micro_batch]["saved_bytes"]


def model_state_bytes(model_cfg: Any, *, sharding: str = "ddp", dp: int = 1) -> int:
    """Model-state bytes of one rank of ``BertMLM(model_cfg)`` (``state_bytes`` with AdamW; 16 B per
    parameter + 4 B per parameter tensor under ddp). The model is built on the meta device."""
    from labkit.model import BertMLM
    from labkit.study.counting import parameter_table

    with torch.device("meta"):
        model = BertMLM(model_cfg)
    return state_bytes(parameter_table(model), sharding=sharding, dp=dp)["total"]


def max_micro_batch(model_cfg: Any, seq_len: int, budget_bytes: int, *, name: str | None = None,
                    mlm_probability: float = 0.15) -> dict[str, Any]:
    """``plan_model`` of ``BertMLM(model_cfg)`` on this CPU (fp32, one DDP rank) under
    ``budget_bytes``, in the sweep table's terms: {model, params, seq_len, budget_bytes,
    state_bytes, act_bytes_per_sample, act_bytes_fixed, transient_bytes, max_micro_batch} plus
    "plan" (the whole ``plan_model`` result). ``name`` labels it (default "<L>L/<H>H")."""
    make_model, make_batch = labkit_model(model_cfg, seq_len, mlm_probability=mlm_probability)
    p = plan_model(make_model, make_batch, device="cpu", precision="fp32", budget_bytes=budget_bytes,
                   name=name or f"{model_cfg.num_layers}L/{model_cfg.hidden_size}H", verify_limit_bytes=budget_bytes)
    return {"model": p["model"], "params": p["params"], "seq_len": seq_len, "budget_bytes": int(budget_bytes),
            "state_bytes": p["state_bytes"], "act_bytes_per_sample": p["activation_bytes_per_sequence"],
            "act_bytes_fixed": p["activation_bytes_fixed"], "transient_bytes": p["transient_bytes"],
            "max_micro_batch": p["max_micro_batch"], "plan": p}
