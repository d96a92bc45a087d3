"""Resume refuses configuration drift (labkit/train/run_config.py, used by labkit/train/loop.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from labkit.config import FLAT_KEYS, TRAIN_SECTIONS, TrainConfig, dotted, to_dict
from labkit.train.run_config import FREE_FIELDS, SAFE_FIELDS, config_drift
from labkit.train import train
from test_loop import read_metrics, tiny_cfg
from tiny_shards import write_tiny_shards


@pytest.fixture
def shards(tmp_path):
    return write_tiny_shards(tmp_path / "shards")


def test_changed_lr_is_refused_in_one_line_naming_both_values(shards, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(shards, run, max_steps=2, checkpoint={"every": 1}))
    with pytest.raises(ValueError) as err:
        train(tiny_cfg(shards, run, max_steps=2, seed=3, optim={"lr": 0.01}))
    message = str(err.value)
    assert "\n" not in message
    assert "optim.lr: 0.003 -> 0.01" in message and "seed: 0 -> 3" in message and "max_steps" not in message
    assert "allow_safe_changes" not in message  # a result-changing drift cannot be allowed
    with pytest.raises(ValueError, match="lr: 0.003 -> 0.01"):  # the option does not allow it either
        train(tiny_cfg(shards, run, max_steps=2, allow_safe_changes=True, optim={"lr": 0.01}))
    assert json.loads((run / "config.json").read_text())["optim"]["lr"] == 0.003  # the refused run wrote nothing


def test_safe_changes_need_the_option_and_earlier_configs_are_kept(shards, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(shards, run, max_steps=2))
    with pytest.raises(ValueError, match=r"max_steps: 2 -> 4; measure.log_every: 1 -> 2 \(set allow_safe_changes=True"):
        train(tiny_cfg(shards, run, max_steps=4, measure={"log_every": 2}))
    result = train(tiny_cfg(shards, run, max_steps=4, num_threads=2, allow_safe_changes=True,
                            measure={"log_every": 2}))
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
    cfg = tiny_cfg("d", "r")
    base = to_dict(cfg)
    data = {"data_sha256": "a", "tokenizer_sha256": "t", "seq_len": 32, "vocab_size": 96}
    assert config_drift(base, base, data, data, allow_safe_changes=False) == []
    for change, key, old, new in (({"model": "mini"}, "model", "tiny", "mini"),
                                  ({"batch": {"micro_batch_size": 8}}, "batch.micro_batch_size", 4, 8),
                                  ({"batch": {"grad_accum_steps": 4}}, "batch.grad_accum_steps", 2, 4),
                                  ({"schedule": {"kind": "cosine"}}, "schedule.kind", "linear", "cosine"),
                                  ({"optim": {"weight_decay": 0.1}}, "optim.weight_decay", 0.01, 0.1),
                                  ({"optim": {"beta2": 0.999}}, "optim.beta2", 0.98, 0.999),
                                  ({"precision": "bf16"}, "precision", "fp32", "bf16"),
                                  ({"data": {"mlm_probability": 0.3}}, "data.mlm_probability", 0.15, 0.3),
                                  ({"model_overrides": {"bias": False}}, "model_overrides", {}, {"bias": False}),
                                  ({"data": {"seq_len": 64}}, "data.seq_len", None, 64)):
        assert config_drift(base, to_dict(cfg.replace(**change)), data, data, allow_safe_changes=True) == [
            f"{key}: {old!r} -> {new!r}"], key
    for key in ("tokenizer_sha256", "seq_len"):
        assert config_drift(base, base, data, {**data, key: "x"}, allow_safe_changes=True) == [
            f"{key}: {data[key]!r} -> 'x'"]
    assert config_drift(base, to_dict(cfg.replace(eval={"every": 5})), data, data, allow_safe_changes=True) == []
    # the sharding changes how a step is computed, not what: a checkpoint loads under another one
    fsdp = to_dict(cfg.replace(parallel={"sharding": "fsdp"}))
    assert config_drift(base, fsdp, data, data, allow_safe_changes=True) == []
    assert config_drift(base, fsdp, data, data, allow_safe_changes=False) == ["parallel.sharding: 'ddp' -> 'fsdp'"]
    assert not FREE_FIELDS & SAFE_FIELDS
    # a run directory's config.json from before the sections (flat names) is compared the same way
    old = {k: v for k, v in base.items() if k not in TRAIN_SECTIONS} | {
        old_name: dotted(base)[new_name] for old_name, new_name in FLAT_KEYS.items()} | {"run_id": "x"}
    assert config_drift(old, base, data, data, allow_safe_changes=False) == []
    assert config_drift(old, fsdp, data, data, allow_safe_changes=False) == ["parallel.sharding: 'ddp' -> 'fsdp'"]


def test_model_config_of_is_the_preset_with_overrides_and_activation_checkpointing():
    from labkit.model import model_config
    from labkit.train.run_config import model_config_of

    cfg = TrainConfig(data_dir="d", run_dir="r", model="tiny", model_overrides={"num_layers": 1})
    plain = model_config_of(cfg, 300)
    assert plain == model_config("tiny", 300, num_layers=1) and not plain.activation_checkpointing
    on = model_config_of(dataclasses.replace(cfg, activation_checkpointing=True), 300)
    assert on == model_config("tiny", 300, num_layers=1, activation_checkpointing=True)


def _snapshot(run) -> dict:
    """Every file of a run directory: its bytes and modification time."""
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()}


def test_training_a_finished_run_again_is_a_no_op_that_says_so(shards, tmp_path, capfd):
    """The same config on a finished run (other free fields such as threads may differ), resumed:
    the saved result is returned and no file of the run directory is written or even touched.
    With resume=False it is a new run: trained from step 0, the finished one moved to previous/."""
    run = tmp_path / "run"
    first = train(tiny_cfg(shards, run, max_steps=3, checkpoint={"every": 3}))
    before = _snapshot(run)
    capfd.readouterr()
    for cfg in (tiny_cfg(shards, run, max_steps=3, checkpoint={"every": 3}),
                tiny_cfg(shards, run, max_steps=3, num_threads=2, checkpoint={"every": 3})):
        again = train(cfg)
        assert _snapshot(run) == before
        assert again == json.loads((run / "result.json").read_text()) == json.loads(json.dumps(first))
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"train: {run} already finished (3 of 3 steps, ended 20")
        assert "labkit resume" in err[0] and "train.max_steps=N" in err[0]
    new = train(tiny_cfg(shards, run, max_steps=3, resume=False, checkpoint={"every": 3}))
    assert new["run_id"] != first["run_id"] and new["resumed_from_step"] is None and new["steps"] == 3
    (aside,) = (run / "previous").iterdir()
    assert aside.name.endswith(first["run_id"]) and json.loads((aside / "result.json").read_text()) == \
        json.loads(json.dumps(first))
    assert [r["loss"] for r in read_metrics(run)] == [r["loss"] for r in read_metrics(aside)]  # the same run again
    # a stopped run is not finished, and a changed config is not this run: both go on as before
    stopped = tmp_path / "stopped"
    train(tiny_cfg(shards, stopped, max_steps=4, stop_after=2, checkpoint={"every": 2}))
    assert train(tiny_cfg(shards, stopped, max_steps=4, checkpoint={"every": 2}))["resumed_from_step"] == 2
    with pytest.raises(ValueError, match="lr: 0.003 -> 0.01"):
        train(tiny_cfg(shards, run, max_steps=3, checkpoint={"every": 3}, optim={"lr": 0.01}))


def test_more_steps_make_a_result_over_the_whole_run_and_every_segment(shards, tmp_path):
    """Stopped after 4 steps, resumed to 8, then asked for 12 explicitly: result.json's throughput
    is the whole run's (segments weighted by their timed seconds, none null) and its provenance
    keeps each segment's steps, times and command; the model card's "trained" sums them."""
    from labkit.train.run_config import trained_seconds

    run = tmp_path / "run"
    a = train(tiny_cfg(shards, run, max_steps=8, stop_after=4, checkpoint={"every": 4}))
    b = train(tiny_cfg(shards, run, max_steps=8, checkpoint={"every": 4}))
    seg = b["segments"]
    assert [(s["start_step"], s["end_step"]) for s in seg] == [(0, 4), (4, 8)]
    assert seg[0]["tokens_per_s"] == a["tokens_per_s"] and seg[0]["start_time"] == a["provenance"]["start_time"]
    # each segment times 3 of its 4 steps (timing_warmup_steps=1): seconds = steps x batch / samples_per_s
    secs = [3 * b["global_batch_size"] / s["samples_per_s"] for s in seg]
    assert [s["timed_seconds"] for s in seg] == pytest.approx(secs)
    assert b["tokens_per_s"] == pytest.approx(sum(s["tokens_per_s"] * t for s, t in zip(seg, secs)) / sum(secs))
    assert b["samples_per_s"] == pytest.approx(6 * b["global_batch_size"] / sum(secs))
    assert b["wall_s"] == pytest.approx(a["wall_s"] + seg[1]["wall_s"])
    c = train(tiny_cfg(shards, run, max_steps=12, allow_safe_changes=True, checkpoint={"every": 4}))
    assert [(s["start_step"], s["end_step"]) for s in c["segments"]] == [(0, 4), (4, 8), (8, 12)]
    for key in ("tokens_per_s", "samples_per_s", "data_wait_fraction", "comm_exposed_s", "packing_efficiency"):
        assert c[key] is not None or key == "comm_exposed_s"  # one process: no gradient communication
    assert [s["command"] for s in c["provenance"]["segments"]] == [a["provenance"]["command"]] * 3
    assert c == json.loads((run / "result.json").read_text())
    assert trained_seconds(c) == pytest.approx(sum(trained_seconds({"provenance": s}) for s in c["provenance"]["segments"]))
    from labkit.export import _trained  # the model card's row

    segs = c["provenance"]["segments"]
    assert _trained(c) == (f"{trained_seconds(c):,.0f} s in 3 segments "
                           f"({segs[0]['start_time']} to {segs[-1]['end_time']})")


def test_a_resume_with_no_step_left_keeps_the_whole_runs_numbers(shards, tmp_path):
    """The issue's case: a finished run resumed with a safe change only (eval interval), so no
    step is left: the run's throughput stays the whole run's, not null."""
    run = tmp_path / "run"
    done = train(tiny_cfg(shards, run, max_steps=4, checkpoint={"every": 4}))
    again = train(tiny_cfg(shards, run, max_steps=4, allow_safe_changes=True, checkpoint={"every": 4},
                           measure={"log_every": 2}))
    assert [(s["start_step"], s["end_step"]) for s in again["segments"]] == [(0, 4), (4, 4)]
    for key in ("tokens_per_s", "samples_per_s", "data_wait_fraction", "mfu", "packing_efficiency"):
        assert again[key] == pytest.approx(done[key]) if done[key] is not None else again[key] is None, key
