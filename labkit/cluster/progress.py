"""Where a run is, drawn in the controlling process: ``StepProgress`` over optimiser steps.

Training on the engines publishes rank 0's metric records (``labkit.cluster.launch.run_ddp``'s
``live`` callbacks receive them about once a second); a run in this process hands each record
to its ``sink`` (``labkit.train.train(cfg, sink=...)``). Either way the bar is drawn here, from
the records: the step of the newest one out of the run's total, with its loss and tokens/s.
Nothing is drawn on the engines. In a terminal (or a log) it is a tqdm bar on stderr; in an
IPython kernel an HTML ``<progress>`` element updated in place (one display id), so an executed
notebook keeps one bar at its final value. ``labkit train``, ``labkit resume``, the sweeps and
``labkit demo`` all use it; ``progress_bar`` is the notebooks' name for it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

__all__ = ["StepProgress", "progress_bar"]


def _in_kernel() -> bool:
    """Whether this process is an IPython kernel (a notebook), where HTML is drawn instead of tqdm."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class StepProgress:
    """A progress bar over a run's optimiser steps: ``live`` callback (a list of records, the
    newest last) and metrics sink (``record(r)``, one record) at once.

    ``total``: the run's last step (``max_steps``, or ``stop_after`` when that stops it earlier);
    ``initial``: the step it starts from (a resumed run's checkpoint step; the bar's rate and
    remaining time count from there); ``label``: what is running (``"train"``, ``"ranks 2"``).
    Each record's ``key`` (default ``"step"``) moves the bar; ``loss`` (nats per masked token,
    3 decimals) and ``tokens_per_s`` (rounded to a whole number) are shown beside it. ``text``
    holds the last state as one line (``"train: step 10/40 (25 %) loss 2.250 tokens/s 1,234"``).
    The bar is created at the first record, so lines printed before it (the engines' start-up,
    a resume line) stay above it; ``close()`` (also ``flush()``, which ``run_ddp`` calls at the
    end, and leaving a ``with`` block) ends it. Use it as a context manager so that an error or
    Ctrl-C closes it before the error's line is printed."""

    def __init__(self, total: int, *, label: str = "train", initial: int = 0, key: str = "step",
                 file: Any = None) -> None:
        self.total, self.label, self.initial, self.key = int(total), label, int(initial), key
        self.file = file
        self.step = self.initial
        self.text = ""
        self._bar = None
        self._html = _in_kernel()
        self._display_id = f"labkit-progress-{os.getpid()}-{time.monotonic_ns()}"
        self._shown = False
        self._closed = False

    def __enter__(self) -> "StepProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def stream(self) -> "_AboveBar":
        """A text stream (``write``, ``flush``) whose lines appear above the bar (tqdm's ``write``)
        instead of breaking it: for other live callbacks that print while the bar is drawn."""
        return _AboveBar(self)

    def __call__(self, records: list[dict]) -> None:
        """``live`` callback: draw the newest of ``records`` (rank 0's recent history)."""
        if records:
            self.record(records[-1])

    def record(self, record: dict) -> None:
        """Metrics sink: draw ``record`` (one metrics record)."""
        step = int(record.get(self.key) or 0)
        loss, tps = record.get("loss"), record.get("tokens_per_s")
        extra = (f" loss {loss:.3f}" if isinstance(loss, (int, float)) else "") + \
            (f" tokens/s {tps:,.0f}" if isinstance(tps, (int, float)) else "")
        self.text = f"{self.label}: {self.key} {step}/{self.total} ({100 * step / max(self.total, 1):.0f} %){extra}"
        if self._closed:
            return
        if self._html:
            self._draw_html(step)
            self.step = step
            return
        if self._bar is None:
            from tqdm.std import tqdm

            self._bar = tqdm(total=self.total, initial=self.initial, desc=self.label, unit=self.key, mininterval=0.5,
                             file=self.file or sys.stderr, dynamic_ncols=True, leave=True)
        if step > self.step:
            self._bar.update(step - self.step)
            self.step = step
        postfix = {}
        if isinstance(loss, (int, float)):
            postfix["loss"] = f"{loss:.3f}"
        if isinstance(tps, (int, float)):
            postfix["tokens/s"] = f"{tps:,.0f}"
        self._bar.set_postfix(postfix, refresh=False)
        if step >= self.total:
            self.close()

    def _draw_html(self, step: int) -> None:
        from IPython.display import display, update_display

        bundle = {"text/plain": self.text, "text/html": f'<progress value="{step}" max="{self.total}" '
                                                         f'style="width:40em"></progress> {self.text}'}
        if self._shown:
            update_display(bundle, raw=True, display_id=self._display_id)
        else:
            display(bundle, raw=True, display_id=self._display_id)
            self._shown = True

    def flush(self) -> None:
        """The run ended (``run_ddp`` calls this after the last records): close the bar."""
        self.close()

    def close(self) -> None:
        """End the bar at its last value (idempotent)."""
        if self._bar is not None and not self._closed:
            self._bar.close()
        self._closed = True


class _AboveBar:
    """``StepProgress.stream``: whole lines (``print`` writes a line's text and its newline in two
    calls; they are joined here) written above the bar while it is drawn, else to its file."""

    def __init__(self, progress: StepProgress) -> None:
        self.progress, self._pending = progress, ""

    def write(self, text: str) -> int:
        from tqdm.std import tqdm

        self._pending += text
        file = self.progress.file or sys.stderr
        while "\n" in self._pending:
            line, self._pending = self._pending.split("\n", 1)
            if self.progress._bar is not None and not self.progress._closed:
                tqdm.write(line, file=file)
            else:
                print(line, file=file)
        return len(text)

    def flush(self) -> None:
        (self.progress.file or sys.stderr).flush()


def progress_bar(total: int, *, key: str = "step", label: str = "training", initial: int = 0) -> StepProgress:
    """A ``live`` callback for ``run_ddp`` / ``train_on_cluster`` drawing one progress bar:
    ``records[-1][key]`` of ``total`` with the loss and tokens/s (``StepProgress``: HTML in a
    notebook, tqdm on stderr elsewhere). The last state as one line is in ``.text``."""
    return StepProgress(total, key=key, label=label, initial=initial)
