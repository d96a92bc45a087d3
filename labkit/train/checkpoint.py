"""Checkpoints: ``checkpoints/step-N/``, one format for every mode (``FORMAT`` 2).

A step directory holds a run's state (``labkit.train.resume.RunState``): torch.distributed.checkpoint
(DCP) files of its tensors, {"model", "optim"} by ``BertMLM`` parameter name and each rank's comm
hook state, every rank writing its own part (``Checkpointer.save``); state.pt from rank 0 (step,
epoch, tokens, scaler, the global sampler state, the noise scale's averages, the run id and, per
rank, the RNG states: tensors, numbers and lists, so ``torch.load(weights_only=True)`` reads it);
and the ``MARKER`` file, written last. It is built under a temporary name and renamed to step-N
only when complete; an existing step-N is swapped out only then. ``Checkpointer.load`` is the
symmetric read: DCP reshards on load, so a checkpoint resumes at another world size, sharding or
split. ``load_weights`` reads the whole model in one process (export). A directory of format 1
(before DCP: model.safetensors + state.pt, or a split run's DCP without marker) is refused in one
line; ``labkit checkpoint upgrade RUN_DIR`` (``labkit.train.upgrade``) rewrites it once.

Run identity: every run has an id (``new_run_id``) in config.json and in every checkpoint.
``plan_run`` (rank 0) chooses where a run starts and refuses another run's checkpoint;
``agree_on_plan`` hands that to every rank and has each confirm it can read the step.
"""
from __future__ import annotations

import contextlib
import copy
import os
import pathlib
import shutil
import json
import tempfile
import time
import uuid
from typing import Any, Iterator

import torch

from labkit.io import atomic_dir, fsync_tree, replace
from labkit.train import dist, status

__all__ = [
    "checkpoint_steps", "read_state", "Checkpointer", "agree_on_plan", "checkpoint_run_id", "is_complete",
    "is_used", "load_weights", "new_run_id", "plan_run", "remove_leftovers", "saved_run_id", "set_aside"
]


