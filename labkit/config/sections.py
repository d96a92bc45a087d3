"""The sections of a training run's configuration: one keyword-only dataclass per TOML table
(``[train.optim]``, ``[train.schedule]``, ...), each field documented below it.

Each section checks its own fields in ``__post_init__`` and raises ``ValueError`` naming the
field with its section (``optim.lr: must be positive``); checks that span sections live in
``TrainConfig.__post_init__`` (``labkit.config.train``).

Whether a field may change when a run is resumed is declared on the field, in its metadata
(``labkit.train.run_config`` reads it): ``FREE`` never matters (where things are, how the
process runs), ``SAFE`` may change with ``allow_safe_changes=True`` (what is logged or saved,
how far the run goes, how a step is split over ranks), and a field without either changes the
result and must be the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from labkit.config.base import _one_of, _require

__all__ = ["FREE", "SAFE", "BatchConfig", "CheckpointConfig", "DataConfig", "EvalConfig", "MeasureConfig",
           "OptimConfig", "ParallelConfig", "ScheduleConfig"]

FREE = {"resume": "free"}
"""Field metadata: the field may differ on resume whatever ``allow_safe_changes`` says."""
SAFE = {"resume": "safe"}
"""Field metadata: the field may differ on resume with ``allow_safe_changes=True``."""


def _positive(value: float, name: str) -> None:
    _require(value > 0, name, f"must be positive, got {value}")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW (decoupled weight decay, arXiv:1711.05101) and gradient clipping."""

    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.98
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    def __post_init__(self) -> None:
        _positive(self.lr, "optim.lr")
        _require(self.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            _require(0.0 <= getattr(self, name) < 1.0, f"optim.{name}", f"must be in [0, 1), got {getattr(self, name)}")
        _require(self.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 disables clipping), got {self.grad_clip}")


@dataclass(kw_only=True)
class ScheduleConfig:
    """The learning rate over the steps (``labkit.train.optim.lr_at``): linear warm-up, then a decay."""

    kind: Literal["linear", "cosine", "wsd", "hf_linear"] = "linear"
    """Decay after warm-up: linear, cosine, or warmup-stable-decay to lr * min_lr_ratio; or "hf_linear",
    transformers' ``get_linear_schedule_with_warmup`` step for step (warm-up from 0, decay towards 0;
    min_lr_ratio unused)."""
    warmup_steps: int = 10
    """Linear warm-up steps from 0 to optim.lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optim.lr."""
    wsd_decay_fraction: float = 0.2
    """wsd: share of max_steps (at the end) spent decaying linearly to the final learning rate; the
    rest after warm-up stays at optim.lr (arXiv:2404.06395 MiniCPM; arXiv:2405.18392 uses 20 %)."""

    def __post_init__(self) -> None:
        _one_of(self.kind, "schedule.kind", ("linear", "cosine", "wsd", "hf_linear"))
        _require(self.warmup_steps >= 0, "schedule.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "schedule.min_lr_ratio",
                 f"must be in [0, 1], got {self.min_lr_ratio}")
        _require(0.0 < self.wsd_decay_fraction <= 1.0, "schedule.wsd_decay_fraction",
                 f"must be in (0, 1], got {self.wsd_decay_fraction}")


@dataclass(kw_only=True)
class BatchConfig:
    """The batch of one optimiser step: global batch size = micro_batch_size * grad_accum_steps * dp
    (sequences), dp the data-parallel degree."""

    micro_batch_size: int = 16
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimiser step (with pp > 1: the micro-batches the pipeline
    schedule runs). A resume at another dp changes it to keep the checkpoint's global batch."""
    lr_rule: Literal["sqrt", "linear", "constant"] = "sqrt"
    """How optim.lr follows the global batch where a run trains at k times this config's batch (a
    ramp's larger batches, a branch, ``labkit.study.branching``): lr x sqrt(k) (Adam: Malladi et al.
    2022, arXiv:2205.10287), lr x k (SGD: Goyal et al. 2017, arXiv:1706.02677), or lr unchanged
    (``labkit.train.optim.lr_for_batch``)."""
    schedule: Literal["fixed", "ramp", "critical"] = "fixed"
    """The global batch over the run (``labkit.train.ramp``): "fixed", micro_batch_size x
    grad_accum_steps x dp throughout; "ramp", that batch at first, then the batches of batch.ramp
    from the steps it names; "critical", doubled whenever the in-run noise scale's 90 % interval
    (``labkit.train.gns``: b_simple_low) is at or above the doubled batch, up to
    batch.max_global_batch_size; valid only where the noise scale agrees with the critical batch
    measured by branching (``labkit sweep branch``). The batch grows through grad_accum_steps at the
    run's world size, the learning rate by batch.lr_rule (optim.lr is that of the starting batch);
    every change is a line of run_dir/batch_changes.jsonl."""
    ramp: tuple[tuple[int, int], ...] = ()
    """schedule "ramp": [[S, B], ...], S ascending, B ascending: after optimiser step S (from step
    S + 1 of metrics.jsonl on) the global batch is B sequences, a multiple of micro_batch_size x dp
    above the starting batch (TOML: ``ramp = [[200, 32], [400, 64]]``)."""
    max_global_batch_size: int | None = None
    """schedule "critical": the largest global batch it may grow to (sequences); None: no bound
    but the noise scale's."""

    def __post_init__(self) -> None:
        _positive(self.micro_batch_size, "batch.micro_batch_size")
        _positive(self.grad_accum_steps, "batch.grad_accum_steps")
        _one_of(self.lr_rule, "batch.lr_rule", ("sqrt", "linear", "constant"))
        _one_of(self.schedule, "batch.schedule", ("fixed", "ramp", "critical"))
        try:
            self.ramp = tuple((int(s), int(b)) for s, b in self.ramp)
        except (TypeError, ValueError):
            raise ValueError(f"batch.ramp: expected a list of [step, global_batch_size] pairs, got {self.ramp!r}") \
                from None
        _require(self.schedule == "ramp" or not self.ramp, "batch.ramp",
                 f"is read only with batch.schedule = 'ramp', not {self.schedule!r}")
        _require(self.schedule != "ramp" or bool(self.ramp), "batch.ramp",
                 "batch.schedule 'ramp' needs at least one [step, global_batch_size] pair")
        steps, batches = [s for s, _ in self.ramp], [b for _, b in self.ramp]
        _require(all(s >= 1 for s in steps) and steps == sorted(set(steps)), "batch.ramp",
                 f"steps must be >= 1 and strictly ascending, got {steps}")
        _require(all(b >= 1 for b in batches) and batches == sorted(set(batches)), "batch.ramp",
                 f"global batch sizes must be positive and strictly ascending, got {batches}")
        _require(self.max_global_batch_size is None or self.schedule == "critical", "batch.max_global_batch_size",
                 f"is read only with batch.schedule = 'critical', not {self.schedule!r}")
        _require(self.max_global_batch_size is None or self.max_global_batch_size > 0, "batch.max_global_batch_size",
                 f"must be positive or None, got {self.max_global_batch_size}")


@dataclass(kw_only=True)
class ParallelConfig:
    """How a step is split over the ranks: the (pp, dp, tp) mesh, dp = world size / (tp * pp), and
    how the data-parallel ranks hold the model and reduce its gradients."""

    sharding: Literal["ddp", "zero1", "fsdp", "replicate"] = field(default="ddp", metadata=SAFE)
    """Data-parallel memory strategy (ZeRO stages, arXiv:1910.02054): ddp replicates everything;
    zero1 shards the AdamW moments (torch's ZeroRedundancyOptimizer); fsdp shards parameters,
    gradients and moments with FSDP2 ``fully_shard`` (ZeRO-3, or ZeRO-2-style with
    fsdp_reshard_after_forward=False). Ignored in a single process. With tp or pp > 1 (over the
    dp dimension): fsdp, or replicate (whole copies, gradients averaged over dp after each
    backward); ddp and zero1 do not compose with a split model (``labkit.train.parallel``)."""
    tp: int = field(default=1, metadata=SAFE)
    """Tensor-parallel degree: ranks that split each layer's heads and FFN width and the word
    embedding / decoder by vocabulary (Megatron-LM, arXiv:1909.08053); a group is tp consecutive
    ranks, on one node."""
    pp: int = field(default=1, metadata=SAFE)
    """Pipeline-parallel degree: stages the layers are split into (``labkit.train.pipeline``); the
    batch.grad_accum_steps micro-batches of a step flow through them."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = field(default="1f1b", metadata=SAFE)
    """Pipeline schedule (torch.distributed.pipelining): GPipe (arXiv:1811.06965), 1F1B or
    interleaved 1F1B (arXiv:2104.04473 section 2.2)."""
    pp_virtual_stages: int = field(default=1, metadata=SAFE)
    """Stages per pipeline rank: 1, or at least 2 with interleaved_1f1b."""
    sequence_parallel: bool = field(default=False, metadata=SAFE)
    """With tp > 1: split the residual stream along the sequence between the layers (norms and
    dropout on 1/tp of the positions; arXiv:2205.05198 section 4.2.2)."""
    fsdp_reshard_after_forward: bool = True
    """fsdp: free the gathered parameters after each layer's forward (ZeRO-3) or keep them until
    backward (False: ZeRO-2-style, more memory, one all-gather less per layer)."""
    bucket_cap_mb: float | Literal["auto"] = 25.0
    """ddp / zero1: DDP's gradient bucket size in MiB (``DistributedDataParallel(bucket_cap_mb=)``;
    torch's default 25); "auto": sized at start-up from a backward and two all-reduces measured on
    this process group, the bucket that hides the link's latency and bandwidth behind backward
    best (``labkit.train.buckets``; rank 0 writes the choice to ``<run_dir>/bucket_auto.json``).
    Smaller buckets start all-reducing earlier in backward, larger ones pay the per-collective
    latency less often; the last bucket's all-reduce is never hidden (``comm_exposed_s`` in every
    metrics record, docs/training.md)."""
    grad_compression: Literal["none", "bf16", "powersgd"] = "none"
    """How the data-parallel gradient reduction travels: "none" in fp32; "bf16" in bfloat16, half the
    bytes (ddp / zero1: torch's ``bf16_compress_hook`` in DDP's one comm hook with the timing,
    ``labkit.train.comm.compression_hook``; fsdp: FSDP2's ``MixedPrecisionPolicy(reduce_dtype=bf16)``;
    replicate: the replicas' all-reduce in bf16); "powersgd" (ddp / zero1 only) sends a rank-
    ``powersgd_rank`` factorisation of each matrix gradient (torch's ``powerSGD_hook``, Vogels et
    al. 2019, arXiv:1905.13727, with error feedback) after ``powersgd_start_iter`` plain steps."""
    powersgd_rank: int = 4
    """grad_compression="powersgd": the rank of each gradient matrix's approximation
    (``PowerSGDState.matrix_approximation_rank``)."""
    powersgd_start_iter: int = 10
    """grad_compression="powersgd": optimiser steps all-reduced uncompressed before PowerSGD starts
    (``PowerSGDState.start_powerSGD_iter``; at least 2, torch's requirement with error feedback)."""

    def __post_init__(self) -> None:
        """One-line refusals of settings that cannot work whatever the model, batch and world size
        (those that depend on them: ``TrainConfig.__post_init__`` and
        ``labkit.config.split.check_split``)."""
        _one_of(self.sharding, "parallel.sharding", ("ddp", "zero1", "fsdp", "replicate"))
        for name in ("tp", "pp", "pp_virtual_stages"):
            _require(getattr(self, name) >= 1, f"parallel.{name}", f"must be >= 1, got {getattr(self, name)}")
        _one_of(self.pp_schedule, "parallel.pp_schedule", ("gpipe", "1f1b", "interleaved_1f1b"))
        split = self.tp * self.pp > 1
        _require(not split or self.sharding in ("fsdp", "replicate"), "parallel.sharding",
                 f"{self.sharding!r} does not compose with tp/pp > 1 (DDP drops tensor-parallel parameters and "
                 "asserts inside a pipeline stage); use 'fsdp' or 'replicate'")
        _require(split or self.sharding != "replicate", "parallel.sharding",
                 "'replicate' is the data-parallel side of tp/pp > 1 runs; with tp = pp = 1 use 'ddp'")
        _require(self.tp > 1 or not self.sequence_parallel, "parallel.sequence_parallel", "needs tp > 1")
        _require(self.pp > 1 or self.pp_virtual_stages == 1, "parallel.pp_virtual_stages", "needs pp > 1")
        interleaved = self.pp_schedule == "interleaved_1f1b"
        _require(self.pp == 1 or interleaved == (self.pp_virtual_stages > 1), "parallel.pp_virtual_stages",
                 f"{self.pp_virtual_stages} with pp_schedule {self.pp_schedule!r}: interleaved_1f1b runs "
                 "2 or more stages per rank, gpipe and 1f1b one")
        _require(self.bucket_cap_mb == "auto" or (not isinstance(self.bucket_cap_mb, str) and self.bucket_cap_mb > 0),
                 "parallel.bucket_cap_mb", f"must be a positive number of MiB or 'auto', got {self.bucket_cap_mb!r}")
        _one_of(self.grad_compression, "parallel.grad_compression", ("none", "bf16", "powersgd"))
        _require(self.grad_compression != "powersgd" or self.sharding in ("ddp", "zero1"), "parallel.grad_compression",
                 "'powersgd' is torch's DDP comm hook (it all-reduces low-rank factors of whole gradient matrices, "
                 f"which FSDP2's shards and tensor-parallel slices are not): it needs sharding 'ddp' or 'zero1', "
                 f"not {self.sharding!r}")
        _require(self.powersgd_rank >= 1, "parallel.powersgd_rank", f"must be >= 1, got {self.powersgd_rank}")
        _require(self.powersgd_start_iter >= 2, "parallel.powersgd_start_iter",
                 f"must be >= 2 (torch's PowerSGD with error feedback), got {self.powersgd_start_iter}")

    @property
    def is_split(self) -> bool:
        """Whether the model is split over ranks (tp or pp > 1)."""
        return self.tp * self.pp > 1


@dataclass(kw_only=True)
class CheckpointConfig:
    """When and how the run saves checkpoints (``labkit.train.checkpoint``) under run_dir/checkpoints."""

    every: int = field(default=0, metadata=SAFE)
    """Checkpoint every this many optimiser steps (0: only at the end)."""
    keep: int = field(default=2, metadata=SAFE)
    """Keep the newest this many checkpoints."""
    asynchronous: bool = field(default=False, metadata=FREE)
    """Write checkpoints in the background (torch.distributed.checkpoint's ``async_save``): training
    stalls only while the state is copied to CPU memory (``checkpoint_stall_s`` in the records)."""
    enabled: bool = field(default=True, metadata=SAFE)
    """False: write no checkpoint at all (sweep runs: metrics.jsonl and result.json only; such a
    run cannot be resumed)."""
    init_from: str | None = None
    """A checkpoint directory of another run (``<its run_dir>/checkpoints/step-N``) that this run
    starts from when it has no checkpoint of its own to resume: its weights, optimiser state, step,
    tokens seen and sampler position (the global sample order continues; the micro-batch size must
    be the checkpoint's), at this config's global batch, learning rate and schedule, not the
    checkpoint's. A branch of that run (``labkit.study.branching``). None: a new run starts at step 0."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, "checkpoint.every", f"must be >= 0, got {self.every}")
        _positive(self.keep, "checkpoint.keep")


@dataclass(kw_only=True)
class EvalConfig:
    """The held-out loss (``labkit.train.evaluation``) on a fixed set of held-out sequences."""

    every: int = field(default=0, metadata=SAFE)
    """Evaluate every this many optimiser steps and at the end; 0: at the end only, and only when
    the shards have a held-out split (with every > 0 shards without one are refused)."""
    sequences: int = field(default=256, metadata=SAFE)
    """Held-out sequences in the fixed evaluation set (the first ones of the split)."""
    batch_size: int | None = field(default=None, metadata=SAFE)
    """Sequences per evaluation forward per rank; None: batch.micro_batch_size."""
    enabled: bool = field(default=True, metadata=SAFE)
    """False: no held-out evaluation at all, not even at the end (the timing sweeps' runs, whose
    quantity is a time: their result.json has eval_loss None). With every > 0 it is refused."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, "eval.every", f"must be >= 0, got {self.every}")
        _require(self.enabled or self.every == 0, "eval.enabled",
                 f"false, but eval.every is {self.every} (set eval.every = 0, or enabled = true)")
        _positive(self.sequences, "eval.sequences")
        _require(self.batch_size is None or self.batch_size > 0, "eval.batch_size",
                 f"must be positive or None, got {self.batch_size}")


@dataclass(kw_only=True)
class DataConfig:
    """What the run expects of its shards (``TrainConfig.data_dir``) and how it reads and masks them."""

    seq_len: int | None = None
    """Sequence length the run expects; shards of another length are refused before training
    (labkit.data.shards.check_shards). None takes the shards' length."""
    tokenizer_path: str | None = field(default=None, metadata=FREE)
    """tokenizer.json the run expects; shards built with a tokenizer of another sha256 are
    refused before training. None skips the check."""
    verify_data: bool = field(default=False, metadata=FREE)
    """Recompute every shard's sha256 against index.json before training (a staged copy was
    already verified when it was made)."""
    mlm_probability: float = 0.15
    """Masking probability (BERT, arXiv:1810.04805 section 3.1)."""
    num_workers: int = field(default=0, metadata=FREE)
    """DataLoader worker processes per rank."""

    def __post_init__(self) -> None:
        _require(self.seq_len is None or self.seq_len > 0, "data.seq_len",
                 f"must be positive or None, got {self.seq_len}")
        _require(0.0 < self.mlm_probability < 1.0, "data.mlm_probability",
                 f"must be in (0, 1), got {self.mlm_probability}")
        _require(self.num_workers >= 0, "data.num_workers", f"must be >= 0, got {self.num_workers}")


@dataclass(kw_only=True)
class MeasureConfig:
    """What the run records (``labkit.measure``, docs/measurement.md) and where it sends it."""

    log_every: int = field(default=1, metadata=SAFE)
    """Write one metrics record every this many optimiser steps."""
    timing_warmup_steps: int = field(default=2, metadata=SAFE)
    """Steps excluded from throughput averages in result.json."""
    trackers: tuple[str, ...] = field(default=("tensorboard",), metadata=FREE)
    """Metric sinks rank 0 sends every record to besides metrics.jsonl (``labkit.train.sinks.SINKS``):
    "tensorboard" writes event files under run_dir/tensorboard; () writes none."""
    timeline: bool = field(default=True, metadata=FREE)
    """Record every rank's step timeline in run_dir/timeline (``labkit.train.timeline``: its phases
    and when each gradient bucket was ready, no collective); the run's culprit and goodput in
    result.json come from it."""

    def __post_init__(self) -> None:
        _positive(self.log_every, "measure.log_every")
        _require(self.timing_warmup_steps >= 0, "measure.timing_warmup_steps",
                 f"must be >= 0, got {self.timing_warmup_steps}")
        self.trackers = tuple(self.trackers)
