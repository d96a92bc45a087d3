"""labkit.train.timeline: the recorder's rows and files (lines per step, Parquet per segment, a
crashed segment's lines read back) and the Chrome trace export. A 2-rank training run's rows
against its own metrics records: tests/train/test_dist.py (test_train_two_ranks_end_to_end, one
spawn for both)."""

from __future__ import annotations

import json
import time

import polars as pl
import pytest

from labkit.train.timeline import PHASES, SCHEMA, Timeline, chrome_trace, read_timeline, write_chrome_trace
from timeline_sim import simulate


def _steps(tl: Timeline, first: int, n: int, *, pause: float = 0.0) -> list[dict]:
    rows = []
    for step in range(first, first + n):
        tl.start(step)
        for phase in ("data", "sync", "forward", "backward", "sync", "optimizer"):
            time.sleep(pause)
            tl.mark(phase)
        rows.append(tl.end(step_s=0.01 * step, comm_exposed_s=0.001))
    return rows


def test_rows_lines_parquet_and_a_crashed_segment(tmp_path):
    first = Timeline(tmp_path, rank=1, world_size=2, segment_start=100.0, host="h9")
    rows = _steps(first, 1, 3, pause=0.002)
    row = rows[0]
    assert set(row) == set(SCHEMA) and row["rank"] == 1 and row["host"] == "h9" and row["segment_start"] == 100.0
    assert row["sync_s"] >= 2 * 0.002 and row["sync_first_s"] < row["sync_s"]
    assert row["sync_end_s"] == pytest.approx(row["data_s"] + row["sync_first_s"])
    assert row["eval_s"] == 0.0 and row["bucket_ready_s"] == [] and row["t_end"] >= row["t_start"]
    lines = (tmp_path / "timeline" / "rank-00001.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert first.close() == tmp_path / "timeline" / "rank-00001.parquet"
    assert not (tmp_path / "timeline" / "rank-00001.jsonl").exists()
    # a second segment resumed from step 2 crashes in its third step's append: a torn line
    second = Timeline(tmp_path, rank=1, world_size=2, segment_start=200.0, resumed_from=2, host="h9")
    _steps(second, 3, 2)
    with open(second.path, "a") as f:
        f.write('{"step": 5, "ra')
    with pytest.warns(UserWarning, match="line 3 is torn"):
        frame = read_timeline(tmp_path)
    assert frame.schema == pl.Schema(SCHEMA)
    assert frame.select("segment_start", "step").rows() == [(100.0, 1), (100.0, 2), (100.0, 3), (200.0, 3), (200.0, 4)]
    assert frame["step_s"].to_list() == pytest.approx([0.01, 0.02, 0.03, 0.03, 0.04])


def test_disabled_writes_nothing_and_a_bad_phase_is_refused(tmp_path):
    off = Timeline(tmp_path, rank=0, world_size=1, enabled=False)
    off.start(1)
    off.mark("data")
    assert off.end(step_s=0.1) is None and off.close() is None and not (tmp_path / "timeline").exists()
    on = Timeline(tmp_path, rank=0, world_size=1)
    on.start(1)
    with pytest.raises(KeyError):
        on.mark("lunch")
    assert read_timeline(tmp_path / "nowhere").height == 0


def test_publish_gets_the_recent_rows_at_most_every_interval_and_at_close(tmp_path):
    seen = []
    tl = Timeline(tmp_path, rank=0, world_size=1, publish=seen.append, publish_every_s=3600, history=2)
    _steps(tl, 1, 3)
    assert [[r["step"] for r in rows] for rows in seen] == [[1]]  # the first row, then inside the interval
    tl.close()
    assert [[r["step"] for r in rows] for rows in seen] == [[1], [2, 3]]


def test_chrome_trace_has_every_phase_and_collective_in_microseconds(tmp_path):
    rows = simulate(3, data=[0.01, 0.02], compute=[0.05, 0.05], hosts=["h1", "h2"])
    frame = pl.from_dicts(rows, schema=SCHEMA)
    trace = chrome_trace(frame)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0 (h1)", "rank 1 (h2)"}
    phases = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "phase"]
    assert {e["name"] for e in phases} <= set(PHASES)
    first = [e for e in phases if e["pid"] == 1 and e["args"]["step"] == 1]
    assert first[0]["name"] == "data" and first[0]["ts"] == pytest.approx(0.0)
    assert first[0]["dur"] == pytest.approx(rows[1]["data_s"] * 1e6)
    assert all(b["ts"] == pytest.approx(a["ts"] + a["dur"]) for a, b in zip(first, first[1:]))  # end to end
    buckets = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "collective"]
    assert len(buckets) == 2 * 3 * 2
    b = next(e for e in buckets if e["pid"] == 0 and e["args"]["step"] == 2 and e["name"] == "bucket 1")
    row = next(r for r in rows if r["rank"] == 0 and r["step"] == 2)
    assert b["ts"] == pytest.approx((row["t_start"] - rows[0]["t_start"] + row["bucket_ready_s"][1]) * 1e6)
    assert b["dur"] == pytest.approx((row["bucket_done_s"][1] - row["bucket_ready_s"][1]) * 1e6)
    Timeline(tmp_path, rank=0, world_size=1)  # makes the folder
    with pytest.raises(FileNotFoundError, match="no timeline rows"):
        write_chrome_trace(tmp_path)
    frame.filter(pl.col("rank") == 0).write_parquet(tmp_path / "timeline" / "rank-00000.parquet")
    out = write_chrome_trace(tmp_path)
    assert json.loads(out.read_text())["traceEvents"] and out.name == "trace.json"
    with pytest.raises(ValueError, match="missing columns"):
        chrome_trace(frame.drop("data_s"))
