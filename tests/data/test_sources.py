"""labkit.data.sources: text files, JSONL and Parquet as corpus documents, with every bad input
counted under its reason. Tests run as root, so a chmod 000 file stays readable; unreadable
files are simulated with a broken symlink and a FIFO where a file is expected."""

from __future__ import annotations

import hashlib
import json
import os

import polars as pl
import pytest

from labkit.config import CleanConfig, CorpusConfig
from labkit.data.clean import clean
from labkit.data.corpus import SCHEMA
from labkit.data.sources import doc_id, find_source_files, read_jsonl, write_source_part

PROSE = "The loader maps each segment.\nRelocations are applied next.\nThen the entry point runs."
BIG = 50 * 1024 * 1024  # a single 50 MB line


def sha_id(source: str, name: str, address: int) -> str:
    return hashlib.sha1(f"text|{source}|{name}|{address}".encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    (d / "a.txt").write_text(PROSE)
    (d / "sub").mkdir()
    (d / "sub" / "b.md").write_text(PROSE.replace("loader", "kernel"))
    (d / "empty.txt").write_bytes(b"")
    (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1") + PROSE.encode())
    (d / "nul.txt").write_bytes(PROSE.encode() + b"\x00\x01binary")
    with open(d / "huge.txt", "wb") as f:
        f.truncate(BIG)  # sparse: 50 MB of NUL bytes on one line, written instantly
    (d / "gone.txt").symlink_to(d / "does-not-exist")
    os.mkfifo(d / "pipe.txt")
    (d / "ignored.bin").write_bytes(b"not a text suffix")
    return d


def test_text_directory(text_dir):
    cfg = CorpusConfig(paths=(), text_paths=(str(text_dir),))
    files = find_source_files("text", cfg)
    names = [os.path.relpath(f, text_dir) for f in files]
    assert names == ["a.txt", "empty.txt", "gone.txt", "huge.txt", "latin1.txt", "nul.txt", "pipe.txt", "sub/b.md"]
    out = text_dir.parent / "text-part.parquet"
    stats = write_source_part("text", files, cfg, str(out))
    assert stats["skipped"] == {"empty": 1, "unreadable": 2, "too_large": 1}
    assert stats["skipped_files"] == {str(text_dir / "empty.txt"): "empty", str(text_dir / "gone.txt"): "unreadable",
                                      str(text_dir / "huge.txt"): "too_large", str(text_dir / "pipe.txt"): "unreadable"}
    df = pl.read_parquet(out)
    assert df.schema == pl.Schema(SCHEMA)
    assert [os.path.basename(s) for s in df["source"]] == ["a.txt", "latin1.txt", "nul.txt", "b.md"]
    assert df["id"].to_list() == [sha_id(s, os.path.basename(s), 0) for s in df["source"]]
    assert set(df["arch"]) == {"text"} and df["address"].to_list() == [0] * 4
    assert df["text"][0] == PROSE and df["text"][1].startswith("caf\ufffd cr\ufffdme")
    assert df["n_bytes"].to_list() == [os.path.getsize(s) for s in df["source"]]
    assert stats["functions"] == 4 and stats["files_read"] == 8
    assert stats["raw_bytes"] == sum(os.path.getsize(s) for s in df["source"])  # empty adds 0; others unread
    # the clean stage drops the undecodable ones and counts them
    marked = clean(pl.scan_parquet(out), CleanConfig()).collect()
    assert dict(zip([os.path.basename(s) for s in marked["source"]], marked["drop_reason"])) == {
        "a.txt": None, "latin1.txt": "undecodable", "nul.txt": "undecodable", "b.md": None}


def test_ids_are_stable_across_runs_and_splits(text_dir, tmp_path):
    cfg = CorpusConfig(paths=(), text_paths=(str(text_dir),))
    files = find_source_files("text", cfg)
    one = write_source_part("text", files, cfg, str(tmp_path / "one.parquet"))
    halves = [write_source_part("text", files[i::2], cfg, str(tmp_path / f"h{i}.parquet")) for i in range(2)]
    a = pl.read_parquet(tmp_path / "one.parquet").sort("id")
    b = pl.concat([pl.read_parquet(tmp_path / f"h{i}.parquet") for i in range(2)]).sort("id")
    assert a.equals(b) and one["functions"] == sum(h["functions"] for h in halves)
    assert doc_id("x", "y", 3) == sha_id("x", "y", 3)


def test_jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"id": 7, "text": PROSE}).encode(),
             b"{not json",
             json.dumps({"id": "b", "text": 12}).encode(),
             json.dumps({"id": "c"}).encode(),
             b"",
             b'{"id": "d", "text": "caf\xe9 ' + json.dumps(PROSE)[1:-1].encode() + b'"}',        # a non-UTF-8 byte inside
             b'["a", "list"]',
             b'{"id": "e", "text": "' + b"x" * BIG + b'"}',                   # a single 50 MB line
             json.dumps({"text": "last line, no newline and no id"}).encode()]
    path.write_bytes(b"\n".join(lines))
    cfg = CorpusConfig(paths=(), jsonl_paths=(str(path),))
    df, skipped, listed = read_jsonl(str(path), cfg)
    assert skipped == {"bad_json": 2, "no_text": 2, "too_large": 1}
    assert listed == {f"{path}:2": "bad_json", f"{path}:3": "no_text", f"{path}:4": "no_text",
                      f"{path}:7": "bad_json", f"{path}:8": "too_large"}
    assert df["name"].to_list() == ["7", "d", ""] and df["address"].to_list() == [0, 5, 8]
    assert df["id"].to_list() == [sha_id(str(path), n, a) for n, a in zip(df["name"], df["address"])]
    assert df["text"][0] == PROSE and df["text"][1].startswith("caf\ufffd ")
    assert df["n_bytes"].to_list() == [len(lines[0]) + 1, len(lines[5]) + 1, len(lines[8])]
    assert clean(df.lazy(), CleanConfig(min_chars=0)).collect()["drop_reason"].to_list() == [None, "undecodable", None]


