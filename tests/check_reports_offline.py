"""Open every report of a work directory in Debian's Chromium with the network cut, and print per
report: failed and remote requests, charts in the HTML and charts drawn, reference-line shapes
and their stroke widths, axes with repeated tick labels (the checks tests/test_notebooks.py makes
on the test corpus's reports). Usage, from the repository root inside .venv:

    python tests/check_reports_offline.py work/demo/reports

Exits 1 when a report made a request, left a chart undrawn or drew a line of width 0.
"""
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser import chromium  # noqa: E402
from test_notebooks import REPORT_CHECK_JS  # noqa: E402

reports = sorted(Path(sys.argv[1]).glob("*.html"))
out = {}
with chromium() as browser:
    ctx = browser.new_context()
    ctx.set_offline(True)
    for html in reports:
        page = ctx.new_page()
        failed, remote = [], []
        page.on("requestfailed", lambda r: failed.append(r.url))
        page.on("request", lambda r: remote.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
        page.goto(html.resolve().as_uri(), wait_until="load")
        page.wait_for_timeout(800)
        figs = page.evaluate(REPORT_CHECK_JS)
        expected = len(re.findall(r'class="plotly-graph-div"', html.read_text()))
        dup = [(a, l) for f in figs for a, l in f["ticks"].items() if len(l) != len(set(l))]
        out[html.name] = {"failed_requests": len(failed), "remote_requests": len(remote), "charts_in_html": expected,
                          "charts_drawn": len(figs), "shapes": sum(f["shapes"] for f in figs),
                          "shape_stroke_widths": [w for f in figs for w in f["shape_widths"]],
                          "axes_with_repeated_tick_labels": dup}
        page.close()
print(json.dumps(out, indent=1))
bad = [name for name, r in out.items() if r["failed_requests"] or r["remote_requests"]
       or r["charts_drawn"] != r["charts_in_html"] or 0 in r["shape_stroke_widths"]]
sys.exit(1 if bad else 0)
