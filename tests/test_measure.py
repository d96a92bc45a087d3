"""Tests of labkit/measure.py: closed forms of the docs/measurement.md."""

from __future__ import annotations

import pytest
import torch

from labkit import measure


def test_mfu_closed_form_with_made_up_device(monkeypatch):
    """MFU = tokens/s x FLOPs/token / (n_gpus x peak): 2 GPUs of a made-up 100 TFLOP/s part at
    50,000 tokens/s on a 1e9 FLOPs/token model use 5e13 of 2e14 FLOP/s = 25 %."""
    monkeypatch.setitem(measure.PEAK_FLOPS, ("Made-up X1", "bf16"), 100e12)
    peak = measure.PEAK_FLOPS[("Made-up X1", "bf16")]
    assert measure.mfu(50_000.0, 1e9, 2, peak) == pytest.approx(0.25)
    assert measure.mfu(50_000.0, 1e9, 2, None) is None


def test_peak_table_and_device_names():
    assert measure.PEAK_FLOPS[("H100 SXM", "bf16")] == 989e12
    assert measure.PEAK_FLOPS[("H100 NVL", "bf16")] == 835.5e12
    assert measure.PEAK_FLOPS[("H200", "bf16")] == 989e12
    assert measure.PEAK_FLOPS[("A100", "bf16")] == 312e12
    assert measure.device_kind("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert measure.device_kind("NVIDIA H100 NVL") == "H100 NVL"
    assert measure.device_kind("NVIDIA H200") == "H200"
    assert measure.device_kind("NVIDIA H200 NVL") == "H200 NVL"  # the 600 W card: its own, lower peak
    assert measure.PEAK_FLOPS[("H200 NVL", "bf16")] == 835.5e12
    assert measure.device_kind("NVIDIA A100-SXM4-80GB") == "A100 80GB"
    assert measure.device_kind("NVIDIA A100-PCIE-40GB") == "A100 40GB"
    assert measure.device_kind("NVIDIA H100 PCIe") is None  # a different peak: not guessed
    assert measure.device_kind("NVIDIA GeForce RTX 4090") is None
    assert measure.peak_flops(torch.device("cpu"), "bf16") is None


def test_peak_flops_takes_a_device_name_and_one_table_serves_the_planner():
    from labkit.study.plan import DEVICES, device_info

    assert measure.peak_flops("H100 SXM", "bf16") == 989e12
    assert measure.peak_flops("H100 NVL", "fp32") == 60e12
    assert measure.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12  # a CUDA product name
    assert measure.peak_flops("A100", "bf16") == measure.peak_flops("A100 80GB", "bf16") == 312e12  # the old name
    assert measure.peak_flops("A100 40GB", "fp32") is None  # no fp32 peak in the table: MFU None
    assert measure.peak_flops("cpu", "bf16") is None
    with pytest.raises(ValueError, match="^device: unknown 'H100 SXN'; known devices are H100 SXM"):
        measure.peak_flops("H100 SXN", "bf16")
    assert DEVICES is measure.DEVICES  # one table
    for name in DEVICES:  # every device the planner knows has measure's peak
        assert device_info(name)["peak_flops"] == measure.peak_flops(name, "bf16") > 0
    assert device_info("A100")["device"] == "A100 40GB" and device_info("A100")["memory_bytes"] == 40e9
    assert {k for k, _ in measure.PEAK_FLOPS} == set(DEVICES) | set(measure.DEVICE_ALIASES)


def test_rates_and_data_wait_fraction():
    assert measure.tokens_per_s(12_000, 0.5) == 24_000.0
    assert measure.samples_per_s(64, 2.0) == 32.0
    assert measure.data_wait_fraction(0.25, 1.0) == 0.25
    assert measure.data_wait_fraction(0.0, 3.0) == 0.0
    with pytest.raises(ValueError, match="step_time_s"):
        measure.data_wait_fraction(0.1, 0.0)


def test_peak_memory_on_cpu_is_the_process_peak_rss():
    got = measure.peak_memory_bytes(torch.device("cpu"))
    assert got == measure.peak_rss_bytes()
    big = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    assert measure.peak_memory_bytes(torch.device("cpu")) >= big.numel() * 4
    measure.reset_peak_memory(torch.device("cpu"))  # a no-op on CPU, must not raise


def test_a_child_process_peak_rss_is_its_own_not_its_parents():
    """A process started from one holding 600 MiB more: getrusage's ru_maxrss reports the
    parent's peak (carried across fork and exec), ``peak_rss_bytes`` the child's own (Python,
    torch and labkit: about 230 MiB)."""
    import json
    import subprocess
    import sys

    big = bytearray(600 * 2**20)
    big[::4096] = b"\1" * len(big[::4096])  # touch every page
    code = ("import json, resource; from labkit import measure; "
            "print(json.dumps([measure.peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))")
    own, inherited = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                               check=True).stdout)
    assert inherited >= 600 * 2**20 and own <= inherited - 300 * 2**20
    del big


