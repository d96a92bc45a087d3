"""Measurements, each defined once (docs/measurement.md).

- tokens/s: real (non-[PAD]) tokens processed by all ranks per second of step time.
- samples/s: sequences processed by all ranks per second of step time.
- data-wait fraction: time a rank waits for its next batch / step time.
- MFU: achieved FLOP/s / (number of GPUs x dense peak FLOP/s of one GPU), with FLOPs per token
  6N + 12·L·H·Q·T (PaLM, arXiv:2204.02311 appendix B) + 6·V·H at each position where the MLM
  head computes logits (all with the dense head, the masked ones with the sparse head;
  Megatron-LM's count of the output layer; ``labkit.model.flops_per_token``).
- peak memory: CUDA ``max_memory_allocated`` on a GPU, else the process's peak RSS.
- scaling efficiency at n ranks: throughput(n) / (n x throughput(1)), weak scaling.

Timings skip warm-up steps (the caller's job) and synchronise the device before reading the
clock (``StepTimer``). When the device peak is unknown (CPU, an unlisted GPU) MFU is ``None``.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a CUDA call needs it: engines reading their RSS never load it
    import torch

PEAK_FLOPS: dict[tuple[str, str], float] = {
    # Dense tensor-core peaks in FLOP/s per GPU; dense = half of NVIDIA's with-sparsity figure.
    # Sources (docs/references.md C2): https://www.nvidia.com/en-us/data-center/h100/ ,
    # https://www.nvidia.com/en-us/data-center/h200/ , https://www.nvidia.com/en-us/data-center/a100/
    ("H100 SXM", "bf16"): 989e12,
    ("H100 SXM", "fp16"): 989e12,
    ("H100 NVL", "bf16"): 835.5e12,
    ("H100 NVL", "fp16"): 835.5e12,
    ("H200", "bf16"): 989e12,  # same tensor-core arithmetic as H100 SXM
    ("H200", "fp16"): 989e12,
    # NVIDIA's H200 page, H200 NVL column: BF16/FP16 Tensor Core 1,671 TFLOPS with sparsity (600 W
    # PCIe card; the H100 NVL's figure too), not the SXM module's 1,979
    ("H200 NVL", "bf16"): 835.5e12,
    ("H200 NVL", "fp16"): 835.5e12,
    ("A100", "bf16"): 312e12,
    ("A100", "fp16"): 312e12,
}
"""(device kind, autocast dtype) -> dense peak FLOP/s of one GPU. fp32 runs have no entry (their
peak depends on TF32 settings), so their MFU is None."""


def device_kind(name: str) -> str | None:
    """Map a CUDA device name (``torch.cuda.get_device_name``) to a ``PEAK_FLOPS`` device kind,
    or None when it is not in the table. E.g. "NVIDIA H100 80GB HBM3" -> "H100 SXM",
    "NVIDIA H100 NVL" -> "H100 NVL", "NVIDIA H200" -> "H200", "NVIDIA H200 NVL" -> "H200 NVL",
    "NVIDIA A100-SXM4-80GB" -> "A100". The H100 PCIe (a lower peak) is deliberately not matched."""
    upper = name.upper()
    if "H200" in upper:
        return "H200 NVL" if "NVL" in upper else "H200"
    if "H100" in upper:
        if "NVL" in upper:
            return "H100 NVL"
        if "SXM" in upper or "HBM3" in upper:
            return "H100 SXM"
        return None
    if "A100" in upper:
        return "A100"
    return None


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Dense peak FLOP/s of one ``device`` for ``precision`` ("bf16"/"fp16"/"fp32"), or None on
    CPU or for an unlisted device/precision."""
    if device.type != "cuda":
        return None
    import torch

    kind = device_kind(torch.cuda.get_device_name(device))
    return PEAK_FLOPS.get((kind, precision)) if kind else None


def tokens_per_s(real_tokens_all_ranks: int | float, step_time_s: float) -> float:
    """Real (non-pad) tokens summed over all ranks / step time in seconds (docs/measurement.md)."""
    return float(real_tokens_all_ranks) / step_time_s


def samples_per_s(sequences_all_ranks: int | float, step_time_s: float) -> float:
    """Sequences summed over all ranks / step time in seconds (docs/measurement.md)."""
    return float(sequences_all_ranks) / step_time_s


