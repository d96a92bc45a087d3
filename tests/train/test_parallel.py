"""Tensor and pipeline parallelism (labkit/train/parallel.py) against one process.

Every case runs a split model on gloo processes and one unsplit ``BertMLM`` in this process on the
same weights and the same global batch (padding, uneven masked counts per micro-batch): the loss,
the clipped norm and every gradient of the first step agree to 1e-5 (relative, per parameter), and
the parameters after 3 AdamW steps with clipping to 1e-5 (absolute: AdamW divides by the gradient's
root mean square, so an element whose gradient is rounding noise, such as the key bias that softmax
ignores, moves by up to lr per step in a direction set by noise, in both runs; at lr 5e-4 such moves
stay under 3e-6, and the weights are of order 0.02-1). The control case shards the flat [3H, H] QKV matrix by rows,
the tp-dependent layout, and must miss by far. End to end, ``train()`` at tp 2 and at pp 2 x dp 2
gives the data-parallel run's losses and resumes exactly. One spawn per world size (2, 4; 8 is the
opt-in ``slow`` test): each spawn costs 10-15 s of start-up on 2 cores.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import shutil
import socket

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from labkit.config import TrainConfig, from_dict, to_dict
from labkit.model import BertMLM, model_config
from labkit.train import build_runtime, parallel

V, SEQ, MB = 97, 16, 2  # an uneven vocabulary: tp 2 splits it 49 / 48, tp 4 25 / 25 / 25 / 22
MASKED = (1, 9, 3, 14)  # masked positions per micro-batch: a per-micro-batch mean would be wrong
STEPS, LR, CLIP = 3, 5e-4, 0.5  # noise-driven AdamW moves (module docstring) scale with LR

pytestmark = pytest.mark.torch_threads(2)


def _model_cfg(**overrides):
    return model_config("tiny", V, num_layers=4, num_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                        max_position_embeddings=64, **overrides)


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, n in enumerate(MASKED):
        ids = torch.randint(5, V, (MB, SEQ), generator=g)
        mask = torch.ones(MB, SEQ, dtype=torch.bool)
        mask[1, SEQ - 2 * i:] = False
        ids[~mask] = 0
        labels = torch.full_like(ids, -100)
        flat = torch.randperm(MB * (SEQ - 8), generator=g)[:n]
        rows, cols = flat // (SEQ - 8), flat % (SEQ - 8) + 1
        labels[rows, cols] = ids[rows, cols]
        ids[rows, cols] = 4
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def _train_cfg(**kw) -> TrainConfig:
    base = TrainConfig(data_dir="-", run_dir="-", optim={"lr": LR, "grad_clip": CLIP, "weight_decay": 0.01})
    return base.replace(**kw)


CASES_2 = {  # name: (TrainConfig.parallel fields, model overrides)
    "tp2": ({"tp": 2, "sharding": "fsdp"}, {}),
    "tp2-dense-sp": ({"tp": 2, "sharding": "fsdp", "sequence_parallel": True}, {"sparse_head": False}),
    "tp2-sparse-sp": ({"tp": 2, "sharding": "fsdp", "sequence_parallel": True}, {}),
    "tp2-geglu-untied-sp": ({"tp": 2, "sharding": "fsdp", "sequence_parallel": True},
                            {"activation": "geglu", "tie_embeddings": False}),
    "tp2-prenorm-rotary-swiglu": ({"tp": 2, "sharding": "fsdp"},
                                  {"norm_position": "pre", "position_embedding": "rotary", "activation": "swiglu"}),
    "tp2-sliding-linear": ({"tp": 2, "sharding": "fsdp"},
                           {"attention": "sliding_window", "window_size": 6, "global_every": 2}),
    "tp2-linear-attention": ({"tp": 2, "sharding": "fsdp"}, {"attention": "linear"}),
    "pp2-gpipe": ({"pp": 2, "sharding": "fsdp", "pp_schedule": "gpipe"}, {}),
    "pp2-1f1b": ({"pp": 2, "sharding": "fsdp", "pp_schedule": "1f1b"}, {"sparse_head": False}),
    "pp2-interleaved": ({"pp": 2, "sharding": "fsdp", "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}, {}),
    "control-flat-qkv-tp2": ({"tp": 2, "sharding": "fsdp"}, {}),
}
CASES_4 = {
    "tp4-dense-sp-geglu": ({"tp": 4, "sharding": "fsdp", "sequence_parallel": True},
                           {"sparse_head": False, "activation": "geglu"}),
    "tp4-sparse": ({"tp": 4, "sharding": "fsdp"}, {}),
    "dp2-tp2": ({"tp": 2, "sharding": "fsdp"}, {}),
    "pp2-dp2-replicate": ({"pp": 2, "sharding": "replicate", "pp_schedule": "1f1b"}, {}),
    "pp2-dp2-fsdp": ({"pp": 2, "sharding": "fsdp", "pp_schedule": "gpipe"}, {}),
    "pp2-tp2-sp": ({"pp": 2, "tp": 2, "sharding": "fsdp", "sequence_parallel": True}, {}),
}
CASES_8 = {"pp2-dp2-tp2": ({"pp": 2, "tp": 2, "sharding": "fsdp", "pp_schedule": "1f1b", "sequence_parallel": True}, {})}


def _flatten_qkv(model: BertMLM) -> None:
    """The control: each layer's QKV as one [3H, H] nn.Linear (the layout before FusedLinear), which
    column-wise tensor parallelism splits by rows: rank 0 then holds all of Q and half of K."""
    for layer in model.layers:
        flat = torch.nn.Linear(64, 192)
        with torch.no_grad():
            flat.weight.copy_(layer.qkv.weight.flatten(0, 1))
            flat.bias.copy_(layer.qkv.bias.flatten())
        layer.qkv = flat


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _run_case(name: str, fields: dict, overrides: dict, world: int, rank: int) -> dict:
    """One split model on this process group: 3 optimiser steps, what the main process compares."""
    mbs = _micro_batches()
    m = len(mbs) * fields.get("tp", 1) * fields.get("pp", 1) // world  # micro-batches per data-parallel replica
    cfg = _train_cfg(parallel=fields, batch={"grad_accum_steps": m})
    torch.manual_seed(0)
    model = BertMLM(_model_cfg(**overrides))
    if name.startswith("control"):
        _flatten_qkv(model)
    split = parallel.check_split(cfg, model.cfg, world, SEQ, rank)
    rt = build_runtime(cfg, model, torch.device("cpu"))  # the training builder and step
    par, optimizer = rt.parts, rt.optimizer
    mine = mbs[split.dp_rank * m:(split.dp_rank + 1) * m]
    out = {"losses": [], "norms": [], "measures": None}
    for step in range(STEPS):
        loss_sum, n_masked, _ = rt.forward_backward(mine)
        total = loss_sum.double().clone()
        tdist.all_reduce(total)
        if step == 0:
            out["grads"] = {n: _full(p.grad) for n, p in par.named_parameters() if p.grad is not None}
            out["measures"] = rt._split_measures()
        out["norms"].append(rt.clip_grad_norm(CLIP))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(total.item() / n_masked.item())
    out["params"] = {n: _full(p) for n, p in par.named_parameters()}
    out["split"] = (split.pp_rank, split.dp_rank, split.tp_rank)
    out["plain"] = [n for n, p in par.named_parameters() if not isinstance(p, DTensor)]
    out["meshes"] = {str(p.device_mesh) for p in par.parameters() if isinstance(p, DTensor)}
    out["fused"] = all(group.get("fused") for group in optimizer.param_groups)
    return out


def _reference(overrides: dict, fields: dict) -> dict:
    """One process, the whole global batch as 4 micro-batches, the loop's own step functions (the
    split's ``fields`` do not enter: every split of a model is compared with the same run)."""
    return _reference_of(json.dumps(overrides, sort_keys=True))


