"""Configuration of a training run (``TrainConfig``, in sections) and of the end-to-end demo."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from labkit.config.base import SPECIAL_TOKENS, _one_of, _require, did_you_mean, to_dict  # noqa: F401
from labkit.config.data import CleanConfig, CorpusConfig, ShardConfig, StageConfig, TokenizerConfig  # noqa: F401
from labkit.config.model import ModelConfig  # noqa: F401
from labkit.config.sections import (FREE, SAFE, BatchConfig, CheckpointConfig, DataConfig, EvalConfig, MeasureConfig,
                                    OptimConfig, ParallelConfig, ScheduleConfig)

__all__ = ["default_workdir", "DemoConfig", "FLAT_KEYS", "TRAIN_SECTIONS", "TrainConfig", "dotted", "resume_policy"]

TRAIN_SECTIONS: dict[str, type] = {"optim": OptimConfig, "schedule": ScheduleConfig, "batch": BatchConfig,
                                   "parallel": ParallelConfig, "checkpoint": CheckpointConfig, "eval": EvalConfig,
                                   "data": DataConfig, "measure": MeasureConfig}
"""``TrainConfig``'s sections: field name (and TOML table under [train]) -> dataclass."""

FLAT_KEYS: dict[str, str] = {
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "beta1": "optim.beta1", "beta2": "optim.beta2",
    "grad_clip": "optim.grad_clip",
    "schedule": "schedule.kind", "warmup_steps": "schedule.warmup_steps", "min_lr_ratio": "schedule.min_lr_ratio",
    "wsd_decay_fraction": "schedule.wsd_decay_fraction",
    "micro_batch_size": "batch.micro_batch_size", "grad_accum_steps": "batch.grad_accum_steps",
    **{k: f"parallel.{k}" for k in ("sharding", "tp", "pp", "pp_schedule", "pp_virtual_stages", "sequence_parallel",
                                    "fsdp_reshard_after_forward", "bucket_cap_mb", "grad_compression",
                                    "powersgd_rank", "powersgd_start_iter")},
    "ckpt_every": "checkpoint.every", "keep_checkpoints": "checkpoint.keep",
    "async_checkpoint": "checkpoint.asynchronous", "checkpoints": "checkpoint.enabled",
    "eval_every": "eval.every", "eval_sequences": "eval.sequences", "eval_batch_size": "eval.batch_size",
    **{k: f"data.{k}" for k in ("seq_len", "tokenizer_path", "verify_data", "mlm_probability", "num_workers")},
    **{k: f"measure.{k}" for k in ("log_every", "timing_warmup_steps", "trackers")},
}
"""The flat ``TrainConfig`` field names of config.json files, TOML files and ``--set`` items from
before the sections -> their dotted names now. ``labkit.config.tomlfile`` still reads them (one
warning line each), and ``labkit.train.run_config`` reads old run directories' config.json with
them."""


