"""MLM batches from token shards: dataset, rank sampler, BERT masking collator, DataLoader.

Determinism and resume. Every random choice is a function of a seed and the data, never of
process state:

- ``RankSampler``: the epoch's order is ``torch.randperm`` from a ``torch.Generator`` seeded with
  ``seed + epoch``; rank r takes every world-th index, so batch k of rank r in epoch e is a pure
  function of (seed, epoch, rank, world_size, batch_size, k). ``{"epoch", "position"}`` resumes it.
- ``MLMCollator``: before each batch its ``torch.Generator`` is re-seeded from
  blake2b(seed, batch shape, batch token bytes). The same batch therefore gets the same masks on
  every run, whichever worker process, worker count or call order collates it, so a resumed run
  that replays batch k of (seed, epoch, rank) reproduces its masks exactly. Masks differ between
  epochs because the batches do (same sequences, different company); with batch_size 1 a
  sequence gets the same mask every epoch (BERT's static masking). ``seed=None`` draws from a
  randomly seeded generator instead (not reproducible).
"""

from __future__ import annotations

import hashlib
import multiprocessing
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from labkit.config import SPECIAL_TOKENS

IGNORE_INDEX = -100
"""Label of positions without MLM loss."""


class MLMCollator:
    """BERT masking (arXiv:1810.04805 section 3.1): choose each non-special token with probability
    ``mlm_probability``; of the chosen, 80 % become [MASK], 10 % a random id in
    [max(special_ids) + 1, vocab_size) (never special), 10 % stay. Special and pad ids are never
    chosen. See the module docstring for seeding.

    ``__call__(rows)``: list of [T] arrays or one [B, T] array of token ids (any integer dtype) ->
    {"input_ids": int64 [B, T], "labels": int64 [B, T] (original id where chosen, else -100),
    "attention_mask": bool [B, T] (input != pad_id)}. Raises ValueError naming vocab_size if an
    id is outside [0, vocab_size).
    """

    def __init__(self, *, vocab_size: int, mlm_probability: float = 0.15,
                 special_ids: Sequence[int] = tuple(range(len(SPECIAL_TOKENS))),
                 mask_id: int = SPECIAL_TOKENS.index("[MASK]"), pad_id: int = SPECIAL_TOKENS.index("[PAD]"),
                 seed: int | None = None) -> None:
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability: must be in (0, 1), got {mlm_probability}")
        if mask_id not in special_ids or pad_id not in special_ids:
            raise ValueError(f"special_ids: must contain mask_id {mask_id} and pad_id {pad_id}, got {tuple(special_ids)}")
        self.low = max(special_ids) + 1
        if vocab_size <= self.low:
            raise ValueError(f"vocab_size: must exceed the largest special id {self.low - 1}, got {vocab_size}")
        self.vocab_size, self.mlm_probability = vocab_size, mlm_probability
        self.special_ids = tuple(sorted(set(int(i) for i in special_ids)))
        self.mask_id, self.pad_id, self.seed = mask_id, pad_id, seed
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
        """Seed the generator from (seed, shape, bytes of the batch); no-op when seed is None."""
        if self.seed is None:
            return
        h = hashlib.blake2b(digest_size=8)
        h.update(np.array([self.seed, *x.shape], dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(x).tobytes())
        self.generator.manual_seed(int.from_bytes(h.digest(), "little") & (2**63 - 1))

    def __call__(self, rows: list[np.ndarray] | np.ndarray) -> dict[str, torch.Tensor]:
        x_np = np.stack(rows) if isinstance(rows, (list, tuple)) else np.asarray(rows)
        if x_np.ndim != 2:
            raise ValueError(f"rows: expected [B, T] token ids, got shape {x_np.shape}")
        x_np = x_np.astype(np.int64, copy=False)
        if x_np.size and (x_np.min() < 0 or x_np.max() >= self.vocab_size):
            raise ValueError(f"vocab_size: token ids must be in [0, {self.vocab_size}), "
                             f"got range [{x_np.min()}, {x_np.max()}]")
        self._reseed(x_np)
        x = torch.from_numpy(x_np)
        g = self.generator
        chosen = (torch.rand(x.shape, generator=g) < self.mlm_probability) & ~torch.isin(x, torch.tensor(self.special_ids))
        action = torch.rand(x.shape, generator=g)  # < 0.8 mask, [0.8, 0.9) random, >= 0.9 keep
        random_ids = torch.randint(self.low, self.vocab_size, x.shape, generator=g)
        input_ids = torch.where(chosen & (action < 0.8), self.mask_id, x)
        input_ids = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, input_ids)
        labels = torch.where(chosen, x, IGNORE_INDEX)
        return {"input_ids": input_ids, "labels": labels, "attention_mask": x != self.pad_id}


