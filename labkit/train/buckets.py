"""``TrainConfig.parallel.bucket_cap_mb = "auto"``: DDP's gradient bucket sized from the measured link.

A bucket of S bytes is all-reduced in t(S) = a + b·S seconds on this process group (a: the
per-collective latency, b: seconds per byte; both measured at start-up by timing all-reduces of
two sizes, ``probe_link``, so they hold the ring's 2(n-1)/n, the transport and the CPU's copy
and sum). Backward makes the gradients ready at an even rate over its ``backward_s`` (measured at
start-up on a batch of the run's shape, ``probe_backward``), the embedding's last (its gradient is
complete only when backward reaches the lookup, so the last bucket holds at least those bytes).
Buckets go onto the link one after another, each when it is full and the link is free
(``exposed_s``, the queue of ``labkit.study.scaling.link_step_time``); what is still on the link
when backward ends is exposed. Small buckets start early but pay a per bucket; large ones pay a
once but start late and leave a big last bucket. ``bucket_bytes`` takes the S of a geometric grid
with the least exposed time (the largest S within 1 % of it: fewer collectives). In closed form,
with G the gradient bytes: when the link keeps up with backward (b < backward_s/G), every S from
S1 = a / (backward_s/G - b) (the smallest whose all-reduce takes no longer than backward needs to
fill it) leaves only the last bucket exposed, at most S + the embedding's bytes, so the best is
near S1; when it cannot, the link is busy from the first bucket on and the best is about
G·sqrt(a / backward_s) (the first bucket's wait against the latencies of all of them;
tests/train/test_buckets.py checks both). Bucketed overlap: Li et al. 2020, "PyTorch
Distributed", arXiv:2006.15704 section 3.2; merging gradients by a and b: Shi, Chu and Li,
"MG-WFBP", IEEE INFOCOM 2019.

Every rank measures, the measurements are all-reduced (their maximum), so every rank computes the
same cap (DDP needs the same buckets on every rank). Rank 0 writes what it chose and from what to
``<run_dir>/bucket_auto.json``.
"""

from __future__ import annotations

import math
import pathlib
import time

import torch
import torch.distributed as dist

from labkit.config import TrainConfig

__all__ = ["EMBEDDING_MODULES", "auto_bucket_cap_mb", "bucket_bytes", "embedding_bytes", "exposed_s",
           "probe_backward", "probe_link", "queue_exposed_s"]

EMBEDDING_MODULES = ("word", "position", "token_type", "embed_norm")
"""labkit's BertMLM modules whose gradients are complete only when backward reaches the embedding
lookup (the tied word embedding among them), i.e. at the very end of backward."""

MIN_BYTES, MAX_BYTES = 64 * 2**10, 256 * 2**20
"""The grid ``bucket_bytes`` searches: 64 KiB to 256 MiB (at most all gradients), 4 steps per doubling."""


def queue_exposed_s(times: list[float], ready: list[float], backward_s: float) -> float:
    """Seconds the link is still busy after backward ends, for all-reduces of ``times`` seconds that
    become ready at ``ready`` seconds into backward (in launch order) and share one link, each
    starting when it is ready and the link is free; >= 0. The queue of
    ``labkit.study.scaling.link_step_time`` and ``exposed_s``."""
    free = 0.0
    for t, r in zip(times, ready):
        free = max(free, r) + t
    return max(0.0, free - backward_s) if times else 0.0


