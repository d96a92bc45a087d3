"""labkit.cluster: pure rank assignment, and a real 2-engine local ipyparallel cluster (gloo DDP)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import re

import pytest

from labkit import cluster as C
from labkit import lab
from tiny_shards import write_tiny_shards

HERE = pathlib.Path(__file__).resolve().parent


def _info(eid, node, local_id=None, host=None):
    return {"engine_id": eid, "hostname": host or node, "node": node, "local_id": local_id,
            "pid": 1000 + eid, "gpus": None}


# ---------------------------------------------------------------- assign_ranks (pure)


def test_assign_ranks_one_host_two_engines():
    env = C.assign_ranks([_info(7, "h", 1), _info(3, "h", 0)], master_port=29500)
    assert env[3] == {"RANK": "0", "LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "2",
                      "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert env[7]["RANK"] == "1" and env[7]["LOCAL_RANK"] == "1"


def test_assign_ranks_two_hosts_uneven_and_order_independent():
    # node "b" has 3 engines, node "a" has 1; engine ids follow registration order, not hosts.
    infos = [_info(0, "b", 2), _info(1, "a", 0), _info(2, "b", 0), _info(3, "b", 1)]
    env = C.assign_ranks(infos, master_port=1234)
    ranks = {eid: (int(e["RANK"]), int(e["NODE_RANK"]), int(e["LOCAL_RANK"]), int(e["LOCAL_WORLD_SIZE"]))
             for eid, e in env.items()}
    assert ranks == {1: (0, 0, 0, 1), 2: (1, 1, 0, 3), 3: (2, 1, 1, 3), 0: (3, 1, 2, 3)}
    assert {e["MASTER_ADDR"] for e in env.values()} == {"a"}  # rank 0's hostname
    assert {e["WORLD_SIZE"] for e in env.values()} == {"4"}
    for seed in range(5):
        shuffled = infos[:]
        random.Random(seed).shuffle(shuffled)
        assert C.assign_ranks(shuffled, master_port=1234) == env


def test_tensor_parallel_groups_stay_within_a_node():
    """tp innermost (labkit.train.parallel): groups of tp consecutive ranks, each on one node."""
    infos = [_info(0, "b", 1), _info(1, "a", 0), _info(2, "b", 0), _info(3, "a", 1)]  # 2 engines per node
    assert C.tensor_parallel_groups(infos, 2) == [[1, 3], [2, 0]]  # ranks 0-1 on a, 2-3 on b
    assert C.tensor_parallel_groups(infos, 1) == [[1], [3], [2], [0]]
    with pytest.raises(ValueError, match=r"^tp: the tensor-parallel group of ranks 0-3 spans nodes \['a', 'b'\]"):
        C.tensor_parallel_groups(infos, 4)
    three = [_info(i, "ab"[i // 3], i % 3) for i in range(6)]
    with pytest.raises(ValueError, match=r"ranks 2-3 spans .* tp 2 must divide every node's engine count \{'a': 3, 'b': 3\}"):
        C.tensor_parallel_groups(three, 2)


def test_assign_ranks_ties_on_local_id_break_by_engine_id_and_errors():
    env = C.assign_ranks([_info(5, "n", 0), _info(2, "n", 0)], master_port=1)
    assert env[2]["RANK"] == "0" and env[5]["RANK"] == "1"
    with pytest.raises(ValueError, match="empty"):
        C.assign_ranks([], master_port=1)
    with pytest.raises(ValueError, match="master_port"):
        C.assign_ranks([_info(0, "n", 0)], master_port=70000)
    with pytest.raises(ValueError, match="duplicate"):
        C.assign_ranks([_info(0, "n", 0), _info(0, "m", 0)], master_port=1)


# ---------------------------------------------------------------- real cluster


@pytest.fixture
def rc(cluster):
    return C.get_client(cluster)


def _allreduce(x, sink=None):
    """Each rank contributes x + rank; returns (rank, sum, env seen, threads)."""
    import datetime
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    t = torch.tensor([float(x + rank)])
    dist.all_reduce(t)
    if sink is not None:
        for step in range(4):
            sink({"step": step, "loss": 1.0 / (step + 1)})
            time.sleep(0.3)
    return {"rank": rank, "sum": t.item(), "world": dist.get_world_size(),
            "env_rank": int(os.environ["RANK"]), "master": os.environ["MASTER_ADDR"],
            "node_rank": int(os.environ["NODE_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
            "threads": torch.get_num_threads()}


def _whoami():
    import os

    return os.getpid(), os.environ.get("LABKIT_NODE_NAME")


def test_controller_listens_on_localhost(cluster):
    files = list(pathlib.Path(cluster.profile_dir, "security").glob(f"ipcontroller-{cluster.cluster_id}-client.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["interface"] == "tcp://127.0.0.1"
    with pytest.warns(UserWarning, match="all interfaces"), pytest.raises(ValueError, match="n must be"):
        C.start_cluster(0, controller_ip="*")
    with pytest.raises(ValueError, match="engines must be one of"):
        C.start_cluster(2, engines="pbs")


def test_connection_files_owner_only(cluster):
    sec = pathlib.Path(cluster.profile_dir, "security")
    mine = sorted(sec.glob(f"*{cluster.cluster_id}*.json"))
    names = {p.name for p in mine}
    # ipyparallel's connection files and cluster file, and labkit's saved settings
    assert {f"ipcontroller-{cluster.cluster_id}-client.json", f"ipcontroller-{cluster.cluster_id}-engine.json",
            f"cluster-{cluster.cluster_id}.json", f"labkit-{cluster.cluster_id}.json"} <= names
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in mine} == {n: oct(0o600) for n in names}
    assert sec.stat().st_mode & 0o777 == 0o700
    saved = json.loads(sec.joinpath(f"labkit-{cluster.cluster_id}.json").read_text())
    assert saved["engines"] == "local" and saved["n"] == 2 and saved["controller_ip"] == "127.0.0.1"
    assert saved["environment"]["PYTHONPATH"].split(os.pathsep)[0] == str(HERE.parents[1])


def test_engine_info_and_per_node_default(rc):
    infos = C.engine_info(rc)
    assert [i["engine_id"] for i in infos] == sorted(rc.ids)
    assert len({i["pid"] for i in infos}) == 2 and os.getpid() not in {i["pid"] for i in infos}
    assert {i["node"] for i in infos} == {i["hostname"] for i in infos}
    assert sorted(i["local_id"] for i in infos) == [0, 1]
    out = C.per_node(rc, _whoami)
    first = min(infos, key=lambda i: i["local_id"])
    assert out == {first["node"]: (first["pid"], None)}


def test_per_node_and_ddp_with_simulated_nodes(rc, tmp_path):
    infos = C.engine_info(rc)
    ids = [i["engine_id"] for i in infos]
    C.set_node_names(rc, {ids[0]: "node-b", ids[1]: "node-a"})
    try:
        out = C.per_node(rc, _whoami)
        pids = {i["engine_id"]: i["pid"] for i in infos}
        assert out == {"node-a": (pids[ids[1]], "node-a"), "node-b": (pids[ids[0]], "node-b")}
        # staging: one copy per simulated node, each made by that node's engine
        src = write_tiny_shards(tmp_path / "shards")
        staged = lab.stage(rc, str(tmp_path))
        index = json.loads((src / "index.json").read_text())
        assert sorted(staged) == ["node-a", "node-b"]
        for node, rep in staged.items():
            dst = pathlib.Path(rep["path"])
            assert rep["node"] == node and rep["copied"] is True
            assert (tmp_path / "local" / node).resolve() in dst.parents
            assert sorted(p.name for p in dst.iterdir()) == ["index.json", "shard-00000.bin", "shard-00001.bin"]
            assert [(dst / s["file"]).read_bytes() == (src / s["file"]).read_bytes() for s in index["shards"]] == [True, True]
        res = C.run_ddp(rc, _allreduce, 10, timeout=120)
        # node-a sorts first, so the engine named node-a is rank 0 on node rank 0
        assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in res] == [(0, 0, 0), (1, 1, 0)]
        assert all(r["master"] == "127.0.0.1" for r in res)  # one real host
        assert all(r["threads"] == max(1, len(os.sched_getaffinity(0)) // 2) for r in res)  # shared per host, not per node
    finally:
        C.set_node_names(rc, {ids[0]: None, ids[1]: None})


def test_run_ddp_allreduce_twice_and_live_records(rc):
    seen = []
    res = C.run_ddp(rc, _allreduce, 3, live=seen.append, timeout=120)
    assert [r["rank"] for r in res] == [0, 1] and [r["env_rank"] for r in res] == [0, 1]
    assert all(r["sum"] == 3 + 4 and r["world"] == 2 for r in res)  # (3+0) + (3+1)
    assert all(r["threads"] == max(1, len(os.sched_getaffinity(0)) // 2) for r in res)  # cores / engines
    assert seen, "live callback never called"
    assert seen[-1] == [{"step": s, "loss": 1.0 / (s + 1)} for s in range(4)]  # final history
    steps = [[r["step"] for r in recs] for recs in seen]
    assert all(s == list(range(len(s))) for s in steps)
    res2 = C.run_ddp(rc, _allreduce, 5, timeout=120)  # same engines, fresh port, fresh group
    assert [r["sum"] for r in res2] == [11.0, 11.0]
    # the engines' environment is restored after the run
    env_after = rc[:].apply_sync(lambda: __import__("os").environ.get("RANK"))
    assert env_after == [None, None]


def _timeline_feed(n, timeline_sink=None):
    """n steps of a real ``Timeline`` on each rank (rank r waits 30 ms x (r + 1) for its "data"),
    published through run_ddp's timeline sink."""
    import os
    import tempfile
    import time

    from labkit.train.timeline import Timeline

    rank = int(os.environ["RANK"])
    tl = Timeline(tempfile.mkdtemp(), rank=rank, world_size=int(os.environ["WORLD_SIZE"]), publish=timeline_sink,
                  publish_every_s=0)
    for step in range(1, n + 1):
        tl.start(step)
        time.sleep(0.03 * (rank + 1))
        tl.mark("data")
        tl.end(step_s=0.03 * (rank + 1))
    tl.close()
    return n


