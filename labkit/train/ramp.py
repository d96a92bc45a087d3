"""The global batch over a run: fixed, on a declared ramp, or grown as the noise scale allows.

``TrainConfig.batch.schedule`` (``labkit.config.sections.BatchConfig``):

- ``"fixed"``: micro_batch_size x grad_accum_steps x dp throughout.
- ``"ramp"``: that starting batch, then ``batch.ramp = [[S, B], ...]``: after optimiser step S the
  global batch is B (the steps after S train at B), a declared schedule such as the batch warm-ups
  of GPT-3 (Brown et al. 2020, arXiv:2005.14165, App. B) and OLMo's (Merrill et al. 2025,
  arXiv:2505.23971).
- ``"critical"``: after every step, the in-run noise scale (``labkit.train.gns``: the 90 % Fieller
  interval of B_simple, in sequences) is read; when its lower end ``b_simple_low`` is at or above
  twice the current batch (and that is within ``batch.max_global_batch_size``) the batch doubles from
  the next step on. Conservative: the batch stays below what the noise scale says with 95 %
  one-sided confidence, so the step stays at least ~half as data-efficient as the smallest batch
  (McCandlish et al. 2018, arXiv:1812.06162, eq. 2.11, where B_noise is the critical batch). It is
  valid only where the noise scale was validated against the critical batch measured by branching
  (``labkit sweep branch``, docs/measurement.md): on the walkthrough it agreed at 2 of 3 points.

The batch grows through accumulation at the run's world size: grad_accum_steps = B / (micro_batch_size
x dp), so every B must be a multiple of micro_batch_size x dp (checked at the start). More ranks
are not added during a run: stop and resume it at a larger world size, which keeps the global
batch with less accumulation (``labkit.train.loop._keep_global_batch``). A pipeline (pp > 1) fixes
its micro-batches when built and is refused (``TrainConfig``). The learning rate at global batch B
is ``lr_at(step) x lr_for_batch(1, B0, B, batch.lr_rule)``, B0 the starting batch at which optim.lr
is declared.

``BatchRamp`` holds the ramp's state, part of the run state (``labkit.train.resume.RunState``): the
starting batch, the current batch, the decision taken after the last step and not yet applied
(``pending``), and the changes so far; the noise scale's averages it reads are the runtime's
(``NoiseScale.state_dict``, in the same checkpoint). A run stopped mid-ramp and resumed is therefore
the uninterrupted run bit for bit (tests/train/test_ramp.py). Each change, and the start, is a
record: {"step": S (the steps taken before it; metrics.jsonl's step S + 1 is the first at the new
batch), "global_batch_size", "grad_accum_steps", "lr" (of step S + 1), "why"}; rank 0 rewrites
run_dir/batch_changes.jsonl from them at each change and at the start (a resumed run's file cut back
to its checkpoint), and result.json lists them as ``batch_changes``.
"""

from __future__ import annotations

import pathlib
from typing import Any

from labkit.config import TrainConfig
from labkit.io import atomic_write_text
from labkit.train.optim import lr_at, lr_for_batch

__all__ = ["CHANGES_FILE", "GROWTH", "BatchRamp"]

GROWTH = 2
""""critical": the factor the global batch grows by at a change (one doubling per step at most)."""

CHANGES_FILE = "batch_changes.jsonl"
"""run_dir's file of the ramp's records (rank 0; ramp and critical runs only)."""


