"""The learning rate as a pure function of the step (``lr_at``: warm-up then linear, cosine,
warmup-stable-decay or transformers' linear schedule) and of the global batch (``lr_for_batch``).
No torch: the sweeps and the command line read these before any engine starts."""

from __future__ import annotations

import math

from labkit.config import TrainConfig

__all__ = ["LR_RULES", "lr_at", "lr_for_batch"]

LR_RULES = ("sqrt", "linear", "constant")
"""The rules ``lr_for_batch`` knows (``TrainConfig.batch.lr_rule``)."""


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimiser step ``step`` (0-based) under ``cfg.schedule.kind``.

    Warm-up: ``lr * (step + 1) / warmup_steps`` for step < warmup_steps (linear, never 0).
    Then, with progress p = (step - warmup) / (last - warmup) in [0, 1], last = max_steps - 1
    (the run's last step, which therefore uses min_lr) and min_lr = lr * min_lr_ratio: linear
    ``min_lr + (lr - min_lr)(1 - p)``; cosine ``min_lr + (lr - min_lr)(1 + cos(pi p)) / 2``
    (arXiv:1608.03983); wsd: lr until the last ``wsd_decay_fraction * max_steps`` steps, then
    linear to min_lr at the last step (warmup-stable-decay, arXiv:2404.06395).

    ``hf_linear`` is transformers' ``get_linear_schedule_with_warmup(opt, warmup_steps,
    max_steps)`` with ``scheduler.step()`` after each ``optimizer.step()``, step for step:
    ``lr * step / warmup_steps`` in warm-up (0 at step 0), then ``lr * (max_steps - step) /
    (max_steps - warmup_steps)`` (the last step, max_steps - 1, gets lr / (max_steps - warmup)
    and the schedule reaches 0 only after the run). It ignores min_lr_ratio.
    """
    peak, floor = cfg.optim.lr, cfg.optim.lr * cfg.schedule.min_lr_ratio
    last = cfg.max_steps - 1
    if cfg.schedule.kind == "hf_linear":  # transformers.optimization._get_linear_schedule_with_warmup_lr_lambda
        if step < cfg.schedule.warmup_steps:
            return peak * step / max(1, cfg.schedule.warmup_steps)
        return peak * max(0.0, (cfg.max_steps - step) / max(1, cfg.max_steps - cfg.schedule.warmup_steps))
    if step < cfg.schedule.warmup_steps:
        return peak * (step + 1) / cfg.schedule.warmup_steps
    if cfg.schedule.kind == "wsd":
        decay = round(cfg.schedule.wsd_decay_fraction * cfg.max_steps)
        decay_start = max(cfg.schedule.warmup_steps, cfg.max_steps - decay)
        p = min(1.0, (step - decay_start) / max(1, last - decay_start)) if step >= decay_start else 0.0
        return floor + (peak - floor) * (1.0 - p)
    p = min(1.0, (step - cfg.schedule.warmup_steps) / max(1, last - cfg.schedule.warmup_steps))
    if cfg.schedule.kind == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * p))
    return floor + (peak - floor) * (1.0 - p)


def lr_for_batch(base_lr: float, base_batch: int, batch: int, rule: str = "sqrt") -> float:
    """The learning rate at global ``batch`` (sequences) from ``base_lr`` at ``base_batch``:
    ``sqrt`` (lr ∝ √B, the rule for Adam: Malladi et al. 2022, arXiv:2205.10287), ``linear``
    (lr ∝ B, Goyal et al. 2017, arXiv:1706.02677, for SGD) or ``constant``. Raises ValueError on an
    unknown rule or a non-positive batch."""
    if rule not in LR_RULES:
        raise ValueError(f"lr rule: must be one of {LR_RULES}, got {rule!r}")
    if batch <= 0 or base_batch <= 0:
        raise ValueError(f"lr_for_batch: batches must be positive, got {base_batch} and {batch}")
    ratio = batch / base_batch
    return base_lr * {"sqrt": math.sqrt(ratio), "linear": ratio, "constant": 1.0}[rule]
