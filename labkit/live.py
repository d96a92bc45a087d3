"""A figure redrawn in place in a notebook output while engines work: ``LivePlot``.

JupyterLab redraws a text/html output on every ``update_display_data`` but not a plotly-mimetype
one (plotly/plotly.py#3053), so the frames between the first and the last are HTML that draws
with the page's plotly.js (``live_html``); the first and the final frames carry the plotly
mimetype too, which the front end draws with its own renderer (and which, in JupyterLab, puts
plotly.js on the page for the HTML frames). ``labkit.plots`` re-exports both names.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable

import plotly.graph_objects as go
import plotly.io as pio
import polars as pl

__all__ = ["live_html", "LivePlot", "StallView"]


_LIVE_SCRIPT = """<div id="{div_id}" class="plotly-graph-div" style="height:{height}px; width:100%;"></div>
<script type="text/javascript">
(function () {{
  var all = window.labkitLive = window.labkitLive || {{}};
  var s = all["{div_id}"] = all["{div_id}"] || {{readyAt: 0}};
  s.fig = {fig_json};  // the newest frame; one waiting to be drawn is replaced, not queued
  var el = document.getElementById("{div_id}");
  if (s.gd && el && el !== s.gd && !el.firstChild) {{ el.replaceWith(s.gd); }}  // keep the drawn plot in place
  function draw(tries) {{
    s.timer = null;
    var gd = document.getElementById("{div_id}"), wait = s.readyAt - performance.now();
    if (!gd || !window.Plotly) {{ if (tries > 0) {{ s.timer = setTimeout(function () {{ draw(tries - 1); }}, 100); }} return; }}
    if (wait > 0) {{ s.timer = setTimeout(function () {{ draw(tries); }}, wait); return; }}
    var t0 = performance.now();
    s.gd = gd;
    window.Plotly.react(gd, s.fig.data, s.fig.layout, {{"responsive": true}});
    s.readyAt = performance.now() + 2 * (performance.now() - t0);  // twice as long as the draw took
  }}
  if (!s.timer) {{ s.timer = setTimeout(function () {{ draw(100); }}, 0); }}  // frames of this task: the newest
}})();
</script>"""


def live_html(fig: go.Figure, div_id: str, *, height: int = 450) -> str:
    """HTML (a plotly div and a script drawing `fig` into it with the page's plotly.js) for a live output.

    JupyterLab and the classic notebook re-render a text/html output on update_display_data, but
    not a plotly mimetype output (plotly/plotly.py#3053), so live frames are HTML. The script
    waits up to 10 s for ``window.Plotly`` and for the div, then draws with ``Plotly.react``.

    The page draws live frames only as fast as it can afford (``window.labkitLive``, one entry per
    ``div_id``): after a figure's draw it waits at least twice as long as that draw took before
    drawing the figure again (each live figure keeps the page busy a third of the time at most);
    a frame arriving meanwhile replaces the one waiting, so only the newest is drawn and none pile up; and the plot already drawn is moved into the new output's place
    and updated there (``Plotly.react``), so the figure never blanks between frames. Without this
    a loaded machine's browser fell behind the frames (the rank view's 0.3-1.8 s per draw, two
    figures a second) and rendered a backlog long after the run ended, its page unresponsive
    meanwhile. ``div_id`` must be the same for every frame of one figure. The
    page has ``window.Plotly`` once any plotly-mimetype figure was drawn (JupyterLab's plotly
    renderer, the jupyterlab-plotly extension of the plotly package, loads its plotly.js bundle
    from the local Jupyter server, which defines it; ``LivePlot``'s first frame is such a figure)
    or after ``setup_notebook_plotting``. `height` in CSS pixels."""
    fig_json = pio.to_json(fig, validate=False).replace("</", "<\\/")  # keep </script> out of the JSON
    return _LIVE_SCRIPT.format(div_id=div_id, height=int(height), fig_json=fig_json)


class LivePlot:
    """A figure redrawn in place in a notebook output, at most once per `min_interval` seconds.

    `LivePlot(make_figure)(records)`: records (list of dicts, e.g. metrics records published by
    `labkit.cluster.run_ddp`) become a polars DataFrame passed to make_figure. The first draw is
    `display(bundle, raw=True, display_id=...)`, later ones `update_display(...)` of the same id.
    Frames while running are text/html (``live_html``), which JupyterLab redraws on every update;
    `flush()` (run_ddp calls it at the end) draws the final frame with the plotly mimetype added,
    so the saved notebook renders even untrusted and the exported HTML keeps every point offline.
    Calls inside the interval are kept and drawn by the next call or by `flush()`. The output is
    `height` CSS pixels tall, or the figure's own layout height when it sets one (a rank view
    grows with its ranks: 1,456 px at 64; a fixed output would cut its lower panels off).

    No setup call is needed: the first frame, like the final one, carries the plotly mimetype too,
    so the front end draws it with its own plotly renderer (JupyterLab, Notebook 7 and VS Code
    do, offline), which in JupyterLab also gives the page the ``window.Plotly`` the HTML frames
    after it draw with (``live_html``); no 4.8 MB copy of plotly.js travels with the frames.
    Exported HTML (nbconvert) and the classic Notebook 6 interface (no plotly renderer of its own)
    need ``setup_notebook_plotting`` for plotly.js, as every figure does. Once it has put plotly.js
    on the page (``page_has_plotly``), the first frame is HTML too: JupyterLab's plotly renderer
    took 4-6 s of the page's time for each figure's first frame on a loaded VM (loading its own
    plotly.js, then drawing), during which notebook 03's run of 100 tiny steps had ended.
    """

    page_has_plotly = False
    """True once ``labkit.plots.setup_notebook_plotting`` emitted plotly.js into this kernel's
    notebook: the HTML frames draw with it from the first."""

    def __init__(self, make_figure: Callable[[pl.DataFrame], go.Figure], *, min_interval: float = 1.0,
                 height: int = 450):
        self.make_figure = make_figure
        self.min_interval = min_interval
        self.height = height
        self.display_id = f"labkit-live-{uuid.uuid4().hex}"
        self.draws = 0
        self._records: list[dict] | None = None
        self._pending = False
        self._final = False
        self._last = float("-inf")

    def __call__(self, records: list[dict]) -> None:
        self._records, self._pending = list(records), True
        if time.monotonic() - self._last >= self.min_interval:
            self._draw(final=False)

    def frame(self, records: list[dict]) -> pl.DataFrame:
        """The records as the frame ``make_figure`` gets (a subclass with a known schema reads them faster)."""
        return pl.from_dicts(records, infer_schema_length=None)

    def flush(self) -> None:
        """Draw the latest records as the final frame (HTML + plotly mimetype); no-op if already drawn."""
        if self._records is None or (self._final and not self._pending):
            return
        self._draw(final=True)

    def _draw(self, *, final: bool) -> None:
        from IPython.display import display, update_display

        fig = self.make_figure(self.frame(self._records))
        height = int(fig.layout.height or self.height)  # a figure that grows with its rows (64 ranks) keeps its output
        bundle = {"text/html": live_html(fig, f"{self.display_id}-plot", height=height),
                  "text/plain": f"<labkit live figure: {len(self._records)} records>"}
        if final or (self.draws == 0 and not LivePlot.page_has_plotly):  # drawn natively (class docstring); JupyterLab does not
            # redraw a plotly-mimetype output on update_display, so the frames between are HTML only
            bundle["application/vnd.plotly.v1+json"] = json.loads(pio.to_json(fig, validate=False))
        if self.draws == 0:
            display(bundle, raw=True, display_id=self.display_id)
        else:
            update_display(bundle, raw=True, display_id=self.display_id)
        self.draws += 1
        self._pending, self._final = False, final
        self._last = time.monotonic()


class StallView:
    """The stuck-rank view of a running ``run_ddp`` call: ``view(found)`` with
    ``labkit.cluster.stuck.StallWatch.poll``'s result about once a second.

    While a step is stalled (``found`` not None) it shows one line in bold, naming the rank the
    others wait for, its host and the collective they wait in ("stuck: ..." when that rank's
    process is not running, "slow: ..." when it runs), and below it that rank's Python stack and
    where the stack came from; when the run moves again the line says it moved on.
    In IPython it is one output updated in place (``display``/``update_display`` of an HTML bundle
    with a text/plain line); outside IPython the line (and the stack's innermost frames) are printed
    to stderr once per stall. ``text`` holds the line shown now ("" before any stall), ``lines``
    every line shown, ``html`` the last HTML."""

    def __init__(self, *, frames: int = 12):
        self.frames = frames
        self.display_id = f"labkit-stall-{uuid.uuid4().hex}"
        self.text, self.html, self.lines = "", "", []
        self._key: tuple | None = None
        self._shown = False

    def __call__(self, found: dict | None) -> None:
        if found is None:
            if self._key is not None:
                self._key = None
                self._show("moved on: " + self.text.split(": ", 1)[-1], [], "", new=True)
            return
        key = (found["rank"], found["seq"], found.get("kind"), found.get("stack_source", "").split(" ")[0])
        new, self._key = key != self._key, key
        source = found.get("stack_source", "") + (f"; in labkit at {found['in_labkit']}" if found.get("in_labkit") else "")
        self._show(f"{found.get('kind', 'stuck')}: {found['line']}", found.get("stack") or [], source, new=new)

    def _show(self, line: str, stack: list[str], source: str, *, new: bool) -> None:
        """Show ``line`` and ``stack``: the notebook output updated in place every call; on stderr
        (outside IPython) only when ``new`` (another rank, collective or kind of stack)."""
        import html
        import sys

        self.text = line
        if new:
            self.lines.append(line)
        frames = stack[-self.frames:]
        self.html = (f'<div style="border-left:4px solid #c0392b;padding:4px 8px"><b>{html.escape(line)}</b>'
                     + (f"<details open><summary>its Python stack ({html.escape(source)}), innermost last</summary>"
                        f"<pre>{html.escape(chr(10).join(frames))}</pre></details>" if frames else "") + "</div>")
        try:
            from IPython import get_ipython
            from IPython.display import display, update_display
        except ImportError:  # pragma: no cover
            get_ipython = lambda: None  # noqa: E731
        if get_ipython() is None:
            if new:
                print(f"labkit: {line}", file=sys.stderr, flush=True)
                if frames:
                    print(f"labkit: its Python stack ({source}), innermost last:\n"
                          + "\n".join(f"    {f}" for f in frames[-5:]), file=sys.stderr, flush=True)
            return
        bundle = {"text/html": self.html, "text/plain": line}
        if not self._shown:
            display(bundle, raw=True, display_id=self.display_id)
        else:
            update_display(bundle, raw=True, display_id=self.display_id)
        self._shown = True
