"""The gradient noise scale (labkit/train/gns.py) against exact per-example gradients.

At fixed weights of a tiny model, ``torch.func`` (vmap of grad through ``functional_call``) gives
every example's gradient in a pool of N sequences; their mean is G and their (population)
covariance Σ. Steps then draw batches from the pool uniformly with replacement, so the pool is
exactly the distribution the estimator samples and the truth carries no sampling error. The
in-run estimator (``Runtime.forward_backward`` with its ``NoiseScale``, no optimiser step) averaged over
many steps must agree with the truth within a tolerance derived from the steps' own spread (4
standard errors), plus the bias bound of the masked-count normalisation (gns.py: 3·CV(m)²/B_big),
and that tolerance must itself be under 15 %, at several (B_small, B_big). A 2-rank DDP check
shows the comm-hook path feeds the observer the same squared norms as the gradients themselves,
and that under PowerSGD (whose averaged bucket is the compressed one) the sketched estimate stays
within 15 % of the plain all-reduce's on the same batches, where the norms of the compressed bucket
do not. The interval (``b_simple_low`` .. ``b_simple_high``) must cover the exact B_simple in at
least 80 % of independent windows, both where B_big is above B_simple and where it is far below.
"""

from __future__ import annotations

import gc
import math
import os
import pathlib
import socket
import weakref

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from labkit.config import TrainConfig
from labkit.model import BertMLM, model_config
from labkit.train import build_runtime, dist
from labkit.train.gns import BiasCorrectedEMA, CountSketch, NoiseScale, fieller_interval, two_batch_estimates

# vmap falls back to a loop for CPU SDPA (a speed warning, not a fault)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

VOCAB, SEQ, POOL, P_MASK = 64, 64, 512, 0.15


def _model() -> BertMLM:
    torch.manual_seed(0)
    return BertMLM(model_config("tiny", VOCAB, hidden_dropout=0.0, attention_dropout=0.0))


def _pool(n: int = POOL, seed: int = 1) -> dict[str, torch.Tensor]:
    """n sequences [n, SEQ] with BERT-style masking at P_MASK (at least one masked each): tokens
    from a skewed unigram distribution, so the true gradient at init is far from zero."""
    g = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, VOCAB - 4, dtype=torch.float64)
    ids = 5 + torch.multinomial(probs.expand(n, -1), SEQ, replacement=True, generator=g)
    ids[:, 0] = 2
    sel = torch.rand(n, SEQ, generator=g) < P_MASK
    sel[:, 0] = False
    sel[torch.arange(n), 1 + torch.randint(0, SEQ - 1, (n,), generator=g)] = True
    labels = torch.where(sel, ids, torch.full_like(ids, -100))
    return {"input_ids": torch.where(sel, torch.full_like(ids, 4), ids), "labels": labels,
            "attention_mask": torch.ones(n, SEQ, dtype=torch.bool)}


def _per_example_grads(model: BertMLM, pool: dict[str, torch.Tensor], chunk: int = 128) -> torch.Tensor:
    """[N, P] fp64: each sequence's gradient of its summed masked CE (torch.func.vmap(grad))."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_sum(p, ids, labels):  # the model's own loss: sum of CE over label != -100
        logits = functional_call(model, p, (ids[None],), {"attention_mask": None}).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels, ignore_index=-100, reduction="sum")

    per = vmap(grad(loss_sum), in_dims=(None, 0, 0))
    out = []
    for i in range(0, pool["input_ids"].shape[0], chunk):
        g = per(params, pool["input_ids"][i:i + chunk], pool["labels"][i:i + chunk])
        out.append(torch.cat([g[k].reshape(g[k].shape[0], -1) for k, _ in model.named_parameters()], 1).double())
    return torch.cat(out)


def test_per_example_gradients_match_autograd():
    model, pool = _model(), _pool(8)
    per = _per_example_grads(model, pool)
    for i in (0, 5):
        model.zero_grad()
        model(pool["input_ids"][i:i + 1], attention_mask=None, labels=pool["labels"][i:i + 1]).loss_sum.backward()
        ref = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        assert torch.allclose(per[i], ref, rtol=1e-4, atol=1e-6)


def _steps(model, pool, b, k, n_steps, seed):
    """Per-step (|G|², tr Σ) estimates of the in-run estimator: one process, k micro-batches of b
    sequences drawn from the pool with replacement, through forward_backward's micro path."""
    g = torch.Generator().manual_seed(seed)
    rt = build_runtime(TrainConfig(data_dir="-", run_dir="-", batch={"micro_batch_size": b, "grad_accum_steps": k}),
                       model, torch.device("cpu"))
    noise = rt.noise  # one process: the micro-batches
    ests = []
    for _ in range(n_steps):
        idx = torch.randint(0, pool["input_ids"].shape[0], (k, b), generator=g)
        micro = [{key: v[j] for key, v in pool.items()} | {"all_real": True} for j in idx]
        model.zero_grad(set_to_none=True)
        noise.reset()
        rt.forward_backward(micro)
        f = noise.step_fields()
        ests.append(two_batch_estimates(f["gns_sq_small"], f["gns_sq_big"], f["gns_b_small"], f["gns_b_big"]))
    return torch.tensor(ests, dtype=torch.float64)