def data_wait_fraction(wait_s: float, step_time_s: float) -> float:
    """Share of the step a rank spends waiting for its next batch: wait_s / step_time_s
    (docs/measurement.md). ``wait_s`` is the time inside the loader's ``next`` (plus host-to-device copy)."""
    if step_time_s <= 0:
        raise ValueError(f"step_time_s: must be positive, got {step_time_s}")
    return wait_s / step_time_s


def mfu(tokens_per_second: float, flops_per_token: float, n_gpus: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation = tokens/s x FLOPs per token / (n_gpus x peak FLOP/s of one GPU)
    (PaLM, arXiv:2204.02311 appendix B; docs/measurement.md). ``tokens_per_second`` is over all GPUs;
    ``peak`` from ``peak_flops``; None when the peak is unknown (CPU)."""
    if peak is None:
        return None
    return tokens_per_second * flops_per_token / (n_gpus * peak)


def scaling_efficiency(throughput_n: float, throughput_1: float, n: int) -> float:
    """Weak-scaling efficiency at ``n`` ranks = throughput(n) / (n x throughput(1)) (docs/measurement.md),
    both in the same unit (tokens/s over all ranks) at the same per-rank batch. 1.0 is linear."""
    if n < 1 or throughput_1 <= 0:
        raise ValueError(f"n / throughput_1: need n >= 1 and throughput_1 > 0, got n={n}, throughput_1={throughput_1}")
    return throughput_n / (n * throughput_1)


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes: ``VmHWM`` of ``/proc/self/status`` on
    Linux; elsewhere ``getrusage`` ``ru_maxrss`` (bytes on macOS, KiB on other systems).

    Not ``ru_maxrss`` on Linux: it carries the peak of the process that forked this one across
    ``exec`` (an engine or rank started from a 1 GiB notebook kernel reports at least 1 GiB,
    tests/test_measure.py shows it), while ``VmHWM`` belongs to this program's own memory."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory in bytes: ``torch.cuda.max_memory_allocated`` on a CUDA device (reset it per
    window with ``reset_peak_memory``); else the process's peak resident set size
    (``peak_rss_bytes``), which is not reset."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA only; the RSS peak is process-lifetime)."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)


class PeakWindows:
    """Peak memory in its own windows (docs/measurement.md): the training steps since the last
    record (``start``/``end_step`` around each step, ``take`` for the record), and each
    evaluation or checkpoint (``around``), whose peaks are kept apart: a checkpoint's in the next
    ``take``, the largest of each kind in ``maxima``. CUDA only; on CPU every window reads the
    process's peak RSS."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.steps, self.checkpoint = device, 0, None
        self.maxima: dict[str, int | None] = {"eval_peak_mem_bytes": None, "checkpoint_peak_mem_bytes": None}

    def start(self) -> None:
        """A step begins: reset the device's peak."""
        reset_peak_memory(self.device)

    def end_step(self) -> None:
        """A step ended: keep its peak."""
        self.steps = max(self.steps, peak_memory_bytes(self.device))

    def around(self, kind: str, fn, *args, **kwargs):
        """``(fn(*args, **kwargs), its peak)`` with the peak reset before; ``kind`` "eval" or
        "checkpoint" names the window it is kept in."""
        reset_peak_memory(self.device)
        out = fn(*args, **kwargs)
        peak = peak_memory_bytes(self.device)
        key = f"{kind}_peak_mem_bytes"
        self.maxima[key] = max(self.maxima[key] or 0, peak)
        if kind == "checkpoint":
            self.checkpoint = max(self.checkpoint or 0, peak)
        return out, peak

    def take(self) -> dict[str, int]:
        """{"peak_mem_bytes": the steps' peak since the last take} (and
        "checkpoint_peak_mem_bytes" when a checkpoint was written since), then start again."""
        out = {"peak_mem_bytes": self.steps}
        if self.checkpoint is not None:
            out["checkpoint_peak_mem_bytes"] = self.checkpoint
        self.steps, self.checkpoint = 0, None
        return out


class StepTimer:
    """Wall clock for one step that synchronises the device before each reading, so queued
    CUDA kernels are counted in the step that launched them.

    ``start()`` then ``stop() -> seconds``; ``lap()`` reads without stopping.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._t0: float | None = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        """Synchronise and start the clock."""
        self._t0 = self._now()

    def lap(self) -> float:
        """Seconds since ``start`` (synchronised)."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.lap() called before start()")
        return self._now() - self._t0

    def stop(self) -> float:
        """Seconds since ``start`` (synchronised); the timer must be started again."""
        elapsed = self.lap()
        self._t0 = None
        return elapsed
