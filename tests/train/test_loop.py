"""Tests of labkit/train/loop.py: the LR schedule, a single-process run on a tiny shard set,
checkpoints loadable with weights_only=True, and exact resume."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest
import torch

from labkit import train as train_mod
from labkit.train import loop, parallel, runtime
from labkit.config import TrainConfig, from_dict
from labkit.model import BertMLM, model_config
from labkit.train import lr_at, train
from labkit.train.checkpoint import load_weights
from tiny_shards import write_tiny_shards

SEQ_LEN = 32
VOCAB = 96


@pytest.fixture
def shards(tmp_path: pathlib.Path) -> pathlib.Path:
    return write_tiny_shards(tmp_path / "shards")


def tiny_cfg(shards: pathlib.Path, run_dir: pathlib.Path, **kw) -> TrainConfig:
    """The tests' tiny run with ``kw`` (``TrainConfig.replace``: a section's dict changes only its keys)."""
    base = TrainConfig(data_dir=str(shards), run_dir=str(run_dir), model="tiny", max_steps=10, num_threads=1,
                       device="cpu", seed=0, batch={"micro_batch_size": 4, "grad_accum_steps": 2},
                       optim={"lr": 3e-3}, schedule={"warmup_steps": 2}, measure={"timing_warmup_steps": 1})
    return base.replace(**kw)


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- schedule ---------------------------------------------------------------------------------


def _sched_cfg(schedule: str) -> TrainConfig:
    return TrainConfig(data_dir="d", run_dir="r", max_steps=12, optim={"lr": 1.0},
                       schedule={"min_lr_ratio": 0.1, "warmup_steps": 2, "kind": schedule, "wsd_decay_fraction": 0.25})


def test_lr_linear_exact():
    cfg = _sched_cfg("linear")
    got = [lr_at(s, cfg) for s in range(12)]  # the steps a 12-step run takes: 0..11
    # warm-up 0.5, 1.0; then 1 - 0.9 * (s - 2) / 9, reaching min_lr at the last step (11)
    want = [0.5, 1.0] + [1.0 - 0.9 * (s - 2) / 9 for s in range(2, 12)]
    assert got == pytest.approx(want, abs=1e-15)
    assert got[11] == pytest.approx(0.1)


def test_lr_cosine_exact():
    cfg = _sched_cfg("cosine")
    assert lr_at(0, cfg) == 0.5
    assert lr_at(2, cfg) == 1.0
    assert lr_at(11, cfg) == pytest.approx(0.1)  # the last step the run takes
    assert lr_at(4, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 9)))


def test_lr_wsd_exact():
    cfg = _sched_cfg("wsd")  # decay over the last 3 of 12 steps: steps 9, 10, 11
    got = [lr_at(s, cfg) for s in range(12)]
    assert got[:9] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert got[9:] == pytest.approx([1.0, 0.55, 0.1])


def test_optimizer_decays_matrices_only():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    opt = train_mod.build_optimizer(model, _sched_cfg("linear"))
    decay, no_decay = opt.param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 3])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
    bert = BertMLM(model_config("tiny", 64, activation="geglu"))  # fused biases [3, H] and [2, F] are 2-D
    decay, no_decay = train_mod.build_optimizer(bert, _sched_cfg("linear")).param_groups
    names = {id(p): n for n, p in bert.named_parameters()}
    assert sorted(names[id(p)] for p in no_decay["params"] if p.ndim == 2) == [
        "layers.0.ffn_in.bias", "layers.0.qkv.bias", "layers.1.ffn_in.bias", "layers.1.qkv.bias"]
    assert not [names[id(p)] for p in decay["params"] if "bias" in names[id(p)] or p.ndim < 2]


# -- a whole run ------------------------------------------------------------------------------


def test_train_single_process(shards, tmp_path):
    run_dir = tmp_path / "run"
    seen = []
    cfg = tiny_cfg(shards, run_dir, max_steps=12, checkpoint={"every": 4, "keep": 2})
    result = train(cfg, sink=seen.append)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert seen == records
    fields = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "samples_per_s", "step_time_s",
              "data_wait_s", "data_wait_fraction", "mfu", "peak_mem_bytes", "world_size", "global_batch_size"}
    assert fields <= set(records[0])
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-3:]) < losses[0] - 0.3, losses
    assert all(r["mfu"] is None and r["world_size"] == 1 and r["global_batch_size"] == 8 for r in records)
    assert [r["lr"] for r in records] == pytest.approx([lr_at(s, cfg) for s in range(12)])
    # real tokens: the cumulative count is the sum of per-step counts, each at most 8 x 32
    assert records[-1]["tokens"] == sum(r["step_tokens"] for r in records)
    assert all(r["comm_exposed_s"] == 0.0 for r in records)  # one process: no gradient collective
    assert all(0 < r["step_tokens"] <= 8 * SEQ_LEN for r in records)
    on_disk = json.loads((run_dir / "result.json").read_text())
    assert on_disk["final_loss"] == losses[-1] and on_disk["initial_loss"] == losses[0]
    assert on_disk["steps"] == 12 and on_disk["world_size"] == 1 and result["params"] == on_disk["params"]
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved.pop("provenance")["world_size"] == 1 and saved.pop("run_id") == result["run_id"]
    assert from_dict(TrainConfig, saved) == cfg
    assert train_mod.checkpoint_steps(run_dir) == [8, 12]  # keep_checkpoints=2 pruned step-4
    state = torch.load(run_dir / "checkpoints" / "step-12" / "state.pt", weights_only=True)
    assert state["step"] == 12 and len(state["ranks"]) == 1 and state["run_id"] == result["run_id"]
    weights = load_weights(run_dir / "checkpoints" / "step-12")  # torch.distributed.checkpoint
    assert all(torch.isfinite(w).all() for w in weights.values()) and len(weights) > 5


def test_resume_reproduces_uninterrupted_run(shards, tmp_path):
    """fp32, CPU, dropout on: a run interrupted after step 3 (mid-epoch) and step 6 (in the next
    epoch) and resumed each time gives exactly the uninterrupted run's losses."""
    full = tiny_cfg(shards, tmp_path / "full", max_steps=8, batch={"micro_batch_size": 8})  # 4 steps per epoch
    train(full)
    part = dataclasses.replace(full, run_dir=str(tmp_path / "part"), stop_after=3)
    train(part)
    assert [r["step"] for r in read_metrics(tmp_path / "part")] == [1, 2, 3]
    assert train(dataclasses.replace(part, stop_after=6))["resumed_from_step"] == 3
    result = train(dataclasses.replace(part, stop_after=None))
    assert result["resumed_from_step"] == 6 and result["steps"] == 8
    assert [r["epoch"] for r in read_metrics(tmp_path / "part")] == [0, 0, 0, 0, 1, 1, 1, 1]
    want = [(r["step"], r["loss"], r["grad_norm"], r["tokens"]) for r in read_metrics(tmp_path / "full")]
    got = [(r["step"], r["loss"], r["grad_norm"], r["tokens"]) for r in read_metrics(tmp_path / "part")]
    assert got == want
    assert result["initial_loss"] == want[0][1] and result["final_loss"] == want[-1][1]


