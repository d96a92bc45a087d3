"""Clean stage: mark each document with the first filter that drops it (datatrove's habit of a
reason per drop, done columnar: ``LazyFrame -> LazyFrame`` with polars expressions only).

``FILTERS`` lists the reasons in the order they are tried; a document gets the first that
matches, so every dropped document is counted exactly once. ``clean_corpus`` runs ``clean`` over
Parquet parts and writes the kept documents plus a count per reason.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib

import polars as pl

from labkit.config import CleanConfig

FILTERS: dict[str, str] = {
    "too_short": "fewer than min_chars characters",
    "too_long": "more than max_chars characters",
    "too_few_lines": "fewer than min_lines lines (instructions)",
    "nonprintable": "share of control characters (other than \\n, \\t, \\r) and U+FFFD above max_nonprintable_ratio",
    "repeated_lines": "share of lines that repeat an earlier line of the document above max_repeated_line_ratio",
    "boilerplate": "(drop_plt_stubs) a name ending in '@plt', or a trivial thunk: one unconditional jump "
                   "(x86 jmp, aarch64 b/br), optionally after endbr64/bti/nop",
    "blocklist": "text matches one of the blocklist regular expressions (Rust regex syntax)",
    "exact_duplicate": "(exact_dedup) same text as a kept document with a smaller id",
}
"""Drop reasons in the order they are tried, with what each means."""

_NONPRINTABLE = r"[\p{Cc}&&[^\n\t\r]]|\x{FFFD}"
_THUNK = r"^(?:(?:endbr64|endbr32|bti(?: [a-z]+)?|nop)\n)?(?:(?:bnd |notrack )?jmp|b|br) [^\n]+$"


class EmptyCorpusError(ValueError):
    """Cleaning kept no document; the message names the input and the drop counts."""


def _check_blocklist(patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        try:
            pl.select(pl.lit("").str.contains(pattern)).item()
        except pl.exceptions.PolarsError as err:
            raise ValueError(f"blocklist: {pattern!r} is not a valid regular expression: {err}") from None


def clean(lf: pl.LazyFrame, cfg: CleanConfig) -> pl.LazyFrame:
    """The same rows and columns plus ``drop_reason`` (Utf8): the first reason of ``FILTERS`` that
    matches, null for a kept document.

    Needs a Utf8 ``text`` column; ``id`` (Utf8) is needed for exact dedup and ``name`` is used for
    PLT stubs when present. Exact dedup compares documents that passed every earlier filter and
    keeps the smallest ``id`` per identical text, so the result does not depend on row order or
    on how the input was split into parts (rows equal in both ``id`` and ``text`` keep one).
    Lengths count characters; lines are ``text.split("\\n")``. Raises ValueError naming
    ``blocklist`` for an invalid regular expression.
    """
    _check_blocklist(cfg.blocklist)
    text = pl.col("text")
    n_chars = text.str.len_chars()
    lines = text.str.split("\n")
    n_lines = lines.list.len()
    repeated = (n_lines - lines.list.n_unique()) / n_lines
    nonprintable = text.str.count_matches(_NONPRINTABLE) / pl.max_horizontal(n_chars, 1)
    rules: list[tuple[str, pl.Expr]] = [
        ("too_short", n_chars < cfg.min_chars),
        ("too_long", n_chars > cfg.max_chars),
        ("too_few_lines", n_lines < cfg.min_lines),
        ("nonprintable", nonprintable > cfg.max_nonprintable_ratio),
        ("repeated_lines", repeated > cfg.max_repeated_line_ratio),
    ]
    if cfg.drop_plt_stubs:
        thunk = text.str.contains(_THUNK)
        if "name" in lf.collect_schema().names():
            thunk = thunk | pl.col("name").str.ends_with("@plt").fill_null(False)
        rules.append(("boilerplate", thunk))
    if cfg.blocklist:
        rules.append(("blocklist", text.str.contains("|".join(f"(?:{p})" for p in cfg.blocklist))))
    reason = pl.lit(None, dtype=pl.Utf8)
    for name, condition in reversed(rules):
        reason = pl.when(condition).then(pl.lit(name)).otherwise(reason)
    lf = lf.with_columns(drop_reason=reason)
    if cfg.exact_dedup:
        kept = pl.col("drop_reason").is_null()
        smallest = pl.when(kept).then(pl.col("id")).min().over("text")
        first_copy = pl.int_range(pl.len()).over(["text", "id"]) == 0
        duplicate = kept & ((pl.col("id") != smallest) | ~first_copy)
        lf = lf.with_columns(drop_reason=pl.when(duplicate).then(pl.lit("exact_duplicate"))
                             .otherwise(pl.col("drop_reason")))
    return lf


def clean_corpus(corpus_glob: str, out_path: str, cfg: CleanConfig) -> dict:
    """Clean every Parquet file matching ``corpus_glob``; write the kept documents (input columns,
    input order, no ``drop_reason``) to ``out_path`` and
    ``{"input": n, "kept": n, "dropped": {reason: n}}`` to ``<out_path stem>.drops.json`` beside it,
    both via temp file + rename, the Parquet first. Returns that dict.

    Raises FileNotFoundError naming the glob when nothing matches, and ``EmptyCorpusError``
    naming the glob and the drop counts when no document is kept (nothing is written then).
    """
    if not glob.glob(corpus_glob, recursive=True):
        raise FileNotFoundError(f"clean_corpus: no Parquet file matches {corpus_glob!r}")
    marked = clean(pl.scan_parquet(corpus_glob), cfg).collect()
    counts = marked.group_by("drop_reason").len().drop_nulls("drop_reason")
    dropped = {r: int(n) for r, n in sorted(counts.iter_rows(), key=lambda rn: list(FILTERS).index(rn[0]))}
    kept = marked.filter(pl.col("drop_reason").is_null()).drop("drop_reason")
    stats = {"input": marked.height, "kept": kept.height, "dropped": dropped}
    if kept.height == 0:
        raise EmptyCorpusError(f"clean_corpus: no document of {corpus_glob!r} was kept "
                               f"({marked.height} in, dropped {dropped})")
    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    kept.write_parquet(tmp)
    os.replace(tmp, out)
    drops = out.with_name(f"{out.stem}.drops.json")
    tmp = drops.with_name(drops.name + ".tmp")
    tmp.write_text(json.dumps(stats, indent=2) + "\n")
    os.replace(tmp, drops)
    return stats
