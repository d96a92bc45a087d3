"""Notebooks 00..05 executed headlessly with a small setting on a tiny real corpus; every exported
report opened in Chromium with the network cut; a live figure and 03_train run in JupyterLab.

The work directory is prepared once per module with the single-process data functions (a C
file compiled here plus three of this machine's shared libraries, as tests/test_demo.py does);
the notebooks then find complete artifacts, read them back, and run their own cluster work on
2 local engines. Chromium is Debian's ``chromium`` package, installed by ``make test`` (its
``browser`` prerequisite), driven by the playwright package (tests/browser.py); without either the
browser tests are skipped, saying so."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from labkit.config import CleanConfig, CorpusConfig, ShardConfig, TokenizerConfig

NOTEBOOKS = ("00_cluster", "01_prepare", "02_stage_and_load", "03_train", "04_scaling", "05_scaling_laws",
             "06_model_parallel")
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
    from labkit.report import declared_parameters, execute_notebook

    out = {}
    for name in NOTEBOOKS:
        src = ROOT / "notebooks" / f"{name}.py"
        params = {k: v for k, v in {"workdir": str(workdir), **PARAMS}.items() if k in declared_parameters(src)}
        out[name] = execute_notebook(src, workdir / "reports" / f"{name}.html", parameters=params, timeout=300,
                                     cwd=str(workdir))
    return out


def test_saving_in_jupyterlab_leaves_the_tracked_scripts_unchanged(tmp_path):
    """The .py scripts are the source; JupyterLab (jupytext's contents manager, as the server runs
    it) writes outputs to the paired .ipynb, which git ignores, and rewrites the .py identically."""
    import asyncio
    import shutil

    import jupytext
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
    from jupytext.async_contentsmanager import build_async_jupytext_contents_manager_class

    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns("*.ipynb", ".*"))
    cm = build_async_jupytext_contents_manager_class(AsyncLargeFileManager)(root_dir=str(tmp_path))

    async def open_run_save(name: str) -> None:
        model = await cm.get(f"notebooks/{name}.py")  # opened as a notebook
        code = next(c for c in model["content"]["cells"] if c["cell_type"] == "code")
        code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "x" * 100_000}]
        code["execution_count"] = 1
        await cm.save(model, f"notebooks/{name}.py")

    for name in NOTEBOOKS:
        asyncio.run(open_run_save(name))
        before = (ROOT / "notebooks" / f"{name}.py").read_bytes()
        assert (tmp_path / "notebooks" / f"{name}.py").read_bytes() == before, f"{name}.py rewritten on save"
        paired = tmp_path / "notebooks" / f"{name}.ipynb"
        assert paired.stat().st_size > 100_000  # the outputs went to the paired notebook ...
        tagged = [c for c in jupytext.read(paired).cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{name}: needs exactly one cell tagged 'parameters'"
    if shutil.which("git") and (ROOT / ".git").exists():  # ... which git ignores
        ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "notebooks/03_train.ipynb"])
        assert ignored.returncode == 0


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
        shown = "".join(o.get("data", {}).get("text/plain", "") for c in nb.cells if c.cell_type == "code"
                        for o in c.get("outputs", []))
        cut = re.findall(r"^│\s*…\s*(?:┆\s*…\s*)*│$", shown, re.M)  # polars' row of "…" for rows left out
        assert not cut, (name, "a table is cut short")
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
    # notebook 06: every split of 2 engines, measured beside the planner
    splits = pl.read_parquet(workdir / "sweeps" / "parallel.parquet")
    assert [(r["dp"], r["tp"], r["pp"], r["pp_schedule"]) for r in splits.iter_rows(named=True)] == [
        (2, 1, 1, None), (1, 2, 1, None), (1, 1, 2, "1f1b"), (1, 1, 2, "gpipe")]
    assert (splits["measured_state_bytes"] == splits["planned_state_bytes"]).all()
    piped = splits.filter(pl.col("pp") > 1)
    assert (piped["pipeline_bubble"] > 0).all() and (piped["planned_bubble"] == 0.2).all()
    assert splits.filter(pl.col("tp") > 1)["tp_comm_s"].drop_nulls().len() == 1





def test_reports_open_offline_in_chromium_with_every_reference_line_drawn(reports):
    from browser import chromium, inspect_report, need_browser

    need_browser()
    with chromium() as browser:
        context = browser.new_context()
        context.set_offline(True)  # the network is cut: anything a report fetches fails
        for name, html in reports.items():
            r = inspect_report(context, html)
            assert r["failed_requests"] == [] and r["remote_requests"] == [], (name, r)
            assert r["charts_in_html"] >= 1 and r["charts_drawn"] == r["charts_in_html"], (name, r)  # every chart drawn
            figs = r["figures"]
            for fig in figs:
                assert len(fig["shape_widths"]) == fig["shapes"] and all(w > 0 for w in fig["shape_widths"]), (name, fig)
                for axis, labels in fig["ticks"].items():
                    assert len(labels) == len(set(labels)), (name, axis, labels)  # no repeated tick label
            if name == "04_scaling":  # the 90 % line and the capacity line (the knee only when one is found)
                assert sum(f["shapes"] for f in figs) >= 2, figs


# ---- in JupyterLab, driven by Chromium (tests/browser.py) ------------------------------------------

BROWSER_OUT = ROOT / "work" / "browser"
"""Screenshots and point counts of the browser tests (outside git: /work/ is ignored)."""

LIVE_FEED = """import time
live = plots.LivePlot(plots.loss_figure, min_interval=0.3)
records = []
for step in range(1, 21):
    records.append({"step": step, "loss": 10 / step, "tokens_per_s": 1000.0 + step})
    live(records)
    time.sleep(0.4)
