"""Metric sinks: where rank 0 sends each metrics record besides ``metrics.jsonl``.

A sink is any object with ``write(record)`` and ``close()`` (``MetricSink``). ``TrainConfig.
trackers`` names the sinks of a run; ``SINKS`` maps a name to a factory ``(run_dir) -> sink``.
Another tracker is a few lines, e.g. MLflow (not a labkit dependency)::

    class MLflowSink:
        def __init__(self, run_dir):
            import mlflow
            self.mlflow = mlflow; mlflow.start_run(run_name=pathlib.Path(run_dir).name)
        def write(self, record):
            self.mlflow.log_metrics(scalars(record), step=record["step"])
        def close(self):
            self.mlflow.end_run()

    SINKS["mlflow"] = MLflowSink

(W&B offline the same way: ``wandb.init(mode="offline", dir=run_dir)``, ``wandb.log(...,
step=...)``, ``wandb.finish()``.)
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Callable, Protocol

__all__ = ["SINKS", "SKIP_KEYS", "TENSORBOARD_DIR", "fan_out", "MetricSink", "open_sinks", "scalars", "tag",
           "TensorBoardSink"]

TENSORBOARD_DIR = "tensorboard"
"""Folder of the run directory holding the TensorBoard event files."""

SKIP_KEYS = frozenset({"step", "time", "world_size", "global_batch_size", "epoch", "skipped"})
"""Record fields that are not plotted as scalars (the step is the x axis; the rest are settings)."""


class MetricSink(Protocol):
    """Receives every metrics record rank 0 writes (the dict of one ``metrics.jsonl`` line)."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plottable numbers of a record: every int or float (not bool, not None) except
    ``SKIP_KEYS``, as float."""
    return {k: float(v) for k, v in record.items()
            if k not in SKIP_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}


def tag(key: str) -> str:
    """TensorBoard tag of a record field: ``eval/<key>`` for eval_* fields, else ``train/<key>``."""
    return f"eval/{key}" if key.startswith("eval") else f"train/{key}"


class TensorBoardSink:
    """TensorBoard event files under ``<run_dir>/tensorboard`` (torch's ``SummaryWriter``): one
    scalar per field of ``scalars(record)`` at ``record["step"]``, wall time ``record["time"]``.

    The writer opens on the first record with ``purge_step`` = that step, so after a resume
    TensorBoard drops the earlier file's events from that step on (those steps were logged after
    the checkpoint and are trained again). Events are flushed every 10 s and at ``close``."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.log_dir = pathlib.Path(run_dir) / TENSORBOARD_DIR
        self.writer = None

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir), purge_step=step, flush_secs=10)
        for key, value in scalars(record).items():
            self.writer.add_scalar(tag(key), value, global_step=step, walltime=record.get("time"))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


SINKS: dict[str, Callable[[str], MetricSink]] = {"tensorboard": TensorBoardSink}
"""Sink name (as in ``TrainConfig.measure.trackers``) -> factory taking the run directory."""


def open_sinks(names: tuple[str, ...] | list[str], run_dir: str | os.PathLike, *, main: bool = True) -> list[MetricSink]:
    """One sink per name on the main rank (``main``), none elsewhere. Every rank checks the
    names, so an unknown one raises ValueError naming it on all ranks alike (none waits in a
    collective for a rank that stopped)."""
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ValueError(f"trackers: unknown {unknown}; known trackers are {sorted(SINKS)}")
    return [SINKS[n](run_dir) for n in names] if main else []


def fan_out(callback: Callable[[dict], None] | None, sinks: list[MetricSink]) -> Callable[[dict], None] | None:
    """A callback that passes each record to ``callback`` (e.g. the live stream) and every sink;
    None when there is nothing to call."""
    if callback is None and not sinks:
        return None

    def emit(record: dict[str, Any]) -> None:
        for sink in sinks:
            sink.write(record)
        if callback is not None:
            callback(record)

    return emit
