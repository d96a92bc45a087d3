"""labkit/study/branching.py and branch_stats.py: the estimates against closed forms, and one real
branching sweep on tiny shards (one process) checked against the base run itself."""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest

from labkit.study.branch_stats import branch_estimates, keep_pace, noise_from_efficiency, overlap


def _losses(b_noise: float, batch: int, factors: list[int], *, n: int = 400, noise: float = 0.0, seed: int = 0):
    """Per-sequence loss sums whose efficiencies follow McCandlish's e(k) = (B_noise + B)/(B_noise + kB)
    exactly (noise 0) or with independent per-sequence noise: start 4.0, the base gains 0.1 nats."""
    rng = np.random.default_rng(seed)
    m = rng.integers(5, 15, n).astype(float)
    l0 = 4.0 * m + rng.normal(0, 1.0, n) * m
    eff = np.array([(b_noise + batch) / (b_noise + k * batch) for k in factors])
    end = l0[None, :] - 0.1 * eff[:, None] * m[None, :] + noise * rng.normal(0, 1, (len(factors), n)) * m
    return l0, end[None], m, eff


def test_estimates_recover_the_noise_scale_and_the_batch_that_keeps_pace():
    factors, batch = [1, 2, 4, 8, 16], 8
    l0, lk, m, eff = _losses(24.0, batch, factors)
    est = branch_estimates(l0, lk, m, factors, batch, tolerance=0.2, n_boot=200)
    assert est["efficiency"] == pytest.approx(eff.tolist(), rel=1e-9)
    assert est["loss_start"] == pytest.approx(l0.sum() / m.sum())
    assert est["b_noise"] == pytest.approx(24.0, rel=0.01) and not est["b_noise_censored"]  # the grid's spacing
    # e(k) = 32/(24 + 8k): 1, 0.8, 0.571, ... keeps pace (>= 0.8) exactly up to k = 2
    assert est["b_keep_pace"] == pytest.approx(16.0) and est["b_keep_pace_low"] == pytest.approx(16.0)
    k, cens = keep_pace(np.array([[1.0, 0.9, 0.7, 0.5]]), np.array([1, 2, 4, 8]), 0.2)
    assert k[0] == pytest.approx(2 ** (1 + 0.5)) and not cens[0]  # 0.9 -> 0.7 crosses 0.8 half-way in log2 k
    k, cens = keep_pace(np.array([[1.0, 0.95, 0.9, 0.85]]), np.array([1, 2, 4, 8]), 0.2)
    assert k[0] == 8 and cens[0]  # every factor keeps pace: at least the largest
    x, cens = noise_from_efficiency(np.array([[1.0, 1.0, 1.0]]), np.array([1, 2, 4]))
    assert cens[0]  # no loss per example at any factor: B_noise beyond the grid
    noisy = branch_estimates(*_losses(24.0, batch, factors, noise=2.0)[:3], factors, batch, tolerance=0.2, n_boot=400)
    assert noisy["b_noise_low"] < 24.0 < noisy["b_noise_high"]  # the held-out sampling noise, covered
    assert overlap((1.0, 0.5, 2.0), (3.0, 1.9, 4.0)) and not overlap((1.0, 0.5, 2.0), (3.0, None, None))
    assert overlap((1.0, None, None), (None, None, None)) is None
    with pytest.raises(ValueError, match="ascending factors from 1"):
        branch_estimates(l0, lk, m, [2, 4, 8, 16, 32], batch, tolerance=0.2)


