"""The study's configuration run end to end on this machine, scaled down: configs/study.toml with
its own ``scaled_down`` overrides (its tokenizer, padding, positions and model options; a small
model, batch and step count), prepared and trained on 2 local engines, exactly as

    labkit prepare configs/study.toml --scaled-down
    labkit train configs/study.toml --scaled-down

do. Writes ``docs/data/study_run.json`` (the numbers docs/results.md sets beside labkit's
defaults, ``python docs/generate.py``) and prints it as its last line.

    python benchmarks/study_run.py [--out docs/data/study_run.json] [--set section.key=value ...]

Not a timing benchmark: tokens/s on a loaded 2-core machine are recorded with the load average
beside them, never compared. A re-run reuses the completed preparation stages (labkit's own
skip rules) and trains again from scratch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _load() -> dict:
    one, five, _ = os.getloadavg()
    return {"load_1min": round(one, 2), "load_5min": round(five, 2), "cpus": len(os.sched_getaffinity(0))}


def main() -> None:
    from labkit import commands, lab
    from labkit.config.tomlfile import load
    from labkit.data.shards import read_index

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "data" / "study_run.json"))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = load(ROOT / "configs" / "study.toml", args.set, scaled_down=True)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=False))
    t0, before = time.time(), _load()
    commands.prepare(cfg)
    prepared = time.time()
    load_train = _load()
    with commands.cluster_client(cfg.cluster) as client:
        staged = lab.stage(client, cfg.workdir, local_root=cfg.stage.local_root, verify=cfg.stage.verify)
        result = lab.train_on_cluster(client, cfg.train, staged=staged)
    index = read_index(pathlib.Path(cfg.workdir) / "shards")
    keep = ("initial_loss", "final_loss", "eval_loss", "perplexity", "tokens_per_s", "samples_per_s",
            "data_wait_fraction", "packing_efficiency", "packing", "world_size", "global_batch_size", "steps",
            "params", "non_embedding_params", "flops_per_token", "seq_len", "vocab_size", "precision", "model",
            "model_config", "wall_s")
    record = {"command": "python benchmarks/study_run.py", "config": "configs/study.toml",
              "overrides": list(cfg.scaled_down) + list(args.set), "preparation": lab.preparation_report(cfg.workdir),
              "index_packing": index.get("packing"), "train": {k: result.get(k) for k in keep},
              "git_commit": (result.get("provenance") or {}).get("git"), "load_before": before,
              "load_before_train": load_train, "load_after": _load(),
              "seconds": {"prepare": round(prepared - t0, 1), "total": round(time.time() - t0, 1)}}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(json.dumps(record, default=str))


if __name__ == "__main__":
    main()