@functools.lru_cache(maxsize=None)
def _reference_of(overrides_json: str) -> dict:
    overrides = json.loads(overrides_json)
    torch.manual_seed(0)
    model = BertMLM(_model_cfg(**overrides))
    rt = build_runtime(_train_cfg(batch={"grad_accum_steps": len(MASKED)}), model, torch.device("cpu"))  # one process
    optimizer = rt.optimizer
    out = {"losses": [], "norms": []}
    for step in range(STEPS):
        loss_sum, n_masked, _ = rt.forward_backward(_micro_batches())
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norms"].append(rt.clip_grad_norm(CLIP))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["losses"].append(loss_sum.item() / n_masked.item())
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _merged(ranks: list[dict], case: str, key: str) -> dict[str, torch.Tensor]:
    """The named tensors of ``case`` over all ranks; the tied embedding's two copies must be equal."""
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        for n, t in r[case][key].items():
            if n in merged:
                assert torch.equal(merged[n], t), (case, key, n, "copies on two ranks differ")
            merged[n] = t
    return merged


def _worst(ranks: list[dict], case: str, ref: dict) -> dict[str, float]:
    grads, params = _merged(ranks, case, "grads"), _merged(ranks, case, "params")
    assert set(grads) == set(ref["grads"]) and set(params) == set(ref["params"]), case
    loss = max(abs(a - b) / b for a, b in zip(ranks[0][case]["losses"], ref["losses"]))
    norm = max(abs(a - b) / b for r in ranks for a, b in zip(r[case]["norms"], ref["norms"]))
    return {"loss": loss, "norm": norm, "grad": max(_rel(grads[n].reshape(g.shape), g) for n, g in ref["grads"].items()),
            "param": max(float((params[n].reshape(p.shape) - p).abs().max()) for n, p in ref["params"].items())}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, cases: dict, trains: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    tdist.init_process_group("gloo")
    try:
        results = {name: _run_case(name, *spec, world, rank) for name, spec in cases.items()}
        results["train"] = _run_trains(trains, rank)
        torch.save(results, pathlib.Path(out_dir) / f"rank{rank}.pt")
    finally:
        tdist.destroy_process_group()


