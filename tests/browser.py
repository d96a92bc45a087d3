"""Test helpers: JupyterLab on 127.0.0.1 with a token, driven by Debian's Chromium through Playwright.

Playwright is the Python package only: it drives the system's ``/usr/bin/chromium`` (``make test``
installs Debian's package as root); no browser is downloaded. ``need_browser()`` skips the calling
test with one line when either is missing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]

COUNT_POINTS_JS = """() => [...document.querySelectorAll('.jp-OutputArea-output .js-plotly-plot, .jp-OutputArea-output.js-plotly-plot')]
    .map(gd => (gd.data || []).map(t => (t.x || []).length))"""
"""Per plotly figure on the page (as drawn by plotly.js), the number of points of each trace."""


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def need_browser() -> str:
    """The chromium path; skips the test (one line) without chromium or the playwright package."""
    path = chromium_path()
    if path is None:
        pytest.skip("chromium is not installed (make test installs Debian's chromium package as root)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the playwright package is not installed (make test installs the test extra)")
    return path


@contextlib.contextmanager
def chromium() -> Iterator:
    """A headless Playwright Browser on the system Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=need_browser(), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyterlab(root_dir: Path, *, log: Path) -> Iterator[tuple[str, str]]:
    """Start JupyterLab (this venv's) serving `root_dir` on 127.0.0.1 with a random token; yields
    (base URL, token). Kernels see this labkit on PYTHONPATH. Stops the server after."""
    token, port = secrets.token_hex(16), _free_port()
    state = root_dir.parent / f"{root_dir.name}-jupyter"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_RUNTIME_DIR=str(state / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(state / "workspaces"), IPYTHONDIR=str(state / "ipython"),
               JUPYTER_CONFIG_PATH=str(ROOT / "etc" / "jupyter"))  # as `make lab` runs it
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
           "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=root_dir, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start; see {log}:\n{log.read_text()[-2000:]}")
                time.sleep(0.5)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_all_and_watch(page, url: str, *, done_text: str, timeout_s: float = 240.0, every_s: float = 0.25,
                      screenshot: Path | None = None, shot_when=None) -> list[tuple[float, list[list[int]]]]:
    """Open a notebook, run all its cells as a person does (Shift+Enter on each), and sample the point counts of
    every plotly figure on the page every `every_s` s until an output contains `done_text`.

    Returns [(seconds since the run started, COUNT_POINTS_JS result)], the last sample taken after
    `done_text` appeared. `screenshot`: written once, the first time ``shot_when(counts)`` is true.
    Raises AssertionError on timeout, naming the last counts and any error output."""
    from playwright.sync_api import Error as PlaywrightError

    page.goto(url)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    page.wait_for_timeout(2000)  # the kernel's session settles after its first idle status
    with contextlib.suppress(Exception):  # JupyterLab's "official Jupyter news?" toast: answer it
        page.get_by_role("button", name="No").click(timeout=2000)
    dialogs = page.locator(".jp-Dialog")
    if dialogs.count():  # a modal (kernel selection, a server message) would take the clicks: say which
        raise AssertionError(f"JupyterLab shows a dialog before the run: {dialogs.all_inner_texts()}")
    page.locator(".jp-Notebook .jp-Cell .jp-InputPrompt").first.click()
    for _ in range(page.locator(".jp-Notebook .jp-Cell").count()):  # Shift+Enter: run, select the next cell
        page.keyboard.press("Shift+Enter")
    t0, samples, shot = time.monotonic(), [], screenshot is None
    while True:
        counts = page.evaluate(COUNT_POINTS_JS)
        samples.append((round(time.monotonic() - t0, 2), counts))
        if not shot and shot_when(counts):
            try:  # a live update can replace the figure's element between the lookup and the scroll
                page.locator(".jp-OutputArea-output .js-plotly-plot").first.scroll_into_view_if_needed(timeout=5000)
                page.screenshot(path=str(screenshot), full_page=False)
                shot = True
            except PlaywrightError:  # detached: try again at the next sample
                pass
        # textContent, not innerText: JupyterLab 4 skips rendering cells out of view (its default
        # windowingMode "contentVisibility"), and Chromium's innerText of a skipped cell is empty:
        # notebook 03's last output, below its live figures, read "" while the kernel sat idle
        outputs = page.locator(".jp-OutputArea-output").all_text_contents()
        if any(done_text in o for o in outputs):
            page.wait_for_timeout(1000)  # the final frame follows the text output within the same cell
            samples.append((round(time.monotonic() - t0, 2), page.evaluate(COUNT_POINTS_JS)))
            return samples
        errors = [o for o in outputs if "Traceback" in o]
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"no {done_text!r} after {timeout_s} s; last counts {counts}; {_cell_states(page)}; "
                                 f"outputs {outputs[-3:]}")
        if errors:
            raise AssertionError(f"the notebook failed: {errors[-1][-3000:]}")
        page.wait_for_timeout(int(every_s * 1000))


