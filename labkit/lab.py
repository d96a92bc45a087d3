"""The lab's stages over a cluster: what the notebooks and ``labkit demo`` call.

Each stage reads the previous stage's artifact under a work directory and writes its own; a
stage whose artifact is already complete returns it without redoing the work (``force=True``
redoes it). "Complete" is decided the same way everywhere: the file a stage writes last exists
(``corpus.json``, the kept-documents Parquet and its ``.drops.json``, ``tokenizer.json``,
``index.json``, a staged copy that verifies, ``result.json``).

Work directory layout (``workdir``)::

    corpus/part-00000.parquet ... corpus.json   one document per disassembled function
    clean/docs.parquet  clean/docs.drops.json   kept documents, drop counts per reason
    tokenizer/tokenizer.json                    HF tokenizers (WordPiece by default)
    shards/shard-00000.bin ... index.json        packed token ids, index written last
    local/<node>/...                             node-local staged copies (simulated nodes)
    runs/<name>/                                 config.json, metrics.jsonl, checkpoints/, result.json
    sweeps/ranks.parquet  sweeps/microbatch.parquet  sweeps/loader.parquet  sweeps/model_size.parquet
    reports/*.html                               executed notebooks

The cluster argument is an ``ipyparallel.Client`` (``labkit.cluster.start_cluster(...)``
``.connect_client_sync()``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import polars as pl

from labkit.config import (
    CleanConfig,
    CorpusConfig,
    ShardConfig,
    TokenizerConfig,
    TrainConfig,
    to_dict,
)


def _paths(workdir: str | os.PathLike) -> dict[str, Path]:
    w = Path(workdir)
    return {
        "corpus": w / "corpus",
        "clean": w / "clean" / "docs.parquet",
        "tokenizer": w / "tokenizer" / "tokenizer.json",
        "shards": w / "shards",
        "local": w / "local",
        "runs": w / "runs",
        "sweeps": w / "sweeps",
        "reports": w / "reports",
    }


def _write_json(path: Path, data: Any) -> None:
    """Write JSON to a temporary name, then rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.std import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, mininterval=0.5, leave=True)


def _wait_all(asyncs: list, desc: str, progress: bool, timeout: float | None = None) -> list:
    """Wait for ipyparallel AsyncResults, advancing a progress bar as each finishes; engine
    errors are raised here (``ipyparallel.error.RemoteError``) with the engine's traceback."""
    deadline = None if timeout is None else time.monotonic() + timeout
    done: set[int] = set()
    with _progress(len(asyncs), desc, progress) as bar:
        while len(done) < len(asyncs):
            for i, ar in enumerate(asyncs):
                if i not in done and ar.ready():
                    ar.get()  # raises the engine's error, if any
                    done.add(i)
                    bar.update(1)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{desc}: {len(asyncs) - len(done)} engine tasks unfinished after {timeout} s")
            time.sleep(0.1)
    return [ar.get() for ar in asyncs]


# --------------------------------------------------------------------------------------------
# 1. corpus: functions disassembled from this machine's ELF files, split over the engines
# --------------------------------------------------------------------------------------------


