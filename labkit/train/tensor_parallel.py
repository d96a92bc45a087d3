"""Tensor (and sequence) parallelism of ``BertMLM``: Megatron-LM's column/row split, applied from outside.

Megatron-LM (Shoeybi et al. arXiv:1909.08053 section 3): in each layer the QKV and FFN-input
weights are split by output columns (every rank holds whole heads: dimension 1 of the stacked
``FusedLinear`` weight, ``labkit.model.encoder``), the attention-output and FFN-output weights
by input rows, so a layer needs one all-reduce of its output in forward after each of the two
row-parallel products and one in backward before each column-parallel one (the conjugate
operators f and g of the paper's figure 3). The word embedding and the tied decoder are split
by vocabulary rows: the embedding looks up the ids in its slice and sums over ranks, the loss is
the vocabulary-parallel cross-entropy (``VocabParallelLoss``). With ``sequence_parallel``
(Korthikanti et al. arXiv:2205.05198 section 4.2.2) the residual stream between the layers is
split along the sequence: each all-reduce becomes a reduce-scatter plus an all-gather, and the
norms and dropout run on 1/tp of the positions; the sparse head's last layer (which gathers the
masked positions from the whole sequence) and the head run on the whole sequence.

Every parameter is a DTensor on the tp mesh (Shard on the split dimension; ``Replicate()`` for the
rest, through torchtitan's ``NoParallel`` style, ``_no_parallel``), so FSDP2,
``torch.distributed.checkpoint``, the clip and fused AdamW see their global shapes on one mesh; the
modules compute on the local slices (``labkit.model.encoder.local``) and every collective is one
of the autograd functions below, each timed by an ``IntervalTimer`` (the record's ``tp_comm_s``).
Modules are switched to their tensor-parallel subclass in place (``module.__class__``, as FSDP2's
``fully_shard`` does), so parameter names do not change. Dropout: the attention dropout (on this
rank's heads) and, with sequence parallelism, the dropout on this rank's sequence chunk draw from
the per-tp-rank default stream; the dropout of the replicated residual stream becomes
``labkit.train.rng.ReplicatedDropout`` (one stream for the group; ``labkit.train.rng``). pattern: Megatron-LM
``megatron/core/tensor_parallel/layers.py``, ``mappings.py``, ``cross_entropy.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from labkit.measure import IntervalTimer
from labkit.model.encoder import IGNORE_INDEX, BertMLM, FusedLinear, Layer, local
from labkit.train.rng import ReplicatedDropout

__all__ = ["apply_tensor_parallel", "ColwiseFused", "ColwiseLinear", "Comm", "replicate_all", "RowwiseLinear",
           "shard_start", "sync_sequence_parallel_grads", "VocabEmbedding", "VocabParallelLoss"]


class Comm:
    """The tensor-parallel group of this rank and the timer of its collectives."""

    def __init__(self, group: dist.ProcessGroup, timer: IntervalTimer):
        self.group, self.timer = group, timer
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``t`` over the group in place (timed); returns it."""
        with self.timer:
            dist.all_reduce(t, op=op, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The ranks' ``t`` concatenated along ``dim`` in rank order (timed)."""
        x = t.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] * self.size, *x.shape[1:]))
        with self.timer:
            dist.all_gather_single(out, x, group=self.group)
        return out.movedim(0, dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's 1/size chunk along ``dim`` of the sum of the ranks' ``t`` (timed)."""
        x = t.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] // self.size, *x.shape[1:]))
        with self.timer:
            dist.reduce_scatter_single(out, x, group=self.group)
        return out.movedim(0, dim)

    def chunk(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's 1/size chunk of ``t`` along ``dim`` (no communication)."""
        return t.chunk(self.size, dim=dim)[self.rank].contiguous()


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward (before a column-parallel product)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return ctx.comm.all_reduce(g.contiguous()), None


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (after a row-parallel product)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return comm.all_reduce(x.contiguous())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return g, None


class _Gather(torch.autograd.Function):
    """Sequence parallel, into a column-parallel product: all-gather along the sequence forward,
    reduce-scatter backward. With ``replicated_after`` (the whole-sequence part after the
    sequence-parallel region computes the same on every rank) the backward takes this rank's chunk."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, replicated_after: bool) -> torch.Tensor:
        ctx.comm, ctx.replicated = comm, replicated_after
        return comm.all_gather(x, 1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return (ctx.comm.chunk(g, 1) if ctx.replicated else ctx.comm.reduce_scatter(g, 1)), None, None


class _Scatter(torch.autograd.Function):
    """Sequence parallel, out of a row-parallel product: reduce-scatter along the sequence
    forward, all-gather backward. With ``reduce=False`` (entering the region from a replicated
    tensor) the forward takes this rank's chunk."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, reduce: bool) -> torch.Tensor:
        ctx.comm = comm
        return comm.reduce_scatter(x, 1) if reduce else comm.chunk(x, 1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return ctx.comm.all_gather(g, 1), None, None


class _GatherLinear(torch.autograd.Function):
    """Sequence parallel, a column-parallel product of the gathered sequence, y = gather(x) W^T + b,
    keeping only this rank's x for backward: the all-gather runs again there, and the input gradient
    is reduce-scattered (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` with
    sequence parallelism; the memory of arXiv:2205.05198 section 4.2.2, where every activation of
    the layer is 1/tp). Under autocast the backward computes in the gradient's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm) -> torch.Tensor:
        ctx.comm, ctx.has_bias = comm, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(comm.all_gather(x, 1), weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        whole = ctx.comm.all_gather(x, 1).to(g.dtype)
        grad_x = ctx.comm.reduce_scatter(g.matmul(weight.to(g.dtype)), 1).to(x.dtype)
        g2 = g.reshape(-1, g.shape[-1])
        grad_w = g2.t().matmul(whole.reshape(-1, whole.shape[-1])).to(weight.dtype)
        grad_b = g2.sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class _TPLinearMixin:
    """What a tensor-parallel linear module carries: ``comm`` and whether its input or output is
    split along the sequence (``sequence_parallel``)."""

    comm: Comm
    sequence_parallel: bool

    def _column(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b for a column-parallel weight slice: f before it, or the sequence-parallel gather."""
        if self.sequence_parallel:
            return _GatherLinear.apply(x, w, b, self.comm)
        return F.linear(_Copy.apply(x, self.comm), w, b)


class ColwiseLinear(_TPLinearMixin, nn.Linear):
    """``nn.Linear`` with weight [out/tp, in] and bias [out/tp] (DTensor Shard(0)): [..., in] -> [..., out/tp]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._column(x, local(self.weight), local(self.bias))


class ColwiseFused(_TPLinearMixin, FusedLinear):
    """``FusedLinear`` with weight [parts, out/tp, in] (DTensor Shard(1)): [..., in] -> [..., parts·out/tp]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = local(self.bias)
        return self._column(x, local(self.weight).flatten(0, 1), None if b is None else b.flatten())


class RowwiseLinear(_TPLinearMixin, nn.Linear):
    """``nn.Linear`` with weight [out, in/tp] (DTensor Shard(1)) and a whole bias: [..., in/tp] ->
    [..., out], summed over ranks (reduce-scattered along the sequence when sequence-parallel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, local(self.weight))
        y = _Scatter.apply(y, self.comm, True) if self.sequence_parallel else _Reduce.apply(y, self.comm)
        return y if self.bias is None else y + local(self.bias)


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` with rows [start, start + V_local) of the vocabulary (DTensor Shard(0)):
    ids outside the slice look up zeros, and the ranks' lookups are summed (Megatron-LM's
    ``VocabParallelEmbedding``)."""

    comm: Comm
    vocab_start: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = local(self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + w.shape[0])
        pad = self.padding_idx - self.vocab_start if self.padding_idx is not None else None
        pad = pad if pad is not None and 0 <= pad < w.shape[0] else None
        x = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), w, pad)
        return _Reduce.apply(x.masked_fill(outside[..., None], 0.0), self.comm)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy summed over labels != -100 from vocabulary-split logits: the row maximum and
    then (target logit, sum of exponentials) are all-reduced, the softmax gradient is formed
    locally (Megatron-LM ``_VocabParallelCrossEntropy``)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, start: int, comm: Comm) -> torch.Tensor:
        logits = logits.float()
        shifted = logits - comm.all_reduce(logits.max(dim=1).values, dist.ReduceOp.MAX)[:, None]
        valid = labels != IGNORE_INDEX
        mine = valid & (labels >= start) & (labels < start + logits.shape[1])
        idx = (labels - start).masked_fill(~mine, 0)
        exp = shifted.exp()
        target = shifted.gather(1, idx[:, None])[:, 0].masked_fill(~mine, 0.0)
        both = comm.all_reduce(torch.stack([target, exp.sum(dim=1)]))
        ctx.save_for_backward(exp.div_(both[1][:, None]), idx, mine, valid)
        return ((both[1].log() - both[0]) * valid).sum()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(1, idx[:, None], -mine.to(grad.dtype)[:, None])
        return grad.mul_(valid.to(grad.dtype)[:, None] * g), None, None, None


