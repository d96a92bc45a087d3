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
# # 04 · Scaling: throughput vs ranks, micro-batch vs model size, and the planner
#
# Two of the study's lessons, measured here: data-parallel training scales near-linearly
# (weak scaling: the same micro-batch per rank, efficiency = tokens/s(n) / (n x tokens/s(1))),
# and larger models fit smaller micro-batches. On CPU the "device memory" is a stated budget
# per rank: the model state a DDP rank holds (fp32 weights, gradients as DDP's buckets, two AdamW
# moments) plus the training step's own peak (the bytes autograd saves for backward, the held
# logits and the backward's temporaries), counted exactly (`labkit.study.memory.plan_model`).
#
# Points already measured (in `sweeps/*.parquet`) are not rerun. The second half plans the
# study's scale from formulas (`labkit.study.plan`, `labkit.study.scaling`): memory per GPU, the largest
# micro-batch, parallel splits, and data-parallel efficiency up to 256 GPUs.

# %% tags=["parameters"]
workdir = "../work/demo"
engines = 2
cluster_id = None  # a running cluster to use (its id; labkit demo passes its own); None: start engines here
model = "mini"
micro_batch_size = 16
sweep_steps = 8  # optimiser steps per point of the rank sweep (the first 2 untimed)
size_steps = 5  # per model of the throughput-per-model-size sweep: 3 timed steps of the largest model
sweep_models = ["mini", "small"]
memory_budget_gib = 2.0
loader_workers = [0, 1, 2]
loader_step_time_s = 0.02  # consumer step in the loader sweep (a planned GPU step)
study_seq_len = 512  # sequence length assumed for the study's models (not reported)

# %%
import polars as pl

from labkit import cluster as lc
from labkit import lab, plots

index = lab.require_prepared(workdir)  # the shards of notebook 01; stops here, in one line, without them
plots.setup_notebook_plotting()
cluster = lc.start_cluster(engines) if cluster_id is None else lc.connect_cluster(cluster_id)
client = lc.get_client(cluster)
staged = lab.stage(client, workdir)

# %% [markdown]
# ## Throughput vs ranks

# %%
base = lab.sweep_config(workdir, model=model, max_steps=sweep_steps, batch={"micro_batch_size": micro_batch_size})
ranks = lab.sweep_ranks(client, base, workdir, staged=staged)
print(lab.reused_note(ranks) or "every point measured now")  # read back from an earlier sweep: when, at what load
ranks

# %%
this = ranks.filter((pl.col("model") == model) & (pl.col("micro_batch_size") == micro_batch_size))  # this sweep's rows
plots.throughput_figure(this, title=f"Data-parallel scaling of {model}: micro-batch {micro_batch_size} per rank of "
                                    f"{index['seq_len']} tokens (weak scaling), {sweep_steps} steps per point")

# %% [markdown]
# ### Scaling table with exposed communication
# `comm_exposed_s`: the gradient all-reduce time of a step that backward did not hide (from the
# last gradient ready to the end of the last all-reduce; docs/measurement.md), mean over the
# timed steps of each run, and its share of the step. It is 0 at one rank; where it is a small
# share, what the efficiency still loses is compute (memory bandwidth, cores), not the network.

# %%
ranks.select("ranks", "model", "micro_batch_size", "tokens_per_s", "efficiency", "comm_exposed_s",
             "comm_exposed_fraction", "load_avg_1m")

# %% [markdown]
# ## Largest micro-batch per model size

# %%
mb = lab.sweep_micro_batch(client, sweep_models, seq_len=index["seq_len"], vocab_size=index["vocab_size"],
                           budget_bytes=int(memory_budget_gib * 2**30), workdir=workdir)
print(lab.reused_note(mb) or "every point measured now")
mb

# %%
plots.microbatch_figure(mb)

