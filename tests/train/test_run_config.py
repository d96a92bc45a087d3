"""Resume refuses configuration drift (labkit/train/run_config.py, used by labkit/train/loop.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from labkit.config import TrainConfig, to_dict
from labkit.train.run_config import FREE_FIELDS, SAFE_FIELDS, config_drift
from labkit.train import train
from test_loop import read_metrics, tiny_cfg
from tiny_shards import write_tiny_shards


@pytest.fixture
def shards(tmp_path):
    return write_tiny_shards(tmp_path / "shards")


def test_changed_lr_is_refused_in_one_line_naming_both_values(shards, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(shards, run, max_steps=2, ckpt_every=1))
    with pytest.raises(ValueError) as err:
        train(tiny_cfg(shards, run, max_steps=2, lr=0.01, seed=3))
    message = str(err.value)
    assert "\n" not in message
    assert "lr: 0.003 -> 0.01" in message and "seed: 0 -> 3" in message and "max_steps" not in message
    assert "allow_safe_changes" not in message  # a result-changing drift cannot be allowed
    with pytest.raises(ValueError, match="lr: 0.003 -> 0.01"):  # the option does not allow it either
        train(tiny_cfg(shards, run, max_steps=2, lr=0.01, allow_safe_changes=True))
    assert json.loads((run / "config.json").read_text())["lr"] == 0.003  # the refused run wrote nothing


def test_safe_changes_need_the_option_and_earlier_configs_are_kept(shards, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(shards, run, max_steps=2))
    with pytest.raises(ValueError, match=r"log_every: 1 -> 2; max_steps: 2 -> 4 \(set allow_safe_changes=True"):
        train(tiny_cfg(shards, run, max_steps=4, log_every=2))
    result = train(tiny_cfg(shards, run, max_steps=4, log_every=2, num_threads=2, allow_safe_changes=True))
    assert result["resumed_from_step"] == 2 and result["steps"] == 4
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 4]
    assert json.loads((run / "config.json").read_text())["max_steps"] == 4
    assert json.loads((run / "configs" / "config-1.json").read_text())["max_steps"] == 2


def test_other_data_is_refused_by_hash(shards, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(shards, run, max_steps=1))
    other = write_tiny_shards(tmp_path / "other", seed=1)
    with pytest.raises(ValueError, match="data_sha256: '[0-9a-f]{64}' -> '[0-9a-f]{64}'"):
        train(tiny_cfg(other, run, max_steps=1))
    assert "data_dir" in FREE_FIELDS  # a moved copy of the same data is fine: compared by hash


def test_every_result_changing_field_is_compared():
    base = to_dict(tiny_cfg("d", "r"))
    data = {"data_sha256": "a", "tokenizer_sha256": "t", "seq_len": 32, "vocab_size": 96}
    assert config_drift(base, base, data, data, allow_safe_changes=False) == []
    for key, value in (("model", "mini"), ("micro_batch_size", 8), ("grad_accum_steps", 4), ("schedule", "cosine"),
                       ("weight_decay", 0.1), ("beta2", 0.999), ("precision", "bf16"),
                       ("mlm_probability", 0.3), ("model_overrides", {"bias": False}), ("seq_len", 64)):
        assert config_drift(base, {**base, key: value}, data, data, allow_safe_changes=True) == [
            f"{key}: {base[key]!r} -> {value!r}"], key
    for key in ("tokenizer_sha256", "seq_len"):
        assert config_drift(base, base, data, {**data, key: "x"}, allow_safe_changes=True) == [
            f"{key}: {data[key]!r} -> 'x'"]
    assert config_drift(base, {**base, "eval_every": 5}, data, data, allow_safe_changes=True) == []
    # the sharding changes how a step is computed, not what: a checkpoint loads under another one
    assert config_drift(base, {**base, "sharding": "fsdp"}, data, data, allow_safe_changes=True) == []
    assert config_drift(base, {**base, "sharding": "fsdp"}, data, data, allow_safe_changes=False) == [
        f"sharding: {base['sharding']!r} -> 'fsdp'"]
    assert not FREE_FIELDS & SAFE_FIELDS


def test_model_config_of_is_the_preset_with_overrides_and_activation_checkpointing():
    from labkit.model import model_config
    from labkit.train.run_config import model_config_of

    cfg = TrainConfig(data_dir="d", run_dir="r", model="tiny", model_overrides={"num_layers": 1})
    plain = model_config_of(cfg, 300)
    assert plain == model_config("tiny", 300, num_layers=1) and not plain.activation_checkpointing
    on = model_config_of(dataclasses.replace(cfg, activation_checkpointing=True), 300)
    assert on == model_config("tiny", 300, num_layers=1, activation_checkpointing=True)
