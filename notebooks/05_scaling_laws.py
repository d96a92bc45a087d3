# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Scaling laws: how large a model for how many tokens
#
# Chinchilla's law L(N, D) = E + A/N^α + B/D^β (arXiv:2203.15556), fitted as they did: Huber
# loss on log loss, L-BFGS from a grid of starts (`labkit.study.laws`). Three parts:
#
# 1. the published constants, and what they say about the study's runs;
# 2. a fit on synthetic points generated from those constants, which must give them back;
# 3. a small real fit from tiny CPU runs on this machine's binary code, with its uncertainty
#    from a bootstrap over the points.
#
# The published fits are for decoders on web text. MLM on disassembly supervises only the 15 %
# masked positions, so its constants differ; only the form is carried over.

# %% tags=["parameters"]
workdir = "../work/demo"
law_widths = [32, 64, 128]  # hidden sizes of the tiny encoders (2 layers, 2 heads)
law_steps = 60  # optimiser steps per run
law_micro_batch = 8
law_points = 6  # held-out evaluations per run: its (N, D, eval loss) points
bootstrap = 16  # bootstrap refits for the uncertainty

# %%
import numpy as np
import polars as pl

from labkit import lab, plots
from labkit.study import laws

index = lab.require_prepared(workdir)  # the shards of notebook 01; stops here, in one line, without them
plots.setup_notebook_plotting()

# %% [markdown]
# ## 1. The published law and the study's runs
# The study's 25 GB of token ids is about 12.5 B tokens (uint16, docs/references.md A). How far is
# each of its models from the compute-optimal split of the same FLOPs, under Chinchilla's
# constants?

# %%
study = [laws.check_allocation(n, 12.5e9) | {"model": m} for m, n in (("bert-120m", 120e6), ("bert-350m", 350e6))]
pl.DataFrame([{"model": s["model"], "verdict": s["verdict"], "predicted loss": round(s["loss"], 4),
               "optimal N": f"{s['optimal']['n_params']:.3g}", "optimal D": f"{s['optimal']['n_tokens']:.3g}",
               "loss given up": round(s["loss_given_up"], 4)} for s in study])

# %%
for s in study:
    print(s["message"])

# %% [markdown]
# ## 2. Synthetic points from the published constants give the constants back

# %%
rng = np.random.default_rng(0)
n_syn = np.repeat(np.geomspace(5e7, 1e10, 8), 6)
d_syn = np.tile(np.geomspace(1e9, 5e11, 6), 8)
l_syn = laws.CHINCHILLA.loss(n_syn, d_syn) * np.exp(rng.normal(0, 1e-4, n_syn.size))
syn = laws.fit_law(n_syn, d_syn, l_syn, top_k=2)["law"]
pl.DataFrame({"constant": ["E", "A", "B", "alpha", "beta"],
              "published": [laws.CHINCHILLA.E, laws.CHINCHILLA.A, laws.CHINCHILLA.B, laws.CHINCHILLA.alpha,
                            laws.CHINCHILLA.beta],
              "recovered": [syn.E, syn.A, syn.B, syn.alpha, syn.beta]})

# %% [markdown]
# ## 3. A small real fit from tiny CPU runs
# One single-process run per width at a constant learning rate after warm-up
# (`labkit.study.law_runs.law_config`, below for the first width). Each run evaluates the
# held-out loss `law_points` times (`eval_loss`: whole documents never trained on, the same fixed
# masks every time, dropout off; `labkit.train.evaluation`), and each evaluation is one
# (N, D, loss) point (D = tokens seen). N counts non-embedding parameters (Kaplan's convention).
# A width already trained with these settings on these shards (`sweeps/law_curves.parquet`, its
# `made_by`) is read back, saying when and at what load it was measured; any other is trained
# again. The runs keep no checkpoint.

# %%
from labkit.study.law_runs import law_config, sweep_law_runs

first = law_config(workdir, law_widths[0], steps=law_steps, micro_batch=law_micro_batch, points=law_points)
print({k: getattr(first, k) for k in ("model", "model_overrides", "max_steps", "seed", "batch", "optim", "schedule",
                                      "eval")})
points = sweep_law_runs(workdir, widths=law_widths, steps=law_steps, micro_batch=law_micro_batch, points=law_points)
points.select("width", "n_params", "n_tokens", "loss", "measured_at", "reused")

# %%
fit = laws.fit_law(points["n_params"], points["n_tokens"], points["loss"], top_k=4)
law = fit["law"]
rng = np.random.default_rng(1)
boot = []
for _ in range(bootstrap):
    idx = rng.integers(0, points.height, points.height)
    b = laws.fit_law(points["n_params"].to_numpy()[idx], points["n_tokens"].to_numpy()[idx],
                     points["loss"].to_numpy()[idx], top_k=1)["law"]
    boot.append({"E": b.E, "alpha": b.alpha, "beta": b.beta,
                 "tokens_per_param_at_1e15": laws.compute_optimal(1e15, b)["tokens_per_param"]})
boot = pl.DataFrame(boot)
summary = pl.DataFrame({
    "constant": ["E", "alpha", "beta", "tokens_per_param_at_1e15"],
    "fit": [law.E, law.alpha, law.beta, laws.compute_optimal(1e15, law)["tokens_per_param"]],
    "bootstrap_p05": [boot[c].quantile(0.05) for c in boot.columns],
    "bootstrap_p95": [boot[c].quantile(0.95) for c in boot.columns],
})
summary

# %% [markdown]
# The 5-95 % bootstrap range above is the honest statement of what these runs determine:
# three tiny widths and a few hundred thousand tokens on two CPU cores constrain the
# exponents only loosely, and points from one run's loss curve are not independent runs
# (Chinchilla's third approach trains each (N, D) to completion with its own schedule). The
# fit is a demonstration of the method on real data; a study-scale fit needs real runs.

# %%
budgets = np.geomspace(6 * points["n_params"].min() * points["n_tokens"].min(),
                       6 * points["n_params"].max() * points["n_tokens"].max() * 10, 20)
frontier = pl.DataFrame([laws.compute_optimal(c, law) for c in budgets])
plots.law_figure(points, law, frontier=frontier,
                 title=f"Held-out MLM loss of tiny encoders (widths {law_widths}, {law_steps} steps of "
                       f"{law_micro_batch} sequences) with the fitted law")
