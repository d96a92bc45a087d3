"""A spawned test process as one rank of a gloo process group on this host, for tests that run
several ``labkit.train.train`` calls in one group (each train() reuses it): ``free_port`` for
MASTER_PORT, ``gloo_group`` around the rank's work."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound to port 0, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int) -> Iterator[None]:
    """This process as rank ``rank`` of a ``world``-rank gloo group: one torch thread, the
    torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR 127.0.0.1, MASTER_PORT
    ``port``, GLOO_SOCKET_IFNAME lo) and torch's default process group, destroyed when the block
    ends, however it ends."""
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    tdist.init_process_group("gloo")
    try:
        yield
    finally:
        tdist.destroy_process_group()
