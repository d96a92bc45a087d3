"""Distributed plumbing: rank from the environment, process group, collectives, DDP's settings.

Every rank runs the same code. Rank and world size come from the environment variables
torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so ``train(cfg)`` runs
the same way under torchrun, in ipyparallel engines (whose env the cluster layer sets) or in a
test (pattern: ``karpathy/nanochat: nanochat/common.py`` ``get_dist_info``). Without those
variables the process is a single rank and no process group is created.

The model is built and wrapped for its split and data-parallel strategy by one builder
(``labkit.train.parallel.build``, torchtitan's order); this module holds the pieces it and the
step use: DDP's bucket size and static-graph rule, ``no_sync``, the collectives. Strategies
(TrainConfig.parallel.sharding; memory per ZeRO, arXiv:1910.02054, docs/references.md C4):

- ``ddp``: everything replicated; gradients all-reduced (averaged) once per optimiser step, in
  place in DDP's buckets (the gradients are views of them).
- ``zero1``: DDP for gradients + ``torch.distributed.optim.ZeroRedundancyOptimizer``: each
  rank keeps the AdamW moments of its partition of the parameters, steps it and broadcasts
  the updated parameters.
- ``fsdp``: FSDP2 ``fully_shard``: parameters, gradients and moments sharded (dim 0, DTensor);
  gathered per layer for forward/backward, gradients reduce-scattered (averaged) every
  micro-batch so they stay sharded. ``reshard_after_forward=False`` is ZeRO-2-style.
- ``replicate`` (tp or pp > 1): whole copies over dp, gradients averaged after each backward.

Every process group a run creates has the run's timeout: the default group gets
``init_distributed``'s explicit ``timeout_s``, every other group is made with ``new_group``
(which passes it; torch's own default for a new group is 30 min whatever the default group's),
and a DeviceMesh's dimension groups get it with ``set_group_timeouts`` (torchtitan's
``set_pg_timeouts`` does the same). A rank that stops answering therefore ends every other rank
within about ``timeout_s`` (``labkit.train.status`` names it).

Nothing happens at import.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.train import probes, status

with warnings.catch_warnings():
    # torch.distributed.optim's __init__ compiles its functional optimisers with torch.jit.script,
    # each raising torch 2.13's own DeprecationWarning at import (torch's call, not labkit's)
    warnings.filterwarnings("ignore", r"`torch\.jit\.(script|interface)` is deprecated", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = [
    "all_gather_object", "all_reduce_smoke_test", "all_reduce_sum", "barrier", "dist_info", "init_distributed",
    "is_fsdp", "is_main", "load_optimizer_state_dict", "new_group", "no_sync", "print0", "resolve_device",
    "run_timeout", "set_group_timeouts", "static_graph_valid", "steps_to_param_devices", "teardown"
]

_timeout: datetime.timedelta | None = None  # the run's collective timeout (init_distributed's timeout_s)


def dist_info() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` read from RANK, LOCAL_RANK, WORLD_SIZE.

    Absent variables mean a single process: ``(0, 0, 1)``. Raises ``ValueError`` naming the
    variable when one is not an integer or the values are inconsistent.
    """
    values = {}
    for name, default in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)):
        raw = os.environ.get(name)
        try:
            values[name] = default if raw in (None, "") else int(raw)
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
    rank, local_rank, world = values["RANK"], values["LOCAL_RANK"], values["WORLD_SIZE"]
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK/WORLD_SIZE: need 0 <= RANK < WORLD_SIZE, got RANK={rank} WORLD_SIZE={world}")
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK: must be >= 0, got {local_rank}")
    return rank, local_rank, world


def is_main() -> bool:
    """True on global rank 0 (and in a single process)."""
    return dist_info()[0] == 0


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only, flushed."""
    if is_main():
        print(*args, **kwargs, flush=True)


def resolve_device(device: str, local_rank: int) -> torch.device:
    """The device of this rank: ``"auto"`` is ``cuda:<local_rank>`` when CUDA is available, else
    cpu; ``"cuda"`` is ``cuda:<local_rank>`` and raises ``ValueError`` (field ``device``) without
    CUDA; ``"cpu"`` is cpu."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but torch.cuda.is_available() is False")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK: {local_rank} but only {torch.cuda.device_count()} CUDA devices are visible")
    return torch.device("cuda", local_rank)


def init_distributed(backend: str, timeout_s: float, device: torch.device) -> bool:
    """Create the default process group from the environment (``env://``) if this is a
    multi-rank run; return whether a process group is active.

    backend: ``"auto"`` (nccl on cuda, gloo on cpu), ``"gloo"`` or ``"nccl"``.
    timeout_s: timeout of setup and of every collective (seconds), passed explicitly because the
    defaults are 10 min (NCCL) / 30 min (gloo) and a hung engine should surface as an error
    (docs/references.md section E, "DDP in persistent engines").

    A single process without MASTER_ADDR gets no process group (returns False). WORLD_SIZE > 1
    requires MASTER_ADDR and MASTER_PORT (``ValueError`` naming the missing one). WORLD_SIZE 1
    with MASTER_ADDR set creates a group of one (a one-engine cluster run). An already
    initialised group is reused. torch's Flight Recorder is turned on for the group
    (``labkit.train.probes.enable_flight_recorder``, unless TORCH_FR_BUFFER_SIZE is set). On CPU with gloo, set ``GLOO_SOCKET_IFNAME=lo`` and
    ``MASTER_ADDR=127.0.0.1`` for single-host runs (Debian maps the hostname to 127.0.1.1).
    """
    global _timeout
    _timeout = datetime.timedelta(seconds=timeout_s)  # the run's, for the groups it makes (new_group), also in a
    if dist.is_initialized():  # group made by the caller
        return True
    rank, _, world = dist_info()
    if world == 1 and not os.environ.get("MASTER_ADDR"):
        return False
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"{name}: must be set for a distributed run (WORLD_SIZE={world})")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: got {backend!r}; allowed values are 'auto', 'gloo', 'nccl'")
    kwargs: dict[str, Any] = {}
    probes.enable_flight_recorder()  # each rank's status file then names the collective it is in (labkit.train.status)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world,
                            timeout=_timeout, **kwargs)
    return True