class BatchRamp:
    """The global batch of a run of ``cfg`` at ``dp`` data-parallel ranks (module docstring).

    ``batch``: the current global batch (sequences); ``base``: the starting one, at which optim.lr is
    declared; ``pending``: (batch, why) decided after the last step, applied before the next;
    ``changes``: the records so far. ``due(step)`` says which batch the next step must train at;
    ``apply`` makes it current; ``decide(step, fields)`` reads the noise scale's record fields
    (critical). ValueError (one line, naming the field) for a ramp this run cannot train."""

    def __init__(self, cfg: TrainConfig, dp: int) -> None:
        b = cfg.batch
        self.kind, self.rule, self.micro, self.dp = b.schedule, b.lr_rule, b.micro_batch_size, dp
        self.base = self.batch = b.micro_batch_size * b.grad_accum_steps * dp
        self.cap = b.max_global_batch_size
        self.table = list(b.ramp)
        self.pending: tuple[int, str] | None = None
        self.changes: list[dict[str, Any]] = []

    @property
    def grad_accum_steps(self) -> int:
        """The accumulation that gives the current batch at this dp."""
        return self.batch // (self.micro * self.dp)

    @property
    def lr_factor(self) -> float:
        """The current batch's learning rate over optim.lr (``lr_for_batch`` by batch.lr_rule)."""
        return lr_for_batch(1.0, self.base, self.batch, self.rule)

    def start(self, cfg: TrainConfig, step: int, *, measured: bool) -> None:
        """Before the first step of this invocation (``step`` steps taken): check that the ramp's
        batches still ahead are multiples of micro_batch_size x dp above the starting batch, and that
        a "critical" run measures the noise scale (``measured``: ``Runtime.noise`` exists); record the
        starting batch (a fresh run; a resumed one keeps its records). ValueError (one line) otherwise."""
        unit = self.micro * self.dp
        bad = [g for s, g in self.table if s > step and (g % unit or g <= self.base)]
        if bad:
            raise ValueError(f"batch.ramp: global batch(es) {bad} are not multiples of micro_batch_size {self.micro} x "
                             f"dp {self.dp} above the starting batch {self.base}")
        if self.kind == "critical" and not measured:
            raise ValueError("batch.schedule: 'critical' reads the in-run noise scale, which this run does not measure "
                             "(one data-parallel rank needs batch.grad_accum_steps >= 2; labkit.train.gns)")
        if not self.changes:
            self.changes.append(self._change(0, self.batch, f"start: micro_batch_size {self.micro} x grad_accum_steps "
                                             f"{self.grad_accum_steps} x dp {self.dp}", cfg))

    def due(self, step: int) -> tuple[int, str] | None:
        """(batch, why) the step after ``step`` steps must train at, where it differs from the current
        one: "ramp" from the table, "critical" the pending decision; else None."""
        if self.kind == "ramp":
            want = [(g, f"batch.ramp: [{s}, {g}]") for s, g in self.table if s <= step]
            return want[-1] if want and want[-1][0] != self.batch else None
        return self.pending if self.kind == "critical" else None

    def apply(self, step: int, batch: int, why: str, cfg: TrainConfig) -> dict[str, Any]:
        """Make ``batch`` current after ``step`` steps (``cfg``: the run's config, for the record's lr);
        returns the change's record. ValueError when ``batch`` is no multiple of micro_batch_size x dp
        (a run resumed at a dp that does not divide its ramp)."""
        if batch % (self.micro * self.dp):
            raise ValueError(f"batch.ramp: global batch {batch} is not a multiple of micro_batch_size {self.micro} x dp "
                             f"{self.dp}")
        self.batch, self.pending = batch, None
        record = self._change(step, batch, why, cfg)
        self.changes.append(record)
        return record

    def decide(self, step: int, fields: dict[str, Any]) -> None:
        """"critical": after step ``step``, with the step's noise-scale record fields (``b_simple``,
        ``b_simple_low``, ``b_simple_high``), set ``pending`` to the doubled batch when b_simple_low is
        at or above it and the bound allows it. Every rank decides alike: the fields come from sums
        all-reduced over the ranks, the same on each."""
        if self.kind != "critical" or self.pending is not None:
            return
        low, nxt = fields.get("b_simple_low"), self.batch * GROWTH
        if low is None or low < nxt or (self.cap is not None and nxt > self.cap):
            return
        high = fields.get("b_simple_high")
        self.pending = (nxt, f"critical: b_simple_low {low:.1f} >= {nxt} after step {step} (b_simple "
                             f"{fields.get('b_simple') or 0:.1f}, 90 % interval {low:.1f}-"
                             f"{'open' if high is None else f'{high:.1f}'})")

    def write(self, run_dir: str | pathlib.Path) -> None:
        """Rank 0's run_dir/batch_changes.jsonl: every record so far (atomic; nothing for "fixed")."""
        import json

        if self.kind != "fixed":
            atomic_write_text(pathlib.Path(run_dir) / CHANGES_FILE,
                              "".join(json.dumps(c) + "\n" for c in self.changes))

    def _change(self, step: int, batch: int, why: str, cfg: TrainConfig) -> dict[str, Any]:
        return {"step": step, "global_batch_size": batch, "grad_accum_steps": batch // (self.micro * self.dp),
                "lr": lr_at(step, cfg) * lr_for_batch(1.0, self.base, batch, self.rule), "why": why}

    def state_dict(self) -> dict[str, Any]:
        """The ramp's state, plain Python (torch.save / JSON): kind, base, batch, pending, changes."""
        return {"kind": self.kind, "base": self.base, "batch": self.batch,
                "pending": list(self.pending) if self.pending is not None else None,
                "changes": [dict(c) for c in self.changes]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``'s output (the current batch is the checkpoint's global
        batch, which the run already trains at: ``labkit.train.loop._keep_global_batch``)."""
        self.base, self.batch = int(state["base"]), int(state["batch"])
        self.pending = (int(state["pending"][0]), str(state["pending"][1])) if state.get("pending") else None
        self.changes = [dict(c) for c in state["changes"]]