live.flush()
print("fed", len(records), "records")"""


def _grew(samples: list, total: int) -> list[int]:
    """The distinct point counts of the first figure's first trace seen before the end."""
    return sorted({c[0][0] for _, c in samples[:-1] if c and 0 < c[0][0] < total})


def _save_timeline(name: str, samples: list) -> Path:
    import json

    BROWSER_OUT.mkdir(parents=True, exist_ok=True)
    path = BROWSER_OUT / f"{name}.points.json"
    path.write_text(json.dumps([{"t_s": t, "points_per_trace": c} for t, c in samples]))
    print(f"{name}: point counts over time in {path}")
    return path


def test_live_figure_grows_in_place_in_jupyterlab(tmp_path):
    import nbformat

    from browser import chromium, jupyterlab, need_browser, run_all_and_watch

    need_browser()
    root = tmp_path / "lab"
    root.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("from labkit import plots\nplots.setup_notebook_plotting()"),
                nbformat.v4.new_code_cell(LIVE_FEED)]
    nbformat.write(nb, root / "live.ipynb")
    with jupyterlab(root, log=tmp_path / "lab.log") as (base, token), chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        samples = run_all_and_watch(page, f"{base}/lab/tree/live.ipynb?token={token}", done_text="fed 20 records",
                                    timeout_s=120)
    _save_timeline("live", samples)
    assert samples[-1][1] == [[20, 20]], samples[-1]  # one figure, both traces with every point
    assert len(_grew(samples, 20)) >= 3, samples  # redrawn in place while the cell ran


def test_03_train_live_figure_in_jupyterlab(workdir, tmp_path):
    import nbformat

    from browser import chromium, jupyterlab, need_browser, run_all_and_watch
    from labkit.report import inject_parameters, read_notebook

    need_browser()
    root = tmp_path / "lab"
    root.mkdir()
    steps = 200
    nb = read_notebook(ROOT / "notebooks" / "03_train.py")
    inject_parameters(nb, {"workdir": str(workdir), "engines": 2, "model": "tiny", "micro_batch_size": 8,
                           "steps": steps})
    nb.cells.append(nbformat.v4.new_code_cell("print('notebook finished')"))
    nbformat.write(nb, root / "03_train.ipynb")
    BROWSER_OUT.mkdir(parents=True, exist_ok=True)
    shot = BROWSER_OUT / "03_train-mid-run.png"
    shot.unlink(missing_ok=True)
    log = tmp_path / "lab.log"
    with jupyterlab(root, log=log) as (base, token), chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        samples = run_all_and_watch(page, f"{base}/lab/tree/03_train.ipynb?token={token}",
                                    done_text="notebook finished", timeout_s=300, screenshot=shot,
                                    shot_when=lambda c: bool(c) and steps // 4 <= c[0][0] < steps)
    _save_timeline("03_train", samples)
    print(f"03_train mid-run screenshot: {shot}")
    live = samples[-1][1][0]  # the live figure is the first on the page; the demo-run figure follows
    assert live[0] == steps, samples[-1]  # the loss trace ends with every step
    assert _grew(samples, steps), samples  # and was drawn while the engines trained
    assert shot.is_file()
    # JupyterLab's terminal (the server's log) stayed quiet through training and stop_cluster
    (BROWSER_OUT / "03_train-jupyterlab.log").write_text(log.read_text())
    assert "Traceback" not in log.read_text(), f"see {BROWSER_OUT / '03_train-jupyterlab.log'}"
