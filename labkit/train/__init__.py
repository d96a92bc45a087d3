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
"""

from labkit.train.checkpoint import checkpoint_steps, load_checkpoint, save_checkpoint
from labkit.train.loop import AUTOCAST_DTYPES, forward_backward, train
from labkit.train.optim import build_optimizer, lr_at

__all__ = ["AUTOCAST_DTYPES", "build_optimizer", "checkpoint_steps", "forward_backward", "load_checkpoint", "lr_at",
           "save_checkpoint", "train"]
