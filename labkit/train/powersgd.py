"""PowerSGD's state by parameter name: what a checkpoint keeps of ``grad_compression="powersgd"``.

torch's ``powerSGD_hook`` (``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``; Vogels
et al. 2019, arXiv:1905.13727) keeps, per DDP bucket index, the error feedback (the part of the
bucket the compression has not sent yet, a flat tensor over the bucket) and the warm-start Q
memory (the concatenated rank-r factors of the bucket's compressed matrices, grouped by shape in
first-appearance order); plus its step counter ``iter``, which ends the uncompressed warm-up. A
bucket index names different parameters before and after DDP rebuilds its buckets (after the first
step, in the order gradients became ready) and in another process, so a resumed run could hand one
parameter's error to another. ``NamedPowerSGD`` keeps the layout of every bucket it has seen
(parameter names, their offsets in the bucket and in the Q memory, torch's own rule
``_should_compress`` deciding which matrices are compressed) and converts that state to one entry
per parameter name and back:

- ``state_dict()``: {"iter", "tensors": {"error.<name>": fp32 [numel], "q.<name>": fp32 [m·r]}}
  (this rank's; the error feedback differs between ranks);
- ``load_state_dict(state)``: the counter, and the tensors pending until each bucket's first call,
  where ``prepare(bucket)`` builds the bucket's error feedback and Q memory from them;
- ``prepare(bucket)`` (the composed comm hook calls it before ``powerSGD_hook``) also notices a
  bucket whose parameters changed (DDP's rebuild) and moves the state of every bucket not yet
  reduced this step back to names first. DDP launches a step's buckets in index order, after the
  previous step's have all completed, so that state is never in flight.

Tests: tests/train/test_compression.py (a run resumed from a checkpoint equals the uninterrupted
run bit for bit, its first step on DDP's unbuilt buckets).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NamedPowerSGD"]


class NamedPowerSGD:
    """The state of ``state`` (a torch ``PowerSGDState``) by parameter name (module docstring);
    ``names``: parameter -> its ``BertMLM`` name."""

    def __init__(self, state: Any, names: dict[torch.nn.Parameter, str]) -> None:
        self.state, self.names = state, names
        self.layouts: dict[int, list[tuple[str, int, int, int, int]]] = {}  # index -> [(name, offset, n, m, r)]
        self.pending: dict[str, torch.Tensor] = {}  # "error.<name>" / "q.<name>" -> tensor, not yet in a bucket
        self._seen: set[int] = set()  # bucket indices prepared in this step

    def layout(self, bucket: Any) -> list[tuple[str, int, int, int, int]]:
        """[(name, offset in the bucket, n, m, r)] of ``bucket``'s parameters in the bucket's order:
        the gradient viewed as the n x m matrix ``powerSGD_hook`` compresses at rank r (r = 0: sent
        uncompressed, torch's ``_should_compress``); the Q memory's order is ``_q_order``."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        out, offset = [], 0
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            n = g.shape[0]
            m = g.numel() // n
            r = min(n, m, self.state.matrix_approximation_rank)
            compressed = _should_compress(n, m, r, self.state.min_compression_rate)[0]
            out.append((self.names[p], offset, n, m, r if compressed else 0))
            offset += g.numel()
        return out

    def prepare(self, bucket: Any) -> None:
        """Before ``powerSGD_hook`` runs on ``bucket``: a new layout at this index moves every bucket's
        state not yet reduced this step to names; then, when the bucket has no state and names of its
        parameters are pending, its error feedback and Q memory are built from them."""
        index, st = bucket.index(), self.state
        if index == 0:
            self._seen = set()
        self._seen.add(index)
        layout = self.layout(bucket)
        if self.layouts.get(index) not in (None, layout):
            for k in [k for k in list(st.error_dict) if k not in self._seen or k == index]:
                self._to_names(k)
        self.layouts[index] = layout
        if st.iter >= st.start_powerSGD_iter and index not in st.error_dict and self.pending:
            self._install(index, layout, bucket.buffer())

    def _to_names(self, index: int) -> None:
        """Move bucket ``index``'s error feedback and Q memory (laid out as ``self.layouts[index]``)
        into ``pending`` by parameter name, and out of PowerSGD's dictionaries."""
        st, layout = self.state, self.layouts[index]
        error, q = st.error_dict.pop(index, None), st.q_memory_dict.pop(index, None)
        st.p_memory_dict.pop(index, None)
        for name, offset, n, m, _ in layout:
            if error is not None:
                self.pending[f"error.{name}"] = error[offset:offset + n * m].clone()
        for name, start, size, _ in _q_order(layout):
            if q is not None:
                self.pending[f"q.{name}"] = q[start:start + size].clone()

    def _install(self, index: int, layout: list[tuple[str, int, int, int, int]], buffer: torch.Tensor) -> None:
        """PowerSGD's error feedback, Q memory and (unwritten) P memory of bucket ``index`` from the
        pending tensors of its parameters (zeros for one without: it had nothing left unsent)."""
        st = self.state
        zeros = lambda n: torch.zeros(n, dtype=buffer.dtype, device=buffer.device)  # noqa: E731
        st.error_dict[index] = torch.cat([self.pending.pop(f"error.{name}", zeros(n * m)).to(buffer.device)
                                          for name, _, n, m, _ in layout])
        order = _q_order(layout)
        if order and all(f"q.{name}" in self.pending for name, _, _, _ in order):
            st.q_memory_dict[index] = torch.cat([self.pending.pop(f"q.{name}").to(buffer.device)
                                                 for name, _, _, _ in order])
            p_size = sum(p_size for _, _, _, p_size in order)
            st.p_memory_dict[index] = torch.empty(p_size, dtype=buffer.dtype, device=buffer.device)

    def state_dict(self) -> dict[str, Any]:
        """{"iter": PowerSGD's step counter, "tensors": this rank's error feedback and Q memory by
        parameter name (the pending ones too), cloned}."""
        tensors, st = {k: v.clone() for k, v in self.pending.items()}, self.state
        for index in list(st.error_dict):
            layout, error, q = self.layouts[index], st.error_dict[index], st.q_memory_dict.get(index)
            for name, offset, n, m, _ in layout:
                tensors[f"error.{name}"] = error[offset:offset + n * m].clone()
            for name, start, size, _ in _q_order(layout) if q is not None else ():
                tensors[f"q.{name}"] = q[start:start + size].clone()
        return {"iter": int(self.state.iter), "tensors": tensors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s output: the counter now, the tensors at each bucket's
        first call (``prepare``). ``state["tensors"]`` may be empty (another layout: the error
        feedback of other ranks is no one's here; the compression starts again from zero error and
        fresh Q memories, without repeating the warm-up)."""
        self.state.iter = int(state["iter"])
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self.layouts, self.pending = {}, dict(state.get("tensors", {}))


def _q_order(layout: list[tuple[str, int, int, int, int]]) -> list[tuple[str, int, int, int]]:
    """[(name, start, m·r, n·r)] of the compressed parameters' Q factors in PowerSGD's Q memory, with
    the size of their P factor: grouped by matrix shape (n, m) in first-appearance order
    (``powerSGD_hook``'s ``shape_to_tensors``), each group in bucket order."""
    groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for name, _, n, m, r in layout:
        if r:
            groups.setdefault((n, m), []).append((name, m * r, n * r))
    out, start = [], 0
    for members in groups.values():
        for name, q_size, p_size in members:
            out.append((name, start, q_size, p_size))
            start += q_size
    return out
