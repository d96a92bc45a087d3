"""ipyparallel clusters: start (local, Slurm, MPI), reconnect, restart, stop, logs, and blocking
calls that Ctrl-C interrupts (``call``, ``wait_results``).

Clusters are started with ipyparallel's own launchers: local engines, `SlurmEngineSetLauncher`
with a labkit `batch_template` (one engine per GPU on each node, `#SBATCH --export=ALL` kept,
ipyparallel issue #243), or `MPIEngineSetLauncher`. The launcher settings are a traitlets Config
rebuilt from a small settings file `security/labkit-<cluster_id>.json` that sits beside
ipyparallel's own cluster file `security/cluster-<cluster_id>.json`, so a notebook can reconnect
to a running cluster (`connect_cluster`) and restarts keep the engines' environment.

Topology (`engine_info`, `assign_ranks`, `per_node`, `set_node_names`) is in
`labkit.cluster.topology`, the DDP launch (`run_ddp`, `DDPError`) in `labkit.cluster.launch`,
training runs that restart or go on elastic (`train_on_cluster`, `run_ddp_resumable`) in
`labkit.cluster.resumable`, the progress bar (`StepProgress`, `progress_bar`) in
`labkit.cluster.progress`; `labkit.cluster` re-exports their names.

Patterns: docs/references.md section E (ipyparallel; DDP in persistent engines).
"""

from __future__ import annotations

import contextlib
import json
from concurrent import futures
import os
import pathlib
import signal
import socket
import stat
import time
import warnings
from typing import Any

import ipyparallel as ipp

from labkit.cluster.engine_watch import (EngineStartError, forget_engines, registered,  # noqa: F401 (re-exported)
                                         track, wait_for_engines, wait_unregistered)
from labkit.cluster.network import default_controller_ip, mpi_exports
from labkit.io import atomic_write_json

__all__ = [
    "ENGINE_KINDS", "STALE_ENGINE_WAIT_S", "connect_cluster", "engine_logs", "get_client", "list_clusters",
    "registration_timeouts",
    "restart_engines", "secure_connection_files", "slurm_batch_template", "start_cluster", "stop_cluster", "call",
    "interrupt_tasks", "wait_results"
]

ENGINE_KINDS = ("local", "slurm", "mpi")
STALE_ENGINE_WAIT_S = 10.0
"""restart_engines waits up to this long for killed engines to unregister themselves; those
still registered then (their node is unreachable) are unregistered by labkit."""
_LAUNCHERS = {"local": "LocalEngineSetLauncher", "slurm": "SlurmEngineSetLauncher", "mpi": "MPIEngineSetLauncher"}


def registration_timeouts(n: int) -> dict[str, int]:
    """ipyparallel's registration timeouts for ``n`` engines, in seconds: ``IPEngine.timeout``, how
    long an engine waits for the controller's reply to its registration request (ipyparallel's
    default 5 s), and ``IPController.registration_timeout``, how long the controller waits for an
    engine to finish registering (default 30 s). The controller answers registrations one after
    the other, so a crowd of engines starting at once waits in line: ipyparallel#301 (200 engines
    on PBS, "almost certainly timeouts during registration"), #700 (half of 1000 engines never
    finished registering). labkit scales both with n: max(10, n / 4) and max(30, n / 2) (64
    engines: 16 s and 32 s; 1000: 250 s and 500 s). benchmarks/bench_control_plane.py measures 64."""
    return {"engine": int(max(10, n / 4)), "controller": int(max(30, n / 2))}


INTERRUPT_WAIT_S = 10.0
"""After Ctrl-C, ``wait_results`` waits up to this long for the interrupted engines' tasks to end."""


# ---------------------------------------------------------------- blocking calls Ctrl-C interrupts


