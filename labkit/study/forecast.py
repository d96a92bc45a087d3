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
the step time of ``labkit.study.scaling.step_time`` (compute at a stated MFU of the precision's
peak, or a measured one-rank step time, plus the exposed all-reduce on the chosen network);
GPU-hours = n × hours. With the critical batch's bootstrap range (``labkit sweep batch``) the
hours come with their range: S at the range's ends, E_min held.

The knee (``KNEE_RULE``) is read from statistical goodput (Pollux, Qiao et al. OSDI'21;
``labkit.measure.statistical_goodput``): throughput × E(B), E(B) = (B_crit + B0)/(B_crit + B)
with the critical batch as the noise scale and B0 the table's smallest global batch. Time to the
target goes as 1 / goodput (exactly so with ``growth`` 0), so a doubling that buys less than
``min_gain`` in goodput buys less than that in time. Its reason is whichever factor lost more of
the ideal 2× per doubling, in log terms: the step time (the network: step(2n)/step(n) > 1) or
the statistical efficiency (the critical batch: E(2n·b) < E(n·b)).

Inputs that are assumptions are labelled in ``assumptions`` of the result (``study_forecast``).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import polars as pl

from labkit.measure import statistical_efficiency

__all__ = ["KNEE_RULE", "forecast_table", "knee", "knee_sentence", "measure_step_time", "steps_to_target",
           "study_forecast"]

KNEE_RULE = ("the knee: the smallest GPU count from which every further doubling of the GPUs buys less than "
             "{min_gain:g}x statistical goodput (throughput x E(B), E(B) = (B_crit + B0)/(B_crit + B), B0 the "
             "smallest global batch here; Pollux, OSDI'21), a step between counts that do not double judged per "
             "doubling (its gain to the power 1/log2 of the ratio); time to the target goes as 1/goodput")
"""The knee's rule, as ``labkit forecast`` prints it (``str.format(min_gain=...)``)."""


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
                   e_min: float, b_crit: float, growth: float = 0.0, tokens_per_example: float = 1.0,
                   b_crit_range: tuple[float, float] | None = None) -> pl.DataFrame:
    """One row per (n_gpus, micro_batch): global_batch, steps, examples (= steps × global batch),
    tokens, step_s (``step_s(n, b)`` seconds), hours, gpu_hours, batch_over_b_crit, throughput
    (examples/s), statistical_efficiency (``labkit.measure.statistical_efficiency`` with B_noise =
    ``b_crit``, B0 = the smallest global batch of the table) and goodput (examples/s,
    ``labkit.measure.statistical_goodput``); with ``b_crit_range`` (low, high) also hours_low and
    hours_high, the hours at the range's high and low B_crit (``e_min`` held). Examples in the
    unit of ``e_min`` and ``b_crit`` (sequences); tokens = examples × ``tokens_per_example``."""
    b0 = min(gpus) * min(micro_batches)
    rows = []
    for b in micro_batches:
        for n in gpus:
            s = steps_to_target(n * b, e_min=e_min, b_crit=b_crit, growth=growth)
            t = step_s(n, b)
            eff = statistical_efficiency(n * b, b_crit, b0)
            row = {"n_gpus": n, "micro_batch": b, "global_batch": n * b, "steps": s, "examples": s * n * b,
                   "tokens": s * n * b * tokens_per_example, "step_s": t, "hours": s * t / 3600,
                   "gpu_hours": n * s * t / 3600, "batch_over_b_crit": n * b / b_crit, "throughput": n * b / t,
                   "statistical_efficiency": eff, "goodput": n * b / t * eff}
            if b_crit_range is not None:
                for key, bc in (("hours_low", b_crit_range[1]), ("hours_high", b_crit_range[0])):
                    row[key] = steps_to_target(n * b, e_min=e_min, b_crit=bc, growth=growth) * t / 3600
            rows.append(row)
    return pl.DataFrame(rows)


