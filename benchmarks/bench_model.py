"""Forward + backward tokens/s of labkit's BertMLM against transformers' BertForMaskedLM.

Same configuration (preset, vocabulary, dropout 0.1, fp32, train mode), same weights, same
batches (``MLMCollator`` with 15% masking), 2 torch threads. Each round times one step of every
model in a rotating order, after warm-up steps; the reported values are medians over rounds
(the machine is shared, so alternation and medians keep the comparison fair; ``ratio_paired_median``
is the median of per-round ratios and ``ratio_min`` the ratio of the fastest steps). On a loaded
machine wall time mostly measures the neighbours, so the process CPU time of each step is
reported too (``cpu_*``: tokens per CPU-second of the 2 threads; the script sets
OMP_WAIT_POLICY=PASSIVE unless set, so waiting threads sleep instead of spinning and CPU time
counts work, for both models alike). The baseline is
BertForMaskedLM with transformers' default attention for BERT (``attn_implementation="sdpa"``);
the eager implementation is measured and reported alongside.

Run from the repository root: ``python benchmarks/bench_model.py``. Prints one JSON line per
sequence length; the last line (seq 128) is the benchmark's result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: CPU time = work (see below)

import numpy as np
import torch

from labkit.config import SPECIAL_TOKENS
from labkit.data.mlm import MLMCollator
from labkit.model import BertMLM, hf_config, model_config, to_hf_state_dict


def make_models(preset: str, vocab_size: int, seq_len: int):
    """(ours, {"hf_sdpa": ..., "hf_eager": ...}) with identical weights, in train mode."""
    from transformers import BertForMaskedLM

    cfg = model_config(preset, vocab_size, max_position_embeddings=max(512, seq_len))
    torch.manual_seed(0)
    ours = BertMLM(cfg).train()
    hf = {}
    for impl in ("sdpa", "eager"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = BertForMaskedLM._from_config(hf_config(cfg), attn_implementation=impl)
        missing, unexpected = m.load_state_dict(to_hf_state_dict(ours), strict=False)
        assert not unexpected and all("position_ids" in k for k in missing), (missing, unexpected)
        hf[f"hf_{impl}"] = m.train()
    return cfg, ours, hf


def make_batches(vocab_size: int, seq_len: int, batch_size: int, n: int) -> list[dict]:
    """n MLM batches of random token rows ([CLS] first), masked 15% by labkit's collator."""
    rng = np.random.default_rng(0)
    collate = MLMCollator(vocab_size=vocab_size, mlm_probability=0.15, seed=0)
    out = []
    for _ in range(n):
        rows = rng.integers(len(SPECIAL_TOKENS), vocab_size, size=(batch_size, seq_len), dtype=np.int64)
        rows[:, 0] = SPECIAL_TOKENS.index("[CLS]")
        out.append(collate(rows))
    return out


def step_ours(model, batch) -> None:
    out = model(batch["input_ids"], batch["attention_mask"], batch["labels"])
    (out.loss_sum / out.n_masked).backward()
    model.zero_grad(set_to_none=True)


def step_hf(model, batch) -> None:
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(), labels=batch["labels"])
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def bench(preset: str, vocab_size: int, seq_len: int, batch_size: int, rounds: int, warmup: int) -> dict:
    cfg, ours, hf = make_models(preset, vocab_size, seq_len)
    runs = {"ours": (ours, step_ours), **{k: (m, step_hf) for k, m in hf.items()}}
    batches = make_batches(vocab_size, seq_len, batch_size, rounds + warmup)
    names = list(runs)
    times = {k: [] for k in names}
    cpu = {k: [] for k in names}
    for i, batch in enumerate(batches):
        order = names[i % len(names):] + names[:i % len(names)]  # rotate who goes first
        for k in order:
            model, step = runs[k]
            t0, c0 = time.perf_counter(), time.process_time()
            step(model, batch)
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
    tokens = batch_size * seq_len
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    paired = statistics.median(b / a for a, b in zip(times["ours"], times["hf_sdpa"]))
    return {
        "benchmark": "model", "metric": "tokens/s", "value": round(tps["ours"], 1),
        "baseline": "transformers BertForMaskedLM", "baseline_value": round(tps["hf_sdpa"], 1),
        "ratio": round(tps["ours"] / tps["hf_sdpa"], 3), "goal": 1.3, "higher_is_better": True,
        "baseline_attn_implementation": "sdpa (transformers' default for BERT)",
        "eager_baseline_value": round(tps["hf_eager"], 1), "ratio_vs_eager": round(tps["ours"] / tps["hf_eager"], 3),
        "ratio_paired_median": round(paired, 3),
        "ratio_min": round(min(times["hf_sdpa"]) / min(times["ours"]), 3),
        "cpu_value": round(tokens / statistics.median(cpu["ours"]), 1),
        "cpu_baseline_value": round(tokens / statistics.median(cpu["hf_sdpa"]), 1),
        "cpu_ratio": round(statistics.median(cpu["hf_sdpa"]) / statistics.median(cpu["ours"]), 3),
        "cpu_ratio_vs_eager": round(statistics.median(cpu["hf_eager"]) / statistics.median(cpu["ours"]), 3),
        "preset": preset, "vocab_size": vocab_size, "seq_len": seq_len,
        "batch_size": batch_size, "rounds": rounds, "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mini", help="the preset the lab trains by default (TrainConfig.model)")
    p.add_argument("--vocab-size", type=int, default=8192, help="labkit's TokenizerConfig default")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [bench(args.preset, args.vocab_size, 512, 1, args.rounds, args.warmup),
             bench(args.preset, args.vocab_size, 128, 4, args.rounds, args.warmup)]
    for line in lines:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
