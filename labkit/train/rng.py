"""Randomness of a run: one stream per region kind, the same rule at every layout and after every resume.

Under tensor parallelism the ranks of a tp group hold different head slices (attention dropout) and,
with sequence parallelism, different sequence chunks (the hidden and embedding dropout between the
layers); a mask drawn from a stream the group shares would repeat the same pattern on every slice.
Outside those regions (the residual stream without sequence parallelism) the ranks compute the same
replicated activations and must draw the same mask. Megatron-LM keeps two streams for this
(``megatron/core/tensor_parallel/random.py``: the default generator for the replicated regions,
seeded alike across the tp group, and ``CudaRNGStatesTracker``'s "model-parallel-rng", seeded
per tp rank, entered with ``get_cuda_rng_tracker().fork()`` around the attention dropout).

labkit inverts which stream is the default, so the model's code needs no fork inside attention: in a
tensor-parallel run the default generator is the per-tp-rank stream, and the dropout modules of the
replicated regions (``ReplicatedDropout``, switched in from outside by
``labkit.train.tensor_parallel.apply_tensor_parallel``) draw from the ``replicated`` stream through
``TRACKER.fork("replicated")``. Without tensor parallelism there is no tracker state and the default
generator is the replicated stream.

The rule, at every layout (``seed_streams``): rank (pp_rank p, dp_rank d, tp_rank t) draws its
replicated regions from stream (p, d), shared by its tp group: one stream per data-parallel replica
and pipeline stage (each stage holds other layers; stages sharing one stream would repeat each
other's masks), and with tp > 1 its tensor-parallel regions from its own stream (p, d, t). After a
resume (``continue_streams``) at the same layout every rank continues its own saved streams (a
resumed run equals the uninterrupted one bit for bit); at another layout each new stream is derived
from the saved replicated stream of replica d mod dp' at stage p mod pp' (the old layout's), salted
by its new place, so the rule holds again (the tp ranks' streams distinct, the replicated one
shared across the tp group, each replica's different) and nothing restarts from the seed.
``rng_state`` / ``set_rng_state`` are a rank's streams as a checkpoint keeps them.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

__all__ = ["RNGTracker", "ReplicatedDropout", "continue_streams", "rng_state", "seed_streams", "set_rng_state"]


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
    """Seed this rank's dropout streams (torch, numpy, python) for a fresh run on ``world`` ranks at
    tensor-parallel degree ``tp`` (tp innermost: the group of ``rank`` is ``rank // tp``, its (p, d)).

    The replicated stream: ``seed + 1 + rank // tp``, alike across the tp group, different across
    data-parallel and pipeline ranks. With tp > 1 the default generator becomes the tp-region stream,
    ``seed + 1 + world + rank`` (different on every rank, and from every replicated stream), and the
    replicated one lives in ``TRACKER`` as "replicated"; with tp = 1 the default generator is the
    replicated stream and ``TRACKER`` is empty."""
    _set_streams(seed + 1 + rank // tp, seed + 1 + world + rank, tp, device)


def _set_streams(shared: int, own: int, tp: int, device: torch.device) -> None:
    """The replicated stream seeded ``shared`` and, with tp > 1, the tp-region stream ``own``
    (``seed_streams``'s arrangement)."""
    TRACKER.reset()
    if tp > 1:
        TRACKER.add("replicated", shared, device)
    seed = shared if tp == 1 else own
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, lists and numbers (``torch.load(weights_only=True)``
    reads them): torch's CPU generator, CUDA's (when initialised), numpy's, python's, and with
    tensor parallelism the tracker's streams ("streams")."""
    np_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                       "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
             "python": {"version": version, "internal": list(internal), "gauss": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    if TRACKER.states:
        state["streams"] = TRACKER.state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore ``rng_state()``'s result into this process (the tracker's streams: none without them)."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    TRACKER.set_state(state.get("streams", state.get("tp_streams")))


def continue_streams(ranks: list[dict[str, Any]], saved: tuple[int, int, int], mesh: Any, device: torch.device) -> None:
    """This rank's streams after a resume (module docstring): ``ranks`` the checkpoint's per-rank
    RNG states (``rng_state``), ``saved`` its (pp, dp, tp), ``mesh`` this run's
    (``labkit.train.parallel.Mesh``). The same layout: this rank's saved states. Another: both
    streams derived from the saved replicated stream of (pp_rank mod pp', dp_rank mod dp'), salted
    by this rank's replicated-stream index (pp_rank · dp + dp_rank) and by its rank."""
    pp, dp, tp = saved
    if (pp, dp, tp) == (mesh.pp, mesh.dp, mesh.tp):
        set_rng_state(ranks[mesh.rank])
        return
    source = ranks[((mesh.pp_rank % pp) * dp + mesh.dp_rank % dp) * tp]
    stream = (source.get("streams") or source.get("tp_streams") or {}).get("replicated")
    if stream is None:  # tp' = 1: the default generator was the replicated stream
        stream = source["cuda"] if device.type == "cuda" and "cuda" in source else source["torch"]
    replica = mesh.pp_rank * mesh.dp + mesh.dp_rank
    _set_streams(_derive(stream, 1 + replica, device), _derive(stream, 1 + mesh.world + mesh.rank, device),
                 mesh.tp, device)


def _derive(state: torch.Tensor, salt: int, device: torch.device) -> int:
    """A seed from generator ``state`` (one draw of a generator on ``device``'s type restored to it)
    and ``salt``: different salts give different seeds, the same (state, salt) the same seed."""
    g = torch.Generator(device="cuda" if device.type == "cuda" else "cpu")
    g.set_state(state)
    base = int(torch.randint(0, 2**62, (1,), generator=g, device=g.device))
    return (base + salt * 0x9E3779B97F4A7C15) % 2**63


class ReplicatedDropout(nn.Dropout):
    """``nn.Dropout`` drawing from ``TRACKER``'s "replicated" stream: the dropout of a replicated
    region of a tensor-parallel model (the same mask on every rank of the tp group)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with TRACKER.fork("replicated"):
            return super().forward(x)
