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
# # 00 · The cluster
#
# labkit drives one ipyparallel engine per GPU. Here the cluster is the embedded default:
# local engines on this machine, CPU tensors, the gloo backend. On a Slurm cluster the same
# calls start engines with ipyparallel's Slurm launcher (see `docs/slurm.md`).
#
# Engine ids are not ranks: labkit asks every engine where it runs, groups engines by node,
# and assigns `RANK`, `LOCAL_RANK`, `NODE_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`
# in one pure function.

# %% tags=["parameters"]
workdir = "../work/demo"  # where every artifact of the lab goes
engines = 2  # local engines, one per (simulated) GPU
cluster_id = None  # a running cluster to use (its id; labkit demo passes its own); None: start engines here
model = "mini"
micro_batch_size = 16

# %%
import polars as pl

from labkit import cluster as lc
from labkit import plots

plots.setup_notebook_plotting()
cluster = lc.start_cluster(engines) if cluster_id is None else lc.connect_cluster(cluster_id)
client = lc.get_client(cluster)
print(f"{len(client.ids)} engines connected")

# %% [markdown]
# ## Where each engine runs, and the ranks labkit gives it

# %%
infos = lc.engine_info(client)
pl.DataFrame(infos)

# %%
env = lc.assign_ranks(infos, master_port=29500)
nodes = {i["engine_id"]: i["node"] for i in infos}
ranks = pl.DataFrame([{"engine_id": eid, "node": nodes[eid], **e} for eid, e in sorted(env.items())])
ranks

# %%
plots.topology_figure(ranks)

# %% [markdown]
# ## A collective across all ranks
#
# Each rank contributes `rank + 1` to an all-reduce; every rank must see the same sum,
# `world_size * (world_size + 1) / 2`.

# %%
from labkit.train.dist import all_reduce_smoke_test

results = lc.run_ddp(client, all_reduce_smoke_test)
pl.DataFrame(results)

# %%
if cluster_id is None:  # engines this notebook started; a cluster it connected to keeps running
    lc.stop_cluster(cluster)
else:
    client.close()