def test_step_timer_needs_start():
    timer = measure.StepTimer(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="before start"):
        timer.lap()
    timer.start()
    first = timer.lap()
    assert 0.0 <= first <= timer.stop()
    with pytest.raises(RuntimeError):
        timer.stop()


@pytest.mark.gpu
def test_cuda_peak_memory_and_peak_flops():
    device = torch.device("cuda")
    measure.reset_peak_memory(device)
    x = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
    assert measure.peak_memory_bytes(device) >= x.numel()
    kind = measure.device_kind(torch.cuda.get_device_name(device))
    assert measure.peak_flops(device, "bf16") == measure.PEAK_FLOPS.get((kind, "bf16"))
    assert measure.peak_flops(device, "fp32") == measure.PEAK_FLOPS.get((kind, "fp32"))  # None if unlisted


def test_fp32_and_tf32_peaks_of_the_h100s():
    """NVIDIA's H100 page (docs/references.md C2): FP32 67 / 60 TFLOP/s (SXM / NVL, CUDA cores),
    TF32 989 / 835 with sparsity, so 494.5 / 417.5 dense; bf16 stays twice TF32."""
    assert measure.PEAK_FLOPS[("H100 NVL", "fp32")] == 60e12 and measure.PEAK_FLOPS[("H100 SXM", "fp32")] == 67e12
    for kind in ("H100 NVL", "H100 SXM"):
        assert measure.PEAK_FLOPS[(kind, "bf16")] == pytest.approx(2 * measure.PEAK_FLOPS[(kind, "tf32")], rel=1e-3)


def test_packing_efficiency():
    assert measure.packing_efficiency(96, 2, 64) == 0.75
    with pytest.raises(ValueError, match="sequences"):
        measure.packing_efficiency(1, 0, 64)


def test_scaling_efficiency_closed_form():
    assert measure.scaling_efficiency(1800.0, 1000.0, 2) == pytest.approx(0.9)
    assert measure.scaling_efficiency(1000.0, 1000.0, 1) == 1.0
    with pytest.raises(ValueError, match="throughput_1"):
        measure.scaling_efficiency(1.0, 0.0, 2)


def test_bubble_fraction_of_a_gpipe_timeline():
    """2 stages, 1 micro-batch, forward 1 s and backward 2 s each: both ranks are in the pipeline
    for 6 s and compute 3 s each, GPipe's (p - 1)/(m + p - 1) = 1/2."""
    assert measure.bubble_fraction(busy_s=3.0 + 3.0, span_s=2 * 6.0) == 0.5
    with pytest.raises(ValueError, match="span_s"):
        measure.bubble_fraction(1.0, 0.0)


def test_interval_timer_sums_intervals_and_restarts():
    import time

    timer = measure.IntervalTimer(torch.device("cpu"))
    for _ in range(3):
        with timer:
            time.sleep(0.01)
    seconds, n = timer.take()
    assert n == 3 and 0.03 <= seconds < 1.0
    assert timer.take() == (0.0, 0)


def test_saved_activation_peak_against_the_planner_and_its_release():
    """The peak of saved-for-backward bytes of one BertMLM step equals the planner's exact count
    (``labkit.study.plan.saved_activation_bytes``), and backward releases them."""
    from labkit.model import BertMLM, model_config
    from labkit.study import plan

    cfg = model_config("tiny", 300, max_position_embeddings=64, sparse_head=False, hidden_dropout=0.0,
                       attention_dropout=0.0)
    torch.manual_seed(0)
    model = BertMLM(cfg).train()
    ids = torch.randint(5, 300, (3, 64))
    labels = torch.where(torch.rand(3, 64) < 0.15, ids, -100)
    peak = measure.SavedActivationPeak({p.untyped_storage().data_ptr() for p in model.parameters()})
    with peak:
        out = model(ids, torch.ones_like(ids, dtype=torch.bool), labels)
        at_forward_end = peak._live
        out.loss_sum.backward()
        del out
    assert peak.bytes == at_forward_end == plan.saved_activation_bytes(cfg, 64, 3, precision="fp32", device="cpu",
                                                                        attention="flash")
    assert peak._live < peak.bytes // 100  # released by backward (the ids and labels stay alive here)


