"""Measurements, each defined once (docs/measurement.md).

- tokens/s: real (non-[PAD]) tokens processed by all ranks per second of step time.
- packing efficiency: real tokens / positions computed (sequences x sequence length).
- samples/s: sequences processed by all ranks per second of step time.
- data-wait fraction: time a rank waits for its next batch / step time.
- MFU: achieved FLOP/s / (number of GPUs x dense peak FLOP/s of one GPU), with FLOPs per token
  6N + 12·L·H·Q·T (PaLM, arXiv:2204.02311 appendix B) + 6·V·H at each position where the MLM
  head computes logits (all with the dense head, the masked ones with the sparse head;
  Megatron-LM's count of the output layer; ``labkit.model.flops_per_token``).
- peak memory: CUDA ``max_memory_allocated`` on a GPU, else the process's peak RSS.
- available memory: MemAvailable, or less where a memory cgroup's limit leaves less
  (``available_memory``; ``check_cpu_budget`` refuses a CPU budget above it).
- scaling efficiency at n ranks: throughput(n) / (n x throughput(1)), weak scaling.
- statistical efficiency at global batch B: (B_noise + B0) / (B_noise + B), the progress per
  example relative to batch B0; statistical goodput: throughput x statistical efficiency (Pollux,
  OSDI'21).
- exposed communication (``comm_exposed_s``): gradient-collective time of an optimiser step not
  hidden behind backward: from the moment the last gradient is ready (end of the last backward
  kernel that produces one) to the end of the last gradient collective; a collective that runs
  inside backward and blocks it (FSDP2's reduce-scatter on CPU) is exposed whole.
- pipeline bubble fraction: 1 - (time the stages compute) / (ranks x the longest rank's schedule time).
- time in tensor-parallel collectives: the summed durations of those collectives (``IntervalTimer``).
- peak saved-activation bytes: the most bytes of tensors autograd held for backward at once (``SavedActivationPeak``).
- goodput (wall clock): productive step time of the steps the final model keeps / the run's elapsed
  time, the rest split by cause into ``badput_*`` (``goodput``; ml-goodput-measurement's meaning).

Timings skip warm-up steps (the caller's job) and synchronise the device before reading the
clock (``StepTimer``). When the device peak is unknown (CPU, an unlisted GPU) MFU is ``None``.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a CUDA call needs it: engines reading their RSS never load it
    import torch

__all__ = ["BADPUT", "CPU_RSS_OVERHEAD", "DEVICE_ALIASES", "DEVICES", "PEAK_FLOPS", "available_memory",
           "bubble_fraction", "check_cpu_budget", "comm_exposed_s", "cpu_rss_caveat", "data_wait_fraction",
           "device_kind", "device_name", "goodput",
           "IntervalTimer", "mfu", "packing_efficiency", "peak_flops", "peak_memory_bytes", "peak_rss_bytes",
           "PeakWindows", "reset_peak_memory", "samples_per_s", "SavedActivationPeak", "scaling_efficiency",
           "statistical_efficiency", "statistical_goodput", "StepTimer", "tokens_per_s"]

_H100_PAGE = "https://www.nvidia.com/en-us/data-center/h100/"
_H200_PAGE = "https://www.nvidia.com/en-us/data-center/h200/"
_A100_PAGE = "https://www.nvidia.com/en-us/data-center/a100/"

DEVICES: dict[str, dict[str, Any]] = {
    # Dense tensor-core peaks in FLOP/s per GPU; dense = half of NVIDIA's with-sparsity figure.
    # "fp32" on the CUDA cores (no tensor cores: torch's default float32_matmul_precision
    # "highest") and "tf32" fp32 tensors with TF32 matmuls on the tensor cores (half of the
    # with-sparsity figure), same pages (docs/references.md C2).
    "H100 SXM": {"memory_gb": 80, "bandwidth_tb_s": 3.35,
                 "peak_flops": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "tf32": 494.5e12},
                 "source": f"{_H100_PAGE} (80 GB HBM3, 3.35 TB/s)"},
    "H100 NVL": {"memory_gb": 94, "bandwidth_tb_s": 3.9,
                 "peak_flops": {"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 60e12, "tf32": 417.5e12},
                 "source": f"{_H100_PAGE} (H100 NVL: 94 GB HBM3, 3.9 TB/s)"},
    "H200": {"memory_gb": 141, "bandwidth_tb_s": 4.8,
             "peak_flops": {"bf16": 989e12, "fp16": 989e12},  # same tensor-core arithmetic as H100 SXM
             "source": f"{_H200_PAGE} (141 GB HBM3e, 4.8 TB/s)"},
    # NVIDIA's H200 page, H200 NVL column: BF16/FP16 Tensor Core 1,671 TFLOPS with sparsity (600 W
    # PCIe card; the H100 NVL's figure too), not the SXM module's 1,979
    "H200 NVL": {"memory_gb": 141, "bandwidth_tb_s": 4.8, "peak_flops": {"bf16": 835.5e12, "fp16": 835.5e12},
                 "source": f"{_H200_PAGE} (H200 NVL: 141 GB HBM3e, 4.8 TB/s)"},
    "A100 40GB": {"memory_gb": 40, "bandwidth_tb_s": 1.6, "peak_flops": {"bf16": 312e12, "fp16": 312e12},
                  "source": f"{_A100_PAGE} (40 GB HBM2, 1.6 TB/s)"},
    "A100 80GB": {"memory_gb": 80, "bandwidth_tb_s": 2.0, "peak_flops": {"bf16": 312e12, "fp16": 312e12},
                  "source": f"{_A100_PAGE} (80 GB HBM2e, 2.0 TB/s)"},
}
"""The one device table (``measure`` and the planner, ``labkit.study.plan``): per GPU, memory
(NVIDIA's nominal GB, taken as 1e9 bytes: the conservative reading), memory bandwidth, dense
peak FLOP/s by precision and the page they come from. A precision without an entry (fp32 on
H200, A100) gives an MFU of None."""

DEVICE_ALIASES: dict[str, str] = {"A100": "A100 40GB"}
"""Older names still accepted: "A100" (``measure``'s name before the table was shared; both A100s
have the same peaks) is the 40 GB card, the smaller memory."""

PEAK_FLOPS: dict[tuple[str, str], float] = {
    (name, precision): flops for name, d in DEVICES.items() for precision, flops in d["peak_flops"].items()}
PEAK_FLOPS |= {(alias, precision): flops for alias, name in DEVICE_ALIASES.items()
               for (n, precision), flops in list(PEAK_FLOPS.items()) if n == name}
"""(device name or alias, precision) -> dense peak FLOP/s of one GPU: ``DEVICES``' peaks as pairs."""


def device_name(name: str) -> str:
    """The ``DEVICES`` name of ``name``: a table name, an alias (``DEVICE_ALIASES``) or a CUDA
    product name (``torch.cuda.get_device_name``, through ``device_kind``). ValueError in one
    line listing the known names when it is none of these."""
    if name in DEVICES:
        return name
    if name in DEVICE_ALIASES:
        return DEVICE_ALIASES[name]
    kind = device_kind(name)
    if kind is None:
        raise ValueError(f"device: unknown {name!r}; known devices are {', '.join(DEVICES)} "
                         f"(aliases {', '.join(DEVICE_ALIASES)})")
    return kind


def device_kind(name: str) -> str | None:
    """Map a CUDA device name (``torch.cuda.get_device_name``) to a ``DEVICES`` name, or None
    when it is not in the table. E.g. "NVIDIA H100 80GB HBM3" -> "H100 SXM",
    "NVIDIA H100 NVL" -> "H100 NVL", "NVIDIA H200" -> "H200", "NVIDIA H200 NVL" -> "H200 NVL",
    "NVIDIA A100-SXM4-80GB" -> "A100 80GB", "NVIDIA A100-PCIE-40GB" -> "A100 40GB" (an A100
    name without either size: the 40 GB card). The H100 PCIe (a lower peak) is deliberately not
    matched."""
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
        return "A100 80GB" if "80GB" in upper.replace(" ", "") else "A100 40GB"
    return None


def peak_flops(device: torch.device | str, precision: str) -> float | None:
    """Dense peak FLOP/s of one ``device`` for ``precision`` ("bf16"/"fp16"/"fp32"/"tf32"), or
    None for a precision the table has no peak for. ``device``: a ``torch.device`` (None on CPU
    or for an unlisted GPU) or a device name (``device_name``: "H100 SXM", "A100", "NVIDIA H200";
    ValueError for an unknown name; "cpu" and "cuda[:i]" are read as ``torch.device``)."""
    import torch

    if isinstance(device, str):
        if device == "cpu" or device.split(":")[0] == "cuda":
            device = torch.device(device)
        else:
            return PEAK_FLOPS.get((device_name(device), precision))
    if device.type != "cuda":
        return None
    kind = device_kind(torch.cuda.get_device_name(device))
    return PEAK_FLOPS.get((kind, precision)) if kind else None


def tokens_per_s(real_tokens_all_ranks: int | float, step_time_s: float) -> float:
    """Real (non-pad) tokens summed over all ranks / step time in seconds (docs/measurement.md)."""
    return float(real_tokens_all_ranks) / step_time_s


def packing_efficiency(real_tokens: int | float, sequences: int, seq_len: int) -> float:
    """Real (non-[PAD]) tokens / positions computed, ``sequences * seq_len`` (docs/measurement.md):
    1.0 for full packed rows, the mean document length / seq_len for padded ones. Raises
    ValueError when there are no positions."""
    if sequences < 1 or seq_len < 1:
        raise ValueError(f"sequences / seq_len: must be positive, got {sequences} / {seq_len}")
    return float(real_tokens) / (sequences * seq_len)


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


def statistical_efficiency(batch: float, b_noise: float, b0: float) -> float:
    """Progress per example at global batch ``batch`` relative to batch ``b0``:
    E(B) = (B_noise + B0) / (B_noise + B) (Pollux, Qiao et al. OSDI'21, "statistical efficiency"; AdaptDL
    ``adaptdl/goodput.py``, ``GoodputFunction.efficiency``), from the gradient noise scale
    B_noise (McCandlish et al. 2018, arXiv:1812.06162: B_simple = tr(Σ)/|G|², labkit.train.gns,
    or a measured critical batch). ``batch``, ``b_noise`` and ``b0`` in one unit (sequences, or
    tokens); 1.0 at B = B0, below 1 for larger batches (each example teaches less), towards
    (B_noise + B0) / B once B ≫ B_noise. Raises ValueError for a non-positive batch or b0 or a
    negative b_noise."""
    if not (batch > 0 and b0 > 0 and b_noise >= 0):
        raise ValueError(f"statistical_efficiency: batch and b0 must be positive and b_noise >= 0, got "
                         f"batch={batch}, b_noise={b_noise}, b0={b0}")
    return (b_noise + b0) / (b_noise + batch)


def statistical_goodput(throughput: float, batch: float, b_noise: float, b0: float) -> float:
    """Statistical goodput = throughput x ``statistical_efficiency(batch, b_noise, b0)`` (Pollux,
    Qiao et al. OSDI'21, "goodput"; AdaptDL ``GoodputFunction.evaluate``): examples (or tokens) per
    second worth of progress at batch ``b0``, in ``throughput``'s unit. Training to a target
    takes E_min (1 + B/B_noise) examples (McCandlish et al. 2018, eq. 2.11), so time to the target
    is proportional to 1 / goodput: a configuration with twice the goodput gets there in half the
    time, whatever its throughput. Raises ValueError as ``statistical_efficiency`` and for a
    negative throughput."""
    if throughput < 0:
        raise ValueError(f"statistical_goodput: throughput must be >= 0, got {throughput}")
    return throughput * statistical_efficiency(batch, b_noise, b0)


def comm_exposed_s(collectives: list[tuple[float, float]], *, blocking: bool = False) -> float:
    """Exposed gradient communication of one optimiser step, in seconds (docs/measurement.md).

    ``collectives``: ``(start, end)`` of every gradient collective of the step, in seconds on one
    clock; a collective starts when its gradients are ready (DDP launches a bucket's all-reduce
    the moment its last gradient is accumulated), so the latest start is the end of the last
    backward kernel that produces a gradient. Asynchronous collectives (DDP buckets, FSDP2 on
    CUDA): ``max(0, max(end) - max(start))``. ``blocking`` collectives run on the backward
    thread and stall it (FSDP2's reduce-scatter on CPU): the sum of their durations. 0.0 when
    there is none (one process)."""
    if not collectives:
        return 0.0
    if blocking:
        return float(sum(end - start for start, end in collectives))
    return max(0.0, max(end for _, end in collectives) - max(start for start, _ in collectives))


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

    ``start()`` then ``stop() -> seconds``; ``lap()`` reads without stopping. ``stop()`` also
    sets ``cpu_s`` (CPU seconds of this process over the step, every thread: ``time.process_time``)
    and ``thread_cpu_s`` (of the calling thread alone: ``time.thread_time``); their difference is
    what other threads did meanwhile (gloo's communication threads, loader threads). A rank whose
    step takes longer than ``thread_cpu_s`` waited: for another rank, the network or a core.
    With ``comm`` (``labkit.train.comm.CommTimer``: ``reset()``, ``exposed_s()``), ``start()``
    resets it and ``stop()`` sets ``comm_exposed_s`` (``comm_exposed_s`` below) from the
    collectives of the step, after the synchronisation; without, it is 0.0.
    """

    def __init__(self, device: torch.device, comm=None):
        self.device, self.comm = device, comm
        self._t0: float | None = None
        self._cpu0 = self._thread0 = 0.0
        self.cpu_s: float | None = None
        self.thread_cpu_s: float | None = None
        self.comm_exposed_s = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        """Synchronise and start the clock."""
        if self.comm is not None:
            self.comm.reset()
        self._t0 = self._now()
        self._cpu0, self._thread0 = time.process_time(), time.thread_time()

    def lap(self) -> float:
        """Seconds since ``start`` (synchronised)."""
        if self._t0 is None:
            raise RuntimeError("StepTimer.lap() called before start()")
        return self._now() - self._t0

    def stop(self) -> float:
        """Seconds since ``start`` (synchronised); the timer must be started again."""
        elapsed = self.lap()
        self.cpu_s, self.thread_cpu_s = time.process_time() - self._cpu0, time.thread_time() - self._thread0
        self.comm_exposed_s = self.comm.exposed_s() if self.comm is not None else 0.0
        self._t0 = None
        return elapsed


def bubble_fraction(busy_s: float, span_s: float) -> float:
    """Measured pipeline bubble: the idle share of a pipeline schedule, 1 - busy_s / span_s
    (docs/measurement.md), where busy_s is the time the stages computed (their forward and backward
    chunks) summed over the ranks and span_s the pipeline's time on all of them: the number of
    ranks x the longest rank's wall time in the schedule's step (a rank done early idles until
    the pipeline drains). GPipe's ideal is (p - 1)/(m + p - 1) (Huang
    et al. arXiv:1811.06965) for p equal stages and m micro-batches (``labkit.study.plan.pipeline_bubble``)."""
    if span_s <= 0:
        raise ValueError(f"span_s: must be positive, got {span_s}")
    return 1.0 - busy_s / span_s


class IntervalTimer:
    """The summed duration of many short intervals, ``with timer: ...`` around each (the time in
    tensor-parallel collectives; a pipeline stage's compute). On CPU the wall clock around each
    interval (a gloo collective returns when it is done); on CUDA a pair of CUDA events on the
    current stream per interval, so nothing is synchronised until ``take`` reads them.

    ``take() -> (seconds, intervals)`` since the previous ``take``, and starts again.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._seconds, self._count = 0.0, 0
        self._open: list = []
        self._events: list = []

    def __enter__(self) -> IntervalTimer:
        if self.device.type == "cuda":
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._open.append(start)
        else:
            self._open.append(time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        start = self._open.pop()
        self._count += 1
        if self.device.type == "cuda":
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((start, end))
        else:
            self._seconds += time.perf_counter() - start

    def take(self) -> tuple[float, int]:
        """(seconds, number of intervals) since the last ``take``; then zero (synchronises on CUDA)."""
        if self._events:
            import torch

            torch.cuda.synchronize(self.device)
            self._seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events.clear()
        out = (self._seconds, self._count)
        self._seconds, self._count = 0.0, 0
        return out


class SavedActivationPeak:
    """The peak of the bytes autograd holds for backward while the block runs (``with peak: ...``,
    then ``peak.bytes``): every tensor saved for backward is counted once per storage from when it
    is saved (``torch.autograd.graph.saved_tensors_hooks``) until its last saved view is released
    (after the backward that used it), and storages in ``exclude`` (the parameters) are not
    counted. Unlike a CUDA allocator peak it works on CPU and counts activations only; tensors that
    are not saved for backward (transient buffers, the logits) are outside it. CPython releases an
    object when its last reference goes, which is when the count drops."""

    def __init__(self, exclude: set[int] | None = None):
        self.exclude = exclude or set()
        self.bytes = 0
        self._live = 0
        self._refs: dict[int, list[int]] = {}  # storage address -> [saved views alive, bytes]
        self._hooks = None

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self._live -= entry[1]
            del self._refs[key]

    def _pack(self, t):
        import weakref

        # a DTensor (a tensor-parallel run's parameters and the inputs of their modules) holds its
        # storage in its local tensor; its own is a wrapper without data
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        key = storage.data_ptr()
        if key not in self.exclude and storage.nbytes() > 0:
            if key not in self._refs:
                self._refs[key] = [0, storage.nbytes()]
                self._live += storage.nbytes()
                self.bytes = max(self.bytes, self._live)
            self._refs[key][0] += 1
            weakref.finalize(t, self._release, key)
        return t

    def __enter__(self) -> SavedActivationPeak:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _cgroup_memory() -> list[tuple[str, int, int]]:
    """(cgroup directory, limit bytes, usage bytes) for this process's memory cgroup and each of
    its ancestors that has a limit (v2: memory.max / memory.current; v1: memory.limit_in_bytes /
    memory.usage_in_bytes, where "no limit" is a huge number). [] when none can be read."""
    import os

    out = []
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return out
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the one unified hierarchy
            root, limit_file, usage_file = "/sys/fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            root, limit_file, usage_file = "/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = os.path.join(root, *parts[:depth])
            try:
                limit = open(os.path.join(d, limit_file)).read().strip()
                usage = int(open(os.path.join(d, usage_file)).read().strip())
            except (OSError, ValueError):
                continue
            if limit != "max" and int(limit) < 2**60:
                out.append((d, int(limit), usage))
    return out


def available_memory() -> dict:
    """Memory this process can still take, in bytes: {"bytes", "machine_available_bytes"
    (/proc/meminfo MemAvailable, the kernel's estimate of what can be allocated without swapping),
    "machine_total_bytes", "cgroup" (the tightest memory cgroup with a limit: {"path", "limit_bytes",
    "usage_bytes"}, or None)}; "bytes" = min(MemAvailable, limit - usage of every limiting cgroup).
    Where /proc/meminfo is missing (not Linux), psutil's virtual_memory gives both machine numbers."""
    info = {}
    try:
        for line in open("/proc/meminfo"):
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024  # kB
        avail, total = info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        import psutil

        vm = psutil.virtual_memory()
        avail, total = vm.available, vm.total
    groups = _cgroup_memory()
    tight = min(groups, key=lambda g: g[1] - g[2], default=None)
    free = min([avail] + [max(0, limit - usage) for _, limit, usage in groups])
    return {"bytes": int(free), "machine_available_bytes": int(avail), "machine_total_bytes": int(total),
            "cgroup": None if tight is None else {"path": tight[0], "limit_bytes": tight[1], "usage_bytes": tight[2]}}


CPU_RSS_OVERHEAD: tuple[float, float] = (1.19, 1.41)
"""(least, most) measured ratio of a CPU training process's RSS growth (``VmHWM`` less the RSS
before the model was built) to the planner's count of its tensor bytes (``plan_model`` on
"cpu", ``total_at`` at its largest micro-batch under 1 GiB): tiny 1.19, mini 1.41, small 1.22
(seq 128, fp32, 3 steps of fused AdamW; benchmarks/bench_cpu_rss.py, 2026-12-01, load average
11-15 on 2 cores). glibc's heap keeps freed blocks and torch's CPU allocator rounds them, so a
CPU budget in tensor bytes needs this much more of the machine's memory."""


def cpu_rss_caveat(budget_bytes: int) -> str:
    """One line for a plan on device "cpu": the budget counts tensor bytes, and the process's
    RSS runs ``CPU_RSS_OVERHEAD`` above them (the memory to have free, in GB)."""
    lo, hi = CPU_RSS_OVERHEAD
    return (f"CPU: the budget counts tensor bytes; a training process's RSS ran {lo:.2f}-{hi:.2f}x that "
            f"(allocator heap; benchmarks/bench_cpu_rss.py), so have {budget_bytes * hi / 1e9:.2f} GB free "
            f"for this {budget_bytes / 1e9:.2f} GB budget")


def check_cpu_budget(budget_bytes: int, available: dict, *, key: str = "budget_bytes", model: str | None = None) -> None:
    """Refuse a CPU micro-batch search whose per-rank budget exceeds what the machine (or the
    engine's memory cgroup) can give now: the search really allocates up to the budget (model
    state and the activations autograd saves), so a budget above it ends in the kernel's OOM
    killer, which may take the notebook server with it. `available`:
    ``available_memory()`` where the search runs. ValueError, one line naming
    `key`, pointing to the planner, which predicts larger budgets without allocating them."""
    if budget_bytes <= available["bytes"]:
        return
    cg, gib = available.get("cgroup"), 2**30
    where = (f"memory cgroup {cg['path']}: limit {cg['limit_bytes'] / gib:.1f} GiB, {cg['usage_bytes'] / gib:.1f} GiB "
             "used; " if cg else "") + f"MemAvailable {available['machine_available_bytes'] / gib:.1f} GiB of " \
        f"{available['machine_total_bytes'] / gib:.1f} GiB"
    raise ValueError(f"{key}: {budget_bytes / gib:.1f} GiB per rank is more than the {available['bytes'] / gib:.1f} GiB "
                     f"this machine can give now ({where}), and the search allocates its budget; plan it instead: "
                     f"labkit plan --model {model or 'MODEL'} --micro-batch B --device DEVICE "
                     "(labkit.study.plan.memory_plan)")


BADPUT = ("startup", "restart", "redone", "checkpoint", "eval", "data", "communication", "other")
"""The causes of lost wall-clock time that ``goodput`` splits the rest of a run into."""


def goodput(timeline: Any, *, end: float | None = None) -> dict[str, float]:
    """Wall-clock goodput of a run (docs/measurement.md "Goodput"): the share of its elapsed time
    spent in productive step time of steps the final model keeps (Google's
    ml-goodput-measurement, github.com/AI-Hypercomputer/ml-goodput-measurement: productive,
    preserved training progress over total time; badput by cause), from every rank's step
    timeline (``labkit.train.timeline.read_timeline``: a polars frame, all run segments).

    Per step (the ranks' rows of one segment and step): the step's wall time is the median
    ``step_s`` over ranks; its data badput the longest data wait of any rank (the step's
    collectives start when the last rank has its batch); its communication badput the exposed
    communication on the critical path: the latest completion of a gradient collective less the
    latest time any rank's gradients were ready (from the end of the step's first
    synchronisation, which all ranks leave together), else the median ``comm_exposed_s``; what
    is left is productive. Evaluation and checkpoint: the longest of any rank. A step of a
    segment that a later segment resumed before is redone: all its time (median ``t_end -
    t_start``) is ``badput_redone``. ``badput_startup``: from the first segment's start to its first
    step; ``badput_restart``: from the last row of a segment to the first step of the next (the
    failure, the restart, start-up and checkpoint load). ``badput_other`` is the rest (logging,
    the timeline itself, the time between steps, from the last row to ``end``), clipped at 0.

    Returns {"goodput", "badput_<cause>" for each of ``BADPUT`` (fractions of the elapsed time;
    with goodput they sum to 1 unless other was clipped), "goodput_elapsed_s", "goodput_productive_s"}. ``end``: unix
    time the run ended (default: its last row's ``t_end``). ValueError for a frame without rows."""
    import polars as pl

    if timeline.height == 0:
        raise ValueError("goodput: the timeline has no rows (was the run trained with timeline on?)")
    by_rank_step = ["segment_start", "step"]
    has_buckets = pl.col("sync_end_s").is_not_null() & (pl.col("bucket_ready_s").list.len() > 0)
    steps = timeline.group_by(by_rank_step).agg(
        step_s=pl.col("step_s").median(), data_s=pl.col("data_s").max(), exposed_s=pl.col("comm_exposed_s").median(),
        done_s=pl.when(has_buckets).then(pl.col("bucket_done_s").list.max() - pl.col("sync_end_s")).max(),
        ready_s=pl.when(has_buckets).then(pl.col("bucket_ready_s").list.max() - pl.col("sync_end_s")).max(),
        buckets=has_buckets.all(), eval_s=pl.col("eval_s").max(), checkpoint_s=pl.col("checkpoint_s").max(),
        row_s=(pl.col("t_end") - pl.col("t_start")).median(), t_start=pl.col("t_start").min(),
        t_end=pl.col("t_end").max(), resumed_from=pl.col("resumed_from").min()).sort(by_rank_step)
    segments = steps.group_by("segment_start").agg(pl.col("resumed_from").min(), first=pl.col("t_start").min(),
                                                   last=pl.col("t_end").max()).sort("segment_start").to_dicts()
    # a step is redone when a later segment resumed from a checkpoint before it
    later_resume = {s["segment_start"]: min((t["resumed_from"] for t in segments[i + 1:]), default=None)
                    for i, s in enumerate(segments)}
    steps = steps.with_columns(redone=pl.col("step") > pl.col("segment_start").replace_strict(
        later_resume, return_dtype=pl.Int64, default=None).fill_null(pl.col("step")))
    comm = pl.when(pl.col("buckets")).then(pl.col("done_s") - pl.col("ready_s")).otherwise(
        pl.col("exposed_s").fill_null(0.0)).clip(lower_bound=0.0)
    kept = steps.filter(~pl.col("redone")).with_columns(data_s=pl.min_horizontal("data_s", "step_s")).with_columns(
        comm_s=pl.min_horizontal(comm, pl.col("step_s") - pl.col("data_s")))
    start, stop = segments[0]["segment_start"], end if end is not None else float(steps["t_end"].max())
    elapsed = stop - start
    lost = {"startup": segments[0]["first"] - start,
            "restart": sum(max(0.0, b["first"] - a["last"]) for a, b in zip(segments, segments[1:])),
            "redone": float(steps.filter(pl.col("redone"))["row_s"].sum()),
            "checkpoint": float(kept["checkpoint_s"].sum()), "eval": float(kept["eval_s"].sum()),
            "data": float(kept["data_s"].sum()), "communication": float(kept["comm_s"].sum())}
    productive = float((kept["step_s"] - kept["data_s"] - kept["comm_s"]).sum())
    lost["other"] = max(0.0, elapsed - productive - sum(lost.values()))
    share = (lambda s: s / elapsed) if elapsed > 0 else (lambda s: 0.0)
    return {"goodput": share(productive), **{f"badput_{k}": share(lost[k]) for k in BADPUT},
            "goodput_elapsed_s": elapsed, "goodput_productive_s": productive}
