"""Scaling-law fit and compute-optimal allocation against closed-form and published values."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from labkit.study.laws import CHINCHILLA, EPOCH_REFIT, LawParams, check_allocation, compute_optimal, fit_law


def test_compute_optimal_matches_reference_values():
    # docs/references.md C3 (derived): at C = 1e19, Chinchilla gives N 2.28e8, D 7.31e9, L 2.99;
    # the Epoch refit gives N 2.62e8, D 6.36e9, L 2.93.
    c = compute_optimal(1e19, CHINCHILLA)
    assert c["n_params"] == pytest.approx(2.28e8, rel=0.01)
    assert c["n_tokens"] == pytest.approx(7.31e9, rel=0.01)
    assert c["loss"] == pytest.approx(2.99, abs=0.01)
    assert 6 * c["n_params"] * c["n_tokens"] == pytest.approx(1e19, rel=1e-9)
    e = compute_optimal(1e19, EPOCH_REFIT)
    assert e["n_params"] == pytest.approx(2.62e8, rel=0.01)
    assert e["n_tokens"] == pytest.approx(6.36e9, rel=0.01)
    assert e["loss"] == pytest.approx(2.93, abs=0.01)


def test_compute_optimal_is_the_minimum_along_the_iso_flop_line():
    c = compute_optimal(3e20)
    ns = np.geomspace(c["n_params"] / 10, c["n_params"] * 10, 2001)
    losses = CHINCHILLA.loss(ns, 3e20 / (6 * ns))
    assert ns[np.argmin(losses)] == pytest.approx(c["n_params"], rel=0.01)


def test_fit_recovers_chinchilla_constants_from_synthetic_points():
    rng = np.random.default_rng(0)
    n = np.repeat(np.geomspace(5e7, 1e10, 8), 6)
    d = np.tile(np.geomspace(1e9, 5e11, 6), 8)
    loss = CHINCHILLA.loss(n, d) * np.exp(rng.normal(0, 1e-4, n.size))
    fit = fit_law(n, d, loss)
    law = fit["law"]
    assert law.alpha == pytest.approx(CHINCHILLA.alpha, abs=0.01)
    assert law.beta == pytest.approx(CHINCHILLA.beta, abs=0.01)
    assert law.E == pytest.approx(CHINCHILLA.E, rel=0.02)
    assert law.A == pytest.approx(CHINCHILLA.A, rel=0.15)
    assert law.B == pytest.approx(CHINCHILLA.B, rel=0.15)
    grid_n = np.geomspace(1e8, 1e10, 5)
    assert law.loss(grid_n, 20 * grid_n) == pytest.approx(CHINCHILLA.loss(grid_n, 20 * grid_n), rel=2e-3)


def test_check_allocation_flags_oversized_and_undersized_models():
    opt = compute_optimal(1e21)
    assert check_allocation(opt["n_params"], opt["n_tokens"])["verdict"] == "ok"
    big = check_allocation(opt["n_params"] * 20, opt["n_tokens"] / 20)
    assert big["verdict"] == "model too large for its data" and big["loss_given_up"] > 0.01
    small = check_allocation(opt["n_params"] / 20, opt["n_tokens"] * 20)
    assert small["verdict"] == "model too small for its data" and small["loss_given_up"] > 0.01


def test_bad_input():
    with pytest.raises(ValueError, match="flops"):
        compute_optimal(0)
    with pytest.raises(ValueError, match="at least 5"):
        fit_law([1e8] * 3, [1e9] * 3, [3.0] * 3)
    with pytest.raises(ValueError, match="positive"):
        fit_law([1e8, -1, 1, 1, 1], [1e9] * 5, [3.0] * 5)
    assert LawParams(E=1, A=0, B=0, alpha=1, beta=1).loss(1e9, 1e9) == 1


def test_refinements_that_run_off_are_discarded(monkeypatch):
    import labkit.study.laws as laws

    assert not laws._usable(torch.tensor([0.0, 0.0, 800.0, 0.3, 0.3]))  # exp(800) overflows
    assert not laws._usable(torch.tensor([5.0, 5.0, 0.0, -0.1, 0.3]))
    assert laws._usable(torch.tensor([6.0, 6.0, 0.5, 0.34, 0.28]))
    # every refinement rejected: the best grid start comes back, finite, instead of an overflow
    monkeypatch.setattr(laws, "_usable", lambda theta: False)
    n = np.repeat(np.geomspace(5e7, 1e10, 4), 3)
    d = np.tile(np.geomspace(1e9, 5e11, 3), 4)
    law = fit_law(n, d, CHINCHILLA.loss(n, d))["law"]
    assert law.alpha in (0.1, 0.3, 0.5, 1.0) and law.beta in (0.1, 0.3, 0.5, 1.0)
    assert np.isfinite([law.E, law.A, law.B]).all()


def test_objective_gradient_matches_autograd():
    # the closed-form gradient that L-BFGS-B follows, against torch's autograd of the same objective
    import labkit.study.laws as laws

    rng = np.random.default_rng(3)
    n = np.geomspace(1e5, 1e7, 9)
    d = np.geomspace(1e6, 1e8, 9)[rng.permutation(9)]
    log_l = np.log(CHINCHILLA.loss(n, d) * np.exp(rng.normal(0, 3e-3, 9)))  # residuals either side of delta
    for theta in ([6.0, 7.0, 0.5, 0.34, 0.28], [2.0, 9.0, -0.3, 0.7, 0.45]):
        t = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
        terms = torch.stack([t[0] - t[3] * torch.from_numpy(np.log(n)), t[1] - t[4] * torch.from_numpy(np.log(d)),
                             t[2].expand(9)], dim=-1)
        r = torch.logsumexp(terms, -1) - torch.from_numpy(log_l)
        ref = torch.where(r.abs() <= 1e-3, 0.5 * r**2, 1e-3 * (r.abs() - 0.5e-3)).sum()
        ref.backward()
        obj, grad = laws._objective(np.array(theta), np.log(n), np.log(d), log_l, 1e-3, grad=True)
        assert obj == pytest.approx(ref.item(), rel=1e-12)
        np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-9, atol=1e-15)


def test_fit_on_points_that_do_not_pin_the_exponents_stays_usable_and_beats_every_start(monkeypatch):
    # a bootstrap resample of labkit demo's scaling-law points (3 widths, 60 steps): three model
    # sizes, so a and alpha can grow together. Unbounded, L-BFGS runs off the usable range (alpha
    # 19) and the refinement is discarded: the fit returns its grid start. Bounded, it stops inside.
    import labkit.study.laws as laws

    n = [105511, 105511, 414695, 414695, 27719, 27719, 414695, 414695, 27719, 27719, 414695, 105511, 27719,
         414695, 27719, 105511, 105511, 105511]
    d = [30720, 40960, 20480, 61440, 10240, 30720, 30720, 61440, 51200, 61440, 40960, 20480, 51200, 30720,
         51200, 20480, 61440, 40960]
    loss = [3.6761, 3.6267, 3.6836, 3.6397, 6.3253, 4.5771, 3.6385, 3.6397, 3.7109, 3.6427, 3.6368, 4.2368,
            3.7109, 3.6385, 3.7109, 4.2368, 3.6231, 3.6267]
    starts = np.array(list(itertools.product((0, 5, 10, 15, 20), (0, 5, 10, 15, 20), (-1, 0, 0.5, 1),
                                             (0.1, 0.3, 0.5, 1.0), (0.1, 0.3, 0.5, 1.0))), dtype=np.float64)
    best_start = laws._objective(starts, *np.log([n, d, loss]), 1e-3).min()
    fit = fit_law(n, d, loss, top_k=1)
    law = fit["law"]
    assert fit["objective"] < 0.6 * best_start
    assert 0 < law.alpha < 10 and 0 < law.beta < 10 and np.isfinite([law.E, law.A, law.B]).all()
    monkeypatch.setattr(laws, "_BOUNDS", None)  # the same refinement without the box
    assert fit_law(n, d, loss, top_k=1)["objective"] == pytest.approx(best_start)
