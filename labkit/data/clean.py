"""Clean stage: mark each document with the first filter that drops it (datatrove's habit of a
reason per drop, done columnar: ``LazyFrame -> LazyFrame`` with polars expressions only).

``FILTERS`` lists the reasons in the order they are tried; a document gets the first that
matches, so every dropped document is counted exactly once. ``clean_corpus`` runs ``clean`` over
Parquet parts and writes the kept documents plus a count per reason.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import pathlib
import tempfile

import polars as pl

from labkit.io import atomic_write, atomic_write_json
from labkit.config import CleanConfig

__all__ = ["FILTERS", "clean", "clean_corpus", "describe_filters", "EmptyCorpusError"]

FILTERS: dict[str, str] = {
    "too_short": "fewer than min_chars characters",
    "too_long": "more than max_chars characters",
    "too_few_lines": "(code) fewer than min_lines lines (instructions)",
    "undecodable": "contains U+FFFD (bytes that were not valid UTF-8, replaced when read) or NUL (binary data)",
    "nonprintable": "share of control characters (other than \\n, \\t, \\r) above max_nonprintable_ratio",
    "badly_formatted": "a line longer than max_line_chars characters",
    "repeated_lines": "share of lines that repeat an earlier line of the document above max_repeated_line_ratio",
    "boilerplate": "(code, drop_plt_stubs) a name ending in '@plt', or a trivial thunk: one unconditional jump "
                   "(x86 jmp, aarch64 b/br), optionally after endbr64/bti/nop; (text) more than "
                   "max_boilerplate_line_ratio of the lines match text_boilerplate (headers, footers)",
    "blocklist": "text matches one of the blocklist regular expressions (Rust regex syntax), or for text "
                 "documents one of text_blocklist",
    "exact_duplicate": "(exact_dedup) same text as a kept document with a smaller id",
    "near_duplicate": "(near_dedup, labkit.data.dedup) estimated Jaccard >= threshold with a kept document "
                      "of smaller id",
}
"""Drop reasons in the order they are tried, with what each means. Filters passed to ``clean`` as
``extra_filters`` are tried after "blocklist" and before "exact_duplicate". A document is text
when its ``arch`` column is "text" (``labkit.data.sources``), else code."""

_NONPRINTABLE = r"[\p{Cc}&&[^\n\t\r]]"
_UNDECODABLE = r"[\x{FFFD}\x00]"
_THUNK = r"^(?:(?:endbr64|endbr32|bti(?: [a-z]+)?|nop)\n)?(?:(?:bnd |notrack )?jmp|b|br) [^\n]+$"
_SEED_1, _SEED_2 = 0x6C61626B6974, 0x6578616374
"""Seeds of the two polars hashes of a text that together key exact dedup in ``clean_corpus``."""

class EmptyCorpusError(ValueError):
    """Cleaning kept no document; the message names the input and the drop counts."""


def _check_patterns(name: str, patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        try:
            pl.select(pl.lit("").str.contains(pattern)).item()
        except pl.exceptions.PolarsError as err:
            raise ValueError(f"{name}: {pattern!r} is not a valid regular expression: {err}") from None


def _any_of(patterns: tuple[str, ...]) -> str:
    return "|".join(f"(?:{p})" for p in patterns)


def describe_filters(cfg: CleanConfig) -> pl.DataFrame:
    """The filters as a frame (reason, meaning, settings): what ``clean`` will do with ``cfg``."""
    settings = {
        "too_short": f"min_chars={cfg.min_chars}", "too_long": f"max_chars={cfg.max_chars}",
        "too_few_lines": f"min_lines={cfg.min_lines}", "undecodable": "",
        "nonprintable": f"max_nonprintable_ratio={cfg.max_nonprintable_ratio}",
        "badly_formatted": f"max_line_chars={cfg.max_line_chars}",
        "repeated_lines": f"max_repeated_line_ratio={cfg.max_repeated_line_ratio}",
        "boilerplate": f"drop_plt_stubs={cfg.drop_plt_stubs}, {len(cfg.text_boilerplate)} text patterns, "
                       f"max_boilerplate_line_ratio={cfg.max_boilerplate_line_ratio}",
        "blocklist": f"{len(cfg.blocklist)} patterns, {len(cfg.text_blocklist)} text patterns",
        "exact_duplicate": f"exact_dedup={cfg.exact_dedup}", "near_duplicate": f"near_dedup={cfg.near_dedup}",
    }
    return pl.DataFrame({"reason": list(FILTERS), "meaning": list(FILTERS.values()),
                         "settings": [settings[r] for r in FILTERS]})


def clean(lf: pl.LazyFrame, cfg: CleanConfig, *, extra_filters: dict[str, pl.Expr] | None = None) -> pl.LazyFrame:
    """The same rows and columns plus ``drop_reason`` (Utf8): the first reason of ``FILTERS`` that
    matches, null for a kept document (near duplicates are marked by ``labkit.data.dedup``).

    Needs a Utf8 ``text`` column; ``id`` (Utf8) is needed for exact dedup, ``name`` is used for
    PLT stubs and ``arch`` ("text" for text documents) picks the code or text rules when
    present (without it every document is code). ``extra_filters`` {reason: boolean polars
    expression over the columns} extends the list: tried in the given order after "blocklist".
    Exact dedup compares documents that passed every earlier filter and keeps the smallest
    ``id`` per identical text, so the result does not depend on row order or on how the input
    was split into parts (rows equal in both ``id`` and ``text`` keep one). Lengths count
    characters; lines are ``text.split("\\n")``. Raises ValueError naming ``blocklist`` (or the
    other pattern field) for an invalid regular expression and ``extra_filters`` for a reason
    that shadows a built-in one.
    """
    _check_patterns("blocklist", cfg.blocklist)
    _check_patterns("text_blocklist", cfg.text_blocklist)
    _check_patterns("text_boilerplate", cfg.text_boilerplate)
    extra = dict(extra_filters or {})
    clash = sorted(set(extra) & set(FILTERS))
    if clash:
        raise ValueError(f"extra_filters: reasons {clash} are built-in; choose other names")
    columns = lf.collect_schema().names()
    is_text = (pl.col("arch") == "text").fill_null(False) if "arch" in columns else pl.lit(False)
    text = pl.col("text")
    n_chars = text.str.len_chars()
    lines = text.str.split("\n")
    n_lines = lines.list.len()
    repeated = (n_lines - lines.list.n_unique()) / n_lines
    nonprintable = text.str.count_matches(_NONPRINTABLE) / pl.max_horizontal(n_chars, 1)
    longest_line = lines.list.eval(pl.element().str.len_chars()).list.max()
    rules: list[tuple[str, pl.Expr]] = [
        ("too_short", n_chars < cfg.min_chars),
        ("too_long", n_chars > cfg.max_chars),
        ("too_few_lines", ~is_text & (n_lines < cfg.min_lines)),
        ("undecodable", text.str.contains(_UNDECODABLE)),
        ("nonprintable", nonprintable > cfg.max_nonprintable_ratio),
        ("badly_formatted", longest_line > cfg.max_line_chars),
        ("repeated_lines", repeated > cfg.max_repeated_line_ratio),
    ]
    boiler = pl.lit(False)
    if cfg.drop_plt_stubs:
        thunk = text.str.contains(_THUNK)
        if "name" in columns:
            thunk = thunk | pl.col("name").str.ends_with("@plt").fill_null(False)
        boiler = ~is_text & thunk
    if cfg.text_boilerplate:
        share = lines.list.eval(pl.element().str.contains(_any_of(cfg.text_boilerplate))).list.mean()
        boiler = boiler | (is_text & (share > cfg.max_boilerplate_line_ratio))
    rules.append(("boilerplate", boiler))
    blocked = pl.lit(False)
    if cfg.blocklist:
        blocked = text.str.contains(_any_of(cfg.blocklist))
    if cfg.text_blocklist:
        blocked = blocked | (is_text & text.str.contains(_any_of(cfg.text_blocklist)))
    rules.append(("blocklist", blocked))
    rules.extend(extra.items())
    reason = pl.lit(None, dtype=pl.Utf8)
    for name, condition in reversed(rules):
        reason = pl.when(condition.fill_null(False)).then(pl.lit(name)).otherwise(reason)
    lf = lf.with_columns(drop_reason=reason)
    if cfg.exact_dedup:
        kept = pl.col("drop_reason").is_null()
        smallest = pl.when(kept).then(pl.col("id")).min().over("text")
        first_copy = pl.int_range(pl.len()).over(["text", "id"]) == 0
        duplicate = kept & ((pl.col("id") != smallest) | ~first_copy)
        lf = lf.with_columns(drop_reason=pl.when(duplicate).then(pl.lit("exact_duplicate"))
                             .otherwise(pl.col("drop_reason")))
    return lf


def _exact_keep(keys: pl.DataFrame) -> pl.Series:
    """Which rows exact dedup keeps (Boolean, one per row), from per-row keys in input order:
    ``ok`` (Boolean: every filter passed), ``h1``/``h2`` (UInt64: two hashes of the text) and
    ``id`` (Utf8).

    The rule of ``clean``'s window expressions: a row is kept when it passed the filters, its id
    is the smallest id among the passing rows with its text (a null id is not compared, as
    ``!=`` with null is null there) and it is the first row, over all rows in input order, with
    its (text, id). Memory: the keys plus a hash table over the distinct passing texts (hash
    and smallest id) and a hash set over the rows that hold a smallest id; never the texts."""
    h = ["h1", "h2"]
    smallest = keys.lazy().filter("ok").group_by(h).agg(smallest=pl.col("id").min())
    no_id = pl.col("id").is_null()
    cand = no_id | (pl.col("id") == pl.col("smallest")).fill_null(False)
    # the first row of each (text, id) among the candidates; other rows get a key of their own kind
    first = pl.struct("h1", "h2", no_id.alias("no_id"), cand.alias("cand")).is_first_distinct()
    return (keys.lazy().join(smallest, on=h, how="left", maintain_order="left")
            .select((pl.col("ok") & cand & first).alias("keep")).collect().to_series())


def clean_corpus(corpus_glob: str, out_path: str, cfg: CleanConfig, *,
                 extra_filters: dict[str, pl.Expr] | None = None) -> dict:
    """Clean every Parquet file matching ``corpus_glob`` (``clean``; near dedup is a separate step,
    ``labkit.data.dedup.near_dedup_parquet``); write the kept documents (input columns,
    input order, no ``drop_reason``) to ``out_path`` and
    ``{"input": n, "kept": n, "dropped": {reason: n}}`` to ``<out_path stem>.drops.json`` beside it,
    both via temp file + rename, the Parquet first. Returns that dict.

    Streams in ``cfg.batch_rows``-row slices of the input (files in sorted order, rows in file
    order); the rows and counts equal ``clean(pl.scan_parquet(corpus_glob), cfg).collect()``
    (the whole corpus in memory) for any batch size (``tests/data/test_stream.py``):

    1. each slice: the filters of ``clean`` (row-wise, so a slice gives the same reasons; counted
       per slice) and two 64-bit polars hashes of the text with different seeds, a 128-bit key
       (two different texts collide with probability about n^2 / 2^129);
    2. exact dedup on those keys (``_exact_keep``): hash tables over hashes and ids only;
    3. each slice again: its kept rows to a temporary Parquet part; the parts are streamed into
       ``out_path`` (``sink_parquet``, row groups of ``cfg.batch_rows`` rows) and removed.

    Memory: one slice (``cfg.batch_rows`` rows with their texts, the filters' intermediates and
    the Parquet row groups the slice touches) plus O(documents) small keys: the id, 16 bytes of
    hash and a flag per document (about 50 bytes with 16-character ids) and, during step 2, the
    hash tables over them (measured: peak grows about 0.35 KB per document, ``benchmarks/
    bench_stream_memory.py``). The texts are never all in memory. ``extra_filters`` must be
    row-wise expressions (an aggregate would see one slice only).

    Raises FileNotFoundError naming the glob when nothing matches, and ``EmptyCorpusError``
    naming the glob and the drop counts when no document is kept (nothing is written then).
    """
    if not glob.glob(corpus_glob, recursive=True):
        raise FileNotFoundError(f"clean_corpus: no Parquet file matches {corpus_glob!r}")
    scan = pl.scan_parquet(corpus_glob)
    n = int(scan.select(pl.len()).collect().item())
    filters_only = dataclasses.replace(cfg, exact_dedup=False)
    keys, counts = [], {}
    for lo in range(0, n, cfg.batch_rows):
        part = clean(scan.slice(lo, cfg.batch_rows), filters_only, extra_filters=extra_filters).collect()
        for reason, count in part.get_column("drop_reason").drop_nulls().value_counts().iter_rows():
            counts[reason] = counts.get(reason, 0) + count
        doc_id = pl.col("id") if cfg.exact_dedup else pl.lit(None, dtype=pl.Utf8).alias("id")  # id not needed
        keys.append(part.select(doc_id, ok=pl.col("drop_reason").is_null(), h1=pl.col("text").hash(_SEED_1),
                                h2=pl.col("text").hash(_SEED_2)))
        del part
    keys = pl.concat(keys) if keys else pl.DataFrame(schema={"id": pl.Utf8, "ok": pl.Boolean, "h1": pl.UInt64,
                                                              "h2": pl.UInt64})
    keep = _exact_keep(keys) if cfg.exact_dedup else keys.get_column("ok")
    n_kept = int(keep.sum())
    if cfg.exact_dedup and int(keys.get_column("ok").sum()) > n_kept:
        counts["exact_duplicate"] = int(keys.get_column("ok").sum()) - n_kept
    del keys
    order = [*list(FILTERS)[:-2], *(extra_filters or {}), *list(FILTERS)[-2:]]
    dropped = {r: int(c) for r, c in sorted(counts.items(), key=lambda rn: order.index(rn[0]))}
    stats = {"input": n, "kept": n_kept, "dropped": dropped}
    if n_kept == 0:
        raise EmptyCorpusError(f"clean_corpus: no document of {corpus_glob!r} was kept "
                               f"({n} in, dropped {dropped})")
    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.parts-", dir=out.parent) as parts_dir:
        parts = []
        for lo in range(0, n, cfg.batch_rows):
            mask = keep.slice(lo, cfg.batch_rows)
            if mask.any():
                parts.append(os.path.join(parts_dir, f"part-{len(parts):08d}.parquet"))
                scan.slice(lo, cfg.batch_rows).collect().filter(mask).write_parquet(parts[-1])
        atomic_write(out, lambda tmp: pl.scan_parquet(parts).sink_parquet(tmp, row_group_size=cfg.batch_rows))
    atomic_write_json(out.with_name(f"{out.stem}.drops.json"), stats)
    return stats