def test_run_ddp_hands_every_ranks_timeline_to_a_rank_view(rc, monkeypatch):
    """Every rank publishes its step-timeline rows (ipyparallel's datapub); run_ddp hands the
    rows of both ranks to a live RankView (``wants = "timeline"``) and rank 0's metric records
    to the other live callbacks; the final frame holds every (rank, step) and its data wait."""
    import IPython.display

    from labkit.rankview import RankView

    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: None)
    monkeypatch.setattr(IPython.display, "update_display", lambda *a, **k: None)
    view, records = RankView(min_interval=0), []
    assert C.run_ddp(rc, _timeline_feed, 6, live=[view, records.append], timeout=120) == [6, 6]
    assert records == []  # the feed has no metrics sink: nothing for record callbacks
    assert view.draws >= 1 and view.latencies and all(s >= 0 for s in view.latencies)
    rows = {(r["rank"], r["step"]): r for r in view._records}
    assert set(rows) == {(r, s) for r in (0, 1) for s in range(1, 7)}
    assert rows[(1, 3)]["data_s"] >= 0.06 and rows[(1, 3)]["host"] and rows[(0, 6)]["world_size"] == 2


def _fail_on_rank_1():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose")
    return "ok"


def _sleep(seconds):
    import time

    time.sleep(seconds)


