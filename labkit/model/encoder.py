"""The BERT encoder with an MLM head, written for one device (parallelism is applied from outside).

With the default options the architecture is transformers' ``BertForMaskedLM`` (BERT,
arXiv:1810.04805): learned absolute positions + token-type embeddings (type 0 everywhere),
post-norm blocks (LayerNorm eps ``cfg.norm_eps``), exact-erf GELU, and the MLM head dense -> GELU
-> LayerNorm -> decoder tied to the word embedding with its own bias. With weights copied across
(``load_hf_state_dict`` / ``to_hf_state_dict``) the logits agree with ``BertForMaskedLM`` to 1e-5
in fp32 (eval mode).

Options, one ``ModelConfig`` field each (see its docstrings): pre-norm, RMSNorm, Xavier/Kaiming
init and depth-scaled residual init, rotary positions, GEGLU/SwiGLU, no biases, dropout, and the
attention families of ``labkit.model.attention`` (sliding window with global layers, Linformer, linear).
The study's model (configs/study.toml; undertale-re/undertale be7ec98,
undertale/models/item/model.py) is a set of them: instruction positions without a token type,
pre-norm without a final norm, block norms of eps 1e-5, no dropout on the attention output nor its
probabilities, eager attention, and an untied decoder at every position; with its weights copied
in, logits and gradients equal the authors' model (tests/model/test_study_model.py).

Differences that change speed, not results: Q/K/V are one fused GEMM (HF has three Linears;
the study's model one per head), attention runs through ``F.scaled_dot_product_attention``
unless ``cfg.attention_backend`` is "eager", and with ``cfg.sparse_head`` the last
layer and the head run only at positions whose label is not -100 (the head part as NVIDIA's
BERT, MosaicBERT and ModernBERT do; the last layer's queries as the same argument allows).

Fused weights are stacked on a leading dimension (``FusedLinear``): Q/K/V as [3, H, H] and a
gated FFN's gate and value as [2, F, H]. Splitting dimension 1 gives every slice the same heads
(gate/value units) of each part, at any split degree, where a split of the rows of a [3H, H]
matrix would hand one rank all of Q and K: column-wise tensor parallelism (Megatron-LM,
arXiv:1909.08053 section 3) uses dimension 1. The layer reads its head count from the weight it
holds (``-1`` in its reshape), so it runs unchanged on a slice of the heads. Flattened, the
stacked weight is the [3H, H] matrix of before, so the forward runs the same GEMM on the same
memory; [3H, H] state dicts (the layout before) load through a state-dict hook.

The forward is three split points that pipeline stages call on their own parts
(``labkit.train.parallel``): ``embed`` (token ids -> hidden states), ``encode`` (the layers, or
a range of them) and ``head_loss`` (final norm, MLM head and loss), with ``context`` deriving
what they need from the attention mask and labels (key mask, rotary tables, the sparse head's
positions). The head takes a vocabulary slice of the tied weight (a DTensor split from outside,
read through ``local``) and a vocabulary-parallel loss (``BertMLM.vocab_loss``).
Parameter counts and FLOPs per token are in ``labkit.model.counts``, transformers interop in
``labkit.model.hf``, the activation-memory model in ``labkit.study.plan``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from labkit.model.attention import (apply_rotary, eager_attention, full_attention, instruction_positions,
                                    layer_attention, linear_attention, linformer_attention, rotary_tables,
                                    sliding_window_attention)
from labkit.config import SPECIAL_TOKENS, ModelConfig, did_you_mean

__all__ = ["IGNORE_INDEX", "MODEL_SIZES", "BertMLM", "Context", "cross_entropy_sum", "FusedLinear", "Layer", "local",
           "MLMOutput", "model_config"]

IGNORE_INDEX = -100
"""Label of positions that carry no MLM loss (PyTorch's cross_entropy default)."""

MODEL_SIZES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256,
                 source="labkit test size (no paper)"),
    "mini": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024,
                 source="BERT-Mini, Turc et al. arXiv:1908.08962 (L=4, H=256)"),
    "small": dict(hidden_size=512, num_layers=6, num_heads=8, intermediate_size=2048,
                  source="Turc et al. arXiv:1908.08962 grid L=6, H=512 (their named BERT-Small is L=4)"),
    "bert-120m": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
                      source="BERT-Base, arXiv:1810.04805 (110M at vocab 30,522); the 120M model of "
                             "arXiv:2509.05258 (its exact shape is not published)"),
    "bert-350m": dict(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096,
                      source="BERT-Large, arXiv:1810.04805 (340M at vocab 30,522); the 350M model of "
                             "arXiv:2509.05258 (its exact shape is not published)"),
    "bert-1.3b": dict(hidden_size=2048, num_layers=24, num_heads=32, intermediate_size=8192,
                      source="Megatron-LM BERT 1.3B, arXiv:1909.08053 table 4 (24 layers, 2048 hidden, 32 heads)"),
}
"""Named shapes: hidden_size, num_layers, num_heads, intermediate_size and where each comes from."""


