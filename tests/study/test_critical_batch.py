"""labkit/study/critical_batch.py: the steps-examples hyperbola fit against closed forms, the
held-out crossing, the LR rules, and a short real sweep (tiny model, tiny shards)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from labkit.study.critical_batch import fit_critical_batch, hyperbola, lr_for_batch, steps_to_target


def test_fit_recovers_the_hyperbola_exactly_and_with_noise():
    b = np.array([4, 8, 16, 32, 64, 128], dtype=float)
    s = 100.0 * (1 + 24.0 / b)  # S_min 100, B_crit 24
    fit = fit_critical_batch(b, s, n_boot=200)
    assert fit["b_crit"] == pytest.approx(24.0, rel=1e-6) and fit["s_min"] == pytest.approx(100.0, rel=1e-6)
    assert fit["e_min"] == pytest.approx(2400.0, rel=1e-6)
    e = b * s  # the relation itself holds at every point
    assert np.allclose((s / fit["s_min"] - 1) * (e / fit["e_min"] - 1), 1.0)
    noisy = s * np.exp(np.random.default_rng(0).normal(0, 0.05, b.size))
    fit = fit_critical_batch(b, noisy, n_boot=300)
    assert fit["b_crit_low"] <= fit["b_crit"] <= fit["b_crit_high"]
    assert fit["b_crit_low"] < 24.0 < fit["b_crit_high"] and fit["b_crit"] == pytest.approx(24, rel=0.3)
    hs, he = hyperbola(100.0, 2400.0)
    assert np.allclose((hs / 100 - 1) * (he / 2400 - 1), 1.0)


def test_fit_refuses_too_few_points():
    with pytest.raises(ValueError, match=">= 3 distinct batch sizes"):
        fit_critical_batch([4, 8], [10, 6])


def test_steps_to_target_interpolates_between_evaluations():
    recs = [{"step": 1, "eval_loss": None}, {"step": 2, "eval_loss": 5.0}, {"step": 4, "eval_loss": 3.0},
            {"step": 6, "eval_loss": 2.0}]
    assert steps_to_target(recs, 4.0) == pytest.approx(3.0)
    assert steps_to_target(recs, 6.0) == 2.0 and steps_to_target(recs, 1.0) is None


def test_lr_rules():
    assert lr_for_batch(1e-3, 16, 64, "sqrt") == pytest.approx(2e-3)
    assert lr_for_batch(1e-3, 16, 64, "linear") == pytest.approx(4e-3)
    assert lr_for_batch(1e-3, 16, 64, "constant") == 1e-3
    with pytest.raises(ValueError, match="lr rule"):
        lr_for_batch(1e-3, 16, 64, "cubic")
    assert math.isclose(lr_for_batch(1e-3, 16, 16), 1e-3)


def test_sweep_batch_on_tiny_shards_writes_tidy_parquet(tmp_path, capsys):
    """A real sweep: one process per batch size, held-out crossings, the fit and its range, and
    the in-run B_simple of each run at the target (accumulation >= 2 everywhere); with
    ``progress`` a bar over each run's steps, fed by its metrics sink."""
    import polars as pl

    from labkit.config import TrainConfig
    from labkit.study.critical_batch import sweep_batch
    from tiny_shards import write_tiny_shards  # tests/ is on sys.path

    shards = write_tiny_shards(tmp_path / "shards", n_sequences=96, heldout_sequences=16)
    base = TrainConfig(data_dir=str(shards), run_dir=str(tmp_path / "runs" / "base"), model="tiny", num_threads=1,
                       device="cpu", batch={"micro_batch_size": 4}, optim={"lr": 3e-3},
                       schedule={"warmup_steps": 1, "min_lr_ratio": 1.0}, checkpoint={"enabled": False},
                       eval={"sequences": 16, "batch_size": 8}, measure={"trackers": ()})
    df, fit = sweep_batch(base, tmp_path, batch_sizes=[4, 8, 16], max_examples=192, progress=True)
    err = capsys.readouterr().err
    assert all(f"sweep batch: {b}: 100%" in err and f"{192 // b}/{192 // b}" in err for b in (4, 8, 16)), err[-2000:]
    assert df["batch"].to_list() == [4, 8, 16] and df["reached"].all()
    assert (df["examples"] == df["steps"] * df["batch"]).all()
    assert df["b_simple"].drop_nulls().len() >= 1 and (df["lr"].to_list()[2] / df["lr"].to_list()[0]) == pytest.approx(2.0)
    if "b_crit" in fit:  # three noisy points may not give a positive B_crit; the table says why not
        assert fit["b_crit"] > 0 and fit["n_points"] == 3
    saved = pl.read_parquet(tmp_path / "sweeps" / "critical_batch.parquet")
    assert saved.columns[:4] == ["batch", "lr", "lr_rule", "target_eval_loss"]
    curves = pl.read_parquet(tmp_path / "sweeps" / "critical_batch_curves.parquet")
    assert set(curves["batch"].unique().to_list()) == {4, 8, 16} and curves["eval_loss"].drop_nulls().len() >= 3
    import json

    result = json.loads((tmp_path / "sweeps" / "critical_batch" / "batch-16" / "result.json").read_text())
    assert result["b_simple"] is not None and result["b_simple_tokens"] > result["b_simple"]  # result.json has both
    # each run's rates from its records equal the loop's own result.json; goodput = samples/s x E(B)
    # with B_noise the sweep's B_crit and B0 the smallest batch (4)
    assert df.filter(pl.col("batch") == 16)["tokens_per_s"].item() == pytest.approx(result["tokens_per_s"])
    assert df.filter(pl.col("batch") == 16)["samples_per_s"].item() == pytest.approx(result["samples_per_s"])
    if "b_crit" in fit:
        eff = [(fit["b_crit"] + 4) / (fit["b_crit"] + b) for b in (4, 8, 16)]
        assert df["statistical_efficiency"].to_list() == pytest.approx(eff)
        assert df["goodput_samples_per_s"].to_list() == pytest.approx([s * e for s, e in zip(df["samples_per_s"], eff)])
    else:
        assert df["goodput_samples_per_s"].null_count() == 3


