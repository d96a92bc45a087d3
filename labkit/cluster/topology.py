"""Engine topology -> ranks: who each engine is, torchrun ranks from that, one call per node.

Engine ids are not ranks (they follow registration order). `engine_info` asks every engine for
its host, node name, local id, pid and GPUs; `assign_ranks` turns that into RANK, LOCAL_RANK,
NODE_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in one pure function;
`per_node` runs a call on exactly one engine per node. Re-exported by `labkit.cluster`.

Pattern: docs/references.md section E (ray Train v2 worker_group.py; dask-pytorch-ddp dispatch.py).
"""

from __future__ import annotations

from typing import Any, Callable

import ipyparallel as ipp

from labkit.env import LOCAL_ID_ENVS, NODE_ENV, SCRATCH_ENV, node_name  # noqa: F401 (re-exported)

__all__ = ["assign_ranks", "engine_info", "per_node", "set_local_roots", "set_node_names", "tensor_parallel_groups"]


def _engine_facts() -> dict:
    import os
    import socket

    from labkit.env import local_id

    local = local_id()
    host = socket.gethostname()
    addr = None
    if os.environ.get("GLOO_SOCKET_IFNAME"):  # labkit.cluster's network_interface: rank 0 is reached there
        import psutil

        ifname = os.environ["GLOO_SOCKET_IFNAME"].split(",")[0]
        addr = next((a.address for a in psutil.net_if_addrs().get(ifname, []) if a.family == socket.AF_INET), None)
    return {"hostname": host, "node": node_name(), "addr": addr,
            "local_id": None if local is None else int(local), "pid": os.getpid(),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "cpus": len(os.sched_getaffinity(0))}


def engine_info(client: ipp.Client, targets: list[int] | None = None, *, timeout: float = 60.0) -> list[dict]:
    """Ask each engine who it is: one dict per engine, sorted by engine_id.

    Keys: engine_id (int), hostname, node (env LABKIT_NODE_NAME, else hostname), addr (IPv4
    address of the interface named by env GLOO_SOCKET_IFNAME, else None), local_id (int:
    env SLURM_LOCALID / OMPI_COMM_WORLD_LOCAL_RANK / MPI_LOCALRANKID / LABKIT_LOCAL_ID, else the
    engine's order by id among engines on its host), pid, gpus (CUDA_VISIBLE_DEVICES or None),
    cpus (usable CPU cores). Raises TimeoutError if an engine does not answer within `timeout` s.
    """
    ids = sorted(client.ids if targets is None else targets)
    if not ids:
        raise ValueError("the client has no engines")
    facts = client[ids].apply_async(_engine_facts).get(timeout=timeout)
    infos = [{"engine_id": eid, **f} for eid, f in zip(ids, facts)]
    for host in {i["hostname"] for i in infos}:
        on_host = [i for i in infos if i["hostname"] == host]
        for order, i in enumerate(on_host):
            if i["local_id"] is None:
                i["local_id"] = order
    return infos


def assign_ranks(infos: list[dict], *, master_port: int) -> dict[int, dict[str, str]]:
    """Map engine_id -> torchrun environment (all values str), a pure function of the topology.

    Nodes are sorted by name (NODE_RANK = position); within a node engines are sorted by
    (local_id, engine_id) (LOCAL_RANK = position); RANK counts through nodes in order.
    MASTER_ADDR is 127.0.0.1 when every engine shares one hostname, else rank 0's "addr" (its
    network interface's address, see engine_info) if known, else its hostname.
    Raises ValueError for an empty list, duplicate engine ids or a port outside 1..65535.
    """
    if not infos:
        raise ValueError("infos is empty: no engines to assign ranks to")
    if len({i["engine_id"] for i in infos}) != len(infos):
        raise ValueError("infos has duplicate engine_id values")
    if not 0 < int(master_port) < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {master_port}")
    nodes = sorted({i["node"] for i in infos})
    by_node = {nd: sorted((i for i in infos if i["node"] == nd),
                          key=lambda i: (i["local_id"], i["engine_id"])) for nd in nodes}
    ordered = [i for nd in nodes for i in by_node[nd]]
    single_host = len({i["hostname"] for i in infos}) == 1
    master = "127.0.0.1" if single_host else ordered[0].get("addr") or ordered[0]["hostname"]
    env = {}
    for rank, info in enumerate(ordered):
        members = by_node[info["node"]]
        env[info["engine_id"]] = {
            "RANK": str(rank), "LOCAL_RANK": str(members.index(info)),
            "NODE_RANK": str(nodes.index(info["node"])), "WORLD_SIZE": str(len(ordered)),
            "LOCAL_WORLD_SIZE": str(len(members)), "MASTER_ADDR": master,
            "MASTER_PORT": str(int(master_port))}
    return env


def _set_env(values: dict) -> None:
    import os

    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def set_node_names(client: ipp.Client, names: dict[int, str | None], *, timeout: float = 30.0) -> None:
    """Set (or with None, clear) env LABKIT_NODE_NAME on engines: {engine_id: node name}."""
    ars = [client[eid].apply_async(_set_env, {NODE_ENV: name}) for eid, name in names.items()]
    for ar in ars:
        ar.get(timeout=timeout)


def set_local_roots(client: ipp.Client, roots: dict[int, str | None], *, timeout: float = 30.0) -> None:
    """Set (or with None, clear) env ``LABKIT_LOCAL_SCRATCH`` on engines: {engine_id: directory}.
    With ``set_node_names`` this makes engines on one machine act as separate nodes with
    separate local disks (tests, the laptop demo)."""
    ars = [client[eid].apply_async(_set_env, {SCRATCH_ENV: root}) for eid, root in roots.items()]
    for ar in ars:
        ar.get(timeout=timeout)


def per_node(client: ipp.Client, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> dict[str, Any]:
    """Run fn(*args, **kwargs) once per node, on its first local engine; {node: result}.

    All calls are submitted before any is awaited; `timeout` (seconds, None = no limit) bounds
    each wait. Engine errors propagate (ipyparallel RemoteError with the engine's traceback).
    """
    infos = engine_info(client)
    first = {}
    for i in sorted(infos, key=lambda i: (i["local_id"], i["engine_id"])):
        first.setdefault(i["node"], i["engine_id"])
    ars = {node: client[eid].apply_async(fn, *args, **kwargs) for node, eid in sorted(first.items())}
    return {node: ar.get(timeout=timeout) for node, ar in ars.items()}


def tensor_parallel_groups(infos: list[dict], tp: int) -> list[list[int]]:
    """The tensor-parallel groups of a run on these engines, as engine ids: ranks k·tp .. k·tp + tp - 1
    of ``assign_ranks``'s order (``labkit.train.parallel``'s mesh puts tp innermost), which must each
    sit on one node, since every layer all-reduces within its group twice per micro-batch.
    Raises ValueError naming the first group that spans nodes and the engines per node."""
    env = assign_ranks(infos, master_port=1)
    order = sorted(env, key=lambda e: int(env[e]["RANK"]))
    node = {i["engine_id"]: i["node"] for i in infos}
    groups = [order[k:k + tp] for k in range(0, len(order), tp)]
    for k, group in enumerate(groups):
        nodes = sorted({node[e] for e in group})
        if len(nodes) > 1:
            counts = {nd: sum(1 for i in infos if i["node"] == nd) for nd in sorted(set(node.values()))}
            raise ValueError(f"tp: the tensor-parallel group of ranks {k * tp}-{k * tp + len(group) - 1} spans nodes "
                             f"{nodes}; tp {tp} must divide every node's engine count {counts}")
    return groups
