"""The lab's stages over a cluster: what the notebooks and ``labkit demo`` call.

Each stage reads the previous stage's artifact under a work directory and writes its own; a
stage whose artifact is already complete, and was made with the same settings from the same
inputs, returns it without redoing the work (``force=True`` redoes it). "Complete" is decided
the same way everywhere: the file a stage writes last exists (``corpus.json``, the
kept-documents Parquet and its ``.drops.json``, ``tokenizer.json`` and its ``.stats.json``,
``index.json``, a staged copy that verifies, ``result.json``). "Made the same way" is the
``made_by`` record that file carries (``labkit.data.made_by``): the stage's settings and the
identity of its inputs (the previous stage's last file, by sha256). Any difference rebuilds
the artifact, and one line on stderr names it (``tokenizer: vocab_size 1024 -> 512,
rebuilding``); a reused artifact is named too, with when it was made.

The work directory's layout is defined once, in ``labkit.workdir``. Sweeps live in
``labkit.study.sweeps`` and DDP training on the engines in ``labkit.cluster.resumable``; both are
re-exported here so notebooks call everything as ``lab.<stage>``.

The cluster argument is an ``ipyparallel.Client`` (``labkit.cluster.start_cluster(...)``
``.connect_client_sync()``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Callable

import polars as pl

from labkit.cluster.engines import call, interrupt_tasks
from labkit.cluster.resumable import train_on_cluster
from labkit.data import made_by
from labkit.data.prepared import preparation_report
from labkit.config import CleanConfig, CorpusConfig, ShardConfig, TokenizerConfig, to_dict
from labkit.io import atomic_write_json
from labkit.study.sweeps import (reused_note, sweep_config, sweep_loader_workers, sweep_micro_batch,
                                 sweep_model_size, sweep_parallel, sweep_ranks)
from labkit.workdir import paths

__all__ = ["NotPrepared", "build_corpus", "build_shards", "build_tokenizer", "clean_corpus", "prepare",
           "preparation_report", "read_metrics", "require_prepared", "reused_note", "stage", "sweep_config",
           "sweep_loader_workers",
           "sweep_micro_batch", "sweep_model_size", "sweep_parallel", "sweep_ranks", "train_on_cluster"]


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.std import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, mininterval=0.5, leave=True)


def _wait_all(asyncs: list, desc: str, progress: bool, timeout: float | None = None) -> list:
    """Wait for ipyparallel AsyncResults (``concurrent.futures.Future``s), advancing a progress
    bar as each finishes; returns their results in order. The first engine error is raised as
    soon as that task ends (``ipyparallel.error.RemoteError`` with the engine's traceback);
    ``TimeoutError`` naming ``desc`` when tasks are unfinished after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = set(asyncs)
    with _progress(len(pending), desc, progress) as bar:
        try:
            while pending:  # wakes as soon as a task ends; at least once a second (Ctrl-C, deadline)
                left = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.monotonic()))
                done, pending = futures.wait(pending, timeout=left, return_when=futures.FIRST_COMPLETED)
                for ar in done:
                    ar.get()  # raises the engine's error, if any
                bar.update(len(done))
                if pending and deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{desc}: {len(pending)} engine tasks unfinished after {timeout} s")
        except KeyboardInterrupt:  # Ctrl-C: the engines' tasks are stopped too
            interrupt_tasks(list(asyncs))
            raise
    return [ar.get() for ar in asyncs]