def _cell_states(page) -> str:
    """Where the run stands, for a timeout's message: the kernel's status and each cell's prompt
    ("[3]:" ran, "[*]:" running or queued, "[ ]:" never run) with its first line."""
    status = page.locator(".jp-Notebook-ExecutionIndicator").first.get_attribute("data-status")
    cells = page.evaluate("""() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')].map(c => {
        const p = c.querySelector('.jp-InputPrompt'); const src = c.querySelector('.jp-InputArea-editor');
        return ((p && p.textContent) || '').trim() + ' ' + ((src && src.textContent) || '').slice(0, 40); })""")
    return f"kernel {status}; cells {cells}"


LAYOUT_JS = """async () => {
    const out = [];
    for (const gd of document.querySelectorAll('.js-plotly-plot')) {
        gd.scrollIntoView();  // JupyterLab may skip laying out cells outside the viewport
        await new Promise(r => setTimeout(r, 250));
        const box = sel => [...gd.querySelectorAll(sel)].map(e => { const b = e.getBoundingClientRect();
            return [b.left, b.top, b.right, b.bottom]; }).filter(b => b[2] > b[0] && b[3] > b[1]);
        out.push({title: ((gd.layout || {}).title || {}).text || "", figure: box('.main-svg').slice(0, 1),
                  legend: box('.legend'), titles: box('.gtitle, .xtitle, .ytitle, .y2title'),
                  ticks: box('g.xtick text, g.ytick text, g.y2tick text')});
    }
    return out;
}"""
"""Per plotly figure on the page, each scrolled into view first: bounding boxes [left, top, right,
bottom] (CSS px) of the figure, the legend, the figure and axis titles and the tick labels."""


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5


def layout_problems(fig: dict) -> list[str]:
    """What is wrong with one ``LAYOUT_JS`` figure: the legend overlapping a title or a tick label,
    or lying outside the figure (cut off). [] when nothing is."""
    problems = []
    frame = fig["figure"][0] if fig["figure"] else None
    for legend in fig["legend"]:
        problems += [f"legend {legend} overlaps title {t}" for t in fig["titles"] if _overlap(legend, t)]
        problems += [f"legend {legend} overlaps tick label {t}" for t in fig["ticks"] if _overlap(legend, t)]
        if frame and (legend[0] < frame[0] - 1 or legend[2] > frame[2] + 1 or legend[3] > frame[3] + 1):
            problems.append(f"legend {legend} is cut off by the figure {frame}")
    return problems


