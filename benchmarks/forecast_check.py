"""The forecast of time to a target held-out loss checked against reality: a tiny model, 1 and 2 ranks.

``labkit forecast`` (labkit/study/forecast.py) multiplies the steps to the target at global batch
B, S(B) = E_min/B + E_min/B_crit (McCandlish et al. 2018, arXiv:1812.06162, eq. 2.11, the critical
batch held constant: growth 0), by the step time at n ranks. Here every input comes from this
machine's own short measurements, and the answer is then checked by training to the target:

1. the critical batch: ``labkit.study.critical_batch.sweep_batch`` trains the tiny model (one
   process) at ``--sweep-batches`` global batch sizes, none of them the two checked below, to
   the target held-out loss (evaluated every step; ``--target``, default 4.4 nats per masked
   token, on the steep part of this data's curve, from ln 1024 = 6.9 at the start to about 4.2
   where it flattens; 0: the sweep's default, its largest best held-out loss) and fits S(B) =
   S_min(1 + B_crit/B): E_min = S_min·B_crit and B_crit;
2. the step time at n = 1 and 2 ranks (gloo on CPU, one thread per rank, rank r pinned to core r
   as in bench_ddp.py): rank 0's mean ``step_time_s`` (the mean, as a sum of steps is what is
   forecast) over the timed steps of a ``--timing-steps`` run (the first ``--timing-warmup``
   steps dropped) in the configuration the check trains with: ``--micro-batch`` sequences per
   rank, no accumulation, the held-out loss evaluated after every step;
3. the forecast: ``labkit.study.forecast.forecast_table`` at n = 1, 2 with micro-batch b, so
   the global batch is n·b (the forecast's weak scaling: the same batch per rank), seconds =
   steps × step time;
4. reality: ``train()`` at 1 rank (global batch b) and at 2 ranks (2·b) with the learning rate
   of the sweep's rule (``lr_for_batch``, √B), evaluating the held-out loss every step, until
   the crossing of the target (``critical_batch.steps_to_target``, linear between the two
   evaluations around it); the measured time is the sum of rank 0's ``step_time_s`` of the
   steps up to the crossing (the last one prorated). Evaluation is outside the step time, in
   the forecast's inputs and in the measured time alike, and so is process start-up.

Steps 2-4 run for n = 1, then for n = 2, each right after the other, so that a shared
machine's load drifts as little as possible between a forecast's step time and its check (the
forecast at n never uses the check's numbers). The data: labkit's packer over synthetic documents of Zipf-distributed motifs with a separately
drawn held-out split (tests/tiny_shards.py, the shards of the training tests). Goal: measured /
forecast within 0.75..1.25 at both rank counts. The machine's load averages are printed with
the result; steps and step time are reported separately, so a miss names the input that was off.

Run: ``python benchmarks/forecast_check.py`` from the repository root (about 3.5 minutes on a
loaded 2-core machine). JSON lines; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _prep import spawn_ranks, train_each  # noqa: E402
from labkit.config import TrainConfig, to_dict  # noqa: E402


def _run(world: int, cfgs: list[TrainConfig]) -> list[list[dict]]:
    """Train ``cfgs`` on ``world`` spawned ranks (rank r on core r); rank 0's metrics records of each."""
    spawn_ranks(world, train_each, json.dumps([to_dict(c) for c in cfgs]), pin=True)
    return [[json.loads(x) for x in pathlib.Path(c.run_dir, "metrics.jsonl").read_text().splitlines() if x.strip()]
            for c in cfgs]


def time_to_step(records: list[dict], step: float) -> float:
    """Seconds of training steps up to the fractional ``step``: the sum of ``step_time_s`` of
    steps 1..floor(step) plus the prorated part of the next (records: one per step)."""
    by = {r["step"]: r["step_time_s"] for r in records}
    whole = int(math.floor(step))
    t = sum(by[k] for k in range(1, whole + 1))
    return t + (step - whole) * by[whole + 1] if step > whole else t