# %% [markdown]
# ### The count and the formula that explains it
# The sweep's answer is `plan_model`'s count; `labkit.study.plan.activation_terms` writes the
# same bytes as a formula (fp32 on CPU, SDPA's math path with attention dropout): its bytes
# per sequence equal the counted ones. The transients (held logits, their gradient, the
# backward's temporaries) are counted only: the formula explains the saved activations.

# %%
from labkit.study import parallel, plan
from labkit.model import count_parameters, model_config

rows = []
for r in mb.iter_rows(named=True):
    cfg = model_config(r["model"], index["vocab_size"])
    formula = (plan.saved_activation_bytes(cfg, r["seq_len"], 3, precision="fp32", attention="eager", device="cpu")
               - plan.saved_activation_bytes(cfg, r["seq_len"], 2, precision="fp32", attention="eager", device="cpu"))
    rows.append({"model": r["model"], "max_micro_batch (counted)": r["max_micro_batch"],
                 "bytes per sequence (counted)": r["act_bytes_per_sample"], "bytes per sequence (formula)": formula,
                 "transient bytes (counted)": r.get("transient_bytes")})
pl.DataFrame(rows)

# %% [markdown]
# ### A GPU plan, counted
# The same counting answers for a GPU: `plan_model` runs the step on this CPU and keeps what CUDA
# keeps (its fused attention kernel, 1-byte dropout masks, its fp32 autocast ops), stating each
# choice. Here this notebook's model on an H100 NVL in bf16, beside the formula planner
# (`plan.memory_plan`) at the counted micro-batch. `labkit plan --model-module FILE.py:FACTORY`
# does the same for a model you wrote yourself.

# %%
from labkit.study.memory import labkit_model, plan_model

mcfg = model_config(model, index["vocab_size"])
counted = plan_model(*labkit_model(mcfg, index["seq_len"]), device="H100 NVL", precision="bf16", name=model)
formula = plan.planned_max_micro_batch(mcfg, device="H100 NVL", seq_len=index["seq_len"], precision="bf16")
print("\n".join(counted["corrections"]))
pl.DataFrame([{"model": model, "seq_len": index["seq_len"], "counted max micro-batch": counted["max_micro_batch"],
               "formula max micro-batch": formula["max_micro_batch"],
               "counted GB per sequence": (counted["activation_bytes_per_sequence"]
                                           + counted["transient_terms"]["held_outputs_per_sequence"]
                                           + counted["transient_terms"]["backward_per_sequence"]) / 1e9,
               "FLOPs per token (FlopCounterMode)": counted["flops_per_token"]}])

# %% [markdown]
# ## Throughput per model size at all ranks

# %%
sizes = lab.sweep_model_size(client, base.replace(max_steps=size_steps), workdir, models=sweep_models, staged=staged)
print(lab.reused_note(sizes) or "every point measured now")
sizes

# %% [markdown]
# ## Loader workers: the knee
# Samples/s and the share of each step spent waiting for data, with 0, 1, 2 ... workers in
# front of a consumer that takes `loader_step_time_s` per batch.

# %%
try:
    loader = lab.sweep_loader_workers(client, workdir, batch_size=micro_batch_size,
                                      step_time_s=loader_step_time_s, workers=loader_workers, staged=staged)
    print(lab.reused_note(loader) or "every point measured now")
except ImportError as err:
    loader = None
    print(f"loader sweep skipped: {err}")
plots.loader_figure(loader.filter((pl.col("batch_size") == micro_batch_size)  # this sweep's consumer
                                  & (pl.col("step_time_s_planned") == loader_step_time_s))) if loader is not None else None

# %%
if cluster_id is None:  # engines this notebook started; a cluster it connected to keeps running
    lc.stop_cluster(cluster)
else:
    client.close()

# %% [markdown]
# ## The study's scale, planned
# Memory per H100 NVL (94 GB) for the study's two models: the largest micro-batch for each
# setting the study does not report, beside the micro-batches it does report (184 and 20).
# Rows within 10 % of the reported value are the settings that reproduce it.