def test_goodput_of_a_run_with_a_restart_in_closed_form():
    """Two segments of 2 ranks (tests/timeline_sim.py): the first starts at t=1000, its first
    step 1 s later, and runs steps 1-6; the second resumes from step 4's checkpoint 7 s after the
    first's last row (its first step 2 s after its own start) and runs steps 5-8. Each step:
    rank 1 waits 0.1 s for data, computes 0.05 s, the collectives take 0.01 s more, the optimiser
    0.005 s, then 0.002 s of other work. Every badput cause is the closed form of that run."""
    import polars as pl

    from labkit.train.timeline import SCHEMA
    from timeline_sim import SMALL, simulate

    first = simulate(6, data=[0.002, 0.1], compute=[0.05, 0.05], segment_start=1000.0)
    end_first = max(r["t_end"] for r in first)
    second = simulate(4, data=[0.002, 0.1], compute=[0.05, 0.05], segment_start=end_first + 5.0, start_delay=2.0,
                      first_step=5, resumed_from=4)
    g = measure.goodput(pl.from_dicts(first + second, schema=SCHEMA))
    step = 0.1 + SMALL + 0.05 + 0.01 + SMALL + 0.005  # data, first all-reduce, compute, tail, loss all-reduce, optimiser
    row = step + 0.002
    elapsed = 1.0 + 6 * row + 7.0 + 4 * row
    assert g["goodput_elapsed_s"] == pytest.approx(elapsed)
    expected = {"startup": 1.0, "restart": 7.0, "redone": 2 * row, "data": 8 * 0.1, "communication": 8 * 0.01,
                "checkpoint": 0.0, "eval": 0.0, "other": 8 * 0.002}
    for cause, seconds in expected.items():
        assert g[f"badput_{cause}"] * elapsed == pytest.approx(seconds, abs=1e-9), cause
    assert g["goodput_productive_s"] == pytest.approx(8 * (step - 0.1 - 0.01))
    assert g["goodput"] + sum(g[f"badput_{c}"] for c in measure.BADPUT) == pytest.approx(1.0)
    assert measure.goodput(pl.from_dicts(first, schema=SCHEMA), end=end_first + 3.0)["badput_other"] * (
        end_first + 3.0 - 1000.0) == pytest.approx(6 * 0.002 + 3.0)  # the run's end after its last row
    with pytest.raises(ValueError, match="no rows"):
        measure.goodput(pl.DataFrame(schema=SCHEMA))


def test_statistical_efficiency_and_goodput_against_adaptdl_and_the_time_to_target():
    """E(B) = (B_noise + B0)/(B_noise + B) equals AdaptDL's ``GoodputFunction.efficiency`` written
    from the gradient's squared norm |G|² and the variance tr(Σ)/B0 of a batch-B0 gradient
    (adaptdl/goodput.py), with B_noise = tr(Σ)/|G|²; and time to a target = steps x step time with
    S(B) = E_min/B + E_min/B_noise (McCandlish et al. 2018) goes as 1 / goodput."""
    from labkit.study.forecast import steps_to_target

    sqr, trace, b0 = 2.0, 300.0, 8.0  # |G|², tr(Σ), the initial batch
    var = trace / b0
    for batch in (8.0, 16.0, 100.0, 4096.0):
        scale = batch / b0
        adaptdl = (var + sqr) / (var / scale + sqr) / scale
        assert measure.statistical_efficiency(batch, trace / sqr, b0) == pytest.approx(adaptdl, rel=1e-12)
    assert measure.statistical_efficiency(8.0, 150.0, 8.0) == 1.0
    assert measure.statistical_efficiency(166.0, 150.0, 8.0) == pytest.approx(0.5)  # B = B_noise + 2 B0 halves it
    b_noise, e_min = 150.0, 1e6
    times = {}
    for batch, step_s in ((16, 0.1), (64, 0.3), (512, 2.0)):
        throughput = batch / step_s
        times[batch] = (steps_to_target(batch, e_min=e_min, b_crit=b_noise) * step_s,
                        measure.statistical_goodput(throughput, batch, b_noise, 16))
    for a in times:
        for b in times:
            assert times[a][0] / times[b][0] == pytest.approx(times[b][1] / times[a][1], rel=1e-12)
    with pytest.raises(ValueError, match="b0 must be positive"):
        measure.statistical_efficiency(8, 10, 0)
    with pytest.raises(ValueError, match="throughput must be >= 0"):
        measure.statistical_goodput(-1.0, 8, 10, 8)
