"""The culprit named on a real cluster: 4 gloo ranks over the network hosts h1/h2
(``labkit.testing.realcluster.NetHosts``), ranks 0-2 on h1 and rank 3 alone on h2, and one rank
slowed for real in each case (``labkit.testing.faults``):

- compute: rank 1's process in a cgroup limited to 0.03 CPU (a small share even on a machine
  loaded by other work, where every rank gets less than its core);
- data: rank 2's DataLoader worker (and its forkserver) in a cgroup allowed 1 ms of CPU a second
  from its first step on (a worker throttled while it starts would take minutes to import
  torch). Its batches take about 0.8 ms of CPU each, so it makes about one a second while the
  rank's own process runs free (a lighter limit does not bite: the worker keeps two batches ahead);
- network: what h2 receives shaped to 20 Mbit/s with tc on h2 (its veth's ingress through an
  ifb with a tbf): rank 3 hears from every other rank only through it. (Shaped both ways, the
  link is as slow for rank 2, which receives from rank 3 in gloo's ring: then the two finish
  their all-reduce together and neither is named.)

labkit must name the right rank and cause in the run's result (``labkit.train.straggler.culprit``
over steps 3-12 of a 12-step run), and an even run of 200 steps (judged over steps 3-200) names no one. The four runs are
one spawn of 4 rank processes, which train the cases one after the other (the test applies each
fault between them) so that torch is imported once, and share one NetHosts start.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest

from labkit.testing import faults
from labkit.testing import realcluster as R

PLACES = ("h1", "h1", "h1", "h2")
CASES = ("even", "compute", "data", "network")
SLOW = {"compute": 1, "data": 2, "network": 3}
pytestmark = pytest.mark.exclusive  # a slowed rank against the others, and an even run that must stay even

CASE_S = 300.0  # the most one case may take on a loaded machine
STEPS = {"even": 200, "compute": 12, "data": 12, "network": 12}
"""Each case's steps. The result's culprit is judged over all steps after the 2 timing warm-up ones
(labkit.train.loop._timeline_fields), and ``culprit`` needs at least 8 of them (``min_window``):
12 steps give 10, named in 10 (compute, network) and 6 or more (data: its worker starts two
batches ahead) on CI, where 20 steps took 40 s (compute) and 50 s (data) of the slowed ranks'
throttled time for the same verdict. The even run keeps its 200: no rank may be named over a long run."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, plan_json: str) -> None:
    """One rank: for each case, say it is ready, wait for the test's go, train it."""
    import torch

    from labkit.config import TrainConfig, from_dict
    from labkit.train import train

    plan = json.loads(plan_json)
    torch.set_num_threads(1)
    os.environ.pop("GLOO_SOCKET_IFNAME", None)  # h1/h2 resolve to the hosts' veth addresses
    gate = pathlib.Path(plan["gate"])
    for case, port, cfg in zip(CASES, plan["ports"], plan["cfgs"]):
        (gate / f"ready-{case}-{rank}").write_text(str(os.getpid()))
        while not (gate / f"go-{case}").exists():
            time.sleep(0.05)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(PLACES[:rank].count(PLACES[rank])), "WORLD_SIZE": "4",
                           "MASTER_ADDR": "h1", "MASTER_PORT": str(port)})
        train(from_dict(TrainConfig, cfg))


def _wait_ready(gate: pathlib.Path, case: str, procs: list, logs: list) -> list[int]:
    def ready():
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a rank ended before {case}: {[log.read_text()[-3000:] for log in logs]}")
        texts = [f.read_text() if f.exists() else "" for f in (gate / f"ready-{case}-{r}" for r in range(4))]
        return all(texts) and [int(t) for t in texts]  # a file may be seen before its pid is in it

    return R.wait_for(ready, CASE_S, f"4 ranks ready for {case}")