class VocabParallelLoss:
    """``BertMLM.vocab_loss`` of a tensor-parallel model: (logits fp32 [n, V_local] of vocabulary
    rows [start, start + V_local), labels int64 [n]) -> fp32 sum of cross-entropy over labels != -100,
    the same number on every rank of the group."""

    def __init__(self, start: int, comm: Comm):
        self.start, self.comm = start, comm

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _VocabParallelCE.apply(logits, labels, self.start, self.comm)


def shard_start(n: int, parts: int, index: int) -> int:
    """First index of slice ``index`` when ``n`` items are split into ``parts`` as DTensor's
    Shard does (``torch.chunk``: slices of ceil(n / parts), the last ones shorter or empty)."""
    return min(index * math.ceil(n / parts), n)


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, dim: int | None, *, replicate: bool = False) -> None:
    """Replace parameter ``name`` of ``module`` by its DTensor split along ``dim`` over ``mesh``, or
    with ``replicate`` whole on every rank (``Replicate()``), each rank keeping its part of its own
    copy (no communication: every rank built the same weights from the seed)."""
    p = getattr(module, name)
    if p is None or (dim is None and not replicate):
        return
    placement = Replicate() if replicate else Shard(dim)
    setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [placement], src_data_rank=None),
                                       requires_grad=p.requires_grad))