def _run_trains(trains: list[str], rank: int) -> dict:
    """train() of each config (JSON); a "copy SRC DST" entry copies a run directory (rank 0), an
    "expect-error CONFIG" entry records the one-line error instead of raising, and "memory CONFIG"
    measures every rank's memory (``labkit.study.parallel.measure_rank_memory``) instead."""
    from labkit.study.parallel import measure_rank_memory
    from labkit.train import train

    errors = {}
    for i, entry in enumerate(trains):
        if entry.startswith("copy "):
            if rank == 0:
                _, src, dst = entry.split(" ")
                shutil.copytree(src, dst)
            tdist.barrier()
            continue
        if entry.startswith("memory "):
            cfg = from_dict(TrainConfig, json.loads(entry.removeprefix("memory ")))
            errors[f"memory {pathlib.Path(cfg.run_dir).name}"] = measure_rank_memory(cfg)
            continue
        expect_error = entry.startswith("expect-error ")
        cfg = from_dict(TrainConfig, json.loads(entry.removeprefix("expect-error ")))
        try:
            train(cfg)
        except ValueError as err:
            if not expect_error:
                raise
            errors[i] = str(err)
        tdist.barrier()
    return errors


def _spawn(world: int, tmp: pathlib.Path, cases: dict, trains: list[str]) -> list[dict]:
    mp.spawn(_worker, args=(world, _port(), str(tmp), cases, trains), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _check_cases(ranks: list[dict], cases: dict) -> None:
    for name, (fields, overrides) in cases.items():
        worst = _worst(ranks, name, _reference(overrides, fields))
        if name.startswith("control"):
            assert worst["grad"] > 1e-2, (name, worst)  # the tp-dependent layout: silently wrong
            continue
        assert max(worst.values()) < 1e-5, (name, worst)
        for r in ranks:  # every parameter on one mesh (plain tensors, or DTensors of one mesh): torch's
            # get_total_norm (the clip) and fused AdamW take them together
            assert r[name]["fused"], name
            assert not (r[name]["plain"] and r[name]["meshes"]) and len(r[name]["meshes"]) <= 1, (name, r[name])
        measures = ranks[0][name]["measures"]
        assert (measures["tp_comm_s"] > 0) == (fields.get("tp", 1) > 1), (name, measures)
        assert (measures["pipeline_bubble"] > 0) == (fields.get("pp", 1) > 1), (name, measures)
        assert 0.0 <= measures["pipeline_bubble"] < 1.0, (name, measures)


# -- end-to-end train() -------------------------------------------------------------------------


def _run_cfg(shards: pathlib.Path, run_dir: pathlib.Path, **kw) -> TrainConfig:
    base = TrainConfig(data_dir=str(shards), run_dir=str(run_dir), model="tiny", max_steps=10, num_threads=1,
                       device="cpu", timeout_s=120,
                       model_overrides={"hidden_dropout": 0.0, "attention_dropout": 0.0, "num_heads": 4},
                       batch={"micro_batch_size": 4, "grad_accum_steps": 2}, schedule={"warmup_steps": 2},
                       measure={"timing_warmup_steps": 1, "trackers": ()}, checkpoint={"every": 5},
                       eval={"every": 5, "sequences": 8})
    return base.replace(**kw)


def _records(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: pathlib.Path) -> list[float]:
    return [r["loss"] for r in _records(run_dir)]


def _j(cfg: TrainConfig) -> str:
    return json.dumps(to_dict(cfg))


def BUBBLE_RUNS(shards: pathlib.Path, tmp: pathlib.Path) -> dict[int, TrainConfig]:
    """pp 2 under GPipe with 1 and 4 micro-batches of one global batch (32 sequences), width 128,
    the dense head (with the sparse one the last stage is lighter: unequal stages)."""
    wide = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "num_heads": 4, "num_layers": 4, "hidden_size": 128,
            "sparse_head": False}
    return {m: _run_cfg(shards, tmp / f"bubble-m{m}", max_steps=6, model_overrides=wide,
                        parallel={"pp": 2, "sharding": "replicate", "pp_schedule": "gpipe"},
                        batch={"grad_accum_steps": m, "micro_batch_size": 32 // m}, checkpoint={"enabled": False},
                        eval={"every": 0}, measure={"timing_warmup_steps": 2}) for m in (1, 4)}


def MEMORY_RUNS(shards: pathlib.Path, tmp: pathlib.Path) -> dict[str, TrainConfig]:
    """The splits whose per-rank memory the planner is checked against (2 ranks)."""
    kw = {"model_overrides": {"hidden_dropout": 0.0, "attention_dropout": 0.0, "num_heads": 4, "num_layers": 4}}
    return {"tp2-sp": _run_cfg(shards, tmp / "tp2-sp", **kw, batch={"micro_batch_size": 4},
                               parallel={"tp": 2, "sharding": "fsdp", "sequence_parallel": True}),
            "pp2-1f1b": _run_cfg(shards, tmp / "pp2-1f1b", **kw, parallel={"pp": 2, "sharding": "replicate"},
                                 batch={"micro_batch_size": 4, "grad_accum_steps": 4}),
            "pp2-gpipe": _run_cfg(shards, tmp / "pp2-gpipe", **kw,
                                  parallel={"pp": 2, "sharding": "replicate", "pp_schedule": "gpipe"},
                                  batch={"micro_batch_size": 4, "grad_accum_steps": 4})}


def FEATURE_RUNS(shards: pathlib.Path, tmp: pathlib.Path) -> dict[str, TrainConfig]:
    """Short runs of step features at 2 ranks: fp16 under tp 2 and pp 2 (``ShardedGradScaler``), and
    dp 2 FSDP2, whose noise scale the tp 2 x dp 2 run of the 4-process test must reproduce."""
    kw = {"max_steps": 3, "checkpoint": {"enabled": False}, "eval": {"every": 0}}
    return {"tp2-fp16": _run_cfg(shards, tmp / "tp2-fp16", parallel={"tp": 2, "sharding": "fsdp"}, precision="fp16",
                                 **kw),
            "pp2-fp16": _run_cfg(shards, tmp / "pp2-fp16", parallel={"pp": 2, "sharding": "replicate"},
                                 precision="fp16", **kw),
            "dp2-fsdp": _run_cfg(shards, tmp / "dp2-fsdp", parallel={"sharding": "fsdp"}, **kw)}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """The world-2 spawn: every 2-process case, train() at tp 2 (whole, interrupted at step 5 and
    resumed, the same checkpoint resumed at pp 2 and at dp 2), and the dp 2
    data-parallel reference run of the pp 2 x dp 2 test."""
    from tiny_shards import write_tiny_shards

    tmp = tmp_path_factory.mktemp("world2")
    shards = write_tiny_shards(tmp / "shards", heldout_sequences=8)
    tp2 = _run_cfg(shards, tmp / "tp2", parallel={"tp": 2, "sharding": "fsdp"})
    part = dataclasses.replace(tp2, run_dir=str(tmp / "part"), stop_after=5)
    at_pp2 = tp2.replace(run_dir=str(tmp / "at-pp2"), allow_safe_changes=True, parallel={"tp": 1, "pp": 2})
    at_dp2 = tp2.replace(run_dir=str(tmp / "at-dp2"), allow_safe_changes=True, parallel={"tp": 1})
    trains = [_j(tp2), _j(part), f"copy {tmp / 'part'} {tmp / 'at-pp2'}", f"copy {tmp / 'part'} {tmp / 'at-dp2'}",
              _j(dataclasses.replace(part, stop_after=None)), _j(at_pp2), _j(at_dp2),
              _j(_run_cfg(shards, tmp / "dp2", parallel={"sharding": "ddp"}))]
    trains += [_j(c) for c in BUBBLE_RUNS(shards, tmp).values()]
    trains += ["memory " + _j(c) for c in MEMORY_RUNS(shards, tmp).values()]
    trains += [_j(c) for c in FEATURE_RUNS(shards, tmp).values()]
    ranks = _spawn(2, tmp, CASES_2, trains)
    one = _run_cfg(shards, tmp / "one")
    from labkit.train import train

    train(one)  # the data-parallel reference of tp 2 (dp 1): one process
    errors = {k: v for k, v in ranks[0]["train"].items() if not str(k).startswith("memory ")}
    memory = {k.removeprefix("memory "): [r["train"][k] for r in ranks] for k in ranks[0]["train"]
              if str(k).startswith("memory ")}
    return {"ranks": ranks, "tmp": tmp, "shards": shards, "errors": errors, "memory": memory}


def test_two_process_splits_match_one_process(world2):
    """TP2 (sparse and dense head, SP on and off, GEGLU/SwiGLU, untied, pre-norm, rotary, sliding window,
    linear attention) and PP2 under each schedule; the control fails."""
    _check_cases(world2["ranks"], CASES_2)


def test_train_tp2_matches_data_parallel_and_resumes_exactly(world2):
    tmp = world2["tmp"]
    ref, tp2 = _records(tmp / "one"), _records(tmp / "tp2")
    assert [r["step"] for r in tp2] == list(range(1, 11))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(tp2, ref)) < 1e-5
    assert max(abs(a["eval_loss"] - b["eval_loss"]) for a, b in zip(tp2, ref) if "eval_loss" in b) < 1e-5
    assert sum("eval_loss" in r for r in tp2) == 2
    assert all(r["tp_comm_s"] > 0 and r["pipeline_bubble"] == 0.0 and r["global_batch_size"] == 8 for r in tp2)
    # one set of measures in every mode: at dp 1 no gradient collective runs over dp (comm_exposed_s 0.0)
    assert all(r["comm_exposed_s"] == 0.0 and r["peak_mem_bytes"] > 0 for r in tp2)
    assert _losses(tmp / "part") == _losses(tmp / "tp2")  # stopped at 5, resumed: exact
    result = json.loads((tmp / "part" / "result.json").read_text())
    assert result["resumed_from_step"] == 5 and (result["tp"], result["pp"], result["dp"]) == (2, 1, 1)
    assert (tmp / "tp2" / "checkpoints" / "step-10" / ".metadata").is_file()  # torch.distributed.checkpoint


