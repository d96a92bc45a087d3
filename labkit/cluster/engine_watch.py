"""Watching ipyparallel engines: registration by uuid, start-up failures, reachability.

- `wait_for_engines` waits until `n` engines are registered whose uuids were not there before.
  Engine ids cannot tell new engines from old ones: engines started with `ipengine --mpi` ask
  for their MPI rank as id, so restarted engines come back with the same ids (and with other
  ids when the old ones have not unregistered yet). Every registration has a new uuid.
- While waiting it watches the engine launchers, so engines that cannot start (a broken Python
  environment on a node, a bad `sbatch` option) end the wait within about a second of their
  exit with `EngineStartError` carrying their own output, instead of a bare timeout much later:
  local engines and `mpiexec` by their exit status, a Slurm job by `squeue` (ended) and by
  srun's "task N: Exited with exit code" lines in the job's output file.
- `unreachable` asks engines through their control channel (ipyparallel's nanny process, which
  answers while the engine's main thread is busy) whether they are there; an engine that does
  not answer within a few seconds is gone (its node crashed or dropped off the network).
- `death_cause` says why an engine process ended: the signal or exit status (for the local
  engines of a cluster this process started, `track`), and "probably out of memory" when it was
  SIGKILL and the kernel says so (its log's OOM-killer line for the pid, or the memory cgroup's
  oom_kill count rising during the task).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import time
import weakref
from typing import Any

import ipyparallel as ipp

__all__ = ["SLURM_ENDED", "death_cause", "EngineStartError", "exit_status", "forget_engines", "kernel_oom_kill",
           "oom_kills", "registered", "startup_failure", "track", "unreachable", "wait_for_engines",
           "wait_unregistered"]

SLURM_ENDED = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
               "PREEMPTED", "TIMEOUT", "SPECIAL_EXIT")
_SRUN_TASK_EXIT = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): Exited with exit code (\d+)")


class EngineStartError(RuntimeError):
    """Engines exited (or their batch job ended) before registering. The message starts with one
    line saying which, followed by the tail of their own output; `output` holds that text."""

    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


def registered(client: ipp.Client) -> dict[int, str]:
    """{engine id: engine uuid} of the engines registered now (pending notifications applied)."""
    client.ids  # noqa: B018 (the property applies registration notifications first)
    return dict(client._engines)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join("  " + line for line in text.rstrip().splitlines()[-lines:])


def _read(path: str | None) -> str:
    try:
        return pathlib.Path(path).read_text(errors="replace") if path else ""
    except OSError:
        return ""


def _slurm_state(job_id: str) -> str | None:
    """The job's state from squeue; None when squeue no longer knows it, "" when squeue fails."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-t", "all", "-o", "%T"], capture_output=True,
                             text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if out.returncode:
        return None if "Invalid job id" in out.stderr else ""
    return out.stdout.strip() or None


def _exit_code(launcher: Any) -> int | None:
    """Exit status of a local launcher's process, None while it runs. (ipyparallel records the
    exit through its event loop, which does not run between synchronous calls.)"""
    proc = getattr(launcher, "_popen_process", None)
    return None if proc is None else proc.poll()


def _code(code: Any) -> str:
    # 0 can be a stand-in: ipyparallel's wait thread may reap the process before Popen sees it
    return f" with code {code}" if code not in (None, 0) else ""


