"""Notebooks 00..07 executed headlessly with a small setting on a tiny real corpus; every exported
report opened in Chromium with the network cut (no request, every chart drawn, no legend on a
title, whole-number ticks on counts, every axis spanning its data and filled a fifth or more); a
notebook alone stops at its first cell; a user's own notebook (no setup call) and 03_train
drawing live figures in JupyterLab.

The notebooks are the ones ``labkit demo`` executed into its reports (tests/conftest.py's
``demo_run``, shared with tests/test_demo.py: a tiny real corpus, 2 local engines, the notebooks
on the demo's engines by ``cluster_id``, two at a time); these tests check the reports and what
the notebooks left in the demo's work directory, then run 03 again in JupyterLab on it.
Chromium is Debian's ``chromium`` package, installed by ``make test`` (its
``browser`` prerequisite), driven by the playwright package (tests/browser.py); without either the
browser tests are skipped, saying so."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from test_demo import SMALL

NOTEBOOKS = ("00_cluster", "01_prepare", "02_stage_and_load", "03_train", "04_scaling", "05_scaling_laws",
             "06_model_parallel", "07_critical_batch")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def workdir(demo_run) -> Path:
    """The demo's work directory (its notebooks' parameters: tests/test_demo.py's ``SMALL`` and
    ``_config``)."""
    return demo_run[0]


@pytest.fixture(scope="module")
def reports(demo_run) -> dict[str, Path]:
    """{notebook: its HTML report} as the demo executed them."""
    return {Path(p).stem: Path(p) for p in demo_run[1]["reports"]}


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
        mine = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "notebooks/Untitled.ipynb"])
        assert mine.returncode == 1  # a user's own notebook is not ignored: git status shows it


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
    from labkit import lab

    rep = lab.preparation_report(str(workdir))  # one-process clean output (a single Parquet file) counts too
    assert rep["kinds"] == ["elf"] and rep["sources"]["elf"]["kept"] == rep["documents_kept"] > 0, rep["sources"]
    assert rep["examples"]["elf"] == pl.read_parquet(workdir / "clean" / "docs.parquet")["text"][0][:240]
    # the sweeps of notebook 04 and the law runs of notebook 05 left their artifacts
    sizes = pl.read_parquet(workdir / "sweeps" / "model_size.parquet")
    assert sizes["model"].to_list() == ["tiny", "mini"] and (sizes["tokens_per_s"] > 0).all()
    loader = pl.read_parquet(workdir / "sweeps" / "loader.parquet")
    assert loader["num_workers"].to_list() == SMALL["loader_workers"] and (loader["samples_per_s"] > 0).all()
    assert sorted(p.name for p in (workdir / "runs").glob("law-*")) == [f"law-{w}" for w in SMALL["law_widths"]]
    text = (reports["05_scaling_laws"]).read_text()
    assert "bootstrap_p05" in text and "compute-optimal" in text
    law_records = [json.loads(line) for line in (workdir / "runs" / "law-16" / "metrics.jsonl").read_text().splitlines()]
    assert sum("eval_loss" in r for r in law_records) == SMALL["law_points"]  # notebook 05 fits held-out loss
    # notebook 03 draws the demo's run (30 steps) from its files: nothing trained again, the same figures
    assert not (workdir / "runs" / "notebook-03").exists()
    nb03 = nbformat.read(reports["03_train"].with_suffix(".ipynb"), as_version=4)
    figs = [o["data"]["application/vnd.plotly.v1+json"] for c in nb03.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if "application/vnd.plotly.v1+json" in o.get("data", {})]
    demo_result = json.loads((workdir / "runs" / "demo" / "result.json").read_text())
    loss = next(f for f in figs if "Training loss of tiny" in f["layout"]["title"]["text"])
    assert "30 steps" in loss["layout"]["title"]["text"] and demo_result["steps"] == 30
    steps_drawn = next(t for t in loss["data"] if t.get("name") == "loss")["x"]
    assert list(steps_drawn) == list(range(1, 31))  # every logged step of runs/demo
    heat = next(f for f in figs if any(t.get("type") == "heatmap" for t in f["data"]))
    assert {len(t["y"]) for t in heat["data"] if t.get("type") == "heatmap"} == {2}  # both ranks' timelines
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
    from browser import axis_problems, chromium, inspect_report, layout_problems, need_browser

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
                if fig["xtitle"] in ("step", "documents"):  # counts: whole-number ticks only
                    assert all(re.fullmatch(r"[\d,]+", t) for t in fig["ticks"]["xtick"]), (name, fig["ticks"])
            problems = [p for fig in r["layout"] for p in layout_problems(fig)]
            assert not problems, (name, problems)  # no legend on a title or tick label, none cut off
            problems = [p for fig in r["axes"] for p in axis_problems(fig)]
            assert not problems, (name, problems)  # every axis spans its data, which fills a fifth of it or more
            if name == "07_critical_batch":  # both log-log figures' axes were checked (labels placed at log10)
                assert sum(len(f["axes"]) for f in r["axes"]) >= 4, r["axes"]
            if name == "04_scaling":  # the 90 % line and the capacity line (the knee only when one is found)
                assert sum(f["shapes"] for f in figs) >= 2, figs


def test_a_notebook_alone_stops_at_its_first_cell_naming_notebook_01(tmp_path):
    """02-05 on a work directory that 01 never prepared: the first cell after the parameters stops
    with one line naming what to run first, before any engine is started."""
    import nbformat
    from nbclient.exceptions import CellExecutionError

    from labkit.report import execute_notebook, read_notebook

    for name in NOTEBOOKS[2:]:
        cells = [c for c in read_notebook(ROOT / "notebooks" / f"{name}.py").cells if c.cell_type == "code"]
        first = next(c for c in cells[1:] if "parameters" not in c.metadata.get("tags", []))
        assert first.source.index("lab.require_prepared(workdir)") < first.source.index("start_cluster") \
            if "start_cluster" in first.source else "lab.require_prepared(workdir)" in first.source, name
    out = tmp_path / "reports" / "03_train.html"
    with pytest.raises(CellExecutionError, match="NotPrepared"):
        execute_notebook(ROOT / "notebooks" / "03_train.py", out, parameters={"workdir": str(tmp_path / "empty")},
                         timeout=120, cwd=str(tmp_path))
    nb = nbformat.read(out.with_suffix(".ipynb"), as_version=4)
    errors = [(k, o) for k, c in enumerate(nb.cells) for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert len(errors) == 1, errors
    k, err = errors[0]
    assert k == next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "require_prepared" in c.source)
    assert len(err["traceback"]) == 1 and "run notebooks/01_prepare.py first" in err["traceback"][0], err["traceback"]
    assert not (tmp_path / "empty").exists()  # nothing was made, no engine started


# ---- in JupyterLab, driven by Chromium (tests/browser.py) ------------------------------------------

BROWSER_OUT = ROOT / "work" / "browser"
"""Screenshots and point counts of the browser tests (outside git: /work/ is ignored)."""

USER_NOTEBOOK = [
    # a new notebook, as a user writes it: no labkit setup call anywhere
    """from labkit import cluster as lc