@pytest.fixture(scope="module")
def truth():
    torch.set_num_threads(1)
    model, pool = _model(), _pool()
    per = _per_example_grads(model, pool)
    masked = (pool["labels"] != -100).sum(1).double()
    per = per / masked.mean()  # an example's gradient: its loss-sum gradient per mean masked count
    mean = per.mean(0)
    trace = float(((per - mean) ** 2).sum(1).mean())  # population covariance of the pool
    cv2 = float(masked.var(correction=0) / masked.mean() ** 2)
    return model, pool, {"grad_sq": float(mean @ mean), "trace": trace, "cv2": cv2, "gram": per @ per.T,
                         "masked": masked}


@pytest.mark.timeout(1800)  # a few hundred tiny forward/backward passes: minutes on a loaded 2-core machine
@pytest.mark.parametrize("b,k,n_steps", [(2, 4, 100), (4, 4, 100), (4, 8, 60)])
def test_estimator_unbiased_against_exact_per_example_gradients(truth, b, k, n_steps):
    model, pool, exact = truth
    ests = _steps(model, pool, b, k, n_steps, seed=b * 100 + k)
    mean, se = ests.mean(0), ests.std(0) / math.sqrt(n_steps)
    bias = 3 * exact["cv2"] / (b * k)  # masked-count normalisation (gns.py), relative
    print(f"b={b} k={k}: |G|^2 {mean[0]:.4g} ± {se[0]:.2g} vs {exact['grad_sq']:.4g}; "
          f"tr(Σ) {mean[1]:.4g} ± {se[1]:.2g} vs {exact['trace']:.4g}; bias bound {bias:.3f}")
    for i, key in enumerate(("grad_sq", "trace")):
        tol = 4 * float(se[i]) / exact[key] + bias  # from the sample size: 4 standard errors
        assert tol <= 0.15, f"{key}: {n_steps} steps give a tolerance of {tol:.1%}, over 15 %"
        assert abs(float(mean[i]) / exact[key] - 1) <= tol, (key, float(mean[i]), exact[key], tol)


# -- the interval: coverage of the exact B_simple over independent windows -----------------------

def _half_learnt(model: BertMLM, pool: dict[str, torch.Tensor], share: float = 0.875) -> BertMLM:
    """``model`` with its decoder bias at ``share`` × the log of the pool's label frequencies: a model
    that has partly learnt the unigram, whose mean gradient is small against the per-example noise."""
    labels = pool["labels"][pool["labels"] != -100]
    freq = torch.bincount(labels, minlength=VOCAB).double() + 0.5
    with torch.no_grad():
        model.decoder_bias.copy_(share * (freq / freq.sum()).log().float())
    return model


@pytest.fixture(scope="module")
def noisy_truth():
    """A frozen point where B_simple is far above the batches (``_half_learnt``), 256 sequences.
    Returns (the Gram matrix of the per-example gradients [N, N] fp64, masked count per sequence,
    exact B_simple)."""
    torch.set_num_threads(1)
    pool = _pool(256, seed=7)
    model = _half_learnt(_model(), pool)
    masked = (pool["labels"] != -100).sum(1).double()
    per = _per_example_grads(model, pool) / masked.mean()
    mean = per.mean(0)
    return per @ per.T, masked, float(((per - mean) ** 2).sum(1).mean()) / float(mean @ mean)


