"""Distributed plumbing: rank from the environment, process group, DDP wrapping, collectives.

Every rank runs the same code. Rank and world size come from the environment variables
torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so ``train(cfg)`` runs
the same way under torchrun, in ipyparallel engines (whose env the cluster layer sets) or in a
test (pattern: ``karpathy/nanochat: nanochat/common.py`` ``get_dist_info``). Without those
variables the process is a single rank and no process group is created.

Parallelism is applied from outside the model (as torchtitan does): the model is built
for one device, then, in this order (torchtitan's ``parallelize.py`` order): activation
checkpointing (``ModelConfig.activation_checkpointing``, set before the model is built) ->
data-parallel wrapper (``wrap_model``: DDP, or FSDP2 ``fully_shard`` per layer then the root)
-> optimiser (``build_optimizer`` in train.py: AdamW, or ZeroRedundancyOptimizer for zero1).
Strategies (TrainConfig.sharding; memory per ZeRO, arXiv:1910.02054, docs/references.md C4):

- ``ddp``: everything replicated; gradients all-reduced (averaged) once per optimiser step, in
  place in DDP's buckets (the gradients are views of them).
- ``zero1``: DDP for gradients + ``torch.distributed.optim.ZeroRedundancyOptimizer``: each
  rank keeps the AdamW moments of its partition of the parameters, steps it and broadcasts
  the updated parameters.
- ``fsdp``: FSDP2 ``fully_shard``: parameters, gradients and moments sharded (dim 0, DTensor);
  gathered per layer for forward/backward, gradients reduce-scattered (averaged) every
  micro-batch so they stay sharded. ``reshard_after_forward=False`` is ZeRO-2-style. In bf16
  the parameters are gathered in bf16 and gradients reduced in fp32 (``MixedPrecisionPolicy``).

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
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.train import status

with warnings.catch_warnings():
    # torch.distributed.optim's __init__ compiles its functional optimisers with torch.jit.script,
    # each raising torch 2.13's own DeprecationWarning at import (torch's call, not labkit's)
    warnings.filterwarnings("ignore", r"`torch\.jit\.(script|interface)` is deprecated", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

from labkit.train import buckets

__all__ = [
    "all_gather_object", "all_reduce_smoke_test", "all_reduce_sum", "barrier", "clip_grad_norm", "dist_info",
    "grad_scaler", "init_distributed", "is_fsdp", "is_main", "load_optimizer_state_dict", "model_state_dict",
    "new_group", "no_sync", "optimizer_state_dict", "print0", "resolve_device", "run_timeout", "set_group_timeouts",
    "static_graph_valid", "steps_to_param_devices", "teardown", "unwrap", "wrap_model"
]

_timeout: datetime.timedelta | None = None  # the run's collective timeout (init_distributed's timeout_s)

_FULL_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Gather the whole (unsharded) state onto rank 0's CPU; other ranks get an empty dict."""


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
    initialised group is reused. On CPU with gloo, set ``GLOO_SOCKET_IFNAME=lo`` and
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


def wrap_model(model: torch.nn.Module, cfg: Any, device: torch.device) -> torch.nn.Module:
    """Wrap ``model`` (already on ``device``) for data parallelism per ``cfg.sharding`` when a
    process group is active; return ``model`` unchanged otherwise (one process).

    ddp / zero1: ``DistributedDataParallel`` (``find_unused_parameters=False``,
    ``gradient_as_bucket_view=True``: the gradients are views of the all-reduce buckets, so DDP
    keeps no second copy; ``device_ids`` on CUDA only), ``bucket_cap_mb=cfg.bucket_cap_mb`` and
    ``static_graph`` where ``static_graph_valid``; zero1's sharding is in the optimiser.
    fsdp: ``fully_shard`` on each module of ``model.layers`` (one all-gather / reduce-scatter
    unit per encoder layer), then on the root (embeddings, head), with
    ``reshard_after_forward=cfg.fsdp_reshard_after_forward``; with ``cfg.precision`` "bf16"
    also ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (as torchtitan's
    ``parallelize.py`` applies it): the all-gathers move bf16 and the bf16 weights are the
    gathered, resharded ones instead of autocast's copies of every layer; the sharded weights,
    gradients and moments stay fp32. The module is changed in place and returned. ``cfg`` None
    means ddp.
    """
    if not dist.is_initialized():
        return model
    if cfg is not None and cfg.sharding == "fsdp":
        kw: dict[str, Any] = {"reshard_after_forward": cfg.fsdp_reshard_after_forward}
        if getattr(cfg, "precision", "fp32") == "bf16":  # torchtitan's policy: bf16 compute, fp32 reductions
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in getattr(model, "layers", []):
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    # gradients as views of DDP's buckets: no second copy (20 -> 16 B per parameter with AdamW)
    cap = getattr(cfg, "bucket_cap_mb", 25.0)
    if cap == "auto":  # from the backward and the link measured now (labkit.train.buckets)
        cap = buckets.auto_bucket_cap_mb(model, cfg, device)
    return DDP(model, device_ids=device_ids, find_unused_parameters=False, gradient_as_bucket_view=True,
               bucket_cap_mb=cap, static_graph=static_graph_valid(cfg))


