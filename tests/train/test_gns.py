"""The gradient noise scale (labkit/train/gns.py) against exact per-example gradients.

At fixed weights of a tiny model, ``torch.func`` (vmap of grad through ``functional_call``) gives
every example's gradient in a pool of N sequences; their mean is G and their (population)
covariance Σ. Steps then draw batches from the pool uniformly with replacement, so the pool is
exactly the distribution the estimator samples and the truth carries no sampling error. The
in-run estimator (``Runtime.forward_backward`` with its ``NoiseScale``, no optimiser step) averaged over
many steps must agree with the truth within a tolerance derived from the steps' own spread (4
standard errors), plus the bias bound of the masked-count normalisation (gns.py: 3·CV(m)²/B_big),
and that tolerance must itself be under 15 %, at several (B_small, B_big). A 2-rank DDP check
shows the comm-hook path feeds the observer the same squared norms as the gradients themselves.
"""

from __future__ import annotations

import math
import os
import pathlib
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from labkit.config import TrainConfig
from labkit.model import BertMLM, model_config
from labkit.train import build_runtime, dist
from labkit.train.gns import BiasCorrectedEMA, NoiseScale, two_batch_estimates

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
    rt = build_runtime(TrainConfig(data_dir="-", run_dir="-", micro_batch_size=b, grad_accum_steps=k), model,
                       torch.device("cpu"))
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
    return model, pool, {"grad_sq": float(mean @ mean), "trace": trace, "cv2": cv2}


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
            cfg = TrainConfig(data_dir="-", run_dir="-", sharding=sharding, micro_batch_size=MB, grad_accum_steps=ACCUM)
            rt = build_runtime(cfg, _model(), device)  # its noise scale: an observer in the collectives
            rt.comm.reset()
            rt.forward_backward(_rank_micro_batches(pool, rank))
            out[sharding] = rt.comm.step_fields()
        torch.save(out, pathlib.Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.teardown()


def test_ddp_hook_and_fsdp_reduce_scatter_give_the_two_batch_norms(tmp_path):
    """2 ranks x 2 micro-batches of 2: |G_small|² is the mean over ranks of the squared norm of a
    rank's gradient (b·k = 4 sequences, per m̂), |G_big|² that of the global one (8 sequences); FSDP2
    (one reduce-scatter per micro-batch) pairs b = 2 with R·b = 4, k times."""
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
            assert (f["gns_b_small"], f["gns_b_big"]) == b
            for key in want:
                assert f[key] == pytest.approx(want[key], rel=1e-4), (sharding, key)
            assert f["b_simple_tokens"] == pytest.approx(f["b_simple"] * m_hat, rel=1e-6)


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
    plain_rt = build_runtime(TrainConfig(data_dir="-", run_dir="-", micro_batch_size=2), plain, cpu)
    assert plain_rt.noise is None
    plain_rt.forward_backward(micro)
    rt = build_runtime(TrainConfig(data_dir="-", run_dir="-", micro_batch_size=2, grad_accum_steps=4), noisy, cpu)
    noise = rt.noise
    rt.forward_backward(micro)
    for p, q in zip(plain.parameters(), noisy.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    f = noise.step_fields()
    total = torch.cat([p.grad.reshape(-1) for p in plain.parameters()]).double()
    assert f["gns_sq_big"] == pytest.approx(float(total @ total), rel=1e-5)
    assert (f["gns_b_small"], f["gns_b_big"]) == (2, 8) and f["b_simple"] is not None
