"""Tensor-parallel randomness: a per-tp-rank dropout stream inside tp regions, one shared stream outside.

Under tensor parallelism the ranks of a tp group hold different head slices (attention dropout) and,
with sequence parallelism, different sequence chunks (the hidden and embedding dropout between the
layers); a mask drawn from a stream the group shares would repeat the same pattern on every slice.
Outside those regions (the residual stream without sequence parallelism) the ranks compute the same
replicated activations and must draw the same mask. Megatron-LM keeps two streams for this
(``megatron/core/tensor_parallel/random.py``: the default generator for the replicated regions,
seeded alike across the tp group, and ``CudaRNGStatesTracker``'s "model-parallel-rng", seeded
per tp rank, entered with ``get_cuda_rng_tracker().fork()`` around the attention dropout).

labkit inverts which stream is the default, so the model's code needs no fork inside attention: in a
tensor-parallel run the default generator is the per-tp-rank stream (``seed_streams``), and the
dropout modules of the replicated regions (``ReplicatedDropout``, switched in from outside by
``labkit.train.tensor_parallel.apply_tensor_parallel``) draw from the ``replicated`` stream, seeded
alike across the group, through ``TRACKER.fork("replicated")``. Without tensor parallelism there is
no tracker state and the default generator is the only stream.

The tracker's states are part of a checkpoint's per-rank RNG state (``labkit.train.checkpoint``:
``state()`` / ``set_state()``), so a resumed run continues the same streams.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch
from torch import nn

__all__ = ["RNGTracker", "ReplicatedDropout", "seed_streams"]


class RNGTracker:
    """Named RNG streams of the device's default generator (CPU, or the current CUDA device's),
    entered with ``fork(name)``: the default generator's state is swapped for the stream's and back,
    the stream keeping what it drew (Megatron-LM ``CudaRNGStatesTracker``)."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.device = torch.device("cpu")

    def reset(self) -> None:
        """Forget every stream (a run without tensor parallelism has none)."""
        self.states = {}

    def _generator(self) -> torch.Generator:
        if self.device.type == "cuda":
            return torch.cuda.default_generators[self.device.index or 0]
        return torch.default_generator

    def add(self, name: str, seed: int, device: torch.device) -> None:
        """A stream ``name`` seeded with ``seed`` on ``device``'s default generator."""
        self.device = device
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.states[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Draw from stream ``name`` inside the block (KeyError when there is none)."""
        gen = self._generator()
        saved = gen.get_state()
        gen.set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = gen.get_state()
            gen.set_state(saved)

    def state(self) -> dict[str, torch.Tensor]:
        """{name: generator state (uint8 tensor)}: for a checkpoint's per-rank RNG state."""
        return {name: s.clone() for name, s in self.states.items()}

    def set_state(self, states: dict[str, torch.Tensor] | None) -> None:
        """Restore ``state()``'s result (None or {}: no streams)."""
        self.states = {name: s.clone() for name, s in (states or {}).items()}


TRACKER = RNGTracker()
"""This process's tracker (one process is one rank)."""


def seed_streams(seed: int, rank: int, world: int, tp: int, device: torch.device) -> None:
    """Seed this rank's dropout streams (torch, numpy, python) for a run on ``world`` ranks at
    tensor-parallel degree ``tp`` (tp innermost: the group of ``rank`` is ``rank // tp``).

    The replicated stream: ``seed + 1 + rank // tp``, alike across the tp group, different across
    data-parallel and pipeline ranks. With tp > 1 the default generator becomes the tp-region stream,
    ``seed + 1 + world + rank`` (different on every rank, and from every replicated stream), and the
    replicated one lives in ``TRACKER`` as "replicated"; with tp = 1 the default generator is the
    replicated stream and ``TRACKER`` is empty."""
    shared = seed + 1 + rank // tp
    TRACKER.reset()
    if tp > 1:
        TRACKER.add("replicated", shared, device)
    own = shared if tp == 1 else seed + 1 + world + rank
    torch.manual_seed(own)
    random.seed(own)
    np.random.seed(own)


class ReplicatedDropout(nn.Dropout):
    """``nn.Dropout`` drawing from ``TRACKER``'s "replicated" stream: the dropout of a replicated
    region of a tensor-parallel model (the same mask on every rank of the tp group)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with TRACKER.fork("replicated"):
            return super().forward(x)
