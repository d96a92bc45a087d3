"""Parallel splits at the study's scale: the planner's table of micro-batches for every setting the
study leaves open, and memory per GPU for every DP x TP x PP split and ZeRO stage."""

from __future__ import annotations

from labkit.config import ModelConfig
from labkit.model import count_parameters
from labkit.study.plan import (ATTENTION, STUDY_MICRO_BATCH, STUDY_VOCAB, device_info, memory_plan,
                               planned_max_micro_batch)


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