def build_corpus(client, cfg: CorpusConfig, workdir: str, *, chunks_per_engine: int = 4,
                 progress: bool = True, force: bool = False) -> dict:
    """Disassemble functions from the ELF files under ``cfg.paths`` on all engines.

    The seeded file list is dealt round-robin into ``len(client.ids) * chunks_per_engine``
    chunks; each chunk is one load-balanced engine task that reads its files in order until it
    holds ``ceil(cfg.max_functions / n_chunks)`` functions and writes ``part-<chunk>.parquet``.
    The output depends on the chunk count, not on which engine ran a chunk.

    Returns the summed statistics, also written last to ``corpus/corpus.json``: files_read,
    functions, raw_bytes (input file sizes), text_bytes, skipped {reason: n}, skipped_files.
    Raises ``FileNotFoundError`` naming a missing input path, ``ValueError`` when no ELF file
    is found.
    """
    from labkit.data.corpus import find_elf_files, write_corpus_part

    out = _paths(workdir)["corpus"]
    done = out / "corpus.json"
    if done.exists() and not force:
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("part-*.parquet"):
        stale.unlink()
    files = [str(p) for p in find_elf_files(cfg)]
    if not files:
        raise ValueError(f"paths: no ELF files found under {list(cfg.paths)}")
    n_chunks = max(1, min(len(files), len(client.ids) * chunks_per_engine))
    budget = None if cfg.max_functions is None else math.ceil(cfg.max_functions / n_chunks)
    part_cfg = dataclasses.replace(cfg, max_functions=budget)
    view = client.load_balanced_view()
    t0 = time.perf_counter()
    asyncs = [
        view.apply_async(write_corpus_part, files[i::n_chunks], part_cfg, str(out / f"part-{i:05d}.parquet"))
        for i in range(n_chunks)
    ]
    parts = _wait_all(asyncs, "corpus: disassembling ELF files", progress)
    stats: dict[str, Any] = {"files_found": len(files), "parts": n_chunks, "files_read": 0, "functions": 0,
                             "raw_bytes": 0, "text_bytes": 0, "skipped": {}, "skipped_files": {}}
    for p in parts:
        for key in ("files_read", "functions", "raw_bytes", "text_bytes"):
            stats[key] += int(p[key])
        for reason, n in p["skipped"].items():
            stats["skipped"][reason] = stats["skipped"].get(reason, 0) + int(n)
        stats["skipped_files"].update(p["skipped_files"])
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    stats["config"] = to_dict(cfg)
    _write_json(done, stats)
    return stats


# --------------------------------------------------------------------------------------------
# 2. clean + exact dedup
# --------------------------------------------------------------------------------------------


def clean_corpus(client, cfg: CleanConfig, workdir: str, *, force: bool = False) -> dict:
    """Filter and exactly deduplicate the corpus on one engine (polars, lazy).

    Returns ``{"input", "kept", "dropped": {reason: n}}``, also in ``clean/docs.drops.json``.
    Raises ``labkit.data.clean.EmptyCorpusError`` when nothing is kept.
    """
    from labkit.data.clean import clean_corpus as _clean

    p = _paths(workdir)
    drops = p["clean"].with_name("docs.drops.json")
    if p["clean"].exists() and drops.exists() and not force:
        return json.loads(drops.read_text())
    glob = str(p["corpus"] / "part-*.parquet")
    return client[client.ids[0]].apply_sync(_clean, glob, str(p["clean"]), cfg)


# --------------------------------------------------------------------------------------------
# 3. tokenizer and shards
# --------------------------------------------------------------------------------------------


def build_tokenizer(client, cfg: TokenizerConfig, workdir: str, *, force: bool = False) -> str:
    """Train the tokenizer on one engine; returns the path of ``tokenizer.json``."""
    from labkit.data.tokenize import train_tokenizer

    p = _paths(workdir)
    if p["tokenizer"].exists() and not force:
        return str(p["tokenizer"])
    p["tokenizer"].parent.mkdir(parents=True, exist_ok=True)
    return client[client.ids[0]].apply_sync(train_tokenizer, str(p["clean"]), cfg, str(p["tokenizer"]))


def build_shards(client, cfg: ShardConfig, workdir: str, *, force: bool = False) -> dict:
    """Tokenize the kept documents into packed shards on one engine; returns the index dict.

    A shard set whose ``index.json`` exists and was built with the current tokenizer is kept.
    """
    from labkit.data.shards import read_index, write_shards
    from labkit.data.tokenize import tokenizer_sha256

    p = _paths(workdir)
    if (p["shards"] / "index.json").exists() and not force:
        index = read_index(str(p["shards"]))
        if index["tokenizer_sha256"] == tokenizer_sha256(str(p["tokenizer"])) and index["seq_len"] == cfg.seq_len:
            return index
    return client[client.ids[0]].apply_sync(
        write_shards, str(p["clean"]), str(p["tokenizer"]), str(p["shards"]), cfg, progress=False
    )


