"""Project the study's data preparation (2 TB of binaries -> 25 GB of uint16 token ids, about
12.5 B tokens; arXiv:2509.05258) onto 128 nodes x 2 engines from a ``bench_prep_scale.py``
record: the largest corpus run with the most engines gives documents/s per engine per stage.

Assumptions (docs/data_path.md lists them with the table): the study's 2 TB holds functions at
this machine's ELF bytes per function (``ELF_BYTES_PER_FUNCTION``); its 12.5 B tokens at the
measured tokens per kept document give the kept documents; extraction costs per function at the
measured functions/s per engine (per byte would count the bytes of files whose functions the
benchmark's per-file cap left unread), cleaning and dedup per input document, encoding and packing per kept
document, each spread evenly over the 256 engines at the measured per-engine rate (linear cost:
``cost_ratio_16x_1x``); the tokenizer trains on its bounded sample on one engine; an engine is
as fast as one core of this machine; the one-engine steps (components, packing plan) are
estimated in memory, not time.
Run from the repository root: python benchmarks/project_prep.py docs/data/prep_scale.jsonl
Prints a Markdown table, then one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.config import CleanConfig, TokenizerConfig  # noqa: E402
from labkit.data.partitioned import BAND_ENTRY_BYTES, EXACT_KEY_BYTES, n_partitions  # noqa: E402

STUDY_TOKENS, STUDY_BYTES, ENGINES = 12.5e9, 2e12, 128 * 2
ELF_BYTES_PER_FUNCTION = 2.1e9 / 546e3
"""Every function of this machine's ELF files, no per-file cap: 546k functions in 2.1 GB
(docs/log.md, 2026-11-30): the study's 2 TB then holds about 520 M functions."""


def project(records: list[dict]) -> tuple[str, dict]:
    """(Markdown table, summary dict) of the projection from ``bench_prep_scale.py`` records: the
    largest size run with the most engines gives the rates."""
    run = max((r for r in records if "stages" in r), key=lambda r: (r["size"], r["engines"]))
    st, e = run["stages"], run["engines"]
    tokens_per_doc = run["tokens"] / run["kept"]
    kept = STUDY_TOKENS / tokens_per_doc
    docs = STUDY_BYTES / ELF_BYTES_PER_FUNCTION
    near_share = run["dropped"].get("near_duplicate", 0) / run["documents"]
    sample = min(kept, TokenizerConfig().max_train_docs)
    fn_per_s = st["extract"]["docs_per_s_per_engine"]  # functions extracted per second per engine
    rows = [("extract", f"{STUDY_BYTES / 1e12:.0f} TB of ELF ({docs:,.0f} functions)", f"{fn_per_s:,.0f} functions/s",
             ENGINES, docs / (fn_per_s * ENGINES)),
            ("clean + exact and near dedup", f"{docs:,.0f} documents",
             f"{st['clean_dedup']['docs_per_s_per_engine']:,.0f} docs/s", ENGINES,
             docs / (st["clean_dedup"]["docs_per_s_per_engine"] * ENGINES)),
            ("tokenizer (bounded sample)", f"{sample:,.0f} documents",  # one engine: the rate times the engines
             f"{st['tokenizer']['docs_per_s_per_engine'] * e:,.0f} docs/s", 1,
             sample / (st["tokenizer"]["docs_per_s_per_engine"] * e)),
            ("encode + pack", f"{kept:,.0f} documents", f"{st['encode_pack']['docs_per_s_per_engine']:,.0f} docs/s",
             ENGINES, kept / (st["encode_pack"]["docs_per_s_per_engine"] * ENGINES))]
    total = sum(r[-1] for r in rows)
    cfg = CleanConfig()
    p_exact = n_partitions(int(docs), EXACT_KEY_BYTES, cfg.memory_mb, ENGINES)
    after_exact = docs * (1 - sum(n for k, n in run["dropped"].items()
                              if k != "near_duplicate") / run["documents"])
    p_near = n_partitions(int(after_exact * cfg.near_dedup.bands), BAND_ENTRY_BYTES, cfg.near_dedup.memory_mb, ENGINES)
    lines = ["| stage | input | measured rate per engine (here) | engines | projected minutes |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {name} | {n_in} | {rate} | {engines} | {sec / 60:.1f} |" for name, n_in, rate, engines, sec in rows]
    lines.append(f"| **all** | | | | **{total / 60:.1f}** |")
    out = {"bench": "project_prep", "from": {"size": run["size"], "engines": e, "documents": run["documents"]},
           "tokens_per_kept_doc": round(tokens_per_doc, 1), "study_kept_docs": round(kept),
           "study_input_docs": round(docs), "engines": ENGINES, "minutes": round(total / 60, 1),
           "partitions": {"exact": p_exact, "near": p_near},
           "docs_per_partition": {"exact": round(docs / p_exact), "near": round(after_exact / p_near)},
           "near_duplicate_share": round(near_share, 4),
           "components_mib_one_engine": round(near_share * docs * (2 * 16 + 80) / 2**20),
           "pack_plan_mib_one_engine": round(kept * (8 + 1 + 40) / 2**20),
           "peak_rss_mib_per_engine_here": run["peak_rss_mib_per_engine"]}
    return "\n".join(lines) + "\n", out


def main() -> None:
    records = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    table, out = project(records)
    print(table, end="")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