def knee(table: pl.DataFrame, micro_batch: int, *, min_gain: float = 1.5) -> dict[str, Any]:
    """The knee of ``table`` (``forecast_table``) at one micro-batch, by ``KNEE_RULE``: each step
    between consecutive GPU counts is judged by its goodput gain per doubling, (g(n2)/g(n1))^(1 /
    log2(n2/n1)); the knee is the smallest count from which every later step gains less than
    ``min_gain``. Returns {"n_gpus" (None when the last step still pays), "gain_next_doubling",
    "reason" ("network" or "critical batch", judged on the step after the knee), "network_loss",
    "critical_batch_loss" (log per doubling), "steps": [{"from", "to", "gain_per_doubling",
    "time_ratio" (hours(to) / hours(from))}], "counts" (the GPU counts, sorted)}."""
    rows = table.filter(pl.col("micro_batch") == micro_batch).sort("n_gpus").to_dicts()
    steps = []
    for a, c in zip(rows, rows[1:]):
        d = math.log2(c["n_gpus"] / a["n_gpus"])
        steps.append({"from": a["n_gpus"], "to": c["n_gpus"],
                      "gain_per_doubling": (c["goodput"] / a["goodput"]) ** (1 / d),
                      "time_ratio": c["hours"] / a["hours"], "doublings": d,
                      "network_loss": math.log(c["step_s"] / a["step_s"]) / d,
                      "critical_batch_loss": math.log(a["statistical_efficiency"] / c["statistical_efficiency"]) / d})
    out = {"n_gpus": None, "gain_next_doubling": None, "reason": None, "network_loss": None,
           "critical_batch_loss": None, "steps": [{k: s[k] for k in ("from", "to", "gain_per_doubling", "time_ratio")}
                                                  for s in steps], "counts": [r["n_gpus"] for r in rows]}
    first = None
    for i in range(len(steps) - 1, -1, -1):
        if steps[i]["gain_per_doubling"] >= min_gain:
            break
        first = i
    if first is None:
        return out
    s = steps[first]
    return out | {"n_gpus": s["from"], "gain_next_doubling": s["gain_per_doubling"], "network_loss": s["network_loss"],
                  "critical_batch_loss": s["critical_batch_loss"],
                  "reason": "network" if s["network_loss"] > s["critical_batch_loss"] else "critical batch"}


def knee_sentence(k: dict[str, Any], micro_batch: int, *, min_gain: float = 1.5, unit: str = "GPUs") -> str:
    """What ``knee``'s answer ``k`` says, in one sentence that holds for any table: no step to
    judge, a knee (and from which count), or more GPUs still paying at the largest step, with
    every step that does not pay and every count that takes longer than the one before it
    (``unit``: "GPUs", or "ranks" on a CPU)."""
    counts = k["counts"]
    head = f"micro-batch {micro_batch}: "
    if len(counts) < 2:
        return head + f"one count of {unit} ({counts[0] if counts else 'none'}): no step to judge"
    if k["n_gpus"] is not None:
        at = next(s for s in k["steps"] if s["from"] == k["n_gpus"])
        where = "at every count here" if k["n_gpus"] == counts[0] else f"from {k['n_gpus']} {unit}"
        return head + (f"more {unit} stop paying {where}: every later step buys less than {min_gain:g}x goodput per "
                       f"doubling ({at['from']} -> {at['to']} {unit}: {at['gain_per_doubling']:.2f}x; the "
                       f"{k['reason']} costs more){_slower(k['steps'], unit)}")
    last = k["steps"][-1]
    weak = [s for s in k["steps"][:-1] if s["gain_per_doubling"] < min_gain]
    text = (f"more {unit} still pay at the largest step ({last['from']} -> {last['to']} {unit}: "
            f"{last['gain_per_doubling']:.2f}x goodput per doubling)")
    if weak:
        text += "; steps that buy less than {:g}x: ".format(min_gain) + ", ".join(
            f"{s['from']} -> {s['to']} ({s['gain_per_doubling']:.2f}x)" for s in weak) + _slower(weak, unit)
    return head + text


def _slower(steps: list[dict[str, Any]], unit: str) -> str:
    """'; 4 GPUs take 26x as long as 2' for each step whose larger count takes longer."""
    worse = [s for s in steps if s["time_ratio"] > 1]
    return "".join(f"; {s['to']} {unit} take {s['time_ratio']:.3g}x as long as {s['from']}" for s in worse)


