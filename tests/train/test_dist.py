"""Tests of labkit/train/dist.py and of the distributed step in labkit/train/loop.py.

The key test: 2 ranks x 2 accumulation steps (gloo, CPU), whose micro-batches hold different
numbers of masked tokens, give the gradients of one process on the whole global batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from labkit.config import TrainConfig
from labkit.train import dist
from labkit.model import BertMLM, model_config
from labkit.train import build_optimizer, build_runtime

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


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(data_dir="-", run_dir="-", **kw)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole gradients by name; FSDP's DTensor shards are all-gathered (collective)."""
    return {n: (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
            for n, g in ((n, p.grad) for n, p in model.named_parameters()) if g is not None}


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(_dist_env(rank, world, port))
    device = torch.device("cpu")
    assert dist.init_distributed("gloo", 60.0, device)
    try:
        rt = build_runtime(_cfg(batch={"grad_accum_steps": 2}), _model(), device)  # DDP over the dp group
        model = rt.parts
        assert isinstance(rt.parts.stages[0], torch.nn.parallel.DistributedDataParallel)
        mine = _micro_batches()[2 * rank: 2 * rank + 2]  # 2 accumulation steps per rank
        loss_sum, n_masked, _ = rt.forward_backward(mine)
        smoke = dist.all_reduce_smoke_test()  # reuses the group, leaves it up
        assert torch.distributed.is_initialized()
        fsdp_grads = {}
        for reshard in (True, False):  # ZeRO-3 and ZeRO-2-style
            fsdp = build_runtime(_cfg(parallel={"sharding": "fsdp", "fsdp_reshard_after_forward": reshard},
                                      batch={"grad_accum_steps": 2}),
                                 _model(), device)
            assert dist.is_fsdp(fsdp.parts.chunks[0])
            fsdp.forward_backward(mine)
            fsdp_grads[reshard] = _full_grads(fsdp.parts)
        zero = build_optimizer(model, _cfg(parallel={"sharding": "zero1"}))  # ZeRO-1: this rank's AdamW holds a partition only
        zero_local = sum(p.numel() for g in zero.optim.param_groups for p in g["params"])
        torch.save({"grads": _grads(model), "loss_sum": loss_sum, "n_masked": n_masked, "smoke": smoke,
                    "fsdp_grads": fsdp_grads, "zero_local": zero_local, "zero_type": type(zero).__name__},
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
    n_params = sum(p.numel() for p in ref_model.parameters())
    assert [r["zero_type"] for r in ranks] == ["ZeroRedundancyOptimizer"] * 2
    assert ranks[0]["zero_local"] + ranks[1]["zero_local"] == n_params
    assert 0 < ranks[0]["zero_local"] < n_params
    # FSDP2 (reduce-scatter every micro-batch, sharded grads) gives the same whole gradient
    for reshard in (True, False):
        got = ranks[0]["fsdp_grads"][reshard]
        assert set(got) == set(ref)
        for name, g in ref.items():
            assert _rel_err(got[name], g) < 1e-5, (reshard, name)

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
    build_runtime(_cfg(batch={"grad_accum_steps": 4}), model, torch.device("cpu")).forward_backward(_micro_batches())
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
    from tiny_shards import write_tiny_shards  # tests/ is on sys.path (pytest rootdir import)

    shards = write_tiny_shards(tmp_path / "shards")
    cfg = TrainConfig(data_dir=str(shards), run_dir=str(tmp_path / "run"), model="tiny", max_steps=3, num_threads=1,
                      device="cpu", timeout_s=60, batch={"micro_batch_size": 4, "grad_accum_steps": 2},
                      schedule={"warmup_steps": 1}, measure={"timing_warmup_steps": 1})
    mp.spawn(_train_worker, args=(2, _free_port(), json.dumps(to_dict(cfg))), nprocs=2, join=True)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["world_size"] == 2 and r["global_batch_size"] == 16 for r in records)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == 3
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-3" / "state.pt", weights_only=True)
    assert len(state["ranks"]) == 2
    assert not torch.equal(state["ranks"][0]["rng"]["torch"], state["ranks"][1]["rng"]["torch"])
    _check_timeline(tmp_path / "run", records, result)


def _check_timeline(run_dir, records: list[dict], result: dict) -> None:
    """The run's per-rank timeline (labkit.train.timeline): every (rank, step) row; rank 0's step
    time and exposed communication are its metrics records' own numbers; one gradient collective
    per DDP bucket the comm hook saw (the record's comm_bucket_bytes), each launched after the
    step's first all-reduce ended and completed after its launch; the step's phases lie within
    its step time; result.json carries the culprit and the goodput with its badput causes."""
    import polars as pl

    from labkit.train.timeline import read_timeline

    frame = read_timeline(run_dir)
    assert frame.select("step", "rank").rows() == [(s, r) for s in (1, 2, 3) for r in (0, 1)]
    assert sorted(p.name for p in (run_dir / "timeline").iterdir()) == ["rank-00000.parquet", "rank-00001.parquet"]
    mine = frame.filter(pl.col("rank") == 0)
    assert mine["step_s"].to_list() == [r["step_time_s"] for r in records]
    assert mine["comm_exposed_s"].to_list() == [r["comm_exposed_s"] for r in records]
    for row in frame.iter_rows(named=True):
        assert len(row["bucket_ready_s"]) == len(row["bucket_done_s"]) == len(records[0]["comm_bucket_bytes"]) >= 1
        assert all(row["sync_end_s"] <= r <= d for r, d in zip(row["bucket_ready_s"], row["bucket_done_s"]))
        assert sum(row[f"{p}_s"] for p in ("data", "sync", "forward", "backward", "optimizer")) <= row["step_s"]
    assert frame.filter(pl.col("step") == 3)["checkpoint_s"].min() > 0  # the final checkpoint, on every rank
    assert "culprit" in result and 0 < result["goodput"] < 1
    assert result["goodput"] + sum(v for k, v in result.items() if k.startswith("badput_")) == pytest.approx(1.0)


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
    rt = build_runtime(_cfg(), _model(), cpu)  # one process: the (1, 1, 1) layout, nothing to communicate
    assert rt.mesh.device_mesh is None and rt.comm is None and rt.parts.stages == rt.parts.chunks
    t = torch.tensor([1.0, 2.0])
    assert dist.all_reduce_sum(t).tolist() == [1.0, 2.0]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        dist.init_distributed("gloo", 10.0, cpu)


# -- sharding strategies through train(): ZeRO-1 and FSDP2 against plain DDP ----------------
# One spawn of 2 gloo ranks runs every train() below (a spawn costs ~10 s of imports on a
# loaded 2-core machine), then checks a collective timeout; the tests read the run dirs.


def _train_many_worker(rank: int, world: int, port: int, timeout_port: int, cfgs_json: str, out_dir: str) -> None:
    """One process group for several train() calls in a row (train reuses a group it did not
    create; re-creating groups on one port can hang, pytorch#55967). Then a fresh group with a
    2 s timeout in which rank 1 never joins an all-reduce; rank 0 writes what happened."""
    import time

    from labkit.config import TrainConfig, from_dict
    from labkit.train import train

    torch.set_num_threads(1)
    os.environ.update(_dist_env(rank, world, port))
    assert dist.init_distributed("gloo", 60.0, torch.device("cpu"))
    try:
        for cfg in json.loads(cfgs_json):
            train(from_dict(TrainConfig, cfg))
    finally:
        dist.teardown()
    os.environ.update(_dist_env(rank, world, timeout_port))
    dist.init_distributed("gloo", 2.0, torch.device("cpu"))
    if rank == 0:
        t0 = time.perf_counter()
        try:
            dist.all_reduce_sum(torch.ones(1))
            outcome = "returned"
        except Exception as err:  # gloo raises DistBackendError (a RuntimeError)
            outcome = f"{type(err).__name__}: {err}"
        pathlib.Path(out_dir, "timeout.txt").write_text(f"{time.perf_counter() - t0:.1f}\n{outcome}")
    else:
        time.sleep(4.0)  # never joins the all-reduce
    os._exit(0)  # skip destroying a group whose peer timed out


def _metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _two_rank_cfg(shards: pathlib.Path, run_dir: pathlib.Path, **kw):
    from labkit.config import TrainConfig

    base = TrainConfig(data_dir=str(shards), run_dir=str(run_dir), model="tiny", max_steps=4, num_threads=1,
                       device="cpu", timeout_s=60, batch={"micro_batch_size": 4, "grad_accum_steps": 2},
                       optim={"lr": 3e-3, "grad_clip": 0.5}, schedule={"warmup_steps": 1},
                       measure={"timing_warmup_steps": 1})
    return base.replace(**kw)


SHARDINGS = {"ddp": {"sharding": "ddp"}, "zero1": {"sharding": "zero1"}, "fsdp": {"sharding": "fsdp"},
             "fsdp2": {"sharding": "fsdp", "fsdp_reshard_after_forward": False}}  # fsdp2: ZeRO-2-style


MIXED = {"zero1-fp16": {"parallel": {"sharding": "zero1"}, "precision": "fp16"},
         "fsdp-fp16": {"parallel": {"sharding": "fsdp"}, "precision": "fp16"},
         "fsdp-bf16-recompute": {"parallel": {"sharding": "fsdp"}, "precision": "bf16",
                                 "activation_checkpointing": True}}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> pathlib.Path:
    """Run dirs: one 4-step run per SHARDINGS entry; zero1-part / fsdp-part stopped after step 2
    and resumed to step 4; timeout.txt. 48 sequences, 16 per step: step 4 is in epoch 1."""
    from labkit.config import to_dict
    from tiny_shards import write_tiny_shards  # tests/ is on sys.path (pytest rootdir import)

    root = tmp_path_factory.mktemp("two_rank_runs")
    shards = write_tiny_shards(root / "shards", n_sequences=48)
    cfgs = [_two_rank_cfg(shards, root / name, parallel=kw) for name, kw in SHARDINGS.items()]
    for name in ("zero1", "fsdp"):
        part = _two_rank_cfg(shards, root / f"{name}-part", stop_after=2, parallel={"sharding": name})
        cfgs += [part, dataclasses.replace(part, stop_after=None)]
    for name, kw in MIXED.items():
        cfgs.append(_two_rank_cfg(shards, root / name, max_steps=2, **kw))
    mp.spawn(_train_many_worker, args=(2, _free_port(), _free_port(), json.dumps([to_dict(c) for c in cfgs]),
                                       str(root)), nprocs=2, join=True)
    return root


def test_zero1_and_fsdp_match_ddp(two_rank_runs):
    """Same seed, data and dropout streams: after 4 AdamW steps (clipping active) ZeRO-1 and FSDP2
    (ZeRO-3 and ZeRO-2-style) hold DDP's parameters, log its losses and its global grad norm."""
    from labkit.train.checkpoint import load_weights

    root = two_rank_runs
    ref = _metrics(root / "ddp")
    assert all(r["grad_norm"] > 0.5 for r in ref)  # the clip (0.5) is active at every step
    ref_w = load_weights(root / "ddp" / "checkpoints" / "step-4")
    for name in ("zero1", "fsdp", "fsdp2"):
        got = _metrics(root / name)
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5), name
        assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-5), name
        assert [r["lr"] for r in got] == [r["lr"] for r in ref]
        w = load_weights(root / name / "checkpoints" / "step-4")
        assert set(w) == set(ref_w)
        for k, v in ref_w.items():  # zero1 steps the same AdamW on the same grads: identical
            assert torch.equal(w[k], v) if name == "zero1" else torch.allclose(w[k], v, rtol=1e-4, atol=1e-6), \
                (name, k, (w[k] - v).abs().max())
        state = torch.load(root / name / "checkpoints" / "step-4" / "state.pt", weights_only=True)
        assert state["sharding"] == SHARDINGS[name]["sharding"] and "optimizer" not in state  # in the DCP files
        assert {p.name for p in (root / name / "checkpoints" / "step-4").glob("*.distcp")} == {"__0_0.distcp",
                                                                                             "__1_0.distcp"}
    init = _model().state_dict()
    moved = max(float((ref_w[k] - init[k]).abs().max()) for k in ref_w if k in init and init[k].shape == ref_w[k].shape)
    assert moved > 1e-3  # the parameters really changed, so the match above means something


