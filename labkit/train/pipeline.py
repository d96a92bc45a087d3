"""Pipeline parallelism of ``BertMLM``: hand-split stages, torch's schedules, the measured bubble.

The model is split by hand into ``pp x pp_virtual_stages`` stages (as torchtitan's
``pipeline_module_split`` does: ``torch.distributed.pipelining.pipeline()`` cannot trace a
forward with host syncs): each ``StageModule`` keeps the parts of a ``BertMLM`` it owns under the
``BertMLM``'s own parameter names (other layers become ``nn.Identity``), and its forward is the
model's split points (``embed`` on the first stage, ``encode`` over its layers, ``head_loss`` on
the last), so there is no second copy of the forward. Stage s runs on pipeline rank s mod pp
(torch's looped assignment for interleaved schedules). Only the hidden states travel between
stages; the attention mask and labels go to every stage as ``step()`` keyword arguments, split per
micro-batch by the schedule. With tied embeddings the last stage holds its own copy of the word
embedding, whose gradient is summed with the first stage's after every backward (Megatron-LM's
embedding group, ``labkit.train.parallel``).

Schedules (``torch.distributed.pipelining``): GPipe (Huang et al. arXiv:1811.06965: all forwards,
then all backwards), 1F1B (Narayanan et al. arXiv:2104.04473 section 2.2: at most p micro-batches
in flight) and interleaved 1F1B (the same paper, section 2.2: v stages per rank, bubble
(p - 1)/(v·m + p - 1)). ``TimedStage`` times each stage's forward and backward chunks, which with
the schedule's own wall time gives the measured bubble (``labkit.measure.bubble_fraction``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from labkit.measure import IntervalTimer
from labkit.model.encoder import BertMLM, Layer

__all__ = ["FIRST_PARTS", "LAST_PARTS", "SCHEDULES", "build_schedule", "owned_layers", "pipeline_forward",
           "stage_indices", "stage_layers", "StageModule", "TimedStage"]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
"""``TrainConfig.parallel.pp_schedule`` -> torch's schedule class."""

FIRST_PARTS = ("word", "position", "instruction", "argument", "token_type", "embed_norm")
"""The embedding modules (the first stage's; a model has those of its options, others are absent or None)."""
LAST_PARTS = ("final_norm", "head_dense", "head_norm")
"""The head's modules (the last stage's, with the decoder parameters and, tied, a word-embedding copy)."""


