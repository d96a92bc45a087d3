"""``schedule = "hf_linear"`` against transformers' ``get_linear_schedule_with_warmup``."""

from __future__ import annotations

import pytest
import torch

from labkit.config import TrainConfig
from labkit.train import lr_at


@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_hf_linear_matches_transformers_every_step(warmup):
    from transformers import get_linear_schedule_with_warmup

    steps, lr = 20, 3e-4
    cfg = TrainConfig(data_dir="d", run_dir="r", max_steps=steps, optim={"lr": lr},
                      schedule={"warmup_steps": warmup, "kind": "hf_linear"})
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=lr)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=steps)
    want = []
    for _ in range(steps):  # the usual loop: the lr the step uses, optimizer.step(), scheduler.step()
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    got = [lr_at(s, cfg) for s in range(steps)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert got[0] == (0.0 if warmup else lr)
    assert got[-1] == pytest.approx(lr / (steps - warmup))


def test_default_schedule_stays_linear():
    assert TrainConfig(data_dir="d", run_dir="r").schedule.kind == "linear"
    with pytest.raises(ValueError, match="^schedule.kind: got 'hf_cosine'"):
        TrainConfig(data_dir="d", run_dir="r", schedule={"kind": "hf_cosine"})