def test_records_carry_exposed_communication_and_cpu_time(two_rank_runs):
    """Every record of a 2-rank run has comm_exposed_s (labkit.measure.comm_exposed_s over the
    step's gradient collectives, timed by labkit.train.comm.CommTimer) within its step; FSDP2's reduce-scatters
    run on the backward thread on CPU, so they are exposed whole and never zero; result.json has
    the mean and the share of the step; cpu_s covers the main thread's and gloo's threads."""
    for name in ("ddp", "zero1", "fsdp", "fsdp2"):
        records = _metrics(two_rank_runs / name)
        assert all(0.0 <= r["comm_exposed_s"] <= r["step_time_s"] for r in records), name
        assert all(0.0 < r["thread_cpu_s"] <= r["cpu_s"] * 1.05 for r in records), name
        if name.startswith("fsdp"):
            assert all(r["comm_exposed_s"] > 0 for r in records), name
        result = json.loads((two_rank_runs / name / "result.json").read_text())
        timed = records[1:]  # timing_warmup_steps=1
        assert result["comm_exposed_s"] == pytest.approx(sum(r["comm_exposed_s"] for r in timed) / len(timed))
        assert 0 <= result["comm_exposed_fraction"] < 1


def test_resume_zero1_and_fsdp_reproduce_losses(two_rank_runs):
    """fp32, gloo, 2 ranks: stopped at step 2, resumed, finished at 4 (in the next epoch):
    exactly the uninterrupted run's losses, grad norms and learning rates, zero1 and fsdp."""
    from labkit.train import lr_at

    root = two_rank_runs
    cfg = _two_rank_cfg(root, root)
    keys = ("step", "loss", "grad_norm", "lr", "tokens", "epoch")
    for sharding in ("zero1", "fsdp"):
        want = _metrics(root / sharding)
        got = _metrics(root / f"{sharding}-part")
        assert [tuple(r[k] for k in keys) for r in got] == [tuple(r[k] for k in keys) for r in want], sharding
        assert [r["lr"] for r in got] == [lr_at(s, cfg) for s in range(4)]
        assert [r["epoch"] for r in got] == [0, 0, 0, 1]
        result = json.loads((root / f"{sharding}-part" / "result.json").read_text())
        assert result["resumed_from_step"] == 2 and result["sharding"] == sharding


