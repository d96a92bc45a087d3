"""Benchmark `prep_scale`: the whole data preparation (extract -> clean -> exact and near dedup
-> tokenizer -> encode and pack) through ``labkit.lab``'s stages on a real local ipyparallel
cluster, on corpora of 1x, 4x and 16x a base size, with 1 and 2 engines.

Input: functions disassembled from this machine's ELF files (default ``CorpusConfig`` paths,
``max_functions`` = the corpus size). Where the machine has fewer functions than a size needs,
the corpus is grown by a documented, deterministic transformation (``grow``): copy c of the real
documents renames the x86-64 general registers by a permutation seeded with c (a new text with
the same structure, so a new document for both dedups), and of every 20 renamed documents one
is planted as an exact copy of a real document and one as a near copy (one line changed).

Each (size, engines) runs on a fresh cluster (peak RSS is a process's lifetime maximum).
Engine scaling is measured with the same hardware per engine in every run: each engine owns one
core (its CPU affinity is that core, and polars, Rayon -- HF tokenizers -- and OpenMP get one
thread), so 2 engines have twice the cores of 1, as 2 nodes have twice the cores of one node.
``BENCH_ONE_CORE_PER_ENGINE=0`` leaves engines unpinned with the libraries' default thread
pools (then a single engine already uses every core in its multi-threaded steps). Before the
clock starts, every engine imports the stage modules (capstone, pyelftools, datasketch, HF
tokenizers, polars); the seconds that took are reported as ``engine_warmup_s``, not in a stage.

Per stage: wall seconds, documents in (extract: the functions extracted, before growing; the
tokenizer: the documents it trained on), documents/s per engine (documents in / seconds /
engines), peak RSS per engine so far (``labkit.measure.peak_rss_bytes``, the engine process's own
``VmHWM``: getrusage's ``ru_maxrss`` would carry this driver's peak into the engines it starts;
the maximum over engines, in MiB; cumulative over the stages run so far), bytes in and out (files read and
written). The tokenizer trains on a bounded sample, ``TokenizerConfig.max_train_docs`` =
``BENCH_TOKENIZER_DOCS`` (default 4,000) documents on one engine: a fixed cost that does not
grow with the corpus (and does not shrink with engines); ``speedup_2_engines_without_tokenizer``
shows the stages that spread over engines.

Goals (issue 14): time per document at 16x at most 1.2 x that at 1x (``cost_ratio_16x_1x``,
2 engines; fixed costs such as the bounded tokenizer sample make it below 1); 2 engines at
least 1.7 x as fast as 1 at 16x (``speedup_2_engines``, whole preparation, wall time); peak RSS
per engine at 16x at most 1.25 x that at 4x (``rss_ratio_16x_4x``, 2 engines).
Each goal is computed only when its runs are in ``BENCH_SIZES``/``BENCH_ENGINES`` (else null,
and its "met" null). Timings move with whatever else runs on the machine. Run from the
repository root:
``python benchmarks/bench_prep_scale.py`` (``BENCH_BASE`` documents at 1x, default 16,000;
``BENCH_SIZES`` default "1,4,16"; ``BENCH_ENGINES`` default "1,2"). Prints one JSON line per
run, then the summary as the last line.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import polars as pl  # noqa: E402

from labkit import lab  # noqa: E402
from labkit.config import CleanConfig, CorpusConfig, ShardConfig, TokenizerConfig  # noqa: E402

BASE = int(os.environ.get("BENCH_BASE", 16000))
TOKENIZER_DOCS = int(os.environ.get("BENCH_TOKENIZER_DOCS", 4000))
CHUNKS = int(os.environ.get("BENCH_CHUNKS", 16))
"""Corpus parts (extraction tasks), all engines together, at every size: 8 per engine with 2."""
ONE_CORE = os.environ.get("BENCH_ONE_CORE_PER_ENGINE", "1") != "0"
ONE_THREAD = {"POLARS_MAX_THREADS": "1", "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
SIZES = [int(s) for s in os.environ.get("BENCH_SIZES", "1,4,16").split(",")]
ENGINES = [int(s) for s in os.environ.get("BENCH_ENGINES", "1,2").split(",")]
REGS = ["rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15"]
_REG_RE = re.compile(r"\b(" + "|".join(REGS) + r")\b")


def grow(real: pl.DataFrame, copy: int) -> pl.DataFrame:
    """Copy ``copy`` (>= 1) of the real documents: registers renamed by a permutation seeded with
    ``copy``; of every 20 rows, row 0 is replaced by an exact copy of a real document and row 1
    by that document with one line changed (planted duplicates). New ids; deterministic."""
    rng = random.Random(copy)
    perm = dict(zip(REGS, rng.sample(REGS, len(REGS))))
    texts = [_REG_RE.sub(lambda m: perm[m.group(1)], t) for t in real["text"].to_list()]
    originals = real["text"].to_list()
    for i in range(0, len(texts) - 1, 20):
        src = originals[rng.randrange(len(originals))]
        lines = src.split("\n")
        texts[i] = src
        lines[rng.randrange(len(lines))] = "nop"
        texts[i + 1] = "\n".join(lines)
    return real.with_columns(id=pl.format("g{}-{}", pl.lit(copy), pl.col("id")), text=pl.Series(texts))


def _dir_bytes(path: Path, pattern: str = "**/*") -> int:
    return sum(p.stat().st_size for p in path.glob(pattern) if p.is_file())


def _rss_mib(client) -> float:
    def peak():
        from labkit.measure import peak_rss_bytes

        return peak_rss_bytes() / 2**20
    return round(max(client[:].apply_sync(peak)), 1)


def _grow_corpus(work: Path, target: int) -> int:
    """Add grown parts until the corpus holds ``target`` documents, each part at most as large as
    the largest real part (so no engine gets an outsized task); returns how many were added."""
    corpus = work / "corpus"
    real_parts = sorted(corpus.glob("part-*.parquet"))
    real = pl.read_parquet(real_parts)
    part_rows = max(pl.scan_parquet(p).select(pl.len()).collect().item() for p in real_parts)
    have, copy, added, k = real.height, 1, 0, 0
    while have < target:
        grown = grow(real, copy).head(target - have)
        for lo in range(0, grown.height, part_rows):
            grown.slice(lo, part_rows).write_parquet(corpus / f"part-{10_000 + k:05d}.parquet")
            k += 1
        have, copy, added = have + grown.height, copy + 1, added + grown.height
    return added


def _prepare_engines(client) -> float:
    """Pin engine k to core k mod cpu_count (when ``ONE_CORE``) and import the stage modules on
    every engine; returns the wall seconds of the imports (the largest over engines)."""
    def setup(core: int | None) -> float:
        import os
        import time

        if core is not None:
            os.sched_setaffinity(0, {core})
        t0 = time.perf_counter()
        import capstone  # noqa: F401
        import datasketch  # noqa: F401
        import elftools.elf.elffile  # noqa: F401
        import tokenizers  # noqa: F401

        import labkit.data.corpus  # noqa: F401
        import labkit.data.pack  # noqa: F401
        import labkit.data.partitioned  # noqa: F401
        import labkit.data.shards  # noqa: F401
        return time.perf_counter() - t0

    cpus = sorted(os.sched_getaffinity(0))
    asyncs = [client[e].apply_async(setup, cpus[k % len(cpus)] if ONE_CORE else None) for k, e in enumerate(client.ids)]
    return round(max(a.get() for a in asyncs), 2)


def _count(stage: dict, docs_in: int, engines: int) -> None:
    """Set a stage's documents in, and its documents/s per engine from them."""
    stage["documents_in"] = docs_in
    stage["docs_per_s_per_engine"] = round(docs_in / stage["seconds"] / engines, 1)