class MLMOutput(NamedTuple):
    """What ``BertMLM.forward`` returns."""

    loss_sum: torch.Tensor | None
    """fp32 scalar: sum of cross-entropy over positions with label != -100 (None without labels)."""
    n_masked: torch.Tensor
    """int64 scalar: number of positions with label != -100 (0 without labels)."""
    logits: torch.Tensor
    """[n_masked, V] with the sparse head and labels, else [B, T, V]."""


class Context(NamedTuple):
    """What the split points need besides the hidden states, derived from the attention mask and
    labels by ``BertMLM.context``."""

    mask: torch.Tensor | None
    """bool [B, 1, 1, T], True = real key; None when every token is real."""
    rope: tuple[torch.Tensor, torch.Tensor] | None
    """Rotary (cos, sin) fp32 [T, Q], or None with learned positions."""
    n_masked: torch.Tensor
    """int64 scalar: positions with label != -100 (0 without labels)."""
    keep: torch.Tensor | None
    """bool [B, T]: label != -100 (None without labels)."""
    select: torch.Tensor | None
    """int64 [B, m]: each row's masked positions first (sparse head with m > 0 masked in some row), else None."""
    valid: torch.Tensor | None
    """bool [B, m]: the entries of ``select`` that are masked positions."""


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 scalar: the sum of cross-entropy of ``logits`` [n, V] at ``labels`` int64 [n] over
    labels != -100 (PyTorch's ``F.cross_entropy``, reduction "sum")."""
    return F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The part of ``t`` this process holds: ``t.to_local()`` for a parameter split from outside the
    model (a DTensor, ``labkit.train.parallel``), ``t`` itself otherwise (None stays None)."""
    return t.to_local() if isinstance(t, DTensor) else t  # isinstance: what torch.compile traces through


def model_config(name: str, vocab_size: int, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of preset ``name`` at ``vocab_size``; ``overrides`` replace fields.

    Raises ValueError for an unknown name (listing the known ones) or an unknown override field.
    """
    if name not in MODEL_SIZES:
        raise ValueError(f"model: unknown size {name!r}; known sizes are {sorted(MODEL_SIZES)}")
    fields = {k: v for k, v in MODEL_SIZES[name].items() if k != "source"}
    known = set(ModelConfig.__dataclass_fields__)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"model_overrides: unknown fields {unknown}; "
                         + did_you_mean(unknown[0], sorted(known), f"known fields are {sorted(known)}"))
    return ModelConfig(**{**fields, "vocab_size": vocab_size, **overrides})


def _validate(cfg: ModelConfig) -> None:
    """Checks beyond ``ModelConfig.__post_init__``; ValueError naming the field."""
    checks = [
        (cfg.num_layers > 0, "num_layers", "must be positive"),
        (cfg.num_heads > 0, "num_heads", "must be positive"),
        (cfg.intermediate_size is None or cfg.intermediate_size > 0, "intermediate_size", "must be positive or None"),
        (cfg.max_position_embeddings > 0, "max_position_embeddings", "must be positive"),
        (cfg.norm_eps > 0, "norm_eps", "must be positive"),
        (cfg.init_std > 0, "init_std", "must be positive"),
    ]
    for ok, name, message in checks:
        if not ok:
            raise ValueError(f"{name}: {message}, got {getattr(cfg, name)!r}")