def static_graph_valid(cfg: Any) -> bool:
    """Whether DDP may be told the graph is static (``static_graph=True``): every model labkit
    builds uses the same parameters in the same order at every step, but DDP's static-graph
    reducer asserts (``expect_autograd_hooks_``, torch 2.13) when the first step accumulates
    under ``no_sync``, so only without gradient accumulation (``cfg.grad_accum_steps == 1``);
    ``cfg`` None (tests, benchmarks) means no."""
    return cfg is not None and getattr(cfg, "grad_accum_steps", 1) == 1


def is_fsdp(model: torch.nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model``."""
    return isinstance(model, FSDPModule)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The single-device module inside a DDP wrapper (``model`` itself otherwise, FSDP too)."""
    return model.module if isinstance(model, DDP) else model


def no_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-batch: DDP's ``no_sync()`` (no gradient all-reduce) unless ``sync``;
    a null context otherwise. FSDP reduce-scatters every micro-batch on purpose: its gradients
    then stay sharded (ZeRO-2/3 memory) at the price of one reduce-scatter per micro-batch."""
    if sync or not isinstance(model, DDP):
        return contextlib.nullcontext()
    return model.no_sync()


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the gradients of ``model`` to a global L2 norm of ``max_norm`` (``inf``: measure
    only) and return the norm before clipping, the same number on every rank.

    ddp / zero1: gradients are already all-reduced, every rank holds all of them. fsdp: each
    rank holds a DTensor shard; ``clip_grad_norm_`` on DTensors sums the squared shard norms
    over ranks (DTensor's Partial -> Replicate reduction) and returns a replicated DTensor, read
    here with ``full_tensor()``; every rank then scales its shard by the same factor;
    tests/train/test_dist.py compares fsdp's norms and parameters with DDP's.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm.item())


def grad_scaler(model: torch.nn.Module, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
    """The fp16 loss scaler (disabled: a pass-through). Under fsdp each rank sees only its
    gradient shard, so the overflow flag must be all-reduced before deciding to skip a step:
    ``ShardedGradScaler`` does that; otherwise every rank holds all gradients."""
    if is_fsdp(model):
        return ShardedGradScaler(device.type, enabled=enabled)
    return torch.amp.GradScaler(device.type, enabled=enabled)


def model_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective under fsdp (every rank calls). The full, unsharded weights by parameter name:
    on rank 0 gathered to CPU under fsdp (an empty dict on other ranks); the unwrapped module's
    ``state_dict()`` otherwise."""
    if is_fsdp(model):
        return get_model_state_dict(model, options=_FULL_ON_RANK0)
    return unwrap(model).state_dict()


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Collective for zero1 and fsdp (every rank calls). The whole optimiser state on rank 0,
    None on the others (zero1, fsdp) or each rank's own copy (ddp, identical on all ranks).

    zero1: ``consolidate_state_dict(to=0)`` sends every partition to rank 0, whose
    ``state_dict()`` then has AdamW's format (state keyed by parameter index). fsdp:
    ``get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)``: state keyed by
    parameter name, unsharded.
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if is_main() else None
    if is_fsdp(model):
        state = get_optimizer_state_dict(model, optimizer, options=_FULL_ON_RANK0)
        return state if is_main() else None
    return optimizer.state_dict()


def load_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
    """Load the whole optimiser state written by ``optimizer_state_dict`` into this rank's
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
