"""The BERT encoder with an MLM head, written for one device (parallelism is applied from outside).

Architecture = transformers' ``BertForMaskedLM`` (BERT, arXiv:1810.04805): learned absolute
positions + token-type embeddings (type 0 everywhere), post-norm blocks (LayerNorm eps
``cfg.norm_eps``), exact-erf GELU, and the MLM head dense -> GELU -> LayerNorm -> decoder tied to
the word embedding with its own bias. With weights copied across (``load_hf_state_dict`` /
``to_hf_state_dict``) the logits agree with ``BertForMaskedLM`` to 1e-5 in fp32 (eval mode).

Differences that change speed, not results: Q/K/V are one fused ``Linear`` (HF has three),
attention runs through ``F.scaled_dot_product_attention``, and with ``cfg.sparse_head`` the head
runs only at positions whose label is not -100 (as NVIDIA's BERT, MosaicBERT and ModernBERT do).
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from labkit.config import SPECIAL_TOKENS, ModelConfig

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
        raise ValueError(f"model_overrides: unknown fields {unknown}; known fields are {sorted(known)}")
    return ModelConfig(**{**fields, "vocab_size": vocab_size, **overrides})


def _validate(cfg: ModelConfig) -> None:
    """Checks beyond ``ModelConfig.__post_init__``; ValueError naming the field."""
    checks = [
        (cfg.num_layers > 0, "num_layers", "must be positive"),
        (cfg.num_heads > 0, "num_heads", "must be positive"),
        (cfg.intermediate_size is None or cfg.intermediate_size > 0, "intermediate_size", "must be positive or None"),
        (cfg.max_position_embeddings > 0, "max_position_embeddings", "must be positive"),
        (cfg.type_vocab_size >= 1, "type_vocab_size", "must be at least 1"),
        (cfg.norm_eps > 0, "norm_eps", "must be positive"),
        (cfg.init_std > 0, "init_std", "must be positive"),
    ]
    for ok, name, message in checks:
        if not ok:
            raise ValueError(f"{name}: {message}, got {getattr(cfg, name)!r}")


class Layer(nn.Module):
    """One post-norm BERT block: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.attention_dropout = cfg.attention_dropout
        self.qkv = nn.Linear(h, 3 * h)  # rows: query, key, value (HF's three Linears stacked)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.ffn_in = nn.Linear(h, cfg.ffn_size)
        self.ffn_out = nn.Linear(cfg.ffn_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, H]; mask bool [B, 1, 1, T] (True = key is a real token) or None."""
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)  # 3x[B,nh,T,Q]
        if mask is not None:  # additive in the compute dtype: a fully padded row stays finite
            mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
        p = self.attention_dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        a = a.transpose(1, 2).reshape(b, t, h)  # [B, T, H]
        x = self.attn_norm(x + self.dropout(self.attn_out(a)))
        return self.ffn_norm(x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(x)))))


class BertMLM(nn.Module):
    """BERT encoder + MLM head. ``forward(input_ids [B,T] int64, attention_mask [B,T] | None,
    labels [B,T] int64 | None) -> MLMOutput``; see the module docstring for the architecture."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        _validate(cfg)
        self.cfg = cfg
        h, v = cfg.hidden_size, cfg.vocab_size
        self.word = nn.Embedding(v, h, padding_idx=SPECIAL_TOKENS.index("[PAD]"))
        self.position = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.head_dense = nn.Linear(h, h)
        self.head_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.decoder = None if cfg.tie_embeddings else nn.Parameter(torch.empty(v, h))
        self.decoder_bias = nn.Parameter(torch.zeros(v))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """BERT init: weights ~ N(0, init_std), biases 0, LayerNorm 1/0, the [PAD] embedding row 0."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=self.cfg.init_std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if self.word.padding_idx is not None and not self.word.weight.is_meta:
            self.word.weight[self.word.padding_idx].zero_()
        if self.decoder is not None:
            nn.init.normal_(self.decoder, std=self.cfg.init_std)
        nn.init.zeros_(self.decoder_bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> MLMOutput:
        """input_ids int64 [B, T]; attention_mask [B, T] (1/True = real token; None = all real);
        labels int64 [B, T] (-100 = no loss). With ``cfg.sparse_head`` and labels, the hidden
        states at label != -100 are gathered (a host sync) before the head: logits [n_masked, V].
        Raises ValueError if T exceeds ``max_position_embeddings``."""
        b, t = input_ids.shape
        if t > self.cfg.max_position_embeddings:
            raise ValueError(f"max_position_embeddings: sequence length {t} exceeds {self.cfg.max_position_embeddings}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.word(input_ids) + self.position(pos) + self.token_type.weight[0]  # [B, T, H]
        x = self.dropout(self.embed_norm(x))
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # [B,1,1,T]
        for layer in self.layers:
            if self.cfg.activation_checkpointing and self.training:
                x = checkpoint(layer, x, mask, use_reentrant=False)
            else:
                x = layer(x, mask)
        n_masked = torch.zeros((), dtype=torch.int64, device=x.device)
        if labels is not None:
            n_masked = (labels != IGNORE_INDEX).sum()
            if self.cfg.sparse_head:
                keep = labels != IGNORE_INDEX
                x, labels = x[keep], labels[keep]  # [n_masked, H], [n_masked]
        logits = self._head(x)
        loss_sum = None
        if labels is not None:
            loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                       reduction="sum", ignore_index=IGNORE_INDEX)
        return MLMOutput(loss_sum, n_masked, logits)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]: dense, GELU, LayerNorm, decoder (tied or own weight) + bias."""
        x = self.head_norm(F.gelu(self.head_dense(x)))
        weight = self.word.weight if self.decoder is None else self.decoder
        return F.linear(x, weight, self.decoder_bias)