def test_a_checkpoint_loads_at_another_split_or_dp(world2):
    tmp = world2["tmp"]
    moved = _losses(tmp / "at-pp2")  # written at tp 2, continued at pp 2
    assert len(moved) == 10 and max(abs(a - b) for a, b in zip(moved, _losses(tmp / "tp2"))) < 1e-5
    assert all(r["pipeline_bubble"] > 0 for r in _records(tmp / "at-pp2")[5:])
    # and at dp 2 without tp (labkit.train.checkpoint: one format; the global batch of 8 kept by
    # accumulating 1 micro-batch instead of 2): the same losses to 1e-5
    at_dp2 = _records(tmp / "at-dp2")
    assert len(at_dp2) == 10 and all(r["global_batch_size"] == 8 for r in at_dp2)
    assert max(abs(a - b) for a, b in zip(_losses(tmp / "at-dp2"), _losses(tmp / "tp2"))) < 1e-5
    assert not world2["errors"]


def test_a_format_1_split_checkpoint_is_upgraded_to_the_state_it_had(world2, tmp_path):
    """The tp 2 run's last checkpoint rewritten as format 1 wrote a split run's (the same DCP files,
    no marker, per-rank sampler positions): ``labkit.train.upgrade.upgrade`` gives back the state.pt
    format 2 wrote (split, global sampler state, step, every rank's RNG) and the marker, and finds
    nothing to do the second time (step-5, format 2 already, is left alone)."""
    from labkit.train.checkpoint import MARKER, read_state
    from labkit.train.upgrade import upgrade

    run = tmp_path / "tp2-format1"
    shutil.copytree(world2["tmp"] / "tp2", run)
    step = run / "checkpoints" / "step-10"
    state = read_state(step)
    (step / MARKER).unlink()
    g = state["sampler"]  # format 1: per rank, the micro-batches of its epoch consumed (dp x b samples each)
    within, rest = divmod(g["samples"] - g["epoch"] * g["n_samples"], g["world_size"] * g["batch_size"])
    assert rest == 0, g
    position = {"epoch": g["epoch"], "position": within}
    torch.save({**{k: v for k, v in state.items() if k not in ("sampler", "noise", "hook")}, "format": 1,
                "ranks": [{"rng": r["rng"], "sampler": position} for r in state["ranks"]]}, step / "state.pt")
    assert [(d["step"], d["kind"]) for d in upgrade(run)] == [(10, "split")]
    new = read_state(step)
    assert (step / MARKER).is_file() and new["format"] == 2
    for key in ("sampler", "split", "step", "epoch", "tokens", "global_batch_size", "world_size", "run_id"):
        assert new[key] == state[key], key
    assert all(torch.equal(a["rng"]["torch"], b["rng"]["torch"]) for a, b in zip(new["ranks"], state["ranks"]))
    assert upgrade(run) == []


