"""Training: ``train(cfg)`` runs one MLM pretraining run as one rank of many, or alone.

- ``labkit.train.loop``: ``train``, the optimiser step read top to bottom;
- ``labkit.train.parallel``: the one builder of every run over a (pp, dp, tp) mesh (pipeline split,
  tensor parallelism, compile, then DDP / ZeRO-1 / FSDP2 / replicas over dp), with
  ``labkit.train.tensor_parallel`` and ``labkit.train.pipeline``;
- ``labkit.train.runtime``: the step of every run (``Runtime``: one forward/backward body, the clip,
  the per-step measures), ``build_runtime`` to build it;
- ``labkit.train.optim``: AdamW and the learning-rate schedule ``lr_at``;
- ``labkit.train.resume``: ``RunState``, everything that shapes the next step, and
  ``labkit.train.checkpoint``: atomic checkpoints of it (``Checkpointer.save`` / ``load``), exact resume;
- ``labkit.train.dist``: process groups, collectives;
- ``labkit.train.evaluation``: the held-out loss on a fixed masked set, reduced over ranks;
- ``labkit.train.run_config``: a run directory's config and data identity; resume refuses drift.

``train`` reads RANK / WORLD_SIZE / LOCAL_RANK from the environment, as under ``torchrun``, so
the same call runs in a plain process, on ipyparallel engines or in a test.

The names below are imported on first use (PEP 562), so that a reader of the run's status files
(``labkit.train.status``, ``labkit ranks``) does not import torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and readers; at run time each name comes on first use (__getattr__)
    from labkit.train.checkpoint import checkpoint_steps
    from labkit.train.loop import train
    from labkit.train.optim import build_optimizer, lr_at
    from labkit.train.runtime import AUTOCAST_DTYPES, Runtime, build_runtime

_WHERE = {"checkpoint_steps": "checkpoint", "train": "loop", "build_optimizer": "optim", "lr_at": "optim",
          "AUTOCAST_DTYPES": "runtime", "Runtime": "runtime", "build_runtime": "runtime"}

__all__ = ["AUTOCAST_DTYPES", "build_optimizer", "build_runtime", "checkpoint_steps", "lr_at", "Runtime", "train"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"labkit.train.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'labkit.train' has no attribute {name!r}")