# --------------------------------------------------------------------------------------------
# Parameters and FLOPs
# --------------------------------------------------------------------------------------------


def count_parameters(cfg_or_model: ModelConfig | nn.Module) -> dict[str, int]:
    """{"total", "non_embedding"} parameter counts (a tied decoder counted once).

    Convention (Kaplan arXiv:2001.08361 section 2.1): non_embedding = total minus the lookup
    tables: word, position and token-type embeddings, and the decoder weight when untied (a second
    vocabulary matrix). Biases, LayerNorms and the head transform count as non-embedding. For a
    ``ModelConfig`` the closed form is used; for a model the real (unique) parameters are summed.
    """
    if isinstance(cfg_or_model, nn.Module):
        params = {id(p): p for p in cfg_or_model.parameters()}
        total = sum(p.numel() for p in params.values())
        tables = [cfg_or_model.word.weight, cfg_or_model.position.weight, cfg_or_model.token_type.weight]
        if cfg_or_model.decoder is not None:
            tables.append(cfg_or_model.decoder)
        return {"total": total, "non_embedding": total - sum(t.numel() for t in tables)}
    cfg = cfg_or_model
    _validate(cfg)
    h, f, v = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size
    embedding = (v + cfg.max_position_embeddings + cfg.type_vocab_size) * h
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * f + f) + (f * h + h) + 2 * h
    non_embedding = 2 * h + cfg.num_layers * per_layer + (h * h + h) + 2 * h + v  # embed LN, layers, head, bias
    untied = 0 if cfg.tie_embeddings else v * h
    return {"total": embedding + untied + non_embedding, "non_embedding": non_embedding}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token = 6 N + 12 L H Q T (PaLM arXiv:2204.02311 appendix B).

    N = non-embedding parameters (``count_parameters``), L layers, H heads, Q head dim, T =
    ``seq_len``. 6N = forward 2N + backward 4N (Kaplan arXiv:2001.08361 eq. 2.2); attention is
    counted in full (no causal halving), right for an encoder. The head is counted at every
    position even when the sparse head runs it only at masked ones. Raises ValueError if seq_len
    is not in [1, max_position_embeddings].
    """
    if not 0 < seq_len <= cfg.max_position_embeddings:
        raise ValueError(f"seq_len: must be in [1, {cfg.max_position_embeddings}], got {seq_len}")
    n = count_parameters(cfg)["non_embedding"]
    return float(6 * n + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len)


# --------------------------------------------------------------------------------------------
# transformers interop (transformers is a test/bench dependency: imported inside functions)
# --------------------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig):
    """The ``transformers.BertConfig`` of the same shape (GELU, absolute positions, pad id 0)."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.ffn_size, hidden_act="gelu",
        hidden_dropout_prob=cfg.hidden_dropout, attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_position_embeddings, type_vocab_size=cfg.type_vocab_size,
        initializer_range=cfg.init_std, layer_norm_eps=cfg.norm_eps, pad_token_id=0,
        tie_word_embeddings=cfg.tie_embeddings,
    )


