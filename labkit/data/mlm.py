"""MLM batches from token shards: dataset, rank sampler, BERT masking collator, DataLoader.

The path of one batch (docs/data_path.md): ``RankSampler`` yields a list of sequence ids ->
``ShardDataset.__getitems__`` gathers them from the shards (``labkit.data.shards.ShardSet``: one
``preadv`` per run of consecutive rows of a shard, each shard's identity checked after the read)
-> ``MLMCollator`` masks the [B, T] block with whole-tensor torch ops -> in a worker, the arrays
cross the pipe as an ``ArrayBatch`` -> ``MLMLoader`` yields dicts of tensors.
``check_shards`` (called by ``make_loader``) stops a run on a shard set that is not the one the
run expects, before any model is built.

Determinism and resume. Every random choice is a function of a seed and the data, never of
process state:

- ``RankSampler``: epoch e's order is ``torch.randperm`` from a ``torch.Generator`` seeded with
  ``seed + e``; the epochs follow one another as one global sample stream (nothing dropped), cut
  into micro-batches of consecutive samples, and rank r takes every world-th micro-batch. The
  global micro-batch sequence does not depend on world_size, and the sampler's whole state is
  the global sample position (``RankSampler.state_at``), which resumes it at any world size.
- ``MLMCollator``: before each batch its ``torch.Generator`` is re-seeded from
  blake2b(seed, batch shape, batch ids as uint32 bytes). The same batch therefore gets the same masks on
  every run, whichever worker process, worker count or call order collates it, so a resumed run
  that replays batch k of (seed, epoch, rank) reproduces its masks exactly. Masks differ between
  epochs because the batches do (same sequences, different company); with batch_size 1 a
  sequence gets the same mask every epoch (BERT's static masking). ``seed=None`` draws from a
  randomly seeded generator instead (not reproducible).
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from labkit.config import SPECIAL_TOKENS
from labkit.data.shards import ShardSet, check_shards

__all__ = ["IGNORE_INDEX", "ArrayBatch", "dense_labels", "index_special_ids", "make_loader", "MLMCollator",
           "MLMLoader", "RankSampler", "ShardDataset"]

IGNORE_INDEX = -100
"""Label of positions without MLM loss."""


class MLMCollator:
    """BERT masking (arXiv:1810.04805 section 3.1): choose each non-special token with probability
    ``mlm_probability``; of the chosen, 80 % become [MASK], 10 % a random id in
    [max(special_ids) + 1, vocab_size) (never special), 10 % stay. Special and pad ids are never
    chosen. See the module docstring for seeding.

    One uniform draw u per position decides both: chosen iff u < p; then [MASK] iff u < 0.8 p,
    random iff 0.8 p <= u < 0.9 p, kept otherwise (given u < p, u / p is uniform on [0, 1)).
    Random ids are drawn only for the positions that get one, in row-major order.

    ``__call__(rows)``: list of [T] arrays or one [B, T] array of token ids (any integer dtype) ->
    {"input_ids": int64 [B, T], "labels": int64 [B, T] (original id where chosen, else -100),
    "attention_mask": bool [B, T] (input != pad_id)}. With ``compact=True`` the dense labels are
    replaced by "masked_positions": int64 [n_masked] (flat row-major indices into B*T, ascending)
    and "masked_labels": int64 [n_masked] (the original ids there): 16 bytes per masked position
    instead of 8 per position, and exactly the rows a sparse MLM head gathers
    (``hidden.reshape(B*T, H)[masked_positions]`` equals ``hidden[labels != -100]``);
    ``dense_labels`` rebuilds the labels. Raises ValueError naming vocab_size if an id is outside
    [0, vocab_size).
    """

    def __init__(self, *, vocab_size: int, mlm_probability: float = 0.15,
                 special_ids: Sequence[int] = tuple(range(len(SPECIAL_TOKENS))),
                 mask_id: int = SPECIAL_TOKENS.index("[MASK]"), pad_id: int = SPECIAL_TOKENS.index("[PAD]"),
                 seed: int | None = None, compact: bool = False) -> None:
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability: must be in (0, 1), got {mlm_probability}")
        if mask_id not in special_ids or pad_id not in special_ids:
            raise ValueError(f"special_ids: must contain mask_id {mask_id} and pad_id {pad_id}, got {tuple(special_ids)}")
        self.low = max(special_ids) + 1
        if vocab_size <= self.low:
            raise ValueError(f"vocab_size: must exceed the largest special id {self.low - 1}, got {vocab_size}")
        self.vocab_size, self.mlm_probability = vocab_size, mlm_probability
        self.special_ids = tuple(sorted(set(int(i) for i in special_ids)))
        self.mask_id, self.pad_id, self.seed, self.compact = mask_id, pad_id, seed, compact
        self.generator = self._new_generator()

    def _new_generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        return g

    def __getstate__(self) -> dict:
        """Pickled without tensors or generator (sent to spawn/forkserver workers as plain data)."""
        return {k: v for k, v in self.__dict__.items() if k != "generator"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.generator = self._new_generator()

    def _reseed(self, x: np.ndarray) -> None:
        """Seed the generator from (seed, shape, ids of the batch as little-endian uint32, so
        uint16 and uint32 shards of the same ids mask alike); no-op when seed is None."""
        if self.seed is None:
            return
        h = hashlib.blake2b(digest_size=8)
        h.update(np.array([self.seed, *x.shape], dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(x, dtype="<u4").tobytes())
        self.generator.manual_seed(int.from_bytes(h.digest(), "little") & (2**63 - 1))

    def _special(self, x: torch.Tensor) -> torch.Tensor:
        if self.special_ids == tuple(range(self.low)):  # labkit's ids 0..4: one comparison
            return x < self.low
        return torch.isin(x, torch.tensor(self.special_ids))

    def _mask(self, rows: list[np.ndarray] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(original ids int64 [B, T], input ids int64 [B, T], chosen bool [B, T])."""
        x_np = np.stack(rows) if isinstance(rows, (list, tuple)) else np.asarray(rows)
        if x_np.ndim != 2:
            raise ValueError(f"rows: expected [B, T] token ids, got shape {x_np.shape}")
        if x_np.size and (x_np.min() < 0 or x_np.max() >= self.vocab_size):
            raise ValueError(f"vocab_size: token ids must be in [0, {self.vocab_size}), "
                             f"got range [{x_np.min()}, {x_np.max()}]")
        self._reseed(x_np)
        x = torch.from_numpy(x_np.astype(np.int64, copy=False))
        g, p = self.generator, self.mlm_probability
        u = torch.rand(x.shape, generator=g)
        chosen = (u < p) & ~self._special(x)
        input_ids = x.masked_fill(chosen & (u < 0.8 * p), self.mask_id)
        randomise = chosen & (u >= 0.8 * p) & (u < 0.9 * p)
        n_random = int(randomise.sum())
        input_ids[randomise] = torch.randint(self.low, self.vocab_size, (n_random,), generator=g)
        return x, input_ids, chosen

    def __call__(self, rows: list[np.ndarray] | np.ndarray) -> dict[str, torch.Tensor]:
        x, input_ids, chosen = self._mask(rows)
        out = {"input_ids": input_ids, "attention_mask": x != self.pad_id}
        if self.compact:
            positions = chosen.view(-1).nonzero().squeeze(1)  # [n_masked], row-major
            out.update(masked_positions=positions, masked_labels=x.view(-1)[positions])
        else:
            out["labels"] = torch.where(chosen, x, IGNORE_INDEX)
        return out

    def packed(self, rows: list[np.ndarray] | np.ndarray) -> ArrayBatch:
        """The batch ``__call__`` returns, as a small ``ArrayBatch`` for the trip out of a worker."""
        x, input_ids, chosen = self._mask(rows)
        positions = chosen.view(-1).nonzero().squeeze(1)  # [n_masked], row-major
        narrow = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        return ArrayBatch(input_ids.numpy().astype(narrow), positions.numpy().astype(np.int32),
                          x.view(-1)[positions].numpy().astype(narrow), pad_id=self.pad_id, compact=self.compact)