def test_sweep_batch_reuses_a_point_only_with_its_settings_and_data_and_force_trains_every_point(tmp_path, capfd):
    """Each batch size is a sweep point: the same call again reads every curve back (nothing
    trained, one line saying when and at what load they were measured), ``force`` trains every
    point again, and on rebuilt shards (a second ``make demo`` that rebuilt the data) no point is
    reused."""
    from labkit.config import TrainConfig
    from labkit.study.critical_batch import sweep_batch
    from tiny_shards import write_tiny_shards

    shards = write_tiny_shards(tmp_path / "shards", n_sequences=64, heldout_sequences=16)
    base = TrainConfig(data_dir=str(shards), run_dir=str(tmp_path / "runs" / "base"), model="tiny", num_threads=1,
                       device="cpu", batch={"micro_batch_size": 4}, optim={"lr": 3e-3},
                       schedule={"warmup_steps": 1, "min_lr_ratio": 1.0}, checkpoint={"enabled": False},
                       eval={"sequences": 16, "batch_size": 8}, measure={"trackers": ()})
    kw = {"batch_sizes": [4, 8, 16], "max_examples": 64}
    runs = {b: tmp_path / "sweeps" / "critical_batch" / f"batch-{b}" / "metrics.jsonl" for b in kw["batch_sizes"]}

    def mtimes() -> dict:
        return {b: p.stat().st_mtime_ns for b, p in runs.items()}

    first, fit = sweep_batch(base, tmp_path, **kw)
    assert not first["reused"].any() and first["measured_at"].null_count() == 0
    trained = mtimes()
    capfd.readouterr()
    again, fit_again = sweep_batch(base, tmp_path, **kw)
    err = capfd.readouterr().err
    assert again["reused"].all() and mtimes() == trained  # read back: no run trained
    assert again["steps"].to_list() == first["steps"].to_list() and fit_again["target_eval_loss"] == fit["target_eval_loss"]
    assert "sweep batch: 3 of 3 points reused from earlier runs (measured 20" in err and " CPUs" in err, err
    forced, _ = sweep_batch(base, tmp_path, force=True, **kw)
    assert not forced["reused"].any() and all(mtimes()[b] > trained[b] for b in runs)
    trained = mtimes()
    write_tiny_shards(shards, n_sequences=64, heldout_sequences=16, seed=1)  # the data rebuilt
    capfd.readouterr()
    rebuilt, _ = sweep_batch(base, tmp_path, **kw)
    err = capfd.readouterr().err
    assert not rebuilt["reused"].any() and all(mtimes()[b] > trained[b] for b in runs)
    assert err.count("measuring again") == 3 and "sweep batch batch 4: data " in err, err


def test_the_batch_sweep_runs_write_no_tracker_and_keep_their_record(tmp_path):
    """Notebook 07's runs are read from metrics.jsonl: no TensorBoard writer (a tenth of a tiny
    step); a point made with one, before, has the same record and is read back."""
    from labkit.study.critical_batch import batch_base, batch_config
    from labkit.study.points import loss_settings

    cfg = batch_config(batch_base(tmp_path, model="tiny", micro_batch=8, lr=2e-3), tmp_path, 16, max_examples=64)
    assert cfg.measure.trackers == () and cfg.measure.log_every == 1
    assert loss_settings(cfg) == loss_settings(cfg.replace(measure={"trackers": ("tensorboard",)}))
