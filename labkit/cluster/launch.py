"""DDP launch in persistent ipyparallel engines: env, fresh port, live metrics, failures, resume.

`run_ddp` sets the `labkit.cluster.assign_ranks` environment on each engine, runs the function on
all ranks at once, streams the engines' stdout/stderr to the caller (AsyncResult.stream_output)
and rank 0's recent metric records through ipyparallel's `publish_data` (which keeps only the
latest value per key, so rank 0 publishes a bounded history). A failed rank, a dead engine or a
timeout raise `DDPError` naming the rank; an interrupt (KeyboardInterrupt in the waiting cell)
sends SIGINT to the engines still working. `run_ddp_resumable` restarts the engines after a
`DDPError` and runs again: a function that resumes from its newest checkpoint (labkit.train.train
with cfg.resume) then continues where it stopped.

Patterns: docs/references.md section E (ipyparallel #141/#506/#706; DDP in persistent
engines: fresh MASTER_PORT per init, tear down on all ranks, restart engines after any error).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import signal
import socket
import sys
import time
from collections import deque
from typing import Any, Callable, Sequence

import ipyparallel as ipp
from ipyparallel import error as ipp_error

from labkit.cluster.engine_watch import death_cause, unreachable
from labkit.cluster.engines import get_client, restart_engines
from labkit.config import TrainConfig
from labkit.cluster.topology import assign_ranks, engine_info, tensor_parallel_groups

__all__ = ["LOST_PROBE_S", "DDPError", "failure_line", "labkit_frame", "run_ddp", "run_ddp_resumable",
           "train_on_cluster"]


class DDPError(RuntimeError):
    """A rank of a `run_ddp` call failed, died or timed out; the message names the rank(s), one
    line per failing rank (``failure_line``).

    Attributes: `rank` (the first failing rank; None for a timeout), `engine_id`, `died` (True
    when the engine process is gone), `lost` (the ranks whose engines are gone or unreachable,
    e.g. their node dropped off the network; empty when all answered), `remote_traceback` (the
    engines' full tracebacks as plain text, by rank; "" when there is none), `failures`
    ({rank: one-line summary})."""

    def __init__(self, message: str, *, rank: int | None = None, engine_id: int | None = None, died: bool = False,
                 lost: list[int] | None = None, remote_traceback: str = "", failures: dict[int, str] | None = None):
        super().__init__(message)
        self.rank, self.engine_id, self.died, self.lost = rank, engine_id, died, list(lost or [])
        self.remote_traceback, self.failures = remote_traceback, dict(failures or {})


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


def _ddp_entry(fn: Callable, env: dict, args: tuple, kwargs: dict, history: int) -> Any:
    """Engine side of `run_ddp`: set env, build rank 0's sink (and every rank's timeline sink),
    call fn, always tear down."""
    import os

    import torch
    import torch.distributed as dist

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    sink = _Publisher(history) if env["RANK"] == "0" else None
    try:
        params = inspect.signature(fn).parameters
        if "sink" in params:
            kwargs = {**kwargs, "sink": sink}
        if "timeline_sink" in params:
            kwargs = {**kwargs, "timeline_sink": _publish_timeline}
        return fn(*args, **kwargs)
    finally:
        if sink is not None and sink.records:
            sink.flush()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
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
    newest `history` steps). `stream`: the engines' output is printed here, prefixed "[stdout:<engine id>]".
    Raises DDPError naming the rank (with the engine's traceback) when a rank fails, when its
    engine dies (unregistered, or its process gone on this host) or, naming the unfinished ranks,
    after `timeout` s; the other ranks' work is then interrupted (SIGINT). A KeyboardInterrupt in
    the caller (or raised by `live`) sends SIGINT to the engines still working, waits up to 10 s
    for them and re-raises. Ranks blocked inside a collective may not see SIGINT until its
    timeout: `labkit.cluster.restart_engines` ends them for sure.
    """
    lives = [] if live is None else list(live) if isinstance(live, (list, tuple)) else [live]
    infos = engine_info(client, targets, timeout=60)
    by_id = {i["engine_id"]: i for i in infos}
    envs = _rank_environments(client, infos)
    rank_of = {eid: int(env["RANK"]) for eid, env in envs.items()}
    engine_of = {r: eid for eid, r in rank_of.items()}
    ars = {rank_of[eid]: client[eid].apply_async(_ddp_entry, fn, env, args, kwargs, history)
           for eid, env in envs.items()}  # all submitted before any wait: init blocks until all join
    here = socket.gethostname()
    name = getattr(fn, "__name__", repr(fn))

    def who(r: int) -> str:
        i = by_id[engine_of[r]]
        return f"rank {r} (engine {i['engine_id']}, node {i['node']}, pid {i['pid']})"

    def dead() -> list[int]:
        ids = set(client.ids)
        return [r for r in sorted(pending) if engine_of[r] not in ids or (
            by_id[engine_of[r]]["hostname"] == here and not _pid_alive(by_id[engine_of[r]]["pid"]))]

    def stop_others(exclude: int | None = None) -> None:
        alive = [engine_of[r] for r in sorted(pending) if r != exclude and engine_of[r] in client.ids]
        if alive:
            with contextlib.suppress(Exception):
                client.send_signal(signal.SIGINT, targets=alive, block=False)

    deadline = None if timeout is None else time.monotonic() + timeout
    shown = None
    pending = set(ars)
    with contextlib.ExitStack() as streams:
        if stream:
            for ar in ars.values():
                streams.enter_context(_stream_without_errors(ar))
        try:
            while pending:
                ars[min(pending)].wait(poll)
                gone = dead()
                if gone:
                    pending.discard(r := gone[0])
                    stop_others()
                    cause = death_cause(by_id[engine_of[r]]["pid"], local=by_id[engine_of[r]]["hostname"] == here)
                    raise DDPError(f"{who(r)}: engine died while running {name} ({cause}); the other ranks were "
                                   "interrupted. Restart the engines (labkit.cluster.restart_engines) and run "
                                   "again to resume from the last checkpoint", rank=r, engine_id=engine_of[r], died=True)
                failed = _failed_ranks(ars, pending)
                if failed:
                    first = min(failed)  # a rank's collective failed: is a peer gone?
                    _raise_if_lost(client, pending, engine_of, who, name,
                                   f"{who(first)} failed: {_first_line(failed[first])}", stop_others, failed[first])
                    stop_others()
                    raise _failure_error(failed, name, {r: by_id[engine_of[r]] for r in failed})
                shown = _show(lives, ars, shown, history)
                if pending and deadline is not None and time.monotonic() > deadline:
                    _raise_if_lost(client, pending, engine_of, who, name, f"timeout after {timeout} s", stop_others)
                    unfinished = ", ".join(who(r) for r in sorted(pending))
                    stop_others()
                    raise DDPError(f"timeout after {timeout} s: {unfinished} not finished")
            if stream:  # a result can arrive before the output printed ahead of it: drain the streams
                for ar in ars.values():
                    ar.wait_for_output(5)
        except KeyboardInterrupt:
            stop_others()
            _wait_quietly([ars[r] for r in sorted(pending)], 10.0)
            raise
        if lives:
            _final_show(lives, ars, shown, history)
    return [ars[r].get(0) for r in sorted(ars)]


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
    """After the run: the last records to every ``live`` callback, then their ``flush()``."""
    ars[0].wait_for_output(5)
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
    called after every live before it in the list, so their outputs keep the list's order.
    Returns the state."""
    shown = shown if shown is not None else {"records": None, "rows": {}, "timeline": None, "called": set()}
    records = (ars[0].data or {}).get("records") or []
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
    records = (ar.data or {}).get("records") or []
    key = (len(records), records[-1]) if records else None
    if records and key != shown:
        for cb in lives:
            cb(records)
        return key
    return shown


def run_ddp_resumable(cluster: ipp.Cluster, fn: Callable, *args: Any, restarts: int = 1,
                      targets: list[int] | None = None, **kwargs: Any) -> list[Any]:
    """`run_ddp` on the cluster's engines; after a DDPError, restart the engines and run again.

    fn must resume from its own newest checkpoint (labkit.train.train does with cfg.resume=True),
    so a rerun continues where the failed run stopped. A ``TrainConfig`` among the arguments with
    resume=False (a new run, which set an earlier run in its run_dir aside) is rerun with
    resume=True: the restart continues the run the first attempt started, whose id its
    checkpoints carry. At most `restarts` restarts; each is
    announced on stderr with the error. `targets` (None = all engines) only applies to the first
    attempt; after a restart all new engines are used. Keyword arguments go to `run_ddp`.
    Returns the results of the successful attempt; re-raises the last DDPError.
    """
    client = get_client(cluster)
    for attempt in range(restarts + 1):
        try:
            return run_ddp(client, fn, *args, targets=targets, **kwargs)
        except DDPError as err:
            if attempt == restarts:
                raise
            first_line = str(err).splitlines()[0]
            print(f"labkit: {first_line}\nlabkit: restarting the engines and resuming "
                  f"(restart {attempt + 1} of {restarts})", file=sys.stderr, flush=True)
            targets = restart_engines(cluster)
            args = tuple(_resuming(a) for a in args)
            kwargs = {k: _resuming(v) for k, v in kwargs.items()}
    raise AssertionError("unreachable")  # pragma: no cover


def _resuming(arg: Any) -> Any:
    """``arg`` with resume=True when it is a ``TrainConfig`` (the rerun continues the run), else ``arg``."""
    if isinstance(arg, TrainConfig) and not arg.resume:
        import dataclasses as _dc

        return _dc.replace(arg, resume=True)
    return arg


def train_on_cluster(client, cfg: TrainConfig, *, targets: list[int] | None = None,
                     staged: dict[str, dict] | None = None,
                     live: Callable[[list[dict]], None] | Sequence[Callable[[list[dict]], None]] | None = None,
                     timeout: float | None = None) -> dict:
    """Run ``labkit.train.train(cfg)`` under DDP on the engines (all, or ``targets``).

    With ``staged`` (the output of ``stage``), each rank reads the copy on its own node: the
    engine's node name picks ``staged[node]["path"]``. Returns rank 0's result dict (the same
    as ``<run_dir>/result.json``). ``live(records)`` is called about once a second with rank 0's
    recent metric records (a list of callables: each; ``labkit.rankview.RankView`` gets every
    rank's step timeline instead). With tp or pp > 1 (``labkit.train.parallel``) the split is checked
    here first: tp x pp must divide the engines and each tensor-parallel group must sit on one
    node (``labkit.cluster.topology.tensor_parallel_groups``); ValueError otherwise.
    """
    if cfg.parallel.is_split:
        from labkit.train.parallel import split_of

        infos = engine_info(client, targets, timeout=60)
        split_of(cfg, len(infos))
        tensor_parallel_groups(infos, cfg.parallel.tp)
    kwargs: dict[str, Any] = {}
    if staged is not None:
        kwargs["staged_paths"] = {node: info["path"] for node, info in staged.items()}
    results = run_ddp(client, _train_entry, cfg, targets=targets, live=live, timeout=timeout, **kwargs)
    return results[0]


def _train_entry(cfg: TrainConfig, *, sink=None, timeline_sink=None,
                 staged_paths: dict[str, str] | None = None) -> dict:
    """Engine side of ``train_on_cluster``: point data_dir at this node's staged copy, train."""
    import dataclasses as _dc

    from labkit.cluster.topology import node_name
    from labkit.train import train

    if staged_paths:
        node = node_name()
        if node not in staged_paths:
            raise RuntimeError(f"node {node!r} has no staged copy; staged nodes are {sorted(staged_paths)}")
        cfg = _dc.replace(cfg, data_dir=staged_paths[node])
    return train(cfg, sink=sink, timeline_sink=timeline_sink)