def _window_fields(gram, masked, b, k, windows, steps, seed):
    """The last record of each of ``windows`` independent runs of ``steps`` steps of the one-process
    estimator (k micro-batches of b sequences drawn from the pool with replacement, as
    ``_steps`` draws them), its squared norms taken from the Gram matrix of the exact per-example
    gradients (|Σ c·g_i|² = c²·1ᵀK1, c = 1 / (b·k·m̂/m̄) as in the run), folded by ``NoiseScale``."""
    n, kb = gram.shape[0], k * b
    idx = torch.randint(0, n, (windows, steps, kb), generator=torch.Generator().manual_seed(seed))
    m_step = masked[idx].sum(-1)  # [W, S] the step's masked tokens
    c2 = (masked.mean() * kb / m_step / kb / kb) ** 2  # (m̄ / (b·k·m̂))²
    sub = gram[idx.unsqueeze(-1), idx.unsqueeze(-2)]  # [W, S, kb, kb]
    blocks = sub.reshape(windows, steps, k, b, k, b)
    small = torch.diagonal(blocks, dim1=2, dim2=4).sum((2, 3, 4)) * c2  # Σ_j |d_j|² (micro-batch shares)
    big = sub.sum((-1, -2)) * c2
    out = []
    for w in range(windows):
        noise = NoiseScale(b, kb, n_sequences=kb, scale_small=k, kind="micro")
        for s in range(steps):
            noise.reset()
            noise.add_small(float(small[w, s]))
            noise.add_big(float(big[w, s]))
            noise.count(int(m_step[w, s]))
            f = noise.step_fields()
        out.append(f)
    return out


@pytest.mark.timeout(600)
def test_interval_covers_the_exact_noise_scale(truth, noisy_truth):
    """90 % Fieller intervals after 60 steps (Kish's n_eff ≈ 35) cover the exact B_simple in >= 80 %
    of 150 independent windows each: B_big = 8 against B_simple ≈ 2.6 (init, skewed unigram) and
    B_big = 8 against B_simple ≈ 60 (B_big far below: the point estimate's 10-90 % range spans a
    factor of several, and the interval must say so, mostly open above, rather than miss)."""
    _, _, exact = truth
    cases = [("init", exact["gram"], exact["masked"], exact["trace"] / exact["grad_sq"], 2, 4),
             ("noisy, one process", *noisy_truth, 2, 4), ("noisy, 2 ranks", *noisy_truth, 4, 2)]
    for name, gram, masked, b_true, b, k in cases:
        fields = _window_fields(gram, masked, b, k, windows=150, steps=60, seed=b * 10 + k)
        covered = [f["b_simple_low"] <= b_true <= (f["b_simple_high"] or math.inf) for f in fields]
        bounded = [f["b_simple_high"] is not None for f in fields]
        ratios = torch.tensor([f["b_simple"] / b_true for f in fields if f["b_simple"]])
        q = ratios.quantile(torch.tensor([0.1, 0.9], dtype=ratios.dtype)).tolist()
        print(f"{name}: B_simple {b_true:.1f}, B_big {b * k}: coverage {sum(covered) / len(covered):.2f}, "
              f"bounded {sum(bounded) / len(bounded):.2f}, point estimate 10-90 % {q[0]:.2f}-{q[1]:.2f} x truth")
        assert sum(covered) >= 0.8 * len(covered), (name, sum(covered))
        assert all(f["b_simple_low"] is not None for f in fields)
        if b_true < b * k:  # where the batches resolve it, the interval is bounded and tight
            assert sum(bounded) == len(bounded) and q[1] / q[0] < 1.5, (name, q)
    assert noisy_truth[2] > 6 * 8  # the second case really is the hard one