def preparation_report(workdir: str) -> dict:
    """Numbers of the data preparation, read back from the artifacts: raw bytes in (ELF files
    read), functions extracted, documents kept, tokens, shard bytes and the reduction in percent
    (1 - shard bytes / raw bytes; the study's 2 TB -> 25 GB is 98.8 %)."""
    p = _paths(workdir)
    corpus = json.loads((p["corpus"] / "corpus.json").read_text())
    drops = json.loads(p["clean"].with_name("docs.drops.json").read_text())
    index = json.loads((p["shards"] / "index.json").read_text())
    raw = corpus["raw_bytes"]
    return {
        "elf_files_read": corpus["files_read"],
        "functions": corpus["functions"],
        "raw_bytes": raw,
        "disassembly_bytes": corpus["text_bytes"],
        "documents_kept": drops["kept"],
        "dropped": drops["dropped"],
        "vocab_size": index["vocab_size"],
        "tokens": index["n_tokens"],
        "sequences": index["n_sequences"],
        "seq_len": index["seq_len"],
        "shard_bytes": index["n_bytes"],
        "reduction_percent": round(100.0 * (1.0 - index["n_bytes"] / raw), 2) if raw else None,
    }


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

    src = str(Path(_paths(workdir)["shards"]).resolve())
    local = str(Path(_paths(workdir)["local"]).resolve())
    return per_node(client, _stage_on_node, src, local_root, local, verify)


def _stage_on_node(src: str, local_root: str | None, default_local: str, verify: bool) -> dict:
    """Engine side of ``stage``: resolve this engine's node name and local root, then copy."""
    import os as _os
    import socket as _socket

    from labkit.data.stage import stage_shards

    node = _os.environ.get("LABKIT_NODE_NAME") or _socket.gethostname()
    if local_root is None:
        root = _os.path.join(default_local, node)
    elif local_root == "auto":
        root = None
    else:
        root = local_root
    return stage_shards(src, local_root=root, node_name=node, verify=verify)


# --------------------------------------------------------------------------------------------
# 5. training under DDP on the engines
# --------------------------------------------------------------------------------------------


def train_on_cluster(client, cfg: TrainConfig, *, targets: list[int] | None = None,
                     staged: dict[str, dict] | None = None,
                     live: Callable[[list[dict]], None] | None = None, timeout: float | None = None) -> dict:
    """Run ``labkit.train.train(cfg)`` under DDP on the engines (all, or ``targets``).

    With ``staged`` (the output of ``stage``), each rank reads the copy on its own node: the
    engine's node name picks ``staged[node]["path"]``. Returns rank 0's result dict (the same
    as ``<run_dir>/result.json``). ``live(records)`` is called about once a second with rank 0's
    recent metric records.
    """
    from labkit.cluster import run_ddp

    kwargs: dict[str, Any] = {}
    if staged is not None:
        kwargs["staged_paths"] = {node: info["path"] for node, info in staged.items()}
    results = run_ddp(client, _train_entry, cfg, targets=targets, live=live, timeout=timeout, **kwargs)
    return results[0]


def _train_entry(cfg: TrainConfig, *, sink=None, staged_paths: dict[str, str] | None = None) -> dict:
    """Engine side of ``train_on_cluster``: point data_dir at this node's staged copy, train."""
    import dataclasses as _dc
    import os as _os
    import socket as _socket

    from labkit.train import train

    if staged_paths:
        node = _os.environ.get("LABKIT_NODE_NAME") or _socket.gethostname()
        if node not in staged_paths:
            raise RuntimeError(f"node {node!r} has no staged copy; staged nodes are {sorted(staged_paths)}")
        cfg = _dc.replace(cfg, data_dir=staged_paths[node])
    return train(cfg, sink=sink)


# --------------------------------------------------------------------------------------------
# 6. sweeps: throughput vs ranks, largest micro-batch per model size
# --------------------------------------------------------------------------------------------