def test_planner_bubble_and_rank_memory_against_measured_runs(world2):
    """The planner's per-rank memory (``planned_rank_memory``: ``memory_plan``'s state and activations)
    within 10 % of the measured (tensors' bytes, peak of the bytes saved for backward) at tp 2 with
    sequence parallelism and at pp 2 under 1F1B and GPipe; GPipe's bubble (p - 1)/(m + p - 1) against
    the measured one at m = 1, within 0.05: the stages run one after the other, so the ratio does
    not depend on how fast this machine is, nor on how loaded. At m = 4 the stages overlap and this
    test's model is small enough for per-micro-batch overheads to count, so the test only checks that
    the bubble shrank; benchmarks/bench_parallel.py measures every m against the formula (goal 0.05)."""
    from labkit.model import model_config
    from labkit.study.parallel import planned_rank_memory
    from labkit.study.plan import pipeline_bubble

    tmp = world2["tmp"]
    for name, cfg in MEMORY_RUNS(world2["shards"], tmp).items():
        measured = max(world2["memory"][name], key=lambda r: r["total_bytes"])
        mcfg = model_config("tiny", 96, **cfg.model_overrides)
        planned = planned_rank_memory(mcfg, cfg, world=2, seq_len=32)
        assert planned["total_bytes"] == pytest.approx(measured["total_bytes"], rel=0.10), (name, planned, measured)
        assert planned["state_bytes"] == measured["state_bytes"], name  # parameters, gradients, moments: exact
    bubbles = {}
    for m, cfg in BUBBLE_RUNS(world2["shards"], tmp).items():
        per_step = sorted(r["pipeline_bubble"] for r in _records(pathlib.Path(cfg.run_dir))[2:])
        bubbles[m] = per_step[len(per_step) // 2]
    assert bubbles[1] == pytest.approx(pipeline_bubble(2, 1), abs=0.05), bubbles
    assert bubbles[4] < bubbles[1] - 0.1, bubbles


def test_split_runs_train_under_fp16(world2):
    """fp16 at tp 2 and at pp 2 (a ``ShardedGradScaler``: each rank holds part of the gradients, the
    overflow flag is all-reduced over the world): finite, no step skipped, the first loss the fp32 tp 2
    run's within autocast noise (the same batches: dp 1 both)."""
    ref = _records(world2["tmp"] / "tp2")
    for name in ("tp2-fp16", "pp2-fp16"):
        got = _records(world2["tmp"] / name)
        assert [r["step"] for r in got] == [1, 2, 3] and not any(r["skipped"] for r in got), name
        assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=2e-2), name
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in got), name