def stage_layers(num_layers: int, n_stages: int) -> list[range]:
    """The layers of each of ``n_stages`` stages: contiguous ranges, sizes differing by at most
    one, the earlier stages taking the extra layers. Raises ValueError when a stage would be empty."""
    if num_layers < n_stages:
        raise ValueError(f"num_layers: {num_layers} layers cannot fill {n_stages} pipeline stages "
                         "(pp x pp_virtual_stages); each stage needs at least one layer")
    base, extra = divmod(num_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stage_indices(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs: pp_rank, pp_rank + pp, ... (``virtual`` of them)."""
    return [pp_rank + k * pp for k in range(virtual)]


class StageModule(BertMLM):
    """Stage ``index`` of ``n_stages`` of a ``BertMLM``: copies of the parts it owns (the
    embeddings on the first stage; its ``layers``; final norm, head, decoder and, with tied
    embeddings, a copy of the word embedding on the last), named as in the ``BertMLM``.

    ``forward(x, attention_mask [B, T], labels [B, T])``: x is int64 token ids [B, T] on the first
    stage and the previous stage's hidden states otherwise; returns the hidden states, or on the
    last stage the fp32 sum of cross-entropy over the masked positions (``head_loss``)."""

    def __init__(self, model: BertMLM, index: int, n_stages: int, layers: range):
        nn.Module.__init__(self)
        self.cfg, self.index, self.n_stages, self.layer_range = model.cfg, index, n_stages, layers
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        keep = set(FIRST_PARTS if self.is_first else ()) | set(LAST_PARTS if self.is_last else ())
        if self.is_last and model.cfg.tie_embeddings:
            keep.add("word")  # the decoder's weight: summed with the first stage's gradient every step
        for name in (*FIRST_PARTS, *LAST_PARTS):
            part = getattr(model, name, None)
            setattr(self, name, copy.deepcopy(part) if name in keep and part is not None else None)
        self.dropout = copy.deepcopy(model.dropout)
        self.layers = nn.ModuleList(copy.deepcopy(layer) if i in layers else nn.Identity()
                                    for i, layer in enumerate(model.layers))
        last = self.is_last
        self.decoder = nn.Parameter(model.decoder.detach().clone()) if last and model.decoder is not None else None
        self.decoder_bias = (nn.Parameter(model.decoder_bias.detach().clone())
                             if last and model.decoder_bias is not None else None)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        ctx = self.context(attention_mask.shape, attention_mask, labels, device=attention_mask.device)
        if self.is_first:
            x = self.embed(x)
        x = self.encode(x, ctx, self.layer_range)
        return self.head_loss(x, ctx, labels).loss_sum if self.is_last else x


class TimedStage(PipelineStage):
    """``PipelineStage`` whose forward and backward chunks run inside ``busy`` (an
    ``IntervalTimer`` shared by this rank's stages) and whose gradient reduction at the end of a
    step (FSDP's reduce-scatter) runs inside ``reduce``, so neither counts as pipeline time."""

    def __init__(self, *args: Any, busy: IntervalTimer, reduce: IntervalTimer, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.busy, self.reduce = busy, reduce

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.busy:
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.busy:
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        with self.busy:
            return super().backward_weight_one_chunk(*args, **kwargs)

    def perform_reduce_grad(self, *args: Any, **kwargs: Any) -> Any:
        with self.reduce:
            return super().perform_reduce_grad(*args, **kwargs)


def build_schedule(stages: list[TimedStage], n_microbatches: int, name: str,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """Torch's schedule ``name`` over this rank's ``stages`` with ``n_microbatches`` per step and
    ``scale_grads=False`` (the loss is already normalised by the global masked count)."""
    cls = SCHEDULES[name]
    first = stages if name == "interleaved_1f1b" else stages[0]
    return cls(first, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def pipeline_forward(chunks: list[StageModule], group: dist.ProcessGroup, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Forward only (evaluation), no schedule: stage by stage through this rank's ``chunks``,
    receiving the hidden states from the previous stage's rank and sending them on (each message
    preceded by its shape and dtype). Returns the last stage's loss sum on its ranks, else None."""
    pp = dist.get_world_size(group)
    n_stages = chunks[0].n_stages
    mine = {c.index: c for c in chunks}
    x, loss = batch["input_ids"], None
    for s in range(n_stages):
        if s not in mine:
            continue
        if s > 0:
            x = _recv(group, (s - 1) % pp, batch["attention_mask"].device)
        out = mine[s](x, attention_mask=batch["attention_mask"], labels=batch["labels"])
        if s == n_stages - 1:
            loss = out
        else:
            _send(out, group, (s + 1) % pp)
        x = out
    return loss


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _send(t: torch.Tensor, group: dist.ProcessGroup, dst: int) -> None:
    """Send ``t`` to group rank ``dst``: first [ndim, dtype index, shape..., 0...] (8 int64), then the data."""
    head = torch.zeros(8, dtype=torch.int64)
    head[:2 + t.ndim] = torch.tensor([t.ndim, _DTYPES.index(t.dtype), *t.shape])
    dist.send(head.to(t.device), group=group, group_dst=dst)
    dist.send(t.contiguous(), group=group, group_dst=dst)


def _recv(group: dist.ProcessGroup, src: int, device: torch.device) -> torch.Tensor:
    """Receive what ``_send`` sent from group rank ``src``."""
    head = torch.empty(8, dtype=torch.int64, device=device)
    dist.recv(head, group=group, group_src=src)
    n = int(head[0])
    dtype, shape = _DTYPES[int(head[1])], [int(v) for v in head[2:2 + n]]
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, group=group, group_src=src)
    return t


def owned_layers(model: nn.Module) -> list[Layer]:
    """The ``Layer`` modules a whole model or a stage holds (not the placeholders of others' layers)."""
    return [m for m in model.layers if isinstance(m, Layer)]
