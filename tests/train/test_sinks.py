"""Metric sinks: the plotted fields, unknown tracker names, TensorBoard events read back with
tensorboard's own reader, including a resume that trains steps again."""

from __future__ import annotations

import pytest

from labkit.train import sinks


def test_scalars_keep_numbers_only():
    record = {"step": 3, "loss": 2.5, "mfu": None, "skipped": False, "tokens": 100, "time": 1.7e9,
              "world_size": 2, "eval_loss": 2.75}
    assert sinks.scalars(record) == {"loss": 2.5, "tokens": 100.0, "eval_loss": 2.75}
    assert sinks.tag("eval_loss") == "eval/eval_loss" and sinks.tag("loss") == "train/loss"


def test_unknown_tracker_is_refused_on_every_rank(tmp_path):
    for main in (True, False):
        with pytest.raises(ValueError, match=r"trackers: unknown \['mlflow'\]; known trackers are \['tensorboard'\]"):
            sinks.open_sinks(["tensorboard", "mlflow"], tmp_path, main=main)
    assert sinks.open_sinks(["tensorboard"], tmp_path, main=False) == []
    assert sinks.fan_out(None, []) is None


def test_tensorboard_resume_replaces_the_steps_trained_again(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = sinks.TensorBoardSink(tmp_path)
    for step in range(1, 5):  # steps 3 and 4 were logged after the step-2 checkpoint, then a crash
        first.write({"step": step, "loss": 10.0 + step, "time": 1000.0 + step})
    first.close()
    seen = []
    emit = sinks.fan_out(seen.append, [resumed := sinks.TensorBoardSink(tmp_path)])
    for step in range(3, 6):
        emit({"step": step, "loss": 20.0 + step, "time": 2000.0 + step})
    resumed.close()
    assert [r["step"] for r in seen] == [3, 4, 5]
    acc = EventAccumulator(str(tmp_path / sinks.TENSORBOARD_DIR))
    acc.Reload()
    got = [(e.step, e.value, e.wall_time) for e in acc.Scalars("train/loss")]
    assert got == [(1, 11.0, 1001.0), (2, 12.0, 1002.0), (3, 23.0, 2003.0), (4, 24.0, 2004.0), (5, 25.0, 2005.0)]
