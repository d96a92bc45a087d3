"""The study's tokenizer beside labkit's WordPiece on the same functions of this machine.

Both tokenizers are trained with labkit's ``train_tokenizer`` on the cleaned documents of a
study preparation (``work/study/clean/docs.parquet``: raw capstone text, as configs/study.toml
asks; ``labkit prepare configs/study.toml --scaled-down`` or ``benchmarks/study_run.py`` makes
it): "wordpiece" at labkit's defaults (TokenizerConfig(): 8192, min_frequency 2) and
"instruction" at the study's (4096, min_frequency 0). For each: the vocabulary reached, tokens
per function and the UNK rate on the tokenizer's 2,000 held-out functions, the packing
efficiency of the study's padded 512-token shards, and the held-out MLM loss after the same
steps: the same model (``mini``, absolute positions, so the tokenizer is the only difference),
seed, batch and schedule, one process.

    python benchmarks/tokenizer_study.py [--workdir work/study] [--steps 60] [--out docs/data/tokenizer_study.json]

The held-out losses are per masked token of each tokenizer, so they compare how well each
vocabulary's units are predicted, not one shared quantity. Writes the JSON file
(docs/results.md renders it, ``python docs/generate.py``) and prints it as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _tokens_per_function(tokenizer_path: str, docs_path: str, held: np.ndarray) -> dict:
    """Tokens per held-out function (the tokenizer's own held-out rows), as shards encode them."""
    from labkit.data.tokenize import encode_flat, iter_texts, load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    texts = [t for batch in iter_texts(docs_path, batch_docs=4096, rows=held) for t in batch]
    lengths = encode_flat(tok, texts)[1]
    return {"functions": len(texts), "mean": float(lengths.mean()), "median": float(np.median(lengths)),
            "p90": float(np.percentile(lengths, 90)), "over_512": float((lengths > 512).mean())}


def main() -> None:
    import torch

    from labkit.config import ShardConfig, TokenizerConfig, TrainConfig
    from labkit.data.shards import write_shards
    from labkit.data.tokenize import split_rows, text_row_count, train_tokenizer
    from labkit.train import train

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=str(ROOT / "work" / "study"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default=str(ROOT / "docs" / "data" / "tokenizer_study.json"))
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(2)
    work = pathlib.Path(args.workdir)
    docs = str(work / "clean" / "docs.parquet")
    out = work / "tokenizer_study"
    settings = {"wordpiece": TokenizerConfig(), "instruction": TokenizerConfig(kind="instruction", vocab_size=4096,
                                                                               min_frequency=0)}
    shard_cfg = ShardConfig(seq_len=512, packing="padded", heldout_fraction=0.1)
    load_before = os.getloadavg()[:2]
    rows = []
    for kind, cfg in settings.items():
        tok_path = train_tokenizer(docs, cfg, str(out / kind / "tokenizer.json"))
        stats = json.loads((out / kind / "tokenizer.stats.json").read_text())
        held = split_rows(text_row_count(docs), cfg)[1]
        index = write_shards(docs, tok_path, str(out / kind / "shards"), shard_cfg, progress=False)
        run = TrainConfig(data_dir=str(out / kind / "shards"), run_dir=str(out / kind / "run"), model="mini",
                          max_steps=args.steps, resume=False, batch={"micro_batch_size": 8},
                          schedule={"warmup_steps": 6}, eval={"sequences": 256, "batch_size": 16},
                          data={"tokenizer_path": tok_path}, checkpoint={"enabled": False}, measure={"trackers": ()})
        result = train(run)
        rows.append({"kind": kind, "settings": {"vocab_size": cfg.vocab_size, "min_frequency": cfg.min_frequency},
                     "vocab_size": stats["vocab_size"], "unk_rate": stats["unk_rate"],
                     "unk_examples": stats["unk_examples"], "held_out_docs": stats["held_out_docs"],
                     "tokens_per_function": _tokens_per_function(tok_path, docs, held),
                     "packing": index["packing"], "n_sequences": index["n_sequences"],
                     "train": {k: result[k] for k in ("initial_loss", "final_loss", "eval_loss", "perplexity",
                                                      "steps", "global_batch_size", "params", "tokens")}})
    record = {"command": "python benchmarks/tokenizer_study.py" + (f" --steps {args.steps}" if args.steps != 60 else ""),
              "documents": text_row_count(docs), "corpus": docs.replace(str(ROOT) + "/", ""),
              "shards": {"seq_len": shard_cfg.seq_len, "packing": shard_cfg.packing,
                         "heldout_fraction": shard_cfg.heldout_fraction},
              "model": "mini", "rows": rows, "load_before": [round(x, 2) for x in load_before],
              "load_after": [round(x, 2) for x in os.getloadavg()[:2]]}
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
