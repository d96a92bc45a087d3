"""Parallel splits at the study's scale: the planner's table of micro-batches for every setting the
study leaves open, and memory per GPU for every DP x TP x PP split and ZeRO stage."""

from __future__ import annotations

from labkit.config import ModelConfig
from labkit.model import count_parameters
from labkit.study.plan import (ATTENTION, STUDY_MICRO_BATCH, STUDY_VOCAB, device_info, memory_plan,
                               planned_max_micro_batch)

__all__ = ["first_fit", "measure_rank_memory", "parallel_plans", "plan_overrides", "planned_rank_memory", "study_table"]


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
                   gpus_per_node: int = 2, pipeline_microbatches: int = 8, reserve_bytes: int = 2**30,
                   sequence_parallel: bool = False, **kw):
    """Memory per GPU for every split dp x tp x pp = n_gpus and ZeRO stage 0-3.

    polars DataFrame, one row per split, in the order a planner would try them (the least
    model parallelism first, then the lowest ZeRO stage): dp, tp, pp, zero_stage, the
    ``memory_plan`` terms in bytes, total, fits (total <= device memory - reserve),
    tp_within_node (tensor parallelism across nodes is slow), bubble ((p - 1)/(m + p - 1)),
    micro_batch and pipeline_microbatches (m), sequence_parallel (``sequence_parallel`` for rows
    with tp > 1, whose activations it plans: ``labkit.study.plan.activation_terms``; False at
    tp 1). ``plan_overrides`` turns a row into ``TrainConfig`` sections.
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
                                   tp=tp, pp=pp, pipeline_microbatches=pipeline_microbatches,
                                   sequence_parallel=sequence_parallel, **kw)
                rows.append({k: plan[k] for k in ("dp", "tp", "pp", "zero_stage", "params", "grads", "optimizer",
                                                  "autocast_copies", "activations", "logits", "head_backward",
                                                  "total", "bubble", "micro_batch", "pipeline_microbatches",
                                                  "sequence_parallel")}
                            | {"fits": plan["total"] <= cap, "tp_within_node": tp <= gpus_per_node})
    return pl.DataFrame(rows).sort(pl.col("tp") * pl.col("pp"), "pp", "zero_stage")


def first_fit(plans) -> dict | None:
    """The first row of ``parallel_plans(...)`` that fits with tensor parallelism inside a node
    (None when none does): the split to use when data parallelism alone cannot hold the model."""
    import polars as pl

    ok = plans.filter(pl.col("fits") & pl.col("tp_within_node"))
    return ok.row(0, named=True) if ok.height else None


def plan_overrides(row: dict, *, schedule: str = "1f1b") -> dict:
    """``TrainConfig`` sections that run a ``parallel_plans`` row (``first_fit``'s, say), as
    ``{"parallel": {...}, "batch": {...}}`` for ``TrainConfig(..., **out)`` or ``cfg.replace(**out)``:
    parallel's tp, pp, sequence_parallel (the row's, so the run splits the activations the way the
    row planned them; False for a row from before the column), the sharding of its ZeRO stage over
    dp and, with pp > 1, ``schedule`` over the row's pipeline micro-batches (batch's
    ``grad_accum_steps``; the planner's activation memory assumes 1F1B) and the row's micro-batch. ZeRO 0 -> ddp (dp only) or replicate; 1 -> zero1 (dp only); 2 -> fsdp
    without resharding after forward (ZeRO-2-style); 3 -> fsdp. ZeRO-1 with tp or pp > 1 has no
    labkit run (DDP does not compose with a split model): ValueError naming the row's split."""
    split = row["tp"] * row["pp"] > 1
    zero = row["zero_stage"]
    if zero == 1 and split:
        raise ValueError(f"zero_stage: ZeRO-1 with tp {row['tp']} x pp {row['pp']} has no labkit run "
                         "(ZeroRedundancyOptimizer needs DDP); take the row's ZeRO-2 neighbour")
    sharding = {0: "replicate" if split else "ddp", 1: "zero1", 2: "fsdp", 3: "fsdp"}[zero]
    par = {"tp": row["tp"], "pp": row["pp"], "sharding": sharding,
           "sequence_parallel": bool(row.get("sequence_parallel", False)) and row["tp"] > 1}
    batch = {}
    if zero >= 2:
        par["fsdp_reshard_after_forward"] = zero == 3
    if row["pp"] > 1:
        par["pp_schedule"] = schedule
        batch["grad_accum_steps"] = row["pipeline_microbatches"]
    if row.get("micro_batch") is not None:
        batch["micro_batch_size"] = row["micro_batch"]
    return {"parallel": par} | ({"batch": batch} if batch else {})


