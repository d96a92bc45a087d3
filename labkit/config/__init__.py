"""Configuration for every labkit stage: keyword-only dataclasses with documented fields.

Every field has a one-line docstring under it. ``__post_init__`` validates and raises
``ValueError`` naming the field and what is allowed. Presets are plain functions; a variant is
``dataclasses.replace(preset(), field=...)``. Every stage saves the config it ran with
(``to_dict``), and ``from_dict`` reads it back.

Nothing here touches the machine: no device probing, no environment reads at import. The
dataclasses live by stage (``labkit.config.data``, ``.model``, ``.train`` with its sections in
``.sections``), the shared helpers in
``.base`` and the TOML loader in ``.tomlfile``; every name is importable from ``labkit.config``.
"""

from labkit.config.base import (LEGACY_SPECIAL_TOKENS, SPECIAL_TOKENS, _one_of, _require, did_you_mean,  # noqa: F401
                                from_dict, to_dict)  # (_one_of, _require: the TOML loader)
from labkit.config.data import (DEFAULT_ELF_PATHS, DEFAULT_TEXT_BLOCKLIST, DEFAULT_TEXT_BOILERPLATE, CleanConfig,
                                CorpusConfig, DedupConfig, ShardConfig, StageConfig, TokenizerConfig)
from labkit.config.model import ModelConfig
from labkit.config.sections import (BatchConfig, CheckpointConfig, DataConfig, EvalConfig, MeasureConfig, OptimConfig,
                                    ParallelConfig, ScheduleConfig)
from labkit.config.train import FLAT_KEYS, TRAIN_SECTIONS, DemoConfig, TrainConfig, default_workdir, dotted, resume_policy

__all__ = ["DEFAULT_ELF_PATHS", "DEFAULT_TEXT_BLOCKLIST", "DEFAULT_TEXT_BOILERPLATE", "LEGACY_SPECIAL_TOKENS",
           "SPECIAL_TOKENS", "CleanConfig",
           "CorpusConfig", "DedupConfig", "DemoConfig", "ModelConfig", "ShardConfig", "StageConfig", "TokenizerConfig",
           "TrainConfig", "default_workdir", "did_you_mean", "from_dict", "to_dict",
           "BatchConfig", "CheckpointConfig", "DataConfig", "EvalConfig", "MeasureConfig", "OptimConfig", "ParallelConfig",
           "ScheduleConfig", "FLAT_KEYS", "TRAIN_SECTIONS", "dotted", "resume_policy"]
