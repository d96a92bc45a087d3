"""Tests of benchmarks/gpu_check.{sh,py} without a GPU: the micro-batch search against fake OOM
predicates, the whole flow on CPU with a fake OOM above a threshold, and the shell script's syntax."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)  # a script, not a package module
_spec.loader.exec_module(gpu_check)


def test_cpu_flow_with_fake_oom(tmp_path, monkeypatch):
    """The whole check on CPU (tiny model) where micro-batches above 5 raise CUDA's OOM error:
    the search answers 5, timing runs at 4, MFU is None (no peak for a CPU), NCCL is skipped."""
    real = gpu_check.Runtime.forward_backward

    def oom_above_5(self, micro_batches, mark=None):  # the configs check's step only (train()'s runs read shards)
        if micro_batches[0]["input_ids"].shape[0] > 5 and self.cfg.data_dir == "-":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake)")
        return real(self, micro_batches, mark)

    monkeypatch.setattr(gpu_check.Runtime, "forward_backward", oom_above_5)  # the trainer's step
    torch.set_num_threads(1)
    out = tmp_path / "gpu.json"
    report = gpu_check.main(["--device", "cpu", "--models", "tiny", "--seq-lens", "32,64", "--vocab", "96",
                             "--compile-modes", "0",
                             "--limit", "64", "--steps", "2", "--warmup", "1", "--out", str(out),
                             "--flops-models", "tiny", "--resume-model", "tiny"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    first, second = report["results"]
    assert (first["seq_len"], first["max_micro_batch"], first["timed_micro_batch"]) == (32, 5, 4)
    assert first["search_tries"] == [1, 2, 4, 8, 6, 5]
    assert (second["seq_len"], second["max_micro_batch"]) == (64, 5)  # limit 64*128/64 = 128 > 5
    assert first["mfu"] is None and first["peak_flops"] is None
    assert first["tokens_per_s"] == pytest.approx(4 * 32 / first["step_time_s"])
    assert report["nccl"] == {"skipped": "no CUDA device"} and report["planner_check"] == {"skipped": "no CUDA device"}
    # the new checks run their CPU stand-ins: FLOPs against FlopCounterMode (math-path attention),
    # ZeRO-1 and fsdp (gloo, one rank) saved at step 2, resumed and finished at 4
    assert [f["model"] for f in report["flops_check"]] == ["tiny sparse", "tiny dense"]
    assert all(f["ok"] for f in report["flops_check"]), report["flops_check"]
    assert all(r["ok"] and r["resumed_from_step"] == 2 for r in report["resume_check"].values()), report["resume_check"]
    assert report["resume_check"]["fsdp"]["eval_loss"] > 0
    from labkit.study import plan
    from labkit.model import model_config

    planned = plan.memory_plan(model_config("tiny", 96), seq_len=32, micro_batch=4, precision="bf16", attention="flash")
    assert first["planned_peak_bytes"] == planned["total"] and first["compile"] is False
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# labkit GPU check: cpu") and md.count("| tiny |") == 2 and "NCCL smoke test" in md


def test_compiled_runs_reuse_the_eager_micro_batch_and_the_planner_check_is_summarised(tmp_path, monkeypatch):
    calls = []

    def fake_check(name, seq, *, compile_, micro_batch, **kw):
        calls.append((name, seq, compile_, micro_batch))
        return {"model": name, "seq_len": seq, "compile": compile_, "max_micro_batch": 37 if not compile_ else None,
                "timed_micro_batch": micro_batch or 32, "step_time_s": 0.5, "tokens_per_s": 1000.0, "mfu": 0.41,
                "planned_over_measured": 1.02}

    monkeypatch.setattr(gpu_check, "check_config", fake_check)
    monkeypatch.setattr(gpu_check, "planner_check", lambda device, vocab, seq: {
        "plan_model": [{"model": "BertForMaskedLM-sdpa", "micro_batch": 16, "planned": 10, "measured": 11,
                        "ratio": 10 / 11, "ok": True}],
        "formula": [{"model": "bert-120m", "micro_batch": 64, "peak_ratio": 0.97, "ok": True}]})
    report = gpu_check.main(["--device", "cpu", "--models", "a,b", "--seq-lens", "128", "--out", str(tmp_path / "g.json"),
                             "--checks", "plan,configs"])
    assert calls == [("a", 128, False, None), ("b", 128, False, None), ("a", 128, True, 32), ("b", 128, True, 32)]
    md = (tmp_path / "g.md").read_text()
    assert "bert-120m b=64: peak ratio 0.970, ok True" in md and "| a | 128 | True | n/a | 32 |" in md
    assert "| BertForMaskedLM-sdpa | 16 | 10 | 11 | 0.909 | True |" in md
    assert len(report["results"]) == 4


def test_other_errors_are_not_taken_for_oom(monkeypatch):
    def broken(*args, **kw):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(gpu_check.Runtime, "forward_backward", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        gpu_check.check_config("tiny", 32, vocab=96, device=torch.device("cpu"), limit=4, steps=1, warmup=0)


def test_shell_script_syntax_and_no_gpu_message(tmp_path):
    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU is present; the no-GPU path is not reachable")
    run = subprocess.run(["bash", str(script), str(tmp_path / "x.json")], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 2 and "nvidia-smi not found" in run.stderr
    assert not (tmp_path / "x.json").exists()
