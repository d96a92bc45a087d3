"""Training runs on the engines that outlive a failure: restarted at the same size, or elastic.

- ``train_on_cluster``: ``labkit.train.train(cfg)`` under DDP on the engines (the notebooks' train
  helper, ``lab.train_on_cluster``); with ``restarts`` > 0 through ``run_ddp_resumable``.
- ``run_ddp_resumable``: ``run_ddp``; after a ``DDPError``, either restart every engine and run
  again at the same size (the default), or, with ``elastic=True``, go on with the engines left at
  a smaller world size and grow again when engines come back (``labkit.cluster.elastic``). Either
  way the function resumes from its newest checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import ipyparallel as ipp

from labkit.cluster import elastic as E
from labkit.cluster.engines import get_client, restart_engines
from labkit.cluster.launch import DDPError, _resuming, run_ddp
from labkit.cluster.topology import engine_info, tensor_parallel_groups
from labkit.config import TrainConfig
from labkit.io import atomic_write_json

__all__ = ["run_ddp_resumable", "train_on_cluster"]


def run_ddp_resumable(cluster: ipp.Cluster | ipp.Client, fn: Callable, *args: Any, restarts: int = 1,
                      targets: list[int] | None = None, elastic: bool = False, **kwargs: Any) -> list[Any]:
    """`run_ddp` on the cluster's engines; after a DDPError, run again from the newest checkpoint.

    fn must resume from its own newest checkpoint (labkit.train.train does with cfg.resume=True),
    so a rerun continues where the failed run stopped. A ``TrainConfig`` among the arguments with
    resume=False (a new run, which set an earlier run in its run_dir aside) is rerun with
    resume=True: the rerun continues the run the first attempt started, whose id its
    checkpoints carry. At most `restarts` reruns; each is announced on stderr with the error.
    Keyword arguments go to `run_ddp`. Returns the results of the successful attempt; re-raises
    the last DDPError.

    Without `elastic`: every engine is restarted (``restart_engines``: needs an ipyparallel
    Cluster) and the rerun uses all new engines; `targets` (None = all) applies to the first
    attempt only. With ``elastic=True`` (a TrainConfig argument needed: its run_dir, data
    parallelism only: parallel.tp = pp = 1): the rerun goes on with the engines of the failed run that are left
    (``elastic.survivors``; the most of them that keep the global batch, ``elastic.usable``) at
    that smaller world size; while it runs, engines that register anew join it at its next
    complete checkpoint (``elastic.GrowWatch``; each change of size counts against `restarts`).
    Each change is a line of run_dir/world_size_changes.jsonl (``elastic.ChangeLog``), and rank 0's
    result (and result.json) gets them as ``world_size_changes``. ValueError (one line) for
    elastic without a TrainConfig, with parallel.tp or pp > 1, or for ``restarts`` < 0.
    """
    if restarts < 0:
        raise ValueError(f"restarts: must be >= 0, got {restarts}")
    if elastic:
        client = cluster if isinstance(cluster, ipp.Client) else get_client(cluster)
        return _run_elastic(client, fn, args, kwargs, restarts=restarts, targets=targets)
    if isinstance(cluster, ipp.Client):
        raise ValueError("cluster: restarting the engines needs the ipyparallel Cluster (start_cluster's), not a Client")
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


def _run_elastic(client: ipp.Client, fn: Callable, args: tuple, kwargs: dict, *, restarts: int,
                 targets: list[int] | None) -> list[Any]:
    """``run_ddp_resumable(..., elastic=True)`` (its docstring)."""
    cfg = next((a for a in [*args, *kwargs.values()] if isinstance(a, TrainConfig)), None)
    if cfg is None:
        raise ValueError("elastic: needs a TrainConfig argument (its run_dir holds the checkpoints and the record)")
    if cfg.parallel.is_split:
        raise ValueError(f"elastic: data parallelism only, got parallel.tp {cfg.parallel.tp} and parallel.pp "
                         f"{cfg.parallel.pp}")
    engines = sorted(targets if targets is not None else client.ids)
    micro_batch = cfg.batch.micro_batch_size
    global_batch = micro_batch * cfg.batch.grad_accum_steps * len(engines)
    lives = kwargs.pop("live", None)
    lives = [] if lives is None else list(lives) if isinstance(lives, (list, tuple)) else [lives]
    log, gone = E.ChangeLog(cfg.run_dir), set()
    for attempt in range(restarts + 1):
        grow = E.GrowWatch(client, engines, cfg.run_dir, gone)
        try:
            results = run_ddp(client, fn, *args, targets=engines, live=[*lives, grow], **kwargs)
            return _finish(results, log, cfg.run_dir)
        except E.Regroup as why:
            when, reason = time.time(), f"engines came back: {why}"
            new = E.usable(sorted(set(engines) | set(grow.joined)), global_batch=global_batch, micro_batch=micro_batch)
        except DDPError as err:
            when, reason = time.time(), str(err).splitlines()[0]
            if attempt == restarts:
                log.complete()
                raise
            left = E.survivors(client, engines, wait_s=cfg.timeout_s + 10)
            new = E.usable(left, global_batch=global_batch, micro_batch=micro_batch)
            if not new:
                raise
        if attempt == restarts:
            break
        gone |= set(engines) - set(new)
        log.add(reason=reason, old=engines, new=new, error_time=when)
        print(f"labkit: {reason}\nlabkit: going on with {len(new)} ranks (world size {len(engines)} -> {len(new)}) "
              f"from the newest checkpoint (change {attempt + 1} of {restarts})", file=sys.stderr, flush=True)
        engines = new
        args = tuple(_resuming(a) for a in args)
        kwargs = {k: _resuming(v) for k, v in kwargs.items()}
    log.complete()
    raise RuntimeError(f"elastic: the run changed world size {restarts} times without finishing (restarts={restarts})")


def _finish(results: list[Any], log: E.ChangeLog, run_dir: str) -> list[Any]:
    """Complete the change records and put them into rank 0's result and result.json."""
    if not log.changes:
        return results
    changes = log.complete()
    if isinstance(results[0], dict):
        results[0] = {**results[0], "world_size_changes": changes}
        path = Path(run_dir) / "result.json"
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            saved = None
        if saved is not None:
            atomic_write_json(path, saved | {"world_size_changes": changes})
    return results


