"""labkit.cluster launchers without a batch system: the Slurm batch script rendered by
ipyparallel's SlurmEngineSetLauncher, a Slurm cluster run end to end through fake
sbatch/srun/scancel (tests/cluster/fake_slurm), the mpiexec command line, and reconnecting to a cluster
another process started."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import ipyparallel as ipp
import pytest

from labkit import cluster as C
from labkit.cluster import engines as cluster_engines
from labkit.cluster import network as cluster_network

HERE = pathlib.Path(__file__).resolve().parent
TESTS = os.pathsep.join([str(HERE), str(HERE.parent)])  # engines import this module and tests/ helpers
FAKE_SLURM = HERE / "fake_slurm"


def _engine_launcher(engines: str, settings: dict, profile_dir: pathlib.Path):
    """The engine-set launcher `Cluster.start_engines` would build, without starting it."""
    cl = ipp.Cluster(engines=engines, profile_dir=str(profile_dir), cluster_id="abc",
                     config=cluster_engines._launcher_config(settings), shutdown_atexit=False)
    return cl.engine_launcher_class(work_dir=str(profile_dir), parent=cl, log=cl.log, profile_dir=cl.profile_dir,
                                    cluster_id=cl.cluster_id, engine_set_id="7")


def test_slurm_batch_script_rendered(tmp_path):
    slurm = {"nodes": 3, "gpus_per_node": 2, "partition": "gpu-h100", "time_limit": "2:00:00",
             "account": "lab{x}", "cpus_per_task": 20, "sbatch_lines": ["#SBATCH --exclusive"],
             "setup_lines": ["module load cuda/12.4", "export NCCL_DEBUG=WARN"]}
    settings = {"engines": "slurm", "slurm": slurm, "environment": {"PYTHONPATH": "/home/u/labkit"}}
    launcher = _engine_launcher("slurm", settings, tmp_path)
    assert type(launcher).__name__ == "SlurmEngineSetLauncher"
    launcher.write_batch_script(6)
    script = pathlib.Path(launcher.batch_file).read_text()
    log = tmp_path / "log" / f"{launcher.identifier}.log"
    assert script.splitlines() == [
        "#!/bin/bash",
        "#SBATCH --export=ALL",
        "#SBATCH --job-name=ipengine-abc",
        "#SBATCH --no-requeue",  # a node failure ends the job; old engines never come back
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --gpus-per-node=2",
        f"#SBATCH --output={log}",
        "#SBATCH --cpus-per-task=20",
        "#SBATCH --partition=gpu-h100",
        "#SBATCH --time=2:00:00",
        "#SBATCH --account=lab{x}",  # braces survive ipyparallel's formatter
        "#SBATCH --exclusive",
        "module load cuda/12.4",
        "export NCCL_DEBUG=WARN",
        f"srun --kill-on-bad-exit=0 {sys.executable} -m ipyparallel.engine",
    ]
    # the engines learn the controller and profile from the exported environment
    env = launcher.get_env()
    assert env["IPP_CLUSTER_ID"] == "abc" and env["PYTHONPATH"] == "/home/u/labkit"
    assert subprocess.run(["bash", "-n", launcher.batch_file]).returncode == 0
    with pytest.raises(ValueError, match="sbatch_lines"):
        C.slurm_batch_template(nodes=1, gpus_per_node=2, sbatch_lines=["--exclusive"])
    with pytest.raises(ValueError, match="gpus_per_node"):
        C.slurm_batch_template(nodes=1, gpus_per_node=0)
    with pytest.raises(ValueError, match="nodes\\*gpus_per_node=4"):
        C.start_cluster(3, engines="slurm", slurm={"nodes": 2, "gpus_per_node": 2})


def test_mpi_engine_command_line(tmp_path):
    launcher = _engine_launcher("mpi", {"engines": "mpi", "mpi_args": ["--bind-to", "none"]}, tmp_path)
    launcher.n = 4
    # Open MPI passes only OMPI_* variables to other hosts: labkit exports the engines' own
    exports = ["-x", "IPP_CLUSTER_ID", "-x", "IPP_PROFILE_DIR"] if cluster_network.mpi_exports({}) else []
    assert launcher.args == ["mpiexec", "-n", "4", "--bind-to", "none", *exports, sys.executable, "-m",
                             "ipyparallel.engine", "--mpi"]
    if shutil.which("mpiexec") and "Open MPI" in subprocess.run(["mpiexec", "--version"], capture_output=True,
                                                               text=True).stdout:
        assert cluster_network.mpi_exports({"PYTHONPATH": "/x"}) == ["-x", "IPP_CLUSTER_ID", "-x", "IPP_PROFILE_DIR",
                                                        "-x", "PYTHONPATH"]


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no MPI runtime (mpiexec) on this machine")
def test_mpi_cluster_runs():  # pragma: no cover - needs mpiexec and mpi4py
    pytest.importorskip("mpi4py")
    cl = C.start_cluster(2, engines="mpi")
    try:
        infos = C.engine_info(C.get_client(cl))
        assert sorted(i["local_id"] for i in infos) == [0, 1]
    finally:
        C.stop_cluster(cl)


def _slurm_ids():
    import os

    return os.environ["SLURM_LOCALID"], os.environ["SLURM_NODEID"]


def test_slurm_cluster_through_fake_sbatch(tmp_path, monkeypatch):
    """ipyparallel's Slurm launcher submits labkit's script; the fake srun starts one engine per
    task on two simulated nodes; ranks follow the nodes; stop_cluster scancels the job."""
    monkeypatch.setenv("PATH", f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(tmp_path))
    cl = C.start_cluster(engines="slurm", slurm={"nodes": 2, "gpus_per_node": 1, "partition": "debug"},
                         controller_ip="127.0.0.1", profile_dir=str(tmp_path / "profile"), timeout=90,
                         env={"PYTHONPATH": TESTS})
    try:
        rc = C.get_client(cl)
        infos = C.engine_info(rc)
        assert sorted((i["node"], i["local_id"]) for i in infos) == [("fake-node-0", 0), ("fake-node-1", 0)]
        submitted = (tmp_path / "submitted.sbatch").read_text()
        assert pathlib.Path(cl.profile_dir, "log", f"slurm-engines-{cl.cluster_id}.sbatch").read_text() == submitted
        assert "#SBATCH --export=ALL" in submitted and "#SBATCH --partition=debug" in submitted
        by_node = {i["node"]: i["engine_id"] for i in infos}
        env = C.assign_ranks(infos, master_port=29500)  # what run_ddp sets (DDP itself: tests/cluster/test_engines.py)
        assert [(env[by_node[f"fake-node-{k}"]]["RANK"], env[by_node[f"fake-node-{k}"]]["NODE_RANK"],
                 env[by_node[f"fake-node-{k}"]]["LOCAL_RANK"]) for k in (0, 1)] == [("0", "0", "0"), ("1", "1", "0")]
        assert sorted(rc[:].apply_sync(_slurm_ids)) == [("0", "0"), ("0", "1")]  # (SLURM_LOCALID, SLURM_NODEID)
        pids = [i["pid"] for i in infos]
    finally:
        C.stop_cluster(cl)
    assert (tmp_path / "scancel.log").read_text().split() == ["4242"]
    assert _all_gone(pids)


def _all_gone(pids, wait=30.0):
    end = time.monotonic() + wait
    while time.monotonic() < end:
        if not any(_pid_alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of this process counts as gone
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


START_AND_LEAVE = """
import json, sys
sys.path.insert(0, {root!r})
from labkit import cluster as C
cl = C.start_cluster(1, profile_dir={pd!r}, keep_running=True, env={{"PYTHONPATH": {tests!r}}})
infos = C.engine_info(C.get_client(cl))
print(json.dumps({{"cluster_id": cl.cluster_id, "pids": [i["pid"] for i in infos]}}))
"""


def test_reconnect_to_cluster_started_by_another_process(tmp_path):
    pd = str(tmp_path / "profile")
    out = subprocess.run([sys.executable, "-c", START_AND_LEAVE.format(root=str(HERE.parents[1]), pd=pd, tests=TESTS)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    started = json.loads(out.stdout.strip().splitlines()[-1])
    cid = started["cluster_id"]
    listed = C.list_clusters(profile_dir=pd)
    assert [(c["cluster_id"], c["engines"], c["n"]) for c in listed] == [(cid, "local", 1)]
    controller_pid = listed[0]["controller_pid"]
    with pytest.raises(FileNotFoundError, match=cid):
        C.connect_cluster("no-such-id", profile_dir=pd)
    cl = C.connect_cluster(cid, profile_dir=pd, timeout=60)
    try:
        rc = C.get_client(cl)
        assert [i["pid"] for i in C.engine_info(rc)] == started["pids"]  # the same engine process
        assert rc[:].apply_sync(lambda: 6 * 7) == [42]
        sec = pathlib.Path(pd, "security")
        assert {p.name: p.stat().st_mode & 0o777 for p in sec.iterdir()} == {
            f"cluster-{cid}.json": 0o600, f"labkit-{cid}.json": 0o600,
            f"ipcontroller-{cid}-client.json": 0o600, f"ipcontroller-{cid}-engine.json": 0o600}
    finally:
        C.stop_cluster(cl)
    assert _all_gone(started["pids"] + [controller_pid])
    assert C.list_clusters(profile_dir=pd) == []
    assert not list(pathlib.Path(pd, "security").glob(f"*{cid}*"))  # labkit's settings file too
