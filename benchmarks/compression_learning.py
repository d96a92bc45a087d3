"""What gradient compression costs in learning, on real data: steps to a held-out loss.

bf16 gradients and PowerSGD (torch's hooks, ``labkit.train.comm.compression_hook``) cut the bytes
a step all-reduces (docs/results.md, lesson 4, "On a network that really limits"); they also
change the update, and what that costs in learning shows only on data that learns (random
tokens sit at the uniform floor whatever the compression). This script trains the config's
model on its own shards (default configs/walkthrough.toml, after ``labkit prepare
configs/walkthrough.toml``: disassembled functions of this machine, seq 64, the `tiny` model) on
2 gloo ranks (CPU, one spawn, the runs one after the other), the same seed, data order and
learning-rate schedule for each gradient reduction:

- ``none``: fp32 all-reduce; ``none-seed2``: the same with ``seed + 1`` (init and data order),
  the yardstick of how much the steps move without any compression;
- ``bf16``: bf16 all-reduce; ``powersgd-r1``, ``powersgd-r4``: PowerSGD at rank 1 and 4 (error
  feedback on, ``powersgd_start_iter`` plain steps first, the config's default).

Each run evaluates the held-out loss every ``--eval-every`` steps for ``--steps`` steps. The
target (``--target``; default the largest best held-out loss over the runs, so every run
reaches it, as ``labkit sweep batch`` picks its target) gives each run's steps to the target
(``labkit.study.critical_batch.steps_to_target``, linear between the evaluations around the
crossing) and its ratio to ``none``'s. It measures steps, not time: the machine's load does not
bias it.

Writes ``--out`` (default ``<workdir>/sweeps/compression_learning.jsonl``): one JSON line per run
(with its held-out curve) and a summary line last; prints the same. docs/generate.py renders
docs/results.md's ``lesson4-compression-learning`` block from docs/data/compression_learning.jsonl:

    python benchmarks/compression_learning.py configs/walkthrough.toml --out docs/data/compression_learning.jsonl

About 5 minutes on 2 idle cores at the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _prep import spawn_ranks, train_each  # noqa: E402
from labkit.config import TrainConfig, to_dict  # noqa: E402

RUNS = (("none", "none", 4, 0), ("none-seed2", "none", 4, 1), ("bf16", "bf16", 4, 0),
        ("powersgd-r1", "powersgd", 1, 0), ("powersgd-r4", "powersgd", 4, 0))  # name, compression, rank, seed offset


def run_configs(base: TrainConfig, out_dir: pathlib.Path, *, steps: int, eval_every: int) -> list[tuple[str, TrainConfig]]:
    """The runs' TrainConfigs: ``base`` with each reduction of ``RUNS``, ``steps`` steps, the held-out
    loss every ``eval_every``, no checkpoints, a fresh run directory under ``out_dir``."""
    return [(name, base.replace(run_dir=str(out_dir / name), seed=base.seed + dseed, max_steps=steps, resume=False,
                                stop_after=None, parallel={"grad_compression": kind, "powersgd_rank": r},
                                eval={"every": eval_every}, measure={"log_every": 1, "trackers": ()},
                                checkpoint={"enabled": False}))
            for name, kind, r, dseed in RUNS]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", default=str(ROOT / "configs" / "walkthrough.toml"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--target", type=float, default=None, help="held-out loss (default: the worst run's best)")
    p.add_argument("--out", default=None, help="JSON lines file (default <workdir>/sweeps/compression_learning.jsonl)")
    args = p.parse_args(argv)
    from labkit.config.tomlfile import load
    from labkit.data.shards import read_index
    from labkit.study.critical_batch import steps_to_target

    lab = load(args.config)
    base = lab.train
    if not pathlib.Path(base.data_dir, "index.json").exists():
        raise SystemExit(f"compression_learning: no shards in {base.data_dir}; run labkit prepare {args.config} first")
    index = read_index(base.data_dir)
    out_dir = pathlib.Path(lab.workdir) / "sweeps" / "compression_learning"
    out_path = pathlib.Path(args.out or pathlib.Path(lab.workdir) / "sweeps" / "compression_learning.jsonl")
    t0, load0 = time.time(), os.getloadavg()
    runs = run_configs(base, out_dir, steps=args.steps, eval_every=args.eval_every)
    spawn_ranks(2, train_each, json.dumps([to_dict(c) for _, c in runs]), pin=False)
    recs = {name: [json.loads(x) for x in pathlib.Path(c.run_dir, "metrics.jsonl").read_text().splitlines()]
            for name, c in runs}
    best = {name: min(r["eval_loss"] for r in rs if r.get("eval_loss") is not None) for name, rs in recs.items()}
    target = args.target if args.target is not None else max(best.values())
    to_target = {name: steps_to_target(rs, target) for name, rs in recs.items()}
    lines = []
    for name, cfg in runs:
        rs, s = recs[name], to_target[name]
        lines.append({"record": "run", "name": name, "grad_compression": cfg.parallel.grad_compression,
                      "powersgd_rank": cfg.parallel.powersgd_rank if cfg.parallel.grad_compression == "powersgd" else None,
                      "seed": cfg.seed, "steps_to_target": s,
                      "ratio_to_none": s / to_target["none"] if s is not None and to_target["none"] else None,
                      "best_eval_loss": best[name], "final_eval_loss": rs[-1].get("eval_loss"),
                      "comm_bytes_per_step": statistics.median(r["comm_bytes"] for r in rs[-10:]),
                      "b_simple_last": next((r["b_simple"] for r in reversed(rs) if r.get("b_simple")), None),
                      "curve": [[r["step"], r["eval_loss"]] for r in rs if r.get("eval_loss") is not None]})
    summary = {"benchmark": "compression_learning", "metric": "steps_to_target_ratio_to_none",
               "target_eval_loss": target, "target_rule": "given" if args.target is not None else "worst run's best",
               "config": os.path.relpath(args.config, ROOT) if os.path.isabs(args.config) else args.config,
               "model": base.model, "ranks": 2, "micro_batch_per_rank": base.batch.micro_batch_size,
               "global_batch": 2 * base.batch.micro_batch_size * base.batch.grad_accum_steps, "lr": base.optim.lr,
               "schedule": base.schedule.kind, "warmup_steps": base.schedule.warmup_steps, "steps": args.steps,
               "eval_every": args.eval_every, "powersgd_start_iter": base.parallel.powersgd_start_iter,
               "seq_len": int(index["seq_len"]), "vocab_size": int(index["vocab_size"]),
               "sequences": int(index["n_sequences"]), "tokenizer_sha256": index["tokenizer_sha256"],
               "runs": {line["name"]: {k: line[k] for k in ("steps_to_target", "ratio_to_none", "best_eval_loss")}
                        for line in lines},
               "cpu_count": os.cpu_count(), "load_avg_start": list(load0), "load_avg": list(os.getloadavg()),
               "wall_s": round(time.time() - t0, 1)}
    lines.append(summary)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tmp.replace(out_path)  # complete or absent
    for line in lines[:-1]:
        s = line["steps_to_target"]
        print(f"{line['name']:12s} steps to {target:.3f}: " + (f"{s:6.1f} (x{line['ratio_to_none']:.2f} none)"
              if s is not None else "not reached") + f"; best held-out {line['best_eval_loss']:.3f}, "
              f"{line['comm_bytes_per_step'] / 1e6:.2f} MB per step", flush=True)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