def _name_map(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> BertForMaskedLM's (fused qkv handled separately)."""
    m = {
        "word.weight": "bert.embeddings.word_embeddings.weight",
        "position.weight": "bert.embeddings.position_embeddings.weight",
        "token_type.weight": "bert.embeddings.token_type_embeddings.weight",
        "embed_norm.weight": "bert.embeddings.LayerNorm.weight",
        "embed_norm.bias": "bert.embeddings.LayerNorm.bias",
        "head_dense.weight": "cls.predictions.transform.dense.weight",
        "head_dense.bias": "cls.predictions.transform.dense.bias",
        "head_norm.weight": "cls.predictions.transform.LayerNorm.weight",
        "head_norm.bias": "cls.predictions.transform.LayerNorm.bias",
        "decoder_bias": "cls.predictions.bias",
    }
    if not cfg.tie_embeddings:
        m["decoder"] = "cls.predictions.decoder.weight"
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for a, b in [("attn_out", "attention.output.dense"), ("attn_norm", "attention.output.LayerNorm"),
                     ("ffn_in", "intermediate.dense"), ("ffn_out", "output.dense"), ("ffn_norm", "output.LayerNorm")]:
            for p in ("weight", "bias"):
                m[f"{ours}{a}.{p}"] = f"{hf}{b}.{p}"
    return m


def to_hf_state_dict(model: BertMLM) -> dict[str, torch.Tensor]:
    """``BertForMaskedLM`` state dict (detached tensors; tied keys share storage as in HF)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {hf: sd[ours] for ours, hf in _name_map(model.cfg).items()}
    for i in range(model.cfg.num_layers):
        for p in ("weight", "bias"):
            q, k, v = sd[f"layers.{i}.qkv.{p}"].chunk(3, dim=0)
            for name, t in zip(("query", "key", "value"), (q, k, v)):
                out[f"bert.encoder.layer.{i}.attention.self.{name}.{p}"] = t
    if model.cfg.tie_embeddings:
        out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
    out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    return out


def load_hf_state_dict(model: BertMLM, sd: dict[str, torch.Tensor]) -> None:
    """Copy a ``BertForMaskedLM`` state dict into ``model`` in place.

    Buffers (position_ids) and pooler weights are ignored. Raises ValueError naming the missing
    keys, or the key whose shape differs.
    """
    names = _name_map(model.cfg)
    needed = list(names.values()) + [f"bert.encoder.layer.{i}.attention.self.{n}.{p}"
                                     for i in range(model.cfg.num_layers)
                                     for n in ("query", "key", "value") for p in ("weight", "bias")]
    missing = [k for k in needed if k not in sd]
    if missing:
        raise ValueError(f"state dict: missing BertForMaskedLM keys {missing[:5]} ({len(missing)} in all)")
    ours = {ours: sd[hf] for ours, hf in names.items()}
    for i in range(model.cfg.num_layers):
        for p in ("weight", "bias"):
            ours[f"layers.{i}.qkv.{p}"] = torch.cat(
                [sd[f"bert.encoder.layer.{i}.attention.self.{n}.{p}"] for n in ("query", "key", "value")])
    target = model.state_dict()
    for k, v in ours.items():
        if tuple(v.shape) != tuple(target[k].shape):
            raise ValueError(f"state dict: {k} has shape {tuple(v.shape)}, model expects {tuple(target[k].shape)}")
    model.load_state_dict(ours, strict=True)


def export_hf(model: BertMLM, out_dir: str | os.PathLike) -> pathlib.Path:
    """Write ``out_dir/model.safetensors`` then ``out_dir/config.json`` (each atomically), a
    directory that ``BertForMaskedLM.from_pretrained(out_dir)`` loads offline. Returns out_dir."""
    from safetensors.torch import save_file

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for k, v in to_hf_state_dict(model).items():
        if v.data_ptr() in seen and k.startswith("cls.predictions.decoder."):
            continue  # tied to another key: HF re-ties it on load
        seen.add(v.data_ptr())
        tensors[k] = v.to("cpu", torch.float32, copy=True).contiguous()
    _atomic_write(out / "model.safetensors", lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    config = json.loads(hf_config(model.cfg).to_json_string())
    config["architectures"] = ["BertForMaskedLM"]
    _atomic_write(out / "config.json", lambda p: pathlib.Path(p).write_text(json.dumps(config, indent=2)))
    return out


def _atomic_write(path: pathlib.Path, write) -> None:
    """Call ``write(tmp)`` on a temp file beside ``path``, then rename it onto ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