def dense_labels(masked_positions: torch.Tensor, masked_labels: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """int64 ``shape`` [B, T] labels from a compact batch: -100 except ``masked_labels`` at the flat
    row-major ``masked_positions``."""
    labels = torch.full((shape[0] * shape[1],), IGNORE_INDEX, dtype=torch.int64, device=masked_labels.device)
    labels[masked_positions] = masked_labels
    return labels.view(shape)


class ShardDataset(Dataset):
    """Sequences of a shard set (``labkit.data.shards``), read on demand; nothing loads the whole
    set. ``ds[i]`` -> np.ndarray [seq_len] of the index's dtype (uint16/uint32);
    ``ds.__getitems__(ids)`` -> np.ndarray [len(ids), seq_len], one ``preadv`` per run of
    consecutive rows of a shard touched (the DataLoader calls it once per batch when a
    batch_sampler is used). ``data``: a directory, or a ``labkit.data.shards.ShardSet`` already
    opened (used as is: its index is not read again). Reads through the ``ShardSet``:
    descriptors open lazily, at most ``max_open`` at a time (an LRU), and are not pickled, so the
    dataset is cheap to send to spawn/forkserver workers. Raises ShardError (a ValueError) naming
    the file if index.json or a shard is missing or malformed, a shard's size differs from the
    index, or a shard changed since the set was opened (in a worker too: the DataLoader
    re-raises it in the main process)."""

    def __init__(self, data: str | os.PathLike | ShardSet, *, max_open: int = 64) -> None:
        self._reader = data if isinstance(data, ShardSet) else ShardSet(data, max_open=max_open)  # checks every entry
        self.data_dir = str(self._reader.data_dir)
        self.seq_len, self.vocab_size = self._reader.seq_len, self._reader.vocab_size
        self.index, self._n = self._reader.index, len(self._reader)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> np.ndarray:
        return self.__getitems__([i])[0]

    def __getitems__(self, ids: Sequence[int]) -> np.ndarray:
        return self._reader.rows(ids)


class RankSampler(Sampler[list[int]]):
    """Micro-batches of sample indices for one data-parallel rank (a ``batch_sampler``).

    ``n_samples``: the count of sequences, or the opened ``ShardSet`` (its ``len``).

    One global sample stream, whatever the world size: epoch e is ``torch.randperm(n_samples)``
    from a generator seeded with ``seed + e``, and the stream is epoch 0, epoch 1, ... with no
    sample dropped (the micro-batch at an epoch's end takes the rest from the next epoch). From
    the stream position ``start`` (0 for a fresh run; a checkpoint's global sample position on
    resume) the micro-batches are consecutive runs of ``batch_size`` samples, and rank r takes
    micro-batches r, r + world, r + 2 world, ...: its i-th starts at sample
    ``start + (i * world + r) * batch_size``. k steps of dp ranks x a accumulated micro-batches
    therefore consume the stream's next k * a * dp * batch_size samples for any split of a * dp,
    and the whole state is one number, the global sample position, which resumes at any world
    size or batch size (``state_at`` / ``load_state_dict``).

    Iteration is by epoch: ``iter`` yields this rank's micro-batches that start in epoch
    ``epoch`` (``len(self)`` of them), from ``position`` on, then moves to epoch + 1, position 0.
    """

    def __init__(self, n_samples: int | ShardSet, *, rank: int, world_size: int, batch_size: int, seed: int = 0,
                 start: int = 0) -> None:
        n_samples = len(n_samples) if isinstance(n_samples, ShardSet) else int(n_samples)
        if world_size < 1:
            raise ValueError(f"world_size: must be at least 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be positive, got {batch_size}")
        if n_samples < world_size * batch_size:
            raise ValueError(f"n_samples: {n_samples} sequences cannot fill one batch of {batch_size} "
                             f"on each of {world_size} ranks")
        self.n_samples, self.rank, self.world_size, self.batch_size = n_samples, rank, world_size, batch_size
        self.seed = seed
        self._orders: dict[int, torch.Tensor] = {}
        self._restart(start)

    def _restart(self, start: int) -> None:
        """Continue the stream at global sample ``start``: this rank's first micro-batch, and so
        its epoch, follow from it."""
        self.start = int(start)
        self.epoch, self.position = (self.start + self.rank * self.batch_size) // self.n_samples, 0

    def _first(self, epoch: int) -> int:
        """The index i of this rank's first micro-batch (since ``start``) that starts in ``epoch``."""
        step = self.world_size * self.batch_size
        lead = epoch * self.n_samples - self.start - self.rank * self.batch_size
        return max(0, -(-lead // step))

    def __len__(self) -> int:
        """This rank's micro-batches that start in the current epoch (since ``start``)."""
        return self._first(self.epoch + 1) - self._first(self.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Go to epoch ``epoch``, its first micro-batch."""
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        """``state_at`` this sampler's own epoch and position."""
        return self.state_at(self.epoch, self.position)

    def state_at(self, epoch: int, position: int) -> dict[str, int]:
        """The global state after this rank consumed ``position`` micro-batches of ``epoch`` (every
        rank consumed as many): {"samples": the global sample position, the stream samples all
        ranks consumed, "epoch": its epoch, "batch_size", "world_size", "n_samples"}. The same on
        every rank."""
        samples = self.start + (self._first(epoch) + int(position)) * self.world_size * self.batch_size
        return {"samples": samples, "epoch": samples // self.n_samples, "batch_size": self.batch_size,
                "world_size": self.world_size, "n_samples": self.n_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after the global sample position of ``state`` (``state_at``'s), at this
        sampler's world size and batch size. A state from before global sample positions reads as
        the same place in the same epoch: {"epoch", "micro_batches" (global, of that epoch),
        "batch_size"} (format 2) or this rank's {"epoch", "position"} at an unchanged world size
        (format 1). ValueError, one line, for a state of another shard set (``n_samples``)."""
        if "samples" in state:
            if state.get("n_samples", self.n_samples) != self.n_samples:
                raise ValueError(f"sampler: the saved position is in a stream of {state['n_samples']} samples an "
                                 f"epoch; this shard set has {self.n_samples}")
            samples = int(state["samples"])
        elif "micro_batches" in state:
            samples = int(state["epoch"]) * self.n_samples + int(state["micro_batches"]) * int(state["batch_size"])
        else:
            position = int(state["position"]) * self.world_size * self.batch_size
            samples = int(state["epoch"]) * self.n_samples + position
        self._restart(samples)

    def _order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s permutation (the last two are kept: a pass reads at most two)."""
        if epoch not in self._orders:
            while len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._orders[epoch] = torch.randperm(self.n_samples, generator=g)
        return self._orders[epoch]

    def batches(self, epoch: int) -> torch.Tensor:
        """int64 [micro-batches, batch_size]: this rank's micro-batches that start in ``epoch``."""
        first, last = self._first(epoch), self._first(epoch + 1)
        b, step = self.batch_size, self.world_size * self.batch_size
        starts = self.start + torch.arange(first, last, dtype=torch.int64) * step + self.rank * b
        where = starts[:, None] + torch.arange(b, dtype=torch.int64)  # stream positions [micro-batches, b]
        out = torch.empty_like(where)
        for e in torch.unique(where // self.n_samples).tolist():  # this epoch and, at its end, the next
            mask = where // self.n_samples == e
            out[mask] = self._order(e)[where[mask] % self.n_samples]
        return out

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches(self.epoch)
        while self.position < len(batches):
            batch = batches[self.position].tolist()
            self.position += 1
            yield batch
        self.epoch, self.position = self.epoch + 1, 0


def _worker_context() -> str:
    """forkserver where the platform has it, else spawn: never fork a process that may run
    tokenizers/polars/OpenMP thread pools (cpython gh-90622)."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _worker_init(rank_pid: int, worker_id: int) -> None:
    """In each DataLoader worker: die with the rank (``_die_with``), tokenizers stays
    single-threaded (and silent) should anything there tokenize, and torch uses one intra-op
    thread (the rank's cores belong to the trainer)."""
    _die_with(rank_pid)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    torch.set_num_threads(1)


def _die_with(rank_pid: int, interval_s: float = 1.0) -> None:
    """Make this worker process end when the rank process ``rank_pid`` that started it ends, however
    it ends (a SIGKILL runs no cleanup): the kernel sends SIGKILL when this process's parent dies
    (Linux ``prctl(PR_SET_PDEATHSIG)``; the parent is the rank, or the rank's forkserver, which ends
    with it), and a daemon thread checks every ``interval_s`` that ``rank_pid`` still exists (any
    platform; the fallback). Without this a worker whose result sits in a full pipe blocks in its
    exit forever (torch's watchdog only runs between indices)."""
    import ctypes
    import signal
    import threading

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            try:
                os.kill(rank_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # exists (another user's: a reused pid)
                pass
            threading.Event().wait(interval_s)

    threading.Thread(target=watch, name="labkit-rank-watch", daemon=True).start()


class ArrayBatch:
    """A masked batch on its way out of a DataLoader worker, small enough to cross the worker's
    pipe in one piece: input ids [B, T] and masked labels [n_masked] as uint16 (uint32 above
    65,536 ids), masked positions [n_masked] as int32 (flat, row-major); 47 kB for 32 x 512 at
    15 % masking instead of 272 kB of int64/bool tensors. A Linux pipe holds 64 kB, so a larger
    batch crosses in pieces, with the worker's feeder thread rescheduled in between; handing over
    torch tensors instead costs a shared-memory segment and a passed file descriptor per tensor.
    Measured receive times are in docs/data_path.md.
    ``tensors()`` rebuilds exactly the collator's dict (attention_mask = input_ids != pad, which
    masking never changes); ``pin_memory()``, called by the DataLoader's pin-memory thread, also
    pins it."""

    def __init__(self, input_ids: np.ndarray, masked_positions: np.ndarray, masked_labels: np.ndarray, *,
                 pad_id: int, compact: bool) -> None:
        self.input_ids, self.masked_positions, self.masked_labels = input_ids, masked_positions, masked_labels
        self.pad_id, self.compact = pad_id, compact

    def tensors(self) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.input_ids.astype(np.int64))
        positions = torch.from_numpy(self.masked_positions.astype(np.int64))
        labels = torch.from_numpy(self.masked_labels.astype(np.int64))
        out = {"input_ids": ids, "attention_mask": ids != self.pad_id}
        if self.compact:
            out.update(masked_positions=positions, masked_labels=labels)
        else:
            out["labels"] = dense_labels(positions, labels, tuple(ids.shape))
        return out

    def pin_memory(self, device: str | None = None) -> dict[str, torch.Tensor]:
        return {k: t.pin_memory() for k, t in self.tensors().items()}


class _Packed:
    """collate_fn for workers: ``collator.packed``."""

    def __init__(self, collator: MLMCollator) -> None:
        self.collator = collator

    def __call__(self, rows) -> ArrayBatch:
        return self.collator.packed(rows)


def _as_tensors(batches: Iterator) -> Iterator[dict[str, torch.Tensor]]:
    """The batches as dicts of tensors. An error re-raised from a worker (``ShardError`` of a
    shard that changed, ...) leaves here with the frames it passed through in the DataLoader
    cleared (``traceback.clear_frames``): torch's ``ExceptionWrapper.reraise`` holds the
    exception in a local of its own frame, a reference cycle through the traceback that keeps
    every caller's frame alive until the garbage collector runs -- the trainer's model, and with
    it the process group, whose connections then stay open, so the other ranks would wait in
    their next collective until the timeout instead of failing at once when this rank gives up."""
    import traceback

    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as err:
            traceback.clear_frames(err.__traceback__)  # this frame is executing: left as it is
            raise
        yield batch.tensors() if isinstance(batch, ArrayBatch) else batch


class MLMLoader(DataLoader):
    """A DataLoader whose iterator turns ``ArrayBatch`` es from workers back into dicts of tensors;
    otherwise a plain DataLoader (``batch_sampler`` is the ``RankSampler``). ``iter(loader)``
    creates the DataLoader iterator at once, so it draws its base seed from torch's global RNG
    when called, exactly as a plain DataLoader (a resumed trainer restores the RNG after it)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return _as_tensors(super().__iter__())


def index_special_ids(index: dict) -> tuple[int, ...]:
    """The special ids of a shard set (its ``index.json``'s "special_ids" values): what masking
    never chooses nor draws. Ids 0..5 for current tokenizers, 0..4 for sets built before [NEXT]."""
    return tuple(sorted(int(i) for i in index["special_ids"].values()))


def make_loader(data: str | os.PathLike | ShardSet, *, batch_size: int, rank: int, world_size: int, seed: int,
                mlm_probability: float, vocab_size: int, num_workers: int = 0,
                pin_memory: bool = False, prefetch_factor: int = 2, seq_len: int | None = None,
                dtype: str | None = None, tokenizer_sha256: str | None = None, verify: bool = False,
                compact: bool = False) -> DataLoader:
    """DataLoader of MLM batches for one rank: ``ShardDataset`` + ``RankSampler`` (as
    batch_sampler, so the dataset is read once per batch) + ``MLMCollator``
    (``compact`` as there; the special ids those of the set's index). ``loader.batch_sampler``
    holds the resume state.

    Workers (num_workers > 0) are persistent, keep ``prefetch_factor`` batches each in flight,
    start with forkserver/spawn (never fork: the parent may run tokenizers/polars/OpenMP thread
    pools, and a forked child of a threaded process can deadlock) and run ``_worker_init`` (they die
    with the rank, ``_die_with``; TOKENIZERS_PARALLELISM=false, one torch thread). They send batches as a compact
    ``ArrayBatch``; the loader yields the collator's dicts of tensors either way. ``pin_memory``
    (for a CUDA trainer) pins them in the DataLoader's pin-memory thread.

    ``data``: the shard set's directory, or the ``ShardSet`` the run opened (``open_shards``):
    then its index is not read again, and the dataset reads through it, so a shard that changes
    after it was opened raises ``ShardError`` naming the file and what changed, here or in a
    worker (``labkit.data.shards.ShardSet``). Before anything is built, ``check_shards``
    compares the set with the given seq_len, dtype, tokenizer_sha256 and vocab_size (and with
    ``verify`` the shards' sha256, once per ``ShardSet``): ShardError naming index.json and what
    differs. ValueError naming num_workers / prefetch_factor if negative.
    """
    shards = data if isinstance(data, ShardSet) else ShardSet(data)
    index = check_shards(shards, seq_len=seq_len, dtype=dtype, vocab_size=vocab_size,
                         tokenizer_sha256=tokenizer_sha256, verify=verify)
    if num_workers < 0:
        raise ValueError(f"num_workers: must be >= 0, got {num_workers}")
    if prefetch_factor < 1:
        raise ValueError(f"prefetch_factor: must be >= 1, got {prefetch_factor}")
    dataset = ShardDataset(shards)
    sampler = RankSampler(shards, rank=rank, world_size=world_size, batch_size=batch_size, seed=seed)
    collator = MLMCollator(vocab_size=vocab_size, mlm_probability=mlm_probability, seed=seed, compact=compact,
                           special_ids=index_special_ids(index))
    workers = dict(multiprocessing_context=_worker_context(), persistent_workers=True,
                   prefetch_factor=prefetch_factor,
                   worker_init_fn=functools.partial(_worker_init, os.getpid())) if num_workers else {}
    return MLMLoader(dataset, batch_sampler=sampler, collate_fn=_Packed(collator) if num_workers else collator,
                     num_workers=num_workers, pin_memory=pin_memory, **workers)