class ShardDataset(Dataset):
    """Sequences of a shard set (``labkit.data.shards``): ``ds[i]`` -> np.ndarray [seq_len] of the
    index's dtype. The memory maps open lazily in each process and are not pickled, so the
    dataset is cheap to send to spawn/forkserver workers. Raises ShardError (a ValueError) naming
    the file if index.json or a shard is missing or malformed."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = str(data_dir)
        reader = self._open()
        self.seq_len, self.vocab_size, self.index = reader.seq_len, reader.vocab_size, reader.index
        self._n = len(reader)

    def _open(self):
        from labkit.data.shards import SequenceReader

        self._reader = SequenceReader(self.data_dir)
        return self._reader

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> np.ndarray:
        reader = self._reader if self._reader is not None else self._open()
        return np.asarray(reader[int(i)])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None}


class RankSampler(Sampler[list[int]]):
    """Batches of sample indices for one data-parallel rank (a ``batch_sampler``).

    Epoch e's order is ``torch.randperm(n_samples)`` from a generator seeded with ``seed + e``.
    With drop_last, the first (n // (world*batch)) * world*batch indices are kept and rank r takes
    ``kept[r::world]``: disjoint, equal-length partitions, only the tail dropped. Without
    drop_last the order is extended cyclically to a multiple of world*batch (some samples repeat)
    so every rank still has the same number of full batches. Each rank yields
    ``len(self)`` batches of ``batch_size`` per epoch.

    ``position`` counts the batches of the current epoch this sampler has yielded; after the last
    one it moves to epoch + 1, position 0. ``load_state_dict({"epoch", "position"})`` makes the
    next iteration yield exactly the remaining batches. A DataLoader with workers draws batches
    ahead of the trainer, so a trainer should checkpoint {"epoch", "position": batches it consumed}.
    """

    def __init__(self, n_samples: int, *, rank: int, world_size: int, batch_size: int, seed: int = 0,
                 drop_last: bool = True) -> None:
        if world_size < 1:
            raise ValueError(f"world_size: must be at least 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be positive, got {batch_size}")
        per_step = world_size * batch_size
        self.num_batches = n_samples // per_step if drop_last else -(-n_samples // per_step)
        if self.num_batches == 0:
            raise ValueError(f"n_samples: {n_samples} sequences cannot fill one batch of {batch_size} "
                             f"on each of {world_size} ranks")
        self.n_samples, self.rank, self.world_size, self.batch_size = n_samples, rank, world_size, batch_size
        self.seed, self.drop_last = seed, drop_last
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch."""
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at batch ``position`` of ``epoch``; ValueError naming position if out of range."""
        if not 0 <= state["position"] <= self.num_batches:
            raise ValueError(f"position: must be in [0, {self.num_batches}], got {state['position']}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def batches(self, epoch: int) -> torch.Tensor:
        """int64 [len(self), batch_size]: this rank's batches of ``epoch``."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.n_samples, generator=g)
        total = self.num_batches * self.world_size * self.batch_size
        if total > self.n_samples:
            order = order.repeat(-(-total // self.n_samples))
        return order[:total][self.rank::self.world_size].view(self.num_batches, self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches(self.epoch)
        while self.position < self.num_batches:
            batch = batches[self.position].tolist()
            self.position += 1
            yield batch
        self.epoch, self.position = self.epoch + 1, 0


def _worker_context() -> str:
    """forkserver where the platform has it, else spawn: never fork a process that may run
    tokenizers/polars/OpenMP thread pools (cpython gh-90622)."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def make_loader(data_dir: str, *, batch_size: int, rank: int, world_size: int, seed: int,
                mlm_probability: float, vocab_size: int, num_workers: int = 0,
                pin_memory: bool = False) -> DataLoader:
    """DataLoader of MLM batches for one rank: ``ShardDataset`` + ``RankSampler`` (as
    batch_sampler, drop_last) + ``MLMCollator``. Workers (num_workers > 0) are persistent and
    started with forkserver/spawn; ``loader.batch_sampler`` holds the resume state. Raises
    ValueError naming vocab_size if it is smaller than the shard set's."""
    dataset = ShardDataset(data_dir)
    if vocab_size < dataset.vocab_size:
        raise ValueError(f"vocab_size: {vocab_size} is smaller than the shards' vocab_size {dataset.vocab_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers: must be >= 0, got {num_workers}")
    sampler = RankSampler(len(dataset), rank=rank, world_size=world_size, batch_size=batch_size, seed=seed)
    collator = MLMCollator(vocab_size=vocab_size, mlm_probability=mlm_probability, seed=seed)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collator, num_workers=num_workers,
                      pin_memory=pin_memory, persistent_workers=num_workers > 0,
                      multiprocessing_context=_worker_context() if num_workers > 0 else None)
