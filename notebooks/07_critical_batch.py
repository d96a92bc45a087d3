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
# # 07 · How far data parallelism helps: the critical batch
#
# Tokens per second measure how fast a cluster runs; they do not say whether a bigger global
# batch buys proportionally more learning. McCandlish et al. 2018 (arXiv:1812.06162): to reach a
# fixed loss, steps S and examples E trade off as (S/S_min − 1)(E/E_min − 1) = 1, and past the
# critical batch B_crit = E_min/S_min more data per step mostly wastes examples. Two ways to
# find it here:
#
# 1. directly: train the same model to the same held-out loss at several global batch sizes
#    (`labkit.study.critical_batch.sweep_batch`, the learning rate scaled by √B from train's lr),
#    record S and E, fit the hyperbola (bootstrap range);
# 2. in every run: the gradient noise scale B_simple = tr(Σ)/|G|² (`labkit.train.gns`, from the
#    micro-batches of each accumulated step here; from the gradient all-reduce under DDP), which
#    McCandlish et al. show predicts B_crit.
#
# Definitions: docs/measurement.md ("Gradient noise scale"). `labkit sweep batch CONFIG` runs the
# same sweep from the command line.

# %% tags=["parameters"]
workdir = "../work/demo"
batch_model = "tiny"  # its own model (not the demo's): five runs must fit in minutes on a CPU
batch_micro_batch = 8  # the largest micro-batch; smaller batches use half their batch
batch_sizes = [4, 8, 16, 32, 64]  # global batches (sequences)
batch_examples = 2048  # sequences each run trains on (32 steps at the largest batch, 512 at the smallest)
lr = 2e-3  # at a global batch of batch_micro_batch; scaled by sqrt(B / batch_micro_batch)
branch_at = [20, 60, 120]  # steps of one run (global batch 2 x batch_micro_batch) to branch from
branch_steps = 160  # that run's schedule length
branch_factors = [1, 2, 4]  # branch batches as multiples of the run's
branch_window = 512  # examples each branch trains on

# %%
import polars as pl

from labkit import lab, plots
from labkit.study.branching import notebook_run, sweep_branch
from labkit.study.critical_batch import batch_base, sweep_batch

index = lab.require_prepared(workdir)  # the shards of notebook 01; stops here, in one line, without them
plots.setup_notebook_plotting()

# %% [markdown]
# ## 1. The same model to the same held-out loss at each batch size
# Each run trains on `batch_examples` sequences in one process; the target is the worst run's best
# held-out loss, so every run reaches it, and S(B) is the (interpolated) step where its held-out
# loss first does. A batch size already trained with these settings on these shards
# (`sweeps/critical_batch_curves.parquet`, its `made_by`) is read back, saying when and at what
# load it was measured; any other is trained again.

# %%
base = batch_base(workdir, model=batch_model, micro_batch=batch_micro_batch, lr=lr)
runs, fit = sweep_batch(base, workdir, batch_sizes=batch_sizes, max_examples=batch_examples)
runs.select("batch", "lr", "steps", "examples", "reached", "b_simple", "final_eval_loss", "measured_at", "reused")

# %%
pl.DataFrame({"quantity": ["B_crit (sequences)", "bootstrap low", "bootstrap high", "S_min", "E_min"],
              "value": [fit["b_crit"], fit["b_crit_low"], fit["b_crit_high"], fit["s_min"], fit["e_min"]]})

# %%
plots.steps_examples_figure(runs.filter(pl.col("reached")), fit,
                            title=f"{batch_model}: steps against examples to held-out loss "
                                  f"{fit['target_eval_loss']:.3f} ({batch_examples:,} sequences per run, lr ∝ √B)")

# %% [markdown]
# ## 2. The in-run noise scale against the measured critical batch
# B_simple of every run against the examples it has seen; the dashed line is B_crit from the fit.
# McCandlish et al. find B_crit ≈ B_simple to within a small factor; both grow as the loss falls.

# %%
curves = pl.read_parquet(f"{workdir}/sweeps/critical_batch_curves.parquet")
plots.noise_scale_figure(curves, b_crit=fit["b_crit"],
                         title=f"Gradient noise scale B_simple of {batch_model} along training, per global batch")

# %%
at_target = runs.filter(pl.col("reached")).select("batch", "b_simple")
ratio = at_target["b_simple"].median() / fit["b_crit"] if at_target["b_simple"].drop_nulls().len() else None
print(f"median in-run B_simple at the target / measured B_crit = {ratio:.2f}" if ratio else "no in-run B_simple")

# %% [markdown]
# ## 3. The critical batch during one run, by branching
# From the checkpoints of one run (`batch_model` at global batch 2 × `batch_micro_batch`, linear
# decay over `branch_steps`), short branches at `branch_factors` × its batch train on the same
# `branch_window` examples at the run's lr scaled by √k (Merrill et al. 2025; `labkit sweep branch`,
# docs/measurement.md). The largest batch whose held-out progress per example stays within 20 %
# of the run's own is the local critical batch; beside it the noise scale the branches imply, the
# run's in-run B_simple and the sweep's B_crit above, each with whether it agrees.

# %%
run = notebook_run(workdir, model=batch_model, micro_batch=batch_micro_batch, lr=lr, steps=branch_steps)
points, branch_runs = sweep_branch(run, workdir, at=branch_at, factors=branch_factors, window=branch_window,
                                   critical_batch=f"{workdir}/sweeps/critical_batch.parquet", n_boot=300)
print("\n".join(points["agreement"]))
plots.critical_batch_figure(points, title=f"{batch_model}: the critical batch along one run at global batch "
                                          f"{2 * batch_micro_batch}, by branches of x{branch_factors} on "
                                          f"{branch_window:,} sequences each")