def _no_parallel(module: nn.Module, mesh: DeviceMesh) -> None:
    """torchtitan's ``NoParallel`` style (``torchtitan/distributed/tensor_parallel.py``; torch has no
    such class): ``module``'s parameters become ``Replicate()`` DTensors on ``mesh``; its tensor
    inputs enter as ``Replicate()`` DTensors (after the hooks registered before, such as the
    sequence-parallel scatter) and its output leaves as the local tensor (before the hooks registered
    before, such as Megatron's f on the head norm). Under sequence parallelism a norm's input is this
    rank's chunk of the sequence: its computation is per position, so the same; its weight gradient
    is then this chunk's part, summed over tp after backward (``sync_sequence_parallel_grads``)."""
    for name, _ in list(module.named_parameters(recurse=False)):
        _distribute(module, name, mesh, None, replicate=True)

    def enter(m: nn.Module, args: tuple) -> tuple:
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

    def leave(m: nn.Module, args: tuple, out: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, prepend=True)


def replicate_all(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter of ``model`` not yet a DTensor becomes a ``Replicate()`` DTensor on ``mesh``:
    the tensor-parallel modules' own (a row-parallel bias; they compute on ``local``) in place, every
    other module's through ``_no_parallel``; so all of a tp run's parameters live on one mesh (and on
    the (dp, tp) mesh under FSDP2), where torch's clip, FSDP2 and fused AdamW take them together.
    A split run without tp (pp or dp only) calls it on its size-1 tp mesh: every parameter of every
    split run is a DTensor (a plain module's through ``_no_parallel``)."""
    for module in model.modules():
        plain = [n for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        if not plain:
            continue
        if module is model or isinstance(module, (_TPLinearMixin, VocabEmbedding)):
            for name in plain:
                _distribute(module, name, mesh, None, replicate=True)
        else:
            _no_parallel(module, mesh)


def _to_tp(module: nn.Module, cls: type, comm: Comm, mesh: DeviceMesh, weight_dim: int, bias_dim: int | None,
           sequence_parallel: bool) -> None:
    _distribute(module, "weight", mesh, weight_dim)
    _distribute(module, "bias", mesh, bias_dim)
    module.__class__ = cls
    module.comm, module.sequence_parallel = comm, sequence_parallel


def apply_tensor_parallel(model: BertMLM, mesh: DeviceMesh, *, sequence_parallel: bool,
                          timer: IntervalTimer) -> tuple[Comm, list[str]]:
    """Split ``model`` (a whole ``BertMLM`` or a pipeline stage of one: layers that are not its
    own are ``nn.Identity``, modules it lacks are None) over the 1-D tp ``mesh`` in place.

    Per layer: qkv and ffn_in column-parallel, attn_out and ffn_out row-parallel; the word
    embedding, an untied decoder and the decoder bias by vocabulary rows; ``model.vocab_loss``
    becomes the vocabulary-parallel loss. With ``sequence_parallel`` the residual stream from
    the embedding norm to the head (or to the sparse head's last layer) is split along the
    sequence (the batch's length must divide by tp). Returns the group's ``Comm`` and the names
    of the parameters whose gradient each rank sees only a part of, to be summed over the tp
    group after backward (``sync_sequence_parallel_grads``): the norms and row-parallel biases
    inside the sequence-parallel region (none without it). Collectives are timed by ``timer``."""
    cfg = model.cfg
    comm = Comm(mesh.get_group(), timer)
    sp_params: list[str] = []
    last = cfg.num_layers - 1
    for i, layer in enumerate(model.layers):
        if not isinstance(layer, Layer):
            continue  # another pipeline stage's layer
        sp = sequence_parallel and not (cfg.sparse_head and i == last)
        for col in (layer.qkv, layer.ffn_in):  # stacked parts split on dim 1, a plain Linear by its rows
            if isinstance(col, FusedLinear):
                _to_tp(col, ColwiseFused, comm, mesh, 1, 1, sp)
            else:
                _to_tp(col, ColwiseLinear, comm, mesh, 0, 0, sp)
        _to_tp(layer.attn_out, RowwiseLinear, comm, mesh, 1, None, sp)
        _to_tp(layer.ffn_out, RowwiseLinear, comm, mesh, 1, None, sp)
        if sp:  # these run on 1/tp of the positions: their gradients are partial sums
            sp_params += [f"layers.{i}.{m}.{n}" for m in ("attn_norm", "ffn_norm")
                          for n, _ in getattr(layer, m).named_parameters()]
            sp_params += [f"layers.{i}.{m}.bias" for m in ("attn_out", "ffn_out") if getattr(layer, m).bias is not None]
        if sequence_parallel and not sp:  # the sparse head's last layer gathers the whole sequence first
            layer.register_forward_pre_hook(lambda m, args: (_Gather.apply(args[0], comm, True), *args[1:]))
        if not sp:  # its hidden dropout acts on the replicated residual stream: one mask for the group
            layer.dropout.__class__ = ReplicatedDropout
    if not sequence_parallel and getattr(model, "dropout", None) is not None:
        model.dropout.__class__ = ReplicatedDropout  # the embeddings' dropout, on the whole sequence
    vocab = cfg.vocab_size
    start = shard_start(vocab, comm.size, comm.rank)
    if model.word is not None:
        _distribute(model.word, "weight", mesh, 0)
        model.word.__class__ = VocabEmbedding
        model.word.comm, model.word.vocab_start = comm, start
    if getattr(model, "decoder", None) is not None:
        _distribute(model, "decoder", mesh, 0)
    if getattr(model, "decoder_bias", None) is not None:
        _distribute(model, "decoder_bias", mesh, 0)
    model.vocab_loss = VocabParallelLoss(start, comm)
    if model.head_norm is not None:  # the decoder is column-parallel over the vocabulary: f before it
        model.head_norm.register_forward_hook(lambda m, args, out: _Copy.apply(out, comm))
    if sequence_parallel:
        if model.embed_norm is not None:  # the embeddings' sum enters the split stream
            model.embed_norm.register_forward_pre_hook(lambda m, args: (_Scatter.apply(args[0], comm, False),))
            sp_params += [f"embed_norm.{n}" for n, _ in model.embed_norm.named_parameters()]
        if not cfg.sparse_head:
            head = model.final_norm if model.final_norm is not None else model.head_dense
            if head is not None:
                head.register_forward_pre_hook(lambda m, args: (_Gather.apply(args[0], comm, True),))
    replicate_all(model, mesh)  # after the hooks above: the sequence-parallel ones run outside
    return comm, sp_params


def sync_sequence_parallel_grads(params: list[torch.Tensor], comm: Comm) -> None:
    """Sum the gradients of ``params`` (``apply_tensor_parallel``'s sequence-parallel norms and
    biases; their local shards under FSDP) over the tp group, as one flat all-reduce (timed)."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]))
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
