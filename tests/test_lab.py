"""labkit.lab data stages on a real 2-engine ipyparallel cluster, against single-process runs of
the same steps: real ELF libraries plus broken ones, a text directory and a JSONL file."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct

import numpy as np
import polars as pl
import pytest

from labkit import lab
from labkit.config import CleanConfig, CorpusConfig, ShardConfig, TokenizerConfig
from labkit.data.clean import clean_corpus
from labkit.data.dedup import near_duplicates, signatures
from labkit.data.shards import parts_dir_for, verify_shards, write_shards

LIBS = [f"/usr/lib/x86_64-linux-gnu/{n}" for n in ("libz.so.1", "libbz2.so.1.0", "liblzma.so.5", "libexpat.so.1")]
PARAGRAPH = ("Section {i}. The dynamic loader maps every segment of the object at its virtual address, "
             "applies relocations and then runs the initialisers of each library in dependency order.")


@pytest.fixture(scope="module")
def client():
    from labkit.cluster import get_client, start_cluster, stop_cluster

    cluster = start_cluster(2)
    try:
        yield get_client(cluster)
    finally:
        stop_cluster(cluster)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    libs = [p for p in LIBS if os.path.exists(p)]
    if len(libs) < 3:
        pytest.skip("fewer than 3 reference system libraries")
    d = tmp_path_factory.mktemp("inputs")
    (d / "elf").mkdir()
    real = open(libs[0], "rb").read()
    (d / "elf" / "truncated.so").write_bytes(real[:300])
    (d / "elf" / "riscv.so").write_bytes(real[:18] + struct.pack("<H", 243) + real[20:])
    (d / "text").mkdir()
    for i in range(12):
        (d / "text" / f"doc{i:02d}.txt").write_text("\n".join(PARAGRAPH.format(i=i * 10 + k) for k in range(4)))
    (d / "text" / "empty.txt").write_bytes(b"")
    (d / "text" / "bad.txt").write_bytes(b"\xff\xfe binary \x00\x00 " * 10)
    (d / "docs.jsonl").write_text("\n".join([json.dumps({"id": i, "text": PARAGRAPH.format(i=500 + i)}) for i in range(6)]
                                            + ["{broken"]))
    cfg = CorpusConfig(paths=(*libs, str(d / "elf")), text_paths=(str(d / "text"),),
                       jsonl_paths=(str(d / "docs.jsonl"),), max_functions=500, max_functions_per_file=200)
    return cfg


@pytest.fixture(scope="module")
def prepared(client, inputs, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("work"))
    out = {"work": work,
           "corpus": lab.build_corpus(client, inputs, work, progress=False),
           "clean": lab.clean_corpus(client, CleanConfig(), work, progress=False),
           "tokenizer": lab.build_tokenizer(client, TokenizerConfig(vocab_size=400), work)}
    out["shard_cfg"] = ShardConfig(seq_len=32, sequences_per_shard=40, part_docs=10_000, source_caps={"/usr/lib": 0.9})
    out["index"] = lab.build_shards(client, out["shard_cfg"], work, progress=False)
    return out


def test_corpus_counts_every_bad_input(prepared):
    c = prepared["corpus"]
    assert c["skipped"] == {"corrupt": 1, "unsupported_arch": 1, "empty": 1, "bad_json": 1}
    # 6 ELF files dealt into 6 chunks of ceil(500 / 6) = 84 functions each; 2 chunks hold a broken file
    assert c["by_kind"] == {"elf": c["functions"], "text": 13, "jsonl": 6} and 84 * 3 < c["functions"] <= 84 * 4
    parts = pl.read_parquet(os.path.join(prepared["work"], "corpus", "part-*.parquet"))
    assert parts.height == c["documents"] == c["functions"] + 19 and parts["id"].n_unique() == parts.height
    assert parts.group_by("arch").len().sort("arch").rows() == [("text", 19), ("x86_64", c["functions"])]
    assert json.loads(open(os.path.join(prepared["work"], "corpus", "corpus.json")).read()) == c


def test_corpus_from_a_walk_made_beforehand_equals_its_own(client, inputs, prepared, tmp_path):
    """``build_corpus(elf_files=find_elf_files(cfg))`` (labkit demo walks the corpus paths while
    its engines start) writes the same parts and the same record as the walk made inside it; a
    list it is given is the list it reads, in that order."""
    from labkit.data.corpus import find_elf_files

    work = str(tmp_path / "work")
    given = lab.build_corpus(client, inputs, work, progress=False, elf_files=[str(p) for p in find_elf_files(inputs)])
    own = prepared["corpus"]
    def same(stats: dict) -> dict:  # without the wall time, and the record's when and at what load
        made_by = {k: stats["made_by"][k] for k in ("stage", "settings", "inputs")}
        return {k: v for k, v in stats.items() if k != "seconds"} | {"made_by": made_by}

    assert same(given) == same(own)
    for part in sorted(pathlib.Path(prepared["work"], "corpus").glob("part-*.parquet")):
        assert pl.read_parquet(part).equals(pl.read_parquet(pathlib.Path(work, "corpus", part.name))), part.name
    one = [p for p in LIBS if os.path.exists(p)][:1]
    only = lab.build_corpus(client, inputs, str(tmp_path / "one"), progress=False, elf_files=one)
    assert only["sources"]["elf"]["files_found"] == only["sources"]["elf"]["files_read"] == 1
    assert only["sources"]["elf"]["raw_bytes"] == os.path.getsize(one[0])


def test_clean_and_near_dedup_match_a_single_process_run(prepared, tmp_path):
    s = prepared["clean"]
    assert s["input"] == prepared["corpus"]["documents"] and s["dropped"]["undecodable"] == 1  # bad.txt
    st = s["stages"]
    assert st["corpus"] >= st["filters"] >= st["exact_dedup"] >= st["near_dedup"] == s["kept"] > 150
    assert s["input"] - s["kept"] == sum(s["dropped"].values())
    assert s["partitions"] == {"exact": 2, "near": 2}  # one per engine at this size
    # the single-process reference: clean_corpus (filters, exact dedup) then near_duplicates
    ref_stats = clean_corpus(os.path.join(prepared["work"], "corpus", "part-*.parquet"), str(tmp_path / "f.parquet"),
                             CleanConfig(near_dedup=None))
    filtered = pl.read_parquet(tmp_path / "f.parquet")
    cfg = CleanConfig().near_dedup
    dup = near_duplicates(filtered["id"].to_list(), signatures(filtered["text"].to_list(), cfg), cfg)
    assert ref_stats["kept"] == s["stages"]["exact_dedup"] and len(dup) == s["dropped"].get("near_duplicate", 0)
    assert filtered.filter(~pl.col("id").is_in(list(dup))).equals(
        pl.read_parquet(os.path.join(prepared["work"], "clean", "docs.parquet")))


def test_shards_from_engines_equal_a_single_process_run(prepared, tmp_path):
    work, cfg, index = prepared["work"], prepared["shard_cfg"], prepared["index"]
    ref = write_shards(os.path.join(work, "clean", "docs.parquet"), prepared["tokenizer"], str(tmp_path / "one"),
                       cfg, progress=False, groups=2)  # one packing group per engine
    assert index == ref and verify_shards(os.path.join(work, "shards")) == ref
    for s in ref["shards"]:
        assert open(os.path.join(work, "shards", s["file"]), "rb").read() == (tmp_path / "one" / s["file"]).read_bytes()
    assert index["balance"]["share_after"]["/usr/lib"] <= 0.9 < index["balance"]["share_before"]["/usr/lib"]


def test_build_shards_resumes(client, prepared):
    work, cfg = prepared["work"], prepared["shard_cfg"]
    shards, parts = os.path.join(work, "shards"), parts_dir_for(os.path.join(work, "shards"))
    part_times = {p.name: p.stat().st_mtime_ns for p in parts.glob("part-*.json")}
    assert len(part_times) == 8  # 2 engines x 4 parts
    os.remove(os.path.join(shards, "index.json"))
    os.remove(os.path.join(shards, "shard-00001.bin"))
    keep = os.stat(os.path.join(shards, "shard-00000.bin")).st_mtime_ns
    again = lab.build_shards(client, cfg, work, progress=False)
    assert again == prepared["index"]
    assert {p.name: p.stat().st_mtime_ns for p in parts.glob("part-*.json")} == part_times  # nothing re-encoded
    assert os.stat(os.path.join(shards, "shard-00000.bin")).st_mtime_ns == keep  # finished shard not rewritten
    assert lab.build_shards(client, cfg, work, progress=False) == again  # complete: returned as is


def test_preparation_report(prepared):
    rep = lab.preparation_report(prepared["work"])
    c, s, index = prepared["corpus"], prepared["clean"], prepared["index"]
    assert rep["raw_bytes"] == c["raw_bytes"] > 0 and rep["shard_bytes"] == index["n_bytes"]
    work = pathlib.Path(prepared["work"])
    dataset = sum(f.stat().st_size for f in (work / "corpus").glob("part-*.parquet"))
    training = index["n_bytes"] + (work / "shards" / "index.json").stat().st_size
    assert rep["dataset_bytes"] == dataset > 0 and rep["training_data_bytes"] == training
    assert rep["training_to_dataset_ratio"] == round(training / dataset, 4)
    # a mixed corpus: what each source gave, counted from the documents themselves
    corpus = pl.read_parquet(work / "corpus" / "part-*.parquet")
    kept = pl.read_parquet(work / "clean" / "docs.parquet")
    assert rep["kinds"] == ["elf", "text", "jsonl"] and rep["elf_files_read"] == rep["sources"]["elf"]["files_read"]
    by_source = lambda df, ext: df.filter(pl.col("source").str.ends_with(ext)).height  # noqa: E731
    assert rep["sources"]["jsonl"]["documents"] == by_source(corpus, ".jsonl") == 6
    assert rep["sources"]["jsonl"]["kept"] == by_source(kept, ".jsonl")
    assert rep["sources"]["text"]["kept"] == by_source(kept, ".txt")
    assert rep["sources"]["elf"]["kept"] == kept.filter(pl.col("arch") != "text").height
    assert sum(v["kept"] for v in rep["sources"].values()) == kept.height
    assert sum(v["raw_bytes"] for v in rep["sources"].values()) == c["raw_bytes"]
    assert rep["examples"]["jsonl"] == kept.filter(pl.col("source").str.ends_with(".jsonl"))["text"][0][:240]
    elf = corpus.filter(pl.col("arch") != "text")
    assert rep["machine_code_bytes"] == elf["n_bytes"].sum() < rep["raw_bytes"]
    assert index["balance"]["kinds"]["elf"]["documents"] + index["balance"]["kinds"]["text"]["documents"] \
        == index["n_documents"]
    assert rep["documents_per_stage"] == {"read": c["documents"], "after_filters": s["stages"]["filters"],
                                          "after_exact_dedup": s["stages"]["exact_dedup"],
                                          "after_near_dedup": s["kept"], "in_shards": index["n_documents"]}
    assert rep["tokens"] == index["n_tokens"] and rep["dropped"] == s["dropped"]
    assert sum(rep["source_share_before"].values()) == pytest.approx(1.0, abs=1e-5)
    assert 0.0 <= rep["unk_rate_held_out"] < 0.01 and rep["unk_rate_documents"] > 0
    assert rep["near_dedup_docs_per_s"] > 0


def test_text_only_corpus_is_reported_and_exported_as_text(client, tmp_path):
    """``text_paths`` without ``paths`` is a text-only corpus (no ELF file read); the preparation
    report, the shard index and the exported model card name text, with an example of it."""
    from labkit.config import TrainConfig
    from labkit.export import export_run
    from labkit.train import train

    files = sorted(str(p) for p in pathlib.Path("/usr/share/common-licenses").iterdir() if p.is_file())
    if len(files) < 5:
        pytest.skip("fewer than 5 texts in /usr/share/common-licenses")
    cfg = CorpusConfig(text_paths=tuple(files))
    assert cfg.paths == () and CorpusConfig().paths and CorpusConfig(paths=("/x",), text_paths=("/y",)).paths == ("/x",)
    work = str(tmp_path / "work")
    corpus = lab.build_corpus(client, cfg, work, progress=False)
    assert corpus["functions"] == 0 and corpus["by_kind"] == {"text": corpus["documents"]} == {"text": len(files)}
    assert set(corpus["sources"]) == {"text"} and corpus["sources"]["text"]["raw_bytes"] == sum(map(os.path.getsize, files))
    lab.clean_corpus(client, CleanConfig(), work, progress=False)
    lab.build_tokenizer(client, TokenizerConfig(vocab_size=600), work)
    index = lab.build_shards(client, ShardConfig(seq_len=32, heldout_fraction=0.3, heldout_seed=1), work, progress=False)
    docs = pl.read_parquet(os.path.join(work, "clean", "docs.parquet"))
    assert (docs["arch"] == "text").all() and docs.height >= 4
    rep = lab.preparation_report(work)
    assert rep["kinds"] == ["text"] and rep["sources"]["text"]["kept"] == docs.height == rep["documents_kept"]
    assert rep["examples"] == {"text": docs["text"][0][:240]}  # from the data itself
    assert not [k for k in rep if any(w in k for w in ("elf", "machine_code", "function", "disassembly"))]
    held = index["heldout"]["n_documents"]
    assert index["balance"]["kinds"]["text"]["documents"] == index["n_documents"] + held and set(index["balance"]["kinds"]) == {"text"}

    run = str(tmp_path / "run")
    train(TrainConfig(data_dir=os.path.join(work, "shards"), run_dir=run, model="tiny", max_steps=3, num_threads=1,
                      batch={"micro_batch_size": 4}, schedule={"warmup_steps": 1}, measure={"trackers": ()},
                      checkpoint={"every": 3},
                      data={"tokenizer_path": os.path.join(work, "tokenizer", "tokenizer.json")}))
    card = (export_run(run, tmp_path / "export") / "README.md").read_text()
    assert "tags: [labkit, bert, masked-lm, text]" in card and "text documents (" in card and "plain text, JSONL or Parquet" in card
    assert "disassembl" not in card.lower() and "ELF" not in card and "rax" not in card
    assert "An example from the run's held-out data" in card and "after 3 steps" in card
