"""The local critical batch from branch losses: efficiencies, the batch that keeps pace, the
noise scale the branches imply, and their bootstrap intervals (``labkit.study.branching`` trains
the branches; definitions in docs/measurement.md, "The critical batch by branching").

Inputs at one branch point (step S of the base run, global batch B): per held-out sequence i the
summed masked-token loss of the checkpoint ``l0[i]`` and of each branch at the end of its window
``lk[r, j, i]`` (repeat r, factor k_j, the factor 1 first), and the masked-token counts ``m[i]``
(the evaluation masks are fixed, so the same for all). Then, with L = Σ l / Σ m:

- progress p_rj = L0 − L_rj (nats per masked token gained over the window of Δ examples);
- efficiency e_j = Σ_r p_rj / Σ_r p_r1: the branch's progress per example relative to the base
  batch's (1 at k = 1; McCandlish et al. 2018, arXiv:1812.06162, eq. 2.11 predicts
  e(k) = (B_noise + B)/(B_noise + kB) while the loss falls about linearly over the window);
- keeps pace: e_j >= 1 − tolerance. The local critical batch (Merrill et al. 2025,
  arXiv:2505.23971) is B·k*, k* where e, linear in log2 k between the factors, first falls below
  1 − tolerance after a prefix of factors that keep pace; every factor keeping pace: at least
  B·k_max (``censored``);
- the noise scale the branches imply: B_noise minimising Σ_j (e_j − (B_noise + B)/(B_noise + k_j B))²
  on a log grid (``GRID``): the same quantity as the in-run B_simple and a batch sweep's B_crit,
  so the three can be compared.

Intervals: the central ``level`` of the same estimates over bootstrap resamples of the held-out
sequences (paired: one resample for the checkpoint and every branch) and of the repeats (branches
from the same checkpoint over other data windows). The sequences carry the evaluation's sampling,
the repeats the training's; with one repeat the interval holds the first alone.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["GRID", "branch_estimates", "keep_pace", "noise_from_efficiency", "overlap"]

GRID = np.geomspace(1e-3, 1e3, 1201)
"""B_noise / B values the fit searches (0.5 % apart); a fit at the top end is censored."""


def keep_pace(eff: np.ndarray, factors: np.ndarray, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """(k* [...], censored [...]) for efficiencies ``eff`` [..., K] at ``factors`` [K] (ascending,
    factors[0] = 1): k* where e, linear in log2 k, first falls below 1 − tolerance; censored
    (k* = factors[-1]) where every factor keeps pace. NaN rows (no progress at k = 1) give NaN."""
    eff = np.asarray(eff, dtype=float)
    logk = np.log2(np.asarray(factors, dtype=float))
    floor = 1.0 - tolerance
    fails = eff < floor
    fails[..., 0] = False  # the base batch keeps pace with itself
    first = np.where(fails.any(axis=-1), fails.argmax(axis=-1), len(logk))
    censored = first == len(logk)
    j = np.clip(first, 1, len(logk) - 1)
    hi = np.take_along_axis(eff, j[..., None], -1)[..., 0]
    lo = np.take_along_axis(eff, (j - 1)[..., None], -1)[..., 0]
    t = np.clip((lo - floor) / np.where(lo - hi > 0, lo - hi, np.inf), 0.0, 1.0)
    k = np.where(censored, factors[-1], 2.0 ** (logk[j - 1] + t * (logk[j] - logk[j - 1])))
    bad = ~np.isfinite(eff).all(axis=-1)
    return np.where(bad, np.nan, k), censored & ~bad


def noise_from_efficiency(eff: np.ndarray, factors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B_noise / B [...], censored [...]): the ``GRID`` value whose e(k) = (x + 1)/(x + k) is
    nearest ``eff`` [..., K] in squared error over the factors; censored at the grid's top end."""
    k = np.asarray(factors, dtype=float)
    model = (GRID[:, None] + 1.0) / (GRID[:, None] + k[None, :])  # [G, K]
    err = ((np.asarray(eff, dtype=float)[..., None, :] - model) ** 2).sum(axis=-1)  # [..., G]
    best = np.nanargmin(np.where(np.isfinite(err), err, np.inf), axis=-1)
    x = GRID[best]
    bad = ~np.isfinite(np.asarray(eff, dtype=float)).all(axis=-1)
    return np.where(bad, np.nan, x), (best == len(GRID) - 1) & ~bad