def test_fieller_interval_closed_forms():
    # no spread: the point; a small spread: the delta method's ratio ± q·se to first order
    assert fieller_interval(6.0, 2.0, 0.0, 0.0, 0.0, 1.645) == pytest.approx((3.0, 3.0))
    lo, hi = fieller_interval(100.0, 10.0, 1.0, 0.01, 0.0, 1.645)
    se = 10.0 * math.sqrt(1.0 / 100.0 ** 2 + 0.01 / 10.0 ** 2)  # delta method
    assert (lo, hi) == pytest.approx((10.0 - 1.645 * se, 10.0 + 1.645 * se), rel=2e-3)
    # the denominator within its error (10² < 1.645² · 50): open above
    lo, hi = fieller_interval(100.0, 10.0, 1.0, 50.0, 0.0, 1.645)
    assert hi is None and 0.0 < lo < 10.0


def test_count_sketch_is_unbiased_and_linear():
    """E|S x|² = |x|² over the sketch's offsets, the mean within 3 standard errors; S is linear;
    n <= bins is exact."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=g) * torch.linspace(0.1, 3.0, 10_000)  # uneven mass
    y = torch.randn(10_000, generator=g)
    sketch = CountSketch(bins=256, seed=1)
    ests = torch.tensor([float(sketch(x, offset=o).double().square().sum()) for o in range(256)])
    want = float(x.double().square().sum())
    assert abs(float(ests.mean()) / want - 1) < 3 * float(ests.std()) / math.sqrt(256) / want + 1e-9
    assert float(ests.std()) / want < math.sqrt(2 / 256) * 1.5  # the AMS bound, about √(2/m)
    assert torch.allclose(sketch(x + 2 * y, offset=5), sketch(x, offset=5) + 2 * sketch(y, offset=5), atol=1e-3)
    small = torch.randn(100, generator=g)
    assert float(sketch(small, offset=7).square().sum()) == pytest.approx(float(small.square().sum()), rel=1e-5)


def test_state_dict_continues_the_averages():
    a, b = NoiseScale(2, 8), NoiseScale(2, 8)
    for i in range(12):
        a.reset()
        a.add_small(5.0 + i % 3)
        a.add_big(2.0 + i % 2)
        fa = a.step_fields()
    b.load_state_dict(a.state_dict())
    for ns in (a, b):
        ns.reset()
        ns.add_small(6.0)
        ns.add_big(2.5)
    assert b.step_fields() == a.step_fields() and a.step_fields()["b_simple_low"] is not None
    with pytest.raises(ValueError, match="missing 'means'"):
        b.load_state_dict({"masked": [0, 0], "steps": 1})
    assert fa["b_simple_low"] is not None


# -- the comm-hook path (DDP) and FSDP2's reduce-scatter feed the observer the right norms ----------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MB, ACCUM, WORLD = 2, 2, 2


def _rank_micro_batches(pool: dict[str, torch.Tensor], rank: int) -> list[dict[str, torch.Tensor]]:
    start = rank * MB * ACCUM
    return [{k: v[start + j * MB: start + (j + 1) * MB] for k, v in pool.items()} for j in range(ACCUM)]


def _hook_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    device = torch.device("cpu")
    assert dist.init_distributed("gloo", 60.0, device)
    try:
        pool, out = _pool(WORLD * MB * ACCUM, seed=3), {}
        for sharding in ("ddp", "fsdp"):
            cfg = TrainConfig(data_dir="-", run_dir="-", parallel={"sharding": sharding},
                              batch={"micro_batch_size": MB, "grad_accum_steps": ACCUM})
            rt = build_runtime(cfg, _model(), device)  # its noise scale: an observer in the collectives
            rt.comm.reset()
            rt.forward_backward(_rank_micro_batches(pool, rank))
            rt.clip_grad_norm(float("inf"))  # as the loop does: under DDP the norm is |G_big| (gns "params")
            out[sharding] = rt.comm.step_fields()
            # its parameters' hooks (kind "params") must not keep it, its model and its group's sockets alive:
            # a failed rank's peers fail at once only when the sockets close (test_data_changes)
            model_ref, runtime_ref = weakref.ref(rt.parts.stages[0]), weakref.ref(rt)
            del rt
            gc.collect()
            out[f"{sharding}_freed"] = (runtime_ref() is None, model_ref() is None)
        out["compression"] = _compression_runs(rank, world, device)
        torch.save(out, pathlib.Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.teardown()


PSGD_STEPS = 16


def _compression_runs(rank: int, world: int, device: torch.device) -> dict[str, list[dict]]:
    """PSGD_STEPS steps at frozen weights (``_half_learnt``: B_simple above the batch of 8) on fresh
    batches (the same for every run) through DDP's composed hook: the plain all-reduce; PowerSGD
    (rank 1, compressed from step 3) with the noise scale as ``for_run`` builds it for PowerSGD
    (sketching); and PowerSGD with the norms of the local and the reduced bucket (kind "average"),
    the reduced one compressed. The sums ride a sideband all-reduce, as in the training loop. Returns each
    run's records."""
    pool, out = _pool(PSGD_STEPS * WORLD * MB * ACCUM, seed=11), {}
    for name, compression in (("none", "none"), ("powersgd", "powersgd"), ("powersgd_compressed_norms", "powersgd")):
        cfg = TrainConfig(data_dir="-", run_dir="-", batch={"micro_batch_size": MB, "grad_accum_steps": ACCUM},
                          parallel={"grad_compression": compression, "powersgd_rank": 1, "powersgd_start_iter": 2})
        rt = build_runtime(cfg, _half_learnt(_model(), pool, share=0.7), device)  # DDP, the compression hook
        assert rt.noise.kind == {"none": "params", "powersgd": "sketch"}[compression]  # as for_run builds it
        if name == "powersgd_compressed_norms":  # the norms of the local and the reduced (compressed) buckets
            rt.noise = NoiseScale(MB * ACCUM, world * MB * ACCUM, ranks=world, rank=rank, kind="average")
            rt.comm.observers = [rt.noise]
        timer = rt.comm
        records = []
        for step in range(PSGD_STEPS):
            timer.reset()
            rt.parts.zero_grad(set_to_none=True)
            part = {k: v[step * WORLD * MB * ACCUM:(step + 1) * WORLD * MB * ACCUM] for k, v in pool.items()}
            rt.forward_backward(_rank_micro_batches(part, rank))
            summed = timer.sideband(device)
            torch.distributed.all_reduce(summed)
            timer.receive(summed)
            rt.clip_grad_norm(float("inf"))  # the loop's order: the sideband, then the clip
            records.append(timer.step_fields())
        out[name] = records
    return out


