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
- ``record_to_figure``: while n ranks each make a per-step record every ``--interval`` s and
  publish their newest ``--window`` every 0.5 s (ipyparallel's ``publish_data``, the channel and
  pace of ``run_ddp``'s ranks), the notebook draws a ranks x steps heatmap of them every second
  (``plotly``): seconds from a record on its rank to the first figure holding it (``latency``),
  how far each figure is behind its newest record and its slowest rank's (``behind_newest``,
  ``behind_slowest``; the last figure, drawn after the ranks ended, left out) and the time to
  build one (``draw``): median, p90, max.

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


def publish_records(rank: int, steps: int, interval: float, window: int, publish_every: float) -> int:
    """A rank without torch: every ``interval`` s (its step) one record {rank, step, t} (t: the Unix
    time it was made); its newest ``window`` published together at most every ``publish_every`` s
    and after the last (``publish_data``, the cadence of run_ddp's ranks: rank 0's records and the
    per-rank timeline rows, every 0.5 s)."""
    import time
    from collections import deque

    from ipyparallel.datapub import publish_data

    recent, last = deque(maxlen=window), float("-inf")
    for step in range(1, steps + 1):
        time.sleep(interval)
        recent.append({"rank": rank, "step": step, "t": time.time()})
        if time.monotonic() - last >= publish_every or step == steps:
            publish_data({"rows": list(recent)})
            last = time.monotonic()
    return steps


def heatmap(rows: list[dict], ranks: int):
    """Ranks x steps heatmap of the newest steps (the figure's cost grows with ranks x window)."""
    import plotly.graph_objects as go

    steps = sorted({r["step"] for r in rows})
    col = {s: i for i, s in enumerate(steps)}
    z = [[None] * len(steps) for _ in range(ranks)]
    for r in rows:
        z[r["rank"]][col[r["step"]]] = r["t"] % 1.0
    fig = go.Figure(go.Heatmap(z=z, x=steps, y=list(range(ranks)), colorscale="Viridis"))
    fig.update_layout(height=max(300, 12 * ranks), xaxis_title="step", yaxis_title="rank")
    return fig.to_plotly_json()


def record_to_figure(rc, n: int, *, steps: int, interval: float, window: int, publish_every: float = 0.5,
                     draw_every: float = 1.0) -> dict:
    """n ranks publish records (``publish_records``); the notebook draws every rank's newest rows
    every ``draw_every`` s (``labkit.live.LivePlot``'s pace). Per record: seconds from its time on
    its rank to the end of the first figure holding it (``latency``). Per figure: seconds from the
    newest record it holds to its end (``behind_newest``), and from the slowest rank's newest
    record (``behind_slowest``); ``draw``: building it."""
    ars = [rc[e].apply_async(publish_records, k, steps, interval, window, publish_every)
           for k, e in enumerate(sorted(rc.ids)[:n])]
    latencies, draws, newest, slowest, seen = [], [], [], [], set()
    while True:
        finished = all(ar.ready() for ar in ars)
        rows = [row for ar in ars for row in ((ar.data or {}).get("rows") or [])]
        if rows:
            t0 = time.time()
            heatmap(rows, n)
            done = time.time()
            draws.append(done - t0)
            fresh = [row for row in rows if (row["rank"], row["step"]) not in seen]
            latencies += [done - row["t"] for row in fresh]
            seen |= {(row["rank"], row["step"]) for row in fresh}
            last = {}
            for row in rows:
                last[row["rank"]] = max(last.get(row["rank"], 0.0), row["t"])
            newest.append(done - max(last.values()))
            slowest.append(done - min(last.values()))
        if finished:
            break
        time.sleep(draw_every)
    [ar.get() for ar in ars]
    return {"latency": _stats(latencies), "behind_newest": _stats(newest[:-1] or newest),
            "behind_slowest": _stats(slowest[:-1] or slowest), "draw": _stats(draws), "records": len(seen)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--per-node", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=40, help="records each rank publishes")
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between a rank's records")
    ap.add_argument("--window", type=int, default=32, help="newest records of each rank it publishes (a figure holds)")
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
        load = _load()
        res = record_to_figure(rc, n, steps=a.steps, interval=a.interval, window=a.window)
        out["record_to_figure"] = res
        print(json.dumps({"what": "record_to_figure", "ranks": n, "interval_s": a.interval, **res, **load}), flush=True)
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
    runner = threading.Thread(target=lambda: result.update(r=C.run_ddp(rc, _wait_then_return, 4.0 + rounds * 0.1,
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
