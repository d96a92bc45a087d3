"""Open every report of a work directory in Debian's Chromium with the network cut, and print per
report: failed and remote requests, charts in the HTML and charts drawn, reference-line shapes
and their stroke widths, axes with repeated tick labels, and axes whose data lies outside their
range or fills less than a fifth of it (the checks tests/test_notebooks.py makes on the test
corpus's reports, through the same ``browser.inspect_report`` and ``browser.axis_problems``).
Usage, from the repository root inside .venv:

    python tests/check_reports_offline.py work/demo/reports

Exits 1 when a report made a request, left a chart undrawn, drew a line of width 0 or has an
axis problem, or when report 07's (07_critical_batch.html) figures have no numeric axis checked.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser import axis_problems, chromium, inspect_report  # noqa: E402

out = {}
with chromium() as browser:
    context = browser.new_context()
    context.set_offline(True)
    for html in sorted(Path(sys.argv[1]).glob("*.html")):
        r = inspect_report(context, html)
        figs, axes = r.pop("figures"), r.pop("axes")
        out[html.name] = {**{k: len(v) if isinstance(v, list) else v for k, v in r.items()},
                          "shapes": sum(f["shapes"] for f in figs),
                          "shape_stroke_widths": [w for f in figs for w in f["shape_widths"]],
                          "axes_with_repeated_tick_labels": [(a, labels) for f in figs for a, labels in f["ticks"].items()
                                                             if len(labels) != len(set(labels))],
                          "axes_checked": sum(len(f["axes"]) for f in axes),
                          "axis_problems": [p for f in axes for p in axis_problems(f)]}
print(json.dumps(out, indent=1))
bad = [name for name, r in out.items() if r["failed_requests"] or r["remote_requests"]
       or r["charts_drawn"] != r["charts_in_html"] or 0 in r["shape_stroke_widths"] or r["axis_problems"]]
if "07_critical_batch.html" in out and out["07_critical_batch.html"]["axes_checked"] < 4:  # 2 figures, x and y
    bad.append("07_critical_batch.html (its axes were not checked)")
if bad:
    print("failed:", ", ".join(bad), file=sys.stderr)
sys.exit(1 if bad else 0)
