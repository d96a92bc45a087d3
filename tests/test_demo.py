"""The main job end to end on a tiny real corpus: a C file compiled here plus a few of this
machine's shared libraries, 2 local engines, CPU, gloo, the notebooks executed into reports."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest

from labkit.config import CleanConfig, CorpusConfig, DemoConfig, ShardConfig, TokenizerConfig

C_SOURCE = r"""
#include <stdio.h>
int add_numbers(int a, int b) { return a + b; }
static int square_it(int x) { return x * x; }
long sum_squares(const int *v, int n) {
    long s = 0;
    for (int i = 0; i < n; i++) s += square_it(v[i]);
    return s;
}
int main(int argc, char **argv) {
    int v[3] = {1, 2, argc};
    printf("%ld %d\n", sum_squares(v, 3), add_numbers(argc, 2));
    return 0;
}
"""

SYSTEM_LIBS = ["libc.so.6", "libcrypto.so.3", "libsqlite3.so.0", "libstdc++.so.6", "libexpat.so.1"]


def _tiny_inputs(tmp: Path) -> list[str]:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is needed to compile the test binary")
    src = tmp / "demo.c"
    exe = tmp / "demo_exe"
    if not exe.exists():  # compiled once: a new binary is a changed input, and the corpus would be rebuilt
        src.write_text(C_SOURCE)
        subprocess.run([gcc, "-O1", "-o", str(exe), str(src)], check=True)
    libs = []
    for root in (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib/aarch64-linux-gnu"), Path("/usr/lib")):
        libs += [str(root / n) for n in SYSTEM_LIBS if (root / n).exists()]
    assert libs, "no system shared library found for the test corpus"
    return [str(exe)] + libs[:3]


def _config(tmp: Path) -> DemoConfig:
    """The demo of these tests (its shard settings are the ones notebook 01 makes from the
    parameters the demo passes it, so the reports reuse the demo's artifacts)."""
    return DemoConfig(
        workdir=str(tmp / "work"),
        engines=2,
        corpus=CorpusConfig(paths=tuple(_tiny_inputs(tmp)), max_functions=4000),
        clean=CleanConfig(),
        tokenizer=TokenizerConfig(vocab_size=1024),
        shards=ShardConfig(seq_len=64, heldout_fraction=0.05),
        model="tiny",
        train_steps=30,
        micro_batch_size=8,
        sweep_steps=4,
        sweep_models=("tiny", "mini"),
        memory_budget_gib=0.5,
        reports=True,
    )


SMALL = {"law_widths": [16, 32], "law_steps": 12, "law_points": 3, "bootstrap": 4, "batch_sizes": [4, 8, 16],
         "batch_examples": 128, "loader_workers": [0, 1], "loader_step_time_s": 0.005, "size_steps": 3,
         "split_steps": 3, "branch_at": [3, 6], "branch_steps": 8, "branch_factors": [1, 2], "branch_window": 32}
"""Notebook parameters the demo of these tests passes on (smaller sweeps); its stages measure with
them as the notebooks then run."""


@pytest.fixture(scope="module")
def demo(demo_run):
    """The session's demo (tests/conftest.py ``demo_run``; tests/test_notebooks.py checks its reports)."""
    return demo_run


def test_corpus_holds_the_compiled_functions(demo):
    work, summary = demo
    names = set(pl.scan_parquet(str(work / "corpus" / "part-*.parquet")).select("name").collect()["name"])
    assert {"add_numbers", "sum_squares", "main"} <= names
    assert summary["preparation"]["functions"] == pl.scan_parquet(str(work / "corpus" / "part-*.parquet")).select(
        pl.len()).collect().item()


def test_clean_counts_add_up(demo):
    work, _ = demo
    drops = json.loads((work / "clean" / "docs.drops.json").read_text())
    kept = pl.read_parquet(work / "clean" / "docs.parquet").height
    assert drops["kept"] == kept > 0
    assert drops["input"] == kept + sum(drops["dropped"].values())
    texts = pl.read_parquet(work / "clean" / "docs.parquet")["text"]
    assert texts.n_unique() == len(texts), "exact duplicates survived cleaning"


def test_shards_verify_and_are_uint16(demo):
    from labkit.data.shards import verify_shards

    work, summary = demo
    index = verify_shards(str(work / "shards"))
    assert index["dtype"] == "uint16" and index["seq_len"] == 64
    assert index["n_bytes"] == sum(s["n_bytes"] for s in index["shards"])
    assert summary["preparation"]["shard_bytes"] == index["n_bytes"]


def test_each_node_got_a_verified_copy(demo):
    from labkit.data.shards import verify_shards

    work, summary = demo
    assert len(summary["staging"]) >= 1
    for rep in summary["staging"].values():
        verify_shards(rep["path"])
        assert Path(rep["path"]).resolve().is_relative_to((work / "local").resolve())


def test_training_run_directory(demo):
    import torch

    from labkit.train.checkpoint import load_weights

    work, summary = demo
    run = work / "runs" / "demo"
    assert json.loads((run / "config.json").read_text())["max_steps"] == 30
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    for key in ("loss", "lr", "tokens_per_s", "samples_per_s", "data_wait_fraction"):
        assert all(r[key] is not None for r in records), key
    result = json.loads((run / "result.json").read_text())
    assert result["world_size"] == 2
    evals = [r for r in records if "eval_loss" in r]  # held-out loss every 30 // 6 steps
    assert [r["step"] for r in evals] == [5, 10, 15, 20, 25, 30]
    assert result["eval_loss"] == evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert summary["train"]["perplexity"] == pytest.approx(math.exp(result["eval_loss"]))
    assert result["final_loss"] < result["initial_loss"] - 0.5, result
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    assert ckpts, "no checkpoint written"
    weights = load_weights(ckpts[-1])  # a torch.distributed.checkpoint directory, each rank's part
    assert len(weights) > 0 and all(torch.isfinite(w).all() for w in weights.values())


def test_sweeps(demo):
    work, _ = demo
    ranks = pl.read_parquet(work / "sweeps" / "ranks.parquet")
    assert ranks["ranks"].to_list() == [1, 2]
    assert ranks.filter(pl.col("ranks") == 1)["efficiency"].item() == pytest.approx(1.0)
    mb = pl.read_parquet(work / "sweeps" / "microbatch.parquet").sort("params")
    assert mb["model"].to_list() == ["tiny", "mini"]
    assert mb["max_micro_batch"][0] > mb["max_micro_batch"][1] >= 1


def test_reports_render_plotly_offline(demo):
    from labkit.report import check_report

    work, summary = demo
    from labkit.demo import NOTEBOOKS

    assert [Path(p).stem for p in summary["reports"]] == list(NOTEBOOKS)
    for path in summary["reports"]:
        info = check_report(path)
        assert info["ok"] and info["figures"] >= 1, (path, info)


def test_the_notebooks_read_back_every_measurement_of_the_demo(demo):
    """The demo measured each sweep its notebooks show, with their parameters: executed after it,
    on its engines, every notebook reads each point back through the made_by check (saying when
    and at what load it was measured) and measures nothing again."""
    import nbformat

    work, summary = demo
    text = {}
    for path in summary["reports"]:
        nb = nbformat.read(Path(path).with_suffix(".ipynb"), as_version=4)
        text[Path(path).stem] = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                                        for o in c.get("outputs", []) if o.get("output_type") == "stream")
    joined = "".join(text.values())
    assert "measuring again" not in joined and "every point measured now" not in joined
    assert "Starting" not in joined  # no notebook started engines of its own: they used the demo's
    assert text["04_scaling"].count("points reused from earlier runs (measured 20") == 4  # ranks, micro-batch, sizes, loaders
    assert "4 of 4 points reused from earlier runs (measured 20" in text["06_model_parallel"]
    assert "sweep law: 2 of 2 widths reused from earlier runs (measured 20" in text["05_scaling_laws"]
    assert "sweep batch: 3 of 3 points reused from earlier runs (measured 20" in text["07_critical_batch"]
    # the branches of 07's run: the base run's checkpoints kept and every branch (2 points x 2) read back
    assert "training it again" not in joined and text["07_critical_batch"].count("already finished") == 4
    fit = summary["critical_batch_fit"]
    assert len(summary["critical_batch"]) == 3 and fit["reached"] == 3 and fit["lr_rule"] == "sqrt"
    assert {p["width"] for p in summary["law_points"]} == {16, 32}
    assert [(s["dp"], s["tp"], s["pp"]) for s in summary["sweep_parallel"]][:2] == [(2, 1, 1), (1, 2, 1)]


