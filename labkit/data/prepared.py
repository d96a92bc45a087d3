"""What a prepared work directory holds, read back from its artifacts: ``preparation_report``.

The numbers of notebook 01, ``labkit prepare`` and the demo's lesson 1, for any corpus (ELF
functions, text documents, or both): per source kind what it gave, documents after each stage,
tokens, the sizes the study's "2 TB became 25 GB" compares. Reads ``corpus/corpus.json``,
``clean/docs.drops.json``, the clean parts, ``shards/index.json`` and
``tokenizer/tokenizer.stats.json`` under a work directory (``labkit.workdir``); writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from labkit.workdir import paths

__all__ = ["preparation_report"]


def preparation_report(workdir: str) -> dict:
    """Numbers of the data preparation, read back from the artifacts, for whatever the corpus
    held (ELF functions, text documents, or both): documents left after each stage, tokens,
    token share per source group before and after balancing, the UNK rate on held-out
    documents, and the sizes behind lesson 1 (docs/results.md defines them):

    - unk_rate_held_out: the share of [UNK] among the tokens of the tokenizer's held-out
      documents (``unk_rate_documents`` of them, text the tokenizer never saw, its alphabet
      included; ``labkit.data.tokenize.train_tokenizer``), unk_rate_by_script: the same per
      script ({script: rate}, ``labkit.data.tokenize.script_of``), unk_examples: what became
      [UNK]. ``heldout_documents`` is another set: the documents the shards hold out for the
      held-out loss;

    - kinds: the source kinds read (elf, text, jsonl, parquet); sources: per kind, files_read,
      raw_bytes (whole input files read), documents (read) and kept (after cleaning and dedup);
      examples: per kind, the start (240 characters) of its first kept document;
    - dataset_bytes: the document dataset as first written, with its metadata
      (corpus/part-*.parquet on disk: id, source, name, address, arch, n_bytes, text): for ELF
      input the study's "dataset of functions" (2 TB);
    - training_data_bytes: what training reads (the shards, the held-out file and index.json);
    - training_to_dataset_ratio = training_data_bytes / dataset_bytes: the study's 25 GB / 2 TB
      = 0.0125 (lesson 1: "training data is 0.0125x the function dataset"); above 1 when the
      training data is the larger;
    - only when ELF files were read: functions, elf_files_read, machine_code_bytes (sum of the
      extracted functions' sizes, corpus n_bytes) and disassembly_bytes (their normalised text).

    Bytes are raw integers; ``labkit.tables.show`` displays them in GB."""
    p = paths(workdir)
    corpus = json.loads((p["corpus"] / "corpus.json").read_text())
    drops = json.loads(p["clean"].with_name("docs.drops.json").read_text())
    index = json.loads((p["shards"] / "index.json").read_text())
    stats_path = p["tokenizer"].with_name("tokenizer.stats.json")
    tok = json.loads(stats_path.read_text()) if stats_path.exists() else {}
    balance = index.get("balance", {})
    stages = drops.get("stages", {"corpus": drops["input"], "near_dedup": drops["kept"]})
    near = drops.get("near_dedup") or {}
    parts = sorted(p["corpus"].glob("part-*.parquet"))
    dataset = sum(f.stat().st_size for f in parts)
    training = index["n_bytes"] + sum(s["n_bytes"] for s in index.get("heldout", {}).get("shards", [])) \
        + (p["shards"] / "index.json").stat().st_size
    sources = _sources_report(corpus, parts, p["clean"])
    report = {
        "kinds": list(sources),
        "sources": {k: {key: v[key] for key in ("files_read", "raw_bytes", "documents", "kept")}
                    for k, v in sources.items()},
        "examples": {k: v["example"] for k, v in sources.items() if v["example"] is not None},
        "files_read": corpus["files_read"],
        "raw_bytes": corpus["raw_bytes"],
        "documents_kept": drops["kept"],
        "dropped": drops["dropped"],
        "documents_per_stage": {"read": corpus.get("documents", corpus["functions"]),
                                **{f"after_{k}": v for k, v in stages.items() if k != "corpus"},
                                "in_shards": index["n_documents"]},
        "skipped_inputs": corpus["skipped"],
        "near_dedup_docs_per_s": near.get("docs_per_s"),
        "vocab_size": index["vocab_size"],
        "unk_rate_held_out": tok.get("unk_rate"),
        "unk_rate_by_script": {k: v["unk_rate"] for k, v in tok["by_script"].items()} if "by_script" in tok else None,
        "unk_rate_documents": tok.get("held_out_docs"),
        "unk_examples": tok.get("unk_examples"),
        "tokens": index["n_tokens"],
        "sequences": index["n_sequences"],
        "seq_len": index["seq_len"],
        "shard_bytes": index["n_bytes"],
        "dataset_bytes": dataset,
        "training_data_bytes": training,
        "training_to_dataset_ratio": round(training / dataset, 4) if dataset else None,
        "heldout_documents": index.get("heldout", {}).get("n_documents", 0),
        "source_share_before": balance.get("share_before"),
        "source_share_after": balance.get("share_after"),
    }
    if "elf" in sources:
        elf_parts = [f for f, kind in zip(parts, _part_kinds(corpus, len(parts))) if kind == "elf"]
        report |= {"functions": corpus["functions"], "elf_files_read": sources["elf"]["files_read"],
                   "machine_code_bytes": int(pl.scan_parquet(elf_parts).select(pl.col("n_bytes").cast(pl.Int64).sum())
                                             .collect().item()) if elf_parts else 0,
                   "disassembly_bytes": sources["elf"]["text_bytes"],
                   "functions_left_out": corpus.get("dropped_functions", {})}
    return report


def _part_kinds(corpus: dict, n_parts: int) -> list[str]:
    """The source kind of each corpus part: ``corpus.json``'s part_kinds, else (a corpus of an
    earlier labkit, which wrote ELF parts only when it had no text) "elf" for every part."""
    return corpus.get("part_kinds") or ["elf" if corpus.get("functions") else "text"] * n_parts


def _sources_report(corpus: dict, parts: list[Path], clean: Path) -> dict[str, dict]:
    """Per source kind: corpus.json's counts, ``kept`` (the kept documents whose ``source`` file
    was read as that kind) and ``example`` (the first kept document's first 240 characters).
    ``clean``: the kept documents, a directory of parts (``labkit.lab.clean_corpus``) or one
    Parquet file (``labkit.data.clean.clean_corpus`` in one process)."""
    kinds = _part_kinds(corpus, len(parts))
    sources = corpus.get("sources") or {  # corpus.json of an earlier labkit: the totals, by the one kind
        kinds[0] if kinds else "elf": {key: corpus[key] for key in ("files_read", "raw_bytes", "text_bytes")}
        | {"documents": corpus.get("documents", corpus["functions"])}}
    out = {k: dict(v, kept=0, example=None) for k, v in sources.items()}
    kind_of: dict[str, str] = {}  # source file -> the kind it was read as (each part holds one kind)
    for part, kind in zip(parts, kinds):
        for src in pl.scan_parquet(part).select(pl.col("source").unique()).collect()["source"].to_list():
            kind_of.setdefault(src, kind)
    files = sorted(clean.glob("*.parquet")) if clean.is_dir() else [clean] if clean.is_file() else []
    if not files or not kind_of:
        return out
    kept = (pl.scan_parquet(files).select(pl.col("source").replace_strict(kind_of, default=None).alias("kind"), "text")
            .group_by("kind", maintain_order=True).agg(pl.len().alias("n"), pl.col("text").first().str.slice(0, 240))
            .collect())
    for kind, n, text in kept.iter_rows():
        if kind in out:
            out[kind]["kept"], out[kind]["example"] = int(n), text
    return out