def train_on_cluster(client, cfg: TrainConfig, *, targets: list[int] | None = None,
                     staged: dict[str, dict] | None = None,
                     live: Callable[[list[dict]], None] | Sequence[Callable[[list[dict]], None]] | None = None,
                     timeout: float | None = None, elastic: bool = False, restarts: int = 1) -> dict:
    """Run ``labkit.train.train(cfg)`` under DDP on the engines (all, or ``targets``).

    With ``staged`` (the output of ``stage``), each rank reads the copy on its own node: the
    engine's node name picks ``staged[node]["path"]``. Returns rank 0's result dict (the same
    as ``<run_dir>/result.json``). ``live(records)`` is called about once a second with rank 0's
    recent metric records (a list of callables: each; ``labkit.rankview.RankView`` gets every
    rank's step timeline instead). With tp or pp > 1 (``labkit.train.parallel``) the split is checked
    here first: tp x pp must divide the engines and each tensor-parallel group must sit on one
    node (``labkit.cluster.topology.tensor_parallel_groups``); ValueError otherwise.
    ``elastic=True`` goes on without lost engines and grows back when they return, at most
    ``restarts`` changes of world size (``run_ddp_resumable``'s elastic run; the changes are in the
    result's ``world_size_changes``); without it a failure raises ``DDPError``.
    """
    if cfg.parallel.is_split:
        from labkit.train.parallel import split_of

        infos = engine_info(client, targets, timeout=60)
        split_of(cfg, len(infos))
        tensor_parallel_groups(infos, cfg.parallel.tp)
    kwargs: dict[str, Any] = {}
    if staged is not None:
        kwargs["staged_paths"] = {node: info["path"] for node, info in staged.items()}
    if elastic:
        return run_ddp_resumable(client, _train_entry, cfg, targets=targets, live=live, timeout=timeout,
                                 elastic=True, restarts=restarts, **kwargs)[0]
    return run_ddp(client, _train_entry, cfg, targets=targets, live=live, timeout=timeout, **kwargs)[0]


def _train_entry(cfg: TrainConfig, *, sink=None, timeline_sink=None,
                 staged_paths: dict[str, str] | None = None) -> dict:
    """Engine side of ``train_on_cluster``: point data_dir at this node's staged copy, train."""
    from labkit.cluster.topology import node_name
    from labkit.train import train

    if staged_paths:
        node = node_name()
        if node not in staged_paths:
            raise RuntimeError(f"node {node!r} has no staged copy; staged nodes are {sorted(staged_paths)}")
        cfg = dataclasses.replace(cfg, data_dir=staged_paths[node])
    return train(cfg, sink=sink, timeline_sink=timeline_sink)
