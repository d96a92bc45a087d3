"""The model-parallel split of a run: where each rank sits in the (pp, dp, tp) mesh, and the
refusals that need the model and the world size (``TrainConfig`` refuses the rest itself).

Plain Python, no torch: the command line checks a split before it starts any engine
(``labkit.preflight``), and ``labkit.train.parallel`` builds the run from the same ``Split``.
tp is innermost, so a tensor-parallel group is consecutive ranks (torchtitan's ``ParallelDims``
order), which ``labkit.cluster`` places on one node.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.config.model import ModelConfig
from labkit.config.train import TrainConfig

__all__ = ["TP_ATTENTION", "check_split", "is_split", "Split", "split_of"]

TP_ATTENTION = ("full", "sliding_window", "linear")
"""Attention kinds checked against one process under tensor parallelism (tests/train/test_parallel.py).
Linformer is not: its E, F projections are shared by the heads, so their gradient would need a sum over tp."""


@dataclass(frozen=True)
class Split:
    """A run's split and this rank's place in it: rank = (pp_rank · dp + dp_rank) · tp + tp_rank."""

    pp: int
    dp: int
    tp: int
    rank: int = 0

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.tp)

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp % self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def __str__(self) -> str:
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}"


def is_split(cfg: TrainConfig) -> bool:
    """Whether a run of ``cfg`` splits the model (tp or pp > 1) and so goes through this module."""
    return cfg.parallel.is_split


def split_of(cfg: TrainConfig, world: int, rank: int = 0) -> Split:
    """The ``Split`` of a run of ``cfg`` on ``world`` ranks. ValueError when tp x pp does not divide it."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if world % (tp * pp):
        raise ValueError(f"parallel.tp: world size {world} is not divisible by tp x pp = {tp} x {pp}")
    return Split(pp=pp, dp=world // (tp * pp), tp=tp, rank=rank)


def check_split(cfg: TrainConfig, mcfg: ModelConfig, world: int, seq_len: int, rank: int = 0) -> Split:
    """Refuse, in one line naming the field, a split that does not divide or cannot work (the
    checks that need the model and world size; ``TrainConfig`` checks the rest): tp x pp not
    dividing the world, heads or FFN width not divisible by tp, the sequence length with sequence
    parallelism, fewer layers than stages, an attention kind not checked under tensor
    parallelism. Returns the split, placing ``rank``."""
    split, par = split_of(cfg, world, rank), cfg.parallel
    tp, stages = par.tp, par.pp * par.pp_virtual_stages
    checks = [
        (mcfg.num_heads % tp == 0, "parallel.tp", f"num_heads {mcfg.num_heads} is not divisible by tp {tp}"),
        (mcfg.ffn_size % tp == 0, "parallel.tp",
         f"the FFN width {mcfg.ffn_size} (intermediate_size) is not divisible by tp {tp}"),
        (not par.sequence_parallel or seq_len % tp == 0, "parallel.sequence_parallel",
         f"sequence length {seq_len} is not divisible by tp {tp}"),
        (mcfg.num_layers >= stages, "parallel.pp", f"{mcfg.num_layers} layers cannot fill pp x pp_virtual_stages = "
                                                   f"{par.pp} x {par.pp_virtual_stages} stages (one layer each at least)"),
        (tp == 1 or mcfg.attention in TP_ATTENTION, "parallel.tp",
         f"attention {mcfg.attention!r} is not checked under tensor parallelism; checked: {list(TP_ATTENTION)}"),
    ]
    for ok, name, message in checks:
        if not ok:
            raise ValueError(f"{name}: {message}")
    return split
