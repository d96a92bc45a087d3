"""Cost of the per-rank step timeline (labkit/train/timeline.py) and the time from a record to the figure.

1. Step-time overhead: ``train()`` on 2 spawned gloo ranks (CPU, one thread each, rank r pinned
   to core r as in bench_ddp.py) with ``timeline`` on and off, in paired rounds inside one
   process group (the order flips every round). The step time is rank 0's median ``step_time_s``
   over the timed steps of a run; the overhead is the median over rounds of the paired ratio
   on/off - 1, with its spread. Goal: <= 1 % of the step. The recorder's own work is also timed
   directly (``recorder_s``: a step's marks, the bucket clock's readings and its row appended to
   the file, median of 200, as a fraction of the step).
2. Record to figure: 2 local engines train the same model with a live ``labkit.rankview.RankView``;
   for each redraw, the seconds from the newest row's ``t_end`` (its rank recorded it) to the
   figure's display (``RankView.latencies``: the rank's publish interval, ipyparallel's datapub,
   run_ddp's poll, the analysis and the figure). Also the figure alone (``figure_s``: the
   analysis and ``rank_view_figure`` over 2 ranks x 100 steps).

Run: ``python benchmarks/bench_timeline.py`` from the repository root. JSON lines; the last line is
one JSON object. ``--no-live`` skips part 2 (no engines).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _prep import spawn_ranks, train_each  # noqa: E402
from bench_ddp import spread, write_shards  # noqa: E402
from labkit.config import TrainConfig, to_dict  # noqa: E402


def recorder_seconds(repeats: int = 200) -> float:
    """Median seconds of what one rank's timeline adds to a step: start, 8 marks, two bucket
    readings and the row written to its file (no publish)."""
    from labkit.train.timeline import Timeline

    with tempfile.TemporaryDirectory(prefix="bench_timeline_rec_") as tmp:
        tl = Timeline(tmp, rank=0, world_size=2)
        times = []
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            tl.start(step)
            for phase in ("data", "sync", "forward", "backward", "sync", "optimizer", "other", "eval"):
                tl.mark(phase)
            tl.clock.before(0, None)
            tl.clock.after(0, None)
            tl.end(step_s=0.1, comm_exposed_s=0.01)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def figure_seconds(rows: list[dict], repeats: int = 5) -> float:
    """Median seconds of ``rank_view_figure`` (the culprit, the breakdown, goodput and the figure)."""
    from labkit.rankview import rank_view_figure

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rank_view_figure(rows)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def live_latency(cfg: TrainConfig) -> dict:
    """Train ``cfg`` on 2 local engines with a live RankView; its latencies and the final rows."""
    import IPython.display

    from labkit import cluster as lc
    from labkit import lab
    from labkit.rankview import RankView

    IPython.display.display = IPython.display.update_display = lambda *a, **k: None  # no notebook here
    view = RankView(min_interval=0)
    cluster = lc.start_cluster(2)
    try:
        lab.train_on_cluster(lc.get_client(cluster), cfg, live=view, timeout=1800)
    finally:
        lc.stop_cluster(cluster)
    return {"latencies": view.latencies, "rows": view._records or []}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="mini")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--live-steps", type=int, default=40)
    p.add_argument("--no-live", action="store_true", help="skip the record-to-figure part (no engines)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0, load0 = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_timeline_") as tmp:
        data = pathlib.Path(tmp) / "shards"
        write_shards(data, n_sequences=2 * args.micro_batch * max(args.steps, args.live_steps) + 8,
                     seq_len=args.seq_len, vocab_size=args.vocab)
        base = TrainConfig(data_dir=str(data), run_dir="", model=args.model, max_steps=args.steps, num_threads=1,
                           device="cpu", timeout_s=600, resume=False, batch={"micro_batch_size": args.micro_batch},
                           schedule={"warmup_steps": 1}, checkpoint={"enabled": False},
                           measure={"timing_warmup_steps": args.warmup_steps, "trackers": ()})
        runs = []
        for rnd in range(args.rounds + 1):  # round 0: warm-up
            for on in ((True, False) if rnd % 2 == 0 else (False, True)):
                cfg = base.replace(run_dir=f"{tmp}/run-{rnd}-{int(on)}", measure={"timeline": on})
                runs.append({"round": rnd, "timeline": on, "cfg": to_dict(cfg)})
        spawn_ranks(2, train_each, json.dumps([r["cfg"] for r in runs]), pin=True)
        step = {True: [], False: []}
        for item in runs:
            run_dir = pathlib.Path(item["cfg"]["run_dir"])
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            med = statistics.median(r["step_time_s"] for r in records[args.warmup_steps:])
            assert (run_dir / "timeline").exists() == item["timeline"], "the switch did not take"
            print(json.dumps({"round": item["round"], "timeline": item["timeline"], "step_time_s": med,
                              "load_avg_1m": os.getloadavg()[0]}), flush=True)
            if item["round"] > 0:
                step[item["timeline"]].append(med)
        live = None
        if not args.no_live:
            live = live_latency(base.replace(run_dir=f"{tmp}/live", max_steps=args.live_steps))
            print(json.dumps({"live_latencies_s": live["latencies"]}), flush=True)
    on, off = statistics.median(step[True]), statistics.median(step[False])
    rec_s = recorder_seconds()
    per_round = [a / b - 1 for a, b in zip(step[True], step[False])]
    overhead = statistics.median(per_round)
    out = {"benchmark": "timeline", "metric": "step_time_overhead", "value": overhead,
           "baseline": "the same 2-rank DDP run without the per-rank timeline", "baseline_value": off,
           "ratio": 1 + overhead, "ratio_of_medians": on / off, "goal": 0.01, "higher_is_better": False,
           "step_time_s_on": on, "step_time_s_off": off, "per_round_overhead": per_round,
           "overhead_spread": spread(per_round), "recorder_s": rec_s, "recorder_fraction": rec_s / off,
           "model": args.model, "seq_len": args.seq_len, "micro_batch_per_rank": args.micro_batch, "ranks": 2,
           "steps": args.steps, "timed_steps": args.steps - args.warmup_steps, "rounds": args.rounds,
           "cpu_count": os.cpu_count(), "load_avg_1m_start": load0}
    if live is not None and live["latencies"]:
        lat = live["latencies"]
        out |= {"record_to_figure_s_median": statistics.median(lat), "record_to_figure_s_max": max(lat),
                "record_to_figure_draws": len(lat), "figure_s": figure_seconds(live["rows"])}
    out |= {"load_avg_1m": os.getloadavg()[0], "wall_s": round(time.time() - t0, 1)}
    s = out["overhead_spread"]
    print(f"overhead {100 * overhead:+.2f} % (per round min {100 * s['min']:+.2f} median {100 * s['median']:+.2f} "
          f"max {100 * s['max']:+.2f} %) over {args.rounds} paired rounds; the recorder alone {1e6 * rec_s:.0f} us = "
          f"{100 * out['recorder_fraction']:.3f} % of the step"
          + (f"; record to figure median {out['record_to_figure_s_median']:.2f} s, max "
             f"{out['record_to_figure_s_max']:.2f} s; the figure alone {out['figure_s']:.3f} s"
             if "figure_s" in out else "") + f"; load average {out['load_avg_1m']:.1f}", flush=True)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
