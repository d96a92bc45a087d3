"""The README's command-line walkthrough, run exactly as written (extracted from README.md, so
the two cannot drift): prepare -> stage -> train (stopped early) -> resume -> export -> report,
on 3,000 real functions of this machine's libraries with 2 local engines; then every artifact
is checked, the TensorBoard events are read back with tensorboard's reader, and the export is
loaded by transformers offline and asked to fill a masked instruction."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = "<!-- cli-walkthrough:"


def walkthrough_block() -> str:
    """The first ```bash block after the walkthrough marker in README.md."""
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, "README.md lost its walkthrough marker"
    match = re.search(r"```bash\n(.*?)```", text[text.index(MARKER):], re.S)
    assert match, "no bash block after the walkthrough marker"
    return match.group(1)


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("walkthrough")
    (tmp / "configs").symlink_to(ROOT / "configs")
    (tmp / "notebooks").symlink_to(ROOT / "notebooks")
    shim = tmp / "bin"
    shim.mkdir()
    (shim / "labkit").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m labkit.cli "$@"\n')
    (shim / "labkit").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    script = "set -eu\n" + walkthrough_block()
    proc = subprocess.run(["bash", "-c", script], cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp / "work" / "walkthrough", proc


def test_prepare_and_stage_artifacts(walkthrough):
    work, _ = walkthrough
    corpus = json.loads((work / "corpus" / "corpus.json").read_text())
    assert corpus["functions"] == 3000
    index = json.loads((work / "shards" / "index.json").read_text())
    assert index["seq_len"] == 64 and index["n_sequences"] > 0
    assert (work / "tokenizer" / "tokenizer.json").is_file()
    staged = [p for p in (work / "local").glob("*/shards-*") if (p / "index.json").is_file()]
    assert len(staged) == 1, "one simulated node: one staged copy"
    assert json.loads((staged[0] / "index.json").read_text())["n_sequences"] == index["n_sequences"]


def test_train_then_resume_artifacts(walkthrough):
    work, _ = walkthrough
    run = work / "runs" / "main"
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == 20 and result["resumed_from_step"] == 10 and result["world_size"] == 2
    segments = result["provenance"]["segments"]  # stopped at 10, resumed: both parts, the whole run's throughput
    assert [(s["start_step"], s["end_step"]) for s in segments] == [(0, 10), (10, 20)]
    assert [s["command"] for s in segments] == ["labkit train configs/walkthrough.toml --set train.stop_after=10",
                                                "labkit resume work/walkthrough/runs/main"]
    assert result["tokens_per_s"] > 0 and result["data_wait_fraction"] is not None
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    assert result["final_loss"] == records[-1]["loss"] < records[0]["loss"]
    prov = json.loads((run / "config.json").read_text())["provenance"]
    assert prov["world_size"] == 2 and len(prov["hostnames"]) == 2 and len(prov["devices"]) == 2
    assert prov["command"] == "labkit resume work/walkthrough/runs/main"
    import torch

    assert prov["torch"] == torch.__version__ and prov["python"] == ".".join(map(str, sys.version_info[:3]))
    assert result["provenance"]["end_time"] >= prov["start_time"]
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert prov["git"]["commit"] == head.strip()


def test_tensorboard_events_hold_every_logged_loss(walkthrough):
    """tensorboard's own event reader: one loss scalar per metrics record, equal in value
    (float32), across the stop at step 10 and the resume."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    work, _ = walkthrough
    run = work / "runs" / "main"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    losses = acc.Scalars("train/loss")
    assert [e.step for e in losses] == [r["step"] for r in records]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert {"train/lr", "train/tokens_per_s", "train/data_wait_fraction", "train/peak_mem_bytes"} <= set(
        acc.Tags()["scalars"])


def test_export_loads_offline_and_fills_a_mask(walkthrough):
    work, _ = walkthrough
    out = work / "export"
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "README.md"} <= {p.name for p in out.iterdir()}
    card = (out / "README.md").read_text()
    assert "pipeline_tag: fill-mask" in card and "final loss" in card
    assert "tags: [labkit, bert, masked-lm, disassembly]" in card and "functions disassembled from ELF" in card
    # the card's example comes from the run's held-out data, with the checkpoint's own top-5
    assert "An example from the run's held-out data" in card and "after 20 steps" in card
    example = re.search(r"^fill\((.+)\)\n# (.+)$", card, re.M)
    text = ast.literal_eval(example.group(1))
    shown = [(ast.literal_eval(t), float(p))
             for t, p in re.findall(r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\") (\d\.\d{3})", example.group(2))]
    code = f"""
import json
from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline
out = {str(out)!r}
tok = AutoTokenizer.from_pretrained(out)
model = AutoModelForMaskedLM.from_pretrained(out)
ids = tok({text!r})["input_ids"]
fill = pipeline("fill-mask", model=out)
preds = fill({text!r}, top_k=5)
print(json.dumps({{"model": type(model).__name__, "ids": ids, "mask_id": tok.mask_token_id,
                   "preds": [[tok.convert_ids_to_tokens(p["token"]), p["token_str"], p["score"]] for p in preds]}}))
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["model"] == "BertForMaskedLM" and got["mask_id"] == 4
    assert got["ids"][0] == 2 and got["ids"][-1] == 3 and 4 in got["ids"], "[CLS] ... [MASK] ... [SEP]"
    scores = [p[2] for p in got["preds"]]
    assert len(got["preds"]) == 5 and scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1.0
    # transformers' pipeline on the exported files predicts what the card says labkit's model did
    assert [t for t, _ in shown] == [p[0] for p in got["preds"]], (shown, got["preds"])
    assert [p for _, p in shown] == pytest.approx(scores, abs=6e-4)


def test_report_of_the_train_notebook(walkthrough):
    work, _ = walkthrough
    html = work / "reports" / "03_train.html"
    from labkit.report import check_report

    assert check_report(html)["ok"]
    assert json.loads((work / "runs" / "notebook-03" / "result.json").read_text())["steps"] == 4


def test_parallel_sweep_of_the_walkthrough(walkthrough):
    """``labkit sweep parallel configs/walkthrough.toml``: every dp x tp x pp split of the 2 engines
    trained, measured and planned, in sweeps/parallel.parquet."""
    import polars as pl

    work, proc = walkthrough
    table = pl.read_parquet(work / "sweeps" / "parallel.parquet")
    assert [(r["dp"], r["tp"], r["pp"], r["pp_schedule"]) for r in table.iter_rows(named=True)] == [
        (2, 1, 1, None), (1, 2, 1, None), (1, 1, 2, "1f1b"), (1, 1, 2, "gpipe")]
    assert (table["tokens_per_s"] > 0).all() and (table["global_batch_size"] == 64).all()
    assert (table["measured_state_bytes"] == table["planned_state_bytes"]).all()
    assert (table.filter(pl.col("pp") > 1)["pipeline_bubble"] > 0).all()


def test_the_commands_say_where_they_are(walkthrough):
    """What the walkthrough's commands printed (issue 37): lines for a reader from prepare, stage
    and export; a progress bar over the steps of train, resume and each split of the sweep, drawn
    in this process from rank 0's records; the stop at train.stop_after with its checkpoint and
    the command that continues it; and the resumed run's one line with its step."""
    work, proc = walkthrough
    out, err = proc.stdout, proc.stderr
    assert "prepared work/walkthrough:\n  read 3,000 documents (elf 3,000)" in out, out[:2000]
    assert "  tokenizer: vocabulary " in out and "held-out split (never trained on): " in out
    assert re.search(r"staged work/walkthrough/shards on 1 node\(s\):\n  \S+: [\d.]+ MB (copied in|already there)", out)
    run = "work/walkthrough/runs/main"
    assert (f"stopped after step 10 of 20 (train.stop_after); last checkpoint {run}/checkpoints/step-10; to continue: "
            f"labkit resume {run}") in out, out[-3000:]
    assert re.search(rf"^{run}: step 20 of 20 \(resumed from step 10\), loss \d+\.\d{{3}} -> \d+\.\d{{3}}, held-out "
                     r"loss \d+\.\d{3} \(perplexity [\d.]+\)$", out, re.M), out[-3000:]
    assert f"train: resuming from step 10 (checkpoint step-10 in {run})" in err
    assert err.count("train: resuming") == 1  # rank 0 alone says it
    bars = re.findall(r"(train|sweep parallel: \S+): +\d+%\|[^|]*\| (\d+)/(\d+) ", err)
    finals = {(name, done, total) for name, done, total in bars if done == total}
    assert {("train", "10", "10"), ("train", "20", "20"), ("sweep parallel: dp2-tp1-pp1", "4", "4")} <= finals, finals
    assert "loss=" in err and "tokens/s=" in err
    assert re.search(rf"^exported {run} \(checkpoint step 20\) to work/walkthrough/export: .*model\.safetensors", out,
                     re.M)
