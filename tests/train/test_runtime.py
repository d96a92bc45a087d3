"""The one gradient clip (labkit/train/clip.py) against torch's, and the runtime of a one-process run
(labkit/train/runtime.py); the split and multi-rank cases are in test_parallel.py and test_dist.py."""

from __future__ import annotations

import pytest
import torch

from labkit.config import TrainConfig
from labkit.measure import StepTimer
from labkit.model import BertMLM, model_config
from labkit.train.clip import clip_grad_norm_, copies_of
from labkit.train.runtime import Runtime


def _model_with_grads() -> BertMLM:
    torch.manual_seed(0)
    model = BertMLM(model_config("tiny", 96, num_layers=2, hidden_dropout=0.0, attention_dropout=0.0))
    ids = torch.randint(5, 96, (2, 16))
    labels = torch.where(torch.rand(2, 16) < 0.3, ids, -100)
    model(ids, attention_mask=torch.ones(2, 16, dtype=torch.bool), labels=labels).loss_sum.backward()
    return model


@pytest.mark.parametrize("max_norm", [0.05, 1e9, float("inf")])
def test_clip_matches_torch(max_norm):
    """One process: the norm and the clipped gradients of torch.nn.utils.clip_grad_norm_ (whose factor
    is max_norm / (norm + 1e-6)), the norm to 1e-6 relative (fp64 against fp32 sums)."""
    ours, ref = _model_with_grads(), _model_with_grads()
    norm = clip_grad_norm_([(p, copies_of(p, 1)) for p in ours.parameters()], max_norm)
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    assert norm == pytest.approx(ref_norm, rel=1e-6) and norm > 0.05
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-9)


def test_copies_and_a_nonfinite_gradient():
    """A plain tensor's every holder has all of it; a non-finite gradient gives a nan norm (the loop
    then skips the step) and leaves every gradient as it was."""
    model = _model_with_grads()
    p = next(model.parameters())
    assert copies_of(p, 4) == 4
    p.grad[0] = float("nan")
    before = [q.grad.clone() for q in model.parameters()]
    norm = clip_grad_norm_([(q, 1) for q in model.parameters()], 1e-3)
    assert norm != norm
    for a, q in zip(before, model.parameters()):
        torch.testing.assert_close(q.grad, a, rtol=0, atol=0, equal_nan=True)


def test_runtime_of_one_process():
    """No process group: pp = tp = 1, dp = 1, no collective to time (comm_exposed_s 0.0), no bubble."""
    cfg = TrainConfig(data_dir="-", run_dir="-", optim={"grad_clip": 1.0})
    model = _model_with_grads()
    model.zero_grad()
    rt = Runtime(cfg, model, torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu"), world=1, rank=0)
    assert (rt.mesh.pp, rt.mesh.dp, rt.mesh.tp, rt.dp_rank) == (1, 1, 1, 0) and rt.comm is None
    ids = torch.randint(5, 96, (2, 16))
    batch = {"input_ids": ids, "labels": torch.where(ids % 3 == 0, ids, -100),
             "attention_mask": torch.ones(2, 16, dtype=torch.bool)}
    timer = StepTimer(torch.device("cpu"), comm=rt.comm)
    timer.start()
    loss_sum, n_masked, n_tokens = rt.forward_backward([batch])
    norm = rt.clip_grad_norm(1.0)
    timer.stop()
    assert n_tokens.item() == 32 and n_masked.item() == int((ids % 3 == 0).sum()) and norm > 0
    assert rt.step_measures(timer) == {"comm_exposed_s": 0.0, "pipeline_bubble": None, "tp_comm_s": None}
