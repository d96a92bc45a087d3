"""Overhead of the gradient noise scale statistics (labkit/train/gns.py) on a 2-rank DDP step.

Under DDP the statistics are one squared norm of each parameter's local gradient, taken by its
post-accumulate-grad hook on the step's synchronising backward (labkit/train/runtime.py), and
the step's clip norm, which the step computes anyway (labkit/train/gns.py, kind "params"); their
per-step sums ride the step's all-reduce of the loss (no collective of their own). This
benchmark runs ONE ``train()`` of ``--steps`` steps on 2 spawned gloo ranks (CPU, one thread
each, rank r pinned to core r as in bench_ddp.py) in which the observer is on
for one step of each pair and off for the other, the order within each pair drawn at random
(seeded, the same on both ranks): adjacent steps meet the same load, so the pair's difference
is a quiet measurement even on a busy machine. "Off" is the same observer returning at once
from every call, which is a run without it but for the hooks' Python calls (``observer_off_s``).

- ``value``: the overhead, the trimmed mean (10 % cut at each end) of the pairs' step-time
  differences on − off over the mean "off" step time (rank 0's ``step_time_s``; the first
  ``--warmup-steps`` steps left out);
- ``ci95`` and ``resolution``: the 2.5-97.5 % range of that estimate over 2,000 bootstrap
  resamples of the pairs, and its half-width: the smallest overhead the run can tell from 0;
- the profile of the rest: ``observer_s``, the seconds per "on" step spent inside the observer's
  calls (the hooks' norms and the bookkeeping, timed in place), as a fraction of the step, and
  ``observer_off_s`` the same calls returning at once; ``norm_warm_s`` and ``norm_cold_s``, one
  squared norm over a buffer of the model's parameter count timed alone (one thread, median of
  20), read again and again (in cache) and after 512 MiB were read in between (from memory, as
  a pass over DDP's bucket after the backward reads it); ``step_fields_s``, the per-step fold
  (outside the step time);
  ``all_reduces_per_step`` on and off (torch.distributed.all_reduce calls, counted): equal, so the
  statistics add no collective.

Goal: <= 1 % of the step, with a resolution under 0.5 %. The machine's load average is printed.

The micro-batch is labkit's default (``BatchConfig.micro_batch_size``, 16 sequences of 128
tokens per rank). The statistics read every parameter's gradient once a step, a cost that grows
with the parameters, while the step grows with parameters x tokens, so their share falls as the
micro-batch grows; ``--micro-batch 4``, the setting of the earlier lines of
docs/data/bench_gns.jsonl, is the harder case.

Run: ``python benchmarks/bench_gns.py`` from the repository root (about 43 minutes at the
defaults on 2 cores: 4,010 steps, 2,000 pairs; ``--steps 2010``, 1,000 pairs, resolved only
±0.50 % at the default micro-batch; ``--micro-batch 4 --steps 2010``: about 8 minutes). JSON
lines; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _prep import spawn_ranks  # noqa: E402
from bench_ddp import write_shards  # noqa: E402
from labkit.config import BatchConfig, TrainConfig, from_dict, to_dict  # noqa: E402

TRIM = 0.10


def schedule(pairs: int, seed: int = 0) -> list[bool]:
    """On/off per step: ``pairs`` pairs, each (on, off) or (off, on) at random (seeded)."""
    rng, out = random.Random(seed), []
    for _ in range(pairs):
        out += [True, False] if rng.random() < 0.5 else [False, True]
    return out


def _toggled_train(rank: int, world: int, cfg_json: str, plan: list[bool], out_dir: str) -> None:
    """One train() with the noise-scale observer toggled per step by ``plan`` (``spawn_ranks``'s
    ``run``, in its process group); rank 0 writes the observer's log to ``out_dir``/observer.json."""
    import torch
    import torch.distributed as tdist

    from labkit.train import gns, train

    calls = {"n": 0}
    plain_all_reduce = tdist.all_reduce

    def counted_all_reduce(*args, **kwargs):  # every all_reduce of the step, the loop's and the hooks'
        calls["n"] += 1
        return plain_all_reduce(*args, **kwargs)

    tdist.all_reduce = counted_all_reduce

    class Toggled(gns.NoiseScale):
        """The run's observer, on or off per step by ``plan``; times its own calls."""

        on, log = True, []

        def reset(self) -> None:
            super().reset()  # self.steps += 1: the step about to run, 1-based
            self.on = plan[(self.steps - 2) % len(plan)]  # __init__'s reset is steps 1
            self.spent, self.calls0 = 0.0, calls["n"]

        def local(self, name, grad):  # the parameters' hooks, on the synchronising backward
            t0 = time.perf_counter()
            if self.on:
                super().local(name, grad)
            self.spent += time.perf_counter() - t0

        def before(self, i, t, weights=None):  # DDP's comm hook (kind "params": nothing)
            t0 = time.perf_counter()
            if self.on:
                super().before(i, t, weights)
            self.spent += time.perf_counter() - t0

        def reduced_norm(self, norm, loss_scale=1.0):  # the clip's norm
            t0 = time.perf_counter()
            if self.on:
                super().reduced_norm(norm, loss_scale)
            self.spent += time.perf_counter() - t0

        def count(self, n):
            if self.on:
                super().count(n)

        def step_fields(self):
            t0 = time.perf_counter()
            fields = super().step_fields() if self.on else {}
            all_reduces = calls["n"] - self.calls0  # the step's, and any the fold made
            Toggled.log.append({"on": self.on, "observer_s": self.spent, "step_fields_s": time.perf_counter() - t0,
                                "all_reduces": all_reduces})
            return fields | {"gns_on": self.on}

        def sideband(self, device):
            return super().sideband(device) if self.on else torch.zeros(2, dtype=torch.float64, device=device)

    for_run = gns.NoiseScale.for_run

    def toggled(**kw):
        made = for_run(**kw)
        made.__class__ = Toggled
        made.reset()
        made.steps = 1
        made.on = plan[0]
        return made

    gns.NoiseScale.for_run = toggled
    try:
        train(from_dict(TrainConfig, json.loads(cfg_json)))
    finally:
        gns.NoiseScale.for_run = for_run
        tdist.all_reduce = plain_all_reduce
    if rank == 0:
        pathlib.Path(out_dir, "observer.json").write_text(json.dumps(Toggled.log))


