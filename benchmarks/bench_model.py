"""Forward + backward tokens/s of labkit's BertMLM against transformers' BertForMaskedLM.

Headline, like for like: labkit with the dense MLM head (logits at every position, as
BertForMaskedLM computes them) against BertForMaskedLM with SDPA attention (transformers'
default for BERT), same preset, vocabulary, dropout 0.1, fp32, train mode, same weights, same
batches (``MLMCollator``, 15 % masking), 2 torch threads. Second figure: labkit's sparse head
(logits at the masked positions only) against its own dense head, ``sparse_gain``; the three
losses on the first batch in eval mode (``loss_*``) show that the heads compute the same loss.
HF's eager attention is measured and reported alongside; ``--compile`` adds labkit dense under
``torch.compile`` (``TrainConfig.compile``).

Each round times one step of every model in a rotating order, after warm-up steps; values are
medians over rounds, and the per-round (paired) ratios are summarised by their spread (min,
quartiles, max). On a loaded machine wall time mostly measures the neighbours, so the process
CPU time of each step is reported too (``cpu_*``: tokens per CPU-second of the 2 threads; the
script sets OMP_WAIT_POLICY=PASSIVE unless set, so waiting threads sleep instead of spinning).

Run from the repository root: ``python benchmarks/bench_model.py``. Prints one JSON line per
sequence length; the last line (seq 128) is the benchmark's result.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def make_models(preset: str, vocab_size: int, seq_len: int, compile_: bool = False):
    """(cfg, {"dense": labkit dense head, "sparse": labkit sparse head[, "dense_compiled"]},
    {"hf_sdpa": ..., "hf_eager": ...}), identical weights, in train mode."""
    from transformers import BertForMaskedLM

    cfg = model_config(preset, vocab_size, max_position_embeddings=max(512, seq_len), sparse_head=False)
    torch.manual_seed(0)
    dense = BertMLM(cfg).train()
    sparse = BertMLM(dataclasses.replace(cfg, sparse_head=True)).train()
    sparse.load_state_dict(dense.state_dict())
    ours = {"dense": dense, "sparse": sparse}
    if compile_:
        compiled = BertMLM(cfg).train()
        compiled.load_state_dict(dense.state_dict())
        compiled.compile()
        ours["dense_compiled"] = compiled
    hf = {}
    for impl in ("sdpa", "eager"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = BertForMaskedLM._from_config(hf_config(cfg), attn_implementation=impl)
        missing, unexpected = m.load_state_dict(to_hf_state_dict(dense), strict=False)
        assert not unexpected and all("position_ids" in k for k in missing), (missing, unexpected)
        hf[f"hf_{impl}"] = m.train()
    return cfg, ours, hf


def spread(values: list[float]) -> dict[str, float]:
    """{"min", "p25", "median", "p75", "max"} of ``values``, rounded to 3 places."""
    med = statistics.median(values)
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) >= 2 else [med, med, med]
    return {k: round(v, 3) for k, v in zip(("min", "p25", "median", "p75", "max"),
                                            (min(values), q[0], med, q[2], max(values)))}


@torch.no_grad()
def losses(ours: dict, hf: dict, batch: dict) -> dict[str, float]:
    """Mean MLM loss of each model on ``batch`` in eval mode (modes restored): equal heads, equal losses."""
    out = {}
    for name, model in list(ours.items()) + [("hf_sdpa", hf["hf_sdpa"])]:
        model.eval()
        if name.startswith("hf"):
            out[f"loss_{name}"] = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
                                        labels=batch["labels"]).loss.item()
        else:
            o = model(batch["input_ids"], batch["attention_mask"], batch["labels"])
            out[f"loss_{name}"] = (o.loss_sum / o.n_masked).item()
        model.train()
    return out


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


def bench(preset: str, vocab_size: int, seq_len: int, batch_size: int, rounds: int, warmup: int,
          compile_: bool = False) -> dict:
    cfg, ours, hf = make_models(preset, vocab_size, seq_len, compile_)
    runs = {**{k: (m, step_ours) for k, m in ours.items()}, **{k: (m, step_hf) for k, m in hf.items()}}
    batches = make_batches(vocab_size, seq_len, batch_size, rounds + warmup)
    checked = losses(ours, hf, batches[0])
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
    paired = [b / a for a, b in zip(times["dense"], times["hf_sdpa"])]  # per round: HF time / labkit time
    sparse_paired = [b / a for a, b in zip(times["sparse"], times["dense"])]
    out = {
        "benchmark": "model", "metric": "tokens/s", "value": round(tps["dense"], 1),
        "labkit_head": "dense (like for like)",
        "baseline": "transformers BertForMaskedLM (sdpa)", "baseline_value": round(tps["hf_sdpa"], 1),
        "ratio": round(tps["dense"] / tps["hf_sdpa"], 3), "goal": 1.3, "higher_is_better": True,
        "ratio_paired_spread": spread(paired),
        "sparse_value": round(tps["sparse"], 1), "sparse_gain": round(tps["sparse"] / tps["dense"], 3),
        "sparse_gain_paired_spread": spread(sparse_paired),
        "sparse_ratio_vs_hf": round(tps["sparse"] / tps["hf_sdpa"], 3),
        **{k: round(v, 6) for k, v in checked.items()},
        "eager_baseline_value": round(tps["hf_eager"], 1), "ratio_vs_eager": round(tps["dense"] / tps["hf_eager"], 3),
        "cpu_value": round(tokens / statistics.median(cpu["dense"]), 1),
        "cpu_baseline_value": round(tokens / statistics.median(cpu["hf_sdpa"]), 1),
        "cpu_ratio": round(statistics.median(cpu["hf_sdpa"]) / statistics.median(cpu["dense"]), 3),
        "preset": preset, "vocab_size": vocab_size, "seq_len": seq_len,
        "batch_size": batch_size, "rounds": rounds, "threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    if compile_:
        out["compiled_value"] = round(tps["dense_compiled"], 1)
        out["compiled_ratio"] = round(tps["dense_compiled"] / tps["hf_sdpa"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="mini", help="the preset the lab trains by default (TrainConfig.model)")
    p.add_argument("--vocab-size", type=int, default=8192, help="labkit's TokenizerConfig default")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also time labkit dense under torch.compile")
    p.add_argument("--seq-lens", default="512,128", help="comma-separated; batch 1 at 512, 4 otherwise")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for seq in (int(x) for x in args.seq_lens.split(",")):
        line = bench(args.preset, args.vocab_size, seq, 1 if seq >= 512 else 4, args.rounds, args.warmup, args.compile)
        print(f"seq {seq}: like for like (labkit dense / HF sdpa) {line['ratio']}x, paired spread "
              f"{line['ratio_paired_spread']}; sparse head gain {line['sparse_gain']}x over labkit dense "
              f"(losses dense {line['loss_dense']}, sparse {line['loss_sparse']}, HF {line['loss_hf_sdpa']})",
              flush=True)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