def planned_rank_memory(mcfg: ModelConfig, cfg, *, world: int, seq_len: int, device: str = "cpu") -> dict:
    """The planner's memory of the worst rank of a run of ``cfg`` (a ``TrainConfig``) on ``world``
    ranks, in the terms ``measure_rank_memory`` measures: {"state_bytes" (parameters, gradients,
    AdamW moments: ``memory_plan``'s params + grads + optimizer), "activation_bytes" (its
    activations), "total_bytes", "bubble" (GPipe's / 1F1B's (p - 1)/(m + p - 1); interleaved with v
    stages per rank (p - 1)/(v·m + p - 1))}. fp32 on CPU, attention "eager" when attention dropout
    is on (CPU's math path), else "flash"; the activations split as ``cfg.parallel.sequence_parallel`` says
    (``labkit.study.plan.activation_terms``: without it the residual stream's are whole on every
    tp rank)."""
    par, m = cfg.parallel, cfg.batch.grad_accum_steps
    dp = world // (par.tp * par.pp)
    zero = 0 if dp == 1 or par.sharding in ("ddp", "replicate") else {"zero1": 1}.get(
        par.sharding, 3 if par.fsdp_reshard_after_forward else 2)
    attention = "eager" if mcfg.attention_dropout > 0 else "flash"
    p = memory_plan(mcfg, seq_len=seq_len, micro_batch=cfg.batch.micro_batch_size, precision=cfg.precision,
                    attention=attention, zero_stage=zero, dp=dp, tp=par.tp, pp=par.pp,
                    pipeline_microbatches=m, device=device, pipeline_schedule=par.pp_schedule,
                    sequence_parallel=par.sequence_parallel)
    state = p["params"] + p["grads"] + p["optimizer"]
    bubble = (par.pp - 1) / (par.pp_virtual_stages * m + par.pp - 1)
    return {"state_bytes": state, "activation_bytes": p["activations"], "total_bytes": state + p["activations"],
            "bubble": bubble}


def measure_rank_memory(cfg, staged_paths: dict[str, str] | None = None) -> dict:
    """Collective, one call per rank of a run of ``cfg`` (a ``TrainConfig``; RANK / WORLD_SIZE from
    the environment, as ``labkit.train.train`` reads them; with ``staged_paths`` {node: shard dir}
    each rank reads its node's copy): build the run with the training builder and step
    (``labkit.train.runtime.build_runtime``), take two optimiser steps (``Runtime.forward_backward``,
    the optimiser's step) on the run's first batches and measure this rank's memory: {"rank", "state_bytes" (bytes of its
    parameters, gradients and AdamW moments, read from the tensors: the local slices of split or
    sharded ones), "activation_bytes" (``labkit.measure.SavedActivationPeak`` over the second step's
    forwards and backwards, micro-batches in flight as the schedule keeps them), "total_bytes"}.
    A process group it creates is destroyed before it returns."""
    import contextlib
    import dataclasses
    import gc

    import torch

    from labkit.data.mlm import make_loader
    from labkit.data.shards import read_index
    from labkit.env import node_name
    from labkit.measure import SavedActivationPeak
    from labkit.model import BertMLM
    from labkit.model.encoder import local
    from labkit.train import dist
    from labkit.train.parallel import check_split
    from labkit.train.run_config import model_config_of
    from labkit.train.runtime import build_runtime

    if staged_paths:
        cfg = dataclasses.replace(cfg, data_dir=staged_paths[node_name()])
    rank, local_rank, world = dist.dist_info()
    device = dist.resolve_device(cfg.device, local_rank)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    owns = not torch.distributed.is_initialized()
    dist.init_distributed(cfg.backend, cfg.timeout_s, device)
    try:
        index = read_index(cfg.data_dir)
        mcfg = model_config_of(cfg, int(index["vocab_size"]))
        check_split(cfg, mcfg, world, int(index["seq_len"]), rank)
        torch.manual_seed(cfg.seed)
        runtime = build_runtime(cfg, BertMLM(mcfg), device)  # the training builder and step
        model, optimizer, step = runtime.parts, runtime.optimizer, runtime.forward_backward
        data_rank, data_world = runtime.dp_rank, runtime.dp
        loader = make_loader(cfg.data_dir, batch_size=cfg.batch.micro_batch_size, rank=data_rank,
                             world_size=data_world, seed=cfg.seed, mlm_probability=cfg.data.mlm_probability,
                             vocab_size=mcfg.vocab_size)
        batches = iter(loader)
        params = list(model.parameters())
        peak = SavedActivationPeak(exclude={local(p).untyped_storage().data_ptr() for p in params})
        for n in range(2):
            mbs = [{k: v.to(device) for k, v in next(batches).items()} for _ in range(cfg.batch.grad_accum_steps)]
            with peak if n == 1 else contextlib.nullcontext():
                step(mbs)
            if n == 1:
                tensors = [local(p) for p in params] + [local(p.grad) for p in params if p.grad is not None]
                tensors += [local(t) for st in optimizer.state.values() for t in st.values()
                            if torch.is_tensor(t) and t.ndim > 0]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        state = sum(t.numel() * t.element_size() for t in tensors)
        out = {"rank": rank, "state_bytes": int(state), "activation_bytes": int(peak.bytes),
               "total_bytes": int(state + peak.bytes)}
        # The gradient all-reduces ran inside the saved-tensor hooks, so their gloo work objects
        # hold those Python hooks (torch's ThreadLocalState) and a gloo thread needs the GIL to
        # free each one. Freeing the DDP reducer drops the last reference to the process group,
        # whose destructor joins those threads while holding the GIL: a deadlock when a work
        # object is still alive. A barrier waits with the GIL released until they are gone, and
        # the model goes before the group does.
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        del step, runtime, model, optimizer, tensors, params, peak, batches, loader
        gc.collect()
        return out
    finally:
        if owns:
            dist.teardown()
