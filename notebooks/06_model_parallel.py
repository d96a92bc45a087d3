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
# # 06 · Model parallelism: tensor and pipeline splits, measured beside the planner
#
# The study stops at data parallelism and notes that scaling further "would likely necessitate
# model parallelism". Here every split of the engines into data (dp), tensor (tp) and pipeline
# (pp) parallelism trains the same model on the same global batch, through the same training
# loop (`labkit.train.parallel`): tensor parallelism splits each layer's heads and FFN across
# ranks of one node (Megatron-LM, arXiv:1909.08053), here with sequence parallelism
# (arXiv:2205.05198); pipeline parallelism splits the layers into stages that pass micro-batches
# along (GPipe arXiv:1811.06965, 1F1B arXiv:2104.04473).
#
# Each split records three things the planner also predicts: throughput, the pipeline bubble
# (measured: 1 - the stages' compute / the pipeline's time; planned: (p - 1)/(m + p - 1)) and the
# memory of the largest rank (measured from its tensors and the bytes autograd holds for
# backward; planned by `labkit.study.plan.memory_plan`). Splits already measured (in
# `sweeps/parallel.parquet`) are not rerun. On CPU the throughput mostly shows the cost of the
# extra communication; the bubble and the memory are the numbers that carry over to GPUs.

# %% tags=["parameters"]
workdir = "../work/demo"
engines = 2
cluster_id = None  # a running cluster to use (its id; labkit demo passes its own); None: start engines here
model = "mini"
split_micro_batch_size = 4  # sequences per micro-batch at dp = engines; the global batch stays the same
micro_batches = 4  # per step and data-parallel replica: the pipeline's m
split_steps = 5  # optimiser steps per split, the first 2 untimed
study_seq_len = 512

# %%
import polars as pl

from labkit import cluster as lc
from labkit import lab, plots
from labkit.config import TrainConfig

lab.require_prepared(workdir)  # the shards of notebook 01; stops here, in one line, without them
plots.setup_notebook_plotting()
cluster = lc.start_cluster(engines) if cluster_id is None else lc.connect_cluster(cluster_id)
client = lc.get_client(cluster)
staged = lab.stage(client, workdir)

# %% [markdown]
# ## Every split of the engines

# %%
base = lab.sweep_config(workdir, model=model, batch={"micro_batch_size": split_micro_batch_size})
table = lab.sweep_parallel(client, base, workdir, micro_batches=micro_batches, steps=split_steps, staged=staged)
print(lab.reused_note(table) or "every split measured now")  # splits read back from an earlier sweep: when, at what load
table.select("dp", "tp", "pp", "pp_schedule", pl.col("tokens_per_s").round(0),
             pl.col("pipeline_bubble").round(3).alias("bubble"), pl.col("planned_bubble").round(3).alias("planned"),
             pl.col("tp_comm_fraction").round(3).alias("TP comm share"),
             "busy", "reused")  # busy: measured while the load was at least the CPUs, its throughput low

# %%
plots.parallel_figure(table)

# %% [markdown]
# ### The planner against the measurement, per rank
# Model state (parameters, gradients, AdamW's two moments; the local slices of split tensors) and
# the peak of the activations held for backward, in MiB, for the rank that needs the most. The
# planner assumes round(0.15 x T) masked positions in every sequence; with real masking the sparse
# head's last layer runs on each batch's largest count, so the measured activations are a little
# higher where that layer weighs most.

# %%
mib = 2**20
table.select(
    "dp", "tp", "pp", "pp_schedule",
    (pl.col("measured_state_bytes") / mib).round(2).alias("state MiB"),
    (pl.col("measured_activation_bytes") / mib).round(2).alias("activations MiB"),
    (pl.col("planned_activation_bytes") / mib).round(2).alias("planned activations MiB"),
    (pl.col("planned_total_bytes") / pl.col("measured_total_bytes")).round(3).alias("planned / measured"),
)

# %%
if cluster_id is None:  # engines this notebook started; a cluster it connected to keeps running
    lc.stop_cluster(cluster)
else:
    client.close()

# %% [markdown]
# ## From the planner's table to a run
# At the study's scale the planner picks the split (`labkit.study.parallel.parallel_plans`, least
# model parallelism first, tensor parallelism inside a node): for a 22 B encoder on 16 H100 NVL
# the first fit is ZeRO-3 data parallelism, and without ZeRO it is a dp x tp x pp split.
# The plans assume sequence parallelism wherever tp > 1 (`sequence_parallel=True`: tensor
# parallelism alone would keep the residual stream's activations whole on every tp rank), and
# `plan_overrides` turns a row into the `TrainConfig` sections that run it (`parallel`, `batch`),
# `sequence_parallel` among them, so the run splits its activations the way its row was planned.

# %%
from labkit.model import count_parameters, model_config
from labkit.study import parallel, plan

big = model_config("bert-1.3b", plan.STUDY_VOCAB, hidden_size=6144, num_heads=48, num_layers=48,
                   intermediate_size=None)
splits = parallel.parallel_plans(big, n_gpus=16, seq_len=study_seq_len, micro_batch=4, sequence_parallel=True)
print(f"{count_parameters(big)['total'] / 1e9:.1f} B parameters")
for what, rows in (("first fit", splits), ("first fit without ZeRO", splits.filter(pl.col("zero_stage") == 0))):
    fit = parallel.first_fit(rows)
    print(f"{what}:", {k: fit[k] for k in ("dp", "tp", "pp", "zero_stage", "total", "bubble")})
overrides = parallel.plan_overrides(fit)
print("TrainConfig sections of the split without ZeRO:", overrides)
TrainConfig(data_dir=f"{workdir}/shards", run_dir=f"{workdir}/runs/planned", model="bert-1.3b", **overrides)

# %%
splits.filter(pl.col("fits")).select("dp", "tp", "pp", "zero_stage", (pl.col("total") / 1e9).round(1).alias("GB per GPU"),
                                     pl.col("bubble").round(3)).head(8)
