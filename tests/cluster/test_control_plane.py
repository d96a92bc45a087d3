"""The control-plane benchmark at a small count: benchmarks/bench_control_plane.py with 4 engines as
2 simulated nodes of 2 (its 64-engine run, 16 nodes of 4, is the lead's, docs/measurement.md). The script runs end
to end; every engine registered, with labkit's registration timeouts on its command line; every
engine answered its control channel; the figure held every record of every rank; the stall watch
read every rank's status file. No timing is asserted."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_control_plane_benchmark_at_4_engines_as_2_nodes():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_control_plane.py"), "--nodes", "2",
                          "--per-node", "2", "--rounds", "3", "--steps", "6", "--interval", "0.2", "--figure-rounds", "1",
                          "--polls", "1.0"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    summary = lines[-1]
    assert summary["what"] == "summary" and summary["engines"] == 4 and summary["nodes"] == 2
    assert summary["registration_timeouts"] == {"engine": 10, "controller": 30}
    assert summary["engine_args_seen"] == [["--IPEngine.timeout=10"]] * 4
    assert {k for k in summary if k.startswith("round_trip_")} == {"round_trip_apply", "round_trip_control",
                                                                    "round_trip_engine_info"}
    rounds = summary["record_to_figure"]  # {poll: [one result per round]}
    assert sorted(rounds) == ["1.0"] and len(rounds["1.0"]) == 1
    assert all(r["records"] == 4 * 6 for v in rounds.values() for r in v)  # every rank's every row reached the view
    assert summary["status_poll"]["ranks_read"] == 4


def test_the_live_rank_view_of_64_ranks_is_readable_in_chromium(tmp_path, say, monkeypatch):
    """The live rank view (``labkit.rankview.RankView``) of 64 ranks on 16 nodes x 100 steps, one
    rank slow on its data, as the notebook gets it (a LivePlot frame: ``labkit.live.live_html``
    drawn with the page's plotly.js) in a 1,280 x 900 Chromium window with JupyterLab's margins:
    it draws every rank in both heatmaps and the per-rank bars, the culprit's line names the slow
    rank, no two tick labels of an axis overlap, and nothing leaves the window's width or its
    output area. The draw's time in Chromium is printed, not asserted."""
    import IPython.display
    import plotly.offline

    from browser import LAYOUT_JS, chromium, need_browser
    from labkit.rankview import RankView
    from timeline_sim import simulate

    need_browser()
    n = 64
    rows = simulate(100, data=[0.002] * 41 + [0.3] + [0.002] * 22, compute=[0.05] * n,
                    hosts=[f"n{r // 4:02d}" for r in range(n)])
    shown = []  # the bundle the notebook's output gets: RankView's first frame
    monkeypatch.setattr(IPython.display, "display", lambda bundle, **kw: shown.append(bundle))
    view = RankView()
    view(rows)
    div = shown[0]["text/html"].replace(f"{view.display_id}-plot", "view")
    page_html = (f"<html><head><script>{plotly.offline.get_plotlyjs()}</script></head><body style='margin:0'>"
                 f"<div style='margin-left:150px;margin-right:40px'>{div}</div></body></html>")
    (tmp_path / "view.html").write_text(page_html)
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto((tmp_path / "view.html").as_uri())
        page.wait_for_selector(".main-svg")
        drawn = page.evaluate("""() => { const gd = document.getElementById('view');
            return {traces: gd.data.map(t => [t.type, (t.y || []).length, (t.z || []).length]),
                    title: gd.layout.title.text, div: gd.getBoundingClientRect().height,
                    svg: gd.querySelector('.main-svg').getBoundingClientRect().height}; }""")
        ms = page.evaluate("""() => { const gd = document.getElementById('view'); const t = performance.now();
            return Plotly.react(gd, gd.data, gd.layout).then(() => performance.now() - t); }""")
        (layout,) = page.evaluate(LAYOUT_JS)
        right = page.evaluate("""() => Math.max(...[...document.querySelectorAll(
            '.main-svg, .legend, g.xtick text, g.ytick text, .gtitle')].map(e => e.getBoundingClientRect().right))""")
    say(f"\n[rank view] 64 ranks x 100 steps redrawn in Chromium in {ms:.0f} ms; figure {drawn['svg']:.0f} px "
        f"tall in a {drawn['div']:.0f} px output")
    heatmaps = [t for t in drawn["traces"] if t[0] == "heatmap"]
    assert len(heatmaps) == 2 and all(t[2] == n for t in heatmaps), drawn["traces"]  # a row per rank
    assert "rank 41" in drawn["title"] and "data" in drawn["title"], drawn["title"]
    assert "ranks 0-40, 42-63 wait" in drawn["title"] and drawn["title"].count("<br>") <= 2, drawn["title"]
    assert right <= 1280 - 40 + 1 and drawn["svg"] <= drawn["div"] + 1, (right, drawn)
    ticks = layout["ticks"]
    overlapping = [(a, b) for i, a in enumerate(ticks) for b in ticks[i + 1:]
                   if a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5]
    assert not overlapping, overlapping[:5]