def main(argv: list[str] | None = None) -> dict:
    from labkit.study.critical_batch import lr_for_batch, steps_to_target, sweep_batch
    from labkit.study.forecast import forecast_table
    from tiny_shards import write_tiny_shards

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank in the check (no accumulation)")
    p.add_argument("--sweep-batches", default="4,6,12,24,32", help="global batch sizes of the critical-batch sweep")
    p.add_argument("--sweep-examples", type=int, default=4096, help="sequences each sweep run trains on")
    p.add_argument("--target", type=float, default=4.4,
                   help="held-out loss target, nats per masked token (0: the sweep's default, its largest best loss)")
    p.add_argument("--lr", type=float, default=2.5e-4, help="learning rate at the micro-batch; others by sqrt(B)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--sequences", type=int, default=4096, help="training sequences in the shards")
    p.add_argument("--heldout", type=int, default=64, help="held-out sequences (all evaluated every step)")
    p.add_argument("--timing-steps", type=int, default=30)
    p.add_argument("--timing-warmup", type=int, default=5)
    p.add_argument("--margin", type=float, default=2.5, help="check runs train up to this x the forecast steps")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0, load0 = time.time(), os.getloadavg()
    b = args.micro_batch
    sweep_batches = [int(x) for x in args.sweep_batches.split(",")]
    if b in sweep_batches or 2 * b in sweep_batches:
        raise SystemExit(f"--sweep-batches: leave out the checked batches {b} and {2 * b}, got {sweep_batches}")
    with tempfile.TemporaryDirectory(prefix="forecast_check_") as tmp:
        shards = write_tiny_shards(pathlib.Path(tmp) / "shards", n_sequences=args.sequences, seq_len=args.seq_len,
                                   vocab_size=args.vocab, heldout_sequences=args.heldout)
        base = TrainConfig(data_dir=str(shards), run_dir=f"{tmp}/base", model="tiny", num_threads=1, device="cpu",
                           resume=False, timeout_s=600, batch={"micro_batch_size": b}, optim={"lr": args.lr},
                           schedule={"warmup_steps": 1, "min_lr_ratio": 1.0}, checkpoint={"enabled": False},
                           eval={"sequences": args.heldout, "batch_size": args.heldout},
                           measure={"log_every": 1, "trackers": ()})
        # 1. the critical batch from a sweep at other batch sizes (one process, accumulation >= 2)
        ts = time.time()
        rows, fit = sweep_batch(base, tmp, batch_sizes=sweep_batches, target=args.target or None,
                                max_examples=args.sweep_examples, eval_every=1, micro_batch_size=4)
        sweep_s = time.time() - ts
        for r in rows.iter_rows(named=True):
            print(json.dumps({"phase": "sweep", **{k: r[k] for k in ("batch", "lr", "steps", "reached",
                                                                      "final_eval_loss", "b_simple")}}), flush=True)
        target = fit["target_eval_loss"]
        if "b_crit" not in fit:
            raise SystemExit(f"the sweep reached the target {target:.3f} at {fit['reached']} batch sizes: no fit")
        print(json.dumps({"phase": "fit", **fit, "sweep_s": round(sweep_s, 1)}), flush=True)
        # per rank count, right after one another so that the machine's load drifts least between
        # them: 2. the step time at batch b per rank, 3. the forecast, 4. reality (train to the target)
        step_s, fc, measured = {}, {}, {}
        for n in (1, 2):
            cfg = base.replace(run_dir=f"{tmp}/timing-{n}", max_steps=args.timing_steps,
                               measure={"timing_warmup_steps": args.timing_warmup},
                               optim={"lr": lr_for_batch(args.lr, b, n * b)}, eval={"every": 1})
            (recs,) = _run(n, [cfg])
            timed = [r["step_time_s"] for r in recs[args.timing_warmup:]]
            step_s[n] = statistics.fmean(timed)
            print(json.dumps({"phase": "timing", "ranks": n, "step_time_s": step_s[n],
                              "median_step_time_s": statistics.median(timed),
                              "first_steps_s": [r["step_time_s"] for r in recs[:args.timing_warmup]],
                              "load_avg_1m": os.getloadavg()[0]}), flush=True)
            (fc[n],) = forecast_table([n], [b], lambda n, _b: step_s[n], e_min=fit["e_min"],
                                      b_crit=fit["b_crit"]).to_dicts()
            print(json.dumps({"phase": "forecast", "ranks": n, "global_batch": n * b, "steps": fc[n]["steps"],
                              "step_s": fc[n]["step_s"], "seconds": fc[n]["hours"] * 3600}), flush=True)
            cfg = base.replace(run_dir=f"{tmp}/check-{n}", max_steps=max(4, math.ceil(args.margin * fc[n]["steps"])),
                               optim={"lr": lr_for_batch(args.lr, b, n * b)}, eval={"every": 1})
            tr = time.time()
            (recs,) = _run(n, [cfg])
            s = steps_to_target(recs, target)
            secs = time_to_step(recs, s) if s is not None else None
            measured[n] = {"ranks": n, "global_batch": n * b, "lr": cfg.optim.lr, "steps": s, "seconds": secs,
                           "mean_step_s": secs / s if s else None, "max_steps": cfg.max_steps,
                           "median_step_s": statistics.median(r["step_time_s"] for r in recs),
                           "first_steps_s": [r["step_time_s"] for r in recs[:args.timing_warmup]],
                           "best_eval_loss": min(r["eval_loss"] for r in recs if r.get("eval_loss") is not None),
                           "process_wall_s": round(time.time() - tr, 1), "load_avg_1m": os.getloadavg()[0]}
            print(json.dumps({"phase": "measured", **measured[n]}), flush=True)
    rows_out = {}
    for n in (1, 2):
        f, m = fc[n], measured[n]
        fs = f["hours"] * 3600
        rows_out[n] = {"forecast_s": fs, "measured_s": m["seconds"],
                       "ratio": m["seconds"] / fs if m["seconds"] is not None else None,
                       "forecast_steps": f["steps"], "measured_steps": m["steps"],
                       "steps_ratio": m["steps"] / f["steps"] if m["steps"] is not None else None,
                       "forecast_step_s": f["step_s"], "measured_mean_step_s": m["mean_step_s"],
                       "step_s_ratio": m["mean_step_s"] / f["step_s"] if m["mean_step_s"] else None,
                       "global_batch": n * b, "lr": m["lr"], "max_steps": m["max_steps"]}
    ratios = [rows_out[n]["ratio"] for n in (1, 2)]
    worst = max(ratios, key=lambda r: abs(math.log(r))) if None not in ratios else None
    out = {"benchmark": "forecast_check", "metric": "measured_over_forecast_time_to_target", "value": worst,
           "baseline": "labkit.study.forecast.forecast_table fed this machine's sweep fit and step times",
           "ratio_1_rank": ratios[0], "ratio_2_ranks": ratios[1], "goal": [0.75, 1.25],
           "within_goal": worst is not None and 0.75 <= worst <= 1.25, "higher_is_better": None,
           "ranks": {str(n): v for n, v in rows_out.items()},
           "target_eval_loss": target, "b_crit": fit["b_crit"], "b_crit_low": fit["b_crit_low"],
           "b_crit_high": fit["b_crit_high"], "s_min": fit["s_min"], "e_min": fit["e_min"],
           "fit_rms_log_residual": fit["rms_log_residual"], "sweep_batches": sweep_batches,
           "sweep_steps": rows["steps"].to_list(), "sweep_examples_per_run": args.sweep_examples,
           "b_simple_at_target": rows["b_simple"].to_list(),
           "model": "tiny", "seq_len": args.seq_len, "vocab": args.vocab, "micro_batch_per_rank": b,
           "lr_rule": "sqrt", "lr_at_micro_batch": args.lr, "timing_steps": args.timing_steps,
           "timing_warmup_steps": args.timing_warmup, "cpu_count": os.cpu_count(),
           "load_avg_start": list(load0), "load_avg": list(os.getloadavg()), "wall_s": round(time.time() - t0, 1)}
    print(f"time to held-out loss {target:.3f}: 1 rank forecast {rows_out[1]['forecast_s']:.2f} s, measured "
          f"{rows_out[1]['measured_s']} s; 2 ranks forecast {rows_out[2]['forecast_s']:.2f} s, measured "
          f"{rows_out[2]['measured_s']} s; B_crit {fit['b_crit']:.1f} ({fit['b_crit_low']:.1f}..{fit['b_crit_high']:.1f}); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