def test_sweep_branch_on_tiny_shards_continues_the_base_run(tmp_path, capsys):
    """A base run at global batch 4 (micro-batch 2 x 2 accumulated, one process, constant lr) is
    checkpointed at steps 3 and 6; branches at 1, 2 and 4 x the batch start from each checkpoint
    (checkpoint.init_from). The factor-1 branch at step 3 is the base run itself, step for step, and
    the factor-2 branch's first step takes the base's next two steps' examples (the sampler continues
    the global order); per-sequence held-out losses sum to the runs' own eval_loss."""
    from labkit.config import TrainConfig
    from labkit.study.branching import sweep_branch
    from tiny_shards import write_tiny_shards

    shards = write_tiny_shards(tmp_path / "shards", n_sequences=96, heldout_sequences=16)
    cfg = TrainConfig(data_dir=str(shards), run_dir=str(tmp_path / "unused"), model="tiny", max_steps=8,
                      num_threads=1, device="cpu", batch={"micro_batch_size": 2, "grad_accum_steps": 2},
                      optim={"lr": 3e-3}, schedule={"warmup_steps": 0, "min_lr_ratio": 1.0},
                      eval={"every": 0, "sequences": 16, "batch_size": 8}, measure={"trackers": ()})
    points, runs = sweep_branch(cfg, tmp_path, at=[3, 6], factors=[2, 4], window=16, n_boot=100, progress=True)
    err = capsys.readouterr().err  # a bar over each run's steps: the base's segments, then each branch's
    assert "sweep branch: base run: 100%" in err and "3/3" in err and "6/6" in err, err[-2000:]
    assert "sweep branch: 3 x2: 100%" in err and "7/7" in err and "sweep branch: 6 x4: 100%" in err, err[-2000:]
    assert points["step"].to_list() == [3, 6] and points["batch"].to_list() == [4, 4]
    assert runs.select("factor", "steps").rows() == [(1, 4), (2, 2), (4, 1)] * 2
    assert runs["lr"].to_list() == pytest.approx([3e-3 * math.sqrt(k) for k in (1, 2, 4)] * 2)  # batch.lr_rule sqrt

    def records(path):
        return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]

    base = records(tmp_path / "sweeps" / "branch" / "base")
    one = records(tmp_path / "sweeps" / "branch" / "step-3" / "r0-x1")
    two = records(tmp_path / "sweeps" / "branch" / "step-3" / "r0-x2")
    assert [r["step"] for r in one] == [4, 5, 6, 7] and [r["loss"] for r in one[:3]] == [r["loss"] for r in base[3:6]]
    assert two[0]["n_masked"] == base[3]["n_masked"] + base[4]["n_masked"] and two[0]["global_batch_size"] == 8
    evals = {r["step"]: r["eval_loss"] for r in base if r.get("eval_loss") is not None}
    assert points["loss_start"].to_list() == pytest.approx([evals[3], evals[6]], rel=1e-6)
    assert (runs["loss_end"] - runs["eval_loss"]).abs().max() < 1e-5  # the run's own evaluation, per sequence
    for step in (3, 6):
        part = runs.filter(pl.col("step") == step)
        gain = part["loss_start"] - part["loss_end"]
        assert part["efficiency"].to_list() == pytest.approx((gain / gain[0]).to_list(), rel=1e-9)
    assert points["b_simple"].to_list() == [base[2]["b_simple"], base[5]["b_simple"]]
    assert all(a.startswith(f"step {s}: ") for s, a in zip((3, 6), points["agreement"]))
    assert points["b_crit_sweep_agrees"].null_count() == 2  # no batch sweep in this work directory
    assert points["b_simple_agrees"].to_list() == [overlap((r["b_noise"], r["b_noise_low"], r["b_noise_high"]),
                                                           (r["b_simple"], r["b_simple_low"], r["b_simple_high"]))
                                                   for r in points.iter_rows(named=True)]
    assert points["b_simple_low"].to_list() == [base[2]["b_simple_low"], base[5]["b_simple_low"]]  # its interval
    saved = pl.read_parquet(tmp_path / "sweeps" / "branch.parquet")
    assert saved.drop("agreement").equals(points.drop("agreement"))
    made = (tmp_path / "sweeps" / "branch" / "step-6" / "r0-x4" / "result.json").stat().st_mtime_ns
    again, _ = sweep_branch(cfg, tmp_path, at=[3, 6], factors=[2, 4], window=16, n_boot=100)  # read back, not trained
    assert (tmp_path / "sweeps" / "branch" / "step-6" / "r0-x4" / "result.json").stat().st_mtime_ns == made
    assert again.drop("agreement").equals(points.drop("agreement"))

    def batch_sweep_done():  # labkit demo's batch sweep, finishing beside the branches: read after wait()
        assert (tmp_path / "sweeps" / "branch.parquet").stat().st_mtime_ns == saved_ns  # the runs are done, no table yet
        pl.DataFrame({"b_crit": [5.0], "b_crit_low": [3.0], "b_crit_high": [9.0], "target_eval_loss": [6.5]}).write_parquet(
            tmp_path / "sweeps" / "critical_batch.parquet")

    saved_ns = (tmp_path / "sweeps" / "branch.parquet").stat().st_mtime_ns
    later, _ = sweep_branch(cfg, tmp_path, at=[3, 6], factors=[2, 4], window=16, n_boot=100, wait=batch_sweep_done)
    assert later["b_crit_sweep"].to_list() == [5.0, 5.0] and later["b_crit_sweep_high"].to_list() == [9.0, 9.0]
    assert later["b_crit_sweep_agrees"].to_list() == [overlap((r["b_noise"], r["b_noise_low"], r["b_noise_high"]),
                                                              (5.0, 3.0, 9.0)) for r in later.iter_rows(named=True)]
    with pytest.raises(ValueError, match="--window: 12 examples is not a multiple"):
        sweep_branch(cfg, tmp_path, at=[3], factors=[2], window=12)
    with pytest.raises(ValueError, match=r"--at: branch points \[9\] outside 1..train.max_steps 8"):
        sweep_branch(cfg, tmp_path, at=[9], factors=[2], window=16)