def test_nonfinite_loss_raises_or_skips(shards, tmp_path, monkeypatch):
    real = runtime.Runtime.forward_backward

    def poisoned(*args, **kwargs):
        loss_sum, n_masked, n_tokens = real(*args, **kwargs)
        return loss_sum * float("nan"), n_masked, n_tokens

    monkeypatch.setattr(runtime.Runtime, "forward_backward", poisoned)  # the step train runs
    with pytest.raises(FloatingPointError, match="step 1: non-finite loss"):
        train(tiny_cfg(shards, tmp_path / "raise", max_steps=2))
    run = tmp_path / "skip"
    result = train(tiny_cfg(shards, run, max_steps=2, on_nonfinite="skip"))
    assert result["skipped_steps"] == 2
    assert [r["skipped"] for r in read_metrics(run)] == [True, True]


def test_checkpoints_false_writes_metrics_and_result_only(shards, tmp_path):
    run = tmp_path / "sweep"
    result = train(tiny_cfg(shards, run, max_steps=3, checkpoint={"every": 1, "enabled": False}))
    assert result["steps"] == 3 and len(read_metrics(run)) == 3 and (run / "result.json").is_file()
    assert train_mod.checkpoint_steps(run) == [] and not (run / "checkpoints").exists()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_train_autocast_precisions_run(shards, tmp_path, precision):
    """bf16/fp16 autocast on CPU: the run completes and the loss is within bf16 noise of fp32's
    at step 1 (same init, data and masks; the loss sum is computed in fp32)."""
    ref = train(tiny_cfg(shards, tmp_path / "fp32", max_steps=1))
    got = train(tiny_cfg(shards, tmp_path / precision, max_steps=3, precision=precision))
    assert got["steps"] == 3 and math.isfinite(got["final_loss"])
    assert got["initial_loss"] == pytest.approx(ref["initial_loss"], rel=2e-2)


