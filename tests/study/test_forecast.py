"""labkit/study/forecast.py: steps to the target from the critical batch (closed forms), the knee
and its reason, and ``labkit forecast`` on the study's configuration."""

from __future__ import annotations

import json

import pytest

from labkit.study.forecast import forecast_table, knee, knee_sentence, steps_to_target

GPUS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_constant_critical_batch_is_mccandlish_hyperbola():
    e_min, b_crit = 1e6, 500.0
    for b in (10, 500, 5000):
        s = steps_to_target(b, e_min=e_min, b_crit=b_crit)
        assert s == pytest.approx(e_min / b_crit * (1 + b_crit / b))  # S_min (1 + B_crit / B)
        e = s * b
        assert (s / (e_min / b_crit) - 1) * (e / e_min - 1) == pytest.approx(1.0)


def test_growing_critical_batch_costs_more_steps_at_large_batch():
    # B_crit(f) = B f^g: the floor Σ ΔE / B_crit(f_i) -> E/B ∫ f^-g df = E / (B (1 - g)) for g < 1
    s = steps_to_target(1e9, e_min=1e6, b_crit=500.0, growth=0.5, segments=4096)
    assert s == pytest.approx(1e6 / 500 / 0.5, rel=0.02)
    with pytest.raises(ValueError, match="growth"):
        steps_to_target(10, e_min=1e6, b_crit=500.0, growth=-1)


def test_knee_and_its_reason():
    crit = forecast_table(GPUS, [16], lambda n, b: 1.0, e_min=1e6, b_crit=256.0)
    k = knee(crit, 16)
    assert k["reason"] == "critical batch" and k["n_gpus"] == 16  # 16 x 16 = B_crit: from there < 1.5x
    net = forecast_table(GPUS, [16], lambda n, b: 1.0 + 0.02 * n, e_min=1e6, b_crit=1e9)
    k = knee(net, 16)
    assert k["reason"] == "network" and k["n_gpus"] == 32
    assert knee(forecast_table([1, 2, 4], [16], lambda n, b: 1.0, e_min=1e6, b_crit=1e9), 16)["n_gpus"] is None