class NotPrepared(FileNotFoundError):
    """A notebook or stage needs an artifact an earlier notebook makes; the message says which
    one to run first. In a notebook it is shown as that one line, not a traceback
    (IPython's ``_render_traceback_``)."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def require_prepared(workdir: str) -> dict:
    """The shard index of ``workdir`` and its tokenizer, which notebooks 02-05 read; raises
    ``NotPrepared`` (one line) naming notebook 01, ``make demo`` and ``labkit prepare`` when the
    shard set or the tokenizer is missing. Checked before a notebook starts engines."""
    from labkit.data.shards import ShardError, read_index

    p = paths(workdir)
    try:
        index = read_index(p["shards"])
    except ShardError as err:
        raise NotPrepared(f"{os.path.abspath(workdir)} has no complete shard set ({err}): run notebooks/01_prepare.py first "
                          "(same workdir), or make demo, or labkit prepare CONFIG") from None
    if not p["tokenizer"].is_file():
        raise NotPrepared(f"{os.path.abspath(workdir)} has no tokenizer ({p['tokenizer']}): run notebooks/01_prepare.py first")
    return index


# --------------------------------------------------------------------------------------------
# 1. corpus: functions disassembled from this machine's ELF files, split over the engines
# --------------------------------------------------------------------------------------------


def build_corpus(client, cfg: CorpusConfig, workdir: str, *, chunks_per_engine: int = 4,
                 progress: bool = True, force: bool = False, elf_files: list[str] | None = None) -> dict:
    """Read every corpus source of ``cfg`` on all engines: functions disassembled from the ELF
    files under ``cfg.paths`` and documents of ``cfg.text_paths``/``jsonl_paths``/``parquet_paths``
    (``labkit.data.sources``).

    The seeded ELF file list is dealt round-robin into ``len(client.ids) * chunks_per_engine``
    chunks; each chunk is one load-balanced engine task that reads its files in order until it
    holds ``ceil(cfg.max_functions / n_chunks)`` functions and writes ``part-<chunk>.parquet``.
    Each text source's files are dealt the same way (no budget) into further parts. The output
    depends on the chunk count, not on which engine ran a chunk.

    Returns the summed statistics, also written last to ``corpus/corpus.json``: files_found,
    parts, files_read, functions (ELF), documents (all sources), by_kind {elf|text|jsonl|parquet:
    documents}, sources {kind: {"files_found", "files_read", "raw_bytes", "text_bytes",
    "documents"}} (the kinds read only), part_kinds (the kind of each ``part-<i>.parquet``, in
    order), raw_bytes (input file sizes), text_bytes, skipped {reason: n}, skipped_files,
    dropped_functions {reason: n} (functions left out at extraction: "disassembly_stopped"),
    seconds, config, made_by (``labkit.data.made_by``: settings ``to_dict(cfg)``, inputs the
    path, size and mtime of every input file found). An existing ``corpus.json`` with the same
    record is returned as is (one line on stderr); any difference rebuilds. ``elf_files``: what
    ``labkit.data.corpus.find_elf_files(cfg)`` returned, when the caller already walked ``cfg.paths``
    (``labkit demo`` does while its engines start: on a cold page cache the walk is disk reads,
    ``python benchmarks/bench_elf_walk.py``); None walks them here. Raises
    ``FileNotFoundError`` naming a missing input path, ``ValueError`` when no input file is found.
    """
    from labkit.data.corpus import find_elf_files, write_corpus_part
    from labkit.data.sources import find_source_files, write_source_part

    out = paths(workdir)["corpus"]
    done = out / "corpus.json"
    elf = [str(p) for p in (find_elf_files(cfg) if elf_files is None else elf_files)] if cfg.paths else []
    text = {kind: find_source_files(kind, cfg) for kind in ("text", "jsonl", "parquet")}
    record = made_by.record("corpus", to_dict(cfg),
                            {"files": made_by.files_identity(elf + [str(f) for fs in text.values() for f in fs])})
    if done.exists() and made_by.reuse("corpus", str(out), made_by.read_record(done), record, force=force):
        return json.loads(done.read_text())
    if not elf and not any(text.values()):
        raise ValueError(f"paths: no input files found under {list(cfg.paths)} (ELF) or the text sources "
                         f"{list(cfg.text_paths) + list(cfg.jsonl_paths) + list(cfg.parquet_paths)}")
    done.unlink(missing_ok=True)  # incomplete from here until the new corpus.json is written
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("part-*.parquet"):
        stale.unlink()
    view = client.load_balanced_view()
    width = len(client.ids) * chunks_per_engine
    t0 = time.perf_counter()
    asyncs, kinds = [], []
    if elf:
        n_chunks = max(1, min(len(elf), width))
        budget = None if cfg.max_functions is None else math.ceil(cfg.max_functions / n_chunks)
        part_cfg = dataclasses.replace(cfg, max_functions=budget)
        for i in range(n_chunks):
            asyncs.append(view.apply_async(write_corpus_part, elf[i::n_chunks], part_cfg,
                                           str(out / f"part-{len(asyncs):05d}.parquet")))
            kinds.append("elf")
    for kind, files in text.items():
        n_chunks = min(len(files), width)
        for i in range(n_chunks):
            asyncs.append(view.apply_async(write_source_part, kind, files[i::n_chunks], cfg,
                                           str(out / f"part-{len(asyncs):05d}.parquet")))
            kinds.append(kind)
    parts = _wait_all(asyncs, "corpus: reading sources", progress)
    stats: dict[str, Any] = {"files_found": len(elf) + sum(map(len, text.values())), "parts": len(asyncs),
                             "files_read": 0, "functions": 0, "documents": 0, "by_kind": {}, "raw_bytes": 0,
                             "text_bytes": 0, "skipped": {}, "skipped_files": {}, "dropped_functions": {},
                             "sources": {kind: {"files_found": len(files), "files_read": 0, "raw_bytes": 0,
                                                "text_bytes": 0, "documents": 0}
                                         for kind, files in {"elf": elf, **text}.items() if files},
                             "part_kinds": kinds}
    for kind, p in zip(kinds, parts):
        for key in ("files_read", "raw_bytes", "text_bytes"):
            stats[key] += int(p[key])
            stats["sources"][kind][key] += int(p[key])
        stats["sources"][kind]["documents"] += int(p["functions"])
        stats["functions" if kind == "elf" else "documents"] += int(p["functions"])
        stats["by_kind"][kind] = stats["by_kind"].get(kind, 0) + int(p["functions"])
        for reason, n in p["skipped"].items():
            stats["skipped"][reason] = stats["skipped"].get(reason, 0) + int(n)
        for reason, n in p.get("dropped_functions", {}).items():
            stats["dropped_functions"][reason] = stats["dropped_functions"].get(reason, 0) + int(n)
        stats["skipped_files"].update(p["skipped_files"])
    stats["documents"] += stats["functions"]
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    stats["config"] = to_dict(cfg)
    stats["made_by"] = record
    stats = json.loads(json.dumps(stats))  # the return value equals corpus.json (tuples as lists)
    if stats["documents"] == 0:  # nothing to clean: say why here, not as an empty corpus later
        from labkit.data.clean import EmptyCorpusError

        raise EmptyCorpusError(f"corpus: no document found in {stats.get('files_read', 0)} files read under "
                               f"{list(cfg.paths)}; skipped {stats['skipped']} (stripped executables have "
                               "no function symbols: point paths at shared libraries or unstripped binaries)")
    atomic_write_json(done, stats)
    return stats


# --------------------------------------------------------------------------------------------
# 2. clean, exact dedup, near dedup
# --------------------------------------------------------------------------------------------


def _engine_map(client, desc: str, progress: bool):
    """``pmap(fn, [args, ...])`` over the engines: one load-balanced task per args, results in order."""
    view = client.load_balanced_view()

    def pmap(fn: Callable, args: list[tuple]) -> list:
        return _wait_all([view.apply_async(fn, *a) for a in args], f"{desc}: {fn.__name__}", progress)
    return pmap


def clean_corpus(client, cfg: CleanConfig, workdir: str, *, force: bool = False, progress: bool = True,
                 extra_filters: dict | None = None) -> dict:
    """Filter, exactly deduplicate and near-deduplicate the corpus on all engines
    (``labkit.data.partitioned.dedup_corpus``): per corpus part, filters and hash keys; per
    hash partition, exact dedup; per part, MinHash signatures and LSH band keys; per band
    partition, candidate pairs checked against the threshold; on one engine, connected
    components of those pairs; per part, the kept rows. The kept set does not depend on the
    engine count (hash partitions hold every copy of a text and every entry of a bucket).

    Writes ``clean/docs.parquet/part-XXXXX.parquet`` (one per corpus part, kept rows in corpus
    order: read the directory as one Parquet dataset), ``clean/near_duplicates.parquet`` and
    last ``clean/docs.drops.json``. Intermediates live in ``clean/work/`` and are removed.

    Returns ``{"input", "kept", "dropped": {reason: n}, "stages": {"corpus", "filters",
    "exact_dedup", "near_dedup"} (documents left after each), "partitions": {"exact", "near"},
    "seconds": {step: s}, "extraction": {reason: n} (functions left out before the corpus,
    from ``corpus.json``: "disassembly_stopped"), "near_dedup": {"seconds", "docs_per_s",
    "config"} | None}``, also
    written to ``clean/docs.drops.json`` with its ``made_by`` record (settings ``to_dict(cfg)``
    and the ``extra_filters`` expressions, input corpus.json's sha256): reused when it matches,
    else rebuilt. Raises ``labkit.data.clean.EmptyCorpusError`` when nothing is kept.
    """
    import shutil

    from labkit.data.clean import EmptyCorpusError
    from labkit.data.partitioned import dedup_corpus

    p = paths(workdir)
    drops_path = p["clean"].with_name("docs.drops.json")
    settings = to_dict(cfg) | {"extra_filters": {name: str(expr) for name, expr in (extra_filters or {}).items()}}
    record = made_by.record("clean", settings, {"corpus": made_by.file_identity(p["corpus"] / "corpus.json")})
    if (p["clean"].exists() and drops_path.exists()
            and made_by.reuse("clean", str(p["clean"]), made_by.read_record(drops_path), record, force=force)):
        return json.loads(drops_path.read_text())
    drops_path.unlink(missing_ok=True)
    if p["clean"].is_file():  # a single-file docs.parquet of an earlier labkit
        p["clean"].unlink()
    parts = sorted(str(f) for f in p["corpus"].glob("part-*.parquet"))
    stats = dedup_corpus(parts, cfg, str(p["clean"].parent / "work"), str(p["clean"]), n_engines=len(client.ids),
                         pmap=_engine_map(client, "clean", progress), extra_filters=extra_filters)
    if stats["kept"] == 0:
        shutil.rmtree(p["clean"], ignore_errors=True)
        raise EmptyCorpusError(f"clean: no document of {p['corpus']} was kept ({stats['input']} in, "
                               f"dropped {stats['dropped']})")
    corpus_json = p["corpus"] / "corpus.json"
    stats["extraction"] = (json.loads(corpus_json.read_text()).get("dropped_functions", {})
                           if corpus_json.exists() else {})
    stats["near_dedup"] = None
    if cfg.near_dedup is not None:
        sec = sum(v for k, v in stats["seconds"].items() if k.startswith("near_"))
        stats["near_dedup"] = {"seconds": round(sec, 3), "docs_per_s": round(stats["stages"]["exact_dedup"] / sec, 1)
                               if sec else None, "config": to_dict(cfg.near_dedup)}
    stats["made_by"] = record
    stats = json.loads(json.dumps(stats))  # equal to the file (tuples as lists)
    atomic_write_json(drops_path, stats)
    return stats


# --------------------------------------------------------------------------------------------
# 3. tokenizer and shards
# --------------------------------------------------------------------------------------------


def build_tokenizer(client, cfg: TokenizerConfig, workdir: str, *, force: bool = False) -> str:
    """Train the tokenizer on one engine; returns the path of ``tokenizer.json``. The held-out
    UNK report goes to ``tokenizer/tokenizer.stats.json`` (``labkit.data.tokenize``), with the
    ``made_by`` record (settings ``to_dict(cfg)``, input docs.drops.json's sha256) added last:
    an existing tokenizer is reused only when that record matches."""
    from labkit.data.tokenize import train_tokenizer

    p = paths(workdir)
    stats = p["tokenizer"].with_name("tokenizer.stats.json")
    record = made_by.record("tokenizer", to_dict(cfg),
                            {"clean": made_by.file_identity(p["clean"].with_name("docs.drops.json"))})
    if (p["tokenizer"].exists() and stats.exists()
            and made_by.reuse("tokenizer", str(p["tokenizer"]), made_by.read_record(stats), record, force=force)):
        return str(p["tokenizer"])
    stats.unlink(missing_ok=True)  # incomplete until the stats carry the new record
    p["tokenizer"].parent.mkdir(parents=True, exist_ok=True)
    out = call(client[client.ids[0]], train_tokenizer, str(p["clean"]), cfg, str(p["tokenizer"]))
    atomic_write_json(stats, json.loads(stats.read_text()) | {"made_by": record}, indent=1)
    return out


_OUTPUT_FIELDS = ("seq_len", "sequences_per_shard", "shard_bytes", "source_pattern", "source_weights", "source_caps",
                  "heldout_fraction", "heldout_seed")
"""ShardConfig fields that change the shard bytes (batch and part sizes never do)."""


def build_shards(client, cfg: ShardConfig, workdir: str, *, force: bool = False, progress: bool = True,
                 parts_per_engine: int = 4) -> dict:
    """Tokenize the kept documents into packed shards on all engines; returns the index dict.

    Engines encode row ranges (``labkit.data.shards.encode_part``; at most ``cfg.part_docs``
    rows, ``parts_per_engine`` per engine) into ``shards.parts/``; one engine selects documents
    and plans the packing (``plan_shards``: one group of consecutive parts per engine, each with
    its own range of shard numbers); the engines pack the groups (``labkit.data.pack.pack_group``);
    one engine merges the shard lists into ``index.json`` (``write_index``). The bytes equal
    ``write_shards(..., groups=len(client.ids))`` in one process.
    Finished parts and shards of an interrupted run of the same record are not redone. A shard
    set whose ``index.json`` exists and whose ``made_by`` record (``shards.parts/config.json``:
    the ``_OUTPUT_FIELDS`` and pack groups; inputs the tokenizer's and ``docs.drops.json``'s
    sha256) equals the current one is returned as is; on any difference the parts are removed
    and the set is rebuilt, one line naming the change (``labkit.data.made_by``).
    """
    from labkit.data.pack import pack_group
    from labkit.data.shards import (ShardError, encode_part, parts_dir_for, plan_parts, plan_shards, read_index,
                                    write_index)
    from labkit.data.tokenize import text_row_count, tokenizer_sha256

    p = paths(workdir)
    docs, tok, out = str(p["clean"]), str(p["tokenizer"]), str(p["shards"])
    parts_dir = parts_dir_for(out)
    settings = {k: getattr(cfg, k) for k in _OUTPUT_FIELDS} | {"pack_groups": len(client.ids)}
    record = made_by.record("shards", settings, {"tokenizer": tokenizer_sha256(tok),
                                                 "clean": made_by.file_identity(p["clean"].with_name("docs.drops.json"))})
    try:
        old = json.loads((parts_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        old = None
    diff = made_by.changes(old, record)
    if (p["shards"] / "index.json").exists():
        try:
            index = read_index(out)
        except (ShardError, OSError, json.JSONDecodeError):
            index = None
        if index is not None and made_by.reuse("shards", out, old, record, force=force):
            return index
    elif old is not None and not diff and not force:
        made_by.say(f"shards: finishing the interrupted build in {out} (same settings and inputs)")
    elif old is not None:
        made_by.say(f"shards: {'--force' if force else '; '.join(diff)}, rebuilding {out} (unfinished)")
    (p["shards"] / "index.json").unlink(missing_ok=True)  # incomplete until the new index is written
    if force or (old is not None and diff):  # parts and shard markers made from other settings or inputs
        shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(parts_dir / "config.json", record)  # what the parts in parts_dir are made for
    n = text_row_count(docs)
    rows = max(1, min(cfg.part_docs, math.ceil(n / (len(client.ids) * parts_per_engine))))
    view = client.load_balanced_view()
    asyncs = [view.apply_async(encode_part, docs, tok, str(parts_dir), i, s, e, batch_docs=cfg.batch_docs)
              for i, (s, e) in enumerate(plan_parts(n, rows))]
    parts = _wait_all(asyncs, "shards: encoding parts", progress)
    engine = client[client.ids[0]]
    plan = call(engine, plan_shards, docs, tok, out, cfg, parts, groups=len(client.ids))
    done = _wait_all([view.apply_async(pack_group, plan, g) for g in range(len(plan["groups"]))],
                     "shards: packing groups", progress)
    return call(engine, write_index, plan, done)


def prepare(client, cfg, *, force: bool = False, progress: bool = True) -> dict:
    """Every data stage of notebook 01 for ``cfg`` (a ``labkit.config.tomlfile.LabConfig``:
    its corpus, clean, tokenizer and shards settings and workdir), in order: ``build_corpus``,
    ``clean_corpus``, ``build_tokenizer``, ``build_shards``. Each reuses its artifact only when
    its settings and inputs are unchanged (a rebuilt stage rebuilds every later one: its output
    file, their input, changed). Returns ``preparation_report(cfg.workdir)``."""
    w = cfg.workdir
    build_corpus(client, cfg.corpus, w, force=force, progress=progress)
    clean_corpus(client, cfg.clean, w, force=force, progress=progress)
    build_tokenizer(client, cfg.tokenizer, w, force=force)
    build_shards(client, cfg.shards, w, force=force, progress=progress)
    return preparation_report(w)


# --------------------------------------------------------------------------------------------
# 4. staging to node-local disk, one engine per node
# --------------------------------------------------------------------------------------------


def stage(client, workdir: str, *, local_root: str | None = None, verify: bool = True) -> dict[str, dict]:
    """Copy the shard set to every node's local disk (one engine per node, checksums verified).

    ``local_root`` None puts each node's copy under ``<workdir>/local/<node>`` so simulated
    nodes on one machine get separate copies; on a real cluster pass the node-local scratch
    (or "auto" for ``labkit.data.stage.resolve_local_root`` on each node). Returns
    ``{node: {"node", "path", "copied", "bytes", "seconds", "mb_per_s"}}``.
    """
    from labkit.cluster import per_node

    src = str(Path(paths(workdir)["shards"]).resolve())
    local = str(Path(paths(workdir)["local"]).resolve())
    return per_node(client, _stage_on_node, src, local_root, local, verify)


def _stage_on_node(src: str, local_root: str | None, default_local: str, verify: bool) -> dict:
    """Engine side of ``stage``: resolve this engine's node name and local root, then copy."""
    import os as _os

    from labkit.data.stage import stage_shards
    from labkit.cluster.topology import node_name

    node = node_name()
    if local_root is None:
        root = _os.path.join(default_local, node)
    elif local_root == "auto":
        root = None
    else:
        root = local_root
    return stage_shards(src, local_root=root, node_name=node, verify=verify)


def read_metrics(run_dir: str) -> pl.DataFrame:
    """A run's ``metrics.jsonl`` as a polars DataFrame (one row per log step)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics in {run_dir}: {path} does not exist")
    return pl.read_ndjson(path)