def test_resume_with_loader_workers(shards, tmp_path):
    """With a worker process the sampler runs ahead of the trainer; the checkpoint stores the
    batches consumed, so a resumed run with workers still matches a worker-less full run."""
    full = tiny_cfg(shards, tmp_path / "full", max_steps=6, batch={"micro_batch_size": 8})
    train(full)
    part = full.replace(run_dir=str(tmp_path / "part"), stop_after=3, data={"num_workers": 1})
    train(part)
    train(dataclasses.replace(part, stop_after=None))
    want = [(r["step"], r["loss"], r["tokens"]) for r in read_metrics(tmp_path / "full")]
    assert [(r["step"], r["loss"], r["tokens"]) for r in read_metrics(tmp_path / "part")] == want


def test_lr_applied_once_per_optimizer_step_across_accumulation_and_resume(shards, tmp_path, monkeypatch):
    """The lr the optimiser actually steps with (read inside ``optimizer.step``) is lr_at(step):
    one step per 3 accumulated micro-batches, and the same sequence after a stop and resume."""
    seen: list[tuple[str, list[float]]] = []
    real_build = train_mod.build_optimizer

    def recording_build(model, cfg, **kw):
        opt = real_build(model, cfg, **kw)
        real_step = opt.step

        def step(*args, **kwargs):
            seen.append((pathlib.Path(cfg.run_dir).name, [g["lr"] for g in opt.param_groups]))
            return real_step(*args, **kwargs)

        opt.step = step
        return opt

    monkeypatch.setattr(parallel, "build_optimizer", recording_build)  # labkit.train.parallel.build builds it
    full = tiny_cfg(shards, tmp_path / "full", max_steps=7, batch={"grad_accum_steps": 3},
                    schedule={"warmup_steps": 2, "kind": "cosine"})
    train(full)
    part = dataclasses.replace(full, run_dir=str(tmp_path / "part"), stop_after=3)
    train(part)
    train(dataclasses.replace(part, stop_after=None))
    want = [[lr_at(s, full)] * 2 for s in range(7)]  # both param groups
    assert [lrs for run, lrs in seen if run == "full"] == want
    part_lrs = [lrs for run, lrs in seen if run == "part"]
    # the resume first creates AdamW's state with one lr-0 step (torch.distributed.checkpoint.state_dict
    # does, before the saved state is loaded into it), then 4 steps
    assert part_lrs == want[:3] + [[0.0, 0.0]] + want[3:]
    assert want[0][0] == pytest.approx(full.optim.lr / 2) and want[6][0] < want[2][0]
    assert [r["lr"] for r in read_metrics(tmp_path / "part")] == [w[0] for w in want]
    # the run's last step (step 7, lr_at(6)) is the one that reaches min_lr
    assert read_metrics(tmp_path / "full")[-1]["lr"] == pytest.approx(full.optim.lr * full.schedule.min_lr_ratio)
    state = torch.load(tmp_path / "part" / "checkpoints" / "step-3" / "state.pt", weights_only=True)
    assert state["lr"] == lr_at(3, full)


