"""A one-process run of the study's configuration in small: its tokenizer, padded rows and model
options on functions of this machine's libc. The throughput counts real tokens only: each
record's tokens are checked against the non-[PAD] ids of the rows its batches hold (rebuilt from
the shards with labkit's sampler), and tokens/s, packing efficiency and MFU against them."""

from __future__ import annotations

import json

import numpy as np
import polars as pl

from labkit import measure
from labkit.config import ShardConfig, TokenizerConfig, TrainConfig
from labkit.config.tomlfile import load
from labkit.data.mlm import RankSampler
from labkit.data.shards import SequenceReader, write_shards
from labkit.data.tokenize import train_tokenizer
from labkit.model import flops_per_token, model_config
from labkit.train import train
from tests.data.real_corpus import libc_functions


def test_study_config_in_small_counts_real_tokens(tmp_path, monkeypatch):
    docs = tmp_path / "docs.parquet"
    texts = libc_functions(400)
    pl.DataFrame({"id": [f"{i:016x}" for i in range(len(texts))], "text": texts}).write_parquet(docs)
    lab = load("configs/study.toml")
    tok = train_tokenizer(str(docs), TokenizerConfig(kind="instruction", vocab_size=300, min_frequency=0,
                                                     held_out_docs=0), str(tmp_path / "tokenizer.json"))
    index = write_shards(str(docs), tok, str(tmp_path / "shards"),
                         ShardConfig(seq_len=128, packing="padded", heldout_fraction=0.1), progress=False)
    monkeypatch.setattr(measure, "peak_flops", lambda device, precision: 1e12)  # a made-up device: MFU not None
    overrides = {**lab.train.model_overrides, "max_position_embeddings": 128}
    cfg = TrainConfig(data_dir=str(tmp_path / "shards"), run_dir=str(tmp_path / "run"), model="tiny",
                      model_overrides=overrides, max_steps=4, num_threads=1, device="cpu", seed=0,
                      batch={"micro_batch_size": 4}, optim={"lr": 1e-3}, schedule={"warmup_steps": 0},
                      eval={"every": 2, "sequences": 16}, checkpoint={"enabled": False}, measure={"trackers": ()},
                      data={"tokenizer_path": tok})
    result = train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = SequenceReader(tmp_path / "shards")
    batches = RankSampler(len(rows), rank=0, world_size=1, batch_size=4, seed=0).batches(0)
    fpt = flops_per_token(model_config("tiny", index["vocab_size"], **overrides), 128)
    for r, ids in zip(records, batches):
        real = int(np.count_nonzero(rows.rows(ids.numpy())))  # [PAD] is id 0
        assert r["step_tokens"] == real < 4 * 128
        assert r["tokens_per_s"] == real / r["step_time_s"]
        assert r["packing_efficiency"] == real / (4 * 128)
        assert r["mfu"] == r["tokens_per_s"] * fpt / 1e12
    assert result["packing"] == index["packing"] and not result["packing"]["cross_document_attention"]
    assert result["model_config"]["position_embedding"] == "instruction" and np.isfinite(result["eval_loss"])
