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
# # 03 · Train with DDP, watching it live
#
# `labkit.train.train(config)` runs on every engine under DDP; rank 0 publishes its recent
# metric records and the figure below redraws about once a second while the engines train.
# Every record is also written to the run directory (`metrics.jsonl`), the source of truth.
#
# Every rank also records its own step timeline (data wait, forward, backward, optimiser,
# communication, and when each gradient bucket was ready) and publishes it: the second figure
# shows, ranks by steps, each rank's step time and data wait, where each rank's seconds went,
# the run's goodput so far, and, in its title, the rank that holds the others up and why.
#
# With `run` set to a finished run's directory (`labkit demo` passes the run it has just
# trained, `runs/demo`), the same figures are drawn from that run's files and nothing is trained.

# %% tags=["parameters"]
workdir = "../work/demo"
engines = 2
cluster_id = None  # a running cluster to use (its id; labkit demo passes its own); None: start engines here
model = "mini"
micro_batch_size = 16
steps = 40  # optimiser steps of this notebook's run
run = None  # a finished run to show instead of training one here (labkit demo passes the run it just trained)

# %%
from labkit import cluster as lc
from labkit import lab, plots, rankview, tables
from labkit.config import TrainConfig

index = lab.require_prepared(workdir)  # the shards of notebook 01; stops here, in one line, without them
plots.setup_notebook_plotting()
cluster = lc.start_cluster(engines) if cluster_id is None else lc.connect_cluster(cluster_id)
client = lc.get_client(cluster)

# %%
if run is None:  # train here, watching it live
    held_out = "heldout" in index  # evaluate the held-out loss 4 times if there is a split
    # The run's own fields at the top, the rest by section (TrainConfig's docstring; a dict holds the
    # fields that differ from the section's defaults)
    cfg = TrainConfig(data_dir=f"{workdir}/shards", run_dir=f"{workdir}/runs/notebook-03", model=model,
                      max_steps=steps, num_threads=1, resume=False,
                      data={"tokenizer_path": f"{workdir}/tokenizer/tokenizer.json"},
                      batch={"micro_batch_size": micro_batch_size}, optim={"lr": 1e-3},
                      schedule={"kind": "cosine", "warmup_steps": max(1, steps // 10)},
                      eval={"every": max(1, steps // 4) if held_out else 0},
                      checkpoint={"enabled": False})  # a look at training; the demo's main run keeps its checkpoint
    run_dir = cfg.run_dir
    title = (f"Training loss of {model}: {len(client.ids)} ranks x micro-batch {micro_batch_size} of "
             f"{index['seq_len']} tokens, {steps} steps")
    live = plots.LivePlot(lambda metrics: plots.loss_figure(metrics, title=title))
    ranks = rankview.RankView()  # every rank's timeline: heatmaps, where the seconds went, goodput, the culprit
    result = lab.train_on_cluster(client, cfg, staged=lab.stage(client, workdir), live=[live, ranks])
else:  # a run trained a moment ago (labkit demo's): the same figures, drawn from its files, nothing trained again
    import json

    from IPython.display import display

    from labkit.train.timeline import read_timeline

    run_dir = run
    result = json.loads(open(f"{run_dir}/result.json").read())
    shown = json.loads(open(f"{run_dir}/config.json").read())
    title = (f"Training loss of {shown['model']}: {result['world_size']} ranks x micro-batch "
             f"{shown['batch']['micro_batch_size']} of {index['seq_len']} tokens, {result['steps']} steps ({run_dir})")
    display(plots.loss_figure(lab.read_metrics(run_dir), title=title))
    display(rankview.rank_view_figure(read_timeline(run_dir)))

# %%
tables.show(result, title=f"Result of {run_dir} (result.json)")

# %% [markdown]
# ## Where the time went
# The culprit as the run's result names it (over its timed steps), and its wall-clock goodput:
# the share of the elapsed time spent in productive steps, the rest by cause. The timeline
# exports as a Chrome trace for Perfetto (ui.perfetto.dev).

# %%
from labkit.train.timeline import write_chrome_trace

print((result["culprit"] or {}).get("line", "culprit: none (no rank holds the others up)"))
print("Chrome trace / Perfetto:", write_chrome_trace(run_dir))
rankview.goodput_figure(result, title=f"Goodput of {run_dir} ({result['world_size']} ranks, {result['steps']} steps): "
                                      "its elapsed time by what it was spent on")

# %% [markdown]
# ## The demo's full run
# When `make demo` has run, its longer training run is in `runs/demo`; this notebook's own run
# is the live figure above.

# %%
import os

demo_run = f"{workdir}/runs/demo"
if run is not None and os.path.exists(demo_run) and os.path.samefile(run, demo_run):
    fig = None
    print(f"the figures above are the demo's run ({demo_run})")
elif os.path.exists(f"{demo_run}/metrics.jsonl"):
    demo_metrics = lab.read_metrics(demo_run)
    fig = plots.loss_figure(demo_metrics, title=f"The demo's run ({demo_run}, {demo_metrics['step'].max()} steps)")
else:
    fig = None
    print(f"no demo run in {demo_run} (make demo writes one): the live figure above is this notebook's run")
fig

# %%
if cluster_id is None:  # engines this notebook started; a cluster it connected to keeps running
    lc.stop_cluster(cluster)
else:
    client.close()