class FusedLinear(nn.Module):
    """``parts`` linear maps of one input in one GEMM: weight [parts, out, in], bias [parts, out];
    ``forward(x [..., in]) -> [..., parts·out]``, part p in columns [p·out, (p+1)·out). Stacked on
    a leading dimension so that a split of dimension 1 (tensor parallelism) takes the same slice
    of every part; flattened it is the [parts·out, in] matrix a ``nn.Linear`` would hold. A state
    dict holding that flattened [parts·out, in] / [parts·out] layout loads through a pre-hook."""

    def __init__(self, in_features: int, out_features: int, parts: int, *, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.parts = in_features, out_features, parts
        self.weight = nn.Parameter(torch.empty(parts, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(parts, out_features)) if bias else None
        self.register_load_state_dict_pre_hook(_unflatten_fused)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``nn.Linear``'s default init on the flattened [parts·out, in] matrix (the same random
        draws, so a seed gives the weights an ``nn.Linear(in, parts·out)`` would get)."""
        w = self.weight.view(-1, self.in_features)
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., parts·out]."""
        return F.linear(x, self.weight.flatten(0, 1), None if self.bias is None else self.bias.flatten())


def _unflatten_fused(module: FusedLinear, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook of ``FusedLinear``: a flattened weight [parts·out, in] or bias
    [parts·out] (the layout of checkpoints written before the stacked layout) is viewed as
    [parts, out, in] / [parts, out]; the stacked layout passes unchanged."""
    for name, ndim in (("weight", 2), ("bias", 1)):
        t = state_dict.get(prefix + name)
        if t is not None and t.ndim == ndim:
            state_dict[prefix + name] = t.unflatten(0, (module.parts, -1))


def _norm(cfg: ModelConfig, eps: float | None = None) -> nn.Module:
    """LayerNorm or RMSNorm over hidden_size (no bias with ``cfg.bias`` False), epsilon ``eps``
    (None: ``cfg.norm_eps``)."""
    eps = cfg.norm_eps if eps is None else eps
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(cfg.hidden_size, eps=eps)
    return nn.LayerNorm(cfg.hidden_size, eps=eps, bias=cfg.bias)


class Layer(nn.Module):
    """One block. Post-norm (BERT): x = N(x + attn(x)); x = N(x + ffn(x)). Pre-norm:
    x = x + attn(N(x)); x = x + ffn(N(x)). Attention per ``labkit.model.attention.layer_attention``."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_size
        self.cfg = cfg
        self.kind = layer_attention(cfg, index)
        self.qkv = FusedLinear(h, h, 3, bias=cfg.bias)  # [3, H, H]: query, key, value (HF's three Linears)
        self.attn_out = nn.Linear(h, h, bias=cfg.bias)
        self.attn_norm = _norm(cfg, cfg.block_norm_eps)
        # gated: [2, F, H] = W (activated), V
        self.ffn_in = FusedLinear(h, f, 2, bias=cfg.bias) if cfg.activation != "gelu" else nn.Linear(h, f, bias=cfg.bias)
        self.ffn_out = nn.Linear(f, h, bias=cfg.bias)
        self.ffn_norm = _norm(cfg, cfg.block_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        if self.kind == "linformer":  # E, F of Linformer eq. 7, shared by the heads
            self.proj_k = nn.Parameter(torch.empty(cfg.linformer_k, cfg.max_position_embeddings))
            self.proj_v = nn.Parameter(torch.empty(cfg.linformer_k, cfg.max_position_embeddings))

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., H]: GELU, or GEGLU / SwiGLU = (act(x W) * x V) W2 (Shazeer arXiv:2002.05202);
        with a split ``ffn_in`` the local W and V columns."""
        y = self.ffn_in(x)
        if self.cfg.activation == "gelu":
            return self.ffn_out(F.gelu(y))
        a, b = y.chunk(2, dim=-1)
        return self.ffn_out((F.gelu(a) if self.cfg.activation == "geglu" else F.silu(a)) * b)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, rope: tuple | None = None,
                select: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H]; mask bool [B, 1, 1, T] (True = real token) or None; rope (cos, sin) [T, Q]
        or None; select int64 [B, m] or None: only these positions' outputs are wanted (the keys
        and values still come from all T), and the result is [B, m, H]. The heads are those of
        the QKV weight this module holds: all of them, or a tensor-parallel slice."""
        cfg, hd = self.cfg, self.cfg.head_dim
        pre = cfg.norm_position == "pre"
        q, k, v = self.qkv(self.attn_norm(x) if pre else x).unflatten(-1, (3, -1, hd)).permute(
            2, 0, 3, 1, 4)  # 3 x [B, nh, T, Q]
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if select is not None:
            x = x.gather(1, select[:, :, None].expand(-1, -1, x.shape[-1]))
            q = q.gather(2, select[:, None, :, None].expand(-1, q.shape[1], -1, hd))
        p = cfg.attention_dropout if self.training else 0.0
        if self.kind == "full" and cfg.attention_backend == "eager":
            a = eager_attention(q, k, v, mask, dropout_p=p, training=self.training)
        elif self.kind == "full":
            a = full_attention(q, k, v, mask, dropout_p=p)
        elif self.kind == "sliding_window":
            a = sliding_window_attention(q, k, v, mask, window=cfg.window_size, q_pos=select, dropout_p=p)
        elif self.kind == "linformer":
            a = linformer_attention(q, k, v, mask, self.proj_k, self.proj_v, dropout_p=p)
        else:
            a = linear_attention(q, k, v, mask)
        a = self.attn_out(a.transpose(1, 2).flatten(2))  # [B, Tq, H]
        if cfg.attention_output_dropout:
            a = self.dropout(a)
        if pre:
            x = x + a
            return x + self.dropout(self.ffn(self.ffn_norm(x)))
        x = self.attn_norm(x + a)
        return self.ffn_norm(x + self.dropout(self.ffn(x)))


class BertMLM(nn.Module):
    """BERT encoder + MLM head. ``forward(input_ids [B,T] int64, attention_mask [B,T] | None,
    labels [B,T] int64 | None) -> MLMOutput``; see the module docstring for the architecture."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        _validate(cfg)
        self.cfg = cfg
        h, v = cfg.hidden_size, cfg.vocab_size
        self.word = nn.Embedding(v, h, padding_idx=SPECIAL_TOKENS.index("[PAD]"))
        self.position = nn.Embedding(cfg.max_position_embeddings, h) if cfg.position_embedding == "absolute" else None
        if cfg.position_embedding == "instruction":  # the study's tables: instruction index, place in it
            self.instruction = nn.Embedding(cfg.max_position_embeddings, h)
            self.argument = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type = nn.Embedding(cfg.type_vocab_size, h) if cfg.type_vocab_size else None
        self.embed_norm = _norm(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = _norm(cfg) if cfg.norm_position == "pre" and cfg.final_norm else None
        self.head_dense = nn.Linear(h, h, bias=cfg.bias)
        self.head_norm = _norm(cfg)
        self.decoder = None if cfg.tie_embeddings else nn.Parameter(torch.empty(v, h))
        self.decoder_bias = nn.Parameter(torch.zeros(v)) if cfg.bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Init per ``cfg.init``: Linear weights normal(0, init_std) (BERT), Xavier-uniform
        (Glorot & Bengio 2010) or Kaiming-normal fan_in with the ReLU gain sqrt(2) (He et al.
        arXiv:1502.01852); embeddings and an untied decoder normal(0, init_std); biases 0; norms
        1/0; the [PAD] embedding row 0; Linformer E, F normal(0, 1/sqrt(k)). With
        ``scale_residual_init`` the attention-output and FFN-output weights are then multiplied by
        1/sqrt(2 L) (GPT-2, Radford et al. 2019 section 2.3)."""
        cfg = self.cfg
        for m in self.modules():
            if isinstance(m, (nn.Linear, FusedLinear)):  # a fused weight as its [parts·out, in] matrix
                w = m.weight.view(-1, m.in_features)
                if cfg.init == "xavier":
                    nn.init.xavier_uniform_(w)
                elif cfg.init == "kaiming":
                    nn.init.kaiming_normal_(w, mode="fan_in", nonlinearity="relu")
                else:
                    nn.init.normal_(w, std=cfg.init_std)
            if isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=cfg.init_std)
            if isinstance(m, (nn.Linear, FusedLinear, nn.LayerNorm)) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(m.weight)
            if isinstance(m, Layer) and m.kind == "linformer":
                nn.init.normal_(m.proj_k, std=cfg.linformer_k ** -0.5)
                nn.init.normal_(m.proj_v, std=cfg.linformer_k ** -0.5)
        if cfg.scale_residual_init:  # after the loop, which visits a Layer before its Linears
            for layer in self.layers:
                layer.attn_out.weight.mul_((2 * cfg.num_layers) ** -0.5)
                layer.ffn_out.weight.mul_((2 * cfg.num_layers) ** -0.5)
        if self.word.padding_idx is not None and not self.word.weight.is_meta:
            self.word.weight[self.word.padding_idx].zero_()
        if self.decoder is not None:
            nn.init.normal_(self.decoder, std=cfg.init_std)
        if self.decoder_bias is not None:
            nn.init.zeros_(self.decoder_bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, max_masked: int | None = None) -> MLMOutput:
        """input_ids int64 [B, T]; attention_mask [B, T] (1/True = real token; None = all real);
        labels int64 [B, T] (-100 = no loss). With ``cfg.sparse_head`` and labels, the last layer
        computes its outputs only at positions with label != -100 (its keys and values still
        from all positions; exact, as only those positions reach the loss) and the head runs
        there only: logits [n_masked, V] (a host sync for the count, unless the caller gives
        ``max_masked``: see ``context``). The three split points in order: ``embed``, ``encode``,
        ``head_loss`` (``context`` once, for all three). Raises ValueError if T exceeds
        ``max_position_embeddings`` or a sliding window exceeds T."""
        ctx = self.context(input_ids.shape, attention_mask, labels, device=input_ids.device, max_masked=max_masked)
        return self.head_loss(self.encode(self.embed(input_ids), ctx), ctx, labels)

    def context(self, shape: tuple[int, int] | torch.Size, attention_mask: torch.Tensor | None,
                labels: torch.Tensor | None, *, device: torch.device, max_masked: int | None = None) -> Context:
        """The ``Context`` of a batch of ``shape`` (B, T) from its attention mask and labels (see
        ``forward``): what each split point needs besides the hidden states, so a pipeline stage
        derives it from the same two tensors. Host syncs: whether every token is real, and with
        the sparse head the largest masked count of a row, unless the caller gives it as
        ``max_masked`` (at least that count; read on the host before the batch went to the
        device: ``labkit.train.loop.to_device``). Raises ValueError if T exceeds
        ``max_position_embeddings`` or a sliding window exceeds T."""
        cfg, t = self.cfg, shape[1]
        if t > cfg.max_position_embeddings:
            raise ValueError(f"max_position_embeddings: sequence length {t} exceeds {cfg.max_position_embeddings}")
        if cfg.attention == "sliding_window" and cfg.window_size > t:
            raise ValueError(f"window_size: {cfg.window_size} exceeds seq_len {t}; allowed values are 1..{t}")
        rope = None
        if cfg.position_embedding == "rotary":
            rope = rotary_tables(torch.arange(t, device=device), cfg.head_dim, cfg.rope_theta)
        mask = None  # bool [B, 1, 1, T]; None when every token is real (packed shards: almost every
        if attention_mask is not None and not bool(attention_mask.bool().all()):  # batch), so SDPA
            mask = attention_mask.bool()[:, None, None, :]  # may pick a fused kernel (a host sync)
        n_masked = torch.zeros((), dtype=torch.int64, device=device)
        keep = select = valid = None
        if labels is not None:
            keep = labels != IGNORE_INDEX
            counts = keep.sum(dim=1)  # [B]
            n_masked = counts.sum()
            m = (int(counts.max()) if max_masked is None else max_masked) if cfg.sparse_head else 0  # host sync
            if m > 0:  # masked positions first in each row, in order; valid marks the real ones
                select = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :m]
                valid = torch.arange(m, device=device) < counts[:, None]  # [B, m]
        return Context(mask, rope, n_masked, keep, select, valid)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Split point 1: int64 [B, T] token ids -> hidden states [B, T, H]: word + token type 0
        (unless ``type_vocab_size`` is 0) + learned absolute positions, or the study's
        instruction and argument tables (``attention.instruction_positions``), then norm and
        dropout. T is checked by ``context``."""
        x = self.word(input_ids)  # [B, T, H]
        if self.token_type is not None:
            x = x + local(self.token_type.weight)[0]  # a Replicate() DTensor under tensor parallelism
        if self.position is not None:
            x = x + self.position(torch.arange(input_ids.shape[1], device=input_ids.device))
        elif self.cfg.position_embedding == "instruction":
            instruction, argument = instruction_positions(input_ids, SPECIAL_TOKENS.index("[NEXT]"))
            x = x + self.instruction(instruction) + self.argument(argument)
        return self.dropout(self.embed_norm(x))

    def encode(self, x: torch.Tensor, ctx: Context, layers: range | None = None) -> torch.Tensor:
        """Split point 2: hidden states [B, T, H] through the layers ``layers`` (default: all),
        in order; layer num_layers - 1 with the sparse head returns [B, m, H] at ``ctx.select``.
        With ``cfg.activation_checkpointing`` in training, each layer is recomputed in backward."""
        last = self.cfg.num_layers - 1
        for i in range(self.cfg.num_layers) if layers is None else layers:
            layer, sel = self.layers[i], ctx.select if i == last else None
            if self.cfg.activation_checkpointing and self.training:
                x = checkpoint(layer, x, ctx.mask, ctx.rope, sel, use_reentrant=False)
            else:
                x = layer(x, ctx.mask, ctx.rope, sel)
        return x

    def head_loss(self, x: torch.Tensor, ctx: Context, labels: torch.Tensor | None) -> MLMOutput:
        """Split point 3: the last layer's output -> ``MLMOutput``: the final norm (pre-norm), with
        the sparse head the rows of the masked positions, the head (``_head``), then
        ``vocab_loss`` over the labels (fp32 logits)."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        if labels is not None and self.cfg.sparse_head:
            x, labels = (x[ctx.valid], labels[ctx.keep]) if ctx.select is not None else (x[ctx.keep], labels[ctx.keep])
        logits = self._head(x)
        loss_sum = None
        if labels is not None:
            loss_sum = self.vocab_loss(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return MLMOutput(loss_sum, ctx.n_masked, logits)

    vocab_loss = staticmethod(cross_entropy_sum)
    """The loss of ``head_loss``: (logits fp32 [n, V_local], labels int64 [n]) -> the fp32 sum of
    cross-entropy over labels != -100. ``cross_entropy_sum`` here; tensor parallelism sets a
    vocabulary-parallel one on the instance (``labkit.train.parallel``)."""

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]: dense, GELU, norm, decoder (tied or own weight) + bias; with a
        vocabulary-split weight (``local``) the logits of this process's slice, [..., V_local]."""
        x = self.head_norm(F.gelu(self.head_dense(x)))
        weight = self.word.weight if self.decoder is None else self.decoder
        return F.linear(x, local(weight), local(self.decoder_bias))
