"""Hand a trained run to transformers: model, tokenizer and a model card in one directory.

``export_run(run_dir, out)`` writes, into a temporary directory renamed onto ``out`` last
(``labkit.io.atomic_dir``: a half-written export never appears under ``out``):

    model.safetensors, config.json      ``labkit.model.export_hf`` (BertForMaskedLM)
    tokenizer.json                      the run's tokenizer with BERT's post-processor
                                        ([CLS] $A [SEP], token type 0) so a call adds them as
                                        the training shards did
    tokenizer_config.json, special_tokens_map.json
                                        what ``AutoTokenizer`` reads: PreTrainedTokenizerFast,
                                        the special tokens, model_max_length = the run's seq_len
    README.md                           model card: config, data, losses, provenance

``AutoTokenizer.from_pretrained(out)``, ``AutoModelForMaskedLM.from_pretrained(out)`` and
``pipeline("fill-mask", model=out)`` load it offline (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

from labkit.config import SPECIAL_TOKENS, ModelConfig, TrainConfig, from_dict, to_dict
from labkit.io import atomic_dir

SPECIAL_NAMES = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                 "mask_token": "[MASK]"}
"""transformers' special-token attributes -> labkit's tokens (``SPECIAL_TOKENS``)."""


def _read_json(path: pathlib.Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _checkpoint(run_dir: pathlib.Path, step: int | None) -> pathlib.Path:
    from labkit.train import checkpoint_steps

    steps = checkpoint_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"{run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise ValueError(f"step: {run_dir} has no checkpoint step-{step}; it has {steps}")
    return run_dir / "checkpoints" / f"step-{step}"


def _model_config(cfg: TrainConfig, result: dict | None) -> ModelConfig:
    """The run's ModelConfig: result.json's ``model_config``, else the preset with the run's
    overrides and the vocabulary of its shards."""
    if result and result.get("model_config"):
        return from_dict(ModelConfig, result["model_config"])
    from labkit.data.shards import read_index
    from labkit.train.run_config import model_config_of

    return model_config_of(cfg, int(read_index(cfg.data_dir)["vocab_size"]))


def hf_tokenizer_files(tokenizer_path: str | os.PathLike, *, model_max_length: int) -> dict[str, str]:
    """``{file name: text}`` of the tokenizer files transformers reads, from a labkit
    ``tokenizer.json``; [NEXT] (when the tokenizer has it) is an additional special token. Raises
    ValueError if the tokenizer lacks SPECIAL_TOKENS at ids 0..5 (0..4 before [NEXT]:
    ``labkit.data.tokenize.special_ids``)."""
    from tokenizers import Tokenizer, processors

    from labkit.data.tokenize import special_ids

    tok = Tokenizer.from_file(str(tokenizer_path))
    names = dict(SPECIAL_NAMES)
    if "[NEXT]" in special_ids(tok, name=f"tokenizer: {tokenizer_path}"):
        names["additional_special_tokens"] = ["[NEXT]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", SPECIAL_TOKENS.index("[CLS]")), ("[SEP]", SPECIAL_TOKENS.index("[SEP]"))])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
              "clean_up_tokenization_spaces": False, **names}
    return {"tokenizer.json": tok.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(names, indent=2) + "\n"}


def model_card(cfg: TrainConfig, mcfg: ModelConfig, result: dict | None, step: int) -> str:
    """A short README.md for the export: what the model is, how to load it, the run's settings,
    its losses and provenance (from result.json when the run finished)."""
    r = result or {}
    prov = r.get("provenance") or {}
    git = prov.get("git") or {}
    losses = {k: r.get(k) for k in ("initial_loss", "final_loss", "eval_loss", "final_eval_loss") if k in r}
    rows = [("model preset", cfg.model), ("hidden size / layers / heads",
                                          f"{mcfg.hidden_size} / {mcfg.num_layers} / {mcfg.num_heads}"),
            ("parameters", r.get("params")), ("vocabulary", mcfg.vocab_size), ("sequence length", r.get("seq_len")),
            ("checkpoint step", step), ("tokens seen", r.get("tokens")),
            ("global batch size (sequences)", r.get("global_batch_size")), ("world size", r.get("world_size")),
            ("peak learning rate / schedule", f"{cfg.lr} / {cfg.schedule}"),
            ("masking probability", cfg.mlm_probability), ("precision", cfg.precision),
            *((k.replace("_", " "), v) for k, v in losses.items()),
            ("labkit / git commit", f"{prov.get('labkit_version')} / {git.get('commit')}"
                                    + (" (dirty)" if git.get("dirty") else "")),
            ("torch / CUDA", f"{prov.get('torch')} / {prov.get('cuda')}"),
            ("hosts", ", ".join(sorted(set(prov.get("hostnames") or [])))),
            ("trained", f"{prov.get('start_time')} to {prov.get('end_time')}")]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"""---