from labkit import lab, plots
from labkit.config import TrainConfig

workdir = {workdir!r}
cluster = lc.start_cluster(2)
client = lc.get_client(cluster)
staged = lab.stage(client, workdir)""",
    """cfg = TrainConfig(data_dir=f"{{workdir}}/shards", run_dir=f"{{workdir}}/runs/mine", model="tiny",
                  max_steps={steps}, num_threads=1, resume=False, batch={{"micro_batch_size": 8}},
                  schedule={{"warmup_steps": 2}}, checkpoint={{"enabled": False}})
live = plots.LivePlot(plots.loss_figure)
result = lab.train_on_cluster(client, cfg, staged=staged, live=live)
print("trained", result["steps"], "steps in", round(result["wall_s"], 1), "s; drawn", live.draws, "times")""",
    """def feed(n, sink=None):  # run_ddp's own live option: rank 0 publishes through its sink
    import time
    for step in range(1, n + 1):
        if sink is not None:
            sink({{"step": step, "loss": 10 / step}})
        time.sleep(0.5)
    return n

lc.run_ddp(client, feed, {fed}, live=plots.LivePlot(plots.loss_figure))""",
    "lc.stop_cluster(cluster)",
    # notebook 04's efficiency figure and 05's law figure, whose legends wrapped onto the x-axis title
    """import numpy as np
import polars as pl
from labkit.study import laws, plan, scaling

curves = [scaling.study_scaling(name, micro_batch=b, seq_len=512, network=net, sparse_head=False)
          .with_columns(label=pl.lit(f"{{name}} b={{b}} {{net}}"))
          for name, b in plan.STUDY_MICRO_BATCH.items() for net in ("25GbE", "IB-NDR")]
plots.efficiency_figure(pl.concat(curves), measured=pl.DataFrame({{"ranks": [1, 2], "efficiency": [1.0, 0.8]}}))""",
    """n, d = np.repeat([2e4, 5e4, 1e5], 4), np.tile([1e5, 3e5, 1e6, 3e6], 3)
