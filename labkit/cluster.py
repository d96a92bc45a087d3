"""ipyparallel clusters: start/stop, topology -> ranks, per-node calls, DDP launch, live metrics.

Engine ids are not ranks (they follow registration order). `engine_info` asks every engine for
its host, node name, local id and GPUs; `assign_ranks` turns that into the torchrun environment
(RANK, LOCAL_RANK, NODE_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) in one pure
function; `run_ddp` sets that environment on each engine, runs the function on all ranks at once
and streams rank 0's recent metric records back through ipyparallel's `publish_data`
(which keeps only the latest value per key, so rank 0 publishes a bounded history).

Patterns: /work/shared/REFERENCES.md section E (ipyparallel; DDP in persistent engines).
"""

from __future__ import annotations

import inspect
import os
import pathlib
import signal
import socket
import time
import warnings
from collections import deque
from typing import Any, Callable

import ipyparallel as ipp
from ipyparallel import error as ipp_error

NODE_ENV = "LABKIT_NODE_NAME"
"""Engine env var overriding the node name (tests simulate several nodes on one host)."""
LOCAL_ID_ENVS = ("SLURM_LOCALID", "LABKIT_LOCAL_ID")
"""Engine env vars giving the engine's local id on its node, first one set wins."""


class DDPError(RuntimeError):
    """A rank of a `run_ddp` call failed, died or timed out; the message names the rank."""


# ---------------------------------------------------------------- cluster lifecycle


