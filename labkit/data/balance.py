"""Per-source balance: token shares per source group, caps and weights, chosen by document id.

A document's *group* is the first match of ``ShardConfig.source_pattern`` in its ``source``
column (default: the first two path components, so ``/usr/lib/x86_64-linux-gnu/libz.so.1`` is in
``/usr/lib`` and ``/data/wiki/a.jsonl`` in ``/data/wiki``); a source the pattern does not match
is its own group, and a frame without ``source`` is one group ``"all"``. Token counts are the
document's ids without special tokens, as encoded for the shards.

Two knobs (both on ``ShardConfig``), applied in this order, only ever removing documents:

1. ``source_weights`` {group: w in [0, 1]}: keep the fraction w of the group's tokens ("*"
   gives the weight of every group not named). As in data-mixture down-sampling (e.g. the
   Pile's per-source epochs, arXiv:2101.00027 table 1, restricted to w <= 1).
2. ``source_caps`` {group: c in (0, 1]}: the group's share of all kept tokens is at most c
   ("*" caps every group not named). The capped budgets solve
   B_g = c_g * (T_free / (1 - sum of c over capped groups)), adding groups to the capped set
   until none of the free ones exceeds its cap; ValueError naming ``source_caps`` when the caps
   cannot be met (every group capped with caps summing below 1).

Within a group documents are taken in ascending ``id`` order (ids are hashes, so this is a
fixed pseudo-random order, the same for any engine count) while the running token sum stays
within the budget. Everything is polars expressions; nothing loops per document.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from labkit.config import ShardConfig

__all__ = ["cap_budgets", "select_documents", "source_groups"]


def source_groups(docs: pl.LazyFrame, pattern: str) -> pl.Expr:
    """Expression of each row's group (Utf8): see the module docstring."""
    if "source" not in docs.collect_schema().names():
        return pl.lit("all")
    return pl.col("source").str.extract(f"({pattern})", 1).fill_null(pl.col("source")).fill_null("all")


def _weight(table: dict[str, float], group: str, default: float | None) -> float | None:
    return table.get(group, table.get("*", default))


def cap_budgets(tokens: dict[str, int], caps: dict[str, float]) -> dict[str, int]:
    """Token budget per group so that each capped group's share of the total is at most its cap
    (module docstring, step 2). Groups without a cap keep all their tokens."""
    capped: set[str] = set()
    while True:
        free = sum(t for g, t in tokens.items() if g not in capped)
        cap_sum = sum(_weight(caps, g, 1.0) for g in capped)
        if cap_sum >= 1.0 or (free == 0 and capped):
            raise ValueError(f"source_caps: caps {caps} cannot all hold for groups {sorted(tokens)} "
                             f"(capped groups {sorted(capped)} would need {cap_sum:.3f} >= 1 of the tokens)")
        total = free / (1.0 - cap_sum)
        over = {g for g, t in tokens.items() if g not in capped and _weight(caps, g, None) is not None
                and t > _weight(caps, g, 1.0) * total + 1e-9}
        if not over:
            return {g: (int(_weight(caps, g, 1.0) * total) if g in capped else t) for g, t in tokens.items()}
        if capped | over == set(tokens):
            raise ValueError(f"source_caps: caps {caps} cannot all hold for groups {sorted(tokens)}: "
                             "every group is over its cap and the caps sum below 1")
        capped |= over


def _take(frame: pl.DataFrame, budgets: dict[str, int]) -> pl.DataFrame:
    """Rows of ``frame`` (row, id, group, tokens) kept: per group, ascending id, running sum <= budget."""
    b = pl.DataFrame({"group": list(budgets), "budget": list(budgets.values())},
                     schema={"group": pl.Utf8, "budget": pl.Int64})
    return (frame.join(b, on="group", how="left").sort("group", "id")
            .with_columns(cum=pl.col("tokens").cum_sum().over("group"))
            .filter(pl.col("cum") <= pl.col("budget")))


def select_documents(docs_path: str, lengths: np.ndarray, cfg: ShardConfig) -> tuple[np.ndarray, dict]:
    """Which rows of ``docs_path`` go into the shards, and the share report.

    ``lengths``: int64 [n_rows], tokens per row (-1 for a null text, never kept). Returns
    (keep: bool [n_rows], report) with report = {"source_pattern", "before": {group: tokens},
    "after": {group: tokens}, "documents_before", "documents_after", "share_before":
    {group: fraction}, "share_after": {group: fraction}, "kinds": {kind: {"documents",
    "tokens"}} of the kept rows} (groups sorted by name). A row's kind is "text" when its arch is
    "text" (``labkit.data.sources``: text, JSONL and Parquet), else "elf" (a disassembled
    function); without an arch column every row is "text". Without weights and caps every
    non-null row is kept and before == after.
    """
    lf = pl.scan_parquet(docs_path)
    names = lf.collect_schema().names()
    order = pl.col("id") if "id" in names else pl.int_range(pl.len()).cast(pl.Utf8).str.zfill(12)
    kind = (pl.when(pl.col("arch") == "text").then(pl.lit("text")).otherwise(pl.lit("elf"))
            if "arch" in names else pl.lit("text"))
    frame = (lf.select(order.alias("id"), source_groups(lf, cfg.source_pattern).alias("group"), kind.alias("kind"))
             .with_row_index("row").collect()
             .with_columns(tokens=pl.Series(lengths, dtype=pl.Int64))
             .filter(pl.col("tokens") >= 0))
    before = dict(sorted(frame.group_by("group").agg(pl.col("tokens").sum()).iter_rows()))
    kept = frame
    if cfg.source_weights:
        budgets = {g: int(t * _weight(cfg.source_weights, g, 1.0)) for g, t in before.items()}
        kept = _take(kept, budgets).drop("budget", "cum")
    if cfg.source_caps:
        now = dict(kept.group_by("group").agg(pl.col("tokens").sum()).iter_rows())
        kept = _take(kept, cap_budgets(now, cfg.source_caps)).drop("budget", "cum")
    keep = np.zeros(len(lengths), dtype=bool)
    keep[kept["row"].to_numpy()] = True
    after = {g: 0 for g in before} | dict(kept.group_by("group").agg(pl.col("tokens").sum()).iter_rows())
    after = dict(sorted(after.items()))

    def shares(tokens: dict[str, int]) -> dict[str, float]:
        total = sum(tokens.values())
        return {g: round(t / total, 6) if total else 0.0 for g, t in tokens.items()}

    kinds = {k: {"documents": n, "tokens": t} for k, n, t in
             kept.group_by("kind").agg(pl.len(), pl.col("tokens").sum()).sort("kind").iter_rows()}
    return keep, {"source_pattern": cfg.source_pattern, "before": before, "after": after,
                  "documents_before": frame.height, "documents_after": kept.height,
                  "share_before": shares(before), "share_after": shares(after), "kinds": kinds}
