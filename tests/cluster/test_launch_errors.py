"""labkit.cluster.launch: an engine's failure as one readable line (rank, node, exception, labkit frame),
the full traceback kept on the error; checked on a real remote traceback's text."""

from __future__ import annotations

from ipyparallel import error as ipp_error

from labkit.cluster import launch

# the shape of IPython's coloured traceback an engine sends (taken from a misspelt model name)
REMOTE_TB = (
    "\x1b[31mValueError\x1b[39m                                Traceback (most recent call last)\n"
    "\x1b[36mFile \x1b[39m\x1b[32m/venv/site-packages/ipyparallel/engine/kernel.py:157\x1b[39m, in \x1b[36mdo_apply\x1b[39m\n"
    "\x1b[36mFile \x1b[39m\x1b[32m/work/labkit/lab.py:417\x1b[39m, in \x1b[36m_train_entry\x1b[39m\x1b[34m(cfg)\x1b[39m\n"
    "\x1b[36mFile \x1b[39m\x1b[32m/work/labkit/model.py:78\x1b[39m, in \x1b[36mmodel_config\x1b[39m\x1b[34m(name)\x1b[39m\n"
    "\x1b[31mValueError\x1b[39m: model: unknown size 'minni'; known sizes are ['mini', 'tiny']\n")


def test_failure_line_names_rank_node_exception_and_labkit_frame():
    err = ipp_error.RemoteError("ValueError", "model: unknown size 'minni'; known sizes are ['mini', 'tiny']", REMOTE_TB)
    line = launch.failure_line(1, "node-a", 3, err, "_train_entry")
    assert line == ("rank 1 (node node-a, engine 3) failed while running _train_entry: ValueError: model: unknown "
                    "size 'minni'; known sizes are ['mini', 'tiny'] [labkit/model.py:78 in model_config]")
    assert launch.labkit_frame('  File "/x/labkit/data/shards.py", line 12, in read_index\n') == \
        "labkit/data/shards.py:12 in read_index"
    assert launch.labkit_frame("File /usr/lib/python3/foo.py:3, in bar") is None


def test_failure_error_one_line_per_rank_and_traceback_on_demand():
    errs = {r: ipp_error.RemoteError("ValueError", "bad\nsecond line", REMOTE_TB) for r in (0, 1)}
    infos = {r: {"node": "n0", "engine_id": 10 + r} for r in (0, 1)}
    e = launch._failure_error(errs, "_train_entry", infos)
    lines = str(e).splitlines()
    assert len(lines) == 3 and lines[0].startswith("rank 0 (node n0, engine 10) failed") and "second" not in str(e)
    assert lines[1].startswith("rank 1 (node n0, engine 11) failed") and ".remote_traceback" in lines[2]
    assert (e.rank, e.engine_id, e.died) == (0, 10, False) and set(e.failures) == {0, 1}
    assert "\x1b[" not in e.remote_traceback and e.remote_traceback.count("labkit/model.py:78") == 2
