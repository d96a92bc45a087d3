"""Configuration of a training run and of the end-to-end demo."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from labkit.config.base import SPECIAL_TOKENS, _one_of, _require, to_dict  # noqa: F401
from labkit.config.data import CleanConfig, CorpusConfig, ShardConfig, StageConfig, TokenizerConfig  # noqa: F401
from labkit.config.model import ModelConfig  # noqa: F401

__all__ = ["default_workdir", "DemoConfig", "TrainConfig"]


@dataclass(kw_only=True)
class TrainConfig:
    """One MLM pretraining run (``labkit.train.train``). Rank and world size come from the
    environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as under torchrun.

    global batch size = micro_batch_size * grad_accum_steps * dp (sequences), dp = world size /
    (tp * pp) the data-parallel degree (the world size itself without model parallelism).
    """

    data_dir: str
    """Shard directory (holding index.json), usually the node-local staged copy."""
    run_dir: str
    """Where config.json, metrics.jsonl, checkpoints/ and result.json go (rank 0 writes)."""
    model: str = "mini"
    """Model size preset name from ``labkit.model.MODEL_SIZES``."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of ``ModelConfig`` that replace the preset's (vocab_size comes from the shards)."""
    micro_batch_size: int = 16
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimiser step."""
    max_steps: int = 100
    """Optimiser steps in the run."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to lr."""
    schedule: Literal["linear", "cosine", "wsd", "hf_linear"] = "linear"
    """Decay after warm-up: linear, cosine, or warmup-stable-decay to lr * min_lr_ratio; or "hf_linear",
    transformers' ``get_linear_schedule_with_warmup`` step for step (warm-up from 0, decay towards 0;
    min_lr_ratio unused)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.98
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    mlm_probability: float = 0.15
    """Masking probability (BERT, arXiv:1810.04805 section 3.1)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Autocast dtype; weights stay fp32. fp16 uses a gradient scaler."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda:LOCAL_RANK when CUDA is available, else cpu."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto: nccl on cuda, gloo on cpu."""
    num_threads: int | None = None
    """torch intra-op threads per rank (CPU); None leaves torch's default."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    seed: int = 0
    """Seed of model init, data order and masking."""
    log_every: int = 1
    """Write one metrics record every this many optimiser steps."""
    timing_warmup_steps: int = 2
    """Steps excluded from throughput averages in result.json."""
    ckpt_every: int = 0
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Keep the newest this many checkpoints."""
    async_checkpoint: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint's ``async_save``): training
    stalls only while the state is copied to CPU memory (``checkpoint_stall_s`` in the records)."""
    checkpoints: bool = True
    """False: write no checkpoint at all (sweep runs: metrics.jsonl and result.json only; such a
    run cannot be resumed)."""
    resume: bool = True
    """Continue from the newest checkpoint in run_dir/checkpoints if there is one (it must be this
    run's: the run id in config.json); False, or no checkpoint: a new run, and the files of an
    earlier run in run_dir move to run_dir/previous/<UTC time>-<its run id>/."""
    on_nonfinite: Literal["skip", "raise"] = "raise"
    """A non-finite loss either skips the optimiser step or stops with an error."""
    timeout_s: float = 300.0
    """Timeout of collectives and process-group setup, in seconds."""
    wsd_decay_fraction: float = 0.2
    """wsd schedule: share of max_steps (at the end) spent decaying linearly to min_lr; the
    rest after warm-up stays at lr (arXiv:2404.06395 MiniCPM; arXiv:2405.18392 uses 20 %)."""
    stop_after: int | None = None
    """Stop (checkpointing) after this many optimiser steps as if interrupted; the schedule still
    follows max_steps, so a resumed run continues it exactly. None runs to max_steps."""
    sharding: Literal["ddp", "zero1", "fsdp", "replicate"] = "ddp"
    """Data-parallel memory strategy (ZeRO stages, arXiv:1910.02054): ddp replicates everything;
    zero1 shards the AdamW moments (torch's ZeroRedundancyOptimizer); fsdp shards parameters,
    gradients and moments with FSDP2 ``fully_shard`` (ZeRO-3, or ZeRO-2-style with
    fsdp_reshard_after_forward=False). Ignored in a single process. With tp or pp > 1 (over the
    dp dimension): fsdp, or replicate (whole copies, gradients averaged over dp after each
    backward); ddp and zero1 do not compose with a split model (``labkit.train.parallel``)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split each layer's heads and FFN width and the word
    embedding / decoder by vocabulary (Megatron-LM, arXiv:1909.08053); a group is tp consecutive
    ranks, on one node. dp = world size / (tp * pp)."""
    pp: int = 1
    """Pipeline-parallel degree: stages the layers are split into (``labkit.train.pipeline``); the
    grad_accum_steps micro-batches of a step flow through them."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    """Pipeline schedule (torch.distributed.pipelining): GPipe (arXiv:1811.06965), 1F1B or
    interleaved 1F1B (arXiv:2104.04473 section 2.2)."""
    pp_virtual_stages: int = 1
    """Stages per pipeline rank: 1, or at least 2 with interleaved_1f1b."""
    sequence_parallel: bool = False
    """With tp > 1: split the residual stream along the sequence between the layers (norms and
    dropout on 1/tp of the positions; arXiv:2205.05198 section 4.2.2)."""
    fsdp_reshard_after_forward: bool = True
    """fsdp: free the gathered parameters after each layer's forward (ZeRO-3) or keep them until
    backward (False: ZeRO-2-style, more memory, one all-gather less per layer)."""
    activation_checkpointing: bool = False
    """Recompute each encoder layer's activations in backward (sets ModelConfig's field; the
    same as model_overrides={"activation_checkpointing": True})."""
    seq_len: int | None = None
    """Sequence length the run expects; shards of another length are refused before training
    (labkit.data.shards.check_shards). None takes the shards' length."""
    tokenizer_path: str | None = None
    """tokenizer.json the run expects; shards built with a tokenizer of another sha256 are
    refused before training. None skips the check."""
    verify_data: bool = False
    """Recompute every shard's sha256 against index.json before training (a staged copy was
    already verified when it was made)."""
    compile: bool = False
    """``torch.compile`` the model's forward (``nn.Module.compile``, in place, so parameter
    names and checkpoints stay the same) before wrapping it for data parallelism."""
    bucket_cap_mb: float | Literal["auto"] = 25.0
    """ddp / zero1: DDP's gradient bucket size in MiB (``DistributedDataParallel(bucket_cap_mb=)``;
    torch's default 25); "auto": sized at start-up from a backward and two all-reduces measured on
    this process group, the bucket that hides the link's latency and bandwidth behind backward
    best (``labkit.train.buckets``; rank 0 writes the choice to ``<run_dir>/bucket_auto.json``).
    Smaller buckets start all-reducing earlier in backward, larger ones pay the per-collective
    latency less often; the last bucket's all-reduce is never hidden (``comm_exposed_s`` in every
    metrics record, docs/training.md)."""
    grad_compression: Literal["none", "bf16", "powersgd"] = "none"
    """ddp / zero1: how DDP's gradient buckets travel (``labkit.train.comm.compression_hook``, in the
    one comm hook with the timing): "none" all-reduces fp32; "bf16" casts each bucket to bfloat16
    for the all-reduce (torch's ``bf16_compress_hook``: half the bytes); "powersgd" sends a rank-
    ``powersgd_rank`` factorisation of each matrix gradient (torch's ``powerSGD_hook``, Vogels et
    al. 2019, arXiv:1905.13727, with error feedback) after ``powersgd_start_iter`` plain steps."""
    powersgd_rank: int = 4
    """grad_compression="powersgd": the rank of each gradient matrix's approximation
    (``PowerSGDState.matrix_approximation_rank``)."""
    powersgd_start_iter: int = 10
    """grad_compression="powersgd": optimiser steps all-reduced uncompressed before PowerSGD starts
    (``PowerSGDState.start_powerSGD_iter``; at least 2, torch's requirement with error feedback)."""
    allow_safe_changes: bool = False
    """Resume even though fields that leave the steps already taken unchanged differ from the
    run directory's saved config (max_steps, log/checkpoint/eval intervals:
    ``labkit.train.run_config.SAFE_FIELDS``). Result-changing differences are refused regardless."""
    eval_every: int = 0
    """Evaluate the held-out loss (``labkit.train.evaluation``) every this many optimiser steps and at
    the end; 0: at the end only, and only when the shards have a held-out split (with
    eval_every > 0 shards without one are refused)."""
    eval_sequences: int = 256
    """Held-out sequences in the fixed evaluation set (the first ones of the split)."""
    eval_batch_size: int | None = None
    """Sequences per evaluation forward per rank; None: micro_batch_size."""
    trackers: tuple[str, ...] = ("tensorboard",)
    """Metric sinks rank 0 sends every record to besides metrics.jsonl (``labkit.train.sinks.SINKS``):
    "tensorboard" writes event files under run_dir/tensorboard; () writes none."""

    def __post_init__(self) -> None:
        _one_of(self.sharding, "sharding", ("ddp", "zero1", "fsdp", "replicate"))
        for name in ("micro_batch_size", "grad_accum_steps", "max_steps", "log_every", "keep_checkpoints"):
            _require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        _require(self.lr > 0, "lr", "must be positive")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        _require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        _one_of(self.schedule, "schedule", ("linear", "cosine", "wsd", "hf_linear"))
        _one_of(self.precision, "precision", ("fp32", "bf16", "fp16"))
        _one_of(self.device, "device", ("auto", "cpu", "cuda"))
        _one_of(self.backend, "backend", ("auto", "gloo", "nccl"))
        _one_of(self.on_nonfinite, "on_nonfinite", ("skip", "raise"))
        _require(0.0 < self.mlm_probability < 1.0, "mlm_probability", "must be in (0, 1)")
        _require(self.ckpt_every >= 0, "ckpt_every", "must be >= 0")
        _require(self.timeout_s > 0, "timeout_s", "must be positive")
        _require(self.bucket_cap_mb == "auto" or (not isinstance(self.bucket_cap_mb, str) and self.bucket_cap_mb > 0),
                 "bucket_cap_mb", f"must be a positive number of MiB or 'auto', got {self.bucket_cap_mb!r}")
        _one_of(self.grad_compression, "grad_compression", ("none", "bf16", "powersgd"))
        _require(self.grad_compression == "none" or self.sharding in ("ddp", "zero1"), "grad_compression",
                 f"{self.grad_compression!r} is a DDP comm hook: it needs sharding 'ddp' or 'zero1', not {self.sharding!r}")
        _require(self.powersgd_rank >= 1, "powersgd_rank", f"must be >= 1, got {self.powersgd_rank}")
        _require(self.powersgd_start_iter >= 2, "powersgd_start_iter",
                 f"must be >= 2 (torch's PowerSGD with error feedback), got {self.powersgd_start_iter}")
        _require(0.0 < self.wsd_decay_fraction <= 1.0, "wsd_decay_fraction", "must be in (0, 1]")
        _require(self.stop_after is None or self.stop_after > 0, "stop_after", "must be positive or None")
        _require(self.eval_every >= 0, "eval_every", f"must be >= 0, got {self.eval_every}")
        _require(self.eval_sequences > 0, "eval_sequences", f"must be positive, got {self.eval_sequences}")
        _require(self.eval_batch_size is None or self.eval_batch_size > 0, "eval_batch_size",
                 f"must be positive or None, got {self.eval_batch_size}")
        self._check_model_parallel()

    def _check_model_parallel(self) -> None:
        """One-line refusals of tp / pp settings that cannot work whatever the model and world size
        (those that depend on them: ``labkit.train.parallel.check_split``)."""
        for name in ("tp", "pp", "pp_virtual_stages"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _one_of(self.pp_schedule, "pp_schedule", ("gpipe", "1f1b", "interleaved_1f1b"))
        split, m = self.tp * self.pp > 1, self.grad_accum_steps
        _require(not split or self.sharding in ("fsdp", "replicate"), "sharding",
                 f"{self.sharding!r} does not compose with tp/pp > 1 (DDP drops tensor-parallel parameters and "
                 "asserts inside a pipeline stage); use 'fsdp' or 'replicate'")
        _require(split or self.sharding != "replicate", "sharding",
                 "'replicate' is the data-parallel side of tp/pp > 1 runs; with tp = pp = 1 use 'ddp'")
        _require(self.tp > 1 or not self.sequence_parallel, "sequence_parallel", "needs tp > 1")
        _require(self.pp > 1 or self.pp_virtual_stages == 1, "pp_virtual_stages", "needs pp > 1")
        interleaved = self.pp_schedule == "interleaved_1f1b"
        _require(self.pp == 1 or interleaved == (self.pp_virtual_stages > 1), "pp_virtual_stages",
                 f"{self.pp_virtual_stages} with pp_schedule {self.pp_schedule!r}: interleaved_1f1b runs "
                 "2 or more stages per rank, gpipe and 1f1b one")
        _require(self.pp == 1 or self.pp_schedule == "gpipe" or m >= self.pp, "grad_accum_steps",
                 f"{self.pp_schedule} needs at least as many micro-batches as stages: {m} < pp {self.pp}")
        rounds = max(1, m // self.pp)
        _require(self.pp == 1 or not interleaved or m % rounds == 0, "grad_accum_steps",
                 f"interleaved_1f1b needs a multiple of {rounds} micro-batches (rounds of pp {self.pp}), got {m}")
        _require(not split or self.precision != "fp16", "precision",
                 "fp16 is not checked with tp/pp > 1 (its loss scaler would see split gradients); use bf16 or fp32")
        _require(not split or not self.compile, "compile", "torch.compile is not checked with tp/pp > 1")


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
    train_steps: int = 60
    """Optimiser steps of the DDP training run."""
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