def test_parquet_sources(tmp_path):
    good = tmp_path / "good.parquet"
    pl.DataFrame({"doc": ["p1", "p2", None], "body": [PROSE, None, "x" * 100]}).write_parquet(good)
    pl.DataFrame({"other": [1]}).write_parquet(tmp_path / "notext.parquet")
    pl.DataFrame({"body": [1, 2]}).write_parquet(tmp_path / "ints.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    (tmp_path / "dir.parquet").mkdir()  # a directory where a file is expected: walked, holds nothing
    cfg = CorpusConfig(paths=(), parquet_paths=(str(tmp_path),), text_field="body", id_field="doc", max_doc_bytes=90)
    files = find_source_files("parquet", cfg)
    assert [os.path.basename(f) for f in files] == ["broken.parquet", "good.parquet", "ints.parquet", "notext.parquet"]
    stats = write_source_part("parquet", files, cfg, str(tmp_path / "out" / "part.parquet"))
    assert stats["skipped"] == {"corrupt": 1, "no_text": 3, "too_large": 1}
    assert stats["skipped_files"] == {str(tmp_path / "broken.parquet"): "corrupt", f"{good}:1": "no_text",
                                      f"{good}:2": "too_large", str(tmp_path / "ints.parquet"): "no_text",
                                      str(tmp_path / "notext.parquet"): "no_text"}
    df = pl.read_parquet(tmp_path / "out" / "part.parquet")
    assert df.select("name", "address", "text").rows() == [("p1", 0, PROSE)]
    assert df["id"][0] == sha_id(str(good), "p1", 0) and df["n_bytes"][0] == len(PROSE)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="jsonl_paths: .*nope"):
        find_source_files("jsonl", CorpusConfig(paths=(), jsonl_paths=(str(tmp_path / "nope"),)))
    with pytest.raises(ValueError, match="kind: got 'csv'"):
        write_source_part("csv", [], CorpusConfig(), str(tmp_path / "x.parquet"))
    with pytest.raises(ValueError, match="paths: give at least one"):
        CorpusConfig(paths=())


def test_single_process_build_corpus_reads_text_sources(text_dir, tmp_path):
    from labkit.data.corpus import build_corpus

    (tmp_path / "d.jsonl").write_text(json.dumps({"text": PROSE}) + "\n{bad\n")
    cfg = CorpusConfig(paths=(), text_paths=(str(text_dir / "a.txt"), str(text_dir / "sub")),
                       jsonl_paths=(str(tmp_path / "d.jsonl"),))
    stats = build_corpus(cfg, str(tmp_path / "c"))
    assert stats["parts"] == ["part-00000.parquet", "part-00001.parquet"]
    assert stats["functions"] == 3 and stats["skipped"] == {"bad_json": 1}
    df = pl.read_parquet(tmp_path / "c" / "part-*.parquet")
    assert [os.path.basename(s) for s in df["source"]] == ["a.txt", "b.md", "d.jsonl"]
