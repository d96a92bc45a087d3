"""``python -m labkit.train CONFIG`` as one plain process and under real torchrun with 2 ranks
(CPU, gloo), on a tiny shard set. The torchrun run must reproduce, loss for loss, the same
config trained by 2 ranks that labkit's own tests start (torch.multiprocessing, env set by
hand), so torchrun's environment reaches the same DDP path."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.tiny_shards import write_tiny_shards

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _config(tmp: pathlib.Path) -> pathlib.Path:
    write_tiny_shards(tmp / "shards", n_sequences=64, seq_len=32)
    cfg = tmp / "run.toml"
    cfg.write_text(f"""workdir = "{tmp}"
[train]
data_dir = "{tmp / 'shards'}"
model = "tiny"
max_steps = 6
num_threads = 1
model_overrides = {{hidden_dropout = 0.0, attention_dropout = 0.0}}
batch = {{micro_batch_size = 4}}
schedule = {{warmup_steps = 1}}
measure = {{timing_warmup_steps = 1}}
""")
    return cfg


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
                OMP_NUM_THREADS="1")


def _records(run: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_two_ranks_matches_one_process(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    cfg = _config(tmp_path)
    ddp, solo = tmp_path / "runs" / "ddp", tmp_path / "runs" / "solo"
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "labkit.train", str(cfg),
                           "--set", f"train.run_dir={json.dumps(str(ddp))}"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])  # rank 0's result, one JSON line
    result = json.loads((ddp / "result.json").read_text())
    assert printed["final_loss"] == result["final_loss"]
    assert result["world_size"] == 2 and result["global_batch_size"] == 8 and result["steps"] == 6
    prov = result["provenance"]
    assert prov["world_size"] == 2 and len(prov["hostnames"]) == 2 and prov["devices"][0] == prov["devices"][1]
    assert prov["command"].startswith(f"torchrun worker: {sys.executable} -m labkit.train {cfg}"), prov["command"]

    # the reference: the same TrainConfig on 2 ranks spawned by hand (tests/train/test_dist.py's worker)
    import torch.multiprocessing as mp

    from labkit.config import to_dict
    from labkit.config.tomlfile import load
    from tests.train.test_dist import _free_port, _train_worker

    ref = tmp_path / "runs" / "spawned"
    ref_cfg = load(cfg, [f"train.run_dir={json.dumps(str(ref))}", "train.measure.trackers=[]"]).train
    mp.spawn(_train_worker, args=(2, _free_port(), json.dumps(to_dict(ref_cfg))), nprocs=2, join=True)
    assert [r["loss"] for r in _records(ddp)] == pytest.approx([r["loss"] for r in _records(ref)], rel=1e-6)
    assert not (ref / "tensorboard").exists(), "trackers=[] writes no event files"
    assert len(list((ddp / "tensorboard").glob("events.out.tfevents.*"))) == 1, "rank 0 alone writes events"

    proc = subprocess.run([sys.executable, "-m", "labkit.train", str(cfg), "--set", f"train.run_dir={json.dumps(str(solo))}"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads((solo / "result.json").read_text())
    assert one["world_size"] == 1 and one["global_batch_size"] == 4 and one["steps"] == 6
    assert one["provenance"]["hostnames"] == prov["hostnames"][:1]
    assert one["provenance"]["command"].startswith(f"{sys.executable} -m labkit.train {cfg}")


def test_train_module_refuses_a_bad_key_in_one_line(tmp_path):
    cfg = _config(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "labkit.train", str(cfg), "--set", "train.max_step=3"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("labkit.train (rank 0): error: train.max_step: unknown key"), lines
