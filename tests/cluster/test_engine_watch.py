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
