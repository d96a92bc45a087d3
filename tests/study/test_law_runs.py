"""labkit/study/law_runs.py: notebook 05's runs as sweep points, read back only when their
settings and their shards are the ones they were trained with (a second ``make demo`` that
rebuilt the data fits the law on runs of the new data)."""

from __future__ import annotations

import json

import polars as pl
import pytest

from labkit.model import count_parameters, model_config
from labkit.study.law_runs import law_config, sweep_law_runs
from labkit.study.points import loss_settings
from tiny_shards import write_tiny_shards  # tests/ is on sys.path


def test_law_runs_are_read_back_only_with_their_settings_and_shards(tmp_path, capfd):
    work = tmp_path / "work"
    write_tiny_shards(work / "shards", n_sequences=48, heldout_sequences=16)
    kw = {"widths": [8, 16], "steps": 6, "micro_batch": 4, "points": 2}
    first = sweep_law_runs(str(work), **kw)
    metrics = {w: work / "runs" / f"law-{w}" / "metrics.jsonl" for w in kw["widths"]}
    evals = [r for r in map(json.loads, metrics[8].read_text().splitlines()) if "eval_loss" in r]
    assert first.filter(pl.col("width") == 8).select("n_tokens", "loss").rows() == \
        [(r["tokens"], r["eval_loss"]) for r in evals] and len(evals) == 2  # steps 3 and 6
    cfg = law_config(str(work), 16, **{k: kw[k] for k in ("steps", "micro_batch", "points")})
    assert first.filter(pl.col("width") == 16)["n_params"].unique().to_list() == [
        count_parameters(model_config("tiny", 96, **cfg.model_overrides))["non_embedding"]]
    assert not first["reused"].any()
    # no tracker in these loss-only runs (the curve is metrics.jsonl's), and a point made with the
    # TensorBoard one (before they went without) has the same record: it is read back, not retrained
    assert cfg.measure.trackers == () and not (work / "runs" / "law-8" / "tensorboard").exists()
    assert loss_settings(cfg) == loss_settings(cfg.replace(measure={"trackers": ("tensorboard",)}))
    trained = {w: p.stat().st_mtime_ns for w, p in metrics.items()}
    capfd.readouterr()
    again = sweep_law_runs(str(work), **kw)
    assert again["reused"].all() and {w: p.stat().st_mtime_ns for w, p in metrics.items()} == trained
    assert again.drop("reused").equals(first.drop("reused"))
    assert "sweep law: 2 of 2 widths reused from earlier runs (measured 20" in capfd.readouterr().err
    # notebook 05 with other steps (law_steps=30 was ignored when runs existed): trained again
    longer = sweep_law_runs(str(work), **(kw | {"steps": 8}))
    assert not longer["reused"].any() and longer["step"].max() == 8
    assert "sweep law width 8: eval.every 3 -> 4; max_steps 6 -> 8, measuring again" in capfd.readouterr().err
    # the data rebuilt (a second make demo on another corpus): no width is read back
    write_tiny_shards(work / "shards", n_sequences=48, heldout_sequences=16, seed=1)
    rebuilt = sweep_law_runs(str(work), **(kw | {"steps": 8}))
    assert not rebuilt["reused"].any() and not rebuilt["loss"].equals(longer["loss"])
    err = capfd.readouterr().err
    assert err.count("measuring again") == 2 and "sweep law width 16: data " in err, err
    with pytest.raises(ValueError, match="widths"):
        sweep_law_runs(str(work), **(kw | {"widths": []}))
