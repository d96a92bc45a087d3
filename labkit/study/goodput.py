"""Statistical goodput columns of the sweep tables: learning per second, not only examples per second.

A sweep row's throughput times its statistical efficiency E(B) = (B_noise + B0)/(B_noise + B)
(``labkit.measure.statistical_goodput``, Pollux, Qiao et al. OSDI'21), B the row's global batch,
B0 the smallest global batch of the table (its one-rank run), B_noise one gradient noise scale
for the whole table: the rows must be compared at one point of training, or the ratio would mix
the batch's cost with the run's progress. Where B_noise comes from is a column of the table
(``b_noise_source``): given by the caller (a batch sweep's fitted B_crit, ``--critical-batch``), or
the in-run B_simple (``labkit.train.gns``, the EMA at the run's last step) of the row with the
most ranks that measured one (a one-rank run without accumulation has none).

Read: two rows' goodput ratio is the ratio of their speeds towards a loss target (training to a
target takes E_min (1 + B/B_noise) examples, McCandlish et al. 2018 eq. 2.11), while their
throughput ratio is the ratio of their example rates.
"""

from __future__ import annotations

import polars as pl

from labkit.measure import statistical_efficiency, statistical_goodput

__all__ = ["goodput_columns", "in_run_b_noise"]


def in_run_b_noise(rows: pl.DataFrame, *, by: str = "ranks") -> tuple[float | None, str | None]:
    """(B_noise, its source) from ``rows``' ``b_simple`` column: the row with the largest ``by``
    whose B_simple is positive; (None, None) when no row has one."""
    if "b_simple" not in rows.columns:
        return None, None
    have = rows.filter(pl.col("b_simple").is_not_null() & (pl.col("b_simple") > 0)).sort(by)
    if not have.height:
        return None, None
    last = have.row(-1, named=True)
    return float(last["b_simple"]), f"in-run B_simple of the {by} {last[by]} run (labkit.train.gns, EMA at its last step)"


def goodput_columns(df: pl.DataFrame, *, batch: str, throughput: str, group: list[str] | None = None,
                    b_noise: float | None = None, source: str | None = None, by: str = "ranks") -> pl.DataFrame:
    """``df`` with ``b_noise``, ``b_noise_source``, ``statistical_efficiency`` and
    ``goodput_<throughput>`` (same unit as ``throughput``: per second, worth of progress at batch
    B0) added, per group of ``group`` columns (default: the whole table). ``batch``: the global
    batch column (sequences). B0: the group's smallest batch. B_noise: ``b_noise`` (sequences, named
    by ``source``) when given, else ``in_run_b_noise`` of the group (largest ``by``); a group with
    neither gets nulls. Raises ValueError naming a missing column."""
    missing = [c for c in (batch, throughput, *(group or [])) if c not in df.columns]
    if missing:
        raise ValueError(f"goodput_columns: no column(s) {missing} in {df.columns}")
    parts = []
    for _, part in (df.group_by(group, maintain_order=True) if group else [((), df)]):
        bn, src = (b_noise, source or "given") if b_noise is not None else in_run_b_noise(part, by=by)
        b0 = part[batch].min()
        eff, good = [], []
        for b, t in zip(part[batch].to_list(), part[throughput].to_list()):
            ok = bn is not None and b is not None and t is not None
            eff.append(statistical_efficiency(b, bn, b0) if ok else None)
            good.append(statistical_goodput(t, b, bn, b0) if ok else None)
        parts.append(part.with_columns(pl.lit(bn, dtype=pl.Float64).alias("b_noise"),
                                       pl.lit(src, dtype=pl.String).alias("b_noise_source"),
                                       pl.Series("statistical_efficiency", eff, dtype=pl.Float64),
                                       pl.Series(f"goodput_{throughput}", good, dtype=pl.Float64)))
    return pl.concat(parts, how="diagonal_relaxed") if parts else df
