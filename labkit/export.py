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
    README.md                           model card: config, the data the run trained on (kinds,
                                        documents and tokens per kind, from the shards' index),
                                        losses, provenance, and a fill-mask example from that data
                                        with this checkpoint's own top-5 (``fill_mask_example``)

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

__all__ = ["KIND_WORDS", "SPECIAL_NAMES", "data_kinds", "export_run", "fill_mask_example", "hf_tokenizer_files",
           "model_card"]

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


KIND_WORDS = {"elf": ("functions disassembled from ELF binaries", "one document per function, normalised operands"),
              "text": ("text documents", "plain text, JSONL or Parquet")}
"""How the model card names each data kind of ``labkit.data.balance.select_documents``."""


def data_kinds(index: dict | None) -> dict[str, dict]:
    """{kind: {"documents", "tokens"}} of a shard set's selected documents (index.json's
    balance.kinds, ``labkit.data.balance``); {} for an index written before labkit recorded it."""
    return dict(((index or {}).get("balance") or {}).get("kinds") or {})


def _pieces(tok, ids) -> str:
    return tok.decode([int(i) for i in ids], skip_special_tokens=True)


def fill_mask_example(model, tokenizer_path: str | os.PathLike, data_dir: str | os.PathLike, *,
                      max_tokens: int = 24, top_k: int = 5) -> dict | None:
    """A fill-mask example from the run's own data and what ``model`` (a ``labkit.model.BertMLM``
    in eval mode) predicts for it, as ``pipeline("fill-mask")`` on the export would.

    The first document of the first held-out sequence (else, saying so, of the first training
    sequence), cut to ``max_tokens`` tokens; the masked token is the first word that starts a line
    after the first line (an instruction, for disassembly), else the middle one. The text shown is
    the decoded context around ``[MASK]``; the predictions come from encoding that text with the
    run's tokenizer ([CLS] text [SEP]) and a forward pass. Returns {"text", "answer" (the token
    masked), "split" ("held-out" or "training"), "predictions": [{"token", "score"}] (top_k,
    softmax probabilities)}, or None when no sequence has a maskable token."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    from labkit.data.heldout import read_heldout
    from labkit.data.shards import SequenceReader

    tok = Tokenizer.from_file(str(tokenizer_path))
    special = {tok.token_to_id(t) for t in SPECIAL_TOKENS}
    try:
        row, split = np.asarray(read_heldout(data_dir, 1)[0]), "held-out"
    except ValueError:
        row, split = np.asarray(SequenceReader(data_dir)[0]), "training"
    doc = []
    for i in row[1:]:  # [CLS] first; the document runs to its [SEP]
        if int(i) in special:
            break
        doc.append(int(i))
    doc = doc[:max_tokens]
    words = [k for k, i in enumerate(doc) if tok.id_to_token(i).isalpha() and 0 < k < len(doc) - 1]
    if not words:
        return None
    newline = [k for k in words if tok.id_to_token(doc[k - 1]) == "\n"]
    pos = newline[0] if newline else words[len(words) // 2]
    text = f"{_pieces(tok, doc[:pos])} [MASK] {_pieces(tok, doc[pos + 1:])}".strip()
    ids = [SPECIAL_TOKENS.index("[CLS]"), *tok.encode(text, add_special_tokens=False).ids, SPECIAL_TOKENS.index("[SEP]")]
    where = ids.index(SPECIAL_TOKENS.index("[MASK]"))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, where].float()
    probs = torch.softmax(logits, -1)
    top = torch.topk(probs, top_k)
    return {"text": text, "answer": tok.id_to_token(doc[pos]), "split": split,
            "predictions": [{"token": tok.id_to_token(int(i)), "score": round(float(p), 4)}
                            for p, i in zip(top.values, top.indices)]}


def _data_section(kinds: dict[str, dict]) -> str:
    if not kinds:
        return "on the documents of its shard set (this index does not record their kinds)"
    parts = [f"{v['documents']:,} {KIND_WORDS.get(k, (k, ''))[0]} ({v['tokens']:,} tokens; {KIND_WORDS.get(k, (k, k))[1]})"
             for k, v in sorted(kinds.items())]
    return "on " + " and ".join(parts)


def _example_section(example: dict | None, r: dict, step: int) -> str:
    if not example:
        return ""
    guesses = ", ".join(f"{p['token']!r} {p['score']:.3f}" for p in example["predictions"])
    tokens = f"{r['tokens']:,} tokens" if r.get("tokens") else "an unknown number of tokens"
    hit = "among them" if any(p["token"] == example["answer"] for p in example["predictions"]) else "not among them"
    return (f"\nAn example from the run's {example['split']} data, with this checkpoint's top-{len(example['predictions'])} "
            f"after {step} steps ({tokens} seen; probabilities after each guess); the masked token was "
            f"`{example['answer']!r}`, {hit}:\n\n"
            f"```python\nfill({example['text']!r})\n# {guesses}\n```\n")


def _trained(result: dict) -> str:
    """The model card's "trained" row: the time spent training, summed over the run's segments
    (``labkit.train.run_config.trained_seconds``: a stopped and resumed run counts every part),
    and the first start and last end: ``"84 s in 2 segments (2026-... to 2026-...)"``."""
    from labkit.train.run_config import trained_seconds

    prov = result.get("provenance") or {}
    spans = prov.get("segments") or [prov]
    seconds = trained_seconds(result)
    when = f"{spans[0].get('start_time')} to {spans[-1].get('end_time')}"
    if seconds is None:
        return when
    parts = f" in {len(spans)} segments" if len(spans) > 1 else ""
    return f"{seconds:,.0f} s{parts} ({when})"


def model_card(cfg: TrainConfig, mcfg: ModelConfig, result: dict | None, step: int, *,
               kinds: dict[str, dict] | None = None, example: dict | None = None) -> str:
    """A short README.md for the export: what the model is and what data it was trained on
    (``kinds``: ``data_kinds`` of its shards), how to load it, ``example`` (``fill_mask_example``)
    with the checkpoint's own guesses, the run's settings, its losses and provenance (from
    result.json when the run finished)."""
    r = result or {}
    kinds = kinds or {}
    prov = r.get("provenance") or {}
    git = prov.get("git") or {}
    losses = {k: r.get(k) for k in ("initial_loss", "final_loss", "eval_loss", "final_eval_loss") if k in r}
    rows = [("model preset", cfg.model), ("hidden size / layers / heads",
                                          f"{mcfg.hidden_size} / {mcfg.num_layers} / {mcfg.num_heads}"),
            ("parameters", r.get("params")), ("vocabulary", mcfg.vocab_size), ("sequence length", r.get("seq_len")),
            ("checkpoint step", step), ("tokens seen", r.get("tokens")),
            ("global batch size (sequences)", r.get("global_batch_size")), ("world size", r.get("world_size")),
            ("peak learning rate / schedule", f"{cfg.optim.lr} / {cfg.schedule.kind}"),
            ("masking probability", cfg.data.mlm_probability), ("precision", cfg.precision),
            *((k.replace("_", " "), v) for k, v in losses.items()),
            ("labkit / git commit", f"{prov.get('labkit_version')} / {git.get('commit')}"
                                    + (" (dirty)" if git.get("dirty") else "")),
            ("torch / CUDA", f"{prov.get('torch')} / {prov.get('cuda')}"),
            ("hosts", ", ".join(sorted(set(prov.get("hostnames") or [])))),
            ("trained", _trained(r))]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    tags = ", ".join(["labkit", "bert", "masked-lm", *(["disassembly"] if "elf" in kinds else []),
                      *(["text"] if "text" in kinds else [])])
    return f"""---
library_name: transformers
pipeline_tag: fill-mask
tags: [{tags}]
---

# labkit encoder: {pathlib.Path(cfg.run_dir).name}

A BERT-style encoder pretrained with masked-language modelling by labkit
{_data_section(kinds)}. It loads as `BertForMaskedLM`; the tokenizer is labkit's, with
[CLS]/[SEP] added around each text.

```python
from transformers import pipeline
fill = pipeline("fill-mask", model="path/to/this/directory")
```
{_example_section(example, r, step)}

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
    ``TrainConfig.data.tokenizer_path``; when the run's shards name a tokenizer sha256 it must match.

    Raises FileNotFoundError for a run without config.json or checkpoints, or a missing
    tokenizer; ValueError for a non-empty ``out`` (unless ``force``), a tokenizer the shards were
    not built with, or a model option BertForMaskedLM cannot represent."""
    import torch

    from labkit.config.tomlfile import read_run_config
    from labkit.data.tokenize import tokenizer_sha256
    from labkit.model import BertMLM, export_hf
    from labkit.train.checkpoint import load_weights

    run, dest = pathlib.Path(run_dir), pathlib.Path(out)
    cfg = read_run_config(run)
    if dest.exists() and any(dest.iterdir()) and not force:
        raise ValueError(f"out: {dest} exists and is not empty (pass force=True / --force to replace it)")
    tok_path = tokenizer_path or cfg.data.tokenizer_path
    if not tok_path or not os.path.isfile(tok_path):
        raise FileNotFoundError(f"tokenizer: {tok_path!r} does not exist (pass --tokenizer PATH/tokenizer.json)")
    index = _read_json(pathlib.Path(cfg.data_dir) / "index.json")
    if index and index.get("tokenizer_sha256") and index["tokenizer_sha256"] != tokenizer_sha256(tok_path):
        raise ValueError(f"tokenizer: {tok_path} is not the tokenizer the shards in {cfg.data_dir} were built with")
    result = _read_json(run / "result.json")
    mcfg = _model_config(cfg, result)
    ckpt = _checkpoint(run, step)
    model = BertMLM(mcfg)
    model.load_state_dict(load_weights(ckpt), strict=True)  # torch.distributed.checkpoint, or format 1
    model.eval()
    seq_len = int((result or {}).get("seq_len") or (index or {}).get("seq_len") or mcfg.max_position_embeddings)
    try:
        example = fill_mask_example(model, tok_path, cfg.data_dir)
    except (OSError, ValueError):  # shards moved or removed since training, a window longer than the example
        example = None
    with atomic_dir(dest) as tmp:  # published only when complete
        tmp.chmod(0o755)
        with torch.no_grad():
            export_hf(model, tmp)
        files = hf_tokenizer_files(tok_path, model_max_length=seq_len)
        files["README.md"] = model_card(cfg, mcfg, result, int(ckpt.name[5:]), kinds=data_kinds(index),
                                        example=example)
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
        if dest.exists():  # force: the old export goes only once the new one is complete
            shutil.rmtree(dest)
    return dest
