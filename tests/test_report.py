"""labkit.report: execute a small notebook with injected parameters, export and check the HTML."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import plotly.io as pio
import pytest

from labkit import report


def _notebook(path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# tiny report"),
        nbformat.v4.new_code_cell("n_points = 3\ntitle = 'default'", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            "import os\n"
            "import plotly.graph_objects as go\n"
            "from labkit.plots import setup_notebook_plotting\n"
            "setup_notebook_plotting()\n"
            "print('IPP', os.environ.get('IPP_NONINTERACTIVE'))\n"
            "fig = go.Figure(go.Scatter(x=list(range(n_points)), y=[i * i for i in range(n_points)]))\n"
            "fig.update_layout(title=title)\n"
            "fig"),
        nbformat.v4.new_code_cell("print('squares', [i * i for i in range(n_points)], title)"),
    ]
    nbformat.write(nb, path)
    return path


def _text(nb):
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_inject_parameters_after_tagged_cell_replaces_old_injection(tmp_path):
    nb = nbformat.read(_notebook(tmp_path / "t.ipynb"), as_version=4)
    report.inject_parameters(nb, {"n_points": 4})
    report.inject_parameters(nb, {"n_points": 5, "title": "it's"})
    tags = [c.metadata.get("tags", []) for c in nb.cells]
    assert tags[1] == ["parameters"] and tags[2] == ["injected-parameters"] and len(nb.cells) == 5
    ns = {}
    exec(nb.cells[2].source, ns)
    assert (ns["n_points"], ns["title"]) == (5, "it's")
    with pytest.raises(ValueError, match="not a Python identifier"):
        report.inject_parameters(nb, {"bad name": 1})
    with pytest.raises(ValueError, match="'title'.*not a Python literal"):
        report.inject_parameters(nb, {"title": object()})
    with pytest.raises(ValueError, match=r"'n_pionts' is not declared .*\(declared: n_points, title\)"):
        report.inject_parameters(nb, {"n_pionts": 4})  # a misspelt parameter is an error, not ignored
    assert report.declared_parameters(nb) == ["n_points", "title"]


def test_execute_notebook_exports_offline_html(tmp_path, capfd):
    src = _notebook(tmp_path / "tiny.ipynb")
    out = report.execute_notebook(src, tmp_path / "out" / "tiny.html", parameters={"n_points": 5, "title": "injected"},
                                  timeout=120)
    err = capfd.readouterr().err  # the kernel's own stderr: it ran over IPC sockets, not TCP, so it did not warn
    assert "running over TCP" not in err and "WARNING" not in err, err[-2000:]
    executed = nbformat.read(tmp_path / "out" / "tiny.ipynb", as_version=4)
    text = _text(executed)
    assert "squares [0, 1, 4, 9, 16] injected" in text  # the injected value took effect
    assert "IPP 1" in text
    info = report.check_report(out)
    assert info["figures"] == 1 and info["plotly_js_embedded"] and info["ok"]
    assert info["external_plotly_scripts"] == [] and info["widgets"] == 0
    html = out.read_text()
    assert info["external_resources"] == [] and "require.js" not in html and "MathJax.js" not in html
    assert "injected" in html and "<title>tiny report</title>" in html  # the notebook's heading, not "Notebook"
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.html", "tiny.ipynb"]  # no temp files left


def test_check_report_flags_cdn_plotly_and_widgets(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text('<script src="https://cdn.plot.ly/plotly-3.0.1.min.js"></script>'
                   '<div class="plotly-graph-div"></div>'
                   '<script type="application/vnd.jupyter.widget-view+json">{}</script>')
    info = report.check_report(bad)
    assert not info["ok"] and not info["plotly_js_embedded"] and len(info["external_resources"]) == 1
    assert len(info["external_plotly_scripts"]) == 1 and info["widgets"] == 1 and info["figures"] == 1
    with pytest.raises(FileNotFoundError, match="missing.html"):
        report.check_report(tmp_path / "missing.html")


def test_failing_notebook_keeps_partial_notebook_and_raises(tmp_path):
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("raise RuntimeError(f'bad x={x}')")]
    nbformat.write(nb, tmp_path / "fail.ipynb")
    with pytest.raises(CellExecutionError, match="bad x=2"):
        report.execute_notebook(tmp_path / "fail.ipynb", tmp_path / "out" / "fail.html", parameters={"x": 2}, timeout=60)
    partial = nbformat.read(tmp_path / "out" / "fail.ipynb", as_version=4)
    assert partial.cells[1].source == "# Parameters (injected by labkit.report)\nx = 2"
    assert partial.cells[2].outputs[0]["ename"] == "RuntimeError"
    assert not (tmp_path / "out" / "fail.html").exists()
    # executed in a process of its own (labkit demo's reports): the failure names the notebook and
    # its cell's error, and the next notebook of the lane does not start
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "next.ipynb")
    with pytest.raises(RuntimeError, match="notebook fail failed") as err:
        report.execute_notebooks([[(tmp_path / "fail.ipynb", tmp_path / "lane" / "fail.html", {"x": 3}),
                                   (tmp_path / "next.ipynb", tmp_path / "lane" / "next.html", {})]], cwd=tmp_path)
    assert "bad x=3" in str(err.value) and not (tmp_path / "lane" / "next.html").exists()


LIVE_CELL = '''
import json
from labkit import cluster as C
from labkit.plots import LivePlot, loss_figure, setup_notebook_plotting

setup_notebook_plotting()

def fake_train(n_steps, sink=None):
    import datetime, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    for step in range(n_steps):
        t = torch.tensor([1.0]); dist.all_reduce(t)
        if sink is not None:
            sink({"step": step, "loss": 10.0 / (step + 1), "tokens_per_s": 100.0 * t.item()})
        time.sleep(0.25)
    return dist.get_rank()

cl = C.start_cluster(2)
try:
    live = LivePlot(loss_figure)
    ranks = C.run_ddp(C.get_client(cl), fake_train, n_steps, live=live, timeout=120)
finally:
    C.stop_cluster(cl)
print("ranks", ranks, "draws", live.draws)
'''


def test_live_ddp_notebook_keeps_one_final_plot(tmp_path):
    """docs/references.md 'Checked': raw-bundle update_display leaves one plot holding the final data."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("n_steps = 2", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(LIVE_CELL)]
    nbformat.write(nb, tmp_path / "live.ipynb")
    with pytest.raises(ValueError, match="overwrite the source"):
        report.execute_notebook(tmp_path / "live.ipynb", tmp_path / "live.html", parameters={})
    out = report.execute_notebook(tmp_path / "live.ipynb", tmp_path / "out" / "live.html", parameters={"n_steps": 8},
                                  timeout=180)
    executed = nbformat.read(out.with_suffix(".ipynb"), as_version=4)
    outputs = executed.cells[2].outputs
    plots = [o for o in outputs if "text/html" in o.get("data", {}) and "plotly-graph-div" in o["data"]["text/html"]]
    assert len(plots) == 1  # live frames were HTML; the final frame adds the plotly mimetype
    fig = pio.from_json(pio.to_json(plots[0]["data"]["application/vnd.plotly.v1+json"]))
    assert list(fig.data[0].x) == list(range(8))  # the final history, all 8 steps
    assert list(fig.data[0].y) == [10.0 / (s + 1) for s in range(8)]
    assert "ranks [0, 1]" in _text(executed)
    assert nbformat.read(tmp_path / "live.ipynb", as_version=4).cells[1].outputs == []  # source untouched
    info = report.check_report(out)
    assert info["ok"] and info["figures"] == 1