def test_four_process_splits_match_one_process_and_train(world2, tmp_path):
    """TP4, DP2 x TP2, PP2 x DP2 (replicate and FSDP2), PP2 x TP2 with SP; then train() at pp 2 x dp 2:
    the dp 2 run's losses, and an exact resume; and a tp 2 x dp 2 run's records carry the noise scale
    of the dp 2 FSDP2 run (the same batches and weights: each tp rank's squared norms summed over the
    world, a parameter both tp ranks hold whole counted once)."""
    shards = world2["shards"]
    pp2 = _run_cfg(shards, tmp_path / "pp2dp2", parallel={"pp": 2, "sharding": "fsdp"})
    part = dataclasses.replace(pp2, run_dir=str(tmp_path / "part"), stop_after=5)
    replicas = _run_cfg(shards, tmp_path / "pp2dp2-replicate", max_steps=3,
                        parallel={"pp": 2, "sharding": "replicate"}, checkpoint={"enabled": False}, eval={"every": 0})
    tp2dp2 = FEATURE_RUNS(shards, tmp_path)["dp2-fsdp"].replace(run_dir=str(tmp_path / "tp2dp2"),
                                                                parallel={"tp": 2})
    ranks = _spawn(4, tmp_path, CASES_4, [_j(pp2), _j(part), _j(dataclasses.replace(part, stop_after=None)),
                                          _j(replicas), _j(tp2dp2)])
    want, got = _records(world2["tmp"] / "dp2-fsdp"), _records(tmp_path / "tp2dp2")
    for key in ("gns_sq_small", "gns_sq_big", "b_simple", "b_simple_tokens"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-4), key
    assert all(r["b_simple"] is not None for r in got[1:])
    _check_cases(ranks, CASES_4)
    ref, got = _records(world2["tmp"] / "dp2"), _records(tmp_path / "pp2dp2")
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(got, ref)) < 1e-5
    assert all(r["global_batch_size"] == 16 and 0 < r["pipeline_bubble"] < 1 for r in got)
    # the dp collectives of a split run are timed as data parallelism's are: FSDP2's reduce-scatters,
    # the replicas' all-reduce (comm_bytes: the fp32 gradients of the stage's parameters, or more)
    for records in (got, _records(tmp_path / "pp2dp2-replicate")):
        assert all(0 < r["comm_exposed_s"] <= r["step_time_s"] and r["comm_bytes"] > 0 for r in records)
    result = json.loads((tmp_path / "pp2dp2" / "result.json").read_text())
    assert result["comm_exposed_s"] > 0 and 0 < result["comm_exposed_fraction"] < 1
    assert _losses(tmp_path / "part") == _losses(tmp_path / "pp2dp2")