def test_activation_checkpointing_same_losses(shards, tmp_path):
    """Recomputing each layer in backward (dropout on; torch's checkpoint replays the RNG) gives
    the same losses and grad norms as keeping the activations."""
    ref = train(tiny_cfg(shards, tmp_path / "keep", max_steps=3))
    got = train(tiny_cfg(shards, tmp_path / "recompute", max_steps=3, activation_checkpointing=True))
    assert got["activation_checkpointing"] is True and ref["activation_checkpointing"] is False
    assert got["model_config"]["activation_checkpointing"] is True
    want = [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "keep")]
    have = [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "recompute")]
    assert np.allclose(have, want, rtol=1e-6, atol=0), (have, want)


@pytest.mark.gpu
def test_train_bf16_on_cuda(shards, tmp_path):
    """On a GPU: a bf16 run records CUDA peak memory, and MFU exactly when the device's peak is
    in measure.PEAK_FLOPS."""
    from labkit import measure

    result = train(tiny_cfg(shards, tmp_path / "cuda", device="cuda", precision="bf16", max_steps=3))
    records = read_metrics(tmp_path / "cuda")
    assert result["device"].startswith("cuda") and math.isfinite(result["final_loss"])
    assert all(r["peak_mem_bytes"] > 0 for r in records)
    kind = measure.device_kind(torch.cuda.get_device_name())
    assert all((r["mfu"] is None) == (kind is None) for r in records)


def _to_format_1(path: pathlib.Path, cfg: TrainConfig) -> None:
    """Rewrite checkpoint directory ``path`` as labkit wrote it before torch.distributed.checkpoint
    for data-parallel runs (format 1): model.safetensors + state.pt with the whole optimiser state
    (by parameter index) and per-rank sampler positions, no run id, no marker."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_model
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    from labkit.train.checkpoint import read_state
    from labkit.train.run_config import model_config_of

    state = read_state(path)
    model = BertMLM(model_config_of(cfg, VOCAB))
    model.load_state_dict(load_weights(path))
    optimizer = train_mod.build_optimizer(model, cfg)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    sd = {"optim": get_optimizer_state_dict(model, optimizer, options=flat)}
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    set_optimizer_state_dict(model, optimizer, sd["optim"], options=flat)
    for f in path.iterdir():
        f.unlink()
    save_model(model, str(path / "model.safetensors"))
    sampler = state["sampler"]  # one rank: its position in the epoch is the epoch's micro-batches consumed
    position = (sampler["samples"] - sampler["epoch"] * sampler["n_samples"]) // sampler["batch_size"]
    torch.save({"format": 1, "step": state["step"], "epoch": state["epoch"], "tokens": state["tokens"],
                "lr": state["lr"], "optimizer": optimizer.state_dict(), "scaler": state["scaler"], "world_size": 1,
                "sharding": "none", "ranks": [{"rng": state["ranks"][0]["rng"],
                                               "sampler": {"epoch": sampler["epoch"], "position": position}}]},
               path / "state.pt")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_format_1_checkpoint_is_refused_then_upgraded_once_and_resumes_exactly(shards, tmp_path, capsys):
    """A checkpoint in the format before torch.distributed.checkpoint (model.safetensors + whole
    optimiser in state.pt) is refused in one line naming the upgrade; ``labkit checkpoint upgrade``
    rewrites it (once: a second call finds nothing), and the run resumes to exactly the
    uninterrupted run's losses."""
    from labkit.cli import main
    from labkit.train.checkpoint import MARKER

    full = tiny_cfg(shards, tmp_path / "full", max_steps=6)
    train(full)
    part = full.replace(run_dir=str(tmp_path / "part"), stop_after=3)
    train(part)
    step3 = tmp_path / "part" / "checkpoints" / "step-3"
    _to_format_1(step3, part)
    with pytest.raises(ValueError, match=r"^resume: .*step-3 is a format-1 checkpoint .*labkit checkpoint upgrade ") \
            as err:
        train(part.replace(stop_after=None))
    assert "\n" not in str(err.value)
    assert main(["checkpoint", "upgrade", str(tmp_path / "part")]) == 0
    assert capsys.readouterr().out.startswith(f"upgraded {step3} (data parallel run, step 3) to format 2")
    assert (step3 / MARKER).is_file() and not (step3 / "model.safetensors").exists()
    assert main(["checkpoint", "upgrade", str(tmp_path / "part")]) == 0
    assert "nothing to upgrade" in capsys.readouterr().out
    assert train(part.replace(stop_after=None))["resumed_from_step"] == 3
    want = [(r["step"], r["loss"], r["grad_norm"], r["tokens"]) for r in read_metrics(tmp_path / "full")]
    assert [(r["step"], r["loss"], r["grad_norm"], r["tokens"]) for r in read_metrics(tmp_path / "part")] == want