def run(size: int, engines: int, root: Path) -> dict:
    from labkit.cluster import get_client, start_cluster, stop_cluster

    n_docs = BASE * size
    work = root / f"x{size}-e{engines}"
    shutil.rmtree(work, ignore_errors=True)
    cluster = start_cluster(engines, env=ONE_THREAD if ONE_CORE else None)
    stages: dict[str, dict] = {}
    try:
        client = get_client(cluster)
        warmup = _prepare_engines(client)

        def stage(name: str, fn, docs_in: int, bytes_in: int, out: Path, pattern: str = "**/*"):
            t0 = time.perf_counter()
            result = fn()
            sec = time.perf_counter() - t0
            stages[name] = {"seconds": round(sec, 2), "documents_in": docs_in,
                            "docs_per_s_per_engine": round(docs_in / sec / engines, 1),
                            "peak_rss_mib_per_engine": _rss_mib(client), "bytes_in": bytes_in,
                            "bytes_out": _dir_bytes(out, pattern) if out.is_dir() else out.stat().st_size}
            return result

        chunks = CHUNKS // engines  # the same chunks, so the same corpus, for every engine count
        corpus = stage("extract", lambda: lab.build_corpus(client, CorpusConfig(max_functions=n_docs), str(work),
                                                           chunks_per_engine=chunks, progress=False),
                       n_docs, 0, work / "corpus")
        stages["extract"]["bytes_in"] = corpus["raw_bytes"]
        _count(stages["extract"], corpus["functions"], engines)  # the functions extracted, not the target
        grown = _grow_corpus(work, n_docs)
        n = corpus["documents"] + grown
        corpus_bytes = _dir_bytes(work / "corpus", "part-*.parquet")
        clean = stage("clean_dedup", lambda: lab.clean_corpus(client, CleanConfig(), str(work), progress=False),
                      n, corpus_bytes, work / "clean" / "docs.parquet")
        clean_bytes = stages["clean_dedup"]["bytes_out"]
        tok_cfg = TokenizerConfig(max_train_docs=TOKENIZER_DOCS)
        tok = stage("tokenizer", lambda: lab.build_tokenizer(client, tok_cfg, str(work)), clean["kept"],
                    clean_bytes, work / "tokenizer" / "tokenizer.json")
        tok_stats = json.loads(Path(tok).with_name("tokenizer.stats.json").read_text())
        _count(stages["tokenizer"], tok_stats["train_docs"], engines)  # the sample it trained on
        index = stage("encode_pack", lambda: lab.build_shards(client, ShardConfig(), str(work), progress=False),
                      clean["kept"], clean_bytes, work / "shards", "shard-*.bin")
    finally:
        stop_cluster(cluster)
    total = sum(s["seconds"] for s in stages.values())
    return {"size": size, "engines": engines, "one_core_per_engine": ONE_CORE, "engine_warmup_s": warmup,
            "tokenizer_train_docs": tok_stats["train_docs"], "documents": n, "real_functions": corpus["functions"],
            "grown_documents": grown, "kept": clean["kept"], "dropped": clean["dropped"],
            "partitions": clean["partitions"], "tokens": index["n_tokens"], "shards": len(index["shards"]),
            "seconds": round(total, 2), "seconds_per_doc": total / n,
            "peak_rss_mib_per_engine": max(s["peak_rss_mib_per_engine"] for s in stages.values()), "stages": stages}


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="labkit-bench-prep-scale-"))
    results = {}
    try:
        for size in SIZES:
            for engines in ENGINES:
                r = run(size, engines, root)
                results[(size, engines)] = r
                print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    get = results.get
    e = 2 if get((16, 2)) else 1
    # each goal is measured only when its runs exist (null otherwise): 16x vs 1x, 16x 1 vs 2 engines, 16x vs 4x
    cost = get((16, e))["seconds_per_doc"] / get((1, e))["seconds_per_doc"] if get((16, e)) and get((1, e)) else None
    both = get((16, 1)) and get((16, 2))
    speedup = get((16, 1))["seconds"] / get((16, 2))["seconds"] if both else None
    spread = ([sum(v["seconds"] for k, v in get((16, n))["stages"].items() if k != "tokenizer") for n in (1, 2)]
              if both else None)
    stage_speedup = ({k: round(v["seconds"] / get((16, 2))["stages"][k]["seconds"], 3)
                      for k, v in get((16, 1))["stages"].items()} if both else None)
    rss = (get((16, e))["peak_rss_mib_per_engine"] / get((4, e))["peak_rss_mib_per_engine"]
           if get((16, e)) and get((4, e)) else None)

    def met(value: float | None, ok: bool) -> bool | None:
        return None if value is None else ok

    summary = {"bench": "prep_scale", "base_documents": BASE, "sizes": SIZES, "engines": ENGINES,
               "cost_ratio_16x_1x": round(cost, 3) if cost else None,
               "speedup_2_engines": round(speedup, 3) if speedup else None,
               "rss_ratio_16x_4x": round(rss, 3) if rss else None,
               "speedup_2_engines_without_tokenizer": round(spread[0] / spread[1], 3) if spread else None,
               "speedup_2_engines_per_stage": stage_speedup, "one_core_per_engine": ONE_CORE,
               "tokenizer_train_docs": TOKENIZER_DOCS,
               "goals": {"cost_ratio_16x_1x": "<= 1.2", "speedup_2_engines": ">= 1.7", "rss_ratio_16x_4x": "<= 1.25"},
               "met": {"cost_ratio_16x_1x": met(cost, cost is not None and cost <= 1.2),
                       "speedup_2_engines": met(speedup, speedup is not None and speedup >= 1.7),
                       "rss_ratio_16x_4x": met(rss, rss is not None and rss <= 1.25)},
               "docs_per_s_per_engine_16x": {f"{k[1]}_engines": {s: v["docs_per_s_per_engine"]
                                                                  for s, v in r["stages"].items()}
                                             for k, r in results.items() if k[0] == 16},
               "cpu_count": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