def _section(name: str, cls: type, value: Any, base: Any = None) -> Any:
    """``value`` (a ``cls``, or a dict of the fields that differ from ``base``, by default the
    section's defaults) as a ``cls``; ValueError naming ``name.key``."""
    if isinstance(value, cls):
        return value
    _require(isinstance(value, dict), name, f"expected a {cls.__name__} or a dict of its fields, got {value!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in value:
        _require(key in names, f"{name}.{key}",
                 "unknown key; " + did_you_mean(key, names, f"{name} has {', '.join(names)}"))
    return cls(**value) if base is None else dataclasses.replace(base, **value)


@dataclass(kw_only=True)
class TrainConfig:
    """One MLM pretraining run (``labkit.train.train``). Rank and world size come from the
    environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as under torchrun.

    The run's own fields are at the top; the rest sit in sections (``TRAIN_SECTIONS``, each a TOML
    table ``[train.<name>]``), given as the section's dataclass or as a dict of the fields that differ
    from its defaults::

        TrainConfig(data_dir="work/shards", run_dir="work/runs/a", model="tiny", max_steps=60,
                    optim={"lr": 3e-4}, batch={"micro_batch_size": 8, "grad_accum_steps": 2})

    A variant is ``cfg.replace(max_steps=200, optim={"lr": 1e-4})`` (a section's dict changes
    those fields and keeps the others). Global batch size = batch.micro_batch_size *
    batch.grad_accum_steps * dp (sequences), dp = world size / (parallel.tp * parallel.pp).

    Each field's metadata says whether it may change when the run is resumed (``FREE``, ``SAFE``,
    else it must stay the same; ``resume_policy``). A flat name of before the sections as a keyword
    (``TrainConfig(lr=...)``) is refused with a ValueError naming its section, and read only as
    ``cfg.optim.lr`` (there is no flat attribute).
    """

    data_dir: str = field(metadata=FREE)
    """Shard directory (holding index.json), usually the node-local staged copy."""
    run_dir: str = field(metadata=FREE)
    """Where config.json, metrics.jsonl, checkpoints/ and result.json go (rank 0 writes)."""
    model: str = "mini"
    """Model size preset name from ``labkit.model.MODEL_SIZES``."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of ``ModelConfig`` that replace the preset's (vocab_size comes from the shards)."""
    max_steps: int = field(default=100, metadata=SAFE)
    """Optimiser steps in the run (the schedule's length)."""
    stop_after: int | None = field(default=None, metadata=FREE)
    """Stop (checkpointing) after this many optimiser steps as if interrupted; the schedule still
    follows max_steps, so a resumed run continues it exactly. None runs to max_steps."""
    seed: int = 0
    """Seed of model init, data order and masking."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype; weights stay fp32. fp16 uses a gradient scaler."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda:LOCAL_RANK when CUDA is available, else cpu."""
    backend: Literal["auto", "gloo", "nccl"] = field(default="auto", metadata=FREE)
    """Process-group backend; auto: nccl on cuda, gloo on cpu."""
    num_threads: int | None = field(default=None, metadata=FREE)
    """torch intra-op threads per rank (CPU); None leaves torch's default."""
    compile: bool = False
    """``torch.compile`` each pipeline stage's forward (the whole model at pp = 1; ``nn.Module.compile``,
    in place, so parameter names and checkpoints stay the same) after tensor parallelism and before
    the data-parallel wrapping (``labkit.train.parallel.build``)."""
    activation_checkpointing: bool = False
    """Recompute each encoder layer's activations in backward (sets ModelConfig's field; the
    same as model_overrides={"activation_checkpointing": True})."""
    on_nonfinite: Literal["skip", "raise"] = "raise"
    """A non-finite loss either skips the optimiser step or stops with an error."""
    timeout_s: float = field(default=300.0, metadata=FREE)
    """Timeout of collectives and process-group setup, in seconds."""
    resume: bool = field(default=True, metadata=FREE)
    """Continue from the newest checkpoint in run_dir/checkpoints if there is one (it must be this
    run's: the run id in config.json); False, or no checkpoint: a new run, and the files of an
    earlier run in run_dir move to run_dir/previous/<UTC time>-<its run id>/."""
    allow_safe_changes: bool = field(default=False, metadata=FREE)
    """Resume even though fields that leave the steps already taken unchanged differ from the
    run directory's saved config (the ``SAFE`` ones: max_steps, log/checkpoint/eval intervals, the
    split; ``resume_policy``). Result-changing differences are refused regardless."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and gradient clipping."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Micro-batch size, gradient accumulation and the global batch over the run."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The (pp, dp, tp) split and the data-parallel strategy."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When and how checkpoints are written."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The held-out loss."""
    data: DataConfig = field(default_factory=DataConfig)
    """What the run expects of its shards, the loader and the masking."""
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    """Metric records and sinks."""

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainConfig:
        flat = [k for k in kwargs if k in FLAT_KEYS and k not in TRAIN_SECTIONS]
        if flat:  # a one-line answer instead of TypeError's "unexpected keyword argument"
            section, key = FLAT_KEYS[flat[0]].split(".")
            raise ValueError(f"{flat[0]}: is now {section}.{key}: TrainConfig(..., {section}={{{key!r}: ...}})")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _require(not isinstance(self.schedule, str), "schedule",
                 "is now schedule.kind: TrainConfig(..., schedule={'kind': ...})")
        for name, cls in TRAIN_SECTIONS.items():
            setattr(self, name, _section(name, cls, getattr(self, name)))
        _one_of(self.precision, "precision", ("fp32", "bf16", "fp16"))
        _one_of(self.device, "device", ("auto", "cpu", "cuda"))
        _one_of(self.backend, "backend", ("auto", "gloo", "nccl"))
        _one_of(self.on_nonfinite, "on_nonfinite", ("skip", "raise"))
        _require(self.max_steps > 0, "max_steps", f"must be positive, got {self.max_steps}")
        _require(self.stop_after is None or self.stop_after > 0, "stop_after", "must be positive or None")
        _require(self.timeout_s > 0, "timeout_s", f"must be positive, got {self.timeout_s}")
        self._check_across_sections()

    def _check_across_sections(self) -> None:
        """One-line refusals of combinations of sections (each section checks its own fields)."""
        par, m = self.parallel, self.batch.grad_accum_steps
        _require(par.pp == 1 or par.pp_schedule == "gpipe" or m >= par.pp, "batch.grad_accum_steps",
                 f"{par.pp_schedule} needs at least as many micro-batches as stages: {m} < parallel.pp {par.pp}")
        _require(par.pp == 1 or self.batch.schedule == "fixed", "batch.schedule",
                 f"{self.batch.schedule!r} changes the micro-batches per step, which a pipeline schedule fixes when it "
                 "is built: with parallel.pp > 1 use 'fixed'")
        rounds = max(1, m // par.pp)
        _require(par.pp == 1 or par.pp_schedule != "interleaved_1f1b" or m % rounds == 0, "batch.grad_accum_steps",
                 f"interleaved_1f1b needs a multiple of {rounds} micro-batches (rounds of parallel.pp {par.pp}), "
                 f"got {m}")

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes``: a top-level field by name, a section by a dict of the fields that
        change (the others kept) or by a whole section. ValueError naming an unknown key (a flat name
        from before the sections names its section)."""
        names = [f.name for f in dataclasses.fields(self)]
        for name, value in list(changes.items()):
            if name not in names:
                hint = (f"is now {FLAT_KEYS[name]}" if name in FLAT_KEYS else
                        "unknown key; " + did_you_mean(name, names, f"TrainConfig has {', '.join(names)}"))
                raise ValueError(f"{name}: {hint}")
            if name in TRAIN_SECTIONS and isinstance(value, dict):
                changes[name] = _section(name, TRAIN_SECTIONS[name], value, base=getattr(self, name))
        return dataclasses.replace(self, **changes)


def dotted(config: dict[str, Any]) -> dict[str, Any]:
    """A saved ``TrainConfig`` dict (``to_dict``; config.json with its non-field records such as
    provenance and run_id) with its section fields as dotted keys (``{"optim.lr": 1e-3, ...}``).
    A config.json from before the sections (flat keys) reads the same (``FLAT_KEYS``)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key in TRAIN_SECTIONS and isinstance(value, dict):
            out |= {f"{key}.{k}": v for k, v in value.items()}
        else:
            out[FLAT_KEYS.get(key, key)] = value
    return out


def resume_policy() -> dict[str, str]:
    """Every ``TrainConfig`` field, dotted (``optim.lr``), -> "free", "safe" or "same": whether it
    may differ when a run is resumed (never matters; only with ``allow_safe_changes``; must be
    the same), from the fields' metadata (``labkit.config.sections.FREE`` / ``SAFE``)."""
    out = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in TRAIN_SECTIONS:
            out |= {f"{f.name}.{g.name}": g.metadata.get("resume", "same")
                    for g in dataclasses.fields(TRAIN_SECTIONS[f.name])}
        else:
            out[f.name] = f.metadata.get("resume", "same")
    return out


def default_workdir() -> str:
    """``$LABKIT_WORKDIR`` or ``./work`` (resolved when called, not at import)."""
    return os.environ.get("LABKIT_WORKDIR", "work")


@dataclass(kw_only=True)
class DemoConfig:
    """The end-to-end lab on the embedded default (``labkit demo``): local engines, CPU, gloo."""

    workdir: str = "work/demo"
    """Root of every artifact: corpus/, shards/, local/ (staged), runs/, sweeps/, reports/."""
    engines: int = 2
    """Local ipyparallel engines (one per simulated GPU)."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    clean: CleanConfig = field(default_factory=CleanConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shards: ShardConfig = field(default_factory=lambda: ShardConfig(heldout_fraction=0.01))
    """Packing; 1 % of the documents are held out for evaluation."""
    model: str = "mini"
    """Model preset trained by the demo."""
    train_steps: int = 40
    """Optimiser steps of the DDP training run (its loss levels off after about 20 at the default
    settings; the held-out loss is evaluated 6 times and at the end)."""
    micro_batch_size: int = 16
    """Sequences per rank per step."""
    sweep_steps: int = 8
    """Steps per point of the rank-scaling sweep (the first two are warm-up)."""
    sweep_models: tuple[str, ...] = ("mini", "small")
    """Model presets whose largest micro-batch is found under memory_budget_gib."""
    memory_budget_gib: float = 2.0
    """CPU memory budget per rank for the micro-batch sweep, in GiB (model state plus the
    activations saved for backward)."""
    reports: bool = True
    """Execute the notebooks and export HTML reports."""

    def __post_init__(self) -> None:
        _require(self.engines >= 1, "engines", "must be at least 1")
        _require(self.train_steps > 0, "train_steps", "must be positive")
        _require(self.memory_budget_gib > 0, "memory_budget_gib", "must be positive")
