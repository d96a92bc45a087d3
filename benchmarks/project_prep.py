"""Project the study's data preparation (2 TB of binaries -> 25 GB of uint16 token ids, about
12.5 B tokens; arXiv:2509.05258) onto 128 nodes x 2 engines from a ``bench_prep_scale.py``
record: the largest corpus run with the most engines gives documents/s per engine per stage.

Assumptions (printed with the table): every stage but the tokenizer and the components step
spreads evenly over the 256 engines and costs linearly in documents (what ``cost_ratio_16x_1x``
checks); the study's corpus has this machine's ratios of tokens per kept document and of kept
to input documents; the tokenizer trains on its bounded sample (``TokenizerConfig.max_train_docs``)
at the measured per-document rate on one engine; engines are as fast as one core here.
Run from the repository root: python benchmarks/project_prep.py docs/prep_scale.jsonl
Prints a Markdown table, then one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.config import CleanConfig, TokenizerConfig  # noqa: E402
from labkit.data.partitioned import BAND_ENTRY_BYTES, EXACT_KEY_BYTES, n_partitions  # noqa: E402

STUDY_TOKENS, ENGINES = 12.5e9, 128 * 2


def main() -> None:
    records = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    runs = [r for r in records if "stages" in r]
    run = max(runs, key=lambda r: (r["size"], r["engines"]))
    tokens_per_doc = run["tokens"] / run["kept"]
    kept = STUDY_TOKENS / tokens_per_doc
    docs = kept * run["documents"] / run["kept"]
    after_exact = docs * (run["documents"] - sum(n for k, n in run["dropped"].items() if k != "near_duplicate")) \
        / run["documents"]
    sample = min(kept, TokenizerConfig().max_train_docs)
    rows, total = [], 0.0
    for name, s in run["stages"].items():
        rate = s["docs_per_s_per_engine"]
        if name == "tokenizer":  # one engine, bounded sample
            hours = sample / (rate * run["engines"]) / 3600
            n_in, engines = sample, 1
        else:
            n_in = kept if name == "encode_pack" else docs
            hours, engines = n_in / (rate * ENGINES) / 3600, ENGINES
        total += hours
        rows.append((name, n_in, rate, engines, hours, s["peak_rss_mib_per_engine"]))
    cfg = CleanConfig()
    p_exact = n_partitions(int(docs), EXACT_KEY_BYTES, cfg.memory_mb, ENGINES)
    p_near = n_partitions(int(after_exact * cfg.near_dedup.bands), BAND_ENTRY_BYTES, cfg.near_dedup.memory_mb, ENGINES)
    print(f"| stage | documents in | measured docs/s per engine | engines | projected hours | peak RSS per engine here (MiB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, n_in, rate, engines, hours, rss in rows:
        print(f"| {name} | {n_in:,.0f} | {rate:,.1f} | {engines} | {hours:.2f} | {rss:,.0f} |")
    print(f"| **all** | | | | **{total:.2f}** | |")
    out = {"bench": "project_prep", "from": {"size": run["size"], "engines": run["engines"], "documents": run["documents"]},
           "tokens_per_kept_doc": round(tokens_per_doc, 1), "study_kept_docs": round(kept),
           "study_input_docs": round(docs), "engines": ENGINES, "hours": round(total, 2),
           "partitions": {"exact": p_exact, "near": p_near},
           "docs_per_partition": {"exact": round(docs / p_exact), "near": round(after_exact / p_near)}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
