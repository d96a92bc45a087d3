"""The control plane at a larger engine count: ``--nodes`` x ``--per-node`` CPU engines on this
machine (default 16 x 4 = 64), each node simulated as labkit simulates nodes on one host: the
engine's ``LABKIT_NODE_NAME`` (``labkit.cluster.set_node_names``) and its own local scratch
(``set_local_roots``), so ``assign_ranks`` gives 16 nodes of 4 ranks.

Measured, wall-clock seconds (one JSON line each, then a summary line):

- ``register``: ``labkit.cluster.start_cluster(n)`` from the call until every engine is registered
  (the controller's start included), with the registration timeouts labkit sets for the count
  (``labkit.cluster.engines.registration_timeouts``, printed);
- ``round_trip`` (median and p90 of ``--rounds``): ``apply``, a no-op task on every engine and its
  result back (``client[:].apply_sync``); ``control``, a signal-0 request to every engine's nanny
  and its reply (what ``run_ddp`` asks when a rank may be lost, ``engine_watch.unreachable``);
  ``engine_info``, the facts every ``run_ddp`` call asks first;
- ``status_poll``: ``labkit.cluster.stuck.StallWatch.poll`` over the n ranks' status files while a
  run_ddp call runs on every engine (what the notebook does every second to name a stuck rank);
- ``record_to_figure``: n ranks under ``run_ddp`` each make a step-timeline row every
  ``--interval`` s and publish their newest 32 every 0.5 s (the timeline's own pace, through
  ipyparallel's ``publish_data``), and the notebook's live rank view (``labkit.rankview.RankView``:
  heatmaps, per-rank bars, the culprit) draws them: seconds from a row on its rank to the end of
  the first draw holding it (``latency``), how far each draw is behind its newest row and its
  slowest rank's (``behind_newest``, ``behind_slowest``; the last draw, after the ranks ended,
  left out) and the time to draw (``draw``): median, p90, max; for each of run_ddp's ``--polls``
  (its wait between looks at the ranks) in paired rounds.

Each line carries the machine's load (1- and 5-minute load average, CPUs) measured just before.
Numbers from a loaded machine say so by that load; docs/measurement.md takes those of an idle one.
Run from the repository root: ``python benchmarks/bench_control_plane.py`` (about 3 GB of memory
for 64 engines and their nannies; ``--nodes 2 --per-node 4`` for a quick check).
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

from labkit import cluster as C  # noqa: E402
from labkit.cluster.engine_watch import unreachable  # noqa: E402
from labkit.cluster.engines import registration_timeouts  # noqa: E402
from labkit.cluster.stuck import StallWatch, read_statuses  # noqa: E402


def _load() -> dict:
    one, five, _ = os.getloadavg()
    return {"load_1m": round(one, 2), "load_5m": round(five, 2), "cpus": len(os.sched_getaffinity(0))}


def _stats(values: list[float]) -> dict:
    v = sorted(values)
    return {"median_s": round(statistics.median(v), 4), "p90_s": round(v[int(0.9 * (len(v) - 1))], 4),
            "max_s": round(v[-1], 4), "n": len(v)}


def _noop() -> int:
    return 0


def timeline_ranks(steps: int, interval: float, phases: list[str], segment_start: float, timeline_sink=None) -> int:
    """A rank without torch: every ``interval`` s (its step) one row of the step timeline
    (``labkit.train.timeline.SCHEMA``'s columns; the phases split the step evenly, no buckets),
    handed to run_ddp's ``timeline_sink`` at the pace ``labkit.train.timeline.Timeline`` publishes:
    its newest 32 rows at most every 0.5 s, and after the last step."""
    import os
    import socket
    import time
    from collections import deque

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    recent, last = deque(maxlen=32), float("-inf")
    for step in range(1, steps + 1):
        t0 = time.time()
        time.sleep(interval)
        t = time.time()
        recent.append({"step": step, "rank": rank, "host": socket.gethostname(), "world_size": world,
                       "segment_start": segment_start, "resumed_from": 0, "t_start": t0, "t_end": t,
                       "step_s": t - t0, **{f"{p}_s": (t - t0) / len(phases) for p in phases},
                       "sync_first_s": 0.0, "sync_end_s": 0.0, "comm_exposed_s": 0.0, "bucket_ready_s": [],
                       "bucket_done_s": []})
        if timeline_sink is not None and (time.monotonic() - last >= 0.5 or step == steps):
            timeline_sink(list(recent))
            last = time.monotonic()
    return steps


def record_to_figure(rc, n: int, *, steps: int, interval: float, poll: float) -> dict:
    """n ranks publish their step-timeline rows through ``run_ddp`` (``timeline_ranks``); the
    notebook's ``labkit.rankview.RankView`` draws them at its pace (at most once a second; the
    display calls themselves are no-ops here, the figure and its JSON for the page are built). Per
    figure: seconds from its newest row, and from its slowest rank's newest row, to the end of the
    draw (``behind_newest``: RankView's own ``latencies``; ``behind_slowest``); per row: seconds
    from its ``t_end`` on its rank to the end of the first draw holding it (``latency``); ``draw``."""
    import IPython.display

    from labkit.rankview import RankView
    from labkit.train.timeline import PHASES

    IPython.display.display = IPython.display.update_display = lambda *a, **k: None  # no front end here
    latencies, draws, slowest, seen = [], [], [], set()

    class Timed(RankView):
        def _draw(self, *, final: bool) -> None:
            t0 = time.perf_counter()
            super()._draw(final=final)
            done = time.time()
            draws.append(time.perf_counter() - t0)
            rows = self._records or []
            newest_of: dict[int, float] = {}
            for row in rows:
                newest_of[row["rank"]] = max(newest_of.get(row["rank"], 0.0), row["t_end"])
                if (row["rank"], row["step"]) not in seen:
                    seen.add((row["rank"], row["step"]))
                    latencies.append(done - row["t_end"])
            slowest.append(done - min(newest_of.values()))

    view = Timed(last_steps=100, window=20)
    C.run_ddp(rc, timeline_ranks, steps, interval, list(PHASES), time.time(), targets=sorted(rc.ids)[:n], live=view,
              timeout=600, stream=False, poll=poll)
    behind = view.latencies[:-1] or view.latencies  # the last draw (flush) comes after the ranks ended
    return {"latency": _stats(latencies), "behind_newest": _stats(behind), "behind_slowest": _stats(slowest[:-1] or slowest),
            "draw": _stats(draws), "records": len(seen)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--per-node", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--polls", type=float, nargs="+", default=[1.0, 0.5],
                    help="run_ddp's poll for record_to_figure, each in turn for --figure-rounds paired rounds")
    ap.add_argument("--figure-rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="steps (timeline rows) each rank makes")
    ap.add_argument("--interval", type=float, default=0.25, help="a rank's step time, seconds")
    a = ap.parse_args()
    n = a.nodes * a.per_node
    out = {"engines": n, "nodes": a.nodes, "per_node": a.per_node, "registration_timeouts": registration_timeouts(n)}
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="labkit-bench-cp-"))
    load = _load()
    t0 = time.monotonic()
    cl = C.start_cluster(n, profile_dir=str(scratch / "profile"), timeout=600)
    out["register_s"] = round(time.monotonic() - t0, 2)
    print(json.dumps({"what": "register", "seconds": out["register_s"], "engines": n, **load}), flush=True)
    try:
        rc = C.get_client(cl)
        ids = sorted(rc.ids)
        C.set_node_names(rc, {e: f"n{k // a.per_node:02d}" for k, e in enumerate(ids)})
        C.set_local_roots(rc, {e: str(scratch / "local" / f"n{k // a.per_node:02d}") for k, e in enumerate(ids)})
        for kind, call in (("apply", lambda: rc[ids].apply_sync(_noop)),
                           ("control", lambda: unreachable(rc, ids, timeout=30)),
                           ("engine_info", lambda: C.engine_info(rc))):
            load, times = _load(), []
            for _ in range(a.rounds):
                t = time.perf_counter()
                result = call()
                times.append(time.perf_counter() - t)
            if kind == "control" and result:
                raise RuntimeError(f"engines {result} did not answer their control channel")
            out[f"round_trip_{kind}"] = _stats(times)
            print(json.dumps({"what": "round_trip", "kind": kind, **_stats(times), **load}), flush=True)
        infos = C.engine_info(rc)
        nodes = {i["node"] for i in infos}
        assert len(nodes) == a.nodes, nodes
        out["engine_args_seen"] = [_engine_args(i["pid"]) for i in infos]
        out["record_to_figure"] = {}
        for k in range(a.figure_rounds):  # the polls alternate, the order flipping every round
            for poll in a.polls if k % 2 == 0 else a.polls[::-1]:
                load = _load()
                res = record_to_figure(rc, n, steps=a.steps, interval=a.interval, poll=poll)
                out["record_to_figure"].setdefault(str(poll), []).append(res)
                print(json.dumps({"what": "record_to_figure", "ranks": n, "interval_s": a.interval, "poll_s": poll,
                                  "round": k, **res, **load}), flush=True)
        status = _status_poll(rc, scratch / "status", a.rounds)
        out["status_poll"] = status
        print(json.dumps({"what": "status_poll", "ranks": n, **status, **_load()}), flush=True)
    finally:
        C.stop_cluster(cl)
    print(json.dumps({"what": "summary", **out}), flush=True)


def _engine_args(pid: int) -> list[str]:
    """The ipyparallel options (``--IPEngine.*``) on an engine process's command line."""
    import psutil

    return [arg for arg in psutil.Process(pid).cmdline() if arg.startswith("--IPEngine.")]


def _wait_then_return(seconds: float) -> int:
    import time

    time.sleep(seconds)
    return 0


def _status_poll(rc, status_dir: pathlib.Path, rounds: int) -> dict:
    """``StallWatch.poll`` over every rank's status file while a run_ddp call runs on all engines."""
    import threading

    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(r=C.run_ddp(rc, _wait_then_return, 2.0 + rounds * 0.1,
                                                                       status_dir=str(status_dir), stream=False)))
    runner.start()
    while len(read_statuses(status_dir)) < len(rc.ids) and runner.is_alive():
        time.sleep(0.1)
    statuses = read_statuses(status_dir)
    token = next(iter(statuses.values()))["token"]
    watch, times = StallWatch(status_dir, token), []
    for _ in range(rounds):
        t = time.perf_counter()
        watch.poll()
        times.append(time.perf_counter() - t)
    runner.join()
    return {**_stats(times), "ranks_read": len(statuses)}


if __name__ == "__main__":
    main()
