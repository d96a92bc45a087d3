"""Benchmark "planner": the planner against the bytes autograd really keeps, for labkit's models
and for models labkit did not write.

1. Models labkit did not write (``labkit.study.memory.plan_model``, fp32 on this CPU, a 2 GiB
   budget): transformers' ``BertForMaskedLM`` with eager and with SDPA attention (built from a
   ``BertConfig``, no hub) and a plain-PyTorch encoder with one module per head
   (tests/plain_encoder.py). For each: plan_model's activation bytes at a micro-batch it did not
   count (b = 7; it counts b = 2 and 3) divided by the bytes autograd saves there, counted
   independently on real tensors (a ``saved_tensors_hooks`` pass keyed by data pointer); and
   its max micro-batch b, verified by counting the whole step on real tensors at b and b + 1
   (state + peak <= budget < the same at b + 1). Goal: every ratio within 3 % and every edge holds.
2. labkit's formula (``plan.saved_activation_bytes``, fp32, CPU) against the count for the
   small presets at several micro-batches and sequence lengths, sparse and dense head: the
   formula explains the count; goal within 10 % everywhere.

The last line is the JSON record every benchmark prints (docs/measurement.md, "Benchmarks"):
value = 1 - the worst relative error over part 1 (1.0 = exact); part 2's worst is a key of it.
The GPU half (plan_model against ``torch.cuda.max_memory_allocated``) is benchmarks/gpu_check.py.

Run from the repository root: ``python benchmarks/bench_planner.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import time

import torch

from labkit.model import model_config
from labkit.study.counting import count_steps
from labkit.study.memory import activation_bytes, plan_model
from labkit.study.plan import saved_activation_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB, SEQ, BUDGET, UNSEEN = 5000, 128, 2 * 2**30, 7
FORMULA_POINTS = [("tiny", 64, b) for b in (1, 4, 16)] + [("mini", 128, b) for b in (1, 4, 8)] + \
                 [("small", 128, b) for b in (1, 2, 4)]
GOAL, FORMULA_GOAL = 0.03, 0.10


def _plain_encoder():
    spec = importlib.util.spec_from_file_location("plain_encoder", ROOT / "tests" / "plain_encoder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.factory(seq_len=SEQ, vocab=VOCAB, hidden=256, layers=4, heads=4, ffn=1024)


def _hf_bert(attn: str):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=1024, attn_implementation=attn)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(5, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(0))
        labels = torch.full_like(ids, -100)
        labels[:, 1:1 + round(0.15 * SEQ)] = ids[:, 1:1 + round(0.15 * SEQ)]
        return {"input_ids": ids, "labels": labels}

    return (lambda: BertForMaskedLM(cfg)), make_batch


def saved_on_real_tensors(make_model, make_batch, b: int) -> int:
    """Distinct storages (by data pointer) autograd saves in one training forward on real CPU
    tensors, parameters and buffers excluded: independent of labkit.study.counting."""
    torch.manual_seed(0)
    model = make_model().train()
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in state:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**make_batch(b))
    del out
    return sum(seen.values())


def main() -> None:
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    rows, worst = [], 0.0
    print(f"{'model':18} {'predicted B at b=7':>19} {'saved B at b=7':>15} {'ratio':>7} {'max b':>6} "
          f"{'state+peak at b':>16} {'at b+1':>14} {'method':>12}")
    for name, (make_model, make_batch) in {"BertForMaskedLM-eager": _hf_bert("eager"),
                                           "BertForMaskedLM-sdpa": _hf_bert("sdpa"),
                                           "plain-encoder": _plain_encoder()}.items():
        p = plan_model(make_model, make_batch, device="cpu", precision="fp32", budget_bytes=BUDGET, name=name)
        predicted = p["activation_bytes_fixed"] + UNSEEN * p["activation_bytes_per_sequence"]
        saved = saved_on_real_tensors(make_model, make_batch, UNSEEN)
        b = p["max_micro_batch"]
        real = {n: p["state_bytes"] + count_steps(make_model, make_batch, (n,), fake=False)["counts"][n]["peak_bytes"]
                for n in (b, b + 1)}
        edge = real[b] <= BUDGET < real[b + 1]
        worst = max(worst, abs(predicted / saved - 1), 0.0 if edge else 1.0)
        rows.append({"model": name, "ratio_at_unseen_b": round(predicted / saved, 6), "max_micro_batch": b,
                     "edge_holds": edge, "method": p["method"]})
        print(f"{name:18} {predicted:19,d} {saved:15,d} {predicted / saved:7.4f} {b:6d} {real[b]:16,d} "
              f"{real[b + 1]:14,d} {p['method']:>12}")
    formula_worst = 0.0
    print(f"\n{'preset':6} {'head':6} {'seq':>4} {'b':>3} {'counted B':>13} {'formula B':>13} {'ratio':>7}")
    for name, seq, b in FORMULA_POINTS:
        for sparse in (True, False):
            cfg = model_config(name, 8192, sparse_head=sparse)
            measured = activation_bytes(cfg, seq, b)
            planned = saved_activation_bytes(cfg, seq, b, precision="fp32", attention="eager", device="cpu")
            formula_worst = max(formula_worst, abs(planned / measured - 1))
            print(f"{name:6} {'sparse' if sparse else 'dense':6} {seq:4d} {b:3d} {measured:13,d} {planned:13,d} "
                  f"{planned / measured:7.4f}")
    load = os.getloadavg()
    print(f"{time.perf_counter() - t0:.1f} s (load average {load[0]:.2f}, {load[1]:.2f}); worst error of "
          f"plan_model {worst:.3%} (goal {GOAL:.0%}), of the formula {formula_worst:.2%} (goal {FORMULA_GOAL:.0%})")
    print(json.dumps({"benchmark": "planner", "metric": "1 - worst relative error of plan_model's activation bytes "
                      "at an uncounted micro-batch (models labkit did not write)", "value": round(1 - worst, 6),
                      "baseline": "bytes autograd saves, counted on real CPU tensors with saved_tensors_hooks",
                      "baseline_value": 1.0, "ratio": round(1 - worst, 6), "goal": 1 - GOAL, "higher_is_better": True,
                      "models": rows, "formula_worst_error": round(formula_worst, 6),
                      "formula_goal": FORMULA_GOAL, "load_average_1m": round(load[0], 2)}))


if __name__ == "__main__":
    main()
