"""The study's configuration in the planner: saved-activation bytes of its model options against
autograd's own count (saved-tensor hooks), the precision experiment against its closed form, and
``labkit plan configs/study.toml`` end to end."""

from __future__ import annotations

import json

import polars as pl
import pytest

from labkit.config.tomlfile import load
from labkit.measure import PEAK_FLOPS
from labkit.model import flops_per_token, model_config
from labkit.study import memory, plan, scaling


def _study(vocab_size: int, name: str = "tiny", **extra):
    lab = load("configs/study.toml")
    return model_config(name, vocab_size, **{**lab.train.model_overrides, "max_position_embeddings": 64, **extra})


@pytest.mark.parametrize("extra", [{}, {"hidden_dropout": 0.0}])
def test_planned_bytes_equal_the_saved_tensor_count(extra):
    """CPU, fp32: instruction positions (3 id tensors), no attention-output dropout mask, no final
    norm, eager attention keeping its probabilities, the dense untied head: exact."""
    cfg = _study(97, **extra)
    for seq, b in ((32, 1), (32, 2), (64, 3)):
        planned = plan.saved_activation_bytes(cfg, seq, b, precision="fp32", attention="eager", device="cpu")
        assert planned == memory.activation_bytes(cfg, seq, b), (seq, b)


def test_precision_experiment_closed_form():
    cfg = _study(5000, "bert-120m", max_position_embeddings=512)
    table = scaling.precision_experiment(cfg, micro_batch=184, seq_len=512, mfu=0.4)
    fpt = flops_per_token(cfg, 512)
    for precision in ("fp32", "tf32", "bf16"):
        t = table.filter(pl.col("precision") == precision)
        peak = PEAK_FLOPS[("H100 NVL", precision)]
        assert t["compute_s"][0] == pytest.approx(184 * 512 * fpt / (0.4 * peak))
        assert t["efficiency"][0] == 1.0 and t["n_gpus"].to_list() == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    at256 = table.filter(pl.col("n_gpus") == 256)
    assert at256["comm_s"].n_unique() == 1  # fp32 gradients in every precision
    fp32, tf32, bf16 = at256.sort("peak_flops")["efficiency"].to_list()
    assert fp32 > 0.98 > 0.9 > tf32 > bf16  # fp32: 0.989 (the embedding's bucket exposed), tf32 0.66, bf16 0.37
    # the same setting in the planner's compression table (no compression) gives the same efficiencies
    comp = scaling.compression_table(cfg, micro_batch=184, seq_len=512, mfu=0.4).filter(pl.col("grad_compression")
                                                                                        == "none")
    for precision in ("fp32", "tf32", "bf16"):
        e = comp.filter(pl.col("precision") == precision)["efficiency"].item()
        assert e == pytest.approx(at256.filter(pl.col("precision") == precision)["efficiency"].item(), rel=1e-12)
    summary = scaling.precision_summary(table).sort("peak_flops")
    assert summary["first_exposed_n"].to_list()[0] is None  # fp32: the network is never the limit
    for row in summary.iter_rows(named=True):  # just below / above the break-even MFU the all-reduce hides / shows
        if row["break_even_mfu"] < 1:
            for mfu, hidden in ((0.98 * row["break_even_mfu"], True), (1.02 * row["break_even_mfu"], False)):
                t = scaling.precision_experiment(cfg, micro_batch=184, seq_len=512, mfu=mfu,
                                                 precisions=(row["precision"],), gpus=(1, 256))
                assert t["comm_hidden"][1] is hidden
    with pytest.raises(ValueError, match="no 'fp32' peak for A100 80GB"):
        scaling.precision_experiment(cfg, micro_batch=8, seq_len=512, precisions=("fp32",), device="A100 80GB")


def test_labkit_plan_of_the_study_config(capsys):
    from labkit.cli import main

    assert main(["plan", "configs/study.toml", "--device", "H100 NVL"]) == 0
    out = capsys.readouterr().out
    assert "{" not in out and "hidden to MFU" in out  # lines for a reader, JSON only when asked
    assert main(["plan", "configs/study.toml", "--device", "H100 NVL", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    lab = load("configs/study.toml")
    cfg = model_config(lab.train.model, 5000, **lab.train.model_overrides)
    expected = plan.planned_max_micro_batch(cfg, device="H100 NVL", seq_len=512, precision="fp32", attention="eager",
                                            dp=256)["max_micro_batch"]
    assert summary["max_micro_batch"] == expected and summary["within_10pct"] and abs(expected - 184) <= 18
    assert set(summary["efficiency_at_max_gpus"]) == {"fp32", "tf32", "bf16"} and summary["n_gpus"] == 256
    assert "largest micro-batch that fits (fp32, planned" in out and summary["method"].startswith("planned")
