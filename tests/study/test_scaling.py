"""labkit/study/scaling.py: the ring all-reduce model against a simulated ring and its closed form,
bucketing, overlap and the efficiency table."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from labkit.study import scaling


def _simulate_ring(chunks_per_rank: list[np.ndarray]) -> tuple[list[np.ndarray], int, int]:
    """Ring all-reduce done for real on n simulated ranks: reduce-scatter then all-gather, each
    of n - 1 steps sending one chunk (S/n elements) to the next rank. Returns the per-rank
    results, the steps taken and the elements each rank sent."""
    n = len(chunks_per_rank)
    data = [np.array_split(x.astype(np.float64), n) for x in chunks_per_rank]
    steps = sent = 0
    for k in range(n - 1):  # reduce-scatter: rank r sends chunk (r - k) mod n
        msgs = [(r, (r - k) % n, data[r][(r - k) % n].copy()) for r in range(n)]
        for r, c, payload in msgs:
            data[(r + 1) % n][c] += payload
        steps += 1
        sent += msgs[0][2].size
    for k in range(n - 1):  # all-gather: rank r sends its finished chunk (r + 1 - k) mod n
        msgs = [(r, (r + 1 - k) % n, data[r][(r + 1 - k) % n].copy()) for r in range(n)]
        for r, c, payload in msgs:
            data[(r + 1) % n][c] = payload
        steps += 1
        sent += msgs[0][2].size
    return [np.concatenate(d) for d in data], steps, sent


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_allreduce_model_equals_a_simulated_ring(n):
    rng = np.random.default_rng(n)
    size = 8 * n * 5  # elements, divisible by n
    xs = [rng.normal(size=size) for _ in range(n)]
    out, steps, sent = _simulate_ring(xs)
    for o in out:
        np.testing.assert_allclose(o, np.sum(xs, axis=0))
    assert steps == 2 * (n - 1) and sent == 2 * (n - 1) * size // n
    nbytes, bw, alpha = size * 4, 1e9, 5e-6  # fp32 elements
    simulated = steps * alpha + sent * 4 / bw  # each step: one hop latency + its bytes on the link
    assert scaling.ring_allreduce_time(nbytes, n, bandwidth=bw, latency=alpha) == pytest.approx(simulated, rel=1e-12)


def test_ring_closed_form_and_bucketing():
    # 2 (n-1)/n * S / B + 2 (n-1) alpha at n 4, S 100 MB, B 1 GB/s, alpha 10 us
    assert scaling.ring_allreduce_time(100e6, 4, bandwidth=1e9, latency=1e-5) == pytest.approx(0.15 + 6e-5)
    assert scaling.ring_allreduce_time(1e9, 1, bandwidth=1e9, latency=1.0) == 0.0
    mib = 2**20
    b = scaling.bucketed_allreduce(60 * mib, 4, bandwidth=1e9, latency=1e-5)  # 25 + 25 + 10 MiB
    assert b["buckets"] == 3
    assert b["total_s"] == pytest.approx(1.5 * 60 * mib / 1e9 + 3 * 6e-5)
    assert b["last_bucket_s"] == pytest.approx(1.5 * 10 * mib / 1e9 + 6e-5)
    with pytest.raises(ValueError, match="bandwidth"):
        scaling.ring_allreduce_time(1, 2, bandwidth=0, latency=0)


def test_step_time_overlap_and_exposure():
    grad = 400e6  # bytes
    one = scaling.step_time(1, compute_s=0.3, grad_bytes=grad)
    assert one["step_s"] == 0.3 and one["exposed_s"] == 0
    # 16 GPUs on 8 nodes of 25 GbE: comm = sum over 16 buckets of the ring time
    s = scaling.step_time(16, compute_s=0.3, grad_bytes=grad, network="25GbE", overlap=0.5)
    comm = scaling.bucketed_allreduce(grad, 16, bandwidth=25e9 / 8, latency=20e-6)
    assert s["comm_s"] == pytest.approx(comm["total_s"])
    assert s["exposed_s"] == pytest.approx(comm["total_s"] - 0.5 * 0.2)  # backward = 2/3 of compute
    assert s["step_s"] == pytest.approx(0.3 + s["exposed_s"])
    # a fast network hides everything but the last bucket
    f = scaling.step_time(16, compute_s=0.3, grad_bytes=grad, network="IB-NDR")
    last = scaling.bucketed_allreduce(grad, 16, bandwidth=400e9 / 8, latency=3e-6)["last_bucket_s"]
    assert f["comm_hidden"] and f["exposed_s"] == pytest.approx(last) and last < f["comm_s"] / 15
    # within one node the intra-node link is used
    assert scaling.step_time(2, compute_s=0.3, grad_bytes=grad)["comm_s"] < comm["total_s"] / 10
    # accumulation: compute x k, one all-reduce
    acc = scaling.step_time(16, compute_s=0.3, grad_bytes=grad, grad_accum=4, overlap=0.5)
    assert acc["compute_s"] == pytest.approx(1.2) and acc["exposed_s"] == pytest.approx(s["exposed_s"])
    with pytest.raises(ValueError, match="network"):
        scaling.step_time(2, compute_s=1, grad_bytes=1, network="carrier pigeon")
    with pytest.raises(ValueError, match="overlap"):
        scaling.step_time(2, compute_s=1, grad_bytes=1, overlap=2)


def test_efficiency_table_and_network_limit():
    t = scaling.efficiency_table(compute_s=0.2, grad_bytes=480e6, tokens_per_step=512 * 184)
    assert t["n_gpus"].to_list() == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert t["efficiency"][0] == 1.0
    eff = t["efficiency"].to_list()
    assert all(a >= b - 1e-12 for a, b in zip(eff[1:], eff[2:]))  # falls once it leaves the node
    assert t["tokens_per_s"][0] == pytest.approx(512 * 184 / 0.2)
    lim = scaling.network_limit(t)
    assert lim["first_exposed_n"] == 4  # the first count that leaves the node's NVLink
    fast = scaling.efficiency_table(compute_s=0.2, grad_bytes=480e6, tokens_per_step=1, network="IB-NDR")
    assert scaling.network_limit(fast)["below_90pct_n"] is None


def test_the_tied_embedding_bucket_is_exposed_last():
    """DDP reduces the bucket holding the word embedding last (ready when backward reaches the
    lookup): for bert-120m at vocabulary 45,000 that is 138 MB of fp32 gradients, the part of the
    all-reduce left after backward when the rest hides behind it (IB NDR), not the remainder."""
    from labkit.model import count_parameters, model_config
    from labkit.study.plan import STUDY_VOCAB

    cfg = model_config("bert-120m", STUDY_VOCAB)
    emb = scaling.embedding_bucket_bytes(cfg)
    assert emb == 4 * ((STUDY_VOCAB + 2 + 512) * 768 + 2 * 768)
    grads = 4 * count_parameters(cfg)["total"]
    kw = dict(compute_s=0.2, grad_bytes=grads, network="IB-NDR")
    net = scaling.NETWORKS["IB-NDR"]
    ring = scaling.ring_allreduce_time(emb, 256, bandwidth=net["bandwidth"], latency=net["latency"])
    tied = scaling.step_time(256, last_bucket_bytes=emb, **kw)
    assert tied["comm_hidden"] and tied["exposed_s"] == pytest.approx(ring)
    assert scaling.step_time(256, **kw)["exposed_s"] < ring / 3  # the remainder bucket alone
    assert scaling.study_scaling("bert-120m", micro_batch=184, network="IB-NDR", mfu=0.4)["exposed_s"][-1] == \
        pytest.approx(ring)
    tiny = model_config("tiny", 128)  # every gradient fits one bucket: that one is the last
    assert scaling.embedding_bucket_bytes(tiny) == 4 * count_parameters(tiny)["total"]


def test_study_scaling_uses_the_planner_devices():
    t = scaling.study_scaling("bert-120m", micro_batch=184, seq_len=512)
    from labkit.model import flops_per_token, model_config
    from labkit.study.plan import STUDY_VOCAB

    fpt = flops_per_token(model_config("bert-120m", STUDY_VOCAB), 512)
    assert t["compute_s"][0] == pytest.approx(512 * 184 * fpt / (0.4 * 835.5e12))
    dense = scaling.study_scaling("bert-120m", micro_batch=184, seq_len=512, sparse_head=False)
    fpt_dense = flops_per_token(model_config("bert-120m", STUDY_VOCAB, sparse_head=False), 512)
    assert dense["compute_s"][0] == pytest.approx(512 * 184 * fpt_dense / (0.4 * 835.5e12))
    assert fpt_dense - fpt > 6 * STUDY_VOCAB * 768 * 0.85  # the decoder (and last layer, head) at unmasked positions
    measured = scaling.study_scaling("bert-120m", micro_batch=184, step_time_1=0.5)
    assert measured["compute_s"][0] == 0.5
    with pytest.raises(ValueError, match="step_time_1"):
        scaling.calibrate(0.0)


def test_one_story_searches_both_lessons():
    import polars as pl

    t = scaling.one_story()
    assert t["model"].to_list() == ["bert-120m", "bert-350m"] and not t["shared_by_both_models"].any()
    for r in t.iter_rows(named=True):
        assert r["efficiency_at_max_mfu"] >= 0.9
        above = scaling.study_scaling(r["model"], micro_batch=r["study"], seq_len=r["seq_len"],
                                      mfu=r["max_mfu"] + 0.01, sparse_head=r["sparse_head"])
        assert above.filter(pl.col("n_gpus") == 256)["efficiency"].item() < 0.9  # the largest MFU that holds


# -- the overlap model against DDP on 2 gloo ranks ----------------------------------------------

def test_exposed_closed_form_and_fitted_overlap():
    # communication hidden except the last bucket; falling behind backward: the excess is exposed
    assert scaling.exposed_s(comm_s=0.3, last_bucket_s=0.05, backward_s=1.0) == pytest.approx(0.05)
    assert scaling.exposed_s(comm_s=1.5, last_bucket_s=0.05, backward_s=1.0) == pytest.approx(0.5)
    assert scaling.exposed_s(comm_s=1.5, last_bucket_s=0.05, backward_s=1.0, overlap=0.5) == pytest.approx(1.0)
    # the overlap that reproduces a measurement, and back
    o = scaling.fit_overlap(comm_s=1.5, backward_s=1.0, exposed_s=0.8)
    assert o == pytest.approx(0.7)
    assert scaling.exposed_s(comm_s=1.5, last_bucket_s=0.05, backward_s=1.0, overlap=o) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="backward_s"):
        scaling.fit_overlap(comm_s=1.0, backward_s=0.0, exposed_s=0.1)


OVERLAP_CAPS_MB = (1.0, 4.0)  # buckets of 1 and 4 MiB (the 32 MiB tied embedding is a bucket of its own)
OVERLAP_STEPS, OVERLAP_WARMUP = 10, 2
B, T = 1, 32  # backward is the vocabulary's (dense [V, H] gradients): long enough to hide all but the last bucket


def _overlap_worker(rank: int, world: int, port: int, out: str) -> None:
    """Per bucket size: DDP steps of mini with a 32k-entry tied embedding (46 MB of fp32
    gradients), ``CommTimer`` on the buckets, backward timed from its call to the last bucket's
    launch. Rank 0 writes per step: measured comm_exposed_s, backward seconds, and each bucket's
    all-reduce seconds (its end minus its start or the previous end, whichever is later: gloo
    runs a process group's collectives in launch order)."""
    import json
    import os
    import time

    import torch

    from labkit.config import TrainConfig
    from labkit.model import BertMLM, model_config
    from labkit.train import build_runtime, dist

    os.sched_setaffinity(0, {rank % len(os.sched_getaffinity(0))})  # one core per rank
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    cpu = torch.device("cpu")
    dist.init_distributed("gloo", 120.0, cpu)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(5, 32768, (B, T), generator=gen)
    labels = torch.where(torch.rand(B, T, generator=gen) < 0.15, ids, -100)
    results = {}
    for cap in OVERLAP_CAPS_MB:
        torch.manual_seed(0)
        rt = build_runtime(TrainConfig(data_dir="-", run_dir="-", parallel={"bucket_cap_mb": cap}),
                           BertMLM(model_config("mini", 32768, hidden_dropout=0.0, attention_dropout=0.0)), cpu)
        model, timer = rt.parts.stages[0], rt.comm  # DDP with the trainer's comm hook
        timer.observers.clear()  # the plain timed all-reduce: no noise-scale norms in the hook
        rows = []
        for step in range(OVERLAP_STEPS):
            timer.reset()
            out_ = model(ids, labels=labels)
            t_backward = time.perf_counter()
            (out_.loss_sum / out_.n_masked).backward()
            model.zero_grad(set_to_none=True)
            buckets = timer.collectives()
            first = min(r[0] for r in timer._records)  # the clock of the buckets' times (perf_counter)
            prev, comm = -float("inf"), []
            for b in buckets:
                comm.append(b["end_s"] - max(b["start_s"], prev))
                prev = b["end_s"]
            backward = first + buckets[-1]["start_s"] - t_backward
            if step >= OVERLAP_WARMUP:
                rows.append({"measured": timer.exposed_s(), "comm": comm, "backward": backward})
        results[str(cap)] = rows
        del model, timer, rt
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.teardown()


@pytest.mark.timeout(300)
def test_overlap_model_predicts_measured_exposed_communication(tmp_path):
    """study.scaling's overlap model (``exposed_s``: the last bucket, or the all-reduce time that
    backward cannot hide), fed with each bucket's all-reduce time and the backward time measured
    in the same run, predicts the comm_exposed_s that DDP's comm hook measured, within 20 % over
    the timed steps, at two bucket sizes."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "overlap.json"
    mp.spawn(_overlap_worker, args=(2, port, str(out)), nprocs=2, join=True)
    results = json.loads(out.read_text())
    n_buckets = {cap: len(rows[-1]["comm"]) for cap, rows in results.items()}
    assert n_buckets[str(OVERLAP_CAPS_MB[0])] > 2 * n_buckets[str(OVERLAP_CAPS_MB[1])] > 2, n_buckets
    for cap, rows in results.items():
        measured = sum(r["measured"] for r in rows)
        predicted = sum(scaling.exposed_s(comm_s=sum(r["comm"]), last_bucket_s=r["comm"][-1],
                                          backward_s=r["backward"]) for r in rows)
        assert measured > 0, cap
        assert predicted == pytest.approx(measured, rel=0.2), (cap, measured, predicted, rows)


def test_comm_hidden_and_the_network_limit_come_from_the_exposed_time():
    """A model whose gradients fit one bucket exposes its whole all-reduce after backward
    (exposed = comm): never hidden, and the network limit starts at the first n > 1, although
    its all-reduce is far shorter than backward (the old rule, comm <= 2/3 compute, said hidden
    and found no limit). A model of many buckets on a fast network hides all but the last one."""
    from labkit.model import count_parameters, model_config

    cfg = model_config("tiny", 1024)
    grads = 4 * count_parameters(cfg)["total"]
    assert grads < scaling.BUCKET_BYTES
    t = scaling.efficiency_table(compute_s=0.05, grad_bytes=grads, tokens_per_step=64 * 8, gpus=(1, 2, 4, 8),
                                 last_bucket_bytes=scaling.embedding_bucket_bytes(cfg))
    two = t.row(1, named=True)
    assert two["comm_s"] < 0.05 * 2 / 3 / 100 and two["exposed_s"] == two["comm_s"] == two["last_bucket_s"]
    assert t["comm_hidden"].to_list() == [True, False, False, False]
    assert scaling.network_limit(t)["first_exposed_n"] == 2
    many = scaling.step_time(256, compute_s=0.5, grad_bytes=480e6, network="IB-NDR")
    assert many["comm_hidden"] and many["exposed_s"] == many["last_bucket_s"] < many["comm_s"] / 10
    slow = scaling.step_time(4, compute_s=0.2, grad_bytes=480e6, network="25GbE")  # backward too short
    assert not slow["comm_hidden"] and slow["exposed_s"] > slow["last_bucket_s"]
    assert scaling.comm_hidden(exposed_s=0.0, last_bucket_s=0.0, comm_s=0.0)  # one rank


def test_fp32_and_bf16_scale_each_at_their_own_peak():
    """`labkit plan --precision fp32` used to scale at the bf16 peak: fp32 compute 14x too short
    for bert-350m on an H100 NVL (60 TFLOP/s on the CUDA cores against 835.5 on the tensor cores)."""
    kw = dict(micro_batch=16, seq_len=512, device="H100 NVL", gpus=(1, 2, 4, 8))
    fp32 = scaling.study_scaling("bert-350m", precision="fp32", **kw)
    bf16 = scaling.study_scaling("bert-350m", precision="bf16", **kw)
    assert fp32["compute_s"][0] / bf16["compute_s"][0] == pytest.approx(835.5 / 60)
    assert fp32["efficiency"].to_list() != bf16["efficiency"].to_list()
    with pytest.raises(ValueError, match="no 'fp32' peak for A100 80GB"):
        scaling.study_scaling("bert-350m", precision="fp32", **(kw | {"device": "A100 80GB"}))
