"""The one builder: every run over a (pp, dp, tp) mesh, built one way, whatever its split.

world = pp x dp x tp with tp innermost, so a tensor-parallel group is consecutive ranks, which
``labkit.cluster`` places on one node: rank = (pp_rank · dp + dp_rank) · tp + tp_rank (the mesh
order of torchtitan's ``ParallelDims``). ``Mesh`` is this rank's place in it and, whenever the
run has a process group, the ``DeviceMesh`` of the three dimensions (pp = tp = 1 included: data
parallelism alone is the (1, world, 1) mesh); a lone process without a process group has nothing
to communicate and no ``DeviceMesh``.

``build`` makes every run's model, optimiser and grad scaler, in torchtitan's order
(``pytorch/torchtitan: torchtitan/distributed/pipeline_parallel.py`` ``pipeline_llm`` splits the
model into stages first, then applies ``parallelize_fn`` to each:
``torchtitan/models/llama3/parallelize.py``: tensor parallelism, activation checkpointing,
compile, data parallelism last):

1. the pipeline split (``labkit.train.pipeline``; the whole model is the one stage at pp = 1);
2. tensor parallelism on each stage (``labkit.train.tensor_parallel``, tp > 1);
3. activation checkpointing: ``ModelConfig.activation_checkpointing``, set before the model was
   built (``labkit.train.run_config.model_config_of``); each stage's ``encode`` recomputes its layers;
4. ``torch.compile`` of each stage (``cfg.compile``; in place, so parameter names stay);
5. the data-parallel strategy on the dp group, last, where dp > 1: DDP (``ddp``; ZeRO-1's ``zero1`` adds the
   sharded optimiser), FSDP2 ``fully_shard`` per layer and per stage (``fsdp``), or whole copies
   whose gradients the step averages (``replicate``). DDP needs pp = tp = 1: it drops
   tensor-parallel parameters from its reducer and asserts inside a pipeline stage (TrainConfig
   refuses the combination).

The result is a ``ModelParts``: this rank's stages registered under the ``BertMLM``'s parameter
names, so the optimiser, ``torch.distributed.checkpoint`` and the clip see the same names at every
split. The step over it is ``labkit.train.runtime.Runtime``'s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.config import TrainConfig
from labkit.config.split import TP_ATTENTION, check_split, split_of  # noqa: F401 (re-exported)
from labkit.measure import IntervalTimer
from labkit.model.encoder import BertMLM, MLMOutput
from labkit.train import buckets, pipeline
from labkit.train.dist import new_group, set_group_timeouts, static_graph_valid
from labkit.train.optim import build_optimizer
from labkit.train.tensor_parallel import apply_tensor_parallel

__all__ = ["build", "Mesh", "ModelParts", "result_fields", "TP_ATTENTION", "check_split", "split_of"]


class Mesh:
    """This rank's place in a run's (pp, dp, tp) mesh: ``pp``, ``dp``, ``tp``, ``rank``, ``world``,
    ``pp_rank``, ``dp_rank``, ``tp_rank`` (``labkit.config.split.Split``'s arithmetic), and
    ``device_mesh``: torch's ``DeviceMesh`` of shape (pp, dp, tp), dimension names "pp", "dp", "tp"
    (``init_device_mesh``, collective: every rank builds it) whenever a process group exists, else
    None (one process, nothing to communicate). ValueError when tp x pp does not divide ``world``."""

    def __init__(self, cfg: TrainConfig, world: int, rank: int, device: torch.device) -> None:
        split = split_of(cfg, world, rank)
        self.pp, self.dp, self.tp, self.rank, self.world = split.pp, split.dp, split.tp, rank, world
        self.pp_rank, self.dp_rank, self.tp_rank = split.pp_rank, split.dp_rank, split.tp_rank
        self.device_mesh: DeviceMesh | None = None
        if tdist.is_initialized():
            self.device_mesh = init_device_mesh(device.type, (self.pp, self.dp, self.tp),
                                                mesh_dim_names=("pp", "dp", "tp"))
            set_group_timeouts(self.device_mesh)  # the run's timeout, not torch's 30 min
            if self.dp > 1 and self.tp > 1:  # one all-reduce, not one per dimension, for a norm over (dp, tp)
                set_group_timeouts(self.device_mesh["dp", "tp"]._flatten("dp_tp"))  # (torchtitan flattens alike)

    def __getitem__(self, dim: str) -> DeviceMesh:
        """The 1-D sub-mesh of ``dim`` ("pp", "dp" or "tp") holding this rank (KeyError without a process group)."""
        if self.device_mesh is None:
            raise KeyError(f"{dim}: a run without a process group has no device mesh")
        return self.device_mesh[dim]

    def group(self, dim: str) -> tdist.ProcessGroup | None:
        """The process group of ``dim`` through this rank (None without a process group)."""
        return None if self.device_mesh is None else self.device_mesh[dim].get_group()

    def __str__(self) -> str:
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}"


class ModelParts(nn.Module):
    """This rank's part of a ``BertMLM`` over its mesh (``build`` makes it).

    - ``chunks``: the modules this rank computes, each a ``BertMLM`` (the whole model at pp = 1) or
      a ``pipeline.StageModule``, after tensor parallelism, compile and FSDP2 (in place);
    - ``stages``: what the step calls for each chunk: the chunk itself, or its DDP wrapper;
    - the chunks' modules and root parameters registered under the ``BertMLM``'s names (one owner
      each), so ``named_parameters``, state dicts and the optimiser see stable names at every split;
    - ``sp_names`` (tensor-parallel parameters whose gradient each tp rank holds a partial sum of:
      ``labkit.train.tensor_parallel.apply_tensor_parallel``), ``tp_comm`` (the tp group's ``Comm``),
      ``tied_copy`` (the last stage's copy of the tied word embedding under pp, else None),
      ``embedding_group`` (that copy's group with the first stage's), ``replicas`` (the dp group
      whose gradients the step averages under ``sharding="replicate"``, else None), ``timers``
      ("tp": tensor-parallel collectives, "busy": stage compute, "reduce": FSDP2's reductions at the
      end of a pipeline step).

    ``forward(input_ids, attention_mask, labels) -> MLMOutput`` is evaluation (no schedule, no
    gradient collective): the loss sum and masked count on one rank per data-parallel replica (the
    last stage's tp rank 0) and zeros elsewhere, so a sum over all ranks counts each sequence once."""

    def __init__(self, cfg: TrainConfig, model: BertMLM, device: torch.device, mesh: Mesh) -> None:
        super().__init__()
        self.cfg, self.mcfg, self.mesh, self.device = cfg, model.cfg, mesh, device
        n_stages = mesh.pp * cfg.parallel.pp_virtual_stages
        if mesh.pp == 1:
            chunks: list[nn.Module] = [model]
        else:
            layers = pipeline.stage_layers(model.cfg.num_layers, n_stages)
            chunks = [pipeline.StageModule(model, s, n_stages, layers[s])
                      for s in pipeline.stage_indices(mesh.pp_rank, mesh.pp, cfg.parallel.pp_virtual_stages)]
        self.chunks = [c.to(device) for c in chunks]  # plain lists: not registered, no chunk prefix in names
        self.stages: list[nn.Module] = list(self.chunks)
        self.n_stages = n_stages
        self.timers = {name: IntervalTimer(device) for name in ("tp", "busy", "reduce")}
        self.sp_names: list[str] = []
        self.tp_comm: Any = None
        self.replicas: tdist.ProcessGroup | None = None
        self.embedding_group: tdist.ProcessGroup | None = None
        self.has_first = any(getattr(c, "is_first", True) for c in chunks)  # a whole model is both
        self.has_last = any(getattr(c, "is_last", True) for c in chunks)
        self.representative = self.has_last and mesh.tp_rank == 0
        self._tied: tuple[nn.Parameter, ...] = ()  # a tuple: an nn.Parameter attribute would be registered

    def register(self) -> None:
        """Register the chunks' modules and root parameters under the BertMLM names, after every
        transformation that replaces parameters (tensor parallelism, FSDP2), in the ``BertMLM``'s
        order (an optimiser over them then partitions them as over the model: ZeRO-1); one owner
        each (the tied copy and the first stage's word embedding never sit on one rank)."""
        chunks = self.chunks
        for name in (*pipeline.FIRST_PARTS, "dropout", "layers", *pipeline.LAST_PARTS):  # BertMLM's order
            if name == "layers":
                own = [[c.layers[i] for c in chunks if not isinstance(c.layers[i], nn.Identity)]
                       for i in range(self.mcfg.num_layers)]
                self.layers = nn.ModuleList(layer[0] if layer else nn.Identity() for layer in own)
                continue
            setattr(self, name, next((getattr(c, name) for c in chunks if getattr(c, name, None) is not None), None))
        for name in ("decoder", "decoder_bias"):
            p = next((getattr(c, name) for c in chunks if getattr(c, name, None) is not None), None)
            if p is not None:
                self.register_parameter(name, p)
            else:
                setattr(self, name, None)
        tied = self.mesh.pp > 1 and self.mcfg.tie_embeddings and self.has_last and not self.has_first
        self._tied = (self.word.weight,) if tied else ()

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy of the tied word embedding under pp (None elsewhere)."""
        return self._tied[0] if self._tied else None

    def train(self, mode: bool = True) -> ModelParts:
        super().train(mode)
        for stage in self.stages:  # the chunks (their own flag decides activation recomputation) and wrappers
            stage.train(mode)
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> MLMOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if self.mesh.pp == 1:
            loss_sum = self.chunks[0](input_ids, attention_mask=attention_mask, labels=labels).loss_sum
        else:
            batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
            loss_sum = pipeline.pipeline_forward(self.chunks, self.mesh.group("pp"), batch)
        n_masked = (labels != -100).sum() if labels is not None else torch.zeros((), dtype=torch.int64)
        if loss_sum is None or not self.representative:
            loss_sum, n_masked = torch.zeros((), device=input_ids.device), torch.zeros_like(n_masked)
        return MLMOutput(loss_sum.float(), n_masked, torch.empty(0, device=input_ids.device))


def build(cfg: TrainConfig, model: BertMLM, device: torch.device, mesh: Mesh) -> tuple[ModelParts, Any, Any]:
    """Every run's model, optimiser and fp16 grad scaler, in the order of the module docstring.

    ``model``: a ``BertMLM`` built alike on every rank (``cfg.seed``). Returns (``ModelParts``,
    optimiser: AdamW over this rank's parameters, or ZeRO-1's ``ZeroRedundancyOptimizer`` over the
    dp group, ``labkit.train.optim.build_optimizer``; scaler: disabled unless ``cfg.precision`` is
    fp16, torch's ``GradScaler`` where DDP leaves every gradient whole on every rank, else
    ``ShardedGradScaler``, which all-reduces the found-inf flag over the world, since each rank
    holds part of the gradients). Collective with a process group (mesh groups, FSDP2, DDP's
    broadcast)."""
    parts = ModelParts(cfg, model, device, mesh)
    for chunk in parts.chunks:
        if mesh.tp > 1:
            parts.tp_comm, names = apply_tensor_parallel(chunk, mesh["tp"], timer=parts.timers["tp"],
                                                         sequence_parallel=cfg.parallel.sequence_parallel)
            parts.sp_names += names
        if cfg.compile:
            chunk.compile()  # in place: state-dict keys unchanged (no _orig_mod prefix)
    _data_parallel(parts, cfg, mesh, device)
    parts.register()
    parts.embedding_group = _embedding_group(mesh) if mesh.pp > 1 and parts.mcfg.tie_embeddings else None
    scaler = _grad_scaler(parts, cfg, device)
    optimizer = build_optimizer(parts, cfg, group=mesh.group("dp"),
                                sharded_scaler=isinstance(scaler, ShardedGradScaler))
    return parts, optimizer, scaler


def _data_parallel(parts: ModelParts, cfg: TrainConfig, mesh: Mesh, device: torch.device) -> None:
    """The dp strategy, last, where dp > 1 (a dp group of one rank has nothing to reduce or shard):
    FSDP2 ``fully_shard`` on each chunk's layers then the chunk
    (``reshard_after_forward=cfg.parallel.fsdp_reshard_after_forward``; ``MixedPrecisionPolicy``: bf16
    parameters under bf16 autocast, as torchtitan's ``parallelize.py``; gradients reduced in fp32, or
    in bf16 with ``grad_compression="bf16"``), DDP on the dp group (``ddp``, ``zero1``: pp = tp = 1),
    or the dp group the step averages the replicas' gradients over (``replicate``)."""
    if mesh.dp == 1:
        return
    if cfg.parallel.sharding == "fsdp":
        bf16 = torch.bfloat16
        policy = MixedPrecisionPolicy(param_dtype=bf16 if cfg.precision == "bf16" else None,
                                      reduce_dtype=bf16 if cfg.parallel.grad_compression == "bf16" else torch.float32)
        kw = {"mesh": mesh["dp"], "reshard_after_forward": cfg.parallel.fsdp_reshard_after_forward, "mp_policy": policy}
        for chunk in parts.chunks:
            for layer in pipeline.owned_layers(chunk):
                fully_shard(layer, **kw)
            fully_shard(chunk, **kw)
    elif cfg.parallel.sharding == "replicate":
        parts.replicas = mesh.group("dp")
    else:
        cap = cfg.parallel.bucket_cap_mb
        if cap == "auto":  # from the backward and the link measured now (labkit.train.buckets)
            cap = buckets.auto_bucket_cap_mb(parts.chunks[0], cfg, device)
        # gradients as views of DDP's buckets: no second copy (20 -> 16 B per parameter with AdamW)
        parts.stages = [DDP(parts.chunks[0], process_group=mesh.group("dp"), gradient_as_bucket_view=True,
                            device_ids=[device.index] if device.type == "cuda" else None,
                            find_unused_parameters=False, bucket_cap_mb=cap, static_graph=static_graph_valid(cfg))]


def _grad_scaler(parts: ModelParts, cfg: TrainConfig, device: torch.device) -> Any:
    """``build``'s scaler; fp16 initialises its scale on every rank (a pipeline rank without the last
    stage never scales a loss, yet unscales and steps)."""
    enabled = cfg.precision == "fp16"
    whole = parts.mesh.world == 1 or isinstance(parts.stages[0], DDP)
    scaler = torch.amp.GradScaler(device.type, enabled=enabled) if whole else \
        ShardedGradScaler(device.type, enabled=enabled)
    if enabled:
        scaler.scale(torch.ones((), device=device))
    return scaler


def _embedding_group(mesh: Mesh) -> tdist.ProcessGroup | None:
    """The group of this rank's word-embedding copies under pp with tied embeddings: the ranks at
    (first stage, dp, tp) and (last stage, dp, tp) (Megatron-LM's embedding group). Every rank
    creates every such group, in the same order (``new_group`` is collective); None on the others."""
    mine = None
    for d in range(mesh.dp):
        for t in range(mesh.tp):
            ranks = [(p * mesh.dp + d) * mesh.tp + t for p in (0, mesh.pp - 1)]
            group = new_group(ranks)  # with the run's timeout
            if mesh.rank in ranks:
                mine = group
    return mine


def result_fields(cfg: TrainConfig, dp: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """result.json's split (dp, tp, pp, schedule) and the means over the records after
    ``timing_warmup_steps`` of the measured pipeline bubble and the seconds in tensor-parallel
    collectives (0.0 where the run is not split that way)."""
    timed = records[cfg.measure.timing_warmup_steps:] or records

    def mean(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    par = cfg.parallel
    return {"dp": dp, "tp": par.tp, "pp": par.pp, "pp_schedule": par.pp_schedule if par.pp > 1 else None,
            "pp_virtual_stages": par.pp_virtual_stages, "sequence_parallel": par.sequence_parallel,
            "pipeline_bubble": mean("pipeline_bubble"), "tp_comm_s": mean("tp_comm_s")}