def test_run_ddp_errors_name_the_rank(rc):
    with pytest.raises(C.DDPError, match=r"rank 1 .*failed") as ei:
        C.run_ddp(rc, _fail_on_rank_1, timeout=60)
    assert "ValueError: boom on purpose" in str(ei.value) and "_fail_on_rank_1" in str(ei.value)
    with pytest.raises(C.DDPError, match=r"timeout after 0.5 s: rank 0 .*rank 1"):
        C.run_ddp(rc, _sleep, 2.0, timeout=0.5)
    rc[:].apply_sync(lambda: None)  # wait for the sleeps to end before the next test


def _say(sink=None):
    import os
    import sys

    print(f"hello from rank {os.environ['RANK']}", flush=True)
    print(f"careful on rank {os.environ['RANK']}", file=sys.stderr, flush=True)
    return os.environ["RANK"]


def test_run_ddp_streams_engine_output(rc, capsys):
    infos = C.engine_info(rc)
    rank_env = C.assign_ranks(infos, master_port=1)
    assert C.run_ddp(rc, _say, timeout=60) == ["0", "1"]
    out, err = capsys.readouterr()
    for eid, env in rank_env.items():
        assert re.search(rf"\[stdout:{eid}\]\s+hello from rank {env['RANK']}\n", out), out
        assert re.search(rf"\[stderr:{eid}\]\s+careful on rank {env['RANK']}\n", err), err