def test_a_second_demo_reuses_every_artifact_and_says_so(demo, capfd):
    """``labkit demo`` again on the same work directory (the notebooks ran in between on it):
    every stage, the training run and every sweep point reused, each said in one line with when
    it was made; no artifact rewritten. ``--force`` would redo them (``run_demo(force=True)``,
    the same flag every stage takes: tests/test_made_by.py)."""
    import dataclasses

    from labkit.demo import run_demo

    work, first = demo
    kept = ["corpus/corpus.json", "clean/docs.drops.json", "tokenizer/tokenizer.json", "tokenizer/tokenizer.stats.json",
            "shards/index.json", "runs/demo/result.json", "runs/demo/metrics.jsonl", "sweeps/ranks.parquet",
            "sweeps/microbatch.parquet", "sweeps/model_size.parquet", "sweeps/loader.parquet", "sweeps/parallel.parquet",
            "sweeps/law_curves.parquet", "sweeps/critical_batch_curves.parquet", "sweeps/critical_batch.parquet",
            "sweeps/branch/base/metrics.jsonl", "sweeps/branch/step-6/r0-x2/metrics.jsonl"]
    before = {k: (work / k).read_bytes() for k in kept}
    capfd.readouterr()
    second = run_demo(dataclasses.replace(_config(work.parent), reports=False), parameters=SMALL)
    out, err = capfd.readouterr()
    assert {k: (work / k).read_bytes() for k in kept} == before
    for stage in ("corpus", "clean", "tokenizer", "shards"):
        assert f"{stage}: reusing " in err and "(same settings and inputs; made 20" in err
    assert "rebuilding" not in err + out and "measuring again" not in err + out
    assert "reusing the finished run in" in out and "--force trains again" in out
    assert "ranks: 2 of 2 points reused from earlier runs (measured 20" in out and "[reused: measured 20" in out
    assert "splits: 4 of 4 points reused" in out and "sweep batch: 3 of 3 points reused" in err
    assert second["train"] == json.loads(before["runs/demo/result.json"])
