"""Lesson 3 with the study's loader settings: DataLoader workers in front of the study's step, per
precision. The data is a study preparation's shards (``work/study/shards``: the instruction
tokenizer, one function per 512-token padded row; ``benchmarks/study_run.py`` makes them), the
batch the study's 184 sequences, and the consumer sleeps for the planned step of the study's
120M model on one H100 NVL in each precision (``labkit.study.scaling.precision_experiment`` at
1 GPU, [plan] mfu of configs/study.toml): a GPU-bound trainer leaves its CPU to the workers.
The knee (fewest workers under 5 % data wait) moves with the step time.

    python benchmarks/study_loaders.py [--workdir work/study] [--workers 0 1 2] [--out docs/data/study_loaders.jsonl]

The loaders' rates are this machine's CPU (recorded with its load average), not a GPU node's: the
table says how many workers a 2-core VM's loader needs to feed each planned step. Writes one
JSON line per (precision, workers) and prints a summary as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    import polars as pl

    from labkit.config.tomlfile import load
    from labkit.study import scaling
    from labkit.study.loader_sweep import sweep_loader
    from labkit.train.run_config import model_config_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=str(ROOT / "work" / "study"))
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seconds", type=float, default=20.0, help="timed consumer seconds per setting (about)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "data" / "study_loaders.jsonl"))
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    lab = load(ROOT / "configs" / "study.toml")
    cfg = model_config_of(lab.train, lab.plan.vocab_size)
    batch, seq_len = lab.train.batch.micro_batch_size, lab.shards.seq_len
    steps = scaling.precision_experiment(cfg, micro_batch=batch, seq_len=seq_len, device=lab.plan.device, gpus=(1,),
                                         mfu=lab.plan.mfu)
    rows = []
    for precision, step_s in zip(steps["precision"], steps["compute_s"]):
        n_batches = max(5, round(args.seconds / step_s))
        load_1m = os.getloadavg()[0]
        table = sweep_loader(str(pathlib.Path(args.workdir) / "shards"), batch_size=batch, step_time_s=step_s,
                             workers=args.workers, n_batches=n_batches, warmup_batches=3, gpu_index=None)
        rows += [r | {"precision": precision, "planned_step_s": step_s, "load_avg_1m": round(load_1m, 2),
                      "cpus": len(os.sched_getaffinity(0))} for r in table.iter_rows(named=True)]
    out = pathlib.Path(args.out)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    df = pl.DataFrame(rows)
    knees = {p: (df.filter((pl.col("precision") == p) & pl.col("knee"))["num_workers"].to_list() or [None])[0]
             for p in steps["precision"]}
    print(json.dumps({"benchmark": "study_loaders", "batch_size": batch, "seq_len": seq_len, "knee": knees,
                      "planned_step_s": dict(zip(steps["precision"], steps["compute_s"]))}))


if __name__ == "__main__":
    main()
