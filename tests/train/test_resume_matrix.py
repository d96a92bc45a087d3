"""Resume at every pair of layouts (issue 34): a run stopped at one layout continues at another.

Layouts: 1 rank, dp 2 DDP, dp 2 FSDP2, tp 2, tp 2 with sequence parallelism, pp 2, tp 2 x dp 2.
Every source layout runs the same 4-step run (global batch 16, no dropout) stopped after step 2;
every target resumes a copy of its run directory (``allow_safe_changes``: the split and sharding are
safe changes; the target sets the ``batch.grad_accum_steps`` that keeps the global batch at its dp,
which the resume accepts as it is). With dropout 0 every layout computes the same steps to rounding,
so each moved run is
compared with the 1-rank run that never moved: losses and the final weights within 1e-5 (at
lr 3e-4: one element of ``position.weight`` has a gradient near AdamW's eps, where the layouts'
rounding is amplified to 5e-5 at lr 3e-3 by tp 2 alone, without any move). The
default suite runs a cycle through the layouts (each once as source and once as target) and the
two moves between pp 2 and tp 2 with dropout on, after which each tp rank draws its own stream and
the tp group one replicated stream (``labkit.train.rng``); the ``slow`` test runs all 49 pairs.
Spawns: 1-rank sources in this process, one spawn of 2 ranks (every 2-rank source, then every
2-rank target), one of 4 (tp 2 x dp 2 as source, then as target), 1-rank targets in this process,
in that order, so each target finds its source written (a 2-rank target of the 4-rank source takes
a second 2-rank spawn after the 4-rank one).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from gloo_group import free_port, gloo_group
from labkit.config import TrainConfig, from_dict, to_dict

pytestmark = pytest.mark.torch_threads(1)

LAYOUTS = {  # name: (ranks, parallel section)
    "one": (1, {}),
    "ddp": (2, {"sharding": "ddp"}),
    "fsdp": (2, {"sharding": "fsdp"}),
    "tp2": (2, {"tp": 2, "sharding": "fsdp"}),
    "tp2sp": (2, {"tp": 2, "sharding": "fsdp", "sequence_parallel": True}),
    "pp2": (2, {"pp": 2, "sharding": "replicate"}),
    "tp2dp2": (4, {"tp": 2, "sharding": "fsdp"}),
}
CYCLE = [("one", "ddp"), ("ddp", "fsdp"), ("fsdp", "tp2"), ("tp2", "tp2sp"), ("tp2sp", "pp2"), ("pp2", "tp2dp2"),
         ("tp2dp2", "one")]
"""(source, target): every layout once as each."""
DROPOUT = [("pp2", "tp2"), ("tp2", "pp2")]
"""The moves between pp 2 and tp 2 with dropout on."""
GLOBAL_BATCH, MICRO, STEPS, STOP = 16, 4, 4, 2


def _cfg(shards: pathlib.Path, run_dir: pathlib.Path, layout: str, *, dropout: float = 0.0, **kw) -> TrainConfig:
    """The matrix's run at ``layout``: 4 steps of a global batch of 16 (micro-batches of 4 accumulated
    to it at the layout's dp), a checkpoint after step 2 and at the end."""
    ranks, parallel = LAYOUTS[layout]
    dp = ranks // (parallel.get("tp", 1) * parallel.get("pp", 1))
    return TrainConfig(data_dir=str(shards), run_dir=str(run_dir), model="tiny", max_steps=STEPS, num_threads=1,
                       device="cpu", timeout_s=120, allow_safe_changes=True, parallel=parallel,
                       model_overrides={"hidden_dropout": dropout, "attention_dropout": dropout, "num_heads": 4},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": GLOBAL_BATCH // (MICRO * dp)},
                       schedule={"warmup_steps": 1}, optim={"lr": 3e-4}, measure={"trackers": ()},
                       checkpoint={"every": STOP}, eval={"every": 0}).replace(**kw)


def _plan(root: pathlib.Path, shards: pathlib.Path, pairs: list[tuple[str, str, float]]) -> dict[str, dict]:
    """{"sources": {world: entries}, "targets": {world: entries}}: each source layout's stopped run
    (``src-<layout>[-drop<p>]``), and each target: its source's directory copied to
    ``<source>-to-<target>[-drop<p>]`` and resumed at the target (entries: a config's JSON, or
    ["copy", src, dst], run in order)."""
    plan: dict[str, dict] = {"sources": {1: [], 2: [], 4: []}, "targets": {1: [], 2: [], 4: []}}
    for layout, drop in sorted({(s, d) for s, _, d in pairs}):
        cfg = _cfg(shards, root / f"src-{layout}{_tag(drop)}", layout, dropout=drop, stop_after=STOP)
        plan["sources"][LAYOUTS[layout][0]].append(json.dumps(to_dict(cfg)))
    for src, dst, drop in pairs:
        moved = root / f"{src}-to-{dst}{_tag(drop)}"
        cfg = _cfg(shards, moved, dst, dropout=drop)
        plan["targets"][LAYOUTS[dst][0]] += [["copy", str(root / f"src-{src}{_tag(drop)}"), str(moved)],
                                             json.dumps(to_dict(cfg))]
    return plan