@pytest.mark.slow  # inductor compiles each stage on each rank: minutes on 2 shared cores
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")  # raised inside dynamo
def test_compiled_split_runs_train_to_the_eager_losses(tmp_path):
    """``compile`` at tp 2 and at pp 2 (each stage compiled after tensor parallelism, before the
    dp strategy): the eager run's losses to 1e-5 over 3 steps, without dropout."""
    from tiny_shards import write_tiny_shards

    shards = write_tiny_shards(tmp_path / "shards")
    kw = {"max_steps": 3, "checkpoint": {"enabled": False}, "eval": {"every": 0}, "timeout_s": 1800}
    runs = {f"{name}-{c}": _run_cfg(shards, tmp_path / f"{name}-{c}", compile=c,
                                    parallel={**split, "sharding": "replicate"}, **kw)
            for name, split in (("tp2", {"tp": 2}), ("pp2", {"pp": 2})) for c in (False, True)}
    _spawn(2, tmp_path, {}, [_j(c) for c in runs.values()])
    for name in ("tp2", "pp2"):
        assert _losses(tmp_path / f"{name}-True") == pytest.approx(_losses(tmp_path / f"{name}-False"), abs=1e-5)


@pytest.mark.slow
def test_eight_processes_pp2_dp2_tp2(tmp_path):
    ranks = _spawn(8, tmp_path, CASES_8, [])
    _check_cases(ranks, CASES_8)