def startup_failure(launcher: Any, *, check_job: bool = True) -> str | None:
    """Why an engine-set launcher's engines can no longer register: a message ending with their
    output, or None while they may still come. Local engines: any engine process that exited;
    MPI: mpiexec exited; Slurm: the job ended, or srun reported a task that exited
    (`check_job`: also ask squeue, a subprocess)."""
    kind = type(launcher).__name__
    if hasattr(launcher, "launchers"):  # LocalEngineSetLauncher: one process per engine
        stopped = dict((launcher.stop_data or {}).get("engines") or {})
        for ident, el in list(launcher.launchers.items()):
            code = _exit_code(el)
            if code is not None:
                stopped[ident] = {"exit_code": code, "output": _read(el.output_file)}
        for ident, data in sorted(stopped.items()):
            out = data.get("output") or launcher.outputs.get(ident) or ""
            code = _code(data.get("exit_code"))
            return f"local engine {ident} exited{code} before registering; its output:\n{_tail(out)}"
        return None
    if kind.startswith("MPI"):
        code = _exit_code(launcher)
        if code is not None or launcher.state == "after":
            code = code if code is not None else (launcher.stop_data or {}).get("exit_code")
            out = _read(launcher.output_file)
            return f"mpiexec exited{_code(code)} before the engines registered; its output:\n{_tail(out)}"
        return None
    job = getattr(launcher, "job_id", "")
    if not job:
        return None
    out = _read(getattr(launcher, "output_file", None))
    task = _SRUN_TASK_EXIT.search(out)
    if task:
        return (f"Slurm job {job}: srun task {task.group(2)} on {task.group(1)} exited with code {task.group(3)} "
                f"before registering; the job's output ({launcher.output_file}):\n{_tail(out)}")
    if check_job:
        state = _slurm_state(job)
        if state is None or state in SLURM_ENDED:
            out = _read(launcher.output_file)
            return (f"Slurm job {job} ended ({state or 'gone from squeue'}) before the engines registered; "
                    f"its output ({launcher.output_file}):\n{_tail(out)}")
    return None


def wait_for_engines(cluster: ipp.Cluster, client: ipp.Client, n: int, *, timeout: float,
                     exclude_uuids: set[str] | frozenset = frozenset(), poll: float = 0.2,
                     job_poll: float = 1.0) -> list[int]:
    """Wait until `n` engines are registered whose uuids are not in `exclude_uuids`; their ids.

    Every `poll` s the cluster's engine launchers are checked (`startup_failure`; squeue every
    `job_poll` s). Raises EngineStartError (with the engines' output) as soon as engines exited
    before registering, TimeoutError with a one-line count after `timeout` s.
    """
    deadline = time.monotonic() + timeout
    next_job_check = 0.0
    while True:
        new = sorted(e for e, u in registered(client).items() if u not in exclude_uuids)
        if len(new) >= n:
            return new
        now = time.monotonic()
        check_job = now >= next_job_check
        next_job_check = now + job_poll if check_job else next_job_check
        for launcher in list(getattr(cluster, "engines", {}).values()):
            why = startup_failure(launcher, check_job=check_job)
            if why:
                raise EngineStartError(f"engines failed to start: {why}", why.split("\n", 1)[-1])
        if now > deadline:
            raise TimeoutError(f"{len(new)} of {n} engines registered within {timeout} s "
                               f"(engine logs: {pathlib.Path(cluster.profile_dir, 'log')})")
        time.sleep(poll)


def unreachable(client: ipp.Client, engine_ids: list[int], *, timeout: float = 5.0) -> list[int]:
    """The engines among `engine_ids` that are unregistered or do not answer a control-channel
    request (signal 0 through the engine's nanny) within `timeout` s, sorted."""
    ids = set(client.ids)
    gone = [e for e in engine_ids if e not in ids]
    futures = {}
    for e in engine_ids:
        if e in ids:
            try:
                futures[e] = client.send_signal(0, targets=[e], block=False)
            except Exception:  # noqa: BLE001 - an engine the client cannot address is gone
                gone.append(e)
    end = time.monotonic() + timeout
    for e, fut in futures.items():
        try:
            fut.result(timeout=max(0.0, end - time.monotonic()))
        except Exception:  # noqa: BLE001 - no answer (TimeoutError) or an error reply: not reachable
            gone.append(e)
    return sorted(set(gone))


def wait_unregistered(client: ipp.Client, uuids: set[str], *, timeout: float, poll: float = 0.2) -> list[int]:
    """Wait up to `timeout` s until no engine with one of `uuids` is registered; the ids of those
    still registered then (empty when all are gone). Killed engines are unregistered by the
    controller once it misses their heartbeats (ipyparallel: 10 x 3 s), or at once when their
    nanny reports the exit."""
    end = time.monotonic() + timeout
    while True:
        left = sorted(e for e, u in registered(client).items() if u in uuids)
        if not left or time.monotonic() > end:
            return left
        time.sleep(poll)


def forget_engines(client: ipp.Client, engine_ids: list[int]) -> None:
    """Ask the controller to unregister `engine_ids` now: the `unregistration_request` an engine
    sends when it leaves, sent for engines that were killed or whose node is gone, so neither
    the ~33 s heartbeat timeout nor an orphan coming back on a returning node keeps them in
    `client.ids`, and MPI engines restarted after them get their ids (their ranks) back."""
    for eid in engine_ids:
        client._send(client._query_stream, "unregistration_request", content={"id": int(eid)})


