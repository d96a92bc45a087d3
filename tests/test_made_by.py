"""Artifacts that know what made them (labkit.data.made_by): between two ``lab.prepare`` runs
(what ``labkit prepare`` calls) on one work directory, a changed vocabulary size, function
budget, source list or sequence length rebuilds exactly the artifacts it shapes, each change
named in one line; the same settings reuse everything, byte for byte. A sweep point measured
with other steps is measured again. Real 2-engine cluster, one small system library and a JSONL
file as input."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import polars as pl
import pytest

from labkit import lab
from labkit.config import CleanConfig, CorpusConfig, ShardConfig, TokenizerConfig
from labkit.data.tokenize import load_tokenizer

LIB = next((p for p in ("/usr/lib/x86_64-linux-gnu/libexpat.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1")
            if os.path.exists(p)), None)
TEXT = "Note {i}: the loader maps each segment, applies its relocations and runs the initialisers of library {i}."


@pytest.fixture(scope="module")
def client():
    from labkit.cluster import get_client, start_cluster, stop_cluster

    cluster = start_cluster(2)
    try:
        yield get_client(cluster)
    finally:
        stop_cluster(cluster)


@dataclasses.dataclass(frozen=True)
class Stages:
    """The part of a LabConfig that ``lab.prepare`` reads."""

    workdir: str
    corpus: CorpusConfig
    clean: CleanConfig
    tokenizer: TokenizerConfig
    shards: ShardConfig


def _files(work: pathlib.Path) -> dict[str, bytes]:
    """Every artifact file of the work directory, by relative path (the made_by records included)."""
    return {str(p.relative_to(work)): p.read_bytes() for p in sorted(work.rglob("*"))
            if p.is_file() and "local" not in p.parts}


def _stderr_lines(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if line.split(":")[0] in
            ("corpus", "clean", "tokenizer", "shards")]


def test_prepare_rebuilds_what_a_changed_setting_shapes(client, tmp_path, capfd):
    if LIB is None:
        pytest.skip("no reference system library")
    jsonl = tmp_path / "notes.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": TEXT.format(i=i)}) for i in range(8)) + "\n")
    work = tmp_path / "work"
    cfg = Stages(workdir=str(work),
                    corpus=CorpusConfig(paths=(LIB,), jsonl_paths=(str(jsonl),), max_functions=40),
                    clean=CleanConfig(), tokenizer=TokenizerConfig(vocab_size=300),
                    shards=ShardConfig(seq_len=32, heldout_fraction=0.0))

    def docs() -> pl.DataFrame:
        return pl.read_parquet(work / "clean" / "docs.parquet")

    def index() -> dict:
        return json.loads((work / "shards" / "index.json").read_text())

    lab.prepare(client, cfg, progress=False)
    corpus = json.loads((work / "corpus" / "corpus.json").read_text())
    assert corpus["by_kind"] == {"elf": 40, "jsonl": 8} and corpus["made_by"]["settings"]["max_functions"] == 40
    assert load_tokenizer(work / "tokenizer" / "tokenizer.json").get_vocab_size() == 300 == index()["vocab_size"]
    assert (docs()["arch"] == "text").sum() == 8 and index()["seq_len"] == 32
    capfd.readouterr()

    # the same settings: every artifact reused, no file rewritten, one line per stage says so
    before = _files(work)
    lab.prepare(client, cfg, progress=False)
    assert _files(work) == before
    lines = _stderr_lines(capfd)
    assert [line.split(":")[0] for line in lines] == ["corpus", "clean", "tokenizer", "shards"]
    assert all(" reusing " in line and "(same settings and inputs; made 20" in line for line in lines)

    # vocabulary size: the tokenizer and the shards are rebuilt, the corpus and cleaning reused
    cfg = dataclasses.replace(cfg, tokenizer=TokenizerConfig(vocab_size=256))
    lab.prepare(client, cfg, progress=False)
    after = _files(work)
    assert load_tokenizer(work / "tokenizer" / "tokenizer.json").get_vocab_size() == 256 == index()["vocab_size"]
    assert after["corpus/corpus.json"] == before["corpus/corpus.json"]
    assert after["clean/docs.drops.json"] == before["clean/docs.drops.json"]
    lines = _stderr_lines(capfd)
    assert lines[2] == "tokenizer: vocab_size 300 -> 256, rebuilding"
    assert lines[3].startswith("shards: input tokenizer changed, rebuilding")

    # the function budget: every stage rebuilt, 60 functions now
    cfg = dataclasses.replace(cfg, corpus=dataclasses.replace(cfg.corpus, max_functions=60))
    lab.prepare(client, cfg, progress=False)
    corpus = json.loads((work / "corpus" / "corpus.json").read_text())
    assert corpus["by_kind"] == {"elf": 60, "jsonl": 8}
    assert (docs()["arch"] != "text").sum() == json.loads((work / "clean" / "docs.drops.json").read_text())["kept"] - 8
    lines = _stderr_lines(capfd)
    assert lines[0] == "corpus: max_functions 40 -> 60, rebuilding"
    assert lines[1] == "clean: input corpus changed, rebuilding" and lines[2] == "tokenizer: input clean changed, rebuilding"
    n_sequences = index()["n_sequences"]

    # a source dropped: its documents leave the corpus, the cleaned documents and the shards
    cfg = dataclasses.replace(cfg, corpus=dataclasses.replace(cfg.corpus, jsonl_paths=()))
    lab.prepare(client, cfg, progress=False)
    corpus = json.loads((work / "corpus" / "corpus.json").read_text())
    assert corpus["by_kind"] == {"elf": 60} and "jsonl" not in corpus["sources"]
    assert (docs()["arch"] == "text").sum() == 0 and docs().height == corpus["documents"] - sum(
        json.loads((work / "clean" / "docs.drops.json").read_text())["dropped"].values())
    assert index()["n_documents"] == docs().height and index()["n_sequences"] < n_sequences
    line = _stderr_lines(capfd)[0]
    assert line.startswith('corpus: jsonl_paths ["/') and line.endswith('notes.jsonl"] -> []; input files changed, rebuilding')

    # the sequence length: only the shards are rebuilt
    before = _files(work)
    cfg = dataclasses.replace(cfg, shards=dataclasses.replace(cfg.shards, seq_len=16))
    lab.prepare(client, cfg, progress=False)
    after = _files(work)
    assert index()["seq_len"] == 16 and "shards/index.json" in {k for k in after if after[k] != before.get(k)}
    assert all(after[k] == before[k] for k in before if k.startswith(("corpus/", "clean/", "tokenizer/")))
    lines = _stderr_lines(capfd)
    assert lines[3] == "shards: seq_len 32 -> 16, rebuilding"

    # force: every stage rebuilt even though nothing changed
    lab.prepare(client, cfg, force=True, progress=False)
    assert [line.split(",")[0] for line in _stderr_lines(capfd)] == [
        "corpus: --force", "clean: --force", "tokenizer: --force", "shards: --force"]


def test_a_parallel_sweep_with_more_steps_measures_again(client, tmp_path, capfd):
    """``labkit sweep parallel --steps 3`` after a 2-step sweep: the split is measured again (its
    row says 3 steps, its run 3 steps), the change named; the same call again reuses it, labelled."""
    from labkit.config import TrainConfig
    from labkit.data.shards import write_shards
    from labkit.data.tokenize import train_tokenizer

    if LIB is None:
        pytest.skip("no reference system library")
    work = tmp_path / "work"
    lab.build_corpus(client, CorpusConfig(paths=(LIB,), max_functions=60), str(work), progress=False)
    lab.clean_corpus(client, CleanConfig(), str(work), progress=False)
    lab.build_tokenizer(client, TokenizerConfig(vocab_size=256), str(work))
    lab.build_shards(client, ShardConfig(seq_len=16, heldout_fraction=0.0), str(work), progress=False)
    base = TrainConfig(data_dir=str(work / "shards"), run_dir=str(work / "runs" / "x"), model="tiny", num_threads=1,
                       batch={"micro_batch_size": 2}, measure={"trackers": (), "timing_warmup_steps": 1},
                       schedule={"warmup_steps": 1})
    split = [{"tp": 1, "pp": 1, "pp_schedule": None}]
    first = lab.sweep_parallel(client, base, str(work), splits=split, micro_batches=1, steps=2)
    assert first["steps"].to_list() == [2] and not first["reused"].any()
    run = work / "runs" / "sweep-parallel-tiny-dp2-tp1-pp1"
    assert json.loads((run / "result.json").read_text())["steps"] == 2
    capfd.readouterr()
    df = lab.sweep_parallel(client, base, str(work), splits=split, micro_batches=1, steps=3)
    assert df["steps"].to_list() == [3] and not df["reused"].any()
    assert json.loads((run / "result.json").read_text())["steps"] == 3
    assert "sweep parallel dp2-tp1-pp1: max_steps 2 -> 3, measuring again" in capfd.readouterr().err
    again = lab.sweep_parallel(client, base, str(work), splits=split, micro_batches=1, steps=3)
    assert again["reused"].to_list() == [True] and again["tokens_per_s"].to_list() == df["tokens_per_s"].to_list()
    assert lab.reused_note(again).startswith("1 of 1 points reused from earlier runs (measured 20")


def test_train_on_cluster_on_a_finished_run_touches_nothing(client, tmp_path, capfd):
    """The README's live-plot cell run twice: the second ``lab.train_on_cluster`` returns the
    saved result (rank 0 says so in one line, streamed from the engine) and no file changes."""
    from labkit import plots
    from labkit.config import TrainConfig
    from tiny_shards import write_tiny_shards

    shards = write_tiny_shards(tmp_path / "shards")
    cfg = TrainConfig(data_dir=str(shards), run_dir=str(tmp_path / "runs" / "mine"), model="tiny", max_steps=3,
                      num_threads=1, batch={"micro_batch_size": 4}, schedule={"warmup_steps": 1},
                      measure={"trackers": ("tensorboard",)}, checkpoint={"enabled": False})
    first = lab.train_on_cluster(client, cfg, live=plots.LivePlot(plots.loss_figure))
    run = pathlib.Path(cfg.run_dir)
    def files() -> dict:  # every file of the run, ranks/ (its ranks' last status) included
        return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()}

    before = files()
    assert {"result.json", "metrics.jsonl", "config.json", "rank-0.json", "rank-1.json"} <= {p.name for p in before}
    capfd.readouterr()
    again = lab.train_on_cluster(client, cfg, live=plots.LivePlot(plots.loss_figure))
    assert files() == before
    assert again == json.loads((run / "result.json").read_text()) == json.loads(json.dumps(first))
    out, err = capfd.readouterr()
    assert "already finished (3 of 3 steps" in out + err
