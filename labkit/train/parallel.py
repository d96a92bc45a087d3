"""Model parallelism: one run over a (pp, dp, tp) mesh, through the same training loop as data parallelism.

world = pp x dp x tp with tp innermost, so a tensor-parallel group is consecutive ranks, which
``labkit.cluster`` places on one node: rank = (pp_rank · dp + dp_rank) · tp + tp_rank (the
mesh order of torchtitan's ``ParallelDims``). ``ParallelModel`` applies, in torchtitan's order
(``torchtitan/models/llama3/infra/parallelize.py``): the pipeline split (``labkit.train.pipeline``)
-> tensor parallelism on each stage (``labkit.train.tensor_parallel``) -> data parallelism on the dp
dimension: FSDP2 ``fully_shard`` per layer and per stage (``sharding="fsdp"``), or whole copies
whose gradients are averaged over dp after each backward (``sharding="replicate"``). DDP and
ZeRO-1 are refused with tp or pp > 1: DDP drops tensor-parallel parameters from its reducer
and asserts inside a pipeline stage.

The optimiser step of ``labkit.train.loop.train`` then runs unchanged: ``forward_backward`` here
counts the masked tokens over the dp group once, runs every micro-batch (through the pipeline
schedule when pp > 1) with the loss ``loss_sum x dp / n_masked_global`` (FSDP and the replicate
path average over dp, so the gradient is that of the global batch's mean), then sums the
sequence-parallel gradients over tp, the two copies of the tied embedding over the first and
last stage, and the replicas over dp; ``clip_grad_norm`` counts every parameter once across all
three dimensions. Each step records the measured pipeline bubble and the time in tensor-parallel
collectives (``take_measures``). Checkpoints are ``torch.distributed.checkpoint`` directories of
the parameters and AdamW state under the ``BertMLM`` names (``labkit.train.checkpoint``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from labkit.config import TrainConfig
from labkit.config.split import TP_ATTENTION, Split, check_split, is_split, split_of  # noqa: F401 (re-exported)
from labkit.measure import IntervalTimer, bubble_fraction
from labkit.model.encoder import BertMLM, MLMOutput, local
from labkit.train import dist as labkit_dist
from labkit.train import pipeline
from labkit.train.checkpoint import load_split_checkpoint, read_state
from labkit.train.clip import clip_grad_norm_, copies_of
from labkit.train.comm import CommTimer, timed_all_reduce
from labkit.train.optim import build_optimizer
from labkit.train.tensor_parallel import apply_tensor_parallel, replicate_all, sync_sequence_parallel_grads

__all__ = [
    "build", "checkpoint_rank", "ParallelModel", "rank_entry", "refuse_checkpoint", "result_fields", "split_record"
]

class ParallelModel(nn.Module):
    """This rank's part of a ``BertMLM`` split over (pp, dp, tp): the modules it holds registered
    under the ``BertMLM``'s names (so ``named_parameters``, state dicts and the optimiser see
    stable names at every split), its pipeline stages (``_chunks``: the whole model when pp = 1),
    the schedule and the groups.

    ``forward(input_ids, attention_mask, labels) -> MLMOutput`` (evaluation: no schedule) gives the
    loss sum and masked count on one rank per data-parallel replica (the last stage's tp rank 0)
    and zeros elsewhere, so a sum over all ranks counts each sequence once."""

    def __init__(self, cfg: TrainConfig, model: BertMLM, device: torch.device, split: Split):
        super().__init__()
        self.cfg, self.mcfg, self.split, self.device = cfg, model.cfg, split, device
        self.mesh = init_device_mesh(device.type, (split.pp, split.dp, split.tp), mesh_dim_names=("pp", "dp", "tp"))
        labkit_dist.set_group_timeouts(self.mesh)  # the run's timeout, not torch's 30 min
        self.tp_timer, self.busy, self.reduce_timer = (IntervalTimer(device) for _ in range(3))
        n_stages = split.pp * cfg.pp_virtual_stages
        if split.pp == 1:
            chunks = [model]
        else:
            layers = pipeline.stage_layers(model.cfg.num_layers, n_stages)
            chunks = [pipeline.StageModule(model, s, n_stages, layers[s])
                      for s in pipeline.stage_indices(split.pp_rank, split.pp, cfg.pp_virtual_stages)]
        self.sp_names: list[str] = []
        self.comm = None
        for chunk in chunks:
            chunk.to(device)
            if split.tp > 1:
                self.comm, names = apply_tensor_parallel(chunk, self.mesh["tp"], timer=self.tp_timer,
                                                         sequence_parallel=cfg.sequence_parallel)
                self.sp_names += names
            else:  # pp or dp only: every parameter a Replicate() DTensor on the (size 1) tp mesh all the same
                replicate_all(chunk, self.mesh["tp"])
            if split.dp > 1 and cfg.sharding == "fsdp":
                for layer in pipeline.owned_layers(chunk):
                    fully_shard(layer, mesh=self.mesh["dp"], reshard_after_forward=cfg.fsdp_reshard_after_forward)
                fully_shard(chunk, mesh=self.mesh["dp"], reshard_after_forward=cfg.fsdp_reshard_after_forward)
        self._chunks = chunks  # a plain list: not registered, so the names below carry no chunk prefix
        self._register_parts(chunks)
        self.has_first = any(getattr(c, "is_first", True) for c in chunks)  # a whole model (pp 1) is both
        self.has_last = any(getattr(c, "is_last", True) for c in chunks)
        self.representative = self.has_last and split.tp_rank == 0
        self.dp_group = self.mesh["dp"].get_group()
        self.embedding_group = self._embedding_group() if split.pp > 1 and model.cfg.tie_embeddings else None
        self.schedule = None
        if split.pp > 1:
            stages = [pipeline.TimedStage(c, c.index, n_stages, device, group=self.mesh["pp"].get_group(),
                                          busy=self.busy, reduce=self.reduce_timer) for c in chunks]
            self.schedule = pipeline.build_schedule(stages, cfg.grad_accum_steps, cfg.pp_schedule, self._loss)
        self._scale = torch.ones((), dtype=torch.float64)
        self._last: dict[str, float] = {}
        self.dp_timer: CommTimer | None = None  # times the replicas' gradient all-reduce (labkit.train.runtime)

    # -- names -------------------------------------------------------------------------------

    def _register_parts(self, chunks: list[nn.Module]) -> None:
        """Register the chunks' modules and root parameters under the BertMLM names (one owner each:
        the tied copy and the first stage's word embedding never sit on one rank)."""
        for name in (*pipeline.FIRST_PARTS, "dropout", *pipeline.LAST_PARTS):
            owner = next((getattr(c, name) for c in chunks if getattr(c, name, None) is not None), None)
            setattr(self, name, owner)
        self.layers = nn.ModuleList(next((c.layers[i] for c in chunks if not isinstance(c.layers[i], nn.Identity)),
                                         nn.Identity()) for i in range(self.mcfg.num_layers))
        for name in ("decoder", "decoder_bias"):
            p = next((getattr(c, name) for c in chunks if getattr(c, name, None) is not None), None)
            if p is not None:
                self.register_parameter(name, p)
            else:
                setattr(self, name, None)

    def train(self, mode: bool = True) -> ParallelModel:
        super().train(mode)
        for c in self._chunks:
            c.train(mode)
        return self

    # -- one optimiser step's forwards and backwards -----------------------------------------

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]], *,
                         dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``labkit.train.runtime.forward_backward`` for a split model: this data-parallel replica's
        micro-batches (the same on its tp and pp ranks), autocast ``dtype`` (None: fp32); returns
        (loss_sum: this rank's, nonzero on one rank per replica; n_masked_global; n_tokens_global),
        the counts summed over the dp group once before the forwards."""
        counts = torch.stack([torch.stack([(b["labels"] != -100).sum(), b["attention_mask"].sum()])
                              for b in micro_batches]).sum(0).to(torch.int64)
        dist.all_reduce(counts, group=self.dp_group)
        n_masked, n_tokens = counts[0], counts[1]
        autocast = torch.autocast(self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)
        self._scale = self.split.dp / n_masked.clamp(min=1).double()
        sums: list[torch.Tensor] = []
        t0 = time.perf_counter()
        if self.schedule is None:
            for batch in micro_batches:
                with autocast:
                    out = self._chunks[0](batch["input_ids"], attention_mask=batch["attention_mask"],
                                          labels=batch["labels"])
                self._loss(out.loss_sum, None).backward()
                sums.append(out.loss_sum.detach().float())
        else:
            whole = {k: torch.cat([b[k] for b in micro_batches]) for k in ("input_ids", "attention_mask", "labels")}
            args = (whole["input_ids"],) if self.has_first else ()
            losses: list[torch.Tensor] = []  # the micro-batches' losses (not those of shape inference)
            with autocast:
                self.schedule.step(*args, attention_mask=whole["attention_mask"], labels=whole["labels"],
                                   target=whole["labels"] if self.has_last else None, losses=losses,
                                   return_outputs=False)
            sums = [loss.detach().double() / self._scale for loss in losses]
        span = time.perf_counter() - t0
        self._after_backward()
        busy, reduce_s = self.busy.take()[0], self.reduce_timer.take()[0]
        self._last = {"busy": busy, "span": span - reduce_s, "tp_comm": self.tp_timer.take()[0]}
        loss_sum = torch.stack(sums).sum().float() if sums else torch.zeros((), device=self.device)
        return (loss_sum if self.representative else torch.zeros_like(loss_sum)), n_masked, n_tokens

    def _loss(self, loss_sum: torch.Tensor, target: Any) -> torch.Tensor:
        """The loss backpropagated for one micro-batch: loss_sum x dp / n_masked_global; also the
        schedule's loss_fn on the last stage (which calls it once more, before the first step, to
        infer the gradients' shapes on placeholder inputs: the logged loss comes from ``losses``)."""
        return loss_sum.float() * self._scale.float()

    def _after_backward(self) -> None:
        """Sum what backward left partial: sequence-parallel gradients over tp, the tied embedding's
        two copies over the first and last stage, and (replicate) the replicas over dp (averaged)."""
        if self.sp_names:
            sync_sequence_parallel_grads([self.get_parameter(n) for n in self.sp_names], self.comm)
        if self.embedding_group is not None and self.word is not None and self.word.weight.grad is not None:
            dist.all_reduce(local(self.word.weight.grad), group=self.embedding_group)
        if self.cfg.sharding == "replicate" and self.split.dp > 1:
            grads = [local(p.grad) for p in self.parameters() if p.grad is not None]
            flat = timed_all_reduce(self.dp_timer, torch.cat([g.reshape(-1) for g in grads]), self.dp_group,
                                    self.split.dp)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def _embedding_group(self) -> dist.ProcessGroup:
        """The group of this rank's word-embedding copies: (first stage, dp, tp) and (last stage, dp, tp).
        Every rank creates every such group, in the same order (``new_group`` is collective)."""
        s, mine = self.split, None
        for d in range(s.dp):
            for t in range(s.tp):
                ranks = [(p * s.dp + d) * s.tp + t for p in (0, s.pp - 1)]
                group = labkit_dist.new_group(ranks)  # with the run's timeout
                if s.rank in ranks:
                    mine = group
        return mine

    # -- clipping and measures ---------------------------------------------------------------

    def grad_copies(self) -> list[tuple[nn.Parameter, float]]:
        """(parameter, copies) for ``labkit.train.clip.clip_grad_norm_``: each parameter is held by the
        dp x tp ranks of its pipeline stage (the tied word embedding by those of the first and the last
        stage), and ``clip.copies_of`` divides by its distinct shards (tp, dp or both)."""
        holders = self.split.dp * self.split.tp
        tied = self.embedding_group is not None
        return [(p, copies_of(p, holders * (2 if tied and name == "word.weight" else 1)))
                for name, p in self.named_parameters()]

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to a global L2 norm of ``max_norm`` (``inf``: measure only) and return the
        norm before clipping, the same on every rank (``labkit.train.clip.clip_grad_norm_`` over
        ``grad_copies``: every parameter counted once across tp, dp and pp)."""
        return clip_grad_norm_(self.grad_copies(), max_norm)

    def dp_modules(self) -> list[nn.Module]:
        """Every module of this rank's pipeline stages (FSDP2's units among them: ``labkit.train.comm``
        times their reduce-scatters over dp)."""
        return [m for chunk in self._chunks for m in chunk.modules()]

    def take_measures(self) -> dict[str, float | None]:
        """Collective: this step's {"pipeline_bubble": ``labkit.measure.bubble_fraction`` of every rank's
        stage compute against the pipeline's time, world x the longest rank's schedule time (a rank
        whose stages finish early, as the last stage does, is idle until the pipeline drains; None
        without pp), "tp_comm_s": mean over ranks of the seconds in tensor-parallel collectives
        (None without tp)}."""
        last = self._last or {"busy": 0.0, "span": 0.0, "tp_comm": 0.0}
        sums = torch.tensor([last["busy"], last["tp_comm"]], dtype=torch.float64)
        span = torch.tensor(last["span"], dtype=torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        world = dist.get_world_size()
        busy, tp_comm = sums.tolist()
        pipeline = self.split.pp > 1 and span.item() > 0
        return {"pipeline_bubble": bubble_fraction(busy, world * span.item()) if pipeline else None,
                "tp_comm_s": tp_comm / world if self.split.tp > 1 else None}

    # -- evaluation forward -----------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> MLMOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if self.schedule is None:
            out = self._chunks[0](input_ids, attention_mask=attention_mask, labels=labels)
            loss_sum = out.loss_sum
        else:
            batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
            loss_sum = pipeline.pipeline_forward(self._chunks, self.mesh["pp"].get_group(), batch)
        n_masked = (labels != -100).sum() if labels is not None else torch.zeros((), dtype=torch.int64)
        if loss_sum is None or not self.representative:
            loss_sum, n_masked = torch.zeros((), device=input_ids.device), torch.zeros_like(n_masked)
        return MLMOutput(loss_sum.float(), n_masked, torch.empty(0, device=input_ids.device))


def split_record(split: Split | None, cfg: TrainConfig) -> dict[str, Any] | None:
    """The split as checkpoints and results record it (None: data parallel only)."""
    if split is None:
        return None
    return {"dp": split.dp, "tp": split.tp, "pp": split.pp, "pp_schedule": cfg.pp_schedule,
            "pp_virtual_stages": cfg.pp_virtual_stages, "sequence_parallel": cfg.sequence_parallel}


def _describe(record: dict[str, Any] | None, world: int | None = None) -> str:
    if record is None:
        return f"dp {world} x tp 1 x pp 1 (data parallel only)"
    return f"dp {record['dp']} x tp {record['tp']} x pp {record['pp']}"


def refuse_checkpoint(path: Any, split: Split | None, world: int) -> None:
    """Raise ValueError (one line naming both splits) when checkpoint directory ``path`` cannot
    resume a run at ``split`` (None: data parallel only, ``world`` ranks): a split checkpoint
    (torch.distributed.checkpoint) loads at any split with the same dp degree (the data order of each
    data-parallel rank continues); a data-parallel-only checkpoint loads only into such a run."""
    state = read_state(path)
    saved = state.get("split")
    now = None if split is None else {"dp": split.dp, "tp": split.tp, "pp": split.pp}
    if (saved is None) != (now is None) or (saved is not None and saved["dp"] != now["dp"]):
        raise ValueError(f"resume: checkpoint {path} was written at {_describe(saved, state.get('world_size'))}; "
                         f"this run is {_describe(now, world)}: a checkpoint loads at another split with the same "
                         "dp (and both split or both data parallel only); set the split it was written at, or resume=False")


def rank_entry(state: dict[str, Any], rank: int, split: Split | None) -> dict[str, Any]:
    """This rank's {rng, sampler} entry of a checkpoint's state.pt (``checkpoint_rank`` for a split run)."""
    return state["ranks"][rank if split is None else checkpoint_rank(state, split)]


def build(cfg: TrainConfig, model: BertMLM, device: torch.device, split: Split,
          ckpt: Any = None) -> tuple[ParallelModel, torch.optim.Optimizer, Any, str, dict[str, Any] | None]:
    """The split run's model, optimiser (AdamW over this rank's parameters, under BertMLM names),
    fp16-less grad scaler, sharding and, from checkpoint directory ``ckpt`` (None: a fresh run),
    the loaded weights and optimiser state with state.pt. Returns (model, optimizer, scaler,
    sharding, state or None)."""
    par = ParallelModel(cfg, model, device, split)
    optimizer = build_optimizer(par, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # fp16 is refused with tp/pp (TrainConfig)
    state = load_split_checkpoint(ckpt, par, optimizer) if ckpt is not None else None
    return par, optimizer, scaler, cfg.sharding, state


def result_fields(cfg: TrainConfig, dp: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """result.json's split (dp, tp, pp, schedule) and the means over the records after
    ``timing_warmup_steps`` of the measured pipeline bubble and the time in TP collectives (None
    when the run is not split that way). The same keys for data-parallel-only runs."""
    timed = records[cfg.timing_warmup_steps:] or records

    def mean(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {"dp": dp, "tp": cfg.tp, "pp": cfg.pp, "pp_schedule": cfg.pp_schedule if cfg.pp > 1 else None,
            "pp_virtual_stages": cfg.pp_virtual_stages, "sequence_parallel": cfg.sequence_parallel,
            "pipeline_bubble": mean("pipeline_bubble"), "tp_comm_s": mean("tp_comm_s")}


def checkpoint_rank(state: dict[str, Any], split: Split) -> int:
    """The rank of the split checkpoint ``state`` whose RNG and sampler state rank ``split.rank``
    continues: the same rank at the same split, else the saved split's (first stage, tp 0) rank of
    the same data-parallel rank (every rank of a replica consumed the same batches)."""
    saved = state["split"]
    if (saved["dp"], saved["tp"], saved["pp"]) == (split.dp, split.tp, split.pp):
        return split.rank
    return split.dp_rank * saved["tp"]