def interrupt_tasks(ars: list) -> None:
    """Stop the work of ipyparallel AsyncResults ``ars`` that are not done: queued tasks are
    aborted (``Client.abort``), and the engines running them get SIGINT (``Client.send_signal``,
    through each engine's nanny), so a Python task raises KeyboardInterrupt there. The engines
    of a direct view's tasks are known (``AsyncResult._targets``); a load-balanced task's engine
    is not, so every engine of the client gets SIGINT (an idle engine ignores it). Then waits up
    to ``INTERRUPT_WAIT_S`` for the tasks to end. Errors of the cluster are suppressed: the
    caller is already handling an interrupt."""
    pending = [ar for ar in ars if not ar.ready()]
    if not pending:
        return
    client = pending[0]._client
    targets: set[int] = set()
    for ar in pending:
        known = ar._targets if isinstance(ar._targets, (list, tuple)) else [ar._targets]
        if any(t is None for t in known) or not known:
            targets.update(client.ids)
        else:
            targets.update(t for t in known if isinstance(t, int))
        with contextlib.suppress(Exception):
            ar.abort()
    with contextlib.suppress(Exception):
        client.send_signal(signal.SIGINT, targets=sorted(t for t in targets if t in client.ids), block=False)
    with contextlib.suppress(Exception):
        futures.wait(pending, timeout=INTERRUPT_WAIT_S)


def wait_results(ars: list, *, poll: float = 1.0) -> list:
    """The results of ipyparallel AsyncResults ``ars`` (``concurrent.futures.Future``s), in order,
    waiting so that Ctrl-C is never lost: ipyparallel's blocking ``apply_sync`` catches
    KeyboardInterrupt and returns the AsyncResult instead (ipyparallel/client/view.py,
    ``_really_apply``), here a KeyboardInterrupt stops the engines' work (``interrupt_tasks``)
    and is raised again. The first engine error is raised when its task ends
    (``ipyparallel.error.RemoteError``)."""
    pending = set(ars)
    try:
        while pending:  # wakes at least every ``poll`` s, so the signal's KeyboardInterrupt lands here
            done, pending = futures.wait(pending, timeout=poll, return_when=futures.FIRST_COMPLETED)
            for ar in done:
                ar.get()
        return [ar.get() for ar in ars]
    except KeyboardInterrupt:
        interrupt_tasks(list(ars))
        raise


def call(view, fn, *args, **kwargs) -> Any:
    """``view.apply_sync(fn, *args, **kwargs)`` that Ctrl-C interrupts: the task is submitted with
    ``apply_async`` and waited for by ``wait_results`` (KeyboardInterrupt raised, the engine's work
    stopped). ``view``: a DirectView (``client[engine_id]``) or a LoadBalancedView. Returns fn's
    result; the engine's error is raised as ``ipyparallel.error.RemoteError``."""
    return wait_results([view.apply_async(fn, *args, **kwargs)])[0]


# ---------------------------------------------------------------- Slurm batch script


def slurm_batch_template(*, nodes: int, gpus_per_node: int, partition: str = "", time_limit: str = "",
                         account: str = "", cpus_per_task: int | None = None,
                         sbatch_lines: list[str] | tuple[str, ...] = (),
                         setup_lines: list[str] | tuple[str, ...] = ()) -> str:
    """The `SlurmEngineSetLauncher.batch_template` for one engine per GPU on each node.

    One job of `nodes` nodes with `gpus_per_node` tasks each (`--ntasks-per-node`,
    `--gpus-per-node`); `srun` starts one engine per task, so SLURM_LOCALID is each engine's
    local id and every engine sees its node's GPUs (it uses cuda:LOCAL_RANK). `#SBATCH
    --export=ALL` passes the notebook's environment (and the engines' connection info) to the
    job. `--no-requeue`: when a node fails Slurm ends the job (NODE_FAIL) instead of requeueing it,
    so engines of an old job can never come back and register beside the ones
    `restart_engines` starts. `sbatch_lines` are extra "#SBATCH ..." lines (e.g. "#SBATCH --exclusive"), `setup_lines`
    shell lines run before srun (e.g. "module load cuda"). ipyparallel fills {cluster_id},
    {output_file} and {program_and_args}; literal braces in user lines are escaped.
    Raises ValueError naming the field for nodes/gpus_per_node < 1 or a line of sbatch_lines
    not starting with "#SBATCH".
    """
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    bad = [line for line in sbatch_lines if not line.startswith("#SBATCH ")]
    if bad:
        raise ValueError(f"sbatch_lines must start with '#SBATCH ': {bad}")

    def esc(s: str) -> str:
        return s.replace("{", "{{").replace("}", "}}")

    lines = ["#!/bin/bash", "#SBATCH --export=ALL", "#SBATCH --job-name=ipengine-{cluster_id}", "#SBATCH --no-requeue",
             f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={gpus_per_node}",
             f"#SBATCH --gpus-per-node={gpus_per_node}", "#SBATCH --output={output_file}"]
    lines += [f"#SBATCH --cpus-per-task={cpus_per_task}"] if cpus_per_task else []
    lines += [f"#SBATCH --partition={esc(partition)}"] if partition else []
    lines += [f"#SBATCH --time={esc(str(time_limit))}"] if time_limit else []
    lines += [f"#SBATCH --account={esc(account)}"] if account else []
    lines += [esc(line) for line in sbatch_lines] + [esc(line) for line in setup_lines]
    lines += ["srun --kill-on-bad-exit=0 {program_and_args}", ""]
    return "\n".join(lines)


