"""The document table: the columns every source writes, so later stages treat all sources alike.

One row per document. ELF functions (``labkit.data.corpus``) and text, JSONL and Parquet records
(``labkit.data.sources``) are written as Parquet parts with exactly these columns, in this order:

- ``id`` (str): 16 hex digits of a sha1 over the document's origin (stable across runs);
- ``source`` (str): the file it came from;
- ``name`` (str): function symbol, or record name / line number for text;
- ``address`` (uint64): function start address (0 for text);
- ``arch`` (str): "x86_64", "aarch64", or "text";
- ``n_bytes`` (uint32): machine-code bytes of the function (text: UTF-8 bytes);
- ``text`` (str): the normalised disassembly, one instruction per line (or the text).
"""

from __future__ import annotations

import polars as pl

__all__ = ["SCHEMA"]

SCHEMA: dict[str, pl.DataType] = {
    "id": pl.Utf8, "source": pl.Utf8, "name": pl.Utf8, "address": pl.UInt64,
    "arch": pl.Utf8, "n_bytes": pl.UInt32, "text": pl.Utf8,
}
"""Columns of a document frame, in order."""
