"""What each rank of a sharded run really holds, against the planner (labkit/study/memory.py), and
the sharded paths that must not hang or crash (labkit/train/dist.py, labkit/train/evaluation.py).

One spawn of 2 gloo ranks: ddp, zero1 and fsdp (fp32, and bf16 under the mixed-precision
policy) each take two real optimiser steps through labkit's builder and step
(``build_runtime``, ``Runtime.forward_backward``); each rank then counts the storages of its parameters, gradients (DDP's
buckets), optimiser moments and steps. Then one fsdp train() evaluates a held-out split of a
single sequence (fewer sequences than ranks) and must finish.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from labkit.model import BertMLM, model_config
from labkit.study.counting import parameter_table
from labkit.study.memory import labkit_model, state_bytes
from labkit.train import build_runtime, dist
from test_dist import _dist_env, _free_port

VOCAB, SEQ = 96, 16
CASES = {"ddp": ("ddp", "fp32"), "zero1": ("zero1", "fp32"), "fsdp": ("fsdp", "fp32"), "fsdp-bf16": ("fsdp", "bf16")}


def _model() -> BertMLM:
    torch.manual_seed(0)
    return BertMLM(model_config("tiny", VOCAB, num_layers=3))  # 3 layers: uneven dim-0 shards too


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard)."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors if t is not None]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())


def _held(parts, opt) -> dict[str, int]:
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    states = list(inner.state.values())
    params = list(parts.parameters())
    model = parts.stages[0]
    out = {"params": _storage_bytes(params), "grads": _storage_bytes(p.grad for p in params),
           "optimizer": _storage_bytes(v for s in states for k, v in s.items() if k != "step"),
           "optimizer_steps": _storage_bytes(s["step"] for s in states)}
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        sizes = model._get_ddp_logging_data()["bucket_sizes"]
        out["ddp_bucket_bytes"] = sum(int(x) for x in str(sizes).split(",") if x.strip())
        out["gradient_as_bucket_view"] = model.gradient_as_bucket_view
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, train_cfg: str) -> None:
    from labkit.config import TrainConfig, from_dict
    from labkit.train import train

    torch.set_num_threads(1)
    os.environ.update(_dist_env(rank, world, port))
    assert dist.init_distributed("gloo", 60.0, torch.device("cpu"))
    try:
        make_batch = labkit_model(model_config("tiny", VOCAB), SEQ)[1]
        held = {}
        for name, (sharding, precision) in CASES.items():
            cfg = TrainConfig(data_dir="-", run_dir="-", precision=precision, parallel={"sharding": sharding},
                              optim={"lr": 1e-3})
            rt = build_runtime(cfg, _model(), torch.device("cpu"))
            opt = rt.optimizer
            for _ in range(2):  # the second step runs on DDP's rebuilt buckets
                opt.zero_grad(set_to_none=True)
                batch = make_batch(2)
                batch["attention_mask"] = torch.ones_like(batch["input_ids"], dtype=torch.bool)  # as the loader gives
                rt.forward_backward([batch])
                opt.step()
            held[name] = _held(rt.parts, opt)
        train(from_dict(TrainConfig, json.loads(train_cfg)))  # fsdp, 1 held-out sequence for 2 ranks
        pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(held))
    finally:
        dist.teardown()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> pathlib.Path:
    from labkit.config import TrainConfig, to_dict
    from tiny_shards import write_tiny_shards

    root = tmp_path_factory.mktemp("sharded_state")
    shards = write_tiny_shards(root / "shards", n_sequences=32, heldout_sequences=1)
    cfg = TrainConfig(data_dir=str(shards), run_dir=str(root / "fsdp-eval"), model="tiny", max_steps=2, num_threads=1,
                      device="cpu", timeout_s=30, batch={"micro_batch_size": 4}, schedule={"warmup_steps": 1},
                      parallel={"sharding": "fsdp"}, eval={"every": 1, "sequences": 8}, checkpoint={"enabled": False})
    mp.spawn(_worker, args=(2, _free_port(), str(root), json.dumps(to_dict(cfg))), nprocs=2, join=True)
    return root


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_the_planned_state(two_ranks, name):
    """Per rank, counted from its tensors: parameters, gradients (and DDP's buckets), AdamW's
    moments and steps equal ``state_bytes`` for that rank, term by term."""
    params = parameter_table(_model())
    sharding = CASES[name][0]
    for rank in range(2):
        held = json.loads((two_ranks / f"rank{rank}.json").read_text())[name]
        plan = state_bytes(params, sharding=sharding, dp=2, rank=rank)
        if sharding != "fsdp":  # the gradients are DDP's buckets, no second copy
            assert held["gradient_as_bucket_view"] and held["ddp_bucket_bytes"] == held["grads"]
        assert {k: held[k] for k in ("params", "grads", "optimizer", "optimizer_steps")} == \
            {k: plan[k] for k in ("params", "grads", "optimizer", "optimizer_steps")}, (name, rank)
    if sharding == "zero1":  # the two ranks step different partitions
        per_rank = [json.loads((two_ranks / f"rank{r}.json").read_text())[name]["optimizer"] for r in range(2)]
        assert per_rank[0] != per_rank[1] and sum(per_rank) == 8 * sum(p["numel"] for p in params)


def test_fsdp_evaluates_one_heldout_sequence_on_two_ranks(two_ranks):
    records = [json.loads(line) for line in (two_ranks / "fsdp-eval" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval_loss") is not None]
    assert [r["step"] for r in evals] == [1, 2] and all(r["eval_sequences"] == 1 for r in evals)
    assert all(r["eval_masked"] > 0 and r["eval_loss"] > 0 for r in evals)


def test_zero1_resume_keeps_fused_steps_on_the_parameters_device():
    """CPU stand-in for CUDA: fake CUDA tensors (FakeTensorMode builds them without a GPU).
    ZeRO-1's load_state_dict moves AdamW's 0-dim ``step`` to the CPU (pytorch/pytorch#124133);
    ``dist.load_optimizer_state_dict`` puts it back beside its parameter for fused AdamW, which
    refuses a step on another device; the default AdamW keeps it on the CPU, as torch does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    os.environ.update(_dist_env(0, 1, _free_port()))
    assert dist.init_distributed("gloo", 30.0, torch.device("cpu"))
    try:
        for fused in (True, False):
            with FakeTensorMode(allow_non_fake_inputs=True):
                params = [torch.nn.Parameter(torch.empty(4, 3, device="cuda")),
                          torch.nn.Parameter(torch.empty(5, device="cuda"))]
                opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3, fused=fused)
                state = {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(p.shape),
                                       "exp_avg_sq": torch.zeros(p.shape)} for i, p in enumerate(params)},
                         "param_groups": [dict(opt.param_groups[0], params=[0, 1])]}
                dist.load_optimizer_state_dict(params[0], opt, state)
                steps = {opt.optim.state[p]["step"].device.type for p in params}
                moments = {opt.optim.state[p]["exp_avg"].device.type for p in params}
            assert steps == ({"cuda"} if fused else {"cpu"}) and moments == {"cuda"}, fused
    finally:
        dist.teardown()