# -- refusals: one line each, naming the field ----------------------------------------------------


@pytest.mark.parametrize("fields, field, words", [
    ({"parallel": {"tp": 2}}, "parallel.sharding", "'ddp' does not compose"),
    ({"parallel": {"pp": 2, "sharding": "zero1"}, "batch": {"grad_accum_steps": 2}}, "parallel.sharding",
     "'zero1' does not compose"),
    ({"parallel": {"sharding": "replicate"}}, "parallel.sharding", "with tp = pp = 1 use 'ddp'"),
    ({"parallel": {"sequence_parallel": True}}, "parallel.sequence_parallel", "needs tp > 1"),
    ({"parallel": {"pp": 2, "sharding": "fsdp"}}, "batch.grad_accum_steps",
     "1f1b needs at least as many micro-batches as stages"),
    ({"parallel": {"pp": 2, "sharding": "fsdp", "pp_schedule": "interleaved_1f1b"}, "batch": {"grad_accum_steps": 2}},
     "parallel.pp_virtual_stages", "interleaved_1f1b runs 2 or more"),
    ({"parallel": {"pp": 2, "sharding": "fsdp", "pp_schedule": "warp"}}, "parallel.pp_schedule", "allowed values"),
    ({"parallel": {"tp": 2, "sharding": "fsdp", "grad_compression": "powersgd"}}, "parallel.grad_compression",
     "'powersgd' is torch's DDP comm hook .* not 'fsdp'"),
    ({"parallel": {"tp": 0}}, "parallel.tp", "must be >= 1"),
])
def test_config_refusals(fields, field, words):
    with pytest.raises(ValueError, match=f"^{field}: .*{words}") as info:
        TrainConfig(data_dir="-", run_dir="-", **fields)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fields, overrides, world, field, words", [
    ({"tp": 3}, {}, 3, "tp", "num_heads 4 is not divisible by tp 3"),
    ({"tp": 2}, {"intermediate_size": 255}, 2, "tp", r"the FFN width 255 \(intermediate_size\) is not divisible by tp 2"),
    ({"tp": 2, "sequence_parallel": True}, {}, 2, "sequence_parallel", "sequence length 15 is not divisible"),
    ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 4}, {}, 2, "pp",
     "4 layers cannot fill pp x pp_virtual_stages = 2 x 4"),
    ({"tp": 2}, {"attention": "linformer", "linformer_k": 8}, 2, "tp", "attention 'linformer' is not checked"),
    ({"tp": 2}, {}, 3, "tp", "world size 3 is not divisible by tp x pp = 2 x 1"),
])
def test_split_refusals(fields, overrides, world, field, words):
    cfg = TrainConfig(data_dir="-", run_dir="-", parallel=fields | {"sharding": "fsdp"},
                      batch={"grad_accum_steps": 4})
    with pytest.raises(ValueError, match=f"^parallel.{field}: {words}") as info:
        parallel.check_split(cfg, _model_cfg(**overrides), world, 15 if fields.get("sequence_parallel") else 16)
    assert "\n" not in str(info.value)