def test_collective_times_out_instead_of_hanging(two_rank_runs):
    """timeout_s reaches every collective: an all-reduce whose peer never joins raises after
    about 2 s (torch's default would wait 30 min)."""
    seconds, outcome = (two_rank_runs / "timeout.txt").read_text().split("\n", 1)
    assert outcome != "returned" and "imed out" in outcome, outcome
    assert float(seconds) < 4.0


@pytest.mark.parametrize("name", list(MIXED))
def test_sharding_with_autocast_and_recompute(two_rank_runs, name):
    """fp16 (scaler; ShardedGradScaler under fsdp) and bf16 + activation checkpointing under
    sharding: the step-1 loss is the fp32 DDP run's within autocast noise, all finite."""
    ref = _metrics(two_rank_runs / "ddp")
    got = _metrics(two_rank_runs / name)
    assert [r["step"] for r in got] == [1, 2] and not any(r["skipped"] for r in got)
    assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=2e-2)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in got)
    assert got[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=5e-2)
    result = json.loads((two_rank_runs / name / "result.json").read_text())
    assert result["sharding"] == MIXED[name]["parallel"]["sharding"] and result["precision"] == MIXED[name]["precision"]
    assert result["activation_checkpointing"] == MIXED[name].get("activation_checkpointing", False)