# %%
table = parallel.study_table()
shown = ("model", "seq_len", "precision", "attention", "sparse_head", "planned", "study")
table.filter(pl.col("within_10pct")).select(shown)

# %%
table.filter(pl.col("seq_len") == study_seq_len).sort("model", "precision", "attention").select(shown)

# %%
plans = []
for name, b in plan.STUDY_MICRO_BATCH.items():
    cfg = model_config(name, plan.STUDY_VOCAB)
    for att in plan.ATTENTION:
        p = plan.memory_plan(cfg, seq_len=study_seq_len, micro_batch=b, precision="bf16", attention=att)
        plans.append(p | {"label": f"{name} b={b} {att}"})
plots.memory_figure(pl.DataFrame(plans), capacity_bytes=plan.device_info("H100 NVL")["memory_bytes"],
                    title=f"Planned memory per H100 NVL at the study's micro-batches (seq {study_seq_len}, bf16)")

# %% [markdown]
# ### When data parallelism alone cannot hold the model
# A 48-layer encoder of width 6144 (about 22 B parameters) on 16 H100 NVL: every split
# dp x tp x pp with ZeRO 0-3, and the first that fits (least model parallelism first, tensor
# parallelism kept inside a node). The bubble is GPipe's (p - 1)/(m + p - 1) at m = 8.

# %%
big = model_config("bert-1.3b", plan.STUDY_VOCAB, hidden_size=6144, num_heads=48, num_layers=48,
                   intermediate_size=None)
print(f"{count_parameters(big)['total'] / 1e9:.1f} B parameters")
splits = parallel.parallel_plans(big, n_gpus=16, seq_len=study_seq_len, micro_batch=4)
fit = parallel.first_fit(splits)
no_zero = parallel.first_fit(splits.filter(pl.col("zero_stage") == 0))
for what, row in (("first split that fits", fit), ("first split without ZeRO", no_zero)):
    print(f"{what}:", {k: row[k] for k in ("dp", "tp", "pp", "zero_stage", "total", "bubble")} if row else None)
splits.select("dp", "tp", "pp", "zero_stage", (pl.col("total") / 1e9).round(1).alias("GB per GPU"), "fits",
              pl.col("bubble").round(3)).head(12)

# %% [markdown]
# ## Data-parallel efficiency from 1 to 256 GPUs
# Step time = compute + the exposed part of DDP's bucketed ring all-reduce (`labkit.study.scaling`):
# 25 MB buckets, 2 GPUs per node, 25 GbE between nodes (InfiniBand for comparison), fp32
# gradients, compute at 40 % MFU with the dense MLM head (the setting that reproduces the
# study's 120M micro-batch, above) counted in FLOPs. The line "measured here (model)" is the same model
# calibrated from this machine's measured 1-rank step time.

# %%
from labkit.study import scaling

curves = []
for name, b in plan.STUDY_MICRO_BATCH.items():
    for net in ("25GbE", "IB-NDR"):
        t = scaling.study_scaling(name, micro_batch=b, seq_len=study_seq_len, network=net, sparse_head=False)
        curves.append(t.with_columns(label=pl.lit(f"{name} b={b} {net}")))
one = ranks.filter(pl.col("ranks") == 1).row(0, named=True)
step_1 = one["micro_batch_size"] * index["seq_len"] / one["tokens_per_s"]
here = scaling.efficiency_table(compute_s=scaling.calibrate(step_1),
                                grad_bytes=4 * count_parameters(model_config(model, index["vocab_size"]))["total"],
                                tokens_per_step=one["micro_batch_size"] * index["seq_len"], gpus_per_node=engines)
curves.append(here.with_columns(label=pl.lit(f"{model} here (model)")))
pred = pl.concat(curves)
plots.efficiency_figure(pred, measured=ranks, title=f"Data-parallel efficiency vs GPUs: seq_len {study_seq_len}, "
                        "40 % MFU, fp32 gradients in 25 MB buckets, 2 GPUs per node")

