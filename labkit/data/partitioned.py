"""Exact and near dedup spread over engines through hash partitions on disk.

The layout of datatrove's and NeMo Curator's large-scale dedup: every step is either *per
corpus part* (any engine, reads one Parquet part) or *per partition* (any engine, reads the
files of one hash partition), and every intermediate is a file under a work directory, so an
engine holds one part or one partition at a time. The number of partitions is chosen from a
memory budget (``n_partitions``), so the memory per engine does not grow with the corpus.

Exact dedup (``labkit.data.clean`` semantics, lowest id kept per text):

1. ``exact_keys_part`` (per corpus part): the filters of ``clean``, then two 64-bit hashes of
   each passing text; the keys (id, h1, h2, part, row) go to partition ``h1 mod P``;
2. ``exact_partition`` (per partition): all copies of a text share h1, so they are all in one
   partition; ``clean._exact_keep`` over it (rows in corpus order) gives the kept rows.

Near dedup (``labkit.data.dedup`` semantics: connected components of similar candidate pairs,
lowest id kept per component):

3. ``near_bands_part`` (per corpus part): MinHash signatures of the rows exact dedup kept
   (saved for step 4), their band keys to partition ``key mod P``;
4. ``near_partition`` (per partition): candidate pairs of each bucket (all entries of one key
   are in one partition) checked against the threshold -> edges;
5. ``near_components`` (one engine): connected components of all edges, lowest id kept;
6. ``write_kept_part`` (per corpus part): the kept rows of the part, in corpus order.

Documents are numbered by their row in the corpus (parts in sorted order, rows in file order):
``part_offsets``. Every step is a pure function of its inputs, so the kept set is the same for
any number of engines and partitions (``tests/data/test_partitioned.py``).
"""

from __future__ import annotations

import dataclasses
import glob as _glob
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl

from labkit.config import CleanConfig, DedupConfig
from labkit.io import atomic_write, atomic_write_npy

__all__ = ["BAND_ENTRY_BYTES", "EXACT_KEY_BYTES", "dedup_corpus", "exact_keys_part", "exact_partition", "n_partitions",
           "near_bands_part", "near_components", "near_partition", "part_offsets", "write_kept_part"]

EXACT_KEY_BYTES = 200
"""Peak bytes per document of ``exact_partition`` (keys ~60 B: 16-character id, two hashes,
part and row; polars' group-by, join and is_first_distinct take about three times that)."""
BAND_ENTRY_BYTES = 48
"""Peak bytes per (document, band) entry of ``near_partition``: key and document (16 B) plus
the sort order and the sorted copies."""


def n_partitions(n_docs: int, bytes_per_doc: int, memory_mb: int, n_engines: int) -> int:
    """Partitions so that one holds at most ``memory_mb`` MiB at ``bytes_per_doc`` per document
    (expected: the hash spreads documents evenly), and at least one per engine."""
    return max(1, n_engines, math.ceil(n_docs * bytes_per_doc / (memory_mb * 2**20)))


def part_offsets(parts: list[str]) -> np.ndarray:
    """int64 [len(parts) + 1]: the corpus row number of each part's first row (and the total)."""
    rows = [pl.scan_parquet(p).select(pl.len()).collect().item() for p in parts]
    return np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)


def _write(frame: pl.DataFrame, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, frame.write_parquet)


