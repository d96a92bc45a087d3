"""Tests of labkit/dist.py and of the distributed step in labkit/train.py.

The key test: 2 ranks x 2 accumulation steps (gloo, CPU), whose micro-batches hold different
numbers of masked tokens, give the gradients of one process on the whole global batch.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket

import pytest
import torch
import torch.multiprocessing as mp

from labkit import dist
from labkit.model import BertMLM, model_config
from labkit.train import forward_backward

VOCAB, SEQ, MB = 64, 16, 2
MASKED_PER_MICRO_BATCH = (1, 9, 3, 14)  # uneven on purpose: a per-rank mean would be wrong


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"}


def _micro_batches() -> list[dict[str, torch.Tensor]]:
    """The 4 micro-batches [MB, SEQ] of one global batch; micro-batch i has
    MASKED_PER_MICRO_BATCH[i] masked tokens and a different amount of padding."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, n_masked in enumerate(MASKED_PER_MICRO_BATCH):
        ids = torch.randint(5, VOCAB, (MB, SEQ), generator=g)
        ids[:, 0] = 2
        mask = torch.ones(MB, SEQ, dtype=torch.bool)
        mask[1, SEQ - 2 * i:] = False  # sequence 1 padded by 0, 2, 4, 6 positions
        ids[~mask] = 0
        labels = torch.full_like(ids, -100)
        flat = torch.randperm(MB * (SEQ - 8), generator=g)[:n_masked]
        rows, cols = flat // (SEQ - 8), flat % (SEQ - 8) + 1
        labels[rows, cols] = ids[rows, cols]
        ids[rows, cols] = 4  # [MASK]
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def _model() -> BertMLM:
    torch.manual_seed(0)
    return BertMLM(model_config("tiny", VOCAB, hidden_dropout=0.0, attention_dropout=0.0))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in dist.unwrap(model).named_parameters() if p.grad is not None}


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(_dist_env(rank, world, port))
    device = torch.device("cpu")
    assert dist.init_distributed("gloo", 60.0, device)
    try:
        model = dist.wrap_model(_model(), None, device)
        mine = _micro_batches()[2 * rank: 2 * rank + 2]  # 2 accumulation steps per rank
        loss_sum, n_masked, _ = forward_backward(model, mine, world_size=world)
        smoke = dist.all_reduce_smoke_test()  # reuses the group, leaves it up
        assert torch.distributed.is_initialized()
        torch.save({"grads": _grads(model), "loss_sum": loss_sum, "n_masked": n_masked, "smoke": smoke},
                   pathlib.Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.teardown()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def test_two_ranks_two_accum_steps_match_one_process(tmp_path):
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    # reference: one process, the whole global batch in one forward, mean CE over masked tokens
    ref_model = _model()
    everything = {k: torch.cat([b[k] for b in _micro_batches()]) for k in ("input_ids", "labels", "attention_mask")}
    out = ref_model(everything["input_ids"], attention_mask=everything["attention_mask"], labels=everything["labels"])
    assert int(out.n_masked) == sum(MASKED_PER_MICRO_BATCH)
    (out.loss_sum / out.n_masked).backward()
    ref = _grads(ref_model)

    assert [(r["smoke"]["rank"], r["smoke"]["sum"], r["smoke"]["ok"]) for r in ranks] == [(0, 3, True), (1, 3, True)]
    assert int(ranks[0]["n_masked"]) == sum(MASKED_PER_MICRO_BATCH)
    total_loss = float(ranks[0]["loss_sum"] + ranks[1]["loss_sum"])
    assert total_loss == pytest.approx(out.loss_sum.detach().item(), rel=1e-5)
    assert set(ranks[0]["grads"]) == set(ref)
    for name, g in ref.items():
        assert _rel_err(ranks[0]["grads"][name], g) < 1e-5, name
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name

    # the naive normalisation (mean over each micro-batch's own masked tokens) differs: the test
    # can tell the two apart with these uneven counts
    naive = _model()
    for b in _micro_batches():
        o = naive(b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
        (o.loss_sum / o.n_masked / len(MASKED_PER_MICRO_BATCH)).backward()
    worst = max(_rel_err(g, ref[n]) for n, g in _grads(naive).items())
    assert worst > 1e-2


def test_single_process_accumulation_matches_whole_batch():
    """World 1, 4 micro-batches through forward_backward = one forward on the whole batch."""
    model = _model()
    forward_backward(model, _micro_batches(), world_size=1)
    ref_model = _model()
    everything = {k: torch.cat([b[k] for b in _micro_batches()]) for k in ("input_ids", "labels", "attention_mask")}
    out = ref_model(everything["input_ids"], attention_mask=everything["attention_mask"], labels=everything["labels"])
    (out.loss_sum / out.n_masked).backward()
    for name, g in _grads(ref_model).items():
        assert _rel_err(_grads(model)[name], g) < 1e-5, name


def _train_worker(rank: int, world: int, port: int, cfg_json: str) -> None:
    from labkit.config import TrainConfig, from_dict
    from labkit.train import train

    os.environ.update(_dist_env(rank, world, port))
    train(from_dict(TrainConfig, json.loads(cfg_json)))


def test_train_two_ranks_end_to_end(tmp_path):
    from labkit.config import TrainConfig, to_dict
    from test_train import write_tiny_shards  # tests/ is on sys.path (pytest rootdir import)

    shards = write_tiny_shards(tmp_path / "shards")
    cfg = TrainConfig(data_dir=str(shards), run_dir=str(tmp_path / "run"), model="tiny", micro_batch_size=4,
                      grad_accum_steps=2, max_steps=3, warmup_steps=1, num_threads=1, device="cpu",
                      timing_warmup_steps=1, timeout_s=60)
    mp.spawn(_train_worker, args=(2, _free_port(), json.dumps(to_dict(cfg))), nprocs=2, join=True)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["world_size"] == 2 and r["global_batch_size"] == 16 for r in records)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == 3
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-3" / "state.pt", weights_only=True)
    assert len(state["ranks"]) == 2
    assert not torch.equal(state["ranks"][0]["rng"]["torch"], state["ranks"][1]["rng"]["torch"])


def test_dist_info_from_env(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert dist.dist_info() == (0, 0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert dist.dist_info() == (3, 1, 4)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK/WORLD_SIZE"):
        dist.dist_info()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK: expected an integer"):
        dist.dist_info()


def test_init_distributed_single_process_and_missing_master(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    cpu = torch.device("cpu")
    assert dist.init_distributed("auto", 10.0, cpu) is False
    assert dist.all_reduce_smoke_test()["ok"] is True  # world 1, no group: sum = 1
    assert not torch.distributed.is_initialized()
    model = torch.nn.Linear(2, 2)
    assert dist.wrap_model(model, None, cpu) is model
    t = torch.tensor([1.0, 2.0])
    assert dist.all_reduce_sum(t).tolist() == [1.0, 2.0]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        dist.init_distributed("gloo", 10.0, cpu)
