"""Tensor-parallel randomness (labkit/train/rng.py) on 2 gloo processes, one spawn.

A tp 2 model whose two head slices hold the same weights computes the same attention output on both
ranks without dropout (the control), and different outputs with attention dropout: the masks of the
two slices come from different streams. The hidden and embedding dropout of the replicated residual
stream draw the same mask on both ranks; with sequence parallelism they act on different sequence
chunks and draw different masks. A tp 2 ``train()`` with dropout stopped at step 3 and resumed gives
the uninterrupted run's losses bit for bit, so the checkpoint carries every stream.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from labkit.config import TrainConfig, from_dict, to_dict
from labkit.measure import IntervalTimer
from labkit.model import BertMLM, model_config
from labkit.train import rng
from labkit.train.tensor_parallel import apply_tensor_parallel

pytestmark = pytest.mark.torch_threads(2)
CPU = torch.device("cpu")
H, HEADS, V, B, T = 64, 4, 96, 2, 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(dropout: float) -> BertMLM:
    """A tp 2 split of a tiny BertMLM whose head slices (heads 0-1 and 2-3) hold the same weights."""
    torch.manual_seed(0)
    model = BertMLM(model_config("tiny", V, num_layers=2, num_heads=HEADS, hidden_size=H, sparse_head=False,
                                 hidden_dropout=dropout, attention_dropout=dropout, max_position_embeddings=64))
    with torch.no_grad():
        for layer in model.layers:
            w, b = layer.qkv.weight, layer.qkv.bias  # [3, H, H], [3, H]: rows head-major
            w[:, H // 2:] = w[:, :H // 2].clone()
            b[:, H // 2:] = b[:, :H // 2].clone()
    return model


def _capture(model: BertMLM, train: bool) -> dict[str, list[torch.Tensor]]:
    """One forward; the rank's attention output before the output projection of layer 0, and the
    (input, output) pairs of layer 0's hidden dropout and of the embedding dropout."""
    seen: dict[str, list] = {"attn": [], "hidden": [], "embed": []}
    hooks = [model.layers[0].attn_out.register_forward_pre_hook(lambda m, a: seen["attn"].append(a[0].detach())),
             model.layers[0].dropout.register_forward_hook(
                 lambda m, a, out: seen["hidden"].append((a[0].detach(), out.detach()))),
             model.dropout.register_forward_hook(lambda m, a, out: seen["embed"].append((a[0].detach(), out.detach())))]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, V, (B, T), generator=g)
    labels = torch.where(torch.rand(B, T, generator=g) < 0.3, ids, -100)
    model.train(train)
    model(ids, attention_mask=torch.ones(B, T, dtype=torch.bool), labels=labels)
    for h in hooks:
        h.remove()
    return seen