points = pl.DataFrame({{"n_params": n, "n_tokens": d, "loss": laws.CHINCHILLA.loss(n, d)}})
frontier = pl.DataFrame([laws.compute_optimal(c, laws.CHINCHILLA) for c in np.geomspace(1e10, 1e13, 8)])
plots.law_figure(points, laws.CHINCHILLA, frontier=frontier,
                 title="Held-out MLM loss of tiny encoders on binary code, with the fitted law")""",
    'print("notebook finished")',
]


def _sizes(samples: list, figure: int, total: int) -> list[int]:
    """The distinct point counts of figure `figure`'s first trace seen while the notebook ran
    (between 0 and `total`, the final count, both excluded)."""
    return sorted({c[figure][0] for _, c in samples[:-1] if len(c) > figure and c[figure] and 0 < c[figure][0] < total})


def _save_timeline(name: str, samples: list) -> Path:
    import json

    BROWSER_OUT.mkdir(parents=True, exist_ok=True)
    path = BROWSER_OUT / f"{name}.points.json"
    path.write_text(json.dumps([{"t_s": t, "points_per_trace": c} for t, c in samples]))
    print(f"{name}: point counts over time in {path}")
    return path


def test_live_figures_grow_in_jupyterlab_in_a_users_notebook_and_in_03(workdir, tmp_path):
    """One JupyterLab, two notebooks run as a person does (Shift+Enter on each cell).

    A user's own notebook that never calls plots.setup_notebook_plotting: LivePlot through
    train_on_cluster and through run_ddp's own live option, each figure growing through at least
    5 sizes while its cell runs; then, at JupyterLab's output width, no legend overlapping a title
    or a tick label (04's efficiency and 05's law figure had wrapped theirs onto the x-axis title).
    Then notebook 03 itself, its live figure drawn while the engines train (a mid-run screenshot).
    JupyterLab's terminal (the server's log) stays quiet through both, stop_cluster included."""
    import nbformat

    from browser import LAYOUT_JS, chromium, jupyterlab, layout_problems, need_browser, run_all_and_watch
    from labkit.report import inject_parameters, read_notebook

    need_browser()
    root = tmp_path / "lab"
    root.mkdir()
    steps, fed, steps_03 = 400, 20, 100  # 200 steps took ~5 s on CI, 4 redraws at 1 per s
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c.format(workdir=str(workdir), steps=steps, fed=fed)) for c in USER_NOTEBOOK]
    nbformat.write(nb, root / "Untitled.ipynb")
    nb03 = read_notebook(ROOT / "notebooks" / "03_train.py")
    inject_parameters(nb03, {"workdir": str(workdir), "engines": 2, "model": "tiny", "micro_batch_size": 8,
                             "steps": steps_03})
    nb03.cells.append(nbformat.v4.new_code_cell("print('notebook finished')"))
    nbformat.write(nb03, root / "03_train.ipynb")
    BROWSER_OUT.mkdir(parents=True, exist_ok=True)
    shot = BROWSER_OUT / "03_train-mid-run.png"
    shot.unlink(missing_ok=True)
    log = tmp_path / "lab.log"
    with jupyterlab(root, log=log) as (base, token), chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        samples = run_all_and_watch(page, f"{base}/lab/tree/Untitled.ipynb?token={token}", done_text="notebook finished",
                                    timeout_s=300)
        layout = page.evaluate(LAYOUT_JS)
        page.close()
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        samples_03 = run_all_and_watch(page, f"{base}/lab/tree/03_train.ipynb?reset&token={token}",  # reset: only 03 open
                                       done_text="notebook finished", timeout_s=300, screenshot=shot,
                                       shot_when=lambda c: bool(c) and steps_03 // 4 <= c[0][0] < steps_03)
    _save_timeline("users_notebook", samples)
    _save_timeline("03_train", samples_03)
    final = samples[-1][1]
    assert [f[0] for f in final[:2]] == [steps, fed], final  # both live figures end with every record
    trained, fed_sizes = _sizes(samples, 0, steps), _sizes(samples, 1, fed)
    assert len(trained) >= 5, (trained, samples)  # redrawn in place while the engines trained
    assert len(fed_sizes) >= 5, (fed_sizes, samples)
    assert len(layout) == 4 and layout[2]["legend"] and layout[3]["legend"], layout
    problems = {f["title"]: layout_problems(f) for f in layout}
    assert not any(problems.values()), problems
    # notebook 03: the live figure is the first on the page (its demo-run figure, if any, follows)
    assert samples_03[-1][1][0][0] == steps_03, samples_03[-1]  # the loss trace ends with every step
    assert _sizes(samples_03, 0, steps_03), samples_03  # and was drawn while the engines trained
    print(f"03_train mid-run screenshot: {shot}")
    assert shot.is_file()
    (BROWSER_OUT / "jupyterlab.log").write_text(log.read_text())
    assert "Traceback" not in log.read_text(), f"see {BROWSER_OUT / 'jupyterlab.log'}"