def norm_seconds(n_params: int, repeats: int = 20) -> dict[str, float]:
    """Median seconds of one ``gns.squared_norm`` pass over ``n_params`` fp32 values (one thread):
    {"warm": read again and again (in cache), "cold": after 512 MiB were read in between}."""
    import torch

    from labkit.train.gns import squared_norm

    torch.set_num_threads(1)
    grads, flush = torch.randn(n_params), torch.randn(128 * 1024 * 1024)
    times: dict[str, list[float]] = {"warm": [], "cold": []}
    for kind in times:
        for _ in range(repeats):
            if kind == "cold":
                flush.sum()
            t0 = time.perf_counter()
            squared_norm(grads).item()
            times[kind].append(time.perf_counter() - t0)
    return {kind: statistics.median(t) for kind, t in times.items()}


def trimmed_mean(values: list[float], cut: float = TRIM) -> float:
    """Mean of ``values`` without the lowest and highest ``cut`` share."""
    v = sorted(values)
    k = int(len(v) * cut)
    return statistics.fmean(v[k:len(v) - k] if len(v) > 2 * k else v)


def paired_overhead(on: list[float], off: list[float], *, resamples: int = 2000, seed: int = 0) -> dict:
    """The overhead of paired step times (``on[i]`` beside ``off[i]``): trimmed mean of the
    differences over the mean off time, with its bootstrap 95 % range over the pairs."""
    diffs = [a - b for a, b in zip(on, off)]
    base = statistics.fmean(off)
    rng = random.Random(seed)
    boot = sorted(trimmed_mean(rng.choices(diffs, k=len(diffs))) / base for _ in range(resamples))
    lo, hi = boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]
    return {"value": trimmed_mean(diffs) / base, "ci95": [lo, hi], "resolution": (hi - lo) / 2, "base_s": base}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mini")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=BatchConfig().micro_batch_size,
                   help="sequences per rank per step (default: labkit's default micro-batch, %(default)s)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=4010,
                   help="steps of the one run (pairs = (steps - warm-up) / 2; at micro-batch 16 on 2 cores "
                        "1,000 pairs resolved ±0.50 %%, 2,000 ±0.30 %%: docs/data/bench_gns.jsonl)")
    p.add_argument("--warmup-steps", type=int, default=10)
    args = p.parse_args(argv)
    if (args.steps - args.warmup_steps) < 20 or (args.steps - args.warmup_steps) % 2:
        raise SystemExit("bench_gns: --steps minus --warmup-steps must be an even number >= 20")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0, load0 = time.time(), os.getloadavg()
    plan = [True] * args.warmup_steps + schedule((args.steps - args.warmup_steps) // 2)
    with tempfile.TemporaryDirectory(prefix="bench_gns_") as tmp:
        data = pathlib.Path(tmp) / "shards"
        write_shards(data, n_sequences=2 * args.micro_batch * args.steps + 8, seq_len=args.seq_len,
                     vocab_size=args.vocab)
        cfg = TrainConfig(data_dir=str(data), run_dir=f"{tmp}/run", model=args.model, max_steps=args.steps,
                          num_threads=1, device="cpu", timeout_s=600, resume=False,
                          batch={"micro_batch_size": args.micro_batch}, schedule={"warmup_steps": 1},
                          measure={"timing_warmup_steps": args.warmup_steps, "trackers": ()},
                          checkpoint={"enabled": False})
        spawn_ranks(2, _toggled_train, json.dumps(to_dict(cfg)), plan, tmp, pin=True)
        records = [json.loads(line) for line in pathlib.Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
        log = json.loads(pathlib.Path(tmp, "observer.json").read_text())
        n_params = json.loads(pathlib.Path(tmp, "run", "result.json").read_text())["params"]
    assert [r["gns_on"] for r in records] == plan, "the toggle did not follow the plan"
    assert all(("b_simple" in r) == r["gns_on"] for r in records), "the switch did not take"
    timed = list(zip(records, log))[args.warmup_steps:]
    on = [r["step_time_s"] for r, _ in timed if r["gns_on"]]
    off = [r["step_time_s"] for r, _ in timed if not r["gns_on"]]
    est = paired_overhead(on, off)
    observer_s = statistics.fmean(entry["observer_s"] for r, entry in timed if entry["on"])
    observer_off_s = statistics.fmean(entry["observer_s"] for r, entry in timed if not entry["on"])
    reduces = {k: sorted({e["all_reduces"] for _, e in timed if e["on"] == k}) for k in (True, False)}
    norm_s = norm_seconds(n_params)
    out = {"benchmark": "gns", "metric": "step_time_overhead", "value": est["value"], "ci95": est["ci95"],
           "resolution": est["resolution"], "estimator": f"trimmed mean ({TRIM:.0%} each end) of paired "
           "differences of interleaved steps / mean off step; bootstrap 95 % range over pairs",
           "baseline": "the same steps of the same 2-rank DDP run with the observer off", "baseline_value": est["base_s"],
           "ratio": 1 + est["value"], "goal": 0.01, "goal_met": est["ci95"][1] <= 0.01, "higher_is_better": False,
           "pairs": len(on), "step_time_s_on_median": statistics.median(on),
           "step_time_s_off_median": statistics.median(off),
           "observer_s": observer_s, "observer_fraction": observer_s / est["base_s"], "observer_off_s": observer_off_s,
           "step_fields_s": statistics.fmean(e["step_fields_s"] for _, e in timed if e["on"]),
           "all_reduces_per_step": {"on": reduces[True], "off": reduces[False]},
           "b_simple_last": next(r["b_simple"] for r in reversed(records) if r["gns_on"]),
           "params": n_params, "norm_warm_s": norm_s["warm"], "norm_cold_s": norm_s["cold"],
           "model": args.model, "seq_len": args.seq_len, "micro_batch_per_rank": args.micro_batch, "ranks": 2,
           "steps": args.steps, "warmup_steps": args.warmup_steps, "cpu_count": os.cpu_count(),
           "load_avg_start": list(load0), "load_avg": list(os.getloadavg()), "wall_s": round(time.time() - t0, 1)}
    assert reduces[True] == reduces[False], f"the statistics added a collective: {reduces}"
    print(f"overhead {100 * out['value']:+.2f} % (95 % range {100 * est['ci95'][0]:+.2f} .. {100 * est['ci95'][1]:+.2f} %, "
          f"resolution ±{100 * est['resolution']:.2f} %) over {len(on)} interleaved pairs of {1e3 * est['base_s']:.0f} ms "
          f"steps; inside the observer {1e3 * observer_s:.2f} ms = {100 * out['observer_fraction']:.2f} % of the step; "
          f"all-reduces per step on {reduces[True]} off {reduces[False]}; load average {out['load_avg'][0]:.1f}",
          flush=True)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
