"""labkit.cluster.stuck's reading of rank status files, on status dicts shaped as
labkit.train.status writes them (the real files are exercised end to end on the network hosts in
tests/cluster/test_cluster_faults.py). The cases are ones seen there: 4 ranks whose rank 3 was
SIGSTOPped wrote their collectives one apart (rank 0 had finished collective 81 locally and waited
in 82, ranks 1-2 waited in 81) while rank 3's file still showed collective 72 from its last beat."""

from __future__ import annotations

import datetime
import json

import pytest

from labkit.cluster import stuck as S

NOW = 1_000_000.0


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")


def _status(rank: int, *, seq: int, in_flight: bool, age: float = 0.2, step: int = 11, phase: str = "train",
            median: float = 0.15, since_ago: float = 6.0, host: str = "h1") -> dict:
    entry = {"record_id": seq, "seq": seq, "op": "gloo:all_reduce", "in_flight": in_flight, "since": NOW - since_ago,
             "ranks": [0, 1, 2, 3]}
    return {"rank": rank, "world_size": 4, "token": "t", "host": host, "node": host, "pid": 100 + rank,
            "time": NOW - age, "interval_s": 0.5, "started": _iso(NOW - 60), "phase": phase, "step": step,
            "steps_done": step - 1, "step_at": NOW - since_ago, "median_step_s": median, "collective": entry,
            "collectives": {"0": entry}, "stack": [], "freed": None}


def _stopped_rank_3() -> dict[int, dict]:
    return {0: _status(0, seq=82, in_flight=True), 1: _status(1, seq=81, in_flight=True),
            2: _status(2, seq=81, in_flight=True, host="h2"),
            3: _status(3, seq=72, in_flight=False, age=6.3, step=10, host="h2")}


def test_a_stopped_rank_is_named_though_the_others_wait_one_collective_apart():
    statuses = _stopped_rank_3()
    assert S.stalled(statuses, NOW) == pytest.approx(6.0)
    found = S.diagnose(statuses, NOW)
    assert found["behind"] == [3] and found["waiting"] == [0, 1, 2] and found["seq"] == 81
    assert found["stale"] == {3: pytest.approx(6.3)}
    line = S.stuck_line(found, statuses, {3: 7})
    assert line == ("rank 3 (host h2, pid 103, engine 7) is not in collective 81 (gloo:all_reduce) that ranks 0-2 "
                    "have waited in for 6 s, at step 10; its heartbeat stopped 6 s ago: the process is not running "
                    "(stopped, or hung holding the GIL) or its node is cut off")


def test_a_running_rank_outside_any_collective_holds_the_others_up():
    statuses = _stopped_rank_3()
    statuses[3] = _status(3, seq=80, in_flight=False, host="h2")  # computing, its file fresh
    found = S.diagnose(statuses, NOW)
    assert found["behind"] == [3] and found["stale"] == {}
    assert S.stuck_line(found, statuses).endswith("at step 11; it is running")


def test_no_culprit_while_all_wait_or_all_compute_or_before_the_stall():
    waiting = {r: _status(r, seq=81, in_flight=True) for r in range(4)}
    assert S.diagnose(waiting, NOW) is None  # all in one collective: the network, not a rank
    computing = {r: _status(r, seq=81, in_flight=False) for r in range(4)}
    assert S.diagnose(computing, NOW) is None
    quiet = _stopped_rank_3()
    quiet[3]["phase"] = "done"  # a rank whose task ended is not stale, however old its file: it holds none up
    assert S.diagnose(quiet, NOW)["stale"] == {}
    short = {r: _status(r, seq=81, in_flight=r != 3, since_ago=0.6) for r in range(4)}
    assert S.stalled(short, NOW) is None  # 0.6 s: under STALL_MIN_S (and 5 x the 0.15 s median is 0.75 s)
    slow_steps = {r: _status(r, seq=81, in_flight=r != 3, median=2.0) for r in range(4)}
    assert S.stalled(slow_steps, NOW) is None  # 6 s is under 5 x a 2 s median


def test_read_statuses_keeps_the_newest_run_and_report_prints_it(tmp_path):
    status = tmp_path / "ranks"
    status.mkdir()
    for r, s in _stopped_rank_3().items():
        (status / f"rank-{r}.json").write_text(json.dumps(s))
    old = _status(5, seq=3, in_flight=False) | {"token": "older", "started": _iso(NOW - 600)}
    (status / "rank-5.json").write_text(json.dumps(old))
    (status / "rank-6.json").write_text("{torn")
    assert sorted(S.read_statuses(status)) == [0, 1, 2, 3] and sorted(S.read_statuses(status, "older")) == [5]
    found = S.report(tmp_path, wait_s=0)  # the files' times lie long past: no rank waits now, each is stale
    lines = found["lines"]
    assert found["state"] == "running" and found["stuck"] is None and sorted(found["ranks"]) == [0, 1, 2, 3]
    assert lines[0] == "running: 4 ranks at step 11; no rank holds the others up"
    assert [line.split(":")[0] for line in lines[-4:]] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert lines[-1].startswith("rank 3: host h2, node h2, pid 103, step 10 in train, collective 72 (gloo:all_reduce) done")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no rank status files"):
        S.report(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="nothing: run directory does not exist"):
        S.report(tmp_path / "nothing")


def test_labkit_frame_is_the_innermost_frame_of_labkit_itself():
    stack = ["/x/ipyparallel/engine/kernel.py:157 in do_apply", "/repo/labkit/train/loop.py:316 in _run",
             "/repo/labkit/train/runtime.py:84 in forward_backward",
             "/v/lib/python3.11/site-packages/labkit/train/dist.py:1 in x",
             "/v/lib/python3.11/site-packages/torch/nn/modules/linear.py:134 in Linear.forward"]
    assert S.labkit_frame(stack) == "labkit/train/runtime.py:84 in forward_backward"
    assert S.labkit_frame(stack[:1]) is None