def test_mismatched_shards_are_refused_before_training(shards, tmp_path):
    from labkit.data.shards import ShardError, read_index

    index = read_index(str(shards))
    with pytest.raises(ShardError, match=r"index\.json.*seq_len: run expects 64, shards have 32"):
        train(tiny_cfg(shards, tmp_path / "a", data={"seq_len": 2 * index["seq_len"]}))
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"not": "the tokenizer the shards were built with"}')
    with pytest.raises(ShardError, match="tokenizer_sha256: run expects"):
        train(tiny_cfg(shards, tmp_path / "b", data={"tokenizer_path": str(tok)}))
    with pytest.raises(FileNotFoundError, match="tokenizer_path"):
        train(tiny_cfg(shards, tmp_path / "c", data={"tokenizer_path": str(tmp_path / "missing.json")}))
    for run in ("a", "b", "c"):
        assert not (tmp_path / run / "metrics.jsonl").exists() or not (tmp_path / run / "metrics.jsonl").read_text()


@pytest.mark.slow  # inductor compiles forward and backward: 1-3 min on 2 shared cores
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")  # raised inside dynamo
@pytest.mark.parametrize("sparse_head", [True, False])
def test_compiled_model_trains_to_the_same_losses(shards, tmp_path, sparse_head):
    """TrainConfig.compile: torch.compile (inductor) of the forward, in place; over 10 AdamW steps
    (the loss after each: every update compounds) the same losses as eager to 1e-5 without
    dropout (inductor draws dropout masks from its own generator), with either head, and
    checkpoints keep the eager parameter names."""
    kw = dict(max_steps=10, grad_accum_steps=1,
              model_overrides={"hidden_dropout": 0.0, "attention_dropout": 0.0, "sparse_head": sparse_head})
    eager = train(tiny_cfg(shards, tmp_path / "eager", **kw))
    compiled = train(tiny_cfg(shards, tmp_path / "compiled", compile=True, **kw))
    losses = [r["loss"] for r in read_metrics(tmp_path / "eager")]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.1  # it trained: the comparison means something
    assert [r["loss"] for r in read_metrics(tmp_path / "compiled")] == pytest.approx(losses, rel=1e-5)
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], rel=1e-5)
    names = set(load_weights(tmp_path / "compiled" / "checkpoints" / "step-10"))
    assert names == set(load_weights(tmp_path / "eager" / "checkpoints" / "step-10"))
    assert names == set(BertMLM(model_config("tiny", VOCAB)).state_dict())


def _cfg() -> TrainConfig:
    return TrainConfig(data_dir="-", run_dir="-")


