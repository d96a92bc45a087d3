"""labkit.train.status in one process: the file a rank's thread keeps fresh, the ranks a failed
collective names, and the controller's two requests (free the collectives; a stack by py-spy)
answered on real sockets and a real process. The multi-rank runs are in tests/train/test_recovery.py
(SIGKILL / SIGSTOP between 2 gloo ranks) and tests/cluster/test_cluster_faults.py (4 ranks on the
network hosts)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from labkit.cluster.stuck import request_interrupt
from labkit.train import status


def _read(path):
    return json.loads(path.read_text())


def _until(check, seconds=10.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("not reached within %.0f s" % seconds)


@pytest.fixture
def rank_status(tmp_path):
    started = []

    def start(**kw):
        s = status.RankStatus(tmp_path / "ranks", kw.pop("rank", 1), 2, interval_s=0.5, **kw).start()
        started.append(s)
        return s

    yield start
    for s in started:
        if status.current() is s:
            s.stop("done")


def test_the_file_keeps_step_phase_median_and_stack_and_its_owner_stops_it(rank_status, tmp_path):
    s = rank_status(token="t1", owner="run_ddp")
    path = tmp_path / "ranks" / "rank-1.json"
    assert _read(path)["phase"] == "start" and status.current() is s
    status.begin(tmp_path / "other", 1, 2, timeout_s=20, run_id="r9", token="unused")  # run_ddp's status is kept
    status.update(step=3, phase="train")
    for step in (1, 2, 3):
        status.step_done(step)
        time.sleep(0.05)
    beat = _read(path)["beat"]
    rec = _until(lambda: (r := _read(path))["beat"] > beat and r)  # the thread's next write
    assert (rec["token"], rec["run_id"], rec["step"], rec["steps_done"], rec["phase"]) == ("t1", "r9", 3, 3, "train")
    assert 0.04 < rec["median_step_s"] < 1.0 and rec["interval_s"] == 0.5 and rec["pid"] == os.getpid()
    assert any("test_the_file_keeps_step_phase" in frame for frame in rec["stack"])  # the main thread, from outside
    assert not (tmp_path / "other").exists()
    status.finish("done")  # the loop's end: the phase is written, run_ddp's thread goes on
    assert _read(path)["phase"] == "done" and status.current() is s
    s.stop("done")
    assert status.current() is None and status.stale(_read(path), time.time() + 99) is None  # done: never stale


def test_a_failed_collective_names_the_silent_and_the_gone_rank_and_keeps_its_own_error(tmp_path):
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    now, host = time.time(), socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    base = {"world_size": 3, "host": host, "token": "t", "interval_s": 0.5, "phase": "train", "labkit_collective": None}
    records = {0: base | {"rank": 0, "pid": os.getpid(), "time": now, "step": 5, "collective": None},
               1: base | {"rank": 1, "pid": os.getpid(), "time": now - 10.0, "step": 5,
                          "collective": {"seq": 83, "op": "gloo:all_reduce", "in_flight": True}},
               2: base | {"rank": 2, "pid": dead.pid, "time": now, "step": 4, "phase": "checkpoint", "collective": None}}
    for r, rec in records.items():
        (ranks / f"rank-{r}.json").write_text(json.dumps(rec))
    found = status.unanswering(ranks, 3, 0)
    assert [(r["rank"], r["how"]) for r in found] == [(1, "silent"), (2, "gone")]
    err = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 3000ms for recv\nmore")
    line = status.explain(err, tmp_path, 3, 0, 3.0)
    assert line == (f"rank 1 (pid {os.getpid()} on host {host}) stopped answering: no heartbeat for "
                    f"{found[0]['silent_s']:.1f} s, last at step 5 in train, in collective 83 (gloo:all_reduce); "
                    f"rank 2 (pid {dead.pid} on host {host}) stopped answering: its process is gone, last at step 4 "
                    "in checkpoint (collective timeout 3 s); here: RuntimeError: [../third_party/gloo/gloo/transport/"
                    "tcp/pair.cc:534] Timed out waiting 3000ms for recv")
    wrapped = RuntimeError("Got the following error when running the callback: RuntimeError: Got the following "
                           "error when running the callback: RuntimeError: [pair.cc:534] Timed out waiting 3000ms")
    assert status.explain(wrapped, tmp_path, 3, 0, 3.0).endswith("; here: RuntimeError: [pair.cc:534] Timed out "
                                                                 "waiting 3000ms")  # torch.futures' wrappers off
    assert status.explain(ValueError("bad shard"), tmp_path, 3, 0, 3.0) is None  # not a communication failure
    assert status.unanswering(ranks, 3, 0, token="another call") == []  # files of another run_ddp call: not read
    # a rank that failed with an error of its own is named only when no rank is silent or gone
    records[1] |= {"time": now, "phase": "failed", "failed_in": "train"}
    records[2] |= {"pid": os.getpid(), "phase": "done"}
    for r, rec in records.items():
        (ranks / f"rank-{r}.json").write_text(json.dumps(rec))
    (found,) = status.unanswering(ranks, 3, 0)
    assert status.failure_line([found], 3.0) == (f"rank 1 (pid {os.getpid()} on host {host}) failed with an error of "
                                                 "its own (see its log), at step 5 in train, in collective 83 "
                                                 "(gloo:all_reduce) (collective timeout 3 s)")


def test_requests_free_the_connections_made_since_the_start_and_dump_a_stack(rank_status, tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    before = socket.create_connection(server.getsockname())
    before_peer, _ = server.accept()
    s = rank_status(token="t2")
    after = socket.create_connection(server.getsockname())
    after_peer, _ = server.accept()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time\ndef waiting_here():\n    time.sleep(120)\n"
                                "waiting_here()"])
    try:
        time.sleep(1.0)  # the sleeper is in waiting_here
        request_interrupt(s.dir, "t2")
        (s.dir / "dump-7.request").write_text(json.dumps({"token": "t2", "host": socket.gethostname(),
                                                          "pid": sleeper.pid}))
        after_peer.settimeout(10)
        assert after_peer.recv(10) == b""  # shut down by the rank's thread: the peer sees the end at once
        assert _until(lambda: _read(s.path)["freed"]) >= 2  # both ends of the new connection are this process's
        before.sendall(b"ok")
        assert before_peer.recv(10) == b"ok"  # a connection older than the status is left alone
        dump = _until(lambda: (s.dir / "dump-7.json").exists() and _read(s.dir / "dump-7.json"), 30)
        assert dump["token"] == "t2" and dump["by_rank"] == 1 and dump["stack"][-1].endswith("in waiting_here")
    finally:
        sleeper.kill()
        for sock in (server, before, before_peer, after, after_peer):
            sock.close()