def sweep_ranks(client, base: TrainConfig, workdir: str, *, ranks: list[int] | None = None,
                staged: dict[str, dict] | None = None, force: bool = False) -> pl.DataFrame:
    """Weak scaling: the same per-rank micro-batch at 1..N ranks, one short run per point.

    Points already in ``sweeps/ranks.parquet`` are not rerun. Columns: ranks, model,
    micro_batch_size, global_batch_size, tokens_per_s (all ranks, after timing warm-up),
    samples_per_s, data_wait_fraction, efficiency = tokens_per_s(n) / (n * tokens_per_s(1)).
    """
    out = _paths(workdir)["sweeps"] / "ranks.parquet"
    ranks = ranks or list(range(1, len(client.ids) + 1))
    rows: list[dict] = []
    if out.exists() and not force:
        rows = pl.read_parquet(out).drop("efficiency").to_dicts()
    have = {(r["ranks"], r["model"], r["micro_batch_size"]) for r in rows}
    for n in ranks:
        if (n, base.model, base.micro_batch_size) in have:
            continue
        cfg = dataclasses.replace(base, run_dir=str(_paths(workdir)["runs"] / f"sweep-ranks-{base.model}-{n}"),
                                  resume=False)
        res = train_on_cluster(client, cfg, targets=client.ids[:n], staged=staged)
        rows.append({"ranks": n, "model": base.model, "micro_batch_size": base.micro_batch_size,
                     "global_batch_size": res["global_batch_size"], "tokens_per_s": res["tokens_per_s"],
                     "samples_per_s": res["samples_per_s"], "data_wait_fraction": res["data_wait_fraction"]})
    df = pl.DataFrame(rows).sort("model", "micro_batch_size", "ranks")
    one = (df.filter(pl.col("ranks") == 1).select("model", "micro_batch_size", pl.col("tokens_per_s").alias("_t1")))
    df = df.join(one, on=["model", "micro_batch_size"], how="left").with_columns(
        (pl.col("tokens_per_s") / (pl.col("ranks") * pl.col("_t1"))).alias("efficiency")
    ).drop("_t1")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    df.write_parquet(tmp)
    os.replace(tmp, out)
    return df


def sweep_micro_batch(client, models: list[str], *, seq_len: int, vocab_size: int, budget_bytes: int | None,
                      workdir: str, force: bool = False) -> pl.DataFrame:
    """Largest micro-batch per model size, measured on an engine: under a per-rank memory
    budget (``labkit.plan.max_micro_batch``: model state at 16 B/parameter plus the activation
    bytes autograd saves for backward, counted exactly), or with ``budget_bytes=None`` on the
    engine's GPU until out of memory (``labkit.plan.max_micro_batch_cuda``; budget_bytes is
    then the device's memory). Cached in ``sweeps/microbatch.parquet``; measured points are
    not rerun.
    """
    from labkit.model import model_config
    from labkit.plan import max_micro_batch, max_micro_batch_cuda

    out = _paths(workdir)["sweeps"] / "microbatch.parquet"
    rows: list[dict] = []
    if out.exists() and not force:
        rows = pl.read_parquet(out).to_dicts()
    rows = [{"method": "budget", **r} for r in rows]  # tables written before the GPU method
    have = {(r["model"], r["seq_len"], r["budget_bytes"] if r["method"] == "budget" else None) for r in rows}
    for name in models:
        if (name, seq_len, budget_bytes) in have:
            continue
        mcfg = model_config(name, vocab_size)
        engine = client[client.ids[0]]
        if budget_bytes is None:
            rep = engine.apply_sync(max_micro_batch_cuda, mcfg, seq_len)
            rep |= {"state_bytes": 16 * rep["params"], "act_bytes_per_sample": None}
        else:
            rep = engine.apply_sync(max_micro_batch, mcfg, seq_len, budget_bytes) | {"budget_bytes": budget_bytes}
        rows.append({"method": "budget" if budget_bytes else "cuda_oom", "model": name, "params": int(rep["params"]),
                     "seq_len": seq_len, "budget_bytes": int(rep["budget_bytes"]), "state_bytes": int(rep["state_bytes"]),
                     "act_bytes_per_sample": rep["act_bytes_per_sample"],
                     "max_micro_batch": int(rep["max_micro_batch"])})
    df = pl.DataFrame(rows).sort("params")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    df.write_parquet(tmp)
    os.replace(tmp, out)
    return df


