"""Time to a target loss per GPU count: the planner's step time joined with the critical batch.

Steps to the target at global batch B (McCandlish et al. 2018, arXiv:1812.06162, eq. 2.11,
applied piecewise because the critical batch grows as training progresses: Zhang et al. 2024,
arXiv:2410.21676; Merrill et al. 2025, arXiv:2505.23971; Bergsma et al. 2025, arXiv:2505.13738):
split the examples a batch-1-like run needs, E_min, into ``segments`` equal parts; part i, at
progress f_i = (i + ½)/segments, has critical batch B_crit(f_i) = B_crit·f_i^growth (``growth`` 0:
constant) and costs ΔE·(1/B + 1/B_crit(f_i)) steps (S = S_min(1 + B_crit/B) with S_min = ΔE/B_crit).
So S(B) = E_min/B + Σ ΔE/B_crit(f_i): the first term shrinks with more data per step, the second
is the floor no batch removes.

Wall-clock time at n GPUs and micro-batch b (global batch n·b, no accumulation) = S(n·b) ×
the step time of ``labkit.study.scaling.step_time`` (compute at a stated MFU or measured, plus
the exposed all-reduce on the chosen network); GPU-hours = n × hours. The knee is the smallest n
from which every further doubling buys less than ``min_gain`` (1.5×) in time; its reason is whichever factor lost
more of the ideal 2×: the step time (the network: step(2n)/step(n) > 1) or the steps (the
critical batch: S(2n·b)/S(n·b) > ½), compared in log terms.

Inputs that are assumptions are labelled in ``assumptions`` of the result (``study_forecast``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import polars as pl

__all__ = ["forecast_table", "knee", "steps_to_target", "study_forecast"]


def steps_to_target(batch: float, *, e_min: float, b_crit: float, growth: float = 0.0, segments: int = 64) -> float:
    """Optimiser steps to the target at global ``batch`` (examples per step) for a run that needs
    ``e_min`` examples at small batch and whose critical batch reaches ``b_crit`` (examples) at the
    target, growing as progress^``growth`` (module docstring). Raises ValueError on a non-positive
    batch, e_min or b_crit, or a negative growth."""
    if batch <= 0 or e_min <= 0 or b_crit <= 0:
        raise ValueError(f"steps_to_target: batch, e_min and b_crit must be positive, got {batch}, {e_min}, {b_crit}")
    if growth < 0:
        raise ValueError(f"growth: must be >= 0, got {growth}")
    de = e_min / segments
    floor = sum(de / (b_crit * ((i + 0.5) / segments) ** growth) for i in range(segments))
    return e_min / batch + floor


def forecast_table(gpus: list[int], micro_batches: list[int], step_s: Callable[[int, int], float], *,
                   e_min: float, b_crit: float, growth: float = 0.0, tokens_per_example: float = 1.0) -> pl.DataFrame:
    """One row per (n_gpus, micro_batch): global_batch, steps, examples (= steps × global batch),
    tokens, step_s (``step_s(n, b)`` seconds), hours, gpu_hours, batch_over_b_crit. Examples in
    the unit of ``e_min`` and ``b_crit`` (sequences); tokens = examples × ``tokens_per_example``."""
    rows = []
    for b in micro_batches:
        for n in gpus:
            s = steps_to_target(n * b, e_min=e_min, b_crit=b_crit, growth=growth)
            t = step_s(n, b)
            rows.append({"n_gpus": n, "micro_batch": b, "global_batch": n * b, "steps": s, "examples": s * n * b,
                         "tokens": s * n * b * tokens_per_example, "step_s": t, "hours": s * t / 3600,
                         "gpu_hours": n * s * t / 3600, "batch_over_b_crit": n * b / b_crit})
    return pl.DataFrame(rows)


def knee(table: pl.DataFrame, micro_batch: int, *, min_gain: float = 1.5) -> dict[str, Any]:
    """The smallest n of ``table`` (one micro-batch) from which every further doubling of the
    GPUs cuts the time by less than ``min_gain``× (a one-off drop, such as leaving the first node
    for the network, does not count while later doublings pay again), and why, judged on its
    first doubling: "network" (the step time grew more, in log terms, than the steps failed to
    halve) or "critical batch". {"n_gpus": None, ...} when the last doubling still pays."""
    rows = table.filter(pl.col("micro_batch") == micro_batch).sort("n_gpus").to_dicts()
    pairs = [(a, c) for a, c in zip(rows, rows[1:]) if c["n_gpus"] == 2 * a["n_gpus"]]
    found = None
    for a, c in reversed(pairs):
        if a["hours"] / c["hours"] >= min_gain:
            break
        found = (a, c)
    if found is None:
        return {"n_gpus": None, "gain_next_doubling": None, "reason": None}
    a, c = found
    net = math.log(c["step_s"] / a["step_s"])  # 0 when the step time holds
    crit = math.log((c["steps"] / a["steps"]) / 0.5)  # 0 when the steps halve
    return {"n_gpus": a["n_gpus"], "gain_next_doubling": a["hours"] / c["hours"], "network_loss": net,
            "critical_batch_loss": crit, "reason": "network" if net > crit else "critical batch"}


def study_forecast(model: Any, *, gpus: list[int], micro_batches: list[int], seq_len: int, network: str,
                   device: str = "H100 NVL", mfu: float = 0.4, precision: str = "bf16", e_min_tokens: float | None = None,
                   b_crit_tokens: float | None = None, growth: float = 0.0, target_loss: float = 2.0,
                   gpus_per_node: int = 2, min_gain: float = 1.5) -> dict[str, Any]:
    """The forecast for a model (a ``ModelConfig``, or a preset name at the study's vocabulary) on
    a cluster: step time from ``labkit.study.scaling.precision_experiment`` (compute at ``mfu`` of
    ``device``'s dense peak in ``precision``, fp32 gradients all-reduced in DDP's buckets on
    ``network``), steps from ``steps_to_target``. ``b_crit_tokens`` None: Kaplan et
    al. 2020 (arXiv:2001.08361) B_crit(L) = 2.1e8 tokens / L^(1/0.21) at ``target_loss`` nats (a
    decoder fit on WebText2: an assumption for MLM). ``e_min_tokens`` None: 20 tokens per
    parameter (Hoffmann et al. 2022, arXiv:2203.15556; an assumption). Returns {"table" (rows as
    dicts), "knee" per micro-batch, "inputs", "assumptions"}."""
    from labkit.model import count_parameters, model_config
    from labkit.study import scaling
    from labkit.study.plan import STUDY_VOCAB

    if network not in scaling.NETWORKS:
        raise ValueError(f"network: unknown {network!r}; known networks are {sorted(scaling.NETWORKS)}")
    cfg = model_config(model, STUDY_VOCAB, max_position_embeddings=max(512, seq_len), sparse_head=False) \
        if isinstance(model, str) else model
    assumptions = [f"MFU {mfu:.0%} of the {device}'s dense {precision} peak (planned, not measured)",
                   f"network {network}: {scaling.NETWORKS[network]['source']}",
                   "sequences of seq_len positions count as the tokens of the critical batch and of E_min"]
    if b_crit_tokens is None:
        b_crit_tokens = 2.1e8 / target_loss ** (1 / 0.21)
        assumptions.append(f"B_crit = 2.1e8 tokens / L^(1/0.21) at L = {target_loss} nats (Kaplan et al. 2020, "
                           "decoder on WebText2; not measured for this MLM)")
    if e_min_tokens is None:
        params = count_parameters(cfg)["total"]
        e_min_tokens = 20.0 * params
        assumptions.append(f"E_min = 20 tokens per parameter = {e_min_tokens:.3g} tokens (Chinchilla's ratio, "
                           "an assumption for the target)")
    assumptions.append(f"B_crit grows as progress^{growth} (0: constant; measured on a tiny model by "
                       "`labkit sweep batch` otherwise)")
    cache: dict[int, pl.DataFrame] = {}

    def step_s(n: int, b: int) -> float:
        if b not in cache:
            cache[b] = scaling.precision_experiment(cfg, micro_batch=b, seq_len=seq_len, device=device,
                                                    network=network, gpus=tuple(gpus), gpus_per_node=gpus_per_node,
                                                    mfu=mfu, precisions=(precision,))
        return cache[b].filter(pl.col("n_gpus") == n)["step_s"].item()

    table = forecast_table(gpus, micro_batches, step_s, e_min=e_min_tokens / seq_len, b_crit=b_crit_tokens / seq_len,
                           growth=growth, tokens_per_example=seq_len)
    return {"table": table.to_dicts(), "knee": {b: knee(table, b, min_gain=min_gain) for b in micro_batches},
            "inputs": {"model": model if isinstance(model, str) else "config", "precision": precision, "seq_len": seq_len, "network": network, "device": device, "mfu": mfu,
                       "b_crit_tokens": b_crit_tokens, "b_crit_sequences": b_crit_tokens / seq_len,
                       "e_min_tokens": e_min_tokens, "growth": growth, "min_gain": min_gain},
            "assumptions": assumptions}