# ---------------------------------------------------------------- why an engine died

_STARTED: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Clusters this process started (``labkit.cluster.start_cluster`` adds them): the parents of
their local engine processes, whose exit status only a parent can read."""

_OOM_LINE = re.compile(r"(?:Out of memory|Memory cgroup out of memory): Killed process (\d+)|oom-kill:.*\bpid=(\d+),")


def track(cluster: Any) -> None:
    """Remember a started cluster, so ``exit_status`` can find its local engine processes."""
    _STARTED.add(cluster)


def exit_status(pid: int) -> int | None:
    """The exit status of a local engine process of a cluster this process started: its code, or
    -N when signal N ended it (psutil's reading, which ipyparallel's launcher took when it reaped
    the process); None while it runs or when this process did not start it."""
    import psutil

    for cluster in list(_STARTED):
        for engine_set in list(getattr(cluster, "engines", {}).values()):
            for launcher in list(getattr(engine_set, "launchers", {}).values()):
                proc = getattr(launcher, "process", None)
                if proc is None or proc.pid != pid:
                    continue
                waiter = getattr(launcher, "_wait_thread", None)
                if waiter is not None and waiter.is_alive():  # ipyparallel's thread reaps it: let it, then
                    try:  # read what it read (psutil keeps the status); two waiters would race for it
                        deadline = time.monotonic() + 2.0  # a process just killed takes a moment to exit
                        while proc.status() != psutil.STATUS_ZOMBIE and waiter.is_alive():
                            if time.monotonic() > deadline:
                                return None
                            time.sleep(0.05)
                    except psutil.NoSuchProcess:
                        pass
                    waiter.join(timeout=5)
                try:
                    return proc.wait(timeout=0)
                except psutil.Error:  # still running (TimeoutExpired) or gone unreaped
                    return None
    return None


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended in this process's memory cgroup
    (cgroup v2 memory.events, v1 memory.oom_control: "oom_kill N"); None where neither is readable."""
    try:
        lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            f = pathlib.Path("/sys/fs/cgroup", path.lstrip("/"), "memory.events")
        elif "memory" in controllers.split(","):
            f = pathlib.Path("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.oom_control")
        else:
            continue
        try:
            for entry in f.read_text().splitlines():
                key, _, value = entry.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def kernel_oom_kill(pid: int, log: str | None = None) -> str | None:
    """The kernel log line saying its OOM killer ended `pid` ("Out of memory: Killed process
    1234 (python3) ...", "oom-kill:...,pid=1234,..."), or None. `log`: the kernel log text;
    None reads ``dmesg`` (which may need root or kernel.dmesg_restrict=0; unreadable: None)."""
    if log is None:
        try:
            log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
    for line in reversed(log.splitlines()):
        m = _OOM_LINE.search(line)
        if m and int(m.group(1) or m.group(2)) == pid:
            return line.strip()
    return None


def death_cause(pid: int | None, *, local: bool = True, oom_kills_before: int | None = None) -> str:
    """Why engine process `pid` ended, in a few words for an error line: "killed by signal 9
    (SIGKILL); probably out of memory: <the kernel's line>", "exited with status 1", or that it
    is unknown (this process did not start it, or it still runs). `local`: the engine ran on this host (else only "unknown" can be said);
    `oom_kills_before`: ``oom_kills()`` before its task (an increase counts as the kernel's word)."""
    import signal

    if pid is None or not local:
        return "its exit status is not visible from here (another host)" if not local else "its exit status is unknown"
    code = exit_status(pid)
    oom = kernel_oom_kill(pid)
    after = oom_kills()
    if oom is None and oom_kills_before is not None and after is not None and after > oom_kills_before:
        oom = f"the memory cgroup's oom_kill count went from {oom_kills_before} to {after}"
    if code is not None and code < 0:
        what = f"killed by signal {-code} ({signal.Signals(-code).name})"
    elif code is not None:
        what = f"exited with status {code}"
    elif oom is not None:
        what = "killed by signal 9 (SIGKILL)"
    else:
        return "its exit status is unknown"
    if oom is not None and (code is None or code == -signal.SIGKILL):
        return f"{what}; probably out of memory: {oom}"
    return what
