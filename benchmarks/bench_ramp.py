"""A growing batch against fixed ones: steps and examples to a held-out loss (issue 36).

On the config's model and shards (default configs/walkthrough.toml after ``labkit prepare
configs/walkthrough.toml``: the `tiny` model on disassembled functions of this machine, seq 64) at
2 gloo ranks (CPU, one spawn, the runs one after the other), the same seed and data order:

- ``fixed-B`` for each B of ``--batches``: the runs ``labkit sweep batch`` makes
  (``labkit.study.critical_batch.sweep_batch``): ``--examples`` sequences, so examples / B steps,
  the config's lr scaled by ``lr_for_batch(lr, B0, B, lr_rule)`` from its global batch B0 at 2 ranks
  (micro_batch_size x grad_accum_steps x 2), warm-up min(the config's, steps / 10);
- ``ramp``: ``batch.schedule = "ramp"`` from B0, the doublings of ``--ramp`` (default: after 1/6
  and 1/2 of the B0 run's steps, to 4 x B0);
- ``critical``: ``batch.schedule = "critical"`` from B0 (doubled whenever the in-run noise scale's
  b_simple_low reaches the doubled batch), up to the largest of ``--batches``.

The ramp runs are the B0 run with a growing batch: examples / B0 steps of the config's schedule,
lr from B0's by ``batch.lr_rule`` at each change. Every run evaluates the held-out loss every
``--eval-examples`` sequences (in steps at its starting batch). The fixed runs train first (one
spawn); the target (``--target``; default the worst fixed run's best held-out loss, as ``labkit
sweep batch`` picks it) is set from them; then the ramp runs train (a second spawn), stopped after
``--stop-factor`` (1.5) x the steps the fixed B0 run took to the target (``stop_after``: their
schedule still follows max_steps). The target gives each run's steps to it (``steps_to_target``:
linear between the evaluations around the crossing) and its examples (the sum of its global
batches up to there). The fixed runs' steps are fitted with
S(B) = S_min (1 + B_crit / B) (``fit_critical_batch``, McCandlish et al. 2018, eq. 2.11), which
gives for each ramp run the fixed batch B* that uses the same examples, E(B*) = E_min (1 + B*/B_crit)
= its examples, and the steps S(B*) that batch needs. The issue's goal: the ramp needs at least 25 %
fewer steps than the fixed batch that uses the same number of examples (within 10 %): the measured
fixed run whose examples are within 10 % of the ramp's when there is one, else S(B*). OLMo's
critical-batch warm-up reached its loss in 43 % fewer steps (Merrill et al. 2025, arXiv:2505.23971).
It measures steps and examples, not time: the machine's load does not bias it.

Writes ``--out`` (default ``<workdir>/sweeps/bench_ramp.jsonl``): one JSON line per run, then a
summary line; prints the same. docs/generate.py renders docs/results.md's ``lesson4-bench-ramp``
block from docs/data/bench_ramp.jsonl:

    python benchmarks/bench_ramp.py configs/walkthrough.toml --out docs/data/bench_ramp.jsonl

A small check: ``--examples 1600 --batches 16 32 64 --eval-examples 160``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _prep import spawn_ranks, train_each  # noqa: E402
from labkit.config import TrainConfig, to_dict  # noqa: E402

RANKS = 2


def run_configs(base: TrainConfig, out_dir: pathlib.Path, *, examples: int, batches: list[int],
                ramp: list[list[int]] | None, eval_examples: int) -> list[tuple[str, TrainConfig]]:
    """The runs' TrainConfigs (module docstring), each in a fresh run directory under ``out_dir``, no
    checkpoints, a record every step. ValueError (one line) for a batch that is not a multiple of
    micro_batch_size x 2 ranks."""
    from labkit.train.optim import lr_for_batch

    micro, b0 = base.batch.micro_batch_size, base.batch.micro_batch_size * base.batch.grad_accum_steps * RANKS
    bad = [b for b in batches if b % (micro * RANKS)]
    if bad:
        raise ValueError(f"--batches: {bad} are not multiples of micro_batch_size {micro} x {RANKS} ranks")
    common = {"resume": False, "stop_after": None, "measure": {"log_every": 1, "trackers": ()},
              "checkpoint": {"enabled": False}}
    runs = []
    for b in sorted(set(batches)):
        steps = max(2, examples // b)
        runs.append((f"fixed-{b}", base.replace(
            run_dir=str(out_dir / f"fixed-{b}"), max_steps=steps, **common,
            batch={"grad_accum_steps": b // (micro * RANKS), "schedule": "fixed"},
            optim={"lr": lr_for_batch(base.optim.lr, b0, b, base.batch.lr_rule)},
            schedule={"warmup_steps": min(base.schedule.warmup_steps, max(1, steps // 10))},
            eval={"every": max(1, eval_examples // b)})))
    steps = max(2, examples // b0)
    table = ramp if ramp is not None else [[steps // 6, 2 * b0], [steps // 2, 4 * b0]]
    grown = dict(max_steps=steps, eval={"every": max(1, eval_examples // b0)}, **common)
    runs.append(("ramp", base.replace(run_dir=str(out_dir / "ramp"), batch={"schedule": "ramp", "ramp": table},
                                      **grown)))
    runs.append(("critical", base.replace(run_dir=str(out_dir / "critical"),
                                          batch={"schedule": "critical", "max_global_batch_size": max(batches)},
                                          **grown)))
    return runs


def _read(cfg: TrainConfig) -> list[dict]:
    return [json.loads(x) for x in pathlib.Path(cfg.run_dir, "metrics.jsonl").read_text().splitlines()]


def _stopped(grown: list[tuple[str, TrainConfig]], fixed: dict[str, list[dict]], target: float, base: TrainConfig,
             factor: float) -> list[tuple[str, TrainConfig]]:
    """The ramp runs stopped (``stop_after``: the schedule still follows max_steps) after ``factor`` x the
    steps the fixed run at their starting batch took to ``target``, when that run reached it: they start
    as that run and grow, so they need no more steps, and the steps after the target are not measured."""
    from labkit.study.critical_batch import steps_to_target

    b0 = base.batch.micro_batch_size * base.batch.grad_accum_steps * RANKS
    s0 = steps_to_target(fixed.get(f"fixed-{b0}", []), target)
    if s0 is None or not factor:
        return grown
    return [(n, c.replace(stop_after=min(c.max_steps, math.ceil(factor * s0)))) for n, c in grown]


def examples_to(records: list[dict], step: float | None) -> float | None:
    """Sequences trained up to the (fractional) ``step``: the sum of the records' global batches
    (one record per step), the last step counted by its fraction."""
    if step is None:
        return None
    whole = int(step)
    done = sum(r["global_batch_size"] for r in records if r["step"] <= whole)
    nxt = next((r["global_batch_size"] for r in records if r["step"] == whole + 1), 0)
    return done + (step - whole) * nxt


def compare(ramp_steps: float, ramp_examples: float, fixed: dict[int, tuple[float, float]],
            fit: dict) -> dict:
    """A ramp run against the fixed batches: the measured fixed run whose examples to the target are
    within 10 % of the ramp's (the nearest), and the fit's batch B* with the same examples and its
    steps S(B*) (None where E_min exceeds the ramp's examples: no fixed batch is that frugal); the
    steps saved against the one chosen (the measured run if any, else the fit's) and whether that is
    at least 25 %."""
    near = min(fixed.items(), key=lambda kv: abs(kv[1][1] / ramp_examples - 1), default=None)
    measured = near if near is not None and abs(near[1][1] / ramp_examples - 1) <= 0.10 else None
    b_star = s_star = None
    if fit.get("b_crit") and ramp_examples > fit["e_min"]:
        b_star = fit["b_crit"] * (ramp_examples / fit["e_min"] - 1)
        s_star = fit["s_min"] * (1 + fit["b_crit"] / b_star)
    against = measured[1][0] if measured is not None else s_star
    saved = 1 - ramp_steps / against if against else None
    return {"matched_fixed_batch": measured[0] if measured else None,
            "matched_fixed_steps": measured[1][0] if measured else None,
            "matched_fixed_examples": measured[1][1] if measured else None,
            "fit_batch_same_examples": b_star, "fit_steps_same_examples": s_star,
            "compared_with": "measured" if measured is not None else ("fit" if s_star else None),
            "steps_saved": saved, "goal_met": saved is not None and saved >= 0.25}


def _summaries(runs: list[tuple[str, TrainConfig]], recs: dict[str, list[dict]], target: float) -> list[dict]:
    """One line per run: steps and examples to ``target``, its batches, its best held-out loss."""
    from labkit.study.critical_batch import steps_to_target

    lines = []
    for name, cfg in runs:
        rs = recs[name]
        s = steps_to_target(rs, target)
        changes = [json.loads(x) for x in pathlib.Path(cfg.run_dir, "batch_changes.jsonl").read_text().splitlines()] \
            if cfg.batch.schedule != "fixed" else None
        lines.append({"record": "run", "name": name, "schedule": cfg.batch.schedule,
                      "start_batch": rs[0]["global_batch_size"], "final_batch": rs[-1]["global_batch_size"],
                      "lr": cfg.optim.lr, "max_steps": cfg.max_steps, "steps_to_target": s,
                      "examples_to_target": examples_to(rs, s),
                      "best_eval_loss": min(r["eval_loss"] for r in rs if r.get("eval_loss") is not None),
                      "changes": changes, "curve": [[r["step"], examples_to(rs, r["step"]), r["eval_loss"]]
                                                    for r in rs if r.get("eval_loss") is not None]})
    return lines


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", default=str(ROOT / "configs" / "walkthrough.toml"))
    p.add_argument("--examples", type=int, default=19200, help="sequences per fixed run (default 19200)")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64], help="fixed global batches")
    p.add_argument("--ramp", default=None, help="S:B,S:B,... (default: 2 x B0 after 1/6, 4 x B0 after 1/2 of B0's steps)")
    p.add_argument("--eval-examples", type=int, default=320, help="sequences between held-out evaluations")
    p.add_argument("--target", type=float, default=None, help="held-out loss (default: the worst fixed run's best)")
    p.add_argument("--stop-factor", type=float, default=1.5,
                   help="stop the ramp runs after this x the starting batch's fixed run's steps to the target (0: never)")
    p.add_argument("--out", default=None, help="JSON lines file (default <workdir>/sweeps/bench_ramp.jsonl)")
    args = p.parse_args(argv)
    from labkit.config.tomlfile import load
    from labkit.data.shards import read_index
    from labkit.study.critical_batch import fit_critical_batch

    lab = load(args.config)
    base = lab.train
    if not pathlib.Path(base.data_dir, "index.json").exists():
        raise SystemExit(f"bench_ramp: no shards in {base.data_dir}; run labkit prepare {args.config} first")
    index = read_index(base.data_dir)
    ramp = [[int(x) for x in pair.split(":")] for pair in args.ramp.split(",")] if args.ramp else None
    out_dir = pathlib.Path(lab.workdir) / "sweeps" / "bench_ramp"
    out_path = pathlib.Path(args.out or pathlib.Path(lab.workdir) / "sweeps" / "bench_ramp.jsonl")
    t0, load0 = time.time(), os.getloadavg()
    runs = run_configs(base, out_dir, examples=args.examples, batches=args.batches, ramp=ramp,
                       eval_examples=args.eval_examples)
    fixed_runs = [(n, c) for n, c in runs if c.batch.schedule == "fixed"]
    spawn_ranks(RANKS, train_each, json.dumps([to_dict(c) for _, c in fixed_runs]), pin=False)
    recs = {name: _read(c) for name, c in fixed_runs}
    best = {name: min(r["eval_loss"] for r in rs if r.get("eval_loss") is not None) for name, rs in recs.items()}
    target = args.target if args.target is not None else max(best.values())
    runs = [(n, c) for n, c in runs if c.batch.schedule == "fixed"] + _stopped(
        [(n, c) for n, c in runs if c.batch.schedule != "fixed"], recs, target, base, args.stop_factor)
    grown = [(n, c) for n, c in runs if c.batch.schedule != "fixed"]
    spawn_ranks(RANKS, train_each, json.dumps([to_dict(c) for _, c in grown]), pin=False)
    recs |= {name: _read(c) for name, c in grown}
    lines = _summaries(runs, recs, target)
    fixed = {line["start_batch"]: (line["steps_to_target"], line["examples_to_target"]) for line in lines
             if line["schedule"] == "fixed" and line["steps_to_target"] is not None}
    fit = fit_critical_batch(list(fixed), [s for s, _ in fixed.values()]) if len(fixed) >= 3 else {}
    for line in lines:
        if line["schedule"] != "fixed" and line["steps_to_target"] is not None:
            line |= compare(line["steps_to_target"], line["examples_to_target"], fixed, fit)
    b0 = base.batch.micro_batch_size * base.batch.grad_accum_steps * RANKS
    summary = {"benchmark": "bench_ramp", "metric": "steps_saved_at_equal_examples", "goal": 0.25,
               "target_eval_loss": target, "target_rule": "given" if args.target is not None else "worst run's best",
               "config": os.path.relpath(args.config, ROOT) if os.path.isabs(args.config) else args.config,
               "model": base.model, "ranks": RANKS, "micro_batch_per_rank": base.batch.micro_batch_size,
               "start_batch": b0, "lr": base.optim.lr, "lr_rule": base.batch.lr_rule, "schedule": base.schedule.kind,
               "warmup_steps": base.schedule.warmup_steps, "examples": args.examples, "batches": sorted(set(args.batches)),
               "eval_examples": args.eval_examples, "stop_factor": args.stop_factor, "seq_len": int(index["seq_len"]),
               "vocab_size": int(index["vocab_size"]), "sequences": int(index["n_sequences"]),
               "tokenizer_sha256": index["tokenizer_sha256"],
               "fit": {k: fit.get(k) for k in ("b_crit", "b_crit_low", "b_crit_high", "s_min", "e_min")} if fit else None,
               "runs": {line["name"]: {k: line.get(k) for k in ("steps_to_target", "examples_to_target", "final_batch",
                                                                 "steps_saved", "compared_with", "goal_met")}
                        for line in lines},
               "cpu_count": os.cpu_count(), "load_avg_start": list(load0), "load_avg": list(os.getloadavg()),
               "wall_s": round(time.time() - t0, 1)}
    lines.append(summary)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tmp.replace(out_path)  # complete or absent
    for line in lines:
        print(json.dumps({k: v for k, v in line.items() if k != "curve"}), flush=True)
    return summary


if __name__ == "__main__":
    main()