def _save(array: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_npy(path, array)


def exact_keys_part(corpus_part: str, part: int, cfg: CleanConfig, work_dir: str, n_parts: int, *,
                    extra_filters: dict | None = None) -> dict:
    """Step 1 for corpus part number ``part``: filter (``labkit.data.clean.clean``, without
    exact dedup) in ``cfg.batch_rows`` slices and write the keys of the passing rows -- id (Utf8),
    h1, h2 (UInt64, ``clean``'s two text hashes), part (UInt32), row (UInt64, row in the part)
    -- to ``work_dir/exact/keys-<p>/part-<part>-<slice>.parquet`` for each partition p = h1 mod
    ``n_parts``. Returns {"part", "input": rows, "passed": rows, "dropped": {reason: n}}.
    Memory: one slice (``cfg.batch_rows`` rows) of texts and its keys."""
    from labkit.data.clean import _SEED_1, _SEED_2, clean

    filters_only = dataclasses.replace(cfg, exact_dedup=False)
    scan = pl.scan_parquet(corpus_part)
    n = int(scan.select(pl.len()).collect().item())
    counts: dict[str, int] = {}
    passed = 0
    for b, lo in enumerate(range(0, n, cfg.batch_rows)):
        frame = clean(scan.slice(lo, cfg.batch_rows), filters_only, extra_filters=extra_filters).collect()
        for reason, count in frame.get_column("drop_reason").drop_nulls().value_counts().iter_rows():
            counts[reason] = counts.get(reason, 0) + int(count)
        keys = frame.with_row_index("row", offset=lo).filter(pl.col("drop_reason").is_null()).select(
            pl.col("id"), h1=pl.col("text").hash(_SEED_1), h2=pl.col("text").hash(_SEED_2),
            part=pl.lit(part, dtype=pl.UInt32), row=pl.col("row").cast(pl.UInt64))
        del frame
        passed += keys.height
        keys = keys.with_columns(p=(pl.col("h1") % n_parts).cast(pl.Int64))
        for (p,), group in keys.partition_by("p", as_dict=True).items():
            _write(group.drop("p"), Path(work_dir) / "exact" / f"keys-{p:05d}" / f"part-{part:05d}-{b:05d}.parquet")
    return {"part": part, "input": n, "passed": passed, "dropped": counts}


def exact_partition(work_dir: str, partition: int) -> dict:
    """Step 2: exact dedup of one partition's keys (rows in corpus order, ``clean._exact_keep``:
    smallest id per text, first row per (text, id)); writes the kept (part, row) to
    ``work_dir/exact/kept-<partition>.parquet``. Returns {"partition", "keys", "kept"}.
    Memory: ``EXACT_KEY_BYTES`` per key of the partition."""
    from labkit.data.clean import _exact_keep

    files = sorted(_glob.glob(str(Path(work_dir) / "exact" / f"keys-{partition:05d}" / "part-*.parquet")))
    schema = {"part": pl.UInt32, "row": pl.UInt64}
    if not files:
        _write(pl.DataFrame(schema=schema), Path(work_dir) / "exact" / f"kept-{partition:05d}.parquet")
        return {"partition": partition, "keys": 0, "kept": 0}
    keys = pl.read_parquet(files).sort("part", "row")
    keep = _exact_keep(keys.with_columns(ok=pl.lit(True)))
    kept = keys.filter(keep).select("part", "row")
    _write(kept, Path(work_dir) / "exact" / f"kept-{partition:05d}.parquet")
    return {"partition": partition, "keys": keys.height, "kept": kept.height}


def _exact_rows(work_dir: str, part: int) -> np.ndarray:
    """Sorted rows of corpus part ``part`` that exact dedup kept (int64)."""
    kept = pl.scan_parquet(str(Path(work_dir) / "exact" / "kept-*.parquet")).filter(pl.col("part") == part)
    return np.sort(kept.select("row").collect()["row"].to_numpy().astype(np.int64))


def near_bands_part(corpus_part: str, part: int, offset: int, cfg: DedupConfig, work_dir: str,
                    n_parts: int) -> dict:
    """Step 3 for corpus part ``part`` (its first row is corpus row ``offset``): MinHash
    signatures (``labkit.data.dedup.signatures``) of the rows exact dedup kept, ``cfg.batch_rows``
    at a time, each batch saved as ``near/sigs-<part>-<batch>.npy`` (uint32 [n, num_perm]) with
    its corpus rows ``near/rows-<part>-<batch>.npy`` (int64, ascending); each (document, band)
    key goes to ``near/bands-<p>/part-<part>-<batch>.npy`` (int64 [m, 2]: key as int64 bits,
    corpus row) for p = key mod ``n_parts``. Returns {"part", "documents", "entries"}.
    Memory: one batch of texts, its signatures and band keys, and the part's kept row numbers
    (8 B per row)."""
    from labkit.data.dedup import band_hashes, signatures

    rows = _exact_rows(work_dir, part)
    texts = (pl.scan_parquet(corpus_part).select(pl.col("text").fill_null("")).with_row_index("row")
             .with_columns(pl.col("row").cast(pl.Int64)))
    near = Path(work_dir) / "near"
    entries = 0
    for b, lo in enumerate(range(0, len(rows), cfg.batch_rows)):
        want = rows[lo:lo + cfg.batch_rows]
        batch = texts.filter(pl.col("row").is_between(int(want[0]), int(want[-1])))
        batch = batch.filter(pl.col("row").is_in(pl.Series(want, dtype=pl.Int64).implode())).collect()
        sig = signatures(batch["text"].to_list(), cfg)
        stem = f"{part:05d}-{b:05d}"
        _save(sig, near / f"sigs-{stem}.npy")
        _save(want + offset, near / f"rows-{stem}.npy")
        keys = band_hashes(sig, cfg).reshape(-1)  # [n * bands], document-major
        docs = np.repeat(want + offset, cfg.bands)
        target = (keys % np.uint64(n_parts)).astype(np.int64)
        for p in np.unique(target):
            sel = target == p
            _save(np.stack([keys[sel].view(np.int64), docs[sel]], axis=1), near / f"bands-{p:05d}" / f"part-{stem}.npy")
        entries += len(keys)
    return {"part": part, "documents": len(rows), "entries": entries}


class _Signatures:
    """Signatures by corpus row, from the ``near/sigs-*.npy`` and ``rows-*.npy`` files, memory-mapped."""

    def __init__(self, work_dir: str) -> None:
        near = Path(work_dir) / "near"
        pairs = [(np.load(r, mmap_mode="r"), np.load(s, mmap_mode="r"))
                 for r, s in zip(sorted(near.glob("rows-*.npy")), sorted(near.glob("sigs-*.npy")))]
        pairs = [(r, s) for r, s in pairs if len(r)]  # parts in corpus order: first rows ascending
        self.rows, self.sigs = [r for r, _ in pairs], [s for _, s in pairs]
        self.first = np.array([r[0] for r in self.rows], dtype=np.int64)

    def __call__(self, docs: np.ndarray) -> np.ndarray:
        out = np.empty((len(docs), self.sigs[0].shape[1]), dtype=np.uint32)
        f = np.searchsorted(self.first, docs, side="right") - 1
        for k in np.unique(f):
            sel = f == k
            out[sel] = self.sigs[k][np.searchsorted(self.rows[k], docs[sel])]
        return out


def near_partition(work_dir: str, partition: int, cfg: DedupConfig) -> dict:
    """Step 4: the band entries of one partition -> candidate pairs (``dedup.bucket_pairs``) ->
    pairs with estimated Jaccard >= threshold (``dedup.similar_pairs``, signatures read from
    the memory-mapped step-3 files) -> ``near/edges-<partition>.npy`` (int64 [m, 2] corpus rows).
    Returns {"partition", "entries", "candidates", "edges"}. Memory: ``BAND_ENTRY_BYTES`` per
    entry plus the pairs."""
    from labkit.data.dedup import bucket_pairs, similar_pairs

    near = Path(work_dir) / "near"
    files = sorted((near / f"bands-{partition:05d}").glob("part-*.npy"))
    entries = np.concatenate([np.load(f) for f in files]) if files else np.zeros((0, 2), dtype=np.int64)
    pairs = bucket_pairs(entries[:, 0].view(np.uint64), entries[:, 1], cfg.max_bucket)
    edges = similar_pairs(pairs, _Signatures(work_dir), cfg) if len(pairs) else pairs
    _save(edges, near / f"edges-{partition:05d}.npy")
    return {"partition": partition, "entries": len(entries), "candidates": len(pairs), "edges": len(edges)}


def near_components(corpus_parts: list[str], work_dir: str) -> dict:
    """Step 5 (one engine): connected components of all edges (``dedup.components``); in each,
    the document with the smallest id is kept. Writes ``near/duplicates.parquet`` (row: Int64
    corpus row, id, duplicate_of) and returns {"edges", "near_duplicate"}. Memory: the edges
    (16 B each) and the ids of the documents in them -- grows with the number of near
    duplicates, not with the corpus."""
    from labkit.data.dedup import components

    near = Path(work_dir) / "near"
    files = sorted(near.glob("edges-*.npy"))
    edges = np.concatenate([np.load(f) for f in files]) if files else np.zeros((0, 2), dtype=np.int64)
    edges = np.unique(edges, axis=0)
    nodes = np.unique(edges)
    offsets = part_offsets(corpus_parts)
    ids = np.empty(len(nodes), dtype=object)
    where = np.searchsorted(offsets, nodes, side="right") - 1
    for k in np.unique(where):
        sel = where == k
        col = pl.scan_parquet(corpus_parts[k]).select("id").collect()["id"]
        ids[sel] = col.gather(nodes[sel] - offsets[k]).to_numpy()
    rank = np.empty(len(nodes), dtype=np.int64)
    rank[np.argsort(ids.astype(str), kind="stable")] = np.arange(len(nodes))
    label = components(np.searchsorted(nodes, edges), rank) if len(nodes) else rank
    by_rank = ids[np.argsort(rank)] if len(nodes) else ids
    dup = label != rank
    frame = pl.DataFrame({"row": nodes[dup], "id": list(ids[dup]), "duplicate_of": list(by_rank[label[dup]])},
                         schema={"row": pl.Int64, "id": pl.Utf8, "duplicate_of": pl.Utf8})
    _write(frame, near / "duplicates.parquet")
    return {"edges": len(edges), "near_duplicate": frame.height}


def write_kept_part(corpus_part: str, part: int, offset: int, work_dir: str, out_path: str,
                    near: bool = True, batch_rows: int = 16_384) -> dict:
    """Step 6: the rows of corpus part ``part`` that exact dedup kept, minus the near
    duplicates (``near``), in corpus order, all input columns, to ``out_path`` (temp file +
    rename). Returns {"part", "kept"}. Memory: ``batch_rows`` rows of the part at a time
    (each slice to a temporary file, then streamed into ``out_path``: ``sink_parquet``)."""
    rows = _exact_rows(work_dir, part)
    scan = pl.scan_parquet(corpus_part)
    n = int(scan.select(pl.len()).collect().item())
    if near:
        dups = pl.scan_parquet(Path(work_dir) / "near" / "duplicates.parquet").filter(
            pl.col("row").is_between(offset, offset + n - 1)).select("row").collect()["row"].to_numpy()
        rows = np.setdiff1d(rows, dups - offset)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out.with_name(f".{out.name}.slices-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        slices = []
        for b, lo in enumerate(range(0, max(n, 1), batch_rows)):
            a, z = np.searchsorted(rows, [lo, lo + batch_rows])
            frame = scan.slice(lo, batch_rows).collect()
            mask = np.zeros(frame.height, dtype=bool)
            mask[rows[a:z] - lo] = True
            frame = frame.filter(pl.Series(mask))
            slices.append(tmp_dir / f"{b:05d}.parquet")
            frame.write_parquet(slices[-1])
        atomic_write(out, lambda tmp: pl.scan_parquet(slices).sink_parquet(tmp, row_group_size=batch_rows))
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return {"part": part, "kept": len(rows)}


def dedup_corpus(corpus_parts: list[str], cfg: CleanConfig, work_dir: str, out_dir: str, *, n_engines: int,
                 pmap: Callable[[Callable, list[tuple]], list] | None = None,
                 extra_filters: dict | None = None) -> dict:
    """Filters, exact dedup and (with ``cfg.near_dedup``) near dedup of ``corpus_parts`` (paths,
    in corpus order) by steps 1-6, writing ``out_dir/part-<k>.parquet`` per corpus part (kept
    rows, corpus order; read the directory as one Parquet dataset) and
    ``out_dir/../near_duplicates.parquet`` (id, duplicate_of).

    ``pmap(fn, [args, ...])`` runs one step's tasks and returns their results in order (on a
    cluster: a load-balanced view; None: in this process, one after another); ``n_engines``
    sets the minimum partition count. Partitions: ``n_partitions`` from ``cfg.memory_mb`` /
    ``cfg.near_dedup.memory_mb``. ``work_dir`` (the intermediates) is removed at the end.

    Returns {"input", "kept", "dropped": {reason: n}, "stages": {"corpus", "filters",
    "exact_dedup", "near_dedup"}, "partitions": {"exact", "near"}, "seconds": {step: s}}.
    """
    pmap = pmap or (lambda fn, args: [fn(*a) for a in args])
    work, out = Path(work_dir), Path(out_dir)
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    offsets = part_offsets(corpus_parts)
    n = int(offsets[-1])
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    p_exact = n_partitions(n, EXACT_KEY_BYTES, cfg.memory_mb, n_engines)
    tasks = [(path, k, cfg, str(work), p_exact) for k, path in enumerate(corpus_parts)]
    if extra_filters:
        tasks = [(*a, extra_filters) for a in tasks]
        first = pmap(_exact_keys_with_filters, tasks)
    else:
        first = pmap(exact_keys_part, tasks)
    seconds["filters"], t = time.perf_counter() - t, time.perf_counter()
    exact = pmap(exact_partition, [(str(work), p) for p in range(p_exact)])
    seconds["exact_dedup"], t = time.perf_counter() - t, time.perf_counter()
    counts: dict[str, int] = {}
    for r in first:
        for reason, c in r["dropped"].items():
            counts[reason] = counts.get(reason, 0) + c
    passed = sum(r["passed"] for r in first)
    after_exact = sum(r["kept"] for r in exact)
    if passed > after_exact:
        counts["exact_duplicate"] = passed - after_exact
    near = cfg.near_dedup
    n_near, p_near = 0, 0
    if near is not None:
        p_near = n_partitions(after_exact * near.bands, BAND_ENTRY_BYTES, near.memory_mb, n_engines)
        pmap(near_bands_part, [(path, k, int(offsets[k]), near, str(work), p_near)
                               for k, path in enumerate(corpus_parts)])
        seconds["near_signatures"], t = time.perf_counter() - t, time.perf_counter()
        pmap(near_partition, [(str(work), p, near) for p in range(p_near)])
        seconds["near_buckets"], t = time.perf_counter() - t, time.perf_counter()
        n_near = pmap(near_components, [(list(corpus_parts), str(work))])[0]["near_duplicate"]
        seconds["near_components"], t = time.perf_counter() - t, time.perf_counter()
        if n_near:
            counts["near_duplicate"] = n_near
    pmap(write_kept_part, [(path, k, int(offsets[k]), str(work), str(out / f"part-{k:05d}.parquet"), near is not None,
                            cfg.batch_rows) for k, path in enumerate(corpus_parts)])
    seconds["write"] = time.perf_counter() - t
    if near is not None:
        dups = pl.read_parquet(work / "near" / "duplicates.parquet").select("id", "duplicate_of")
        _write(dups, out.parent / "near_duplicates.parquet")
    shutil.rmtree(work, ignore_errors=True)
    from labkit.data.clean import FILTERS

    order = [*list(FILTERS)[:-2], *(extra_filters or {}), *list(FILTERS)[-2:]]
    counts = dict(sorted(counts.items(), key=lambda rc: order.index(rc[0])))
    filters = n - sum(c for r, c in counts.items() if r not in ("exact_duplicate", "near_duplicate"))
    return json.loads(json.dumps({
        "input": n, "kept": after_exact - n_near, "dropped": counts,
        "stages": {"corpus": n, "filters": filters, "exact_dedup": after_exact, "near_dedup": after_exact - n_near},
        "partitions": {"exact": p_exact, "near": p_near}, "seconds": {k: round(v, 3) for k, v in seconds.items()}}))


def _exact_keys_with_filters(corpus_part, part, cfg, work_dir, n_parts, extra_filters):
    return exact_keys_part(corpus_part, part, cfg, work_dir, n_parts, extra_filters=extra_filters)
