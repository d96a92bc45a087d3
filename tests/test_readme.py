"""README.md's "From Python" example, run exactly as written there (extracted from the README, so
the two cannot drift): prepare, train on 2 local engines, read the metrics, stop."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_example() -> str:
    """The first ```python block of the README's "From Python" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## From Python\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)[:1]
    return code


def test_readme_from_python_example_runs_whole(tmp_path):
    code = readme_example()
    assert "stop_cluster(cluster)" in code and "read_metrics" in code and "..." not in code
    (tmp_path / "example.py").write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+) in (\d+) steps", run.stdout)
    assert m and int(m[3]) == 20, run.stdout[-2000:]
    kept = re.search(r"kept (\d+) of (\d+)", run.stdout)
    assert kept and 0 < int(kept[1]) <= int(kept[2]) <= 2_000, run.stdout
    assert (tmp_path / "work" / "mine" / "runs" / "mine" / "metrics.jsonl").is_file()
