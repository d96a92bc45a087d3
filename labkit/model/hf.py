"""transformers interop: ``BertForMaskedLM`` config, state dicts both ways, and export.

transformers is a test/bench dependency, so it is imported inside the functions that need it.
With the default options (``BERT_OPTIONS``) ``BertMLM`` maps onto ``BertForMaskedLM`` weight for
weight (the fused QKV weight [3, H, H] unbound into query/key/value, stacked back on load);
logits agree to 1e-5 in fp32.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch

from labkit.config import ModelConfig
from labkit.io import atomic_write, atomic_write_text
from labkit.model.encoder import BertMLM

__all__ = ["BERT_OPTIONS", "export_hf", "hf_config", "load_hf_state_dict", "to_hf_state_dict"]

BERT_OPTIONS = {"norm_position": "post", "norm_type": "layernorm", "position_embedding": "absolute",
                "activation": "gelu", "bias": True, "attention": "full", "attention_output_dropout": True}
"""Option values under which the model is BERT and maps onto ``BertForMaskedLM``. Also needed:
``block_norm_eps`` None or equal to ``norm_eps`` (BERT has one ``layer_norm_eps``). Either
``attention_backend`` maps (the same weights; transformers' "eager" or "sdpa" attention), and
``type_vocab_size`` 0 is written as one all-zero token-type row."""


def _require_bert(cfg: ModelConfig) -> None:
    """ValueError naming the first option that ``BertForMaskedLM`` cannot represent."""
    for name, value in BERT_OPTIONS.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"{name}: BertForMaskedLM interop needs {value!r}, got {getattr(cfg, name)!r} "
                             "(transformers' BERT cannot express this option)")
    if cfg.block_norm_eps not in (None, cfg.norm_eps):
        raise ValueError(f"block_norm_eps: BertForMaskedLM interop needs None or norm_eps {cfg.norm_eps}, got "
                         f"{cfg.block_norm_eps} (transformers' BERT has one layer_norm_eps)")


def hf_config(cfg: ModelConfig):
    """The ``transformers.BertConfig`` of the same shape (GELU, absolute positions, pad id 0).
    Raises ValueError if an option is not BERT's (``BERT_OPTIONS``)."""
    from transformers import BertConfig

    _require_bert(cfg)
    return BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.ffn_size, hidden_act="gelu",
        hidden_dropout_prob=cfg.hidden_dropout, attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_position_embeddings, type_vocab_size=max(1, cfg.type_vocab_size),
        initializer_range=cfg.init_std, layer_norm_eps=cfg.norm_eps, pad_token_id=0,
        tie_word_embeddings=cfg.tie_embeddings,
    )


def _name_map(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> BertForMaskedLM's (fused qkv handled separately)."""
    m = {
        "word.weight": "bert.embeddings.word_embeddings.weight",
        "position.weight": "bert.embeddings.position_embeddings.weight",
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
    if cfg.type_vocab_size:
        m["token_type.weight"] = "bert.embeddings.token_type_embeddings.weight"
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for a, b in [("attn_out", "attention.output.dense"), ("attn_norm", "attention.output.LayerNorm"),
                     ("ffn_in", "intermediate.dense"), ("ffn_out", "output.dense"), ("ffn_norm", "output.LayerNorm")]:
            for p in ("weight", "bias"):
                m[f"{ours}{a}.{p}"] = f"{hf}{b}.{p}"
    return m


def to_hf_state_dict(model: BertMLM) -> dict[str, torch.Tensor]:
    """``BertForMaskedLM`` state dict (detached tensors; tied keys share storage as in HF)."""
    _require_bert(model.cfg)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {hf: sd[ours] for ours, hf in _name_map(model.cfg).items()}
    if not model.cfg.type_vocab_size:  # no token-type table: BERT's one row, all zero, adds nothing
        out["bert.embeddings.token_type_embeddings.weight"] = sd["word.weight"].new_zeros(1, model.cfg.hidden_size)
    for i in range(model.cfg.num_layers):
        for p in ("weight", "bias"):
            q, k, v = sd[f"layers.{i}.qkv.{p}"].unbind(0)
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
    _require_bert(model.cfg)
    names = _name_map(model.cfg)
    needed = list(names.values()) + [f"bert.encoder.layer.{i}.attention.self.{n}.{p}"
                                     for i in range(model.cfg.num_layers)
                                     for n in ("query", "key", "value") for p in ("weight", "bias")]
    missing = [k for k in needed if k not in sd]
    if missing:
        raise ValueError(f"state dict: missing BertForMaskedLM keys {missing[:5]} ({len(missing)} in all)")
    token_type = sd.get("bert.embeddings.token_type_embeddings.weight")
    if not model.cfg.type_vocab_size and token_type is not None and bool(token_type[0].any()):
        raise ValueError("type_vocab_size: the model has no token-type table, but the state dict's "
                         "token_type_embeddings row 0 is not zero")
    ours = {ours: sd[hf] for ours, hf in names.items()}
    for i in range(model.cfg.num_layers):
        for p in ("weight", "bias"):
            ours[f"layers.{i}.qkv.{p}"] = torch.stack(
                [sd[f"bert.encoder.layer.{i}.attention.self.{n}.{p}"] for n in ("query", "key", "value")])
    target = model.state_dict()
    for k, v in ours.items():
        if tuple(v.shape) != tuple(target[k].shape):
            raise ValueError(f"state dict: {k} has shape {tuple(v.shape)}, model expects {tuple(target[k].shape)}")
    model.load_state_dict(ours, strict=True)


def export_hf(model: BertMLM, out_dir: str | os.PathLike) -> pathlib.Path:
    """Write ``out_dir/model.safetensors`` then ``out_dir/config.json`` (each atomically), a
    directory that ``BertForMaskedLM.from_pretrained(out_dir)`` loads offline with no missing
    key, tied or untied embeddings (logits equal to 1e-5 in fp32, tests/model/). Returns
    out_dir. Raises ValueError naming the option for a model transformers' BERT cannot express
    (``BERT_OPTIONS``: pre-norm, RMSNorm, no biases, gated activations, rotary positions,
    efficient attention)."""
    from safetensors.torch import save_file

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for k, v in to_hf_state_dict(model).items():
        if k == "cls.predictions.decoder.weight" and model.cfg.tie_embeddings:
            continue  # the word embedding: HF re-ties it on load
        # decoder.bias is written even though it equals cls.predictions.bias: with untied
        # embeddings transformers does not re-tie it and would leave it at its initial zeros
        tensors[k] = v.to("cpu", torch.float32, copy=True).contiguous()
    atomic_write(out / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    config = json.loads(hf_config(model.cfg).to_json_string())
    config["architectures"] = ["BertForMaskedLM"]
    atomic_write_text(out / "config.json", json.dumps(config, indent=2))
    return out