def _busy(marker_dir, sink=None):
    """Loops 60 s unless interrupted; writes marker_dir/rank<R> saying how it ended."""
    import os
    import pathlib
    import time

    marker = pathlib.Path(marker_dir, f"rank{os.environ['RANK']}")
    try:
        for step in range(600):
            if sink is not None:
                sink({"step": step})
            time.sleep(0.1)
    except KeyboardInterrupt:
        marker.write_text(f"interrupted at step {step}")
        raise
    marker.write_text("finished")


def test_interrupt_stops_engine_work(rc, tmp_path):
    calls = []

    def live(records):
        calls.append(records[-1]["step"])
        raise KeyboardInterrupt  # what a notebook's interrupt button does in the waiting cell

    with pytest.raises(KeyboardInterrupt):
        C.run_ddp(rc, _busy, str(tmp_path), live=live, timeout=120, stream=False)
    assert len(calls) == 1
    texts = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert sorted(texts) == ["rank0", "rank1"]
    assert all(t.startswith("interrupted at step ") for t in texts.values()), texts
    # the engines are free again: a new task runs at once (they would be busy for 60 s otherwise)
    assert len(set(rc[:].apply_async(os.getpid).get(timeout=20))) == 2


def test_progress_bar_text(capsys):
    """Outside a notebook the bar is tqdm's on stderr, moved by the newest record's step, with its
    loss and tokens/s; a resumed run's bar starts at its checkpoint's step."""
    bar = C.progress_bar(40, label="train")
    bar([{"step": 9, "loss": 2.5}, {"step": 10, "loss": 2.25, "tokens_per_s": 1234.0}])
    assert bar.text == "train: step 10/40 (25 %) loss 2.250 tokens/s 1,234"
    bar.close()
    err = capsys.readouterr().err
    assert "train:" in err and "10/40" in err and "loss=2.250" in err and "tokens/s=1,234" in err, err
    with C.StepProgress(40, label="resume", initial=30) as resumed:
        resumed.record({"step": 31, "loss": 2.0})
        assert resumed._bar.n == 31 and resumed._bar.initial == 30
    assert "31/40" in capsys.readouterr().err


def _die():
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def test_run_ddp_dead_engine_raises(rc):
    """Runs last: kills one engine (the module fixture stops the cluster afterwards)."""
    victim = max(rc.ids)
    with pytest.raises(C.DDPError, match=rf"(?s)engine {victim}\b.*died") as err:
        C.run_ddp(rc, _die, targets=[victim], timeout=60)
    # the signal, from the engine process's exit status; not out of memory (the kernel did not say so)
    assert "killed by signal 9 (SIGKILL))" in str(err.value) and "out of memory" not in str(err.value), err.value
