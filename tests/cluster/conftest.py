"""Fixtures of the cluster tests: a real local ipyparallel cluster of 2 engines per test module."""

from __future__ import annotations

import os
import pathlib

import pytest

from labkit import cluster as C

HERE = pathlib.Path(__file__).resolve().parent
TESTS = os.pathsep.join([str(HERE), str(HERE.parent)])  # engines import the test modules and tests/ helpers


@pytest.fixture(scope="module")
def cluster():
    """2 local engines (labkit.cluster.start_cluster) shared by one test module, stopped after it."""
    cl = C.start_cluster(2, env={"PYTHONPATH": TESTS})
    try:
        yield cl
    finally:
        C.stop_cluster(cl)