def _dropped(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The drop mask of each call (output 0 where the input was not), concatenated."""
    return torch.cat([((out == 0) & (inp != 0)).flatten() for inp, out in pairs])


def _worker(rank: int, world: int, port: int, out_dir: str, trains: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    tdist.init_process_group("gloo")
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        out: dict = {}
        rng.seed_streams(7, rank, world, world, CPU)
        own = torch.rand(64)
        with rng.TRACKER.fork("replicated"):
            shared = torch.rand(64)
        out["streams"] = {"own": own, "shared": shared, "own_after": torch.rand(64)}
        for sp in (False, True):
            model = _model(0.3)
            apply_tensor_parallel(model, mesh, sequence_parallel=sp, timer=IntervalTimer(CPU))
            rng.seed_streams(7, rank, world, world, CPU)
            out[f"sp={sp}"] = {"eval": _capture(model, False), "train": _capture(model, True)}
        from labkit.train import train

        for entry in trains:
            train(from_dict(TrainConfig, json.loads(entry)))
            tdist.barrier()
        torch.save(out, pathlib.Path(out_dir) / f"rank{rank}.pt")
    finally:
        tdist.destroy_process_group()


def _run_cfg(shards: pathlib.Path, run_dir: pathlib.Path, **kw) -> TrainConfig:
    base = TrainConfig(data_dir=str(shards), run_dir=str(run_dir), model="tiny", max_steps=6, num_threads=1,
                       device="cpu", timeout_s=120,
                       model_overrides={"hidden_dropout": 0.2, "attention_dropout": 0.2, "num_heads": 4},
                       batch={"micro_batch_size": 4, "grad_accum_steps": 2}, schedule={"warmup_steps": 2},
                       measure={"trackers": ()}, checkpoint={"every": 3}, eval={"every": 0},
                       parallel={"tp": 2, "sharding": "fsdp"})
    return base.replace(**kw)


def _losses(run_dir: pathlib.Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    from tiny_shards import write_tiny_shards

    tmp = tmp_path_factory.mktemp("tp_rng")
    shards = write_tiny_shards(tmp / "shards")
    trains = []
    for sp in (False, True):
        whole = _run_cfg(shards, tmp / f"whole-sp{sp}", parallel={"sequence_parallel": sp})
        part = dataclasses.replace(whole, run_dir=str(tmp / f"part-sp{sp}"), stop_after=3)
        trains += [json.dumps(to_dict(c)) for c in (whole, part, dataclasses.replace(part, stop_after=None))]
    mp.spawn(_worker, args=(2, _port(), str(tmp), trains), nprocs=2, join=True)
    return {"ranks": [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)], "tmp": tmp}


def test_streams_differ_per_tp_rank_and_the_replicated_one_is_shared(spawned):
    a, b = (r["streams"] for r in spawned["ranks"])
    assert torch.equal(a["shared"], b["shared"])
    assert not torch.equal(a["own"], b["own"]) and not torch.equal(a["own_after"], b["own_after"])


@pytest.mark.parametrize("sp", [False, True])
def test_head_slices_get_different_attention_masks(spawned, sp):
    """Equal head slices: equal attention outputs without dropout, different ones with it."""
    a, b = (r[f"sp={sp}"] for r in spawned["ranks"])
    assert torch.equal(a["eval"]["attn"][0], b["eval"]["attn"][0])  # the control: same weights, same input
    if not sp:  # the same layer input: the replicated embedding dropout drew one mask
        assert torch.equal(a["train"]["embed"][0][1], b["train"]["embed"][0][1])
    assert not torch.allclose(a["train"]["attn"][0], b["train"]["attn"][0])


@pytest.mark.parametrize("sp", [False, True])
def test_replicated_dropout_is_shared_and_sequence_chunks_differ(spawned, sp):
    a, b = (r[f"sp={sp}"]["train"] for r in spawned["ranks"])
    for kind in ("hidden", "embed"):
        ma, mb = _dropped(a[kind]), _dropped(b[kind])
        assert 0.2 < ma.float().mean() < 0.4, (kind, ma.float().mean())  # p = 0.3
        assert torch.equal(ma, mb) != sp, (kind, sp)  # sequence parallel: different chunks, different masks


@pytest.mark.parametrize("sp", [False, True])
def test_a_resumed_tp_run_continues_the_same_streams(spawned, sp):
    tmp = spawned["tmp"]
    whole, part = _losses(tmp / f"whole-sp{sp}"), _losses(tmp / f"part-sp{sp}")
    assert len(whole) == 6 and part == whole  # bitwise: every dropout stream continued


def _mesh(pp: int, dp: int, tp: int, rank: int) -> SimpleNamespace:
    world = pp * dp * tp
    return SimpleNamespace(pp=pp, dp=dp, tp=tp, rank=rank, world=world, pp_rank=rank // (dp * tp),
                           dp_rank=rank // tp % dp, tp_rank=rank % tp)


def _streams_after(ranks: list[dict], saved: tuple[int, int, int], mesh: SimpleNamespace) -> dict:
    """This process's streams after ``continue_streams`` placed it at ``mesh``: {"own": the default
    generator's next draws, "replicated": the replicated stream's (the default one at tp 1)}."""
    rng.continue_streams(ranks, saved, mesh, CPU)
    own = torch.rand(16)
    if mesh.tp == 1:
        return {"own": own, "replicated": own}
    with rng.TRACKER.fork("replicated"):
        return {"own": own, "replicated": torch.rand(16)}


def test_continue_streams_follows_one_rule_at_every_layout():
    """In one process, rank by rank: the saved streams of a pp 2 run (2 ranks) continued at tp 2 give
    the two tp ranks different own streams, one replicated stream, neither the fresh run's (nothing
    restarts from the seed); at dp 2 (tp 1) the two replicas differ; at the same layout each rank gets
    back exactly its saved state."""
    saved = []
    for r in range(2):  # a pp 2 run's ranks after some draws
        rng.seed_streams(7, r, 2, 1, CPU)
        torch.rand(100)
        saved.append(rng.rng_state())
    tp2 = [_streams_after(saved, (2, 1, 1), _mesh(1, 1, 2, r)) for r in range(2)]
    assert not torch.equal(tp2[0]["own"], tp2[1]["own"])
    assert torch.equal(tp2[0]["replicated"], tp2[1]["replicated"])
    fresh = []
    for r in range(2):
        rng.seed_streams(7, r, 2, 2, CPU)
        fresh.append(torch.rand(16))
    assert not any(torch.equal(t["own"], f) for t in tp2 for f in fresh)
    dp2 = [_streams_after(saved, (2, 1, 1), _mesh(1, 2, 1, r)) for r in range(2)]
    assert not torch.equal(dp2[0]["replicated"], dp2[1]["replicated"])
    rng.continue_streams(saved, (2, 1, 1), _mesh(2, 1, 1, 1), CPU)  # the same layout: rank 1's own state
    assert torch.equal(torch.get_rng_state(), saved[1]["torch"]) and rng.TRACKER.states == {}