def _throttle_loader(limit: faults.CpuLimit, pid: int, started: pathlib.Path, stop: threading.Event) -> None:
    """Once ``started`` exists (the rank's first timeline row), put every process rank ``pid``
    has started (its DataLoader's forkserver and worker) in ``limit``, and any it starts later."""
    seen: set[int] = set()
    while not stop.is_set() and not started.exists():
        time.sleep(0.05)
    while not stop.is_set():
        for child in faults.descendants(pid):
            if child not in seen:
                seen.add(child)
                try:
                    limit.add(child)
                except OSError:
                    pass
        time.sleep(0.05)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Train the four cases; {case: (result, seconds, seconds the kernel throttled the slowed processes)}."""
    why = R.unavailable_hosts() or faults.cgroup_unavailable() or faults.ifb_unavailable()
    if why:
        pytest.skip(f"straggler cases need network hosts, a cpu cgroup and ifb: {why}")
    from labkit.config import TrainConfig, to_dict
    from tiny_shards import write_tiny_shards

    root = tmp_path_factory.mktemp("stragglers")
    shards = write_tiny_shards(root / "shards", n_sequences=256)
    base = TrainConfig(data_dir=str(shards), run_dir="", model="tiny", max_steps=20, num_threads=1, device="cpu",
                       timeout_s=120, seed=0, batch={"micro_batch_size": 8}, optim={"lr": 1e-3},
                       schedule={"warmup_steps": 2}, measure={"timing_warmup_steps": 2, "trackers": ()},
                       checkpoint={"enabled": False}, eval={"every": 0})
    cfgs = {case: to_dict(base.replace(run_dir=str(root / case), max_steps=STEPS[case],
                                       data={"num_workers": 1 if case == "data" else 0})) for case in CASES}
    gate = root / "gate"
    gate.mkdir()
    plan = {"gate": str(gate), "ports": [_free_port() for _ in CASES], "cfgs": [cfgs[c] for c in CASES]}
    out = {}
    with R.NetHosts(root / "net") as hosts:
        procs, logs = [], []
        for rank, host in enumerate(PLACES):
            logs.append(root / f"rank{rank}.err")
            with open(logs[-1], "w") as err:
                command = hosts.wrap(host) + [sys.executable, __file__, str(rank), json.dumps(plan)]
                procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err,
                                              cwd=pathlib.Path(__file__).resolve().parents[2]))
        try:
            for case in CASES:
                pids = _wait_ready(gate, case, procs, logs)
                limit, stop, watcher = None, threading.Event(), None
                if case == "compute":
                    limit = faults.CpuLimit(0.03)
                    limit.add(pids[SLOW[case]])
                elif case == "data":
                    limit = faults.CpuLimit(0.001, period_s=1.0)
                    started = root / case / "timeline" / f"rank-{SLOW[case]:05d}.jsonl"
                    watcher = threading.Thread(target=_throttle_loader, args=(limit, pids[SLOW[case]], started, stop))
                    watcher.start()
                elif case == "network":
                    faults.shape_host(hosts, PLACES[SLOW[case]], 20e6, direction="in")
                t0 = time.monotonic()
                (gate / f"go-{case}").write_text("")
                try:
                    done = root / case / "result.json"
                    R.wait_for(lambda: done.exists() or any(p.poll() is not None for p in procs), CASE_S,
                               f"case {case}", poll=0.2)
                    assert (root / case / "result.json").exists(), [log.read_text()[-3000:] for log in logs]
                    out[case] = (json.loads((root / case / "result.json").read_text()), time.monotonic() - t0,
                                 limit.throttled_s() if limit is not None else None)
                finally:
                    stop.set()
                    if watcher is not None:
                        watcher.join()
                    if limit is not None:
                        limit.close()
                    if case == "network":
                        faults.unshape_host(hosts, PLACES[SLOW[case]])
            for p in procs:
                p.wait(timeout=60)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    assert [p.returncode for p in procs] == [0] * 4, [log.read_text()[-3000:] for log in logs]
    return out


def _say(say, case: str, run: tuple) -> None:
    result, seconds, throttled = run
    extra = f", kernel throttled the slowed processes {throttled:.1f} s" if throttled is not None else ""
    say(f"\n[stragglers] {case}: {result['steps']} steps in {seconds:.1f} s (load {os.getloadavg()[0]:.1f}"
        f"{extra}); goodput {result['goodput']:.2f}; "
        f"{(result['culprit'] or {}).get('line', 'culprit: none')}")


def test_an_even_run_of_200_steps_names_no_culprit(runs, say):
    result = runs["even"][0]
    _say(say, "even", runs["even"])
    assert result["steps"] == 200 and result["world_size"] == 4
    assert result["culprit"] is None
    parts = [result["goodput"]] + [v for k, v in result.items() if k.startswith("badput_")]
    assert len(parts) == 9 and all(p >= 0 for p in parts) and abs(sum(parts) - 1) < 1e-6


@pytest.mark.parametrize("case", ["compute", "data", "network"])
def test_the_slowed_rank_and_its_cause_are_named_within_20_steps(runs, case, say):
    result = runs[case][0]
    _say(say, case, runs[case])
    found = result["culprit"]
    assert found is not None, f"{case}: no culprit named"
    assert (found["rank"], found["cause"]) == (SLOW[case], case), found["line"]
    assert found["host"] == PLACES[SLOW[case]] and found["last_step"] <= 20 and found["of"] == STEPS[case] - 2
    assert found["waiting"] == [r for r in range(4) if r != SLOW[case]]


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2])