def checkpoint_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints in run_dir/checkpoints (``step-N`` dirs), ascending.
    Temp dirs of an interrupted write (``.step-N.*.tmp``) are ignored."""
    ckdir = pathlib.Path(run_dir) / "checkpoints"
    if not ckdir.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in ckdir.iterdir() if p.name.startswith("step-") and p.name[5:].isdigit())


# ------------------------------------------------------------------------------------------
# Run identity: which run a run directory and each of its checkpoints belong to
# ------------------------------------------------------------------------------------------

RUN_FILES = ("checkpoints", "metrics.jsonl", "result.json", "config.json", "data.json", "configs", "tensorboard",
             "batch_changes.jsonl", "world_size_changes.jsonl")
"""What a run leaves in its run_dir; a new run in a used run_dir moves these to ``previous/``."""

PREVIOUS_DIR = "previous"
"""run_dir/previous/<UTC start>-<run id>/: the files of earlier runs set aside by ``plan_run``."""


def new_run_id() -> str:
    """A fresh run id: the UTC start time and 12 hex digits of a uuid4, e.g. ``20261201T182300Z-3f2a9c1e4b7d``
    (sortable by start; the random part tells apart runs started in the same second)."""
    return f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:12]}"


def saved_run_id(run_dir: str | os.PathLike) -> str | None:
    """The ``run_id`` in run_dir/config.json (None: no config.json, or one from before run ids)."""
    path = pathlib.Path(run_dir) / "config.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("run_id")


def checkpoint_run_id(path: str | os.PathLike) -> str | None:
    """The ``run_id`` stored in checkpoint directory ``path`` (None: a checkpoint from before run ids)."""
    return read_state(path).get("run_id")


def is_used(run_dir: str | os.PathLike) -> bool:
    """Whether ``run_dir`` holds any file a run leaves (``RUN_FILES``)."""
    return any((pathlib.Path(run_dir) / name).exists() for name in RUN_FILES)


def set_aside(run_dir: str | os.PathLike) -> pathlib.Path | None:
    """Move the files of the run in ``run_dir`` (``RUN_FILES``) into
    ``run_dir/previous/<UTC now>-<its run id, or "unnamed">/`` (renames: nothing copied, nothing
    deleted). Returns that directory, or None when run_dir holds none of them."""
    run_dir = pathlib.Path(run_dir)
    present = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if not present:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = run_dir / PREVIOUS_DIR / f"{stamp}-{saved_run_id(run_dir) or 'unnamed'}"
    k = 1
    while dest.exists():  # two set-asides in one second
        dest, k = dest.with_name(f"{dest.name.split('~')[0]}~{k}"), k + 1
    dest.mkdir(parents=True)
    for path in present:
        replace(path, dest / path.name)  # labkit.io: rename, then the directory fsynced
    return dest


def plan_run(run_dir: str | os.PathLike, resume: bool) -> dict[str, Any]:
    """Rank 0, before anything is written: which run this is and where it starts.

    With ``resume`` and a complete checkpoint in ``run_dir``, the newest one: its run id must be
    run_dir/config.json's (a checkpoint without an id, from before run ids, is taken as the run's).
    Its global batch goes into the plan (the run keeps it at any world size).
    Otherwise a new run: a fresh ``new_run_id``, and a used run_dir's files are first moved aside
    (``set_aside``). Returns {"step": resume step (0: fresh), "run_id", "set_aside": the directory
    the old run went to or None, "error": a one-line refusal or None, "global_batch_size": the
    checkpoint's, None for a fresh run or a format-1 checkpoint}; the error is returned, not
    raised, so that rank 0 can hand it to every rank (``agree_on_plan``) instead of leaving them
    waiting in a collective."""
    run_dir = pathlib.Path(run_dir)
    plan: dict[str, Any] = {"step": 0, "run_id": None, "set_aside": None, "error": None, "global_batch_size": None}
    try:
        steps = checkpoint_steps(run_dir) if resume else []
        if steps:
            path = run_dir / "checkpoints" / f"step-{steps[-1]}"
            state = read_state(path)
            ckpt_id, dir_id = state.get("run_id"), saved_run_id(run_dir)
            plan["global_batch_size"] = state.get("global_batch_size")
            if ckpt_id is not None and dir_id is not None and ckpt_id != dir_id:
                plan["error"] = (f"resume: checkpoint {path} belongs to run {ckpt_id}, but {run_dir} holds run "
                                 f"{dir_id} (config.json); move that checkpoint away, or set resume=False to set "
                                 "both aside and start a new run")
            return plan | {"step": steps[-1], "run_id": ckpt_id or dir_id or new_run_id()}
        aside = set_aside(run_dir) if is_used(run_dir) else None
        return plan | {"run_id": new_run_id(), "set_aside": None if aside is None else str(aside)}
    except (OSError, ValueError, RuntimeError) as err:  # e.g. an unreadable state.pt
        message = f"resume: cannot plan the run in {run_dir}: {type(err).__name__}: {err}"
        return plan | {"error": message.splitlines()[0]}


def agree_on_plan(plan: dict[str, Any] | None, run_dir: str | os.PathLike) -> dict[str, Any]:
    """Collective: rank 0's ``plan_run`` result on every rank; then every rank confirms that it
    can read the chosen checkpoint (``is_complete`` on its own view of run_dir, all-reduced)
    before any rank loads it. Raises ValueError (one line, the same on every rank) with rank 0's
    refusal, or naming the ranks that cannot read the step (a run_dir that is not shared, or a
    stale listing of a shared file system). Without a process group: ``plan`` checked alone."""
    import torch.distributed as tdist

    if tdist.is_initialized():
        box = [plan]
        tdist.broadcast_object_list(box, src=0)
        plan = box[0]
    assert plan is not None
    if plan["error"]:
        raise ValueError(plan["error"])
    if plan["step"]:
        path = pathlib.Path(run_dir) / "checkpoints" / f"step-{plan['step']}"
        rank, _, world = dist.dist_info()
        missing = torch.zeros(world, dtype=torch.int64)
        missing[rank] = 0 if is_complete(path) else 1
        if tdist.is_initialized() and tdist.get_backend() == "nccl":
            missing = missing.cuda()
        dist.all_reduce_sum(missing)
        bad = [r for r in range(world) if missing[r]]
        if bad:
            raise ValueError(f"resume: rank(s) {bad} cannot read checkpoints/step-{plan['step']} in their run_dir, "
                             "the checkpoint rank 0 chose to resume from (every rank must see the same run_dir: "
                             "use a shared file system)")
    return plan


def is_complete(path: str | os.PathLike) -> bool:
    """Whether this process sees checkpoint directory ``path`` complete: its ``MARKER`` (written
    last), or for a format-1 directory its state.pt and weights."""
    path = pathlib.Path(path)
    if (path / MARKER).is_file():
        return True
    return (path / "state.pt").is_file() and ((path / "model.safetensors").is_file() or (path / ".metadata").is_file())


@contextlib.contextmanager
def _replacing(final: pathlib.Path, built: pathlib.Path | None = None) -> Iterator[pathlib.Path]:
    """``labkit.io.atomic_dir(final)`` that may replace an existing ``final``: the new directory is
    built and made durable under a temporary name first (or is ``built``, already durable); only
    then is an old ``final`` renamed away (``.step-N.*.old``, ignored by ``checkpoint_steps``),
    the new one renamed into place and the old one deleted. A crash at any point leaves a
    complete step-N or the previous steps."""
    if built is None:
        with atomic_dir(final.parent / f".{final.name}.{os.getpid()}.new") as built_here:
            yield built_here
        built = final.parent / f".{final.name}.{os.getpid()}.new"
    else:
        yield built
    old = final.parent / f".{final.name}.{os.getpid()}.old"
    if final.exists():
        replace(final, old)
    replace(built, final)
    shutil.rmtree(old, ignore_errors=True)


FORMAT = 2
"""state.pt's ``format``: 2 = torch.distributed.checkpoint for every mode, global sampler state
(the noise scale's averages and the comm hook's state when the run has them). 1 = before:
model.safetensors + whole optimiser in state.pt (data parallel), or DCP for split runs with
per-rank sampler positions; refused, ``labkit checkpoint upgrade`` rewrites it."""

MARKER = "COMPLETE"
"""The file rank 0 writes last into a step directory, after every rank's part and state.pt."""


def _quiet(fn, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` without DCP's warning that a call with ``no_dist`` runs in one
    process (said on purpose here)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        return fn(*args, **kwargs)


def _no_dist() -> bool:
    """No process group: DCP reads and writes in this process alone (said, so it does not warn)."""
    return not torch.distributed.is_initialized()


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """state.pt of checkpoint directory ``path`` (``torch.load(weights_only=True)`` on CPU)."""
    return torch.load(pathlib.Path(path) / "state.pt", map_location="cpu", weights_only=True)


class Checkpointer:
    """Writes ``checkpoints/step-N/`` of a run: collective, every rank writes its own part.

    Layout: torch.distributed.checkpoint files (``.metadata``, ``__<rank>_0.distcp``) of the run
    state's tensors (each rank's shards; a replicated tensor written once, by one rank), then
    state.pt from rank 0 (the state's "run" fields: step, epoch, tokens, scaler, the global sampler
    state, the run id, ... plus ``ranks`` = [the "rank" entry of rank 0, 1, ...]: RNG states,
    small), then ``MARKER`` last. All of it goes into a temporary directory, which rank 0 renames to step-N
    once complete (``_replacing``: an existing step-N is swapped out only then), and prunes all
    but the newest ``keep``; each save first deletes what saves that never finished left
    (``remove_leftovers``).

    ``asynchronous``: ``torch.distributed.checkpoint.async_save`` copies the state to CPU memory
    (its ``DefaultStager``: new storage, so the next optimiser step cannot change what is
    written) and writes it in a background thread over a gloo process group of its own (created
    here, collectively), so training's collectives never interleave with the checkpoint's. Rank 0
    publishes the directory when its write has finished (DCP's coordinator writes ``.metadata``
    after every rank's data: ``poll`` at each record, or the next ``save`` / ``close``).

    ``stalls`` lists the seconds each save held up training on this rank (sync: the whole save;
    async: state dict, copy and planning), ``take()`` the sum since the last call.
    """

    def __init__(self, run_dir: str | os.PathLike, *, keep: int, asynchronous: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"keep_checkpoints: must be at least 1, got {keep}")
        self.run_dir, self.keep, self.asynchronous = pathlib.Path(run_dir), keep, asynchronous
        self.group = None
        if asynchronous and torch.distributed.is_initialized():
            self.group = dist.new_group(backend="gloo")  # collective, with the run's timeout
        self.pending: tuple[Any, pathlib.Path, pathlib.Path] | None = None  # (future, tmp, final)
        self.stalls: list[float] = []
        self.saved_s: list[float] = []  # seconds from the start of each save to its directory being complete
        self._started = 0.0
        self._untaken: list[float] = []
        self._executor = None

    def save(self, step: int, state: Any) -> float:
        """Collective: checkpoint step ``step`` of the run state ``state`` (its ``state_dict()``:
        {"tensors", "run", "rank"}, ``labkit.train.resume.RunState``; see the class). Returns this
        save's stall in seconds."""
        import torch.distributed.checkpoint as dcp

        status.update(phase="checkpoint")  # run_dir/ranks/rank-<r>.json (labkit.train.status)
        t0 = time.perf_counter()
        self.wait()
        full = state.state_dict()
        sd = full["tensors"]
        ranks = dist.all_gather_object(full["rank"])
        final = self.run_dir / "checkpoints" / f"step-{step}"
        tmp = None
        if dist.is_main():
            final.parent.mkdir(parents=True, exist_ok=True)
            remove_leftovers(final.parent)
            tmp = pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
            torch.save({**full["run"], "format": FORMAT, "ranks": ranks}, tmp / "state.pt")
        box = [str(tmp) if tmp is not None else None]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(box, src=0)
        tmp = pathlib.Path(box[0])
        self._started = t0
        if self.asynchronous:
            if _no_dist():  # one process: copy, then write in a thread of our own (DCP's would warn there)
                import concurrent.futures

                staged = {part: {k: v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
                                 for k, v in d.items()} for part, d in sd.items()}  # both flat: {name: tensor or number}
                self._executor = self._executor or concurrent.futures.ThreadPoolExecutor(max_workers=1)
                future = self._executor.submit(_quiet, dcp.save, staged, checkpoint_id=str(tmp), no_dist=True)
            else:
                future = dcp.async_save(sd, checkpoint_id=str(tmp), process_group=self.group)
            self.pending = (future, tmp, final)
        else:
            # returns once every rank's part and .metadata are written
            _quiet(dcp.save, sd, checkpoint_id=str(tmp), no_dist=_no_dist())
            self._publish(tmp, final)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self._untaken.append(stall)
        return stall

    def load(self, path: str | os.PathLike, state: Any) -> dict[str, Any]:
        """Collective: continue the run state ``state`` from checkpoint directory ``path``, the
        symmetric read of ``save``, at any world size, sharding or split: DCP reads, on each rank,
        the names and slices that rank holds of the tensors ``state.tensors_to_load`` asks for (an
        FSDP2 rank only its shards, a ZeRO-1 rank only its partition's optimiser state, the comm
        hook's tensors only at the same layout), then ``state.load_state_dict`` takes them with
        state.pt. Returns state.pt. ValueError (one line, on every rank) for a format-1 checkpoint."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        path = pathlib.Path(path)
        saved = read_state(path)
        if saved.get("format", 1) < FORMAT or not (path / ".metadata").is_file():
            raise ValueError(f"resume: {path} is a format-1 checkpoint (before torch.distributed.checkpoint); "
                             f"rewrite it once with: labkit checkpoint upgrade {self.run_dir}")
        meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        stored = {k: (m.size, m.properties.dtype) for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
        tensors = state.tensors_to_load(saved, stored)
        _quiet(dcp.load, tensors, checkpoint_id=str(path), no_dist=_no_dist())
        state.load_state_dict({"tensors": tensors, "run": saved, "ranks": saved["ranks"]})
        return saved

    def poll(self) -> None:
        """Publish a finished asynchronous save (rank 0); local, no collective."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the pending asynchronous save is written, then publish it (rank 0).
        Re-raises its error."""
        if self.pending is None:
            return
        future, tmp, final = self.pending
        self.pending = None
        future.result()
        self._publish(tmp, final)

    def close(self) -> None:
        """``wait`` for the last save, then free the checkpoint process group."""
        self.wait()
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def take(self) -> dict[str, float | None]:
        """{"checkpoint_stall_s": seconds of training stalled by the saves since the last call (None: none)}."""
        self.poll()
        out = {"checkpoint_stall_s": sum(self._untaken) if self._untaken else None}
        self._untaken = []
        return out

    def _publish(self, tmp: pathlib.Path, final: pathlib.Path) -> None:
        """Rank 0: write the marker last, make the directory durable, swap it in, prune."""
        self.saved_s.append(time.perf_counter() - self._started)
        if not dist.is_main():
            return
        state = read_state(tmp)
        (tmp / MARKER).write_text(json.dumps({"step": state["step"], "run_id": state.get("run_id"),
                                              "world_size": len(state["ranks"]), "format": FORMAT}) + "\n")
        fsync_tree(tmp)
        with _replacing(final, built=tmp):
            pass
        ckdir = final.parent
        for old in checkpoint_steps(self.run_dir)[:-self.keep]:
            shutil.rmtree(ckdir / f"step-{old}", ignore_errors=True)


def remove_leftovers(ckdir: pathlib.Path) -> list[str]:
    """Rank 0, at a save with no save of its own pending: delete the temporary directories of
    saves that never finished in ``ckdir`` (``.step-N.*.tmp`` being written, ``.step-N.*.new`` /
    ``.old`` being swapped in: a crash, a kill, a lost node). No other job writes there (the run
    directory's lock, ``labkit.train.runlock``). Returns their names."""
    gone = []
    for path in sorted(ckdir.glob(".step-*")):
        if path.is_dir() and path.name.endswith((".tmp", ".new", ".old")):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path.name)
    return gone


def load_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole model's weights {BertMLM name: tensor} of checkpoint directory ``path``, in one
    process (export, tests): DCP's ``model.*`` entries read at their full shapes. ValueError for a
    format-1 directory (model.safetensors: ``labkit checkpoint upgrade`` rewrites it),
    FileNotFoundError naming the directory when it is no checkpoint."""
    path = pathlib.Path(path)
    if (path / "model.safetensors").is_file():
        raise ValueError(f"{path}: a format-1 checkpoint (before torch.distributed.checkpoint); rewrite it once "
                         f"with: labkit checkpoint upgrade {path.parent.parent}")
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint (no .metadata)")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata()
    weights = {key[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype)
               for key, m in meta.state_dict_metadata.items()
               if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    _quiet(dcp.load, {"model": weights}, checkpoint_id=str(path), no_dist=True)
    return weights