library_name: transformers
pipeline_tag: fill-mask
tags: [labkit, bert, masked-lm, disassembly]
---

# labkit encoder: {pathlib.Path(cfg.run_dir).name}

A BERT-style encoder pretrained with masked-language modelling by labkit on functions
disassembled from ELF binaries (one document per function, normalised operands). It loads
as `BertForMaskedLM`; the tokenizer is labkit's, with [CLS]/[SEP] added around each text.

```python
from transformers import pipeline
fill = pipeline("fill-mask", model="path/to/this/directory")
fill("test rax, rax\\n[MASK] ADDR")  # guesses for the instruction after a test
```

| setting | value |
| --- | --- |
{table}

Full training config (TrainConfig):

```json
{json.dumps(to_dict(cfg), indent=2)}
```
"""


def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, *, tokenizer_path: str | None = None,
               step: int | None = None, force: bool = False) -> pathlib.Path:
    """Export the newest checkpoint (or ``step``) of ``run_dir`` to ``out`` (see the module
    docstring); returns ``out``. The tokenizer is ``tokenizer_path`` or the run's
    ``TrainConfig.tokenizer_path``; when the run's shards name a tokenizer sha256 it must match.

    Raises FileNotFoundError for a run without config.json or checkpoints, or a missing
    tokenizer; ValueError for a non-empty ``out`` (unless ``force``), a tokenizer the shards were
    not built with, or a model option BertForMaskedLM cannot represent."""
    import torch
    from safetensors.torch import load_model

    from labkit.config.tomlfile import read_run_config
    from labkit.data.tokenize import tokenizer_sha256
    from labkit.model import BertMLM, export_hf

    run, dest = pathlib.Path(run_dir), pathlib.Path(out)
    cfg = read_run_config(run)
    if dest.exists() and any(dest.iterdir()) and not force:
        raise ValueError(f"out: {dest} exists and is not empty (pass force=True / --force to replace it)")
    tok_path = tokenizer_path or cfg.tokenizer_path
    if not tok_path or not os.path.isfile(tok_path):
        raise FileNotFoundError(f"tokenizer: {tok_path!r} does not exist (pass --tokenizer PATH/tokenizer.json)")
    index = _read_json(pathlib.Path(cfg.data_dir) / "index.json")
    if index and index.get("tokenizer_sha256") and index["tokenizer_sha256"] != tokenizer_sha256(tok_path):
        raise ValueError(f"tokenizer: {tok_path} is not the tokenizer the shards in {cfg.data_dir} were built with")
    result = _read_json(run / "result.json")
    mcfg = _model_config(cfg, result)
    ckpt = _checkpoint(run, step)
    model = BertMLM(mcfg)
    load_model(model, str(ckpt / "model.safetensors"), strict=True)
    model.eval()
    seq_len = int((result or {}).get("seq_len") or (index or {}).get("seq_len") or mcfg.max_position_embeddings)
    with atomic_dir(dest) as tmp:  # published only when complete
        tmp.chmod(0o755)
        with torch.no_grad():
            export_hf(model, tmp)
        files = hf_tokenizer_files(tok_path, model_max_length=seq_len)
        files["README.md"] = model_card(cfg, mcfg, result, int(ckpt.name[5:]))
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if dest.exists():  # force: the old export goes only once the new one is complete
            shutil.rmtree(dest)
    return dest
