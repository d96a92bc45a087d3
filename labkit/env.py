"""The environment variables labkit reads to know where a process runs, defined once.

- ``LABKIT_NODE_NAME``: the node this process is on (default: the hostname). Set per engine by
  ``labkit.cluster.set_node_names`` to simulate several nodes on one machine, and by the Slurm
  task prolog of docs/slurm.md where virtual nodes share a hostname.
- ``SLURM_LOCALID`` / ``OMPI_COMM_WORLD_LOCAL_RANK`` / ``MPI_LOCALRANKID`` / ``LABKIT_LOCAL_ID``:
  the process's local id on its node (Slurm, Open MPI, MPICH, labkit's own), first set wins.
- ``LABKIT_LOCAL_SCRATCH``: the node-local directory shards are staged to (default ``$TMPDIR``
  or /tmp, then ``labkit-<user>``); ``labkit.cluster.set_local_roots`` sets it per engine.
- ``LABKIT_COMMAND``: the ``labkit`` command line a run came from (set by ``labkit.cli``,
  inherited by the engines; ``labkit.train.provenance`` records it).
"""

from __future__ import annotations

import os
import socket

__all__ = ["COMMAND_ENV", "LOCAL_ID_ENVS", "NODE_ENV", "SCRATCH_ENV", "local_id", "node_name"]

NODE_ENV = "LABKIT_NODE_NAME"
"""Engine env var overriding the node name (tests simulate several nodes on one host)."""
LOCAL_ID_ENVS = ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "LABKIT_LOCAL_ID")
"""Engine env vars giving the engine's local id on its node (Slurm, Open MPI, MPICH), first set wins."""
SCRATCH_ENV = "LABKIT_LOCAL_SCRATCH"
"""Env var naming the node-local scratch directory that shards are staged to."""
COMMAND_ENV = "LABKIT_COMMAND"
"""Env var holding the ``labkit`` command line of a run (its provenance's command)."""


def node_name() -> str:
    """This process's node: env ``LABKIT_NODE_NAME``, else the hostname. The one place the rule is written."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def local_id() -> int | None:
    """This process's local id on its node from the first of ``LOCAL_ID_ENVS`` that is set, else None."""
    value = next((os.environ[k] for k in LOCAL_ID_ENVS if k in os.environ), None)
    return None if value is None else int(value)
