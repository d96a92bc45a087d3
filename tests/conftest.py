"""Shared test fixtures: process-group hygiene and small real inputs; how ``make test`` runs
the suite on 2 workers (pytest-xdist, ``-n 2 --dist loadscope``) without losing a check's conditions."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import tempfile

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """Destroy any process group a test leaves behind (litgpt's conftest habit)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if os.geteuid() == 0:  # CI runs as root; Open MPI refuses root unless told (MPI engines in the tests)
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


@pytest.fixture(autouse=True)
def _torch_threads(request):
    """A module marked ``pytestmark = pytest.mark.torch_threads(n)`` runs each test with n torch
    threads; the count in force before is restored afterwards."""
    marker = request.node.get_closest_marker("torch_threads")
    if marker is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(marker.args[0])
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """One ``labkit demo`` on a tiny real corpus (tests/test_demo.py's config and its smaller
    notebook parameters), notebooks 00-07 executed into reports on its engines: (work directory,
    summary). Shared by tests/test_demo.py and tests/test_notebooks.py, which check the demo's
    stages and its reports; the demo takes minutes, so it runs once per session."""
    from pathlib import Path

    from test_demo import SMALL, _config

    from labkit.demo import run_demo

    cfg = _config(tmp_path_factory.mktemp("demo"))
    summary = run_demo(cfg, parameters=SMALL)
    return Path(cfg.workdir), summary


# ---- two workers (make test: pytest -n 2 --dist loadscope) ----------------------------------------

GROUPS = {
    # the session's demo (``demo_run``), which both files check: built once, on one worker
    "demo": ("tests/test_demo.py", "tests/test_notebooks.py"),
    # the real cluster (network hosts, Slurm, munge): one per machine behind a machine-wide flock,
    # which is reentrant within a process only; on one worker, a module's hosts never wait on the other's
    "realcluster": ("tests/cluster/test_stragglers.py", "tests/cluster/test_real_hosts.py",
                    "tests/cluster/test_real_cluster.py", "tests/cluster/test_net_hosts.py",
                    "tests/cluster/test_cluster_faults.py", "tests/train/test_recovery.py"),
}
"""Files whose tests run on one worker together, in order; every other file is a unit of its own
(``--dist loadscope``: a module's fixtures are built once, on the worker that runs all its tests)."""

LONG_FIRST = ("realcluster", "demo", "tests/test_cli_walkthrough.py", "tests/train/test_parallel.py",
              "tests/cluster/test_resume.py", "tests/test_plots.py", "tests/cluster/test_ctrl_c.py",
              "tests/train/test_checkpoint.py", "tests/test_readme.py", "tests/study/test_plan.py",
              "tests/train/test_resume_matrix.py", "tests/test_cli.py", "tests/test_made_by.py")
"""The units that took longest in a serial run (its --durations, 2 idle cores), handed out first
under xdist, so that no long one is left to run alone at the end; the rest follow in file order."""


def _unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((name for name, files in GROUPS.items() if path in files), path)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """In an xdist worker: the tests of ``LONG_FIRST``'s units first (a stable sort: a file's tests
    keep their order). One process keeps pytest's order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {u: i for i, u in enumerate(LONG_FIRST)}
        items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(LONG_FIRST)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with ``GROUPS``: each group's files as one unit of work, each other
    file as one (pytest-xdist's own ``--dist loadgroup`` cannot: xdist 3.8 groups by renaming node
    ids, which pytest 9 no longer lets it do)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the units in the workers' order: LONG_FIRST's first

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return FileGroups(config, log)


@contextlib.contextmanager
def _share_of_the_machine(exclusive: bool):
    """Under pytest-xdist: a test marked ``exclusive`` (a bound on seconds, a collective timeout, a
    throttled or shaped rank measured against the others) runs with the machine to itself, as in a
    serial run: it waits until the other worker's test ends, and no test starts beside it. The
    others share it. A reader-writer flock on a file of this run, with a turnstile that a waiting
    exclusive test holds, so that the other worker cannot keep taking the shared lock before it."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:  # one process: nothing runs beside the test
        yield
        return
    base = pathlib.Path(tempfile.gettempdir(), f"labkit-pytest-{run}")
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's setup, call and teardown (the module fixtures it builds or ends too) under its
    share of the machine (``_share_of_the_machine``)."""
    with _share_of_the_machine(item.get_closest_marker("exclusive") is not None):
        return (yield)


@pytest.fixture
def say(request, capsys):
    """``say(text)``: a line of what a test measured, for the terminal, under pytest-xdist too
    (the worker sends it with the test's report; ``pytest_runtest_logreport`` prints it there)."""
    def emit(text: str) -> None:
        if os.environ.get("PYTEST_XDIST_WORKER"):
            request.node.user_properties.append(("say", text))
        else:
            with capsys.disabled():
                print(text)
    return emit


_CONFIG: list = []


def pytest_configure(config):
    _CONFIG[:] = [config]


def pytest_runtest_logreport(report):
    """In the controlling process of an xdist run: the lines the test said (``say``), once, at
    its teardown, on the terminal."""
    lines = [text for key, text in report.user_properties if key == "say"]
    if report.when != "teardown" or not lines or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    terminal = _CONFIG[0].pluginmanager.get_plugin("terminalreporter") if _CONFIG else None
    if terminal is not None:
        terminal.write_line("")
        for text in [f"{report.nodeid}:"] + [t.strip("\n") for t in lines]:
            terminal.write_line(text)
