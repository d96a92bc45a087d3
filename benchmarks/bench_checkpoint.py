"""Checkpoint save time and training stall: labkit's torch.distributed.checkpoint saves (each rank
writing its own part; synchronous, and asynchronous with ``async_save``) against the format they
replaced, rank 0's ``torch.save`` of the whole model and optimiser while the other ranks wait.

For each model preset (``--models``: ``small`` and ``bert-120m``, the largest that fits beside
the other work of a 24 GiB machine: bert-350m needs ~5.4 GB of weights and AdamW state per rank,
twice that with the asynchronous copy) and each world size (1 process; 2 gloo ranks under DDP),
one process group builds the model and AdamW (its state created by one step on zero
gradients), then runs ``--rounds`` paired rounds after a warm-up round; in each round the three
ways save the same state, in an order that rotates every round:

- ``torch_save``: rank 0 writes ``{"model": state_dict(), "optim": optimizer.state_dict()}`` with
  ``torch.save``; every rank waits in a barrier, so its stall is the whole save.
- ``dcp_sync``: ``labkit.train.checkpoint.Checkpointer.save`` of the run's state
  (``labkit.train.resume.RunState`` over the run's builder, ``build_runtime``): the stall is the whole save.
- ``dcp_async``: the same with ``asynchronous=True``: the stall is what ``save`` blocks for
  (state dict, copy to CPU memory, planning); ``save_s`` runs until the directory is published.
  The background write still shares the machine's cores and disk with training, which the stall
  does not count.

Per save, per rank: ``stall_s``, ``save_s`` and ``bytes`` written (that rank's DCP data file;
rank 0 also state.pt, .metadata and the marker; torch.save: rank 0 the whole file). Each line
printed is one (model, ranks, round, way) with rank 0's times, every rank's bytes and the load
average. Last line: one JSON object: value = median over rounds of the asynchronous stall /
the synchronous save time (largest model, 2 ranks), baseline = rank-0 torch.save seconds there,
ratio = the DCP synchronous save time / torch.save's; plus each configuration's medians and each
rank's share of the bytes at 2 ranks. Run: ``python benchmarks/bench_checkpoint.py`` from the
repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _prep import spawn_ranks  # noqa: E402

WAYS = ("torch_save", "dcp_sync", "dcp_async")


def _dir_bytes(path: pathlib.Path, rank: int) -> int:
    """Bytes rank ``rank`` wrote into checkpoint directory ``path``."""
    own = path / f"__{rank}_0.distcp"
    total = own.stat().st_size if own.exists() else 0
    if rank == 0:
        total += sum(p.stat().st_size for p in path.iterdir() if not p.name.endswith(".distcp"))
    return total


def _save_rounds(rank: int, world: int, args_json: str, out: str) -> None:
    """Every model's rounds of the three ways on this rank (``spawn_ranks``'s ``run``, in its process
    group at 2 ranks; one torch thread); rank 0 writes the lines to ``out``."""
    args = json.loads(args_json)
    torch.set_num_threads(1)
    from labkit.config import TrainConfig
    from labkit.data.mlm import RankSampler
    from labkit.model import BertMLM, model_config
    from labkit.train import build_runtime, dist
    from labkit.train.checkpoint import MARKER, Checkpointer
    from labkit.train.resume import RunState

    root = pathlib.Path(args["dir"])
    lines = []
    for name in args["models"]:
        torch.manual_seed(0)
        run_dir = root / f"{name}-{world}"
        cfg = TrainConfig(data_dir="-", run_dir=str(run_dir), model=name, optim={"lr": 1e-4})
        runtime = build_runtime(cfg, BertMLM(model_config(name, args["vocab"])), torch.device("cpu"))
        model, optimizer = runtime.parts, runtime.optimizer  # the run's builder: DDP at 2 ranks
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()  # AdamW's state exists, as in a run
        optimizer.zero_grad(set_to_none=True)
        state = RunState(cfg, runtime, RankSampler(64 * world, rank=rank, world_size=world, batch_size=4), "bench")
        savers = {"dcp_sync": Checkpointer(run_dir / "sync", keep=1),
                  "dcp_async": Checkpointer(run_dir / "async", keep=1, asynchronous=True)}
        for rnd in range(args["rounds"] + 1):  # round 0: warm-up
            order = WAYS[rnd % 3:] + WAYS[:rnd % 3]
            for way in order:
                dist.barrier()
                t0 = time.perf_counter()
                if way == "torch_save":
                    target = run_dir / "torch" / "state.pt"
                    if rank == 0:
                        target.parent.mkdir(parents=True, exist_ok=True)
                        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                                   target)
                        os.sync()
                    dist.barrier()
                    stall = save_s = time.perf_counter() - t0
                    written = target.stat().st_size if rank == 0 else 0
                else:
                    saver = savers[way]
                    state.step = rnd + 1
                    stall = saver.save(rnd + 1, state)  # the run's state, as train() saves it
                    saver.wait()
                    save_s = saver.saved_s[-1]
                    dist.barrier()  # rank 0 has published the directory
                    kind = "sync" if way == "dcp_sync" else "async"
                    step_dir = run_dir / kind / "checkpoints" / f"step-{rnd + 1}"
                    assert (step_dir / MARKER).is_file()
                    written = _dir_bytes(step_dir, rank)
                per_rank = dist.all_gather_object({"stall_s": stall, "save_s": save_s, "bytes": written})
                if rank == 0:
                    lines.append({"model": name, "ranks": world, "round": rnd, "way": way,
                                  "stall_s": per_rank[0]["stall_s"], "save_s": per_rank[0]["save_s"],
                                  "max_stall_s": max(r["stall_s"] for r in per_rank),
                                  "bytes_per_rank": [r["bytes"] for r in per_rank],
                                  "load_avg_1m": os.getloadavg()[0]})
                    print(json.dumps(lines[-1]), flush=True)
        for saver in savers.values():
            saver.close()
        del model, optimizer, state, runtime
        shutil.rmtree(run_dir, ignore_errors=True)
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps(lines))


def _median(lines: list[dict], key: str, **match) -> float:
    return statistics.median(r[key] for r in lines if r["round"] > 0 and all(r[k] == v for k, v in match.items()))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="small,bert-120m")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", default="1,2")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    models = args.models.split(",")
    worlds = [int(w) for w in args.ranks.split(",")]
    lines: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_", dir=os.environ.get("TMPDIR")) as tmp:
        for world in worlds:
            out = pathlib.Path(tmp) / f"lines-{world}.json"
            payload = json.dumps({"dir": str(pathlib.Path(tmp) / "runs"), "models": models, "vocab": args.vocab,
                                  "rounds": args.rounds})
            spawn_ranks(world, _save_rounds, payload, str(out), pin=False)
            lines += json.loads(out.read_text())
    configs = {}
    for name in models:
        for world in worlds:
            row = {}
            for way in WAYS:
                row[f"{way}_stall_s"] = _median(lines, "stall_s", model=name, ranks=world, way=way)
                row[f"{way}_save_s"] = _median(lines, "save_s", model=name, ranks=world, way=way)
                row[f"{way}_bytes_per_rank"] = next(r["bytes_per_rank"] for r in lines
                                                    if (r["model"], r["ranks"], r["way"]) == (name, world, way))
            configs[f"{name}@{world}"] = row
    big, world = models[-1], max(worlds)
    rounds = sorted({r["round"] for r in lines if r["round"] > 0})

    def at(way: str, rnd: int) -> dict:
        return next(r for r in lines if (r["model"], r["ranks"], r["way"], r["round"]) == (big, world, way, rnd))

    async_over_sync = [at("dcp_async", k)["stall_s"] / at("dcp_sync", k)["save_s"] for k in rounds]
    sync_over_torch = [at("dcp_sync", k)["save_s"] / at("torch_save", k)["save_s"] for k in rounds]
    shares = [b / sum(configs[f"{big}@{world}"]["dcp_sync_bytes_per_rank"])
              for b in configs[f"{big}@{world}"]["dcp_sync_bytes_per_rank"]]
    result = {"benchmark": "checkpoint", "metric": "async stall / sync save time",
              "value": statistics.median(async_over_sync),
              "baseline": f"rank-0 torch.save of the same state ({big}, {world} ranks), seconds",
              "baseline_value": configs[f"{big}@{world}"]["torch_save_save_s"],
              "ratio": statistics.median(sync_over_torch), "ratio_means": "DCP sync save time / torch.save time",
              "goal": 1.0, "higher_is_better": False,
              "per_round_async_over_sync": async_over_sync, "per_round_sync_over_torch_save": sync_over_torch,
              "byte_share_per_rank": shares, "configs": configs, "rounds": args.rounds,
              "load_avg_1m": os.getloadavg()[0]}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