def measure_step_time(model: Any, *, micro_batch: int, seq_len: int, precision: str = "fp32",
                      mlm_probability: float = 0.15, steps: int = 4, warmup: int = 2,
                      threads: int | None = None) -> dict[str, Any]:
    """One rank's optimiser step of ``BertMLM(model)`` (a ``ModelConfig``) measured here, on this
    machine's CPU, in this process: forward, backward and AdamW at ``micro_batch`` sequences of
    ``seq_len`` tokens (``labkit.study.memory.labkit_model``'s batch: random ids, the masked
    share ``mlm_probability``), autocast for bf16/fp16 as training runs it, ``threads`` torch
    threads (None: torch's default; restored after). The mean of ``steps`` timed steps after
    ``warmup`` untimed ones (a sum of steps is what is forecast). Returns {"step_s", "steps",
    "warmup", "threads", "load_avg_1m" (os.getloadavg before and after), "cpu_count"}."""
    import torch

    from labkit.study.counting import loss_of
    from labkit.study.memory import labkit_model

    make_model, make_batch = labkit_model(model, seq_len, mlm_probability=mlm_probability)
    before_threads = torch.get_num_threads()
    load0 = os.getloadavg()[0]
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            net = make_model().train()
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
            batch = make_batch(micro_batch)
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
            times = []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    loss = loss_of(net(**batch))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before_threads)
    return {"step_s": sum(times) / len(times), "steps": steps, "warmup": warmup, "threads": threads or before_threads,
            "load_avg_1m": [load0, os.getloadavg()[0]], "cpu_count": os.cpu_count()}


