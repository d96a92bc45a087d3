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
# # 02 · Stage to node-local disk, then load MLM batches
#
# The study's second lesson: copy the prepared dataset to every node's local disk before
# training. One engine per node copies the shard set to a temporary directory, verifies every
# shard's sha256 against `index.json`, and renames it into place; a verified copy already
# there is kept. The copy each rank reads is then memory-mapped and masked for MLM
# (15 % of tokens; of those 80 % `[MASK]`, 10 % random, 10 % unchanged).

# %% tags=["parameters"]
workdir = "../work/demo"
engines = 2
cluster_id = None  # a running cluster to use (its id; labkit demo passes its own); None: start engines here
model = "mini"
micro_batch_size = 16

# %%
import polars as pl

from labkit import cluster as lc
from labkit import lab, plots

lab.require_prepared(workdir)  # the shards of notebook 01; stops here, in one line, without them
plots.setup_notebook_plotting()
cluster = lc.start_cluster(engines) if cluster_id is None else lc.connect_cluster(cluster_id)
client = lc.get_client(cluster)

# %%
staged = lab.stage(client, workdir)
pl.DataFrame(list(staged.values()))

# %%
plots.staging_figure(staged)

# %% [markdown]
# ## One masked batch from the staged copy

# %%
from labkit.data.mlm import make_loader
from labkit.data.shards import read_index
from labkit.data.tokenize import load_tokenizer

path = next(iter(staged.values()))["path"]
index = read_index(path)
loader = make_loader(path, batch_size=micro_batch_size, rank=0, world_size=1, seed=0,
                     mlm_probability=0.15, vocab_size=index["vocab_size"])
batch = next(iter(loader))
{k: (tuple(v.shape), str(v.dtype)) for k, v in batch.items()}

# %%
tok = load_tokenizer(f"{workdir}/tokenizer/tokenizer.json")
ids, labels = batch["input_ids"][0], batch["labels"][0]
shown = [tok.id_to_token(int(i)) + (f"→{tok.id_to_token(int(l))}" if l != -100 else "")
         for i, l in zip(ids[:48], labels[:48])]
print(" ".join(shown))

# %%
real = batch["attention_mask"]
masked = batch["labels"] != -100
print(f"masked {int(masked.sum())} of {int(real.sum())} real tokens "
      f"({float(masked.sum() / real.sum()):.3f}; expected about 0.15 of non-special tokens)")

# %%
if cluster_id is None:  # engines this notebook started; a cluster it connected to keeps running
    lc.stop_cluster(cluster)
else:
    client.close()
