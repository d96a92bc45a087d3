"""Near-dedup semantics before and after 2026-11-30 on this machine's functions: the greedy pass
(documents in id order against the LSH index of those kept so far; labkit at commit ec4e361)
vs connected components of verified candidate pairs (labkit.data.dedup now), on the same
signatures after filters and exact dedup. Prints one JSON line. Needs the git history.
Run from the repository root: python benchmarks/near_dedup_semantics.py [N_FUNCTIONS, default 30000]
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import polars as pl  # noqa: E402

from labkit.config import CleanConfig, CorpusConfig, DedupConfig  # noqa: E402
from labkit.data.clean import clean_corpus  # noqa: E402
from labkit.data.corpus import build_corpus  # noqa: E402
from labkit.data.dedup import near_duplicates, signatures  # noqa: E402


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30_000
    with tempfile.TemporaryDirectory() as d:
        old_src = Path(d) / "old_dedup.py"
        old_src.write_text(subprocess.run(["git", "show", "ec4e361:labkit/data/dedup.py"], check=True,
                                          capture_output=True, text=True).stdout)
        spec = importlib.util.spec_from_file_location("old_dedup", old_src)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        build_corpus(CorpusConfig(max_functions=n), f"{d}/corpus", n_parts=1)
        clean_corpus(f"{d}/corpus/part-*.parquet", f"{d}/docs.parquet", CleanConfig(near_dedup=None))
        docs = pl.read_parquet(f"{d}/docs.parquet")
    cfg = DedupConfig()
    sig = signatures(docs["text"].to_list(), cfg)
    ids = docs["id"].to_list()
    greedy, comp = set(old.near_duplicates(ids, sig, cfg)), set(near_duplicates(ids, sig, cfg))
    print(json.dumps({"bench": "near_dedup_semantics", "functions": n, "after_exact": len(ids),
                      "greedy_near_duplicates": len(greedy), "components_near_duplicates": len(comp),
                      "dropped_by_both": len(greedy & comp), "only_greedy": len(greedy - comp),
                      "only_components": len(comp - greedy)}))


if __name__ == "__main__":
    main()