def _timeouts_worker(rank: int, world: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "lo"})
    cpu = torch.device("cpu")
    dist.init_distributed("gloo", 7.0, cpu)
    try:
        mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "dp", "tp"))  # pp, tp: groups of 1 rank
        of = lambda group: group._get_backend(cpu).options._timeout.total_seconds()  # noqa: E731
        found = {"mesh_before": [of(g) for g in mesh.get_all_groups()]}
        dist.set_group_timeouts(mesh)
        found |= {"mesh": [of(g) for g in mesh.get_all_groups()], "new_group": of(dist.new_group(backend="gloo")),
                  "torch_new_group": of(tdist.new_group(backend="gloo", timeout=None))}
        assert dist.run_timeout() == datetime.timedelta(seconds=7)
        if rank == 0:
            pathlib.Path(out).write_text(json.dumps(found))
    finally:
        dist.teardown()


def test_every_process_group_gets_the_runs_timeout(tmp_path):
    """A new group and a DeviceMesh's dimension groups get torch's 30-minute default whatever the
    default group's timeout (the issue's asynchronous checkpoint group): made through
    ``dist.new_group`` and ``dist.set_group_timeouts`` they get the run's (2 gloo ranks)."""
    out = tmp_path / "timeouts.json"
    mp.spawn(_timeouts_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    found = json.loads(out.read_text())
    assert found["torch_new_group"] == 1800.0 and 1800.0 in found["mesh_before"]  # what torch gives them
    assert found["mesh"] == [7.0, 7.0, 7.0] and found["new_group"] == 7.0
