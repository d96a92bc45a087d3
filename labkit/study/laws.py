"""Scaling laws: fit L(N, D) = E + A / N^alpha + B / D^beta and allocate compute.

The functional form and fitting procedure are Chinchilla's (Hoffmann et al. 2022,
arXiv:2203.15556, section 3.3 and appendix D.2): minimise the Huber loss (delta = 1e-3) between
the predicted and observed log loss, with the prediction written as a log-sum-exp

    log L_hat = LSE(a - alpha log N, b - beta log D, e),   A = exp(a), B = exp(b), E = exp(e),

by L-BFGS from a grid of starting points, keeping the best (here scipy's L-BFGS-B on the
objective's closed-form gradient, bounded to ``_BOUNDS``). N is the parameter count, D the
number of training tokens. The fits published for decoders on web text are constants here
(``CHINCHILLA``, ``EPOCH_REFIT``); for MLM on code keep the form and refit the constants.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["CHINCHILLA", "EPOCH_REFIT", "check_allocation", "compute_optimal", "fit_law", "LawParams", "training_flops"]


@dataclass(frozen=True, kw_only=True)
class LawParams:
    """Constants of L(N, D) = E + A / N^alpha + B / D^beta (loss in nats per token)."""

    E: float
    """Irreducible loss."""
    A: float
    """Model-size coefficient."""
    B: float
    """Data-size coefficient."""
    alpha: float
    """Model-size exponent."""
    beta: float
    """Data-size exponent."""

    def loss(self, n_params, n_tokens):
        """Predicted loss for parameter count(s) N and token count(s) D (floats or arrays)."""
        n = np.asarray(n_params, dtype=np.float64)
        d = np.asarray(n_tokens, dtype=np.float64)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta


CHINCHILLA = LawParams(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
"""Chinchilla's published fit (arXiv:2203.15556, eq. 10 / appendix D.2)."""

EPOCH_REFIT = LawParams(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658)
"""Besiroglu et al.'s refit of Chinchilla's data (arXiv:2404.10102), quoted second-hand."""


def training_flops(n_params: float, n_tokens: float) -> float:
    """Training compute C = 6 N D FLOPs (Kaplan et al., arXiv:2001.08361, eq. 2.2)."""
    return 6.0 * n_params * n_tokens


def compute_optimal(flops: float, law: LawParams = CHINCHILLA) -> dict[str, float]:
    """Loss-minimising N and D for a FLOP budget C under C = 6 N D.

    N_opt = G (C/6)^a, D_opt = G^-1 (C/6)^b with a = beta/(alpha+beta), b = alpha/(alpha+beta),
    G = (alpha A / (beta B))^(1/(alpha+beta)) (arXiv:2203.15556, appendix D.2, eq. 4).
    Returns {"flops", "n_params", "n_tokens", "tokens_per_param", "loss"}.
    Raises ValueError for a non-positive budget.
    """
    if not flops > 0:
        raise ValueError(f"flops: must be positive, got {flops}")
    s = law.alpha + law.beta
    g = (law.alpha * law.A / (law.beta * law.B)) ** (1.0 / s)
    n = g * (flops / 6.0) ** (law.beta / s)
    d = (flops / 6.0) ** (law.alpha / s) / g
    return {"flops": flops, "n_params": n, "n_tokens": d, "tokens_per_param": d / n,
            "loss": float(law.loss(n, d))}


def check_allocation(n_params: float, n_tokens: float, law: LawParams = CHINCHILLA, *,
                     tolerance: float = 0.01) -> dict:
    """Compare a planned run with the compute-optimal allocation of the same FLOPs.

    Returns {"loss", "optimal": compute_optimal(...), "loss_given_up", "verdict", "message"}:
    verdict is "ok" when the predicted loss is within ``tolerance`` nats of the optimum, else
    "model too large for its data" (N > N_opt) or "model too small for its data".
    """
    flops = training_flops(n_params, n_tokens)
    opt = compute_optimal(flops, law)
    loss = float(law.loss(n_params, n_tokens))
    gap = loss - opt["loss"]
    if gap <= tolerance:
        verdict = "ok"
    elif n_params > opt["n_params"]:
        verdict = "model too large for its data"
    else:
        verdict = "model too small for its data"
    message = (f"N={n_params:.3g}, D={n_tokens:.3g} ({n_tokens / n_params:.1f} tokens/param): predicted loss "
               f"{loss:.4f}; the compute-optimal N={opt['n_params']:.3g}, D={opt['n_tokens']:.3g} for the same "
               f"{flops:.3g} FLOPs reaches {opt['loss']:.4f} ({gap:.4f} nats given up): {verdict}")
    return {"loss": loss, "optimal": opt, "loss_given_up": gap, "verdict": verdict, "message": message}


