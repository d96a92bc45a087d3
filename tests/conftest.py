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