def test_host_facts_leave_the_step_unchanged(shards):
    """``to_device``'s host facts (no mask when nothing is padded, the sparse head's gather size)
    give the same loss and gradients as the model finding them itself, for a padded and an
    unpadded batch; a larger-than-needed gather size changes nothing either."""
    from labkit.model import BertMLM, model_config

    torch.manual_seed(0)
    ids = torch.randint(5, VOCAB, (3, SEQ_LEN))
    labels = torch.where(torch.rand(3, SEQ_LEN) < 0.2, ids, -100)
    for padded in (False, True):
        mask = torch.ones(3, SEQ_LEN, dtype=torch.bool)
        if padded:
            mask[1, 20:] = False
        batch = {"input_ids": ids, "labels": torch.where(mask, labels, -100), "attention_mask": mask}
        moved = loop.to_device(batch, torch.device("cpu"))
        assert moved["all_real"] is (not padded)
        assert moved["max_masked"] == int((batch["labels"] != -100).sum(1).max())
        runs = []
        for facts in ({}, {"all_real": moved["all_real"], "max_masked": moved["max_masked"]},
                      {"max_masked": SEQ_LEN}):
            torch.manual_seed(1)
            model = BertMLM(model_config("tiny", VOCAB, hidden_dropout=0.0, attention_dropout=0.0))
            rt = train_mod.build_runtime(_cfg(), model, torch.device("cpu"))
            loss, n, _ = rt.forward_backward([{**batch, **facts}])
            runs.append((loss, {k: p.grad.clone() for k, p in model.named_parameters()}))
        for loss, grads in runs[1:]:
            assert torch.allclose(loss, runs[0][0], rtol=1e-6)
            assert all(torch.allclose(g, runs[0][1][k], rtol=1e-5, atol=1e-7) for k, g in grads.items())


@pytest.mark.gpu
def test_step_makes_no_host_sync_on_cuda(shards):
    """With ``to_device``'s host facts the dense head's forward and backward never wait for the
    device (``torch.cuda.set_sync_debug_mode("error")`` raises on a synchronising call). The
    sparse head still syncs in its boolean gathers (``x[valid]``, ``labels[keep]``: their size
    is data-dependent), not for its count any more."""
    from labkit.model import BertMLM, model_config

    dev = torch.device("cuda")
    ids = torch.randint(5, VOCAB, (4, SEQ_LEN))
    batch = {"input_ids": ids, "labels": torch.where(torch.rand(4, SEQ_LEN) < 0.15, ids, -100),
             "attention_mask": torch.ones(4, SEQ_LEN, dtype=torch.bool)}
    model = BertMLM(model_config("tiny", VOCAB, sparse_head=False)).to(dev)
    moved = loop.to_device(batch, dev)
    torch.cuda.synchronize()
    rt = train_mod.build_runtime(_cfg(), model, dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        rt.forward_backward([moved])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_peak_memory_windows_keep_evaluation_and_checkpoints_apart(tmp_path, monkeypatch):
    """A fake CUDA allocator: each training step peaks 300 B above the 100 B at rest, each
    evaluation 5,000 B, each checkpoint 7,000 B. A record's peak_mem_bytes is its steps' own;
    evaluation and checkpoint peaks land in their own fields (before: one window took all)."""
    shards = write_tiny_shards(tmp_path / "shards", heldout_sequences=4)

    class FakeAllocator:
        peak = 100

        def reset(self, device):
            self.peak = 100

        def read(self, device):
            return self.peak

        def around(self, fn, extra):
            def wrapped(*a, **kw):
                self.peak = max(self.peak, 100 + extra)
                return fn(*a, **kw)
            return wrapped

    mem = FakeAllocator()
    monkeypatch.setattr(loop.measure, "reset_peak_memory", mem.reset)
    monkeypatch.setattr(loop.measure, "peak_memory_bytes", mem.read)
    monkeypatch.setattr(runtime.Runtime, "forward_backward", mem.around(runtime.Runtime.forward_backward, 300))
    from labkit.train import evaluation

    monkeypatch.setattr(evaluation, "evaluate", mem.around(evaluation.evaluate, 5000))
    monkeypatch.setattr(loop.Checkpointer, "save", mem.around(loop.Checkpointer.save, 7000))
    cfg = tiny_cfg(shards, tmp_path / "run", max_steps=4, eval={"every": 2, "sequences": 4}, checkpoint={"every": 2})
    result = train(cfg)
    records = read_metrics(tmp_path / "run")
    assert [r["peak_mem_bytes"] for r in records] == [400] * 4
    assert [r.get("eval_peak_mem_bytes") for r in records] == [None, 5100, None, 5100]
    assert [r.get("checkpoint_peak_mem_bytes") for r in records] == [None, None, 7100, None]  # step-2's, logged next
    assert (result["peak_mem_bytes"], result["eval_peak_mem_bytes"], result["checkpoint_peak_mem_bytes"]) == \
        (400, 5100, 7100)