def test_labkit_forecast_on_the_study_config(capsys):
    """The study's own micro-batch, 184, is over the planner's largest on its GPU (180): marked in the
    table, the JSON and the knee's sentence, and so is 400; the knee's rule is printed; lines by
    default, with units (no six-decimal steps)."""
    from labkit.cli import main

    assert main(["forecast", "configs/study.toml", "--gpus", ",".join(map(str, GPUS)), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["n_gpus"]: r for r in out["table"]}
    assert rows[256]["global_batch"] == 256 * 184 and rows[256]["gpu_hours"] > rows[128]["gpu_hours"]
    assert out["knee"]["184"]["n_gpus"] in GPUS and any("assumption" in a for a in out["assumptions"])
    assert out["max_micro_batch"] == 180 and not any(r["fits"] for r in out["table"])
    assert out["vocab_size"] == 5000 and out["params"] == 94_119_560  # the [plan] vocabulary, not the study's 45,000
    assert main(["forecast", "configs/study.toml", "--micro-batches", "120,184,400"]) == 0
    text = capsys.readouterr().out
    for b in (184, 400):
        assert f"micro-batch {b} does NOT fit the H100 NVL: the planner's largest at seq 512, fp32 is 180" in text
    assert "micro-batch 120 does NOT" not in text and "every further doubling of the GPUs buys less than 1.5x" in text
    assert "stop paying from none" not in text and "none within" not in text
    decimals = [w for line in text.splitlines() for w in line.split() if "." in w and w.replace(".", "").isdigit()]
    assert decimals and all(len(w.replace(".", "").lstrip("0")) <= 4 for w in decimals), decimals  # rounded


def test_knee_sentence_is_true_for_counts_that_do_not_double_and_for_a_slower_step():
    """Counts that do not double are judged per doubling (the old knee found no pair and said
    "stop paying from none"); a step that makes the run slower is named with how much slower,
    also when a later doubling pays again (the old sentence said "none" when 4 GPUs were 26x
    slower than 2)."""
    odd = forecast_table([1, 3, 10], [16], lambda n, b: 1.0, e_min=1e6, b_crit=1e9)
    k = knee(odd, 16)
    assert k["n_gpus"] is None and k["steps"][0]["gain_per_doubling"] == pytest.approx(2.0, rel=1e-6)
    assert knee_sentence(k, 16) == ("micro-batch 16: more GPUs still pay at the largest step (3 -> 10 GPUs: "
                                    "2.00x goodput per doubling)")
    steps = {1: 1.0, 2: 1.0, 4: 26 * 2.0, 8: 26 * 2.0, 16: 26 * 2.0}  # 4 GPUs take 26x as long as 2
    jump = forecast_table(list(steps), [16], lambda n, b: steps[n], e_min=1e6, b_crit=1e9)
    k = knee(jump, 16)
    text = knee_sentence(k, 16)
    assert k["n_gpus"] is None and "2 -> 4 (0.04x)" in text and "4 GPUs take 26x as long as 2" in text, text
    flat = forecast_table([4, 8, 16], [16], lambda n, b: 1.0 + n, e_min=1e6, b_crit=1e9)  # no step pays
    assert knee_sentence(knee(flat, 16), 16).startswith("micro-batch 16: more GPUs stop paying at every count here")
    assert knee_sentence(knee(forecast_table([8], [16], lambda n, b: 1.0, e_min=1e6, b_crit=1e9), 16), 16) == \
        "micro-batch 16: one count of GPUs (8): no step to judge"


def test_the_knee_is_read_from_statistical_goodput():
    """Goodput = throughput x E(B) with E(B) = (B_crit + B0)/(B_crit + B) (labkit.measure), B0 the
    smallest global batch; hours x goodput is the same at every count (time goes as 1/goodput)."""
    from labkit.measure import statistical_goodput

    t = forecast_table(GPUS, [16], lambda n, b: 1.0 + 0.01 * n, e_min=1e6, b_crit=300.0)
    for r in t.iter_rows(named=True):
        assert r["goodput"] == pytest.approx(statistical_goodput(r["global_batch"] / r["step_s"], r["global_batch"],
                                                                 300.0, 16))
        assert r["hours"] * r["goodput"] == pytest.approx(t["hours"][0] * t["goodput"][0])


def test_forecast_on_a_cpu_plans_the_configs_own_model_with_a_measured_step_and_an_interval(tmp_path, capsys):
    """`labkit forecast configs/walkthrough.toml --device cpu`: the model at the shards' vocabulary
    (it was planned at the study's 45,000: 3.06 M parameters for 0.20 M), its parameters those of
    the BertMLM the config trains; the step time measured in this process, with the load it ran
    at; and with a `labkit sweep batch` table the time to the target comes with the range of the
    critical batch's bootstrap."""
    import sys

    import polars as pl

    from labkit.cli import main
    from labkit.config.tomlfile import load
    from labkit.model import BertMLM
    from labkit.train.run_config import model_config_of

    sys.path.insert(0, "tests")
    from tiny_shards import write_tiny_shards

    write_tiny_shards(tmp_path / "shards", n_sequences=16, seq_len=64, vocab_size=700)
    crit = tmp_path / "critical_batch.parquet"
    pl.DataFrame({"batch": [4, 8, 16], "b_crit": [40.0] * 3, "b_crit_low": [25.0] * 3, "b_crit_high": [70.0] * 3,
                  "s_min": [50.0] * 3, "e_min": [2000.0] * 3, "target_eval_loss": [4.4] * 3}).write_parquet(crit)
    args = ["forecast", "configs/walkthrough.toml", "--device", "cpu", "--set", f'workdir="{tmp_path}"',
            "--gpus", "1,2,4", "--critical-batch", str(crit)]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    lab = load("configs/walkthrough.toml", [f'workdir="{tmp_path}"'])
    model = BertMLM(model_config_of(lab.train, 700))
    assert out["vocab_size"] == 700 and out["params"] == sum(p.numel() for p in model.parameters()) < 300_000
    measured = out["step_time"]["8"]
    assert measured["step_s"] > 0 and len(measured["load_avg_1m"]) == 2 and measured["threads"] == 1
    one = next(r for r in out["table"] if r["n_gpus"] == 1)
    assert one["step_s"] == measured["step_s"] and out["max_micro_batch"] is None
    for r in out["table"]:
        for key, b_crit in (("hours_low", 70.0), ("hours", 40.0), ("hours_high", 25.0)):
            steps = steps_to_target(r["global_batch"], e_min=2000.0, b_crit=b_crit)
            assert r[key] == pytest.approx(steps * r["step_s"] / 3600, rel=1e-9)
        assert r["hours_low"] < r["hours"] < r["hours_high"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "measured here, in this process" in text and "load average" in text and "time range" in text
    assert "B_crit 2,560 tokens (90% bootstrap range 1,600-4,480)" in text


def test_labkit_forecast_refuses_bad_input_in_one_line(capsys):
    """An unknown network is refused naming the known ones (it was a KeyError traceback), and a
    malformed --gpus names that flag alone."""
    from labkit.cli import main

    assert main(["forecast", "configs/study.toml", "--network", "25gbe"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "network: unknown '25gbe'" in err and "25GbE" in err, err
    assert main(["forecast", "configs/study.toml", "--gpus", "1,two"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--gpus: comma-separated integers, got '1,two'" in err and "None" not in err, err