def _launcher_config(settings: dict) -> Any:
    """traitlets Config for the engine launcher from labkit's saved settings (see start_cluster)."""
    from traitlets.config import Config

    c = Config()
    launcher = c[_LAUNCHERS[settings["engines"]]]
    launcher.environment = dict(settings.get("environment") or {})
    launcher.engine_args = list(settings.get("engine_args") or [])
    if settings["engines"] == "slurm":
        launcher.batch_template = slurm_batch_template(**settings["slurm"])
        if settings.get("batch_file"):  # absolute: os.path.join(work_dir, it) is it
            launcher.batch_file_name = settings["batch_file"]
    if settings["engines"] == "mpi":
        launcher.mpi_args = list(settings.get("mpi_args") or []) + mpi_exports(launcher.environment)
    return c


def _settings_path(cluster: ipp.Cluster) -> pathlib.Path:
    return pathlib.Path(cluster.profile_dir, "security", f"labkit-{cluster.cluster_id}.json")


# ---------------------------------------------------------------- cluster lifecycle


def start_cluster(
    n: int | None = None,
    *,
    engines: str = "local",
    profile: str | None = None,
    profile_dir: str | None = None,
    controller_ip: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    keep_running: bool = False,
    slurm: dict | None = None,
    mpi_args: list[str] | None = None,
    network_interface: str | None = None,
    **kw: Any,
) -> ipp.Cluster:
    """Start a controller and engines with ipyparallel's own launchers, and connect a client.

    engines: "local" (n engines on this machine, default n=2), "slurm" (one batch job, one engine
    per GPU: `slurm` holds the keywords of `slurm_batch_template`, nodes and gpus_per_node at
    least; n defaults to, and must equal, nodes * gpus_per_node) or "mpi" (`mpiexec -n n
    <mpi_args> ipengine --mpi`; needs mpi4py in the engines).
    network_interface: the network interface the nodes talk over (for multi-homed nodes, e.g.
    "ib0"): exported to the engines as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (unless `env`
    sets them), and its IPv4 address on this host is the default controller_ip.
    controller_ip: default 127.0.0.1 for local engines (reachable from this machine only);
    for Slurm and MPI the address of `network_interface`, else the address this host's name
    resolves to; where that is a loopback address, MPI without a host list keeps 127.0.0.1 and
    Slurm (and MPI with -H/--host/--hostfile) raise ValueError saying in one line what to pass.
    "*" / "0.0.0.0" listen on all interfaces and warn.
    env: extra engine environment; the directory holding this `labkit` is prepended to
    PYTHONPATH so engines import the same code. keep_running: leave the cluster running when
    this Python process exits (reconnect later with `connect_cluster`). timeout: seconds for
    the engines to register (default 120, Slurm 3600 for the queue). ipyparallel's registration
    timeouts are scaled with n (``registration_timeouts``). Other keywords go to
    `ipyparallel.Cluster`. The settings are saved to security/labkit-<cluster_id>.json and every
    file in the profile's security/ directory is made owner-only (0600, directory 0700).
    Raises ValueError naming the bad argument; EngineStartError (a RuntimeError) within about a
    second of the engines' exit when they cannot start, with their own output (local, MPI,
    Slurm: see labkit.cluster.engine_watch); TimeoutError when they do not register in time. The
    cluster is stopped first in every case.
    """
    if engines not in ENGINE_KINDS:
        raise ValueError(f"engines must be one of {ENGINE_KINDS}, got {engines!r}")
    if controller_ip in ("*", "0.0.0.0"):
        warnings.warn(f"controller_ip={controller_ip!r} listens on all interfaces; anyone who can reach "
                      "this machine can connect to the controller", stacklevel=2)
    if engines == "slurm":
        if not slurm or "nodes" not in slurm or "gpus_per_node" not in slurm:
            raise ValueError("slurm: pass slurm={'nodes': N, 'gpus_per_node': G, ...} for engines='slurm'")
        slurm_batch_template(**slurm)  # validate early
        total = int(slurm["nodes"]) * int(slurm["gpus_per_node"])
        if n is not None and n != total:
            raise ValueError(f"n={n} but slurm asks for nodes*gpus_per_node={total} engines")
        n = total
    n = 2 if n is None else n
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if controller_ip is None:
        controller_ip = default_controller_ip(engines, network_interface, mpi_args or [])
    engine_env = dict(env or {})
    if network_interface:
        engine_env.setdefault("GLOO_SOCKET_IFNAME", network_interface)
        engine_env.setdefault("NCCL_SOCKET_IFNAME", network_interface)
    paths = [str(pathlib.Path(__file__).resolve().parents[2])]
    paths += [p for p in (engine_env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")) if p]
    engine_env["PYTHONPATH"] = os.pathsep.join(paths)
    waits = registration_timeouts(n)
    settings = {"engines": engines, "n": n, "environment": engine_env, "slurm": slurm,
                "mpi_args": list(mpi_args or []), "controller_ip": controller_ip,
                "network_interface": network_interface, "engine_args": [f"--IPEngine.timeout={waits['engine']}"]}
    kw["controller_args"] = [*kw.get("controller_args", []), f"--IPController.registration_timeout={waits['controller']}"]
    for key, value in (("profile", profile), ("profile_dir", profile_dir)):
        if value is not None:
            kw[key] = value
    if engines == "slurm" and controller_ip != "127.0.0.1":
        kw.setdefault("controller_location", controller_ip if controller_ip not in ("*", "0.0.0.0")
                      else socket.gethostname())
    cluster = ipp.Cluster(n=n, engines=engines, controller_ip=controller_ip, shutdown_atexit=not keep_running, **kw)
    if engines == "slurm":  # the rendered script goes to the profile's log/, not the notebook's directory
        settings["batch_file"] = os.path.join(cluster.profile_dir, "log", f"slurm-engines-{cluster.cluster_id}.sbatch")
        os.makedirs(os.path.dirname(settings["batch_file"]), exist_ok=True)
    cluster.config = _launcher_config(settings)
    track(cluster)  # engine_watch.death_cause reads its local engines' exit status
    if timeout is None:
        timeout = 3600.0 if engines == "slurm" else 120.0
    try:
        cluster.start_controller_sync()
        cluster.start_engines_sync(n)
        _write_private(_settings_path(cluster), settings)
        client = cluster.connect_client_sync()
        cluster._labkit_client = client
        wait_for_engines(cluster, client, n, timeout=timeout)
        secure_connection_files(cluster.profile_dir)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def _write_private(path: pathlib.Path, obj: Any) -> None:
    """Write JSON readable by the owner only (mode 0600), atomically (``labkit.io``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, obj, indent=1, mode=0o600)


def secure_connection_files(profile_dir: str) -> list[str]:
    """Make `<profile_dir>/security` 0700 and every file in it 0600 (connection files hold the
    controller's key; ipyparallel writes its cluster-*.json files with the default umask).
    Returns the files whose mode was changed."""
    sec = pathlib.Path(profile_dir, "security")
    changed = []
    if sec.is_dir():
        if stat.S_IMODE(sec.stat().st_mode) != 0o700:
            sec.chmod(0o700)
        for f in sec.iterdir():
            try:
                if f.is_file() and f.stat().st_uid == os.getuid() and stat.S_IMODE(f.stat().st_mode) != 0o600:
                    f.chmod(0o600)
                    changed.append(str(f))
            except FileNotFoundError:  # another cluster's file removed meanwhile
                continue
    return changed


def get_client(cluster: ipp.Cluster) -> ipp.Client:
    """The client `start_cluster` / `connect_cluster` connected (or a new one)."""
    client = getattr(cluster, "_labkit_client", None)
    if client is None:
        client = cluster._labkit_client = cluster.connect_client_sync()
    return client


def list_clusters(*, profile: str | None = None, profile_dir: str | None = None) -> list[dict]:
    """Clusters saved in a profile (default profile "default"): one dict per cluster file with
    cluster_id, engines (launcher name), n (engines started) and controller_pid (None if none)."""
    kw = {"profile_dir": profile_dir} if profile_dir else {"profile": profile or "default"}
    sec = pathlib.Path(ipp.Cluster(**kw, shutdown_atexit=False).profile_dir, "security")
    out = []
    for f in sorted(sec.glob("cluster-*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        ctl = (d.get("controller") or {}).get("state") or {}
        sets = (d.get("engines") or {}).get("sets") or {}
        out.append({"cluster_id": d["cluster"]["cluster_id"], "engines": (d.get("engines") or {}).get("class"),
                    "n": sum(int(s.get("n", 0)) for s in sets.values()), "controller_pid": ctl.get("pid")})
    return out


def connect_cluster(cluster_id: str, *, profile: str | None = None, profile_dir: str | None = None,
                    timeout: float = 60.0) -> ipp.Cluster:
    """Reconnect to a running cluster from its saved files (e.g. after a kernel restart).

    Loads ipyparallel's `security/cluster-<cluster_id>.json` (`Cluster.from_file`) with labkit's
    saved launcher settings, connects a client and waits up to `timeout` s for the engines.
    The returned cluster is not stopped when this process exits; `stop_cluster` stops it.
    Raises FileNotFoundError naming the missing file (and the saved cluster ids) and
    RuntimeError when the controller is no longer running.
    """
    kw = {"profile_dir": profile_dir} if profile_dir else {"profile": profile or "default"}
    probe = ipp.Cluster(cluster_id=cluster_id, shutdown_atexit=False, **kw)
    if not os.path.exists(probe.cluster_file):
        ids = [c["cluster_id"] for c in list_clusters(**kw)]
        raise FileNotFoundError(f"no cluster file {probe.cluster_file}; saved clusters there: {ids}")
    path = _settings_path(probe)
    settings = json.loads(path.read_text()) if path.exists() else None
    extra = {"config": _launcher_config(settings)} if settings else {}
    cluster = ipp.Cluster.from_file(cluster_id=cluster_id, **kw, **extra)
    if cluster.controller is None:
        raise RuntimeError(f"cluster {cluster_id}: its controller is not running ({probe.cluster_file})")
    client = cluster._labkit_client = cluster.connect_client_sync()
    n = sum(es.n for es in cluster.engines.values())
    client.wait_for_engines(n, timeout=timeout, interactive=False)
    secure_connection_files(cluster.profile_dir)
    return cluster


def restart_engines(cluster: ipp.Cluster, *, timeout: float | None = None) -> list[int]:
    """Kill every engine (SIGKILL; `scancel -s 9` on Slurm), stop and start the same number again
    (same launcher settings and environment); wait for the new engines and return their ids.

    Use it after a failed or interrupted DDP run: surviving ranks may be blocked in a collective
    that no signal ends. New engines are told apart from the old ones by their registration
    uuid, not their id: MPI engines come back with the same ids (their MPI ranks), other
    launchers give new ids. Node names set with `set_node_names` are gone. An engine set that
    cannot be stopped cleanly (its Slurm job already ended after a node failure) is dropped and
    a new one started. Killed engines unregister themselves; those still registered after
    STALE_ENGINE_WAIT_S (their node is unreachable) are unregistered by labkit
    (`forget_engines`: the controller would otherwise keep them for ~33 s of missed heartbeats,
    an orphan on a returning node longer), so `client.ids` holds only the new engines.
    Raises EngineStartError when the new engines exit before registering (with their output),
    TimeoutError if they do not register within `timeout` s (default as in `start_cluster`).
    """
    client = get_client(cluster)
    old = set(registered(client).values())
    path = _settings_path(cluster)
    settings = json.loads(path.read_text()) if path.exists() else {}
    n = sum(es.n for es in cluster.engines.values()) or int(settings.get("n", 0))
    if n < 1:
        raise RuntimeError(f"cluster {cluster.cluster_id}: no engine set to restart and no saved engine count")
    kind = settings.get("engines") or ("slurm" if any("Slurm" in type(es).__name__ for es in cluster.engines.values())
                                       else "local")
    with contextlib.suppress(Exception):  # a rank stuck in a collective ignores SIGTERM; the state is disposable
        cluster.signal_engines_sync(signal.SIGKILL)
    for set_id in list(cluster.engines):
        try:
            cluster.stop_engines_sync(set_id)
        except Exception as err:  # noqa: BLE001 - e.g. scancel of a job that already ended
            cluster.log.warning("restart_engines: engine set %s did not stop cleanly (%s); dropped", set_id, err)
            cluster.engines.pop(set_id, None)
    # engines that exit unregister themselves (a killed one through its nanny) within a second or
    # two; wait for that first: an old engine unregistering late would cancel the registration of a
    # new MPI engine that asked for the same id. Only engines on a lost node are left to forget.
    left = wait_unregistered(client, old, timeout=STALE_ENGINE_WAIT_S)
    forget_engines(client, left)  # do not wait ~33 s for the controller's missed heartbeats
    wait_unregistered(client, old, timeout=10)
    cluster.start_engines_sync(n)
    if timeout is None:
        timeout = 3600.0 if kind == "slurm" else 120.0
    new = wait_for_engines(cluster, client, n, timeout=timeout, exclude_uuids=old)
    stale = wait_unregistered(client, old, timeout=1)
    if stale:  # run_ddp on all engines would pick these up
        warnings.warn(f"restart_engines: old engines {stale} are still registered; pass targets={new} to run_ddp",
                      stacklevel=2)
    secure_connection_files(cluster.profile_dir)
    return new


def stop_cluster(cluster: ipp.Cluster) -> None:
    """Close the client and stop engines and controller (the job too, on Slurm); safe twice.

    ipyparallel logs each engine's whole output when it stops (a WARNING, as stopped engines exit
    by signal); that is quietened here
    (a notebook's last cell would otherwise end in a log dump). ``engine_logs`` keeps it. The
    processes this host's engines started (their nannies) are ended too, so none outlives the call."""
    import logging

    client = getattr(cluster, "_labkit_client", None)
    if client is not None:
        client.close()
        cluster._labkit_client = None
    launchers = [cluster.controller, *getattr(cluster, "engines", {}).values()]
    logs = {id(lg): lg for lg in [cluster.log, *(getattr(la, "log", None) for la in launchers)] if lg is not None}
    levels = {key: lg.level for key, lg in logs.items()}
    for lg in logs.values():  # stopped engines exit by signal, which ipyparallel logs as a WARNING
        lg.setLevel(logging.ERROR)
    helpers = _engine_children(cluster)
    try:
        cluster.stop_cluster_sync()
    finally:
        for key, lg in logs.items():
            lg.setLevel(levels[key])
    _end_processes(helpers)
    try:
        _settings_path(cluster).unlink()
    except FileNotFoundError:
        pass


def _engine_children(cluster: ipp.Cluster) -> list:
    """The processes this host's engine processes started: ipyparallel's nanny, one per engine
    (ipyparallel/engine/nanny.py). None for engines on other hosts (Slurm)."""
    import psutil

    procs = []
    for engine_set in getattr(cluster, "engines", {}).values():
        for launcher in getattr(engine_set, "launchers", {}).values():
            with contextlib.suppress(Exception):
                procs += psutil.Process(launcher.pid).children(recursive=True)
    return procs


def _end_processes(procs: list, wait_s: float = 3.0) -> None:
    """End ``procs`` now (SIGTERM; SIGKILL to those still running after ``wait_s``) and return once
    each has exited. For the engines' nannies, called after their engines and the controller
    stopped: a nanny outlives its stopped engine by up to 3 s while it tries to unregister the
    engine from that stopped controller (its socket's LINGER), which nothing can receive any more.
    A zombie counts as exited: its engine, its parent, is gone, so it waits only for init to
    reap it (which can take a second or two in a container)."""
    import psutil

    def running(proc) -> bool:
        try:
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    for signal_them in ("terminate", "kill"):
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                getattr(proc, signal_them)()
        end = time.monotonic() + wait_s
        while (procs := [p for p in procs if running(p)]) and time.monotonic() < end:
            time.sleep(0.02)
        if not procs:
            return


def engine_logs(cluster: ipp.Cluster) -> dict[str, str]:
    """{log file path: text} of this cluster's controller and engine logs (profile's log/).

    Engines' own stdout/stderr outside of tasks (start-up errors, crashes, Slurm's srun
    messages) go there, not to the notebook."""
    logs = sorted(pathlib.Path(cluster.profile_dir, "log").glob(f"*{cluster.cluster_id}*.log"))
    return {str(p): p.read_text(errors="replace") for p in logs}