def exposed_s(bucket: float, *, grad_bytes: float, last_bytes: float, backward_s: float, latency_s: float,
              s_per_byte: float) -> float:
    """Modelled exposed all-reduce seconds of one step with buckets of ``bucket`` bytes (module
    docstring). DDP fills buckets in the order the gradients become ready and closes one at the
    cap (``_compute_bucket_assignment_by_size``, torch/nn/parallel/distributed.py): the
    ``grad_bytes`` - ``last_bytes`` ready at an even rate over ``backward_s`` make full buckets of
    ``bucket`` bytes, each ready when full, and what is left of them joins the ``last_bytes`` (the
    embedding's, ready when backward ends) in the last bucket. Each all-reduce takes ``latency_s``
    + ``s_per_byte`` x its bytes; ``queue_exposed_s`` of them."""
    last_bytes = min(last_bytes, grad_bytes)
    full = int((grad_bytes - last_bytes) // bucket)
    sizes = [bucket] * full
    ready = [backward_s * (k + 1) * bucket / grad_bytes for k in range(full)]
    tail = grad_bytes - full * bucket
    if tail > 0:
        sizes.append(tail)
        ready.append(backward_s)
    elif ready:
        ready[-1] = backward_s
    return queue_exposed_s([latency_s + s_per_byte * s for s in sizes], ready, backward_s)


def bucket_bytes(*, grad_bytes: float, last_bytes: float, backward_s: float, latency_s: float,
                 s_per_byte: float) -> dict[str, float]:
    """The bucket size with the least ``exposed_s`` over a geometric grid (``MIN_BYTES`` to
    min(``MAX_BYTES``, ``grad_bytes``), 4 per doubling), the largest within 1 % of the least.
    Returns {"bytes", "exposed_s", "exposed_s_at_25mib" (the same model at torch's default)}.
    Raises ValueError for a non-positive gradient size or backward time, or a negative latency or
    rate."""
    if not (grad_bytes > 0 and backward_s > 0 and latency_s >= 0 and s_per_byte >= 0):
        raise ValueError(f"bucket_bytes: grad_bytes and backward_s must be positive, latency_s and s_per_byte >= 0; "
                         f"got {grad_bytes}, {backward_s}, {latency_s}, {s_per_byte}")
    top = max(MIN_BYTES, min(MAX_BYTES, grad_bytes))
    grid = [MIN_BYTES * 2 ** (k / 4) for k in range(int(4 * math.log2(top / MIN_BYTES)) + 1)] + [top]
    kw = dict(grad_bytes=grad_bytes, last_bytes=last_bytes, backward_s=backward_s, latency_s=latency_s,
              s_per_byte=s_per_byte)
    cost = {s: exposed_s(s, **kw) for s in grid}
    least = min(cost.values())
    best = max(s for s, c in cost.items() if c <= least * 1.01 + 1e-12)
    return {"bytes": best, "exposed_s": cost[best], "exposed_s_at_25mib": exposed_s(25 * 2**20, **kw)}


def embedding_bytes(model: torch.nn.Module) -> int:
    """fp32 gradient bytes of the parameters of ``EMBEDDING_MODULES`` among ``model``'s children
    (0 for a model without them): the bytes DDP's last bucket holds at least."""
    children = dict(model.named_children())
    return sum(4 * p.numel() for name in EMBEDDING_MODULES if name in children
               for p in children[name].parameters() if p.requires_grad)


def probe_link(device: torch.device, *, sizes: tuple[int, int] = (64 * 2**10, 4 * 2**20), reps: int = 5
               ) -> dict[str, float]:
    """The all-reduce of this process group timed at two sizes (bytes of fp32; one untimed, then
    the fastest of ``reps``, each after a barrier), the slowest rank's (all-reduced maximum):
    {"latency_s": a, "s_per_byte": b} of t(S) = a + b·S through the two points (a >= 0).

    The fastest, not the median: other work on the host only ever adds time, and on a loaded
    machine a median at 64 KiB came out slower than the one at 2 MiB (a slope of 0)."""
    medians = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=device)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - t0)
        medians.append(min(times))
    t = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    (s1, s2), (t1, t2) = sizes, t.tolist()
    b = max(0.0, (t2 - t1) / (s2 - s1))
    return {"latency_s": max(0.0, t1 - b * s1), "s_per_byte": b, "sizes": list(sizes), "seconds": [t1, t2]}


def probe_backward(model: torch.nn.Module, cfg: TrainConfig, device: torch.device, seq_len: int) -> float:
    """Seconds of one backward of ``model`` (labkit's BertMLM: ``model.cfg.vocab_size``) on a
    micro-batch of the run's shape (``cfg.batch.micro_batch_size`` x ``seq_len`` random ids, the masked
    share ``cfg.data.mlm_probability``, autocast per ``cfg.precision``): the second of two, the slowest
    rank's (all-reduced maximum). The RNG states are restored and the gradients cleared after, so
    the run trains as it would have."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    b, vocab = cfg.batch.micro_batch_size, model.cfg.vocab_size
    times = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        ids = torch.randint(5, vocab, (b, seq_len), device=device)
        labels = torch.where(torch.rand(b, seq_len, device=device) < cfg.data.mlm_probability, ids, -100)
        labels[:, 0] = ids[:, 0]  # at least one masked position per row
        for _ in range(2):
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = model(ids, None, labels).loss_sum
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    t = torch.tensor([times[-1]], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def auto_bucket_cap_mb(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> float:
    """``bucket_cap_mb="auto"`` for ``model`` (not yet wrapped, on ``device``) under the active
    process group: the backward and the link measured (``probe_backward``, ``probe_link``), then
    ``bucket_bytes`` in MiB. The run's sequence length is ``cfg.data.seq_len``, else its shards'
    (``cfg.data_dir``'s index.json). A model that is not labkit's (no ``cfg.vocab_size``), or a run
    without a shard index, gets torch's 25 MiB. Collective: every rank calls it. Rank 0 writes
    ``<cfg.run_dir>/bucket_auto.json`` (the inputs and the choice)."""
    seq_len = cfg.data.seq_len
    index = pathlib.Path(cfg.data_dir or ".", "index.json")
    if seq_len is None and index.is_file():
        import json

        seq_len = int(json.loads(index.read_text())["seq_len"])
    if seq_len is None or not hasattr(getattr(model, "cfg", None), "vocab_size"):
        return 25.0
    grads = sum(4 * p.numel() for p in model.parameters() if p.requires_grad)
    backward = probe_backward(model, cfg, device, seq_len)
    link = probe_link(device)
    choice = bucket_bytes(grad_bytes=grads, last_bytes=embedding_bytes(model), backward_s=backward,
                          latency_s=link["latency_s"], s_per_byte=link["s_per_byte"])
    cap = choice["bytes"] / 2**20
    if dist.get_rank() == 0 and cfg.run_dir:
        from labkit.io import atomic_write_json

        record = {"bucket_cap_mb": cap, "grad_bytes": grads, "embedding_bytes": embedding_bytes(model),
                  "backward_s": backward, "seq_len": seq_len, "micro_batch": cfg.batch.micro_batch_size,
                  "world_size": dist.get_world_size(), **link, **choice}
        path = pathlib.Path(cfg.run_dir, "bucket_auto.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, record)
    return cap
