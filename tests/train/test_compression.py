"""Gradient compression through DDP's one comm hook (labkit.train.comm.compression_hook inside
time_gradient_collectives): 2 gloo ranks train the tiny model with grad_compression "none",
"bf16" and "powersgd" in one spawn. bf16 puts exactly half of none's bytes on the wire (2 bytes
per gradient element instead of 4; none's bytes are 4 x the model's parameters, each all-reduced
once), keeps comm_exposed_s in every record and trains to none's losses within bf16's rounding,
under DDP and under FSDP2 (its reduce-scatters in bf16, ``MixedPrecisionPolicy(reduce_dtype)``);
PowerSGD all-reduces fp32 during its warm-up steps, then less than half the bytes. A run stopped
after step 3 and resumed continues exactly: under PowerSGD bit for bit (its error feedback and Q
memories by parameter name, its step counter: compressed from the first resumed step on, on DDP's
unbuilt buckets), and the noise scale's averages where they were (plain all-reduce: bit for bit)."""

from __future__ import annotations

import json
import os
import pathlib
import socket

import pytest
import torch
import torch.multiprocessing as mp

STEPS, START = 5, 2  # PowerSGD: steps 1-2 plain all-reduce, 3-5 compressed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfgs_json: str) -> None:
    from labkit.config import TrainConfig, from_dict
    from labkit.train import dist, train

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    assert dist.init_distributed("gloo", 60.0, torch.device("cpu"))
    try:
        for cfg in json.loads(cfgs_json):
            train(from_dict(TrainConfig, cfg))
    finally:
        dist.teardown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> pathlib.Path:
    from labkit.config import TrainConfig, to_dict
    from tiny_shards import write_tiny_shards  # tests/ is on sys.path (pytest rootdir import)

    root = tmp_path_factory.mktemp("compression")
    shards = write_tiny_shards(root / "shards", n_sequences=48)
    cfgs = [TrainConfig(data_dir=str(shards), run_dir=str(root / name), model="tiny", max_steps=STEPS, num_threads=1,
                        device="cpu", timeout_s=60, batch={"micro_batch_size": 4}, optim={"lr": 3e-3},
                        schedule={"warmup_steps": 1}, measure={"timing_warmup_steps": 1},
                        checkpoint={"enabled": sharding == "ddp"},
                        parallel={"grad_compression": kind, "powersgd_rank": 2, "powersgd_start_iter": START,
                                  "sharding": sharding})
            for name, kind, sharding in (("none", "none", "ddp"), ("bf16", "bf16", "ddp"),
                                         ("powersgd", "powersgd", "ddp"), ("fsdp-none", "none", "fsdp"),
                                         ("fsdp-bf16", "bf16", "fsdp"))]
    cfgs.append(cfgs[0].replace(run_dir=str(root / "auto"), parallel={"bucket_cap_mb": "auto"}))
    for kind in ("powersgd", "none"):  # RESUMED: uninterrupted, and stopped after step 3 then resumed
        whole = cfgs[2 if kind == "powersgd" else 0].replace(run_dir=str(root / f"{kind}-whole"), max_steps=6,
                                                             checkpoint={"every": 3})
        part = whole.replace(run_dir=str(root / f"{kind}-part"), stop_after=3)
        cfgs += [whole, part, part.replace(stop_after=None)]
    mp.spawn(_worker, args=(2, _free_port(), json.dumps([to_dict(c) for c in cfgs])), nprocs=2, join=True)
    return root


def _metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_bf16_sends_half_the_bytes_and_records_exposed_communication(runs):
    none, bf16 = _metrics(runs / "none"), _metrics(runs / "bf16")
    assert [r["step"] for r in bf16] == list(range(1, STEPS + 1))
    params = json.loads((runs / "none" / "result.json").read_text())["params"]  # tied embedding once
    for a, b in zip(none, bf16):
        assert a["comm_bytes"] == 4 * params  # fp32: every parameter's gradient once per step
        assert b["comm_bytes"] * 2 == a["comm_bytes"]
        assert 0.0 <= b["comm_exposed_s"] <= b["step_time_s"]
    # bf16 rounds each averaged gradient to 8 bits of mantissa: the same training, to ~1e-2
    assert [r["loss"] for r in bf16] == pytest.approx([r["loss"] for r in none], rel=2e-2)
    assert bf16[0]["loss"] == none[0]["loss"]  # the first forward precedes any reduction
    fsdp, fsdp_bf16 = _metrics(runs / "fsdp-none"), _metrics(runs / "fsdp-bf16")  # FSDP2's reduce_dtype
    assert all(b["comm_bytes"] * 2 == a["comm_bytes"] > 0 for a, b in zip(fsdp, fsdp_bf16))
    assert [r["loss"] for r in fsdp_bf16] == pytest.approx([r["loss"] for r in fsdp], rel=2e-2)
    assert fsdp_bf16[0]["loss"] == fsdp[0]["loss"]