REPORT_CHECK_JS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(gd => ({
    traces: (gd.data || []).length,
    xtitle: (((gd.layout || {}).xaxis || {}).title || {}).text || "",
    shapes: ((gd.layout || {}).shapes || []).length,
    shape_widths: [...gd.querySelectorAll('.shapelayer path')].map(p => parseFloat(getComputedStyle(p).strokeWidth)),
    ticks: Object.fromEntries(['xtick', 'ytick', 'y2tick'].map(c =>
        [c, [...gd.querySelectorAll('g.' + c + ' text')].map(t => t.textContent)])),
}))"""
"""Per drawn plotly figure: traces, the x-axis title, layout shapes, the stroke width of each drawn shape,
tick labels per axis."""


AXES_JS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(gd => {
    const full = gd._fullLayout || {}, out = {};
    const id = name => name.replace('axis', '');  // "xaxis2" -> "x2", as traces name their axes
    for (const name of Object.keys(full).filter(k => /^[xy]axis\\d*$/.test(k))) {
        const ax = full[name];
        if (!ax || !Array.isArray(ax.range) || !['linear', 'log'].includes(ax.type)) continue;
        const log = ax.type === 'log', vals = [];
        for (const t of gd._fullData || []) {
            if (t.visible !== true || (t[name[0] + 'axis'] || name[0]) !== id(name)) continue;
            const raw = t[name[0]];
            if (!raw || typeof raw.length !== 'number') continue;
            for (const v of Array.from(raw)) if (typeof v === 'number' && isFinite(v) && (!log || v > 0)) vals.push(v);
            const along = t.orientation === 'h' ? 'x' : 'y';  // bars grow from 0 along their value axis
            if (t.type === 'bar' && name[0] === along && !log) vals.push(0);
        }
        if (!vals.length) continue;
        const f = v => log ? Math.log10(v) : v;
        const [r0, r1] = [Math.min(...ax.range), Math.max(...ax.range)];
        let [d0, d1] = [f(Math.min(...vals)), f(Math.max(...vals))];
        if (!log && r0 <= 0 && 0 <= r1) [d0, d1] = [Math.min(d0, 0), Math.max(d1, 0)];  // a baseline at 0 counts
        out[name] = {type: ax.type, range: [r0, r1], data: [d0, d1], distinct: new Set(vals).size,
                     fill: r1 > r0 ? (Math.min(d1, r1) - Math.max(d0, r0)) / (r1 - r0) : 1};
    }
    return {title: ((gd.layout || {}).title || {}).text || '', axes: out};
})"""
"""Per drawn plotly figure: its title and, per numeric axis (linear or log; category and date
axes are left out), the drawn range (log10 units on a log axis), the extent of the data of the
visible traces on it (bars from 0; on a linear axis whose range holds 0, 0 counts as data: a
chosen baseline), the number of distinct values and ``fill``: the share of the range the data
spans."""

MIN_FILL = 0.2
"""A figure whose data fills less than this share of an axis's range is unreadable: the points
crowd into a corner (report 07's log axes ran to 1e33 when a label was placed at a value plotly
read as log10, and its points sat in the bottom tenth)."""


def axis_problems(fig: dict, *, min_fill: float = MIN_FILL) -> list[str]:
    """What is wrong with one ``AXES_JS`` figure's axes: data that lies outside the drawn range
    (beyond 1 % of it), or that fills less than ``min_fill`` of it (an axis with one distinct
    value has nothing to fill and is left out). [] when nothing is."""
    problems = []
    for name, ax in fig["axes"].items():
        (r0, r1), (d0, d1) = ax["range"], ax["data"]
        slack = 0.01 * (r1 - r0)
        if d0 < r0 - slack or d1 > r1 + slack:
            problems.append(f"{fig['title']!r} {name}: data {d0:.4g}..{d1:.4g} outside its range {r0:.4g}..{r1:.4g}")
        elif ax["distinct"] > 1 and ax["fill"] < min_fill:
            problems.append(f"{fig['title']!r} {name} ({ax['type']}): data {d0:.4g}..{d1:.4g} fills {ax['fill']:.0%} "
                            f"of its range {r0:.4g}..{r1:.4g}")
    return problems


def inspect_report(context, html: Path) -> dict:
    """Open one exported report in ``context`` (a Playwright browser context, offline for the
    tests) and return: failed_requests and remote_requests (URLs), charts_in_html (plotly divs
    in the file), charts_drawn, ``figures`` (``REPORT_CHECK_JS`` per drawn figure) and ``layout``
    (``LAYOUT_JS`` per drawn figure) and ``axes`` (``AXES_JS`` per drawn figure)."""
    import re

    page = context.new_page()
    failed, remote = [], []
    page.on("requestfailed", lambda r: failed.append(r.url))
    page.on("request", lambda r: remote.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
    page.goto(html.resolve().as_uri(), wait_until="load")
    page.wait_for_timeout(500)
    figs = page.evaluate(REPORT_CHECK_JS)
    axes = page.evaluate(AXES_JS)
    layout = page.evaluate(LAYOUT_JS)
    page.close()
    return {"failed_requests": failed, "remote_requests": remote,
            "charts_in_html": len(re.findall(r'class="plotly-graph-div"', html.read_text())),
            "charts_drawn": len(figs), "figures": figs, "axes": axes, "layout": layout}