def test_ddp_hook_and_fsdp_reduce_scatter_give_the_two_batch_norms(tmp_path):
    """2 ranks x 2 micro-batches of 2: |G_small|² is the mean over ranks of the squared norm of a
    rank's gradient (b·k = 4 sequences, per m̂), |G_big|² that of the global one (8 sequences); FSDP2
    (one reduce-scatter per micro-batch) pairs b = 2 with R·b = 4, k times. Under PowerSGD (same
    spawn, ``_compression_runs``) the sketched estimate follows the plain all-reduce's step by step."""
    mp.spawn(_hook_worker, args=(WORLD, _free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    pool, model = _pool(WORLD * MB * ACCUM, seed=3), _model()
    m_hat = float((pool["labels"] != -100).sum()) / (WORLD * MB * ACCUM)  # masked tokens per sequence

    def mean_grad(batch):  # Σ_i s_i / (n_sequences · m̂): the mean per-example gradient
        model.zero_grad()
        model(batch["input_ids"], attention_mask=None, labels=batch["labels"]).loss_sum.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double() / (batch["input_ids"].shape[0] * m_hat)

    ranks = [_rank_micro_batches(pool, r) for r in range(WORLD)]
    whole = lambda bs: {k: torch.cat([b[k] for b in bs]) for k in bs[0]}  # noqa: E731
    g_rank = [mean_grad(whole(mbs)) for mbs in ranks]
    g_big = mean_grad(pool)
    ddp = {"gns_sq_small": sum(float(g @ g) for g in g_rank) / WORLD, "gns_sq_big": float(g_big @ g_big)}
    g_micro = [[mean_grad(mbs[j]) for j in range(ACCUM)] for mbs in ranks]  # [rank][micro]
    g_micro_big = [sum(g_micro[r][j] for r in range(WORLD)) / WORLD for j in range(ACCUM)]
    fsdp = {"gns_sq_small": sum(float(g @ g) for gs in g_micro for g in gs) / (WORLD * ACCUM),
            "gns_sq_big": sum(float(g @ g) for g in g_micro_big) / ACCUM}
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for sharding, want, b in (("ddp", ddp, (MB * ACCUM, WORLD * MB * ACCUM)), ("fsdp", fsdp, (MB, WORLD * MB))):
            f = got[sharding]
            assert got[f"{sharding}_freed"] == (True, True), sharding  # runtime and model gone once dropped
            assert (f["gns_b_small"], f["gns_b_big"]) == b
            for key in want:
                assert f[key] == pytest.approx(want[key], rel=1e-4), (sharding, key)
            assert f["b_simple_tokens"] == pytest.approx(f["b_simple"] * m_hat, rel=1e-6)
        # PowerSGD: the same batches, the noise scale from the sketched uncompressed buckets
        runs = got["compression"]
        full = runs["none"][0]["comm_bytes"]
        assert all(r["comm_bytes"] < full / 2 for r in runs["powersgd"][2:])  # really compressed
        plain, sketched = runs["none"][-1]["b_simple"], runs["powersgd"][-1]["b_simple"]
        print(f"rank {rank}: B_simple plain {plain:.2f}, PowerSGD sketched {sketched:.2f}")
        assert sketched == pytest.approx(plain, rel=0.15)
        assert runs["powersgd"][-1]["gns_sketch_bins"] and runs["none"][-1]["gns_sketch_bins"] is None
        for key in ("gns_sq_small", "gns_sq_big"):  # every step's norms, sketched: AMS error ~√(2/m) = 2 %
            ratios = [b[key] / a[key] for a, b in zip(runs["none"], runs["powersgd"])]
            assert max(abs(r - 1) for r in ratios) < 0.08, (key, ratios)
        # the check has teeth: the compressed bucket's own norm (how it was measured before) is far off
        wrong = [c["gns_sq_big"] / a["gns_sq_big"] for a, c in zip(runs["none"], runs["powersgd_compressed_norms"])]
        assert max(abs(r - 1) for r in wrong[2:]) > 0.3, wrong


def test_two_batch_estimates_and_ema():
    # E|G_B|² = |G|² + tr/B with |G|² = 2, tr = 8: B = 2 gives 6, B = 8 gives 3
    assert two_batch_estimates(6.0, 3.0, 2, 8) == pytest.approx((2.0, 8.0))
    with pytest.raises(ValueError, match="b_small < b_big"):
        two_batch_estimates(1.0, 1.0, 4, 4)
    ema = BiasCorrectedEMA(0.9)
    assert ema.get() is None and ema.update(5.0) == pytest.approx(5.0)  # bias-corrected: the first value
    assert ema.update(1.0) == pytest.approx((0.9 * 0.1 * 5 + 0.1 * 1) / (1 - 0.81))
    assert NoiseScale.for_run(micro_batch_size=4, grad_accum_steps=1, dp=1, sharding="none") is None


def test_micro_batch_path_leaves_the_accumulated_gradient_unchanged():
    """One process with the noise scale: the micro-batches' gradients, summed by the runtime's
    micro-batch path, equal plain accumulation's (a runtime of one micro-batch a step has no noise
    scale), and its two sums are those micro-batch norms (k·|d_j|² and |Σ d_j|²)."""
    pool = _pool(8, seed=5)
    micro = [{k: v[j * 2:(j + 1) * 2] for k, v in pool.items()} for j in range(4)]
    plain, noisy = _model(), _model()
    cpu = torch.device("cpu")
    plain_rt = build_runtime(TrainConfig(data_dir="-", run_dir="-", batch={"micro_batch_size": 2}), plain, cpu)
    assert plain_rt.noise is None
    plain_rt.forward_backward(micro)
    rt = build_runtime(TrainConfig(data_dir="-", run_dir="-", batch={"micro_batch_size": 2, "grad_accum_steps": 4}),
                       noisy, cpu)
    noise = rt.noise
    rt.forward_backward(micro)
    for p, q in zip(plain.parameters(), noisy.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    f = noise.step_fields()
    total = torch.cat([p.grad.reshape(-1) for p in plain.parameters()]).double()
    assert f["gns_sq_big"] == pytest.approx(float(total @ total), rel=1e-5)
    assert (f["gns_b_small"], f["gns_b_big"]) == (2, 8) and f["b_simple"] is not None