def test_powersgd_plain_during_warm_up_then_compressed(runs):
    none, psgd = _metrics(runs / "none"), _metrics(runs / "powersgd")
    assert [r["comm_bytes"] for r in psgd[:START]] == [r["comm_bytes"] for r in none[:START]]
    full = none[0]["comm_bytes"]
    assert all(0 < r["comm_bytes"] < full / 2 for r in psgd[START:]), [r["comm_bytes"] for r in psgd]
    assert all(0.0 <= r["comm_exposed_s"] <= r["step_time_s"] for r in psgd)
    assert all(r["loss"] == r["loss"] for r in psgd)  # finite: the compressed steps still train
    # the planner's count (labkit.study.scaling.compressed_grad_bytes, per parameter by torch's rule)
    # is what the hook sent, bucket by bucket
    from labkit.model import model_config
    from labkit.study.scaling import compressed_grad_bytes

    vocab = json.loads((runs / "none" / "result.json").read_text())["vocab_size"]
    cfg = model_config("tiny", vocab)
    assert psgd[-1]["comm_bytes"] == compressed_grad_bytes(cfg, "powersgd", powersgd_rank=2)
    assert none[0]["comm_bytes"] == compressed_grad_bytes(cfg, "none") == 2 * compressed_grad_bytes(cfg, "bf16")
    assert sum(psgd[-1]["comm_bucket_bytes"]) == psgd[-1]["comm_bytes"]
    # the noise scale rides the loop's loss all-reduce; under PowerSGD from sketches of the local buckets
    assert all(r["gns_sketch_bins"] for r in psgd) and not any(r["gns_sketch_bins"] for r in none)
    assert [r["gns_sq_small"] for r in psgd[:START]] == pytest.approx([r["gns_sq_small"] for r in none[:START]], rel=0.1)


def test_config_refusals():
    from labkit.config import TrainConfig

    with pytest.raises(ValueError, match="^parallel.grad_compression: 'powersgd' is torch's DDP comm hook .*sharding "
                                         "'ddp' or 'zero1', not 'fsdp'$"):
        TrainConfig(data_dir="d", run_dir="r", parallel={"sharding": "fsdp", "grad_compression": "powersgd"})
    bf16 = TrainConfig(data_dir="d", run_dir="r", parallel={"sharding": "fsdp", "grad_compression": "bf16"})
    assert bf16.parallel.grad_compression == "bf16"
    with pytest.raises(ValueError, match="grad_compression"):
        TrainConfig(data_dir="d", run_dir="r", parallel={"grad_compression": "fp8"})
    with pytest.raises(ValueError, match="powersgd_start_iter"):
        TrainConfig(data_dir="d", run_dir="r", parallel={"grad_compression": "powersgd", "powersgd_start_iter": 1})
    with pytest.raises(ValueError, match="powersgd_rank"):
        TrainConfig(data_dir="d", run_dir="r", parallel={"powersgd_rank": 0})


def test_auto_bucket_cap_measures_the_link_and_trains_as_the_default(runs):
    """bucket_cap_mb="auto" on 2 gloo ranks: rank 0 records the backward and the link it measured
    and the cap it chose (labkit/train/buckets.py), DDP's buckets follow that cap, and the losses
    equal the 25 MiB run's bit for bit (the probe's forward, backward and random draws leave
    nothing behind; a 2-rank sum is the same in any bucketing)."""
    import math

    from labkit.train import buckets

    record = json.loads((runs / "auto" / "bucket_auto.json").read_text())
    assert record["backward_s"] > 0 and record["s_per_byte"] > 0 and record["world_size"] == 2
    again = buckets.bucket_bytes(grad_bytes=record["grad_bytes"], last_bytes=record["embedding_bytes"],
                                 backward_s=record["backward_s"], latency_s=record["latency_s"],
                                 s_per_byte=record["s_per_byte"])
    assert record["bucket_cap_mb"] == again["bytes"] / 2**20
    auto, none = _metrics(runs / "auto"), _metrics(runs / "none")
    assert [r["loss"] for r in auto] == [r["loss"] for r in none]
    cap = record["bucket_cap_mb"] * 2**20
    rebuilt = auto[-1]["comm_bucket_bytes"]
    assert sum(rebuilt) == none[-1]["comm_bytes"] and len(rebuilt) == max(1, math.ceil(sum(rebuilt) / cap)) or \
        all(b <= cap + record["embedding_bytes"] for b in rebuilt), (rebuilt, cap)


def test_a_resumed_run_continues_powersgd_and_the_noise_scale(runs):
    """Stopped after step 3 (PowerSGD compressing since step 3) and resumed: the uninterrupted run's
    losses and grad norms bit for bit under PowerSGD, its compressed bytes from the first resumed step
    (no second warm-up), and the noise scale's averages continued (plain all-reduce: bit for bit,
    not restarted)."""
    whole, part = _metrics(runs / "powersgd-whole"), _metrics(runs / "powersgd-part")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in part] == [(r["step"], r["loss"], r["grad_norm"])
                                                                      for r in whole]
    assert [r["comm_bytes"] for r in part] == [r["comm_bytes"] for r in whole]
    assert all(r["comm_bytes"] < whole[0]["comm_bytes"] / 2 for r in part[START:])
    from labkit.train.gns import two_batch_estimates

    plain, resumed = _metrics(runs / "none-whole"), _metrics(runs / "none-part")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in plain]
    for key in ("gns_grad_sq", "gns_trace_cov", "b_simple"):  # the averages over steps 1-6, bit for bit: DDP's
        # buckets differ on the first resumed step, the squared norms are summed per parameter by name (gns)
        assert [r[key] for r in resumed] == [r[key] for r in plain], key
    fresh = two_batch_estimates(*(resumed[3][k] for k in ("gns_sq_small", "gns_sq_big", "gns_b_small", "gns_b_big")))
    assert abs(fresh[0] / resumed[3]["gns_grad_sq"] - 1) > 1e-2  # restarted averages would be step 4's own