def run_timeout() -> datetime.timedelta | None:
    """The collective timeout of this process's run (``init_distributed``'s), None before one."""
    return _timeout


def new_group(ranks: list[int] | None = None, *, backend: str | None = None) -> Any:
    """Collective: ``torch.distributed.new_group(ranks, backend=...)`` with the run's timeout
    (``run_timeout``) instead of torch's 30-minute default for new groups."""
    return dist.new_group(ranks, backend=backend, timeout=_timeout)


def set_group_timeouts(mesh: Any) -> None:
    """Give every dimension group of DeviceMesh ``mesh`` the run's timeout: ``init_device_mesh``
    creates them with torch's default (30 min for gloo). Uses
    ``torch.distributed.distributed_c10d._set_pg_timeout``, as torchtitan's ``set_pg_timeouts``
    (pytorch/torchtitan: torchtitan/distributed/utils.py); a no-op before ``init_distributed``."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    if _timeout is None:
        return
    for group in mesh.get_all_groups():
        _set_pg_timeout(_timeout, group)


def static_graph_valid(cfg: Any) -> bool:
    """Whether DDP may be told the graph is static (``static_graph=True``): every model labkit
    builds uses the same parameters in the same order at every step, but DDP's static-graph
    reducer asserts (``expect_autograd_hooks_``, torch 2.13) when the first step accumulates
    under ``no_sync``, so only without gradient accumulation (``cfg.batch.grad_accum_steps == 1``)
    now or later (``cfg.batch.schedule == "fixed"``: a ramp's first step after a resume may
    accumulate); ``cfg`` None (tests, benchmarks) means no."""
    return cfg is not None and cfg.batch.grad_accum_steps == 1 and cfg.batch.schedule == "fixed"


def is_fsdp(model: torch.nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model``."""
    return isinstance(model, FSDPModule)


def no_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-batch: DDP's ``no_sync()`` (no gradient all-reduce) unless ``sync``;
    a null context otherwise. FSDP reduce-scatters every micro-batch on purpose: its gradients
    then stay sharded (ZeRO-2/3 memory) at the price of one reduce-scatter per micro-batch."""
    if sync or not isinstance(model, DDP):
        return contextlib.nullcontext()
    return model.no_sync()


def load_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
    """Load a whole optimiser state (``optimizer.state_dict()`` of one process) into this rank's
    optimiser (every rank passes the whole state). zero1: each rank keeps its partition, its
    0-dim state back on the parameters' devices (``steps_to_param_devices``); fsdp:
    ``set_optimizer_state_dict`` shards it (collective; the optimiser must not have gradients yet)."""
    if is_fsdp(model):
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        steps_to_param_devices(optimizer.optim)


def steps_to_param_devices(optimizer: torch.optim.Optimizer) -> None:
    """Put a fused or capturable optimiser's 0-dim state (AdamW's ``step``) on its parameter's
    device. ``ZeroRedundancyOptimizer.load_state_dict`` moves every 0-dim state tensor to the CPU
    (torch/distributed/optim/zero_redundancy_optimizer.py; pytorch/pytorch#124133, open), which
    fused AdamW on CUDA refuses at its next step; the default implementations keep ``step`` on
    the CPU on purpose and are left alone."""
    for group in optimizer.param_groups:
        if not (group.get("fused") or group.get("capturable")):
            continue
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() == 0 and value.device != p.device:
                    optimizer.state[p][name] = value.to(p.device)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place and return it (identity without a process group)."""
    if dist.is_initialized():
        with status.in_collective("all_reduce_sum"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(obj: Any) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` (``[obj]`` without a process group). Pickles; for
    small state (RNG, sampler position) only."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    with status.in_collective("all_gather_object"):
        dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for all ranks (no-op without a process group)."""
    if dist.is_initialized():
        with status.in_collective("barrier"):
            dist.barrier()


def all_reduce_smoke_test(timeout_s: float = 60.0) -> dict[str, Any]:
    """Check the process group: each rank all-reduces ``rank + 1``; every rank must get
    world_size * (world_size + 1) / 2. Initialises the group from the environment if needed
    (and then destroys it again). Returns {rank, local_rank, world_size, hostname, backend,
    device, sum, expected, ok} for a table in the notebook (notebooks/00_cluster)."""
    import socket

    rank, local_rank, world = dist_info()
    device = resolve_device("auto", local_rank)
    owns = not dist.is_initialized()
    init_distributed("auto", timeout_s, device)
    try:
        total = all_reduce_sum(torch.tensor([rank + 1], dtype=torch.int64, device=device)).item()
        backend = dist.get_backend() if dist.is_initialized() else None
    finally:
        if owns:
            teardown()
    expected = world * (world + 1) // 2
    return {"rank": rank, "local_rank": local_rank, "world_size": world, "hostname": socket.gethostname(),
            "backend": backend, "device": str(device), "sum": int(total), "expected": expected,
            "ok": int(total) == expected}


def teardown() -> None:
    """Destroy the default process group if one exists. A new group afterwards needs a fresh
    MASTER_PORT (re-initialisation on the same store can hang; pytorch#55967)."""
    global _timeout
    if dist.is_initialized():
        dist.destroy_process_group()
    _timeout = None
