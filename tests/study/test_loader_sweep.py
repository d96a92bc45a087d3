"""labkit.study.loader_sweep: the sweep table on real shards (counts checked against a plain
single-process loader), the knee, the planner's step time, NVML sampling with and without NVML."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import polars as pl
import pytest

from labkit.config import ShardConfig, TokenizerConfig
from labkit.study.loader_sweep import SCHEMA, knee, measure_step_time, planned_step_time, sweep_loader, workers_needed
from labkit.data.mlm import make_loader
from labkit.data.shards import write_shards
from labkit.data.tokenize import train_tokenizer
from labkit.model import flops_per_token, model_config

B = 16  # 394 sequences: 24 batches per epoch


pytestmark = pytest.mark.torch_threads(2)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sweep")
    lines = ["mov rax, qword ptr [rbp - 8]", "add rax, rbx", "call FUNC", "ret", "push rbp", "xor eax, eax",
             "lea rdi, [rip + IMM]", "cmp eax, IMM", "jne ADDR"]
    docs = ["\n".join(lines[(i * 7 + j * j) % 9] for j in range(3 + i % 11)) for i in range(300)]
    pl.DataFrame({"text": docs}).write_parquet(d / "docs.parquet")
    train_tokenizer(str(d / "docs.parquet"), TokenizerConfig(vocab_size=150), str(d / "tokenizer.json"))
    write_shards(str(d / "docs.parquet"), str(d / "tokenizer.json"), str(d / "shards"),
                 ShardConfig(seq_len=32, sequences_per_shard=25), progress=False)
    return d / "shards"


def reference_counts(data_dir: Path, n_skip: int, n: int) -> tuple[int, int]:
    """Real tokens and masked positions of batches n_skip..n_skip+n of a single-process loader,
    rolling over epochs as the sweep does."""
    from labkit.data.shards import read_index

    loader = make_loader(data_dir, batch_size=B, rank=0, world_size=1, seed=0, mlm_probability=0.15,
                         vocab_size=read_index(data_dir)["vocab_size"])
    batches = []
    while len(batches) < n_skip + n:
        batches += list(loader)
    timed = batches[n_skip:n_skip + n]
    return (sum(int(b["attention_mask"].sum()) for b in timed),
            sum(int((b["labels"] != -100).sum()) for b in timed))


@pytest.mark.timeout(120)
def test_sweep_table_counts_match_a_plain_loader(shards):
    table = sweep_loader(shards, batch_size=B, step_time_s=0.002, workers=(0, 2), n_batches=30,
                         warmup_batches=3, threshold=0.5, gpu_index=None)
    assert table.columns == [*SCHEMA, "knee"] and table["num_workers"].to_list() == [0, 2]
    tokens, masked = reference_counts(shards, 3, 30)  # 30 timed batches cross an epoch boundary
    assert table["tokens"].to_list() == [tokens, tokens] and table["n_masked"].to_list() == [masked, masked]
    assert table["samples"].to_list() == [30 * B] * 2 and table["batches"].to_list() == [30, 30]
    for row in table.iter_rows(named=True):
        assert row["samples_per_s"] == pytest.approx(row["samples"] / row["seconds"])
        assert 0.0 <= row["data_wait_fraction"] <= 1.0
        assert row["data_wait_fraction"] == pytest.approx(row["data_wait_s"] / row["step_time_s"])
        assert row["step_time_s"] >= 0.002 and row["gpu_util_mean"] is None and row["gpu_util_samples"] == 0
    at = knee(table, 0.5)
    assert table.filter(pl.col("knee"))["num_workers"].to_list() == ([] if at is None else [at])


def test_knee_is_the_fewest_workers_under_the_threshold():
    table = pl.DataFrame({"num_workers": [0, 1, 2, 4], "data_wait_fraction": [0.9, 0.2, 0.01, 0.0]})
    assert knee(table, 0.05) == 2 and knee(table.lazy(), 0.5) == 1 and knee(table, 0.0) is None
    assert knee(table.reverse(), 0.05) == 2


def test_planned_step_time_and_workers_needed_closed_form():
    cfg = model_config("bert-120m", 8192)
    fpt = flops_per_token(cfg, 512)
    t = planned_step_time(fpt, seq_len=512, batch_size=32, peak_flops=989e12, mfu=0.4)
    assert t == pytest.approx(32 * 512 * fpt / (0.4 * 989e12))
    samples_per_s = 32 / t
    assert workers_needed(samples_per_s, samples_per_s / 3.5) == 4 and workers_needed(10.0, 100.0) == 1
    assert math.isclose(samples_per_s * 512 * fpt, 0.4 * 989e12)
    with pytest.raises(ValueError, match="mfu"):
        planned_step_time(fpt, seq_len=512, batch_size=32, peak_flops=989e12, mfu=0.0)
    with pytest.raises(ValueError, match="samples_per_s_per_worker"):
        workers_needed(1.0, 0.0)


def test_measured_consumer_and_fake_nvml(shards, monkeypatch):
    """A consumer given as a callable sees every batch; with an NVML module present (a stand-in
    here: no GPU on CI) utilisation samples are taken during each setting and averaged."""
    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: ("gpu", i),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=37 if h == ("gpu", 0) else 0))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    seen = []
    table = sweep_loader(shards, batch_size=B, step=lambda b: seen.append(b["input_ids"].shape), workers=(0,),
                         n_batches=5, warmup_batches=2, gpu_index=0, sample_interval_s=0.001)
    assert seen == [(B, 32)] * 7
    assert table["gpu_util_mean"].to_list() == [37.0] and table["gpu_util_samples"][0] >= 1
    assert calls == ["init", "shutdown"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails, no samples
    table = sweep_loader(shards, batch_size=B, step_time_s=0.0, workers=(0,), n_batches=2, gpu_index=0)
    assert table["gpu_util_mean"].to_list() == [None] and table["gpu_util_samples"].to_list() == [0]


def test_measure_step_time_and_errors(shards):
    ticks = []
    assert measure_step_time(lambda b: ticks.append(1), {}, repeats=3, warmup=2) >= 0 and len(ticks) == 5
    with pytest.raises(ValueError, match="step_time_s"):
        sweep_loader(shards, batch_size=B)
    with pytest.raises(ValueError, match="step_time_s"):
        sweep_loader(shards, batch_size=B, step_time_s=0.1, step=print)
    with pytest.raises(ValueError, match="workers"):
        sweep_loader(shards, batch_size=B, step_time_s=0.1, workers=())
