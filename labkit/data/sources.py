"""Text corpus sources: plain-text files, JSONL and Parquet, as documents of the corpus schema.

The ELF path (one document per function) is ``labkit.data.corpus``; this module gives the other
sources the same columns (``labkit.data.documents.SCHEMA``) so cleaning, dedup, tokenization and shards treat
every document alike. A text document has ``arch = "text"`` (the clean stage applies its text
rules to those), ``source`` = the file path as given or found, and

============ ============================== ================= ==========================
kind         one document per               ``name``          ``address``
============ ============================== ================= ==========================
``text``     file (suffix in text_suffixes) the file name      0
``jsonl``    line with a string text_field  str(id_field)/""  line number (0-based)
``parquet``  row with a non-null text_field str(id_field)/""  row number (0-based)
============ ============================== ================= ==========================

``id`` = ``sha1(f"text|{source}|{name}|{address}").hexdigest()[:16]`` (the ELF recipe with
arch "text"): stable across runs and engine counts. ``n_bytes`` is the document's size in the
file (UTF-8 bytes of the text for Parquet).

Bad input never raises; it is counted under a reason (per file, or per record for JSONL and
Parquet) and the rest goes on:

=============== ============================================================================
reason          meaning
=============== ============================================================================
``unreadable``  cannot be opened or read (missing, a directory or FIFO where a file is
                expected, a broken symlink, no permission)
``empty``       a text file of zero bytes (blank JSONL lines are skipped silently)
``too_large``   a file over ``max_file_bytes``, or one document over ``max_doc_bytes``
                (e.g. a single 50 MB line), never decoded
``bad_json``    a JSONL line that is not a JSON object
``no_text``     a record whose text_field is missing, null or not a string; a Parquet file
                without a Utf8 text_field column
``corrupt``     a Parquet file that cannot be read
=============== ============================================================================

Bytes that are not UTF-8 are decoded with U+FFFD replacements and NUL bytes are kept; the clean
stage drops such documents as "undecodable" (``labkit.data.clean``), so they are counted there.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Literal

import polars as pl

from labkit.io import atomic_write
from labkit.config import CorpusConfig
from labkit.data.documents import SCHEMA

__all__ = ["READERS", "SUFFIXES", "doc_id", "find_source_files", "read_jsonl", "read_parquet_source", "read_text_file",
           "write_source_part"]

Kind = Literal["text", "jsonl", "parquet"]
SUFFIXES: dict[str, tuple[str, ...]] = {"jsonl": (".jsonl", ".ndjson", ".json"), "parquet": (".parquet",)}
"""File suffixes taken when a JSONL or Parquet path is a directory (text: ``cfg.text_suffixes``)."""
_MAX_LISTED = 1000  # skipped records listed by name per part; all are counted


def doc_id(source: str, name: str, address: int) -> str:
    """``sha1(f"text|{source}|{name}|{address}")[:16]``: the stable id of a text document."""
    return hashlib.sha1(f"text|{source}|{name}|{address}".encode()).hexdigest()[:16]


def find_source_files(kind: Kind, cfg: CorpusConfig) -> list[str]:
    """Files of one source kind: each path of ``cfg.<kind>_paths`` that is not a directory is
    taken as given (so a broken symlink or FIFO is counted, not lost); a directory is walked
    (sorted, symlinked directories not followed) for names ending in the kind's suffixes.
    Raises FileNotFoundError naming a path that does not exist (a broken symlink exists)."""
    given = {"text": cfg.text_paths, "jsonl": cfg.jsonl_paths, "parquet": cfg.parquet_paths}[kind]
    suffixes = cfg.text_suffixes if kind == "text" else SUFFIXES[kind]
    out: list[str] = []
    for path in given:
        if not os.path.lexists(path):
            raise FileNotFoundError(f"CorpusConfig.{kind}_paths: {path!r} does not exist")
        if not os.path.isdir(path) or os.path.islink(path):
            out.append(path)
            continue
        for dirpath, dirs, files in os.walk(path):
            dirs.sort()
            out.extend(os.path.join(dirpath, f) for f in sorted(files) if f.endswith(suffixes))
    return out


def _frame(rows: dict[str, list]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=SCHEMA)


def _empty_rows() -> dict[str, list]:
    return {k: [] for k in SCHEMA}


def _add(rows: dict[str, list], source: str, name: str, address: int, n_bytes: int, text: str) -> None:
    for key, value in (("id", doc_id(source, name, address)), ("source", source), ("name", name),
                       ("address", address), ("arch", "text"), ("n_bytes", n_bytes), ("text", text)):
        rows[key].append(value)


def _open_regular(path: str, cfg: CorpusConfig):
    """(file object, size) or a skip reason; never blocks on a FIFO."""
    try:
        st = os.stat(path)
    except OSError:
        return "unreadable"
    if not pathlib.Path(path).is_file() or (st.st_mode & 0o170000) != 0o100000:
        return "unreadable"
    if st.st_size > cfg.max_file_bytes:
        return "too_large"
    try:
        return open(path, "rb"), st.st_size
    except OSError:
        return "unreadable"


def read_text_file(path: str, cfg: CorpusConfig) -> tuple[pl.DataFrame, dict[str, int], dict[str, str]]:
    """One document from a plain-text file. Returns (frame, skip counts, {path: reason})."""
    opened = _open_regular(path, cfg)
    if isinstance(opened, str):
        return _frame(_empty_rows()), {opened: 1}, {path: opened}
    f, size = opened
    with f:
        if size == 0:
            return _frame(_empty_rows()), {"empty": 1}, {path: "empty"}
        if size > cfg.max_doc_bytes:
            return _frame(_empty_rows()), {"too_large": 1}, {path: "too_large"}
        try:
            data = f.read()
        except OSError:
            return _frame(_empty_rows()), {"unreadable": 1}, {path: "unreadable"}
    rows = _empty_rows()
    _add(rows, path, os.path.basename(path), 0, len(data), data.decode("utf-8", "replace"))
    return _frame(rows), {}, {}


def _lines(f, limit: int):
    """(line number, bytes or None when longer than ``limit``) of a binary file, reading at most
    ``limit + 1`` bytes of any line into memory."""
    number = 0
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):  # skip the rest of the long line
                line = f.readline(1 << 20)
            yield number, None
        else:
            yield number, line
        number += 1


def read_jsonl(path: str, cfg: CorpusConfig) -> tuple[pl.DataFrame, dict[str, int], dict[str, str]]:
    """One document per JSONL line whose ``cfg.text_field`` is a string (module docstring)."""
    opened = _open_regular(path, cfg)
    if isinstance(opened, str):
        return _frame(_empty_rows()), {opened: 1}, {path: opened}
    f, _ = opened
    rows, skipped, listed = _empty_rows(), {}, {}

    def skip(number: int, reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1
        if len(listed) < _MAX_LISTED:
            listed[f"{path}:{number + 1}"] = reason

    with f:
        for number, line in _lines(f, cfg.max_doc_bytes):
            if line is None:
                skip(number, "too_large")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8", "replace"))
            except json.JSONDecodeError:
                skip(number, "bad_json")
                continue
            if not isinstance(record, dict):
                skip(number, "bad_json")
                continue
            text = record.get(cfg.text_field)
            if not isinstance(text, str):
                skip(number, "no_text")
                continue
            name = record.get(cfg.id_field)
            _add(rows, path, "" if name is None else str(name), number, len(line), text)
    return _frame(rows), skipped, listed


def read_parquet_source(path: str, cfg: CorpusConfig) -> tuple[pl.DataFrame, dict[str, int], dict[str, str]]:
    """One document per Parquet row with a non-null Utf8 ``cfg.text_field`` (module docstring)."""
    opened = _open_regular(path, cfg)
    if isinstance(opened, str):
        return _frame(_empty_rows()), {opened: 1}, {path: opened}
    opened[0].close()
    try:
        lf = pl.scan_parquet(path)
        schema = lf.collect_schema()
    except Exception:  # polars raises ComputeError, OSError, ... on a damaged file
        return _frame(_empty_rows()), {"corrupt": 1}, {path: "corrupt"}
    if schema.get(cfg.text_field) not in (pl.Utf8, pl.String):
        return _frame(_empty_rows()), {"no_text": 1}, {path: "no_text"}
    name = pl.col(cfg.id_field).cast(pl.Utf8) if cfg.id_field in schema else pl.lit("")
    try:
        df = lf.select(pl.col(cfg.text_field).alias("text"), name.fill_null("").alias("name")) \
            .with_row_index("address").collect()
    except Exception:
        return _frame(_empty_rows()), {"corrupt": 1}, {path: "corrupt"}
    size = pl.col("text").str.len_bytes()
    reason = (pl.when(pl.col("text").is_null()).then(pl.lit("no_text"))
              .when(size > cfg.max_doc_bytes).then(pl.lit("too_large")))
    df = df.with_columns(reason=reason)
    bad = df.filter(pl.col("reason").is_not_null())
    skipped = dict(bad.group_by("reason").len().sort("reason").iter_rows())
    listed = {f"{path}:{a}": r for a, r in bad.head(_MAX_LISTED).select("address", "reason").iter_rows()}
    good = df.filter(pl.col("reason").is_null())
    key = pl.concat_str(pl.lit(f"text|{path}|"), pl.col("name"), pl.lit("|"), pl.col("address").cast(pl.Utf8))
    ids = [hashlib.sha1(k.encode()).hexdigest()[:16] for k in good.select(key).to_series().to_list()]
    frame = good.select(pl.Series("id", ids, dtype=pl.Utf8), pl.lit(path).alias("source"), "name",
                        pl.col("address").cast(pl.UInt64), pl.lit("text").alias("arch"),
                        size.cast(pl.UInt32).alias("n_bytes"), "text")
    return frame.cast(SCHEMA), {k: int(v) for k, v in skipped.items()}, listed


READERS = {"text": read_text_file, "jsonl": read_jsonl, "parquet": read_parquet_source}
"""Reader per source kind: ``(path, cfg) -> (frame, skip counts, {path[:record]: reason})``."""


def write_source_part(kind: Kind, files: list[str], cfg: CorpusConfig, out_path: str) -> dict:
    """Read ``files`` of one kind in order and write their documents to one Parquet file at
    ``out_path`` (temp file + rename): what an engine runs on its share of a text source.

    Returns the same keys as ``labkit.data.corpus.write_corpus_part`` -- "files_read",
    "functions" (here: documents), "raw_bytes" (sizes of the files read), "text_bytes",
    "skipped" {reason: n} (files and records), "skipped_files" {path or path:record: reason},
    at most 1000 records listed per file -- plus "kind". Raises ValueError naming ``kind``.
    """
    if kind not in READERS:
        raise ValueError(f"kind: got {kind!r}; allowed values are {', '.join(map(repr, READERS))}")
    frames, skipped, listed = [], {}, {}
    raw_bytes = 0
    for path in files:
        frame, skips, names = READERS[kind](path, cfg)
        for reason, n in skips.items():
            skipped[reason] = skipped.get(reason, 0) + n
        listed.update(names)
        if not skips.keys() & {"unreadable", "too_large"} or frame.height:
            try:
                raw_bytes += os.path.getsize(path)
            except OSError:
                pass
        if frame.height:
            frames.append(frame)
    table = pl.concat(frames) if frames else _frame(_empty_rows())
    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, table.write_parquet)
    return {"kind": kind, "files_read": len(files), "functions": table.height, "raw_bytes": raw_bytes,
            "text_bytes": int(table["text"].str.len_bytes().sum() or 0), "skipped": skipped, "skipped_files": listed}
