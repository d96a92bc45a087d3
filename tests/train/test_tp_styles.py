"""labkit's tensor-parallel modules (labkit/train/tensor_parallel.py) against torch's DTensor styles
they stand in for, on 2 gloo processes (one spawn), and both against one process.

- ``ColwiseLinear`` -> ``RowwiseLinear`` (Megatron's f and g) against ``ColwiseParallel`` ->
  ``RowwiseParallel`` through ``parallelize_module``;
- the same with sequence parallelism (the norm on this rank's chunk of the sequence, the gathered
  product, the reduce-scatter out) against ``SequenceParallel`` on the norm,
  ``ColwiseParallel(input_layouts=Shard(1))`` and ``RowwiseParallel(output_layouts=Shard(1))``;
- ``VocabParallelLoss`` against ``loss_parallel`` (cross-entropy on vocabulary-sharded logits,
  an uneven vocabulary).

Outputs, losses and every gradient agree to 1e-6 (docs/parallelism.md says why labkit keeps its own).
"""

from __future__ import annotations

import copy
import os
import pathlib
import socket
from collections import OrderedDict

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.torch_threads(2)
H, FF, B, T, V, N = 16, 32, 2, 8, 97, 12


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _block() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(norm=nn.LayerNorm(H), up=nn.Linear(H, FF), act=nn.GELU(), down=nn.Linear(FF, H)))


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)
    logits = torch.randn(N, V, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::3] = -100
    return x, w, logits, labels


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _reference() -> dict:
    block = _block()
    x, w, logits, labels = _inputs()
    y = block(x)
    (y * w).sum().backward()
    logits = logits.clone().requires_grad_()
    loss = F.cross_entropy(logits, labels, reduction="sum")
    loss.backward()
    return {"y": y.detach(), "grads": _grads(block), "loss": loss.detach(), "dlogits": logits.grad}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                       loss_parallel, parallelize_module)

        from labkit.measure import IntervalTimer
        from labkit.train import tensor_parallel as tpm

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        comm = tpm.Comm(mesh.get_group(), IntervalTimer(torch.device("cpu")))
        x, w, logits, labels = _inputs()
        chunk = slice(rank * T // world, (rank + 1) * T // world)
        out: dict = {}
        for sp in (False, True):
            ours, theirs = _block(), _block()
            tpm._to_tp(ours.up, tpm.ColwiseLinear, comm, mesh, 0, 0, sp)
            tpm._to_tp(ours.down, tpm.RowwiseLinear, comm, mesh, 1, None, sp)
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            if sp:
                plan = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                        "down": RowwiseParallel(output_layouts=Shard(1))}
            parallelize_module(theirs, mesh, plan)
            xin, win = (x[:, chunk], w[:, chunk]) if sp else (x, w)
            result = {}
            for name, model in (("ours", ours), ("theirs", theirs)):
                y = model(xin)
                y = y.to_local() if isinstance(y, DTensor) else y
                (y * win).sum().backward()
                if name == "ours" and sp:  # the norm and the row-parallel bias saw this rank's chunk only
                    tpm.sync_sequence_parallel_grads([ours.norm.weight, ours.norm.bias, ours.down.bias], comm)
                result[name] = {"y": y.detach(), "grads": _grads(model)}
            out[f"sp={sp}"] = result
        start, stop = tpm.shard_start(V, world, rank), tpm.shard_start(V, world, rank + 1)
        mine = logits[:, start:stop].clone().requires_grad_()
        ours_loss = tpm.VocabParallelLoss(start, comm)(mine, labels)
        ours_loss.backward()
        theirs_logits = logits[:, start:stop].clone().requires_grad_()
        with loss_parallel():
            sharded = DTensor.from_local(theirs_logits, mesh, [Shard(1)], shape=logits.shape,  # uneven: say so
                                         stride=logits.stride())
            theirs_loss = F.cross_entropy(sharded, labels, reduction="sum")
            theirs_loss.backward()
        out["loss"] = {"ours": (ours_loss.detach(), mine.grad), "theirs": (theirs_loss.full_tensor().detach(),
                                                                           theirs_logits.grad), "slice": (start, stop)}
        torch.save(out, pathlib.Path(out_dir) / f"rank{rank}.pt")
    finally:
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_styles")
    mp.spawn(_worker, args=(2, _port(), str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("sp", [False, True])
def test_column_row_linears_equal_torchs_styles_and_one_process(ranks, sp):
    ref = _reference()
    for rank, r in enumerate(ranks):
        got = r[f"sp={sp}"]
        chunk = slice(rank * T // 2, (rank + 1) * T // 2) if sp else slice(None)
        for name in ("ours", "theirs"):
            torch.testing.assert_close(got[name]["y"], ref["y"][:, chunk], rtol=1e-6, atol=1e-6)
            assert set(got[name]["grads"]) == set(ref["grads"])
            for n, g in ref["grads"].items():
                torch.testing.assert_close(got[name]["grads"][n], g, rtol=1e-6, atol=1e-6, msg=f"{name} {n}")
        for n in ref["grads"]:
            torch.testing.assert_close(got["ours"]["grads"][n], got["theirs"]["grads"][n], rtol=1e-6, atol=1e-6)


def test_vocabulary_parallel_loss_equals_loss_parallel(ranks):
    ref = _reference()
    for r in ranks:
        (ours, d_ours), (theirs, d_theirs) = r["loss"]["ours"], r["loss"]["theirs"]
        start, stop = r["loss"]["slice"]
        torch.testing.assert_close(ours, ref["loss"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(theirs, ref["loss"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(d_ours, ref["dlogits"][:, start:stop], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(d_theirs, ref["dlogits"][:, start:stop], rtol=1e-6, atol=1e-6)
