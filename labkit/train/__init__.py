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
"""

from labkit.train.checkpoint import checkpoint_steps
from labkit.train.loop import train
from labkit.train.optim import build_optimizer, lr_at
from labkit.train.runtime import AUTOCAST_DTYPES, Runtime, build_runtime

__all__ = ["AUTOCAST_DTYPES", "build_optimizer", "build_runtime", "checkpoint_steps", "lr_at", "Runtime", "train"]