def start_cluster(
    n: int = 2,
    *,
    engines: str = "local",
    profile: str | None = None,
    controller_ip: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    **kw: Any,
) -> ipp.Cluster:
    """Start a controller and `n` engines with ipyparallel's own launchers, and connect.

    `engines` is an ipyparallel launcher name ("local", "slurm", "mpi", "ssh"). The controller
    listens on `controller_ip` (127.0.0.1: reachable from this machine only); "*" or "0.0.0.0"
    exposes it to the network and warns. `env` is extra environment for the engines; the
    directory holding this `labkit` package is prepended to their PYTHONPATH so engines import
    the same code as the caller. Other keywords go to `ipyparallel.Cluster`.
    The connected client is `get_client(cluster)`. Raises ValueError for n < 1 and
    TimeoutError when the engines have not registered within `timeout` seconds (the cluster
    is stopped first).
    """
    if controller_ip in ("*", "0.0.0.0"):
        warnings.warn(
            f"controller_ip={controller_ip!r} listens on all interfaces; anyone who can reach "
            "this machine can connect to the controller", stacklevel=2)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    engine_env = dict(env or {})
    paths = [str(pathlib.Path(__file__).resolve().parent.parent)]
    paths += [p for p in (engine_env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")) if p]
    engine_env["PYTHONPATH"] = os.pathsep.join(paths)
    if profile is not None:
        kw["profile"] = profile
    cluster = ipp.Cluster(n=n, engines=engines, controller_ip=controller_ip, **kw)
    try:
        cluster.start_controller_sync()
        cluster.start_engines_sync(n, environment=engine_env)
        client = cluster.connect_client_sync()
        cluster._labkit_client = client
        client.wait_for_engines(n, timeout=timeout, interactive=False)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def get_client(cluster: ipp.Cluster) -> ipp.Client:
    """The client `start_cluster` connected (or a new one for a cluster started elsewhere)."""
    client = getattr(cluster, "_labkit_client", None)
    if client is None:
        client = cluster._labkit_client = cluster.connect_client_sync()
    return client


def stop_cluster(cluster: ipp.Cluster) -> None:
    """Close the client and stop engines and controller; safe to call twice."""
    client = getattr(cluster, "_labkit_client", None)
    if client is not None:
        client.close()
        cluster._labkit_client = None
    cluster.stop_cluster_sync()


# ---------------------------------------------------------------- topology


def _engine_facts() -> dict:
    import os
    import socket

    local = next((os.environ[k] for k in ("SLURM_LOCALID", "LABKIT_LOCAL_ID") if k in os.environ), None)
    host = socket.gethostname()
    return {"hostname": host, "node": os.environ.get("LABKIT_NODE_NAME") or host,
            "local_id": None if local is None else int(local), "pid": os.getpid(),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "cpus": len(os.sched_getaffinity(0))}


def engine_info(client: ipp.Client, targets: list[int] | None = None, *, timeout: float = 60.0) -> list[dict]:
    """Ask each engine who it is: one dict per engine, sorted by engine_id.

    Keys: engine_id (int), hostname, node (env LABKIT_NODE_NAME, else hostname), local_id (int:
    env SLURM_LOCALID / LABKIT_LOCAL_ID, else the engine's order by id among engines on its
    host), pid, gpus (CUDA_VISIBLE_DEVICES or None), cpus (usable CPU cores).
    Raises TimeoutError if an engine does not answer within `timeout` seconds.
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
    MASTER_ADDR is 127.0.0.1 when every engine shares one hostname, else rank 0's hostname.
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
    master = "127.0.0.1" if single_host else ordered[0]["hostname"]
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


# ---------------------------------------------------------------- DDP


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _Publisher:
    """Rank 0's sink: keeps the last `history` records, publishes them at most every `interval` s."""

    def __init__(self, history: int, interval: float = 0.5):
        self.records: deque = deque(maxlen=history)
        self.interval = interval
        self._last = 0.0

    def __call__(self, record: dict) -> None:
        self.records.append(dict(record))
        if time.monotonic() - self._last >= self.interval:
            self.flush()

    def flush(self) -> None:
        from ipyparallel.datapub import publish_data

        publish_data({"records": list(self.records)})
        self._last = time.monotonic()


def _ddp_entry(fn: Callable, env: dict, args: tuple, kwargs: dict, history: int) -> Any:
    """Engine side of `run_ddp`: set env, build rank 0's sink, call fn, always tear down."""
    import os

    import torch
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    sink = _Publisher(history) if env["RANK"] == "0" else None
    try:
        if "sink" in inspect.signature(fn).parameters:
            kwargs = {**kwargs, "sink": sink}
        return fn(*args, **kwargs)
    finally:
        if sink is not None and sink.records:
            sink.flush()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        _set_env(saved)


def _remote_text(err: BaseException) -> str:
    if isinstance(err, ipp_error.CompositeError):
        return "\n".join(_remote_text(e) for e in err.elements) if hasattr(err, "elements") else str(err)
    if isinstance(err, ipp_error.RemoteError):
        return f"{err.ename}: {err.evalue}\n{err.traceback or ''}"
    return f"{type(err).__name__}: {err}"


def run_ddp(
    client: ipp.Client,
    fn: Callable,
    *args: Any,
    targets: list[int] | None = None,
    live: Callable[[list[dict]], None] | None = None,
    timeout: float | None = None,
    history: int = 500,
    poll: float = 1.0,
    **kwargs: Any,
) -> list[Any]:
    """Run fn(*args, **kwargs) on every target engine as one torch.distributed job; results by rank.

    Each engine gets the `assign_ranks` environment with a fresh MASTER_PORT (bound to port 0 on
    rank 0's engine), OMP/POLARS_MAX/RAYON_NUM_THREADS = its host's usable cores // engines on
    that host (torch.set_num_threads too; polars and rayon read theirs only at first import),
    TOKENIZERS_PARALLELISM=false, and on a single host MASTER_ADDR=127.0.0.1 and
    GLOO_SOCKET_IFNAME=lo; the environment is restored afterwards. fn initialises the process
    group itself (as `labkit.train.train` does from the env); it is destroyed on every rank after
    fn returns or raises. If fn has a `sink` parameter it receives, on rank 0, a callable that
    keeps the last `history` records and publishes them (ipyparallel publish_data, key
    "records"); other ranks get sink=None. While waiting, `live(records)` is called with rank 0's
    published records about every `poll` seconds when they change, once more at the end, then
    `live.flush()` if it has one.
    Raises DDPError naming the rank (with the engine's traceback text) when a rank fails, when
    its engine disappears (unregistered, or its process is gone on this host), or, naming the
    unfinished ranks, after `timeout` seconds. After such an error other ranks may still be
    blocked in a collective: restart the engines (cluster.restart_engines_sync()).
    """
    infos = engine_info(client, targets)
    by_id = {i["engine_id"]: i for i in infos}
    rank0 = next(e for e, v in assign_ranks(infos, master_port=1).items() if v["RANK"] == "0")
    port = client[rank0].apply_async(_free_port).get(timeout=30)
    envs = assign_ranks(infos, master_port=port)
    hosts = [i["hostname"] for i in infos]
    single_host = len(set(hosts)) == 1
    for eid, env in envs.items():
        threads = str(max(1, by_id[eid]["cpus"] // hosts.count(by_id[eid]["hostname"])))
        env.update(OMP_NUM_THREADS=threads, POLARS_MAX_THREADS=threads, RAYON_NUM_THREADS=threads,
                   TOKENIZERS_PARALLELISM="false")
        if single_host:
            env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    rank_of = {eid: int(env["RANK"]) for eid, env in envs.items()}
    ars = {rank_of[eid]: client[eid].apply_async(_ddp_entry, fn, env, args, kwargs, history)
           for eid, env in envs.items()}  # all submitted before any wait: init blocks until all join
    engine_of = {r: eid for eid, r in rank_of.items()}
    here = socket.gethostname()

    def who(r: int) -> str:
        i = by_id[engine_of[r]]
        return f"rank {r} (engine {i['engine_id']}, node {i['node']}, pid {i['pid']})"

    deadline = None if timeout is None else time.monotonic() + timeout
    shown = None
    pending = set(ars)
    try:
        while pending:
            ars[min(pending)].wait(poll)
            for r in sorted(pending):
                if ars[r].ready():
                    pending.discard(r)
                    try:
                        ars[r].get(0)
                    except Exception as err:
                        raise DDPError(f"{who(r)} failed:\n{_remote_text(err)}") from err
            if live is not None:
                shown = _show(live, ars[0], shown)
            for r in sorted(pending):
                info = by_id[engine_of[r]]
                gone = info["engine_id"] not in client.ids or (
                    info["hostname"] == here and not _pid_alive(info["pid"]))
                if gone:
                    raise DDPError(f"{who(r)}: engine died while running {fn.__name__}")
            if pending and deadline is not None and time.monotonic() > deadline:
                raise DDPError(f"timeout after {timeout} s: {', '.join(who(r) for r in sorted(pending))}"
                               " not finished")
    except KeyboardInterrupt:
        client.send_signal(signal.SIGINT, targets=[engine_of[r] for r in pending], block=False)
        raise
    if live is not None:
        ars[0].wait_for_output(5)
        _show(live, ars[0], shown)
        if hasattr(live, "flush"):
            live.flush()
    return [ars[r].get(0) for r in sorted(ars)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _show(live: Callable, ar: Any, shown: Any) -> Any:
    """Call live(records) if rank 0 published records different from `shown`; return the new key."""
    records = (ar.data or {}).get("records") or []
    key = (len(records), records[-1]) if records else None
    if records and key != shown:
        live(records)
        return key
    return shown
