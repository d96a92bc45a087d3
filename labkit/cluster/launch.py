"""DDP launch in persistent ipyparallel engines: env, fresh port, live metrics, failures, stuck ranks.

`run_ddp` sets the `labkit.cluster.assign_ranks` environment on each engine, runs the function on
all ranks at once, streams the engines' stdout/stderr to the caller (AsyncResult.stream_output)
and rank 0's recent metric records through ipyparallel's `publish_data` (which keeps only the
latest value per key, so rank 0 publishes a bounded history). A failed rank, a dead engine or a
timeout raise `DDPError` naming the rank; every rank writes a status file from a thread of its own
(``labkit.train.status``), from which a stalled step names the rank the others wait for while they
wait (``labkit.cluster.stuck``); an interrupt (KeyboardInterrupt in the waiting cell) frees the
ranks' collectives and sends SIGINT to the engines still working. Restarting or going on without
lost engines is ``labkit.cluster.resumable``'s.

Patterns: docs/references.md section E (ipyparallel #141/#506/#706; DDP in persistent
engines: fresh MASTER_PORT per init, tear down on all ranks, restart engines after any error).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections import deque
from typing import Any, Callable, Sequence

import ipyparallel as ipp
from ipyparallel import error as ipp_error

from labkit.cluster.engine_watch import death_cause, unreachable
from labkit.cluster.stuck import StallWatch, clear_requests, ranks_text, request_interrupt
from labkit.cluster.topology import assign_ranks, engine_info
from labkit.config import TrainConfig
from labkit.train.run_config import finished_run
from labkit.train.status import interval_for

__all__ = ["LOST_PROBE_S", "DDPError", "failure_line", "labkit_frame", "run_ddp"]


class DDPError(RuntimeError):
    """A rank of a `run_ddp` call failed, died or timed out; the message names the rank(s), one
    line per failing rank (``failure_line``).

    Attributes: `rank` (the first failing rank; None for a timeout), `engine_id`, `died` (True
    when the engine process is gone), `lost` (the ranks whose engines are gone or unreachable,
    e.g. their node dropped off the network; empty when all answered), `remote_traceback` (the
    engines' full tracebacks as plain text, by rank; "" when there is none), `failures`
    ({rank: one-line summary}), `stuck` (the stall seen before the error: ``StallWatch.found``,
    whose line then begins the message, or follows it when the error names a dead or lost engine,
    the cause; None without one)."""

    def __init__(self, message: str, *, rank: int | None = None, engine_id: int | None = None, died: bool = False,
                 lost: list[int] | None = None, remote_traceback: str = "", failures: dict[int, str] | None = None):
        super().__init__(message)
        self.rank, self.engine_id, self.died, self.lost = rank, engine_id, died, list(lost or [])
        self.remote_traceback, self.failures = remote_traceback, dict(failures or {})
        self.stuck: dict | None = None  # the stall seen before the error (labkit.cluster.stuck.StallWatch)


LOST_PROBE_S = 3.0
"""Seconds an engine has to answer a control request before run_ddp counts it as lost."""


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


def _publish_timeline(rows: list[dict]) -> None:
    """Every rank's timeline sink: its recent step-timeline rows (``labkit.train.timeline``) under
    the key "timeline" of ipyparallel's ``publish_data`` (which keeps the latest value per key)."""
    from ipyparallel.datapub import publish_data

    publish_data({"timeline": rows})


def _ddp_entry(fn: Callable, env: dict, args: tuple, kwargs: dict, history: int, status: dict | None = None) -> Any:
    """Engine side of `run_ddp`: set env, start this rank's status file (``status``: {"dir",
    "token", "interval_s"}; ``labkit.train.status.RankStatus``, with torch's Flight Recorder on),
    build rank 0's sink (and every rank's timeline sink), call fn, always tear down. torch is not imported here: a function without it runs without it (torch
    reads OMP_NUM_THREADS when fn imports it; an engine that imported it before gets
    ``torch.set_num_threads``)."""
    import os
    import sys

    from labkit.train import probes
    from labkit.train.status import RankStatus

    with contextlib.suppress(Exception):  # IPython's default tracebacks parse every frame's source file (stack_data):
        get_ipython().InteractiveTB.set_mode("Plain")  # noqa: F821 - seconds for a torch stack on a busy host
    saved = {k: os.environ.get(k) for k in [*env, "TORCH_FR_BUFFER_SIZE"]}
    os.environ.update(env)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    sink = _Publisher(history) if env["RANK"] == "0" else None
    if status is not None:
        probes.enable_flight_recorder()
    beat = None if status is None else RankStatus(status["dir"], int(env["RANK"]), int(env["WORLD_SIZE"]),
                                                  interval_s=status["interval_s"], token=status["token"],
                                                  owner="run_ddp").start()
    phase = "failed"
    try:
        params = inspect.signature(fn).parameters
        if "sink" in params:
            kwargs = {**kwargs, "sink": sink}
        if "timeline_sink" in params:
            kwargs = {**kwargs, "timeline_sink": _publish_timeline}
        result = fn(*args, **kwargs)
        phase = "done"
        return result
    finally:
        if sink is not None and sink.records:
            sink.flush()
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if beat is not None:
            beat.stop(phase)
        runlock = sys.modules.get("labkit.train.runlock")
        if runlock is not None:  # a run_dir lock fn's run left held (its clean-up cut short by the SIGINT of
            runlock.release_all()  # stop_others): this engine lives on and runs the next call (elastic, a rerun)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FRAME = re.compile(r'File "?([^"\n:]*?labkit/[^"\n:]+\.py)"?(?:, line |:)(\d+)(?:,)? in (\w+)')


def _remote_text(err: BaseException) -> str:
    """An engine error as plain text: exception line and the engine's traceback, ANSI colours removed."""
    if isinstance(err, ipp_error.CompositeError):
        return "\n".join(_remote_text(e) for e in err.elements) if hasattr(err, "elements") else str(err)
    if isinstance(err, ipp_error.RemoteError):
        return _ANSI.sub("", f"{err.ename}: {err.evalue}\n{err.traceback or ''}")
    return f"{type(err).__name__}: {err}"


def labkit_frame(traceback_text: str) -> str | None:
    """The innermost labkit frame of a traceback (IPython's or Python's format, colours allowed),
    as "labkit/model/encoder.py:78 in model_config"; None when no frame is in labkit."""
    frames = _FRAME.findall(_ANSI.sub("", traceback_text))
    if not frames:
        return None
    path, line, func = frames[-1]
    return f"labkit/{path.rsplit('labkit/', 1)[1]}:{line} in {func}"


def failure_line(rank: int, node: str, engine_id: int, err: BaseException, name: str = "its task") -> str:
    """One readable line for a rank whose call `name` raised: rank, node, engine, exception type and
    the first line of its message, and the labkit frame it came from (``labkit_frame``)."""
    if isinstance(err, ipp_error.RemoteError):
        ename, evalue, tb = err.ename, str(err.evalue), err.traceback or ""
    else:
        ename, evalue, tb = type(err).__name__, str(err), ""
    lines = evalue.strip().splitlines()
    msg = lines[0] if lines else ""
    msg = msg if len(msg) <= 300 else msg[:297] + "..."
    frame = labkit_frame(tb)
    what = "engine died" if isinstance(err, ipp_error.EngineError) else "failed"
    return (f"rank {rank} (node {node}, engine {engine_id}) {what} while running {name}: {ename}: {msg}"
            + (f" [{frame}]" if frame else ""))


def _stream_without_errors(ar: Any) -> Any:
    """``ar.stream_output()`` for the engines' stdout/stderr, without the coloured tracebacks it
    prints for engine errors: run_ddp reports those itself, one line per failing rank."""
    shown = ar._iopub_streaming_output_callback  # bound method; stream_output() looks it up on the instance

    def callback(eid: int, msg_future: Any, msg: dict) -> None:
        if msg.get("header", {}).get("msg_type") != "error":
            shown(eid, msg_future, msg)

    ar._iopub_streaming_output_callback = callback
    return ar.stream_output()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_ddp(
    client: ipp.Client,
    fn: Callable,
    *args: Any,
    targets: list[int] | None = None,
    live: Callable[[list[dict]], None] | Sequence[Callable[[list[dict]], None]] | None = None,
    timeout: float | None = None,
    history: int = 500,
    poll: float = 1.0,
    stream: bool = True,
    status_dir: str | None = None,
    stall_view: Callable[[dict | None], None] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run fn(*args, **kwargs) on every target engine as one torch.distributed job; results by rank.

    Each engine gets the `assign_ranks` environment with a fresh MASTER_PORT (bound to port 0 on
    rank 0's engine, so on rank 0's host), OMP/POLARS_MAX/RAYON_NUM_THREADS = its host's usable
    cores // engines on that host (torch.set_num_threads too), TOKENIZERS_PARALLELISM=false, and
    on a single host MASTER_ADDR=127.0.0.1 and GLOO_SOCKET_IFNAME=lo; the environment is restored
    afterwards. fn initialises the process group itself with its own timeout (labkit.train.train
    uses cfg.timeout_s); the group is destroyed on every rank after fn returns or raises, so a
    second run in the same engines starts clean. If fn has a `sink` parameter it receives, on
    rank 0, a callable keeping and publishing the last `history` records (others: None); `timeline_sink`,
    on every rank, one publishing its step-timeline rows. Each `live` (a callable or a list, drawn in
    order) gets rank 0's records about every `poll` s when they change and at the end, then any `flush()`;
    one whose ``wants`` is "timeline" (``labkit.rankview.RankView``) gets every rank's timeline rows (the
    newest `history` steps); one with ``every_poll = True`` is called at every poll, records or not
    (``labkit.cluster.elastic.GrowWatch``). `stream`: the engines' output is printed here, prefixed
    "[stdout:<engine id>]". Every rank writes a status file to `status_dir` (default: a
    TrainConfig argument's run_dir/ranks, else, or when that run is finished and resumed, which
    train() returns untouched, the profile's labkit-status/<token>;
    ``labkit.train.status``, every ``interval_for(cfg.timeout_s)`` s); when a step stalls, `stall_view(found)` (default
    ``labkit.live.StallView()``) gets ``labkit.cluster.stuck.StallWatch``'s line naming the rank the
    others wait for, its host and the collective, with its stack (None once it moves again).
    Raises DDPError naming the rank (with the engine's traceback) when a rank fails, when its
    engine dies (unregistered, or its process gone on this host) or, naming the unfinished ranks,
    after `timeout` s; the other ranks' work is then interrupted (SIGINT), and a stall seen before
    is its first line (`.stuck`). A KeyboardInterrupt in the caller (or raised by `live`) asks every
    rank to free its collectives (``stuck.request_interrupt``: a blocked rank's collective raises
    within about a second), sends SIGINT to the engines still working, waits up to 10 s for them
    and re-raises; a stopped process (SIGSTOP) ends its task once it is continued.
    """
    lives = [] if live is None else list(live) if isinstance(live, (list, tuple)) else [live]
    infos = engine_info(client, targets, timeout=60)
    by_id = {i["engine_id"]: i for i in infos}
    envs = _rank_environments(client, infos)
    rank_of = {eid: int(env["RANK"]) for eid, env in envs.items()}
    engine_of = {r: eid for eid, r in rank_of.items()}
    status, watch, view = _stall_watch(client, args, kwargs, status_dir, engine_of, stall_view)
    ars = {rank_of[eid]: client[eid].apply_async(_ddp_entry, fn, env, args, kwargs, history, status)
           for eid, env in envs.items()}  # all submitted before any wait: init blocks until all join
    job = _Job(client, ars, by_id, engine_of, status, getattr(fn, "__name__", repr(fn)))
    deadline = None if timeout is None else time.monotonic() + timeout
    shown = None
    with contextlib.ExitStack() as streams:
        if stream:
            for ar in ars.values():
                streams.enter_context(_stream_without_errors(ar))
        try:
            while job.pending:
                ars[min(job.pending)].wait(poll)
                job.check()
                shown = _show(lives, ars, shown, history)
                view(watch.poll())
                if job.pending and deadline is not None and time.monotonic() > deadline:
                    job.timed_out(timeout)
            if stream:  # a result can arrive before the output printed ahead of it: drain the streams
                for ar in ars.values():
                    ar.wait_for_output(5)
        except DDPError as err:
            _name_stuck(err, watch)
            raise
        except KeyboardInterrupt:
            job.stop_others()
            _wait_after_interrupt(ars, job.pending, watch)
            raise
        finally:
            if status["temporary"] and not job.pending:  # every rank has stopped writing there
                shutil.rmtree(status["dir"], ignore_errors=True)
        if lives:
            _final_show(lives, ars, shown, history)
    return [ars[r].get(0) for r in sorted(ars)]


class _Job:
    """The ranks of one ``run_ddp`` call while it waits: who each is, which are dead or failed
    (``check`` raises DDPError naming them), stopping the others."""

    def __init__(self, client: ipp.Client, ars: dict[int, Any], by_id: dict[int, dict], engine_of: dict[int, int],
                 status: dict, name: str):
        self.client, self.ars, self.by_id, self.engine_of, self.status, self.name = (client, ars, by_id, engine_of,
                                                                                      status, name)
        self.pending = set(ars)
        self.here = socket.gethostname()

    def who(self, r: int) -> str:
        i = self.by_id[self.engine_of[r]]
        return f"rank {r} (engine {i['engine_id']}, node {i['node']}, pid {i['pid']})"

    def dead(self) -> list[int]:
        ids = set(self.client.ids)
        info = lambda r: self.by_id[self.engine_of[r]]  # noqa: E731
        return [r for r in sorted(self.pending) if self.engine_of[r] not in ids
                or (info(r)["hostname"] == self.here and not _pid_alive(info(r)["pid"]))]

    def stop_others(self, exclude: int | None = None) -> None:
        """Free every rank's collectives (``stuck.request_interrupt``) and SIGINT the engines still working."""
        request_interrupt(self.status["dir"], self.status["token"])
        alive = [self.engine_of[r] for r in sorted(self.pending) if r != exclude and self.engine_of[r] in self.client.ids]
        if alive:
            with contextlib.suppress(Exception):
                self.client.send_signal(signal.SIGINT, targets=alive, block=False)

    def check(self) -> None:
        """Raise DDPError when a rank's engine died, or a rank failed (naming lost peers first)."""
        gone = self.dead()
        if gone:
            self.pending.discard(r := gone[0])
            self.stop_others()
            info = self.by_id[self.engine_of[r]]
            cause = death_cause(info["pid"], local=info["hostname"] == self.here)
            raise DDPError(f"{self.who(r)}: engine died while running {self.name} ({cause}); the other ranks were "
                           "interrupted. Restart the engines (labkit.cluster.restart_engines) and run "
                           "again to resume from the last checkpoint", rank=r, engine_id=self.engine_of[r], died=True)
        failed = _failed_ranks(self.ars, self.pending)
        if failed:
            first = min(failed)  # a rank's collective failed: is a peer gone?
            _raise_if_lost(self.client, self.pending, self.engine_of, self.who, self.name,
                           f"{self.who(first)} failed: {_first_line(failed[first])}", self.stop_others, failed[first])
            self.stop_others()
            raise _failure_error(failed, self.name, {r: self.by_id[self.engine_of[r]] for r in failed})

    def timed_out(self, timeout: float) -> None:
        """Raise DDPError naming the unfinished ranks (a lost one first)."""
        _raise_if_lost(self.client, self.pending, self.engine_of, self.who, self.name, f"timeout after {timeout} s",
                       self.stop_others)
        unfinished = ", ".join(self.who(r) for r in sorted(self.pending))
        self.stop_others()
        raise DDPError(f"timeout after {timeout} s: {unfinished} not finished")


def _stall_watch(client: ipp.Client, args: tuple, kwargs: dict, status_dir: str | None, engine_of: dict[int, int],
                 view: Callable[[dict | None], None] | None) -> tuple[dict, StallWatch, Callable[[dict | None], None]]:
    """The run's status directory, token and interval ({"dir", "token", "interval_s", "temporary"}: a
    TrainConfig argument's run_dir/ranks and ``status.interval_for`` its timeout_s, else the client's
    profile's labkit-status/<token> (temporary: removed when the call returns) at 0.5 s; the latter
    also, at the config's interval, for a finished run resumed (``labkit.train.run_config.finished_run``
    as this client sees the run: train() returns its saved result, and its ranks/ keeps the last
    status of the ranks that trained it), its ``StallWatch`` and the view it feeds (default
    ``labkit.live.StallView()``). Requests left by earlier runs are removed."""
    import uuid

    from labkit.live import StallView

    token = uuid.uuid4().hex[:12]
    temporary = False
    cfg = next((a for a in [*args, *kwargs.values()] if isinstance(a, TrainConfig)), None)
    if status_dir is None:
        temporary = cfg is None or (cfg.resume and finished_run(cfg, say=False) is not None)
        status_dir = (os.path.join(client._profile_dir.location, "labkit-status", token) if temporary
                      else os.path.join(cfg.run_dir, "ranks"))
    os.makedirs(status_dir, exist_ok=True)
    clear_requests(status_dir)
    return ({"dir": os.path.abspath(status_dir), "token": token, "temporary": temporary,
             "interval_s": interval_for(cfg.timeout_s if cfg is not None else None)},
            StallWatch(status_dir, token, engine_of), view if view is not None else StallView())


def _wait_after_interrupt(ars: dict[int, Any], pending: set[int], watch: StallWatch) -> None:
    """After an interrupt: wait up to 10 s for the ranks' tasks to end, except those of ranks whose
    process is not running (``watch.found["stopped"]``), which end only once continued; say so."""
    stopped = [r for r in (watch.found or {}).get("stopped", []) if r in pending]
    _wait_quietly([ars[r] for r in sorted(pending) if r not in stopped], 10.0)
    if stopped:
        print(f"labkit: {ranks_text(stopped)} did not run when interrupted (pid {watch.found['pid']} on "
              f"{watch.found['host']}): its task ends once the process is continued (kill -CONT), or restart "
              "the engines (labkit.cluster.restart_engines)", file=sys.stderr, flush=True)


def _name_stuck(err: DDPError, watch: StallWatch) -> None:
    """Put the stall the watch saw before ``err`` (the rank the others waited for) first in its message;
    after it when ``err`` names an engine that died or was lost, which is then the cause (a node cut
    off: its rank's status still says it waits in the collective the survivors have left)."""
    err.stuck = watch.found
    if watch.found:
        text = err.args[0] if err.args else ""
        err.args = (f"{text}\n{watch.found['line']}" if err.died or err.lost else f"{watch.found['line']}\n{text}",)


def _rank_environments(client: ipp.Client, infos: list[dict]) -> dict[int, dict[str, str]]:
    """{engine_id: environment} for one DDP job: ``assign_ranks`` with a fresh MASTER_PORT (a free
    port found on rank 0's engine), thread counts = the host's usable cores // its engines, and
    on a single host MASTER_ADDR=127.0.0.1 and GLOO_SOCKET_IFNAME=lo."""
    by_id = {i["engine_id"]: i for i in infos}
    rank0 = next(e for e, v in assign_ranks(infos, master_port=1).items() if v["RANK"] == "0")
    port = client[rank0].apply_async(_free_port).get(timeout=30)
    envs = assign_ranks(infos, master_port=port)
    hosts = [i["hostname"] for i in infos]
    for eid, env in envs.items():
        threads = str(max(1, by_id[eid]["cpus"] // hosts.count(by_id[eid]["hostname"])))
        env.update(OMP_NUM_THREADS=threads, POLARS_MAX_THREADS=threads, RAYON_NUM_THREADS=threads,
                   TOKENIZERS_PARALLELISM="false")
        if len(set(hosts)) == 1:
            env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    return envs


def _wait_quietly(results: list[Any], seconds: float) -> None:
    """Wait up to ``seconds`` in all for ``results`` (AsyncResults) to finish, ignoring their errors."""
    end = time.monotonic() + seconds
    for ar in results:
        with contextlib.suppress(Exception):
            ar.wait(max(0.0, end - time.monotonic()))


def _final_show(lives: list[Callable], ars: dict[int, Any], shown: Any, history: int) -> None:
    """After the run: the last records to every ``live`` callback (not the ``every_poll`` watches:
    the run is over), then their ``flush()``."""
    ars[0].wait_for_output(5)
    lives = [cb for cb in lives if not getattr(cb, "every_poll", False)]
    _show(lives, ars, shown, history)
    for cb in lives:
        if hasattr(cb, "flush"):
            cb.flush()


def _raise_if_lost(client: ipp.Client, ranks: set[int], engine_of: dict[int, int], who: Callable[[int], str],
                   name: str, then: str, stop_others: Callable[[], None], cause: BaseException | None = None) -> None:
    """Raise DDPError naming the first lost rank if any of `ranks` has an engine that is
    unregistered or does not answer within LOST_PROBE_S (its node is down or off the network)."""
    gone = set(unreachable(client, [engine_of[r] for r in ranks], timeout=LOST_PROBE_S)) if ranks else set()
    lost = [r for r in sorted(ranks) if engine_of[r] in gone]
    if lost:
        stop_others()
        raise DDPError(_lost_message(lost, who, name, then), rank=lost[0], engine_id=engine_of[lost[0]],
                       died=True, lost=lost) from cause


def _first_line(err: BaseException) -> str:
    lines = [ln for ln in _remote_text(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def _lost_message(lost: list[int], who: Callable[[int], str], name: str, then: str) -> str:
    return (f"{who(lost[0])}: engine lost while running {name} (no answer within {LOST_PROBE_S:g} s: its node is "
            f"down or off the network); engines gone: {'; '.join(who(r) for r in lost)}; then {then}. "
            "When the node is back, restart the engines (labkit.cluster.restart_engines) and run again "
            "to resume from the last checkpoint")


def _failed_ranks(ars: dict[int, Any], pending: set[int], *, grace: float = 2.0) -> dict[int, BaseException]:
    """Ranks of `pending` whose call has finished with an error, {rank: error}; finished ranks
    leave `pending`. After a first failure, waits up to `grace` s for the other ranks, so ranks
    failing together (a bad config fails on all) are reported together."""
    def collect() -> dict[int, BaseException]:
        out = {}
        for r in sorted(pending):
            if ars[r].ready():
                pending.discard(r)
                try:
                    ars[r].get(0)
                except Exception as err:
                    out[r] = err
        return out

    failed = collect()
    end = time.monotonic() + grace
    while failed and pending and time.monotonic() < end:
        ars[min(pending)].wait(min(0.2, max(0.0, end - time.monotonic())))
        failed |= collect()
    return failed


def _failure_error(failed: dict[int, BaseException], name: str, infos: dict[int, dict]) -> DDPError:
    """A DDPError with one line per failing rank (``failure_line``) and the engines' tracebacks."""
    lines = {r: failure_line(r, infos[r]["node"], infos[r]["engine_id"], err, name) for r, err in sorted(failed.items())}
    first = min(failed)
    died = isinstance(failed[first], ipp_error.EngineError)
    tracebacks = "\n\n".join(f"--- rank {r} ---\n{_remote_text(err)}" for r, err in sorted(failed.items()))
    message = "\n".join(lines.values()) + "\n(the engines' full tracebacks: this DDPError's .remote_traceback)"
    return DDPError(message, rank=first, engine_id=infos[first]["engine_id"], died=died,
                    remote_traceback=tracebacks, failures=lines)


def _show(lives: list[Callable], ars: dict[int, Any], shown: dict | None, history: int) -> dict:
    """Call each live(records) if rank 0 published records different from the last shown, and
    each live that ``wants`` "timeline" with every rank's timeline rows (kept in ``shown``,
    by segment, step and rank, the newest `history` steps) when they changed; a live is first
    called after every live before it in the list, so their outputs keep the list's order. A live
    with ``every_poll = True`` (a watch, not a display: ``labkit.cluster.elastic.GrowWatch``) is
    called with rank 0's records at every poll. Returns the state."""
    shown = shown if shown is not None else {"records": None, "rows": {}, "timeline": None, "called": set()}
    records = (ars[0].data or {}).get("records") or []
    for cb in lives:
        if getattr(cb, "every_poll", False):
            cb(records)
    lives = [cb for cb in lives if not getattr(cb, "every_poll", False)]
    rows = shown["rows"]
    if any(getattr(cb, "wants", "records") == "timeline" for cb in lives):
        for ar in ars.values():
            for row in (ar.data or {}).get("timeline") or []:
                rows[(row["segment_start"], row["step"], row["rank"])] = row
        for old in sorted(rows)[:-history * len(ars)] if len(rows) > history * len(ars) else []:
            del rows[old]
    new = {"records": (len(records), records[-1]) if records else None,
           "timeline": (len(rows), max(r["t_end"] for r in rows.values())) if rows else None}
    for i, cb in enumerate(lives):  # in list order: the first draw of each keeps its place in the notebook
        if any(j not in shown["called"] for j in range(i)):
            break
        kind = "timeline" if getattr(cb, "wants", "records") == "timeline" else "records"
        if new[kind] is not None and (new[kind] != shown[kind] or i not in shown["called"]):
            cb(list(rows.values()) if kind == "timeline" else records)
            shown["called"].add(i)
    shown.update(new)
    return shown


def _resuming(arg: Any) -> Any:
    """``arg`` with resume=True when it is a ``TrainConfig`` (the rerun continues the run), else ``arg``."""
    if isinstance(arg, TrainConfig) and not arg.resume:
        import dataclasses as _dc

        return _dc.replace(arg, resume=True)
    return arg
