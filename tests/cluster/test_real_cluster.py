"""labkit on a real Slurm 22.05 with two virtual nodes (n1, n2, GPU GRES backed by device files)
and on real Open MPI, on this machine (labkit.testing.realcluster; needs root and the Debian
packages `make test` installs). Engines that cannot start fail fast with their own error, for
local, MPI and Slurm engines."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import time

import pytest

from labkit import cluster as C
from labkit.testing import realcluster as R

HERE = pathlib.Path(__file__).resolve().parent
TESTS = os.pathsep.join([str(HERE), str(HERE.parent)])  # engines import tests/ helpers
REASON = R.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"real cluster: {REASON}")
BROKEN = "labkit-test: this node's Python environment is broken"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """slurmctld + slurmd n1, n2 on 127.0.0.1 (2 GPUs each); stopped by pid however the tests end."""
    cluster = R.Slurm(tmp_path_factory.mktemp("slurm"), gpus_per_node=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(cluster.conf))
        cluster.start()
        try:
            yield cluster
        finally:
            cluster.stop()


def _where():
    import os
    import socket

    return {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"), "host": socket.gethostname(),
            "slurm_node": os.environ.get("SLURMD_NODENAME")}


def _allreduce_ranks():
    """All-reduce (rank + 1) over gloo; (rank, world size, sum, node, LOCAL_RANK)."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    from labkit.cluster.topology import node_name

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), node_name(), int(os.environ["LOCAL_RANK"])


