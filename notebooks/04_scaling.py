# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Scaling: throughput vs ranks, micro-batch vs model size
#
# Two of the study's lessons, measured here: data-parallel training scales near-linearly
# (weak scaling: the same micro-batch per rank, efficiency = tokens/s(n) / (n x tokens/s(1))),
# and larger models fit smaller micro-batches. On CPU the "device memory" is a stated budget
# per rank: model state at 16 bytes per parameter (fp32 weights and gradients, two AdamW
# moments) plus the bytes autograd saves for backward, counted exactly.
#
# Points already measured (in `sweeps/*.parquet`) are not rerun.

# %% tags=["parameters"]
workdir = "../work/demo"
engines = 2
model = "mini"
micro_batch_size = 16
sweep_steps = 8
sweep_models = ["mini", "small"]
memory_budget_gb = 2.0

# %%
import polars as pl

from labkit import cluster as lc
from labkit import lab, plots
from labkit.config import TrainConfig
from labkit.data.shards import read_index

plots.setup_notebook_plotting()
cluster = lc.start_cluster(engines)
client = lc.get_client(cluster)
staged = lab.stage(client, workdir)
index = read_index(f"{workdir}/shards")

# %% [markdown]
# ## Throughput vs ranks

# %%
base = TrainConfig(data_dir=f"{workdir}/shards", run_dir=f"{workdir}/runs/sweep", model=model,
                   micro_batch_size=micro_batch_size, max_steps=sweep_steps, warmup_steps=1,
                   num_threads=1, resume=False)
ranks = lab.sweep_ranks(client, base, workdir, staged=staged)
ranks

# %%
plots.throughput_figure(ranks)

# %% [markdown]
# ## Largest micro-batch per model size

# %%
mb = lab.sweep_micro_batch(client, sweep_models, seq_len=index["seq_len"], vocab_size=index["vocab_size"],
                           budget_bytes=int(memory_budget_gb * 2**30), workdir=workdir)
mb

# %%
plots.microbatch_figure(mb)

# %%
lc.stop_cluster(cluster)
