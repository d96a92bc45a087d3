"""The control-plane benchmark at a small count: benchmarks/bench_control_plane.py with 8 engines as
2 simulated nodes of 4 (its 64-engine run is the lead's, docs/measurement.md). The script runs end
to end; every engine registered, with labkit's registration timeouts on its command line; every
engine answered its control channel; the figure held every record of every rank; the stall watch
read every rank's status file. No timing is asserted."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_control_plane_benchmark_at_8_engines_as_2_nodes():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_control_plane.py"), "--nodes", "2",
                          "--per-node", "4", "--rounds", "3", "--steps", "6", "--interval", "0.2", "--figure-rounds", "1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    summary = lines[-1]
    assert summary["what"] == "summary" and summary["engines"] == 8 and summary["nodes"] == 2
    assert summary["registration_timeouts"] == {"engine": 10, "controller": 30}
    assert summary["engine_args_seen"] == [["--IPEngine.timeout=10"]] * 8
    assert {k for k in summary if k.startswith("round_trip_")} == {"round_trip_apply", "round_trip_control",
                                                                    "round_trip_engine_info"}
    rounds = summary["record_to_figure"]  # {poll: [one result per round]}
    assert sorted(rounds) == ["0.5", "1.0"] and all(len(v) == 1 for v in rounds.values())
    assert all(r["records"] == 8 * 6 for v in rounds.values() for r in v)  # every rank's every row reached the view
    assert summary["status_poll"]["ranks_read"] == 8