def _save(df: pl.DataFrame, out: Path) -> pl.DataFrame:
    """Write a sweep table to Parquet under a temporary name, then rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    df.write_parquet(tmp)
    os.replace(tmp, out)
    return df


def _done_rows(out: Path, force: bool) -> list[dict]:
    return pl.read_parquet(out).to_dicts() if out.exists() and not force else []


def sweep_loader_workers(client, workdir: str, *, batch_size: int, step_time_s: float,
                         workers: list[int] | tuple[int, ...] = (0, 1, 2), n_batches: int = 30,
                         staged: dict[str, dict] | None = None, force: bool = False, **kw) -> pl.DataFrame:
    """Lesson 3: samples/s and data-wait fraction per DataLoader worker count, in front of a
    consumer taking ``step_time_s`` per batch (a planned GPU step, ``labkit.scaling.compute_time``),
    run on the first engine with ``labkit.data.loader_sweep.sweep_loader`` (the loader helper's
    sweep) on its node's staged copy when ``staged`` is given. Worker counts already in
    ``sweeps/loader.parquet`` for the same batch_size and step_time_s are not rerun; ``knee`` is
    recomputed over the whole table (fewest workers with data-wait fraction below 5 %).
    Raises ImportError naming the missing module when the loader sweep is not installed."""
    try:
        from labkit.data.loader_sweep import sweep_loader
    except ImportError as err:
        raise ImportError("sweep_loader_workers needs labkit.data.loader_sweep (the loader sweep, issue 4)") from err
    out = _paths(workdir)["sweeps"] / "loader.parquet"
    rows = [{k: v for k, v in r.items() if k != "knee"} for r in _done_rows(out, force)]
    have = {(r["num_workers"], r["batch_size"], r["step_time_s_planned"]) for r in rows}
    todo = [w for w in workers if (w, batch_size, step_time_s) not in have]
    data_dir = str(_paths(workdir)["shards"])
    if staged:
        data_dir = next(iter(staged.values()))["path"]
    if todo:
        table = client[client.ids[0]].apply_sync(sweep_loader, data_dir, batch_size=batch_size,
                                                 step_time_s=step_time_s, workers=todo, n_batches=n_batches,
                                                 gpu_index=None, **kw)
        rows += [r | {"batch_size": batch_size, "step_time_s_planned": step_time_s}
                 for r in table.drop("knee").to_dicts()]
    df = pl.DataFrame(rows).sort("batch_size", "step_time_s_planned", "num_workers")
    knee = (pl.col("data_wait_fraction") < 0.05) & (
        pl.col("num_workers") == pl.col("num_workers").filter(pl.col("data_wait_fraction") < 0.05).min()
        .over("batch_size", "step_time_s_planned"))
    return _save(df.with_columns(knee=knee.fill_null(False)), out)


def sweep_model_size(client, base: TrainConfig, workdir: str, *, models: list[str], ranks: int | None = None,
                     staged: dict[str, dict] | None = None, force: bool = False) -> pl.DataFrame:
    """Throughput per model size at a fixed number of ranks, one short run per model (lesson 5:
    larger models fit smaller batches and cost throughput). Models already in
    ``sweeps/model_size.parquet`` at the same ranks and micro-batch are not rerun. Columns:
    model, params, non_embedding_params, ranks, micro_batch_size, seq_len, tokens_per_s,
    samples_per_s, flops_per_token (``labkit.model.flops_per_token``), achieved_flops
    (tokens_per_s x flops_per_token, all ranks)."""
    from labkit.data.shards import read_index
    from labkit.model import count_parameters, flops_per_token, model_config

    out = _paths(workdir)["sweeps"] / "model_size.parquet"
    n = ranks or len(client.ids)
    rows = _done_rows(out, force)
    have = {(r["model"], r["ranks"], r["micro_batch_size"]) for r in rows}
    index = read_index(base.data_dir)
    for name in models:
        if (name, n, base.micro_batch_size) in have:
            continue
        cfg = dataclasses.replace(base, model=name, resume=False,
                                  run_dir=str(_paths(workdir)["runs"] / f"sweep-size-{name}-{n}"))
        res = train_on_cluster(client, cfg, targets=client.ids[:n], staged=staged)
        mcfg = model_config(name, index["vocab_size"], **base.model_overrides)
        fpt = flops_per_token(mcfg, index["seq_len"])
        counts = count_parameters(mcfg)
        rows.append({"model": name, "params": counts["total"], "non_embedding_params": counts["non_embedding"],
                     "ranks": n, "micro_batch_size": base.micro_batch_size, "seq_len": index["seq_len"],
                     "tokens_per_s": res["tokens_per_s"], "samples_per_s": res["samples_per_s"],
                     "flops_per_token": fpt, "achieved_flops": res["tokens_per_s"] * fpt})
    return _save(pl.DataFrame(rows).sort("params", "ranks"), out)


def read_metrics(run_dir: str) -> pl.DataFrame:
    """A run's ``metrics.jsonl`` as a polars DataFrame (one row per log step)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics in {run_dir}: {path} does not exist")
    return pl.read_ndjson(path)
