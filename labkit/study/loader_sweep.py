"""How many DataLoader workers keep a trainer fed (lesson 3 of arXiv:2509.05258): add loaders
until the GPU is busy, and no further.

``sweep_loader`` runs ``make_loader`` with 0, 1, ..., k workers in front of a consumer whose step
takes a given time -- measured from a real training step (``step=``), or taken from the
planner (``step_time_s=``, e.g. ``planned_step_time`` for a model at a target MFU) -- and
measures samples/s and the data-wait fraction (docs/measurement.md: time waiting for the next batch /
step time, where step time = wait + consumer time). The knee is the fewest workers whose
data-wait fraction is below a threshold. On a GPU the GPU's utilisation is sampled through NVML
(pynvml / nvidia-ml-py, imported only then) during each setting, as the study did; without
NVML that column is null.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import polars as pl

from labkit.data.mlm import make_loader
from labkit.data.shards import read_index

__all__ = ["SCHEMA", "knee", "measure_step_time", "planned_step_time", "sweep_loader", "workers_needed"]

SCHEMA = {"num_workers": pl.Int64, "batches": pl.Int64, "samples": pl.Int64, "tokens": pl.Int64,
          "n_masked": pl.Int64, "seconds": pl.Float64, "samples_per_s": pl.Float64,
          "data_wait_s": pl.Float64, "step_time_s": pl.Float64, "data_wait_fraction": pl.Float64,
          "gpu_util_mean": pl.Float64, "gpu_util_samples": pl.Int64}
"""Columns of the sweep table: per worker count, totals over the timed batches (tokens = real,
non-PAD tokens), seconds of the timed loop, mean wait and mean step time per batch (s),
data_wait_fraction = total wait / total step time, GPU utilisation (percent, mean of NVML
samples; null without NVML), then ``knee`` (Boolean) added by ``sweep_loader``."""


def planned_step_time(flops_per_token: float, *, seq_len: int, batch_size: int, peak_flops: float,
                      mfu: float = 0.4) -> float:
    """Seconds per step of one device training ``batch_size`` sequences of ``seq_len`` tokens at
    model FLOPs utilisation ``mfu``: batch_size * seq_len * flops_per_token / (mfu * peak_flops)
    (PaLM arXiv:2204.02311 app. B; ``flops_per_token`` from ``labkit.model.flops_per_token``,
    ``peak_flops`` dense FLOP/s of the device, e.g. 989e12 for an H100 SXM in bf16).
    ValueError naming mfu outside (0, 1]."""
    from labkit.study.scaling import compute_time

    return compute_time(flops_per_token, seq_len=seq_len, micro_batch=batch_size, peak_flops=peak_flops, mfu=mfu)


def workers_needed(samples_per_s_needed: float, samples_per_s_per_worker: float) -> int:
    """ceil(needed / per-worker rate): loader workers that together produce the samples/s a
    device consumes, assuming workers scale linearly (true while each has its own core)."""
    if samples_per_s_per_worker <= 0:
        raise ValueError(f"samples_per_s_per_worker: must be positive, got {samples_per_s_per_worker}")
    return max(1, math.ceil(samples_per_s_needed / samples_per_s_per_worker))


def measure_step_time(step: Callable[[dict], Any], batch: dict, *, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of ``step(batch)`` over ``repeats`` calls after ``warmup`` untimed ones.
    ``step`` must finish its device work before returning (e.g. call torch.cuda.synchronize())."""
    for _ in range(warmup):
        step(batch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def knee(table: pl.DataFrame | pl.LazyFrame, threshold: float) -> int | None:
    """Fewest ``num_workers`` in ``table`` whose data_wait_fraction < threshold; None if none is."""
    hit = (table.lazy().filter(pl.col("data_wait_fraction") < threshold)
           .select(pl.col("num_workers").min()).collect().item())
    return None if hit is None else int(hit)


class _GpuSampler:
    """Background thread reading NVML GPU utilisation (percent of time a kernel ran over the
    driver's last sample period) every ``interval_s``; inert when NVML is unavailable."""

    def __init__(self, gpu_index: int | None, interval_s: float) -> None:
        self.samples: list[float] = []
        self.interval_s, self._stop = interval_s, threading.Event()
        self._thread, self._nvml, self._handle = None, None, None
        if gpu_index is None:
            return
        try:
            import pynvml  # nvidia-ml-py; optional

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
        except Exception:  # no package, no driver, no such device: sweep without GPU samples
            self._nvml = None

    def __enter__(self) -> _GpuSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._nvml.nvmlShutdown()


def _default_gpu() -> int | None:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _one_setting(data_dir: str, num_workers: int, consume: Callable[[dict], None], *, batch_size: int,
                 n_batches: int, warmup_batches: int, loader_kw: dict, gpu_index: int | None,
                 sample_interval_s: float) -> dict:
    loader = make_loader(data_dir, batch_size=batch_size, rank=0, world_size=1, num_workers=num_workers, **loader_kw)
    sampler = loader.batch_sampler
    it = iter(loader)

    def next_batch() -> dict:
        nonlocal it
        try:
            return next(it)
        except StopIteration:  # epoch over: the sampler moved to the next epoch, start it
            it = iter(loader)
            return next(it)

    for _ in range(warmup_batches):  # worker start-up and first prefetch, not timed
        consume(next_batch())
    waits, steps, tokens, masked = [], [], 0, 0
    with _GpuSampler(gpu_index, sample_interval_s) as gpu:
        t_start = time.perf_counter()
        for _ in range(n_batches):
            t0 = time.perf_counter()
            batch = next_batch()
            t1 = time.perf_counter()
            consume(batch)
            t2 = time.perf_counter()
            waits.append(t1 - t0)
            steps.append(t2 - t0)
            tokens += int(batch["attention_mask"].sum())
            masked += int((batch["labels"] != -100).sum()) if "labels" in batch else len(batch["masked_labels"])
        seconds = time.perf_counter() - t_start
    del it, loader, sampler  # persistent workers exit with their iterator
    return {"num_workers": num_workers, "batches": n_batches, "samples": n_batches * batch_size,
            "tokens": tokens, "n_masked": masked, "seconds": seconds,
            "samples_per_s": n_batches * batch_size / seconds, "data_wait_s": sum(waits) / n_batches,
            "step_time_s": sum(steps) / n_batches, "data_wait_fraction": sum(waits) / sum(steps),
            "gpu_util_mean": statistics.fmean(gpu.samples) if gpu.samples else None,
            "gpu_util_samples": len(gpu.samples)}


def sweep_loader(data_dir: str, *, batch_size: int, step_time_s: float | None = None,
                 step: Callable[[dict], Any] | None = None, workers: Sequence[int] = (0, 1, 2),
                 n_batches: int = 50, warmup_batches: int = 5, threshold: float = 0.05, seed: int = 0,
                 mlm_probability: float = 0.15, prefetch_factor: int = 2, pin_memory: bool = False,
                 gpu_index: int | None | str = "auto", sample_interval_s: float = 0.1) -> pl.DataFrame:
    """Samples/s and data-wait fraction of ``make_loader(data_dir, ...)`` (rank 0 of 1) for each
    worker count in ``workers``, in front of a consumer taking ``step_time_s`` seconds per batch
    (``time.sleep``: a GPU-bound trainer leaves its CPU to the workers) or running ``step(batch)``
    (a real step, timed as it runs). Each setting gets fresh workers, ``warmup_batches`` untimed
    batches, then ``n_batches`` timed ones; epochs roll over as in training.

    Returns a polars DataFrame with ``SCHEMA``'s columns plus ``knee`` (True on the row of
    ``knee(table, threshold)``), one row per worker count in the order given.
    ``gpu_index="auto"`` samples the current CUDA device when torch sees one; None never samples.
    ValueError naming step_time_s unless exactly one of step_time_s / step is given, or naming
    workers / n_batches when empty or not positive.
    """
    if (step_time_s is None) == (step is None):
        raise ValueError("step_time_s: give exactly one of step_time_s (seconds) or step (a callable)")
    if step_time_s is not None and step_time_s < 0:
        raise ValueError(f"step_time_s: must be >= 0, got {step_time_s}")
    if not workers or min(workers) < 0:
        raise ValueError(f"workers: need worker counts >= 0, got {list(workers)}")
    if n_batches < 1:
        raise ValueError(f"n_batches: must be positive, got {n_batches}")
    consume = step if step is not None else (lambda batch: time.sleep(step_time_s))
    index = read_index(data_dir)
    loader_kw = dict(seed=seed, mlm_probability=mlm_probability, vocab_size=index["vocab_size"],
                     pin_memory=pin_memory, prefetch_factor=prefetch_factor)
    gpu = _default_gpu() if gpu_index == "auto" else gpu_index
    rows = [_one_setting(str(data_dir), w, consume, batch_size=batch_size, n_batches=n_batches,
                         warmup_batches=warmup_batches, loader_kw=loader_kw, gpu_index=gpu,
                         sample_interval_s=sample_interval_s) for w in workers]
    table = pl.DataFrame(rows, schema=SCHEMA, orient="row")
    at = knee(table, threshold)
    return table.with_columns(knee=pl.col("num_workers") == at if at is not None else pl.lit(False))
