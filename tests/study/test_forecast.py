"""labkit/study/forecast.py: steps to the target from the critical batch (closed forms), the knee
and its reason, and ``labkit forecast`` on the study's configuration."""

from __future__ import annotations

import json

import pytest

from labkit.study.forecast import forecast_table, knee, steps_to_target

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
    from labkit.cli import main

    assert main(["forecast", "configs/study.toml", "--gpus", ",".join(map(str, GPUS)), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["n_gpus"]: r for r in out["table"]}
    assert rows[256]["global_batch"] == 256 * 184 and rows[256]["gpu_hours"] > rows[128]["gpu_hours"]
    assert out["knee"]["184"]["n_gpus"] in GPUS and any("assumption" in a for a in out["assumptions"])
    assert main(["forecast", "configs/study.toml"]) == 0
    assert "stop paying" in capsys.readouterr().out


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
