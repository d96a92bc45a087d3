"""Training: ``train(cfg)`` runs one MLM pretraining run as one rank of many, or alone.

- ``labkit.train.loop``: ``train`` and the step (``forward_backward``), read top to bottom;
- ``labkit.train.optim``: AdamW and the learning-rate schedule ``lr_at``;
- ``labkit.train.checkpoint``: atomic checkpoints and exact resume;
- ``labkit.train.dist``: process groups, DDP / ZeRO-1 / FSDP2 wrapping, collectives;
- ``labkit.train.parallel``: tensor and pipeline parallel runs (``ParallelModel``) over a (pp, dp, tp)
  mesh, with ``labkit.train.tensor_parallel`` and ``labkit.train.pipeline``;
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
    from labkit.train.checkpoint import checkpoint_steps, load_checkpoint, save_checkpoint
    from labkit.train.loop import AUTOCAST_DTYPES, forward_backward, train
    from labkit.train.optim import build_optimizer, lr_at

_WHERE = {"checkpoint_steps": "checkpoint", "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
          "AUTOCAST_DTYPES": "loop", "forward_backward": "loop", "train": "loop", "build_optimizer": "optim",
          "lr_at": "optim"}

__all__ = ["AUTOCAST_DTYPES", "build_optimizer", "checkpoint_steps", "forward_backward", "load_checkpoint", "lr_at",
           "save_checkpoint", "train"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"labkit.train.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'labkit.train' has no attribute {name!r}")
