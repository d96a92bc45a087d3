"""Notebooks 00..05 executed headlessly with a small setting on a tiny real corpus, and one
exported report opened in headless Chromium to check that its plotly charts rendered.

The work directory is prepared once per module with the single-process data functions (a C
file compiled here plus three of this machine's shared libraries, as tests/test_demo.py does);
the notebooks then find complete artifacts, read them back, and run their own cluster work on
2 local engines. Chromium is Debian's ``chromium`` package, installed by ``make test`` (its
``browser`` prerequisite); without it the browser test is skipped, saying so."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from labkit.config import CleanConfig, CorpusConfig, ShardConfig, TokenizerConfig

NOTEBOOKS = ("00_cluster", "01_prepare", "02_stage_and_load", "03_train", "04_scaling", "05_scaling_laws")
ROOT = Path(__file__).resolve().parent.parent
PARAMS = {"engines": 2, "model": "tiny", "micro_batch_size": 8, "max_functions": 3000, "vocab_size": 1024,
          "seq_len": 64, "steps": 6, "sweep_steps": 3, "sweep_models": ["tiny", "mini"], "memory_budget_gb": 0.25,
          "loader_workers": [0, 1], "loader_step_time_s": 0.005, "law_widths": [16, 32, 64], "law_steps": 30,
          "law_points": 5, "bootstrap": 6, "heldout_fraction": 0.05}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from test_demo import _tiny_inputs

    from labkit.data.clean import clean_corpus
    from labkit.data.corpus import build_corpus
    from labkit.data.shards import write_shards
    from labkit.data.tokenize import train_tokenizer

    tmp = tmp_path_factory.mktemp("nb")
    work = tmp / "work"
    build_corpus(CorpusConfig(paths=tuple(_tiny_inputs(tmp)), max_functions=PARAMS["max_functions"]),
                 str(work / "corpus"))
    clean_corpus(str(work / "corpus" / "part-*.parquet"), str(work / "clean" / "docs.parquet"), CleanConfig())
    (work / "tokenizer").mkdir()
    train_tokenizer(str(work / "clean" / "docs.parquet"), TokenizerConfig(vocab_size=PARAMS["vocab_size"]),
                    str(work / "tokenizer" / "tokenizer.json"))
    write_shards(str(work / "clean" / "docs.parquet"), str(work / "tokenizer" / "tokenizer.json"),
                 str(work / "shards"), ShardConfig(seq_len=PARAMS["seq_len"], sequences_per_shard=256,
                                                         heldout_fraction=PARAMS["heldout_fraction"]), progress=False)
    return work


@pytest.fixture(scope="module")
def reports(workdir) -> dict[str, Path]:
    from labkit.report import execute_notebook

    out = {}
    for name in NOTEBOOKS:
        out[name] = execute_notebook(ROOT / "notebooks" / f"{name}.ipynb", workdir / "reports" / f"{name}.html",
                                     parameters={"workdir": str(workdir), **PARAMS}, timeout=300, cwd=str(workdir))
    return out


def test_notebooks_are_paired_with_their_scripts():
    import jupytext

    for name in NOTEBOOKS:
        script = jupytext.read(ROOT / "notebooks" / f"{name}.py")
        notebook = jupytext.read(ROOT / "notebooks" / f"{name}.ipynb")
        assert [c.source for c in script.cells] == [c.source for c in notebook.cells], f"{name}: ipynb out of sync"
        tagged = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{name}: needs exactly one cell tagged 'parameters'"


def test_notebooks_execute_and_export_offline_reports(reports, workdir):
    import nbformat
    import polars as pl

    from labkit.report import check_report

    for name, html in reports.items():
        info = check_report(html)
        assert info["ok"] and info["figures"] >= 1, (name, info)
        nb = nbformat.read(html.with_suffix(".ipynb"), as_version=4)
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        assert not errors, (name, errors)
    # the sweeps of notebook 04 and the law runs of notebook 05 left their artifacts
    sizes = pl.read_parquet(workdir / "sweeps" / "model_size.parquet")
    assert sizes["model"].to_list() == ["tiny", "mini"] and (sizes["tokens_per_s"] > 0).all()
    loader = pl.read_parquet(workdir / "sweeps" / "loader.parquet")
    assert loader["num_workers"].to_list() == PARAMS["loader_workers"] and (loader["samples_per_s"] > 0).all()
    assert sorted(p.name for p in (workdir / "runs").glob("law-*")) == ["law-16", "law-32", "law-64"]
    text = (reports["05_scaling_laws"]).read_text()
    assert "bootstrap_p05" in text and "compute-optimal" in text
    law_records = [json.loads(line) for line in (workdir / "runs" / "law-16" / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval_loss" in r for r in law_records) == PARAMS["law_points"]  # notebook 05 fits held-out loss
    nb03 = [json.loads(line) for line in (workdir / "runs" / "notebook-03" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in nb03 if "eval_loss" in r] == list(range(1, PARAMS["steps"] + 1))  # every 6 // 4 steps
    nb04 = nbformat.read(reports["04_scaling"].with_suffix(".ipynb"), as_version=4)
    shown = "".join(o.get("data", {}).get("text/plain", "") for c in nb04.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
    assert re.search(r"┆ 184\s+│", shown), "the study's micro-batch (184) is not shown beside the plan"


def test_report_renders_in_headless_chromium(reports, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (make test installs Debian's chromium package as root)")
    html = reports["04_scaling"]
    expected = len(re.findall(r'class="plotly-graph-div"', html.read_text()))
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000", "--dump-dom",
         html.resolve().as_uri()],
        capture_output=True, text=True, timeout=120, check=True).stdout
    plotted = len(re.findall(r'class="plotly-graph-div js-plotly-plot"', dom))  # plotly.js ran on the div
    rendered = len(re.findall(r'class="main-svg"', dom))
    # every chart of the report was drawn: plotly.js marks its div and adds (at least) two .main-svg layers
    assert expected >= 4 and plotted == expected and rendered >= 2 * expected, (expected, plotted, rendered)