def study_forecast(model: Any, *, gpus: list[int], micro_batches: list[int], seq_len: int, network: str,
                   device: str = "H100 NVL", mfu: float = 0.4, precision: str = "bf16",
                   e_min_tokens: float | None = None, b_crit_tokens: float | None = None,
                   b_crit_range_tokens: tuple[float, float] | None = None,
                   growth: float = 0.0, target_loss: float = 2.0, gpus_per_node: int = 2, min_gain: float = 1.5,
                   compute_s: dict[int, float] | None = None, compute_source: str | None = None) -> dict[str, Any]:
    """The forecast for a model (a ``ModelConfig``, or a preset name at the study's vocabulary) on
    a cluster: step time from ``labkit.study.scaling.step_time`` with fp32 gradients all-reduced
    in DDP's buckets on ``network`` (the word embedding's bucket last), the compute of one
    micro-batch either ``compute_s[b]`` (seconds measured at one rank; ``compute_source`` says
    where, it goes into the assumptions) or planned at ``mfu`` of ``device``'s dense peak in
    ``precision`` (``scaling.precision_experiment``); steps from ``steps_to_target``.
    ``b_crit_tokens`` None: Kaplan et al. 2020 (arXiv:2001.08361) B_crit(L) = 2.1e8 tokens /
    L^(1/0.21) at ``target_loss`` nats (a decoder fit on WebText2: an assumption for MLM);
    ``b_crit_range_tokens`` (low, high): its bootstrap range, which gives the hours a range.
    ``e_min_tokens`` None: 20 tokens per parameter (Hoffmann et al. 2022, arXiv:2203.15556; an
    assumption). On a ``device`` with a memory entry the micro-batches are checked against the
    planner's largest (``labkit.study.plan.planned_max_micro_batch``). Returns {"table" (rows as
    dicts, each with ``fits``), "knee" per micro-batch, "rule" (``KNEE_RULE``), "max_micro_batch"
    (None on "cpu"), "params", "inputs", "assumptions"}. ValueError for an unknown network or
    device, a precision without a peak there, or a missing measured compute time."""
    from labkit.model import count_parameters, model_config
    from labkit.study import scaling
    from labkit.study.plan import STUDY_VOCAB, planned_max_micro_batch

    if network not in scaling.NETWORKS:
        raise ValueError(f"network: unknown {network!r}; known networks are {sorted(scaling.NETWORKS)}")
    cfg = model_config(model, STUDY_VOCAB, max_position_embeddings=max(512, seq_len), sparse_head=False) \
        if isinstance(model, str) else model
    params = count_parameters(cfg)["total"]
    if compute_s is None:
        peak = scaling.peak_of(device, precision)
        assumptions = [f"one rank's compute planned at {mfu:.0%} MFU of the {device}'s dense {precision} peak "
                       f"({peak / 1e12:g} TFLOP/s), not measured"]
    else:
        missing = [b for b in micro_batches if b not in compute_s]
        if missing:
            raise ValueError(f"compute_s: no measured step time for micro-batch {missing[0]}")
        assumptions = [f"one rank's compute {compute_source or 'measured'}"]
    assumptions += [f"network {network} ({gpus_per_node} per node): {scaling.NETWORKS[network]['source']}",
                    "sequences of seq_len positions count as the tokens of the critical batch and of E_min"]
    if b_crit_tokens is None:
        b_crit_tokens = 2.1e8 / target_loss ** (1 / 0.21)
        assumptions.append(f"B_crit = 2.1e8 tokens / L^(1/0.21) at L = {target_loss} nats (Kaplan et al. 2020, "
                           "decoder on WebText2; not measured for this MLM), so no range on the hours")
    if e_min_tokens is None:
        e_min_tokens = 20.0 * params
        assumptions.append(f"E_min = 20 tokens per parameter = {e_min_tokens:.3g} tokens (Chinchilla's ratio, "
                           "an assumption for the target)")
    assumptions.append(f"B_crit grows as progress^{growth:g} (0: constant)")
    step_s = _step_time(cfg, gpus=gpus, seq_len=seq_len, network=network, device=device, mfu=mfu,
                        precision=precision, gpus_per_node=gpus_per_node, compute_s=compute_s)
    table = forecast_table(gpus, micro_batches, step_s, e_min=e_min_tokens / seq_len, b_crit=b_crit_tokens / seq_len,
                           growth=growth, tokens_per_example=seq_len,
                           b_crit_range=None if b_crit_range_tokens is None
                           else (b_crit_range_tokens[0] / seq_len, b_crit_range_tokens[1] / seq_len))
    best = None
    if device != "cpu":
        attention = "eager" if cfg.attention_backend == "eager" else "flash"
        best = planned_max_micro_batch(cfg, device=device, seq_len=seq_len, attention=attention,
                                       precision="fp32" if precision == "tf32" else precision)["max_micro_batch"]
    table = table.with_columns(fits=pl.lit(True) if best is None else pl.col("micro_batch") <= best)
    return {"table": table.to_dicts(), "knee": {b: knee(table, b, min_gain=min_gain) for b in micro_batches},
            "rule": KNEE_RULE.format(min_gain=min_gain), "max_micro_batch": best, "params": params,
            "inputs": {"model": model if isinstance(model, str) else "config", "precision": precision,
                       "seq_len": seq_len, "network": network, "device": device,
                       "mfu": mfu if compute_s is None else None, "gpus_per_node": gpus_per_node,
                       "b_crit_tokens": b_crit_tokens,
                       "b_crit_sequences": b_crit_tokens / seq_len, "b_crit_range_tokens": b_crit_range_tokens,
                       "e_min_tokens": e_min_tokens, "growth": growth, "min_gain": min_gain},
            "assumptions": assumptions}


def _step_time(cfg: Any, *, gpus: list[int], seq_len: int, network: str, device: str, mfu: float, precision: str,
               gpus_per_node: int, compute_s: dict[int, float] | None) -> Callable[[int, int], float]:
    """``step_s(n, b)``: seconds of one step at n GPUs and micro-batch b (``study_forecast``)."""
    from labkit.model import count_parameters
    from labkit.study import scaling

    cache: dict[int, pl.DataFrame] = {}
    grad_bytes = 4 * count_parameters(cfg)["total"]
    last = scaling.embedding_bucket_bytes(cfg, grad_dtype_bytes=4)

    def step_s(n: int, b: int) -> float:
        if compute_s is not None:
            return scaling.step_time(n, compute_s=compute_s[b], grad_bytes=grad_bytes, network=network,
                                     gpus_per_node=gpus_per_node, last_bucket_bytes=last)["step_s"]
        if b not in cache:
            cache[b] = scaling.precision_experiment(cfg, micro_batch=b, seq_len=seq_len, device=device,
                                                    network=network, gpus=tuple(gpus), gpus_per_node=gpus_per_node,
                                                    mfu=mfu, precisions=(precision,))
        return cache[b].filter(pl.col("n_gpus") == n)["step_s"].item()

    return step_s