# %% [markdown]
# ### Why the model and the measurement differ on this machine
# The model counts one cost of data parallelism: the part of the gradient all-reduce that
# backward cannot hide, over the link between the ranks. Here the ranks are engines on one
# machine, so that link is a copy through loopback, and the model predicts almost no loss. The
# measurement pays for more: the ranks share this machine's cores, memory bandwidth and caches,
# and whatever else was running (each point records the 1-minute load average). Comparing the
# step time per rank at 1 and at n ranks with the model's exposed all-reduce shows which one
# the gap is.

# %%
from labkit import tables

n = int(this["ranks"].max())
at = {r["ranks"]: r for r in this.iter_rows(named=True)}
step = {k: at[k]["micro_batch_size"] * index["seq_len"] * k / at[k]["tokens_per_s"] for k in (1, n)}  # s per step
modelled = here.filter(pl.col("n_gpus") == n).row(0, named=True)
extra = step[n] - step[1]
why = {"ranks": n, "measured efficiency": at[n]["efficiency"], "modelled efficiency": modelled["efficiency"],
       "step time per rank at 1 rank (s)": step[1], f"step time per rank at {n} ranks (s)": step[n],
       "measured extra time per step (s)": extra,
       "modelled exposed all-reduce per step (s)": modelled["exposed_s"],
       "1-minute load average / usable CPUs": {f"{k} rank(s)": f"{at[k].get('load_avg_1m')} / {at[k].get('cpu_count')}"
                                             for k in (1, n)}}
if "comm_exposed_s" in this.columns:  # the measured exposed communication, where the sweep recorded it
    why["measured exposed communication per step (s)"] = at[n]["comm_exposed_s"]
if extra > 2 * modelled["exposed_s"]:
    why["reading"] = (f"the ranks' steps got {extra:.3g} s slower, {extra / max(modelled['exposed_s'], 1e-9):.0f}x "
                      "the exposed all-reduce the model counts: the gap is mostly ranks slowing each other's compute "
                      "on shared cores and memory (and other load), which a network model does not describe")
tables.show(why, title=f"Model vs measurement at {n} ranks")

# %%
summary = []
for name, b in plan.STUDY_MICRO_BATCH.items():
    for accum in (1, 4, 16):
        t = scaling.study_scaling(name, micro_batch=b, seq_len=study_seq_len, grad_accum=accum, sparse_head=False)
        summary.append({"model": name, "micro_batch": b, "grad_accum": accum,
                        "efficiency_256_gpus": t.filter(pl.col("n_gpus") == 256)["efficiency"].item(),
                        **scaling.network_limit(t)})
pl.DataFrame(summary)

# %% [markdown]
# ### One story for lessons 4 and 5
# The settings under which both hold at once: the planner's max micro-batch within 10 % of the
# study's (lesson 5) and efficiency >= 0.9 at 256 GPUs on 25 GbE (lesson 4), searched over
# sequence length, precision, attention, head and achieved MFU (`labkit.study.scaling.one_story`).
# Memory does not depend on MFU, so lesson 5 fixes the candidates; "max_mfu" is the largest
# MFU (against the bf16 peak) at which lesson 4 then holds.

# %%
scaling.one_story()

# %% [markdown]
# ## The study as its authors ran it: precision explains lesson 4
# The authors' code (configs/study.toml: undertale-re/undertale at be7ec98) trains the 120M model
# in fp32 (Lightning's default, no TF32) at 184 functions of 512 tokens per GPU. The same model,
# batch and 25 GbE network, planned in three precisions (`labkit.study.scaling.precision_experiment`,
# each at the file's [plan] mfu of its own dense peak: fp32 60, TF32 417.5, bf16 835.5 TFLOP/s on
# an H100 NVL): a slow fp32 step hides the all-reduce of its fp32 gradients behind backward, a
# tensor-core step does not.