def _efficiency(l0: np.ndarray, lk: np.ndarray, m: np.ndarray, w: np.ndarray, reps: np.ndarray) -> np.ndarray:
    """Efficiencies [n_boot, K] for sequence weights ``w`` [n_boot, n] and repeat counts ``reps``
    [n_boot, R]: progress per repeat from the weighted sums, summed over repeats, over factor 1's."""
    masked = w @ m  # [b]
    start = (w @ l0) / masked  # [b]
    end = np.einsum("bn,rkn->brk", w, lk) / masked[:, None, None]  # [b, R, K]
    progress = np.einsum("br,brk->bk", reps, start[:, None, None] - end)  # [b, K]
    base = progress[:, :1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(base > 0, progress / base, np.nan)


def branch_estimates(l0: np.ndarray, lk: np.ndarray, m: np.ndarray, factors: list[int], batch: int, *,
                     tolerance: float, n_boot: int = 1000, level: float = 0.9, seed: int = 0) -> dict:
    """The estimates at one branch point (module docstring) and their bootstrap intervals.
    ``l0`` [n], ``lk`` [R, K, n], ``m`` [n] (float), ``factors`` [K] ascending from 1, ``batch``
    the base's global batch B (sequences). Returns {"loss_start", "loss_end" [K] (mean over
    repeats), "efficiency" [K], "b_keep_pace", "b_keep_pace_low", "b_keep_pace_high",
    "b_keep_pace_censored", "b_noise", "b_noise_low", "b_noise_high", "b_noise_censored",
    "level", "n_boot"} in sequences; estimates None when the base batch made no progress.
    ValueError on mismatched shapes or factors not starting at 1."""
    l0, lk, m = (np.asarray(a, dtype=float) for a in (l0, lk, m))
    fac = np.asarray(factors, dtype=float)
    if lk.ndim != 3 or lk.shape[1:] != (len(fac), len(m)) or l0.shape != m.shape or fac[0] != 1 \
            or (np.diff(fac) <= 0).any():
        raise ValueError(f"branch_estimates: need l0 [n], lk [R, K, n], m [n] and ascending factors from 1, got "
                         f"{l0.shape}, {lk.shape}, {m.shape}, {list(factors)}")
    n, reps = len(m), lk.shape[0]
    eff = _efficiency(l0, lk, m, np.ones((1, n)), np.ones((1, reps)))[0]
    rng = np.random.default_rng(seed)
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(float)
    r = rng.multinomial(reps, np.full(reps, 1.0 / reps), size=n_boot).astype(float)
    boot = _efficiency(l0, lk, m, w, r)
    out = {"loss_start": float(l0.sum() / m.sum()), "loss_end": (lk.sum(axis=2) / m.sum()).mean(axis=0).tolist(),
           "efficiency": [None if not math.isfinite(e) else float(e) for e in eff], "level": level,
           "n_boot": n_boot}
    q = [(1 - level) / 2, (1 + level) / 2]
    for name, fn in (("b_keep_pace", lambda e: keep_pace(e, fac, tolerance)),
                     ("b_noise", lambda e: noise_from_efficiency(e, fac))):
        (value,), (cens,) = fn(eff[None, :])
        values, _ = fn(boot)
        values = values[np.isfinite(values)]
        ok = math.isfinite(value)
        lo, hi = np.quantile(values, q) if ok and values.size else (math.nan, math.nan)
        out |= {name: float(value) * batch if ok else None, f"{name}_low": float(lo) * batch if ok else None,
                f"{name}_high": float(hi) * batch if ok else None, f"{name}_censored": bool(cens)}
    return out


def overlap(a: tuple[float | None, float | None, float | None], b: tuple[float | None, float | None, float | None]
            ) -> bool | None:
    """Whether two estimates (value, low, high) agree: their intervals overlap (an estimate without
    an interval is its value alone). None when either value is missing."""
    if a[0] is None or b[0] is None:
        return None
    alo, ahi = (a[1], a[2]) if a[1] is not None and a[2] is not None else (a[0], a[0])
    blo, bhi = (b[1], b[2]) if b[1] is not None and b[2] is not None else (b[0], b[0])
    return alo <= bhi and blo <= ahi
