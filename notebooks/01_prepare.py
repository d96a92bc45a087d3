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
# # 01 · Prepare the data
#
# The study's first lesson: preprocess and tokenize heavily (2 TB of binaries became 25 GB of
# token ids). By default the raw input is this machine's own ELF executables and shared
# libraries: every function symbol is disassembled (capstone + pyelftools) into one document.
# Your own text (plain files, JSONL, Parquet) is the other source: set `text_paths` (and
# `jsonl_paths`, `parquet_paths`) below; without `elf_paths` the corpus is then text only, with
# both it is a mix (docs/data_path.md, "Your own data"). The documents are cleaned, exactly
# deduplicated and near-deduplicated (polars; MinHash LSH), a WordPiece tokenizer is trained
# (HF tokenizers), and the documents are packed into fixed-length token-id shards with an
# `index.json` written last; 1 % of the documents (whole documents) are held out for the
# evaluation loss (`labkit.data.heldout`).
#
# Each stage skips work whose artifact is already complete, so re-running the notebook after
# `make demo` only reads the results back.

# %% tags=["parameters"]
workdir = "../work/demo"
engines = 2
cluster_id = None  # a running cluster to use (its id; labkit demo passes its own); None: start engines here
model = "mini"
micro_batch_size = 16
max_functions = 30_000  # bounded sample of functions to disassemble
vocab_size = 8192
seq_len = 128
heldout_fraction = 0.01  # share of documents held out (by document) for the evaluation loss
elf_paths = None  # ELF files or directories; None: this machine's system directories, or none with text below
text_paths = []  # your own plain-text files or directories (one document per file)
jsonl_paths = []  # JSONL files (one document per line's "text" field)
parquet_paths = []  # Parquet files (one document per row's "text" column)

# %%
import polars as pl

from labkit import cluster as lc
from labkit import lab, plots, tables
from labkit.config import CleanConfig, CorpusConfig, ShardConfig, TokenizerConfig

plots.setup_notebook_plotting()
cluster = lc.start_cluster(engines) if cluster_id is None else lc.connect_cluster(cluster_id)
client = lc.get_client(cluster)

# %% [markdown]
# ## 1. Corpus: documents read on the engines

# %%
corpus_cfg = CorpusConfig(paths=None if elf_paths is None else tuple(elf_paths), text_paths=tuple(text_paths),
                          jsonl_paths=tuple(jsonl_paths), parquet_paths=tuple(parquet_paths),
                          max_functions=max_functions)
corpus = lab.build_corpus(client, corpus_cfg, workdir)
tables.show({k: v for k, v in corpus.items() if k not in ("skipped_files", "config", "part_kinds")}, title="Corpus")

# %%
docs = pl.scan_parquet(f"{workdir}/corpus/part-*.parquet")
docs.select("name", "source", "arch", "n_bytes", "text").head(3).collect()

# %% [markdown]
# ## 2. Clean and deduplicate
# Every dropped document is counted under its reason.

# %%
drops = lab.clean_corpus(client, CleanConfig(), workdir)
plots.drop_reasons_figure(drops)

# %% [markdown]
# ## 3. Tokenizer and shards

# %%
tok_path = lab.build_tokenizer(client, TokenizerConfig(vocab_size=vocab_size), workdir)
index = lab.build_shards(client, ShardConfig(seq_len=seq_len, heldout_fraction=heldout_fraction), workdir)
tables.show({k: v for k, v in index.items() if k not in ("shards", "parts")}, title="Shard index (index.json)")

# %%
from labkit.data.tokenize import load_tokenizer

tok = load_tokenizer(tok_path)
sample = pl.read_parquet(f"{workdir}/clean/docs.parquet", n_rows=1)["text"][0]
print(sample[:400])
print(tok.encode(sample).tokens[:60])

# %% [markdown]
# ## What preprocessing bought
# Like the study's 2 TB -> 25 GB (a dataset of functions to the token ids trained on, 0.0125x):
# the document dataset as first written, with its metadata (`dataset_bytes`, the corpus Parquet
# files) against the training data (`training_data_bytes`: shards, held-out file, index.json),
# as the ratio `training_to_dataset_ratio`. Per source kind (`sources`): the files read and their
# bytes, the documents they gave and how many survived cleaning, with an example of each kind
# (`examples`). For ELF input also the machine code of the functions (`machine_code_bytes`).

# %%
report = lab.preparation_report(workdir)
plots.preparation_figure(report)

# %%
tables.show(report, title="Preparation report (lab.preparation_report; bytes in GB, raw values in the dict)")

# %%
if cluster_id is None:  # engines this notebook started; a cluster it connected to keeps running
    lc.stop_cluster(cluster)
else:
    client.close()
