"""labkit.cluster.engine_watch without a cluster: new engines are told apart by registration uuid (MPI
engines come back with the same ids), srun's task-exit line ends the wait with the job's
output, and a plain timeout says how many engines came."""

from __future__ import annotations

import threading
import time
import types

import pytest

from labkit.cluster import engine_watch as W


class FakeClient:
    """The two things engine_watch reads from an ipyparallel Client: `ids` and `_engines`."""

    def __init__(self, engines: dict[int, str]):
        self._engines = dict(engines)

    @property
    def ids(self):
        return sorted(self._engines)


def test_restarted_engines_with_the_same_ids_are_new(tmp_path):
    client = FakeClient({0: "old-a", 1: "old-b"})
    cluster = types.SimpleNamespace(engines={}, profile_dir=str(tmp_path))

    def mpi_restart():  # the old engines leave, the new ones ask for ids 0 and 1 again
        time.sleep(0.3)
        client._engines = {}
        time.sleep(0.3)
        client._engines = {0: "new-a"}
        time.sleep(0.3)
        client._engines = {0: "new-a", 1: "new-b"}

    t = threading.Thread(target=mpi_restart)
    t.start()
    try:
        assert W.wait_for_engines(cluster, client, 2, timeout=30, exclude_uuids={"old-a", "old-b"}) == [0, 1]
        assert W.registered(client) == {0: "new-a", 1: "new-b"}
    finally:
        t.join()
    with pytest.raises(TimeoutError, match=r"^0 of 2 engines registered within 0.5 s \(engine logs: "):
        W.wait_for_engines(cluster, client, 2, timeout=0.5, exclude_uuids={"new-a", "new-b"})


def test_srun_task_exit_ends_the_wait_with_the_job_output(tmp_path):
    out = tmp_path / "ipengine.log"
    out.write_text("Traceback (most recent call last):\nImportError: no module named torch\n"
                   "srun: error: n2: task 1: Exited with exit code 1\n")
    launcher = types.SimpleNamespace(job_id="42", output_file=str(out))
    cluster = types.SimpleNamespace(engines={"1": launcher}, profile_dir=str(tmp_path))
    with pytest.raises(W.EngineStartError) as ei:
        W.wait_for_engines(cluster, FakeClient({}), 2, timeout=30, job_poll=3600)
    first, rest = str(ei.value).split("\n", 1)
    assert first == (f"engines failed to start: Slurm job 42: srun task 1 on n2 exited with code 1 before "
                     f"registering; the job's output ({out}):")
    assert "ImportError: no module named torch" in rest and "ImportError" in ei.value.output
    # a job still queued (no output yet) is not a failure
    assert W.startup_failure(types.SimpleNamespace(job_id="43", output_file=str(tmp_path / "none")),
                             check_job=False) is None


KERNEL_LOG = """\
[  812.301100] python3 invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0
[  812.301377] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,task_memcg=/user.slice,task=python3,pid=4242,uid=0
[  812.301390] Out of memory: Killed process 4242 (python3) total-vm:25012344kB, anon-rss:23871200kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:46912kB oom_score_adj:0
[  900.000001] Memory cgroup out of memory: Killed process 777 (ipengine) total-vm:901234kB, anon-rss:880000kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:2000kB oom_score_adj:0
"""
"""Lines in the kernel's own formats (mm/oom_kill.c: dump_oom_summary and __oom_kill_process)."""


def test_kernel_oom_lines_are_found_by_pid():
    assert W.kernel_oom_kill(4242, KERNEL_LOG).startswith("[  812.301390] Out of memory: Killed process 4242 (python3)")
    assert "Memory cgroup out of memory: Killed process 777" in W.kernel_oom_kill(777, KERNEL_LOG)
    assert W.kernel_oom_kill(42, KERNEL_LOG) is None and W.kernel_oom_kill(424, KERNEL_LOG) is None


class _Cluster:
    """What exit_status reads of an ipyparallel Cluster: engine sets with launchers holding a psutil.Process."""

    def __init__(self, pid: int):
        import psutil

        self.engines = {"set": types.SimpleNamespace(launchers={0: types.SimpleNamespace(process=psutil.Process(pid))})}


def test_death_cause_names_the_signal_and_the_kernels_oom_word(monkeypatch):
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    cluster = _Cluster(child.pid)
    W.track(cluster)
    try:
        assert W.exit_status(child.pid) is None  # still running
        child.send_signal(signal.SIGKILL)
        cluster.engines["set"].launchers[0].process.wait(10)  # reaped as ipyparallel's launcher thread does
        assert W.exit_status(child.pid) == -signal.SIGKILL
        monkeypatch.setattr(W, "kernel_oom_kill", lambda pid, log=None: None)
        assert W.death_cause(child.pid) == "killed by signal 9 (SIGKILL)"  # not called out of memory without the kernel
        monkeypatch.setattr(W, "kernel_oom_kill", lambda pid, log=None: f"Out of memory: Killed process {pid} (python3)")
        assert W.death_cause(child.pid) == (f"killed by signal 9 (SIGKILL); probably out of memory: "
                                            f"Out of memory: Killed process {child.pid} (python3)")
        monkeypatch.setattr(W, "kernel_oom_kill", lambda pid, log=None: None)
        monkeypatch.setattr(W, "oom_kills", lambda: 3)
        assert W.death_cause(child.pid, oom_kills_before=2).endswith("the memory cgroup's oom_kill count went from 2 to 3")
        assert "not visible from here" in W.death_cause(child.pid, local=False)
    finally:
        child.kill()
        child.wait()