def _tag(dropout: float) -> str:
    return f"-drop{dropout}" if dropout else ""


def _run_entries(entries: list, rank: int) -> None:
    """train() of each config in turn; a ["copy", src, dst] entry copies a run directory (rank 0)."""
    from labkit.train import train

    for entry in entries:
        if isinstance(entry, list):
            if rank == 0:
                shutil.copytree(entry[1], entry[2])
        else:
            train(from_dict(TrainConfig, json.loads(entry)))
        if tdist.is_initialized():
            tdist.barrier()


def _worker(rank: int, world: int, port: int, phases: list[list]) -> None:
    """One process group; its entries of every phase whose turn is this world size's."""
    with gloo_group(rank, world, port):
        for entries in phases:
            _run_entries(entries, rank)


def _run_matrix(root: pathlib.Path, pairs: list[tuple[str, str, float]]) -> pathlib.Path:
    """Every source, then every target of ``pairs`` ((source, target, dropout)), and the 1-rank
    reference that never moved (``ref``); returns ``root``. The 2-rank targets join the 2-rank
    sources' spawn unless one of them continues the 4-rank source (then a second spawn follows it)."""
    from tiny_shards import write_tiny_shards

    shards = write_tiny_shards(root / "shards", n_sequences=64)
    plan = _plan(root, shards, pairs)
    _run_entries(plan["sources"][1] + [json.dumps(to_dict(_cfg(shards, root / "ref", "one")))], 0)
    after_four = any(LAYOUTS[s][0] == 4 and LAYOUTS[d][0] == 2 for s, d, _ in pairs)
    phases = [plan["sources"][2]] if after_four else [plan["sources"][2], plan["targets"][2]]
    mp.spawn(_worker, args=(2, free_port(), phases), nprocs=2, join=True)
    if plan["sources"][4] or plan["targets"][4]:
        mp.spawn(_worker, args=(4, free_port(), [plan["sources"][4], plan["targets"][4]]), nprocs=4, join=True)
    if after_four:
        mp.spawn(_worker, args=(2, free_port(), [plan["targets"][2]]), nprocs=2, join=True)
    _run_entries(plan["targets"][1], 0)
    return root


def _losses(run_dir: pathlib.Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_moves(root: pathlib.Path, pairs: list[tuple[str, str, float]]) -> None:
    """Every dropout-free move: the reference's 4 losses and final weights within 1e-5; a move with
    dropout trains on (finite losses); a tp 2 target's ranks hold distinct own streams and one
    replicated stream at their last checkpoint."""
    from labkit.train.checkpoint import load_weights, read_state

    ref_w = load_weights(root / "ref" / "checkpoints" / f"step-{STEPS}")
    for src, dst, drop in pairs:
        moved = root / f"{src}-to-{dst}{_tag(drop)}"
        losses = _losses(moved)
        assert len(losses) == STEPS and json.loads((moved / "result.json").read_text())["resumed_from_step"] == STOP
        if not drop:
            assert max(abs(a - b) for a, b in zip(losses, _losses(root / "ref"))) < 1e-5, (src, dst)
            w = load_weights(moved / "checkpoints" / f"step-{STEPS}")
            assert set(w) == set(ref_w) and max(float((w[k] - v).abs().max()) for k, v in ref_w.items()) < 1e-5, \
                (src, dst)
            continue
        assert all(x == x for x in losses), (src, dst)
        ranks = [r["rng"] for r in read_state(moved / "checkpoints" / f"step-{STEPS}")["ranks"]]
        if LAYOUTS[dst][1].get("tp", 1) == 2:
            assert not torch.equal(ranks[0]["torch"], ranks[1]["torch"]), (src, dst)
            assert torch.equal(ranks[0]["streams"]["replicated"], ranks[1]["streams"]["replicated"]), (src, dst)
        else:  # pp 2: each stage its own replicated stream
            assert not torch.equal(ranks[0]["torch"], ranks[1]["torch"]), (src, dst)


SUBSET = [(s, d, 0.0) for s, d in CYCLE] + [(s, d, 0.1) for s, d in DROPOUT]


def test_every_layout_moves_to_another_and_continues(tmp_path):
    """The cycle (every layout once as source and once as target) and pp 2 <-> tp 2 with dropout."""
    _check_moves(_run_matrix(tmp_path, SUBSET), SUBSET)


@pytest.mark.slow
def test_every_pair_of_layouts(tmp_path):
    """All 49 (source, target) pairs, dropout 0."""
    pairs = [(s, d, 0.0) for s in LAYOUTS for d in LAYOUTS]
    _check_moves(_run_matrix(tmp_path, pairs), pairs)