def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float,
               *, grad: bool = False):
    """The summed Huber loss of ``theta`` [..., 5] = (a, b, e, alpha, beta) on the points (float64
    arrays [points]): shape [...]; with ``grad`` also its gradient [..., 5] (closed form: the
    log-sum-exp's softmax weights times the Huber derivative, clipped residual)."""
    a, b, e, alpha, beta = np.moveaxis(theta, -1, 0)
    terms = np.stack([a[..., None] - alpha[..., None] * log_n, b[..., None] - beta[..., None] * log_d,
                      np.broadcast_to(e[..., None], (*e.shape, log_n.shape[0]))], axis=-1)  # [..., points, 3]
    top = terms.max(-1, keepdims=True)
    w = np.exp(terms - top)
    total = w.sum(-1, keepdims=True)
    r = (top + np.log(total))[..., 0] - log_l  # residual of log L_hat [..., points]
    ar = np.abs(r)
    obj = np.where(ar <= delta, 0.5 * r**2, delta * (ar - 0.5 * delta)).sum(-1)
    if not grad:
        return obj
    h = np.clip(r, -delta, delta)[..., None] * (w / total)  # dHuber/dr x d(LSE)/d(term) [..., points, 3]
    g = np.stack([h[..., 0].sum(-1), h[..., 1].sum(-1), h[..., 2].sum(-1),
                  -(h[..., 0] * log_n).sum(-1), -(h[..., 1] * log_d).sum(-1)], axis=-1)
    return obj, g


_BOUNDS = [(-199.0, 199.0)] * 3 + [(1e-3, 9.99)] * 2
"""L-BFGS-B's box for (a, b, e, alpha, beta): inside ``_usable``'s range, so that a refinement
along a direction the points do not pin down (few distinct N or D: a and alpha grow together)
stops at the edge of the usable range instead of running off it and being discarded."""


def _usable(theta) -> bool:
    """A refined (a, b, e, alpha, beta) that maps to finite constants with positive exponents.
    L-BFGS on a few degenerate points (a bootstrap resample, say) can run off to exp overflow."""
    a, b, e, alpha, beta = (float(x) for x in theta)
    return (all(math.isfinite(x) for x in (a, b, e, alpha, beta)) and max(abs(a), abs(b), abs(e)) < 200
            and 0 < alpha < 10 and 0 < beta < 10)


def fit_law(n_params, n_tokens, losses, *, delta: float = 1e-3, top_k: int = 8,
            grid: dict[str, tuple[float, ...]] | None = None) -> dict:
    """Fit L(N, D) = E + A/N^alpha + B/D^beta to observed (N, D, L) points, Chinchilla-style.

    Huber loss (delta) on log L; every grid start is scored, the ``top_k`` best are refined with
    L-BFGS-B (float64, scipy; inside ``_BOUNDS``), and the lowest objective wins. Default grid (arXiv:2203.15556 D.2 uses a
    finer one): alpha, beta in {0.1, 0.3, 0.5, 1.0}, e in {-1, 0, 0.5, 1}, a, b in {0, 5, 10, 15, 20}.

    A refinement that leaves the usable range (non-finite, |log constant| >= 200, exponents
    outside (0, 10)) is discarded; if all are, the best grid start is returned.
    Inputs are 1-D sequences of equal length >= 5 (five unknowns). Returns {"law": LawParams,
    "objective", "n_points", "starts"}. Raises ValueError on mismatched lengths, too few
    points or non-positive values.
    """
    n = np.asarray(n_params, dtype=np.float64)
    d = np.asarray(n_tokens, dtype=np.float64)
    l = np.asarray(losses, dtype=np.float64)
    if not (n.shape == d.shape == l.shape) or n.ndim != 1:
        raise ValueError(f"n_params, n_tokens, losses: need 1-D arrays of one length, got {n.shape}, {d.shape}, {l.shape}")
    if n.size < 5:
        raise ValueError(f"losses: need at least 5 points to fit 5 constants, got {n.size}")
    if (n <= 0).any() or (d <= 0).any() or (l <= 0).any():
        raise ValueError("n_params, n_tokens, losses: all values must be positive")
    grid = grid or {"a": (0, 5, 10, 15, 20), "b": (0, 5, 10, 15, 20), "e": (-1, 0, 0.5, 1),
                    "alpha": (0.1, 0.3, 0.5, 1.0), "beta": (0.1, 0.3, 0.5, 1.0)}
    from scipy.optimize import minimize

    log_n, log_d, log_l = np.log(n), np.log(d), np.log(l)
    starts = np.array(list(itertools.product(grid["a"], grid["b"], grid["e"], grid["alpha"], grid["beta"])),
                      dtype=np.float64)
    scores = _objective(starts, log_n, log_d, log_l, delta)
    best_theta, best_obj = None, math.inf
    for idx in np.argsort(scores, kind="stable")[:top_k]:
        with np.errstate(over="ignore", invalid="ignore"):  # a start that runs off is discarded below
            res = minimize(lambda t: _objective(t, log_n, log_d, log_l, delta, grad=True), starts[idx], jac=True,
                           method="L-BFGS-B", bounds=_BOUNDS,
                           options={"maxiter": 500, "maxcor": 50, "ftol": 1e-15, "gtol": 1e-12})
        obj = float(_objective(res.x, log_n, log_d, log_l, delta))
        if _usable(res.x) and obj < best_obj:
            best_obj, best_theta = obj, res.x
    if best_theta is None:  # every refinement ran off (few, degenerate points): keep the best start
        best_theta = starts[int(np.argmin(scores))]
        best_obj = float(scores.min())
    a, b, e, alpha, beta = best_theta.tolist()
    law = LawParams(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta)
    return {"law": law, "objective": best_obj, "n_points": int(n.size), "starts": int(starts.shape[0])}