def test_slurm_engines_on_two_nodes(slurm, tmp_path):
    """start_cluster(engines="slurm") on n1/n2: node names and local ids from Slurm, ranks node
    by node, the interface setting on every engine, staging per node, DDP across the nodes, a
    pipeline x data parallel run (pp 2 x dp 2: one stage per node), restart_engines (a new job,
    the old one gone), and squeue empty after stop_cluster."""
    from labkit import lab
    from tiny_shards import write_tiny_shards

    cl = C.start_cluster(engines="slurm", slurm={"nodes": 2, "gpus_per_node": 2}, network_interface="lo",
                         profile_dir=str(tmp_path / "profile"), timeout=180, env={"PYTHONPATH": TESTS})
    try:
        rc = C.get_client(cl)
        infos = C.engine_info(rc)
        assert sorted((i["node"], i["local_id"], i["gpus"]) for i in infos) == [
            ("n1", 0, "0,1"), ("n1", 1, "0,1"), ("n2", 0, "0,1"), ("n2", 1, "0,1")]
        ranks = C.assign_ranks(infos, master_port=29500)
        by_rank = sorted((int(ranks[i["engine_id"]]["RANK"]), i["node"], i["local_id"]) for i in infos)
        assert by_rank == [(0, "n1", 0), (1, "n1", 1), (2, "n2", 0), (3, "n2", 1)]
        facts = rc[:].apply_sync(_where)
        assert {f["GLOO_SOCKET_IFNAME"] for f in facts} == {"lo"}  # network_interface="lo"
        assert sorted(f["slurm_node"] for f in facts) == ["n1", "n1", "n2", "n2"]
        jobs = slurm.jobs()
        assert [(j["name"], j["state"], j["nodes"]) for j in jobs] == [
            (f"ipengine-{cl.cluster_id}", "RUNNING", "n[1-2]")]
        first_job = jobs[0]["job_id"]

        workdir = tmp_path / "work"
        write_tiny_shards(workdir / "shards")
        staged = lab.stage(rc, str(workdir))
        assert sorted(staged) == ["n1", "n2"]
        for node, info in staged.items():  # one verified copy per node, in that node's own directory
            assert pathlib.Path(info["path"]).is_relative_to(workdir / "local" / node), info
            assert sorted(p.name for p in pathlib.Path(info["path"]).glob("shard-*.bin")) == [
                "shard-00000.bin", "shard-00001.bin"]

        out = C.run_ddp(rc, _allreduce_ranks, timeout=120, stream=False)
        assert out == [(0, 4, 10.0, "n1", 0), (1, 4, 10.0, "n1", 1), (2, 4, 10.0, "n2", 0), (3, 4, 10.0, "n2", 1)]

        # pipeline x data parallel across the nodes: stage 0 on n1's ranks, stage 1 on n2's (tp innermost)
        from labkit.config import TrainConfig

        pp2 = TrainConfig(data_dir=str(workdir / "shards"), run_dir=str(tmp_path / "pp2-dp2"), model="tiny",
                          max_steps=3, device="cpu", num_threads=1, timeout_s=120,
                          batch={"micro_batch_size": 4, "grad_accum_steps": 2}, schedule={"warmup_steps": 1},
                          parallel={"pp": 2, "sharding": "fsdp"}, measure={"trackers": (), "timing_warmup_steps": 1})
        result = lab.train_on_cluster(rc, pp2, staged=staged, timeout=300)
        assert (result["dp"], result["pp"], result["world_size"], result["steps"]) == (2, 2, 4, 3)
        assert 0 < result["pipeline_bubble"] < 1 and result["final_loss"] < result["initial_loss"] + 1
        assert (tmp_path / "pp2-dp2" / "checkpoints" / "step-3" / ".metadata").is_file()

        old_ids = rc.ids
        new_ids = C.restart_engines(cl, timeout=180)
        assert len(new_ids) == 4 and rc.ids == new_ids and not set(new_ids) & set(old_ids)
        jobs = slurm.jobs()
        assert len(jobs) == 1 and jobs[0]["job_id"] != first_job and jobs[0]["state"] == "RUNNING"
        assert sorted((i["node"], i["local_id"]) for i in C.engine_info(rc)) == [
            ("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]
        assert C.run_ddp(rc, _allreduce_ranks, timeout=120, stream=False)[3] == (3, 4, 10.0, "n2", 1)
    finally:
        C.stop_cluster(cl)
    assert R.wait_for(lambda: slurm.jobs() == [] or None, 20, "squeue empty after stop_cluster") is True


def test_slurm_controller_address_needs_reachable_default(slurm, tmp_path):
    """This host's name resolves to loopback here: engines="slurm" without controller_ip or
    network_interface says in one line what to pass, before anything starts."""
    if not socket.gethostbyname(socket.gethostname()).startswith("127."):
        pytest.skip("this host's name resolves to a routable address: the default is that address")
    with pytest.raises(ValueError, match=r"pass controller_ip='<address>' or network_interface='<name>'") as ei:
        C.start_cluster(engines="slurm", slurm={"nodes": 2, "gpus_per_node": 1}, profile_dir=str(tmp_path / "p"))
    assert "\n" not in str(ei.value)
    assert slurm.jobs() == []


@pytest.fixture()
def broken_env(tmp_path):
    """A PYTHONPATH entry that breaks `python -m ipyparallel.engine` like a broken environment."""
    pkg = tmp_path / "broken" / "ipyparallel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    return str(pkg.parent)


@pytest.mark.parametrize("engines", ["local", "mpi", "slurm"])
def test_engines_that_cannot_start_fail_fast(engines, broken_env, slurm, tmp_path, say):
    """start_cluster ends with EngineStartError carrying the engines' own error text within
    seconds of their exit (the timeout is 120 s), and leaves nothing running."""
    kw = {"slurm": {"nodes": 2, "gpus_per_node": 1}, "controller_ip": "127.0.0.1"} if engines == "slurm" else {}
    t0 = time.monotonic()
    with pytest.raises(C.EngineStartError) as ei:
        C.start_cluster(2, engines=engines, env={"PYTHONPATH": broken_env}, timeout=120,
                        profile_dir=str(tmp_path / "profile"), **kw)
    seconds = time.monotonic() - t0
    say(f"\n[{engines} engines that cannot start] error after {seconds:.1f} s (timeout 120 s):\n{ei.value}")
    assert BROKEN in str(ei.value) and "ImportError" in str(ei.value)
    first = str(ei.value).splitlines()[0]
    assert first.startswith("engines failed to start: ") and {"local": "local engine", "mpi": "mpiexec exited",
                                                              "slurm": "Slurm job"}[engines] in first
    assert seconds < 60  # exit detected, not the 120 s timeout (10 s or less when the CPU is not shared)
    if engines == "slurm":
        assert R.wait_for(lambda: slurm.jobs() == [] or None, 20, "squeue empty") is True


def test_mpi_restart_engines_same_ids(tmp_path):
    """Engines started with --mpi register with their MPI rank as id; after restart_engines the
    new engines have the same ids, and are told apart from the old ones by registration."""
    cl = C.start_cluster(2, engines="mpi", profile_dir=str(tmp_path / "profile"), timeout=120,
                         env={"PYTHONPATH": TESTS})
    try:
        rc = C.get_client(cl)
        pids = sorted(i["pid"] for i in C.engine_info(rc))
        old_uuids = set(C.registered(rc).values())
        assert rc.ids == [0, 1]
        assert C.restart_engines(cl, timeout=120) == [0, 1]
        assert rc.ids == [0, 1] and not set(C.registered(rc).values()) & old_uuids
        assert not set(pids) & {i["pid"] for i in C.engine_info(rc)}
        assert sorted(C.run_ddp(rc, _allreduce_ranks, timeout=120, stream=False)) == [
            (0, 2, 3.0, socket.gethostname(), 0), (1, 2, 3.0, socket.gethostname(), 1)]
    finally:
        C.stop_cluster(cl)


def test_stop_leaves_no_daemons(tmp_path):
    """Slurm.stop ends the daemons and the jobs' processes by pid, even with a job running."""
    s = R.Slurm(tmp_path / "s2", nodes=1, gpus_per_node=1, ctld_port=6827, node_port=17011)
    s.start()
    try:
        job = subprocess.run(["sbatch", "--wrap", "sleep 300", "-o", str(tmp_path / "out")], capture_output=True,
                             text=True, env={**os.environ, **s.env})
        assert job.returncode == 0, job.stderr
        R.wait_for(lambda: [j for j in s.jobs() if j["state"] == "RUNNING"], 30, "sleep job running")
        daemons = [int((s.dir / f).read_text()) for f in ("slurmctld.pid", "slurmd-n1.pid")]
        assert s.job_pids()  # slurmstepd and the sleep
    finally:
        s.stop()
    assert not any(R.pid_alive(p) for p in daemons) and s.job_pids() == []
