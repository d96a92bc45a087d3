"""What several benchmarks share: a real corpus from this machine's ELF files, and spawned gloo ranks.

``demo_docs(root, max_functions)`` extracts functions with labkit's corpus stage (default
CorpusConfig paths), cleans and exactly deduplicates them, and trains the default WordPiece
tokenizer; it returns (kept-documents Parquet, tokenizer.json). Cached under ``root``.

``spawn_ranks(world, run, *args, pin=...)`` runs ``run(rank, world, *args)`` on ``world`` spawned
CPU ranks of one gloo process group (``rank_worker``); ``train_each`` is the usual ``run``: train()
every config of a JSON list in turn, in that one group. ``free_port()`` is a MASTER_PORT.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.config import CleanConfig, CorpusConfig, TokenizerConfig  # noqa: E402


def demo_docs(root: Path, max_functions: int = 30_000) -> tuple[str, str]:
    from labkit.data.clean import clean_corpus  # here, not above: the spawned ranks import this module
    from labkit.data.corpus import build_corpus
    from labkit.data.tokenize import train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    docs, tok = root / "clean" / "docs.parquet", root / "tokenizer.json"
    if not (root / "corpus" / "corpus.json").exists():
        build_corpus(CorpusConfig(max_functions=max_functions), str(root / "corpus"), n_parts=1)
    if not docs.exists():
        clean_corpus(str(root / "corpus" / "part-*.parquet"), str(docs), CleanConfig())
    if not tok.exists():
        train_tokenizer(str(docs), TokenizerConfig(), str(tok))
    return str(docs), str(tok)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bound to port 0, then released): a MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_worker(rank: int, world: int, port: int, pin: bool, run: Callable[..., None], *args) -> None:
    """One spawned rank (``torch.multiprocessing.spawn``'s function): with ``pin``, pinned to core
    ``rank`` of this process's cores (modulo their number; threads started later inherit it); with
    ``world`` > 1, the single-host gloo environment (MASTER_ADDR 127.0.0.1, MASTER_PORT ``port``,
    GLOO_SOCKET_IFNAME lo) and labkit's process group (``labkit.train.dist.init_distributed``: 600 s
    collective timeout, Flight Recorder on), which every train() inside ``run`` then reuses; then
    ``run(rank, world, *args)`` (a module-level function: spawn pickles it by name); the group is
    torn down however ``run`` ends. ``run`` hands its results back in files."""
    if pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch

    from labkit.train import dist

    if world > 1:
        assert dist.init_distributed("gloo", 600.0, torch.device("cpu"))
    try:
        run(rank, world, *args)
    finally:
        if world > 1:
            dist.teardown()


def spawn_ranks(world: int, run: Callable[..., None], *args, pin: bool) -> None:
    """``run(rank, world, *args)`` on ``world`` spawned ranks (``rank_worker``, a fresh port);
    returns when every rank has; a rank's error is raised here (``ProcessRaisedException``)."""
    import torch.multiprocessing as mp

    mp.spawn(rank_worker, args=(world, free_port(), pin, run, *args), nprocs=world, join=True)


def train_each(rank: int, world: int, cfgs_json: str) -> None:
    """``run`` for ``spawn_ranks``: ``labkit.train.train`` of every config in ``cfgs_json`` (a JSON
    list of ``labkit.config.to_dict`` TrainConfigs) in turn; each run writes its own run_dir."""
    from labkit.config import TrainConfig, from_dict
    from labkit.train import train

    for cfg in json.loads(cfgs_json):
        train(from_dict(TrainConfig, cfg))
