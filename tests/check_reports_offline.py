"""Open every report of a work directory in Debian's Chromium with the network cut, and print per
report: failed and remote requests, charts in the HTML and charts drawn, reference-line shapes
and their stroke widths, axes with repeated tick labels (the checks tests/test_notebooks.py makes
on the test corpus's reports, through the same ``browser.inspect_report``). Usage, from the
repository root inside .venv:

    python tests/check_reports_offline.py work/demo/reports

Exits 1 when a report made a request, left a chart undrawn or drew a line of width 0.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser import chromium, inspect_report  # noqa: E402

out = {}
with chromium() as browser:
    context = browser.new_context()
    context.set_offline(True)
    for html in sorted(Path(sys.argv[1]).glob("*.html")):
        r = inspect_report(context, html)
        figs = r.pop("figures")
        out[html.name] = {**{k: len(v) if isinstance(v, list) else v for k, v in r.items()},
                          "shapes": sum(f["shapes"] for f in figs),
                          "shape_stroke_widths": [w for f in figs for w in f["shape_widths"]],
                          "axes_with_repeated_tick_labels": [(a, labels) for f in figs for a, labels in f["ticks"].items()
                                                             if len(labels) != len(set(labels))]}
print(json.dumps(out, indent=1))
bad = [name for name, r in out.items() if r["failed_requests"] or r["remote_requests"]
       or r["charts_drawn"] != r["charts_in_html"] or 0 in r["shape_stroke_widths"]]
sys.exit(1 if bad else 0)
