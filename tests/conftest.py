"""Shared test fixtures: process-group hygiene and small real inputs."""

from __future__ import annotations

import os

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