def test_parameter_types_are_checked_before_anything_runs(tmp_path, capsys):
    from labkit.cli import main

    src = _notebook(tmp_path / "t.ipynb")
    nb = nbformat.read(src, as_version=4)
    assert report.parameter_defaults(nb) == {"n_points": 3, "title": "default"}
    with pytest.raises(ValueError, match=r"^parameter 'n_points': expected int like its default 3, got 'three'$"):
        report.inject_parameters(nb, {"n_points": "three"})
    for bad in ({"n_points": True}, {"n_points": 2.5}, {"title": 4}):
        with pytest.raises(ValueError, match="expected"):
            report.check_parameters(nb, bad)
    report.check_parameters(nb, {"n_points": 4, "title": "x"})
    out = tmp_path / "out" / "t.html"
    assert main(["report", str(src), str(out), "--param", "n_points=three"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "parameter 'n_points': expected int" in err[0], err
    assert not out.parent.exists(), "refused before the kernel started or anything was written"


def test_nbformat_loads_without_jsonschemas_iri_checker_and_still_validates():
    # a fresh interpreter, as a kernel is: the notebook plotting setup and labkit.report import
    # nbformat with jsonschema but not rfc3987_syntax (3.7 CPU-s of Lark grammar, labkit._nbformat)
    code = """
import sys
from labkit import plots
plots.setup_notebook_plotting()
import labkit.report as r
import jsonschema
nb = r.nbformat.v4.new_notebook()
nb.cells.append(r.nbformat.v4.new_code_cell("1"))
r.nbformat.validate(nb)
bad = r.nbformat.v4.new_notebook()
bad.cells.append({"cell_type": "code", "source": 1})
try:
    r.nbformat.validate(bad)
    raise SystemExit("an invalid notebook passed")
except r.nbformat.ValidationError:
    pass
checkers = jsonschema.FormatChecker.checkers
print("rfc3987_syntax" in sys.modules, "iri" in checkers, "uri" in checkers, "date-time" in checkers)
import rfc3987_syntax
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False False True True"