# %%
import pathlib

import labkit
from labkit.config.tomlfile import load as load_config
from labkit.train.run_config import model_config_of

study = load_config(pathlib.Path(labkit.__file__).resolve().parent.parent / "configs" / "study.toml")
study_model = model_config_of(study.train, study.plan.vocab_size)
precisions = scaling.precision_experiment(study_model, micro_batch=study.train.batch.micro_batch_size,
                                          seq_len=study.shards.seq_len, device=study.plan.device,
                                          network=study.plan.network, gpus_per_node=study.plan.gpus_per_node,
                                          mfu=study.plan.mfu)
fig = plots.efficiency_figure(precisions.with_columns(label=pl.col("precision")),
                              title=f"The study's 120M model, micro-batch {study.train.batch.micro_batch_size}, "
                                    f"{study.plan.network}: efficiency per precision")
fig.add_hrect(y0=0.9, y1=1.0, fillcolor="green", opacity=0.12, line={"width": 1, "color": "green"},
              annotation_text="the study: near-linear to 256 GPUs", annotation_position="bottom left")
fig

# %%
scaling.precision_summary(precisions, mfu=study.plan.mfu)

# %% [markdown]
# ## A network that really limits
# Everything above ran with the ranks on one machine, where the "network" is a memory copy and
# never the limit. `labkit sweep network CONFIG` (as root) makes the regime the planner predicts
# for the study real: it trains this model on 2 ranks across two network hosts (network
# namespaces joined by a virtual link, `labkit.testing.realcluster.NetHosts`) with the link shaped by a
# token-bucket filter to each bandwidth in turn, and writes `sweeps/network.parquet`: tokens/s,
# efficiency against 1 rank, exposed communication and bytes per step, each beside the network
# model's prediction (`labkit.study.scaling.link_step_time`: the 1-rank compute time, the run's
# gradient buckets, the link's measured bandwidth). The x-axis is the link time of one step's
# gradients over the compute time: above 1 the link cannot keep up, whatever the overlap.
# Without the sweep's file this section shows the model alone for this model, calibrated from
# the 1-rank step measured above; with bf16 gradient compression (`TrainConfig.parallel.grad_compression`)
# the bytes halve.

# %%
grad_bytes = 4 * count_parameters(model_config(model, index["vocab_size"]))["total"]
bucket = 25 * 2**20  # DDP's default cap: the model's gradients in buckets of at most 25 MiB
modelled_net = []
for mbit in (10000, 3000, 1000, 500, 200, 100, 50, 20):
    for kind, nbytes in (("none", grad_bytes), ("bf16", grad_bytes // 2)):
        buckets = [min(bucket, nbytes - k) for k in range(0, nbytes, bucket)]
        p = scaling.link_step_time(compute_s=step[1], bucket_bytes=buckets, bandwidth=mbit * 1e6 / 8)
        modelled_net.append({"grad_compression": kind, "rate_mbit": mbit, "link_over_compute": nbytes * 8 / (mbit * 1e6) / step[1],
                             "efficiency": step[1] / p["step_s"], "exposed_s": p["exposed_s"]})
modelled_net = pl.DataFrame(modelled_net)
net_file = pathlib.Path(workdir) / "sweeps" / "network.parquet"
measured_net = pl.read_parquet(net_file) if net_file.exists() else None
plots.network_figure(modelled_net, measured=measured_net, model=model,
                     title=f"Data-parallel efficiency of {model} at 2 ranks against the link (step {step[1]:.3g} s "
                           f"at 1 rank, micro-batch {micro_batch_size}, seq_len {index['seq_len']})")

# %%
if measured_net is not None:
    shown_net = measured_net.select("model", "grad_compression", "rate_mbit", "link_mbit", "comm_bytes", "efficiency",
                                    "comm_exposed_s", "step_s", "predicted_step_s", "predicted_ratio", "load_avg_1m")
else:
    shown_net = modelled_net
shown_net
