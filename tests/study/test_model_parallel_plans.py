"""The planner's side of model parallelism: parallel_plans rows -> TrainConfig fields, the grid of
splits a sweep runs, and the parameters of a pipeline stage against labkit's own stages."""

from __future__ import annotations

import pytest
import torch

from labkit.config import TrainConfig
from labkit.model import BertMLM, model_config
from labkit.study import parallel, plan
from labkit.study.sweeps import parallel_grid
from labkit.train.pipeline import StageModule, stage_layers


def test_plan_overrides_run_the_planners_rows():
    big = model_config("bert-1.3b", plan.STUDY_VOCAB, hidden_size=6144, num_heads=48, num_layers=48,
                       intermediate_size=None)
    splits = parallel.parallel_plans(big, n_gpus=16, seq_len=512, micro_batch=4)
    no_zero = parallel.first_fit(splits.filter(splits["zero_stage"] == 0))
    over = parallel.plan_overrides(no_zero)
    assert over == {"parallel": {"tp": 2, "pp": 4, "sharding": "replicate", "pp_schedule": "1f1b",
                                 "sequence_parallel": False},
                    "batch": {"grad_accum_steps": 8, "micro_batch_size": 4}}
    cfg = TrainConfig(data_dir="-", run_dir="-", **over)  # a valid run of the row
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.batch.grad_accum_steps) == (2, 4, 8)
    assert TrainConfig(data_dir="-", run_dir="-").replace(**over) == cfg
    zero3 = parallel.plan_overrides(parallel.first_fit(splits))
    assert zero3 == {"parallel": {"tp": 1, "pp": 1, "sharding": "fsdp", "fsdp_reshard_after_forward": True,
                                  "sequence_parallel": False}, "batch": {"micro_batch_size": 4}}
    # the planner reads sequence_parallel: with it the tp rows plan less activation memory, and
    # their configs run with it (at tp 1 there is nothing to split: TrainConfig refuses it there)
    with_sp = parallel.parallel_plans(big, n_gpus=16, seq_len=512, micro_batch=4, sequence_parallel=True)
    tp_rows = (splits["tp"] > 1).to_list()
    for a, b, is_tp in zip(splits.iter_rows(named=True), with_sp.iter_rows(named=True), tp_rows):
        assert (b["activations"] < a["activations"]) == is_tp and a["sequence_parallel"] is False
        if not (b["zero_stage"] == 1 and b["tp"] * b["pp"] > 1):  # no labkit run (refused above)
            assert parallel.plan_overrides(b)["parallel"]["sequence_parallel"] is is_tp
    sp_cfg = TrainConfig(data_dir="-", run_dir="-", **parallel.plan_overrides(parallel.first_fit(
        with_sp.filter((with_sp["zero_stage"] == 0) & (with_sp["tp"] > 1)))))
    assert sp_cfg.parallel.sequence_parallel and sp_cfg.parallel.tp > 1
    row = {"tp": 1, "pp": 1, "zero_stage": 1, "micro_batch": 2, "pipeline_microbatches": 8}
    assert parallel.plan_overrides(row)["parallel"]["sharding"] == "zero1"
    assert parallel.plan_overrides(row | {"zero_stage": 2})["parallel"]["fsdp_reshard_after_forward"] is False
    with pytest.raises(ValueError, match=r"^zero_stage: ZeRO-1 with tp 2 x pp 1 has no labkit run"):
        parallel.plan_overrides(row | {"tp": 2})


def test_parallel_grid_of_the_splits_a_sweep_runs():
    mini = model_config("mini", 512)  # 4 heads, 4 layers
    assert parallel_grid(2, mini, micro_batches=4, seq_len=64) == [
        {"tp": 1, "pp": 1, "pp_schedule": None}, {"tp": 2, "pp": 1, "pp_schedule": None},
        {"tp": 1, "pp": 2, "pp_schedule": "1f1b"}, {"tp": 1, "pp": 2, "pp_schedule": "gpipe"}]
    four = parallel_grid(4, mini, micro_batches=2, seq_len=63)  # 63: no tp (sequence parallelism)
    assert [(g["tp"], g["pp"], g["pp_schedule"]) for g in four] == [
        (1, 1, None), (1, 2, "1f1b"), (1, 2, "gpipe"), (1, 4, "gpipe")]  # 1F1B needs m >= pp
    linformer = model_config("mini", 512, attention="linformer")
    assert all(g["tp"] == 1 for g in parallel_grid(2, linformer, micro_batches=4, seq_len=64))


@pytest.mark.parametrize("overrides, pp", [({}, 2), ({"tie_embeddings": False, "activation": "geglu"}, 2),
                                           ({"num_layers": 5}, 3)])
def test_planned_parameters_per_rank_are_the_largest_stage(overrides, pp):
    """``plan._params_per_gpu`` at pp stages = the parameters of labkit's largest StageModule
    (``labkit.train.pipeline``: embeddings on the first, head and tied copy on the last)."""
    cfg = model_config("tiny", 97, num_layers=overrides.pop("num_layers", 4), **overrides)
    with torch.device("meta"):
        model = BertMLM(cfg)
        ranges = stage_layers(cfg.num_layers, pp)
        sizes = [sum(p.numel() for p in StageModule(model, s, pp, ranges[s]).parameters()) for s in range(pp)]
    assert plan._params_per_gpu(cfg, 1, pp) == max(sizes)
    assert plan._params_per_gpu(cfg, 1, 1) == sum(p.numel() for p in model.parameters())


def test_planned_rank_memory_reads_sequence_parallel():
    """``planned_rank_memory`` plans the activations of the run's own ``sequence_parallel``
    (TrainConfig's default: off); the state is the same either way."""
    cfg = model_config("tiny", 97)
    off_cfg = TrainConfig(data_dir="-", run_dir="-", parallel={"sharding": "fsdp", "tp": 2})
    off = parallel.planned_rank_memory(cfg, off_cfg, world=2, seq_len=32)
    on = parallel.planned_rank_memory(cfg, off_cfg.replace(parallel={"sequence_parallel": True}), world=2, seq_len=32)
    attention = "eager" if cfg.attention_dropout > 0 else "flash"  # CPU's math path with attention dropout
    terms = {sp: plan.memory_plan(cfg, seq_len=32, micro_batch=16, precision="fp32", attention=attention,
                                  zero_stage=0, dp=1, tp=2, device="cpu", sequence_parallel=sp)["activations"]
             for sp in (False, True)}
    assert (off["activation_bytes"], on["activation_bytes"]) == (terms[False], terms[True])
    assert on["activation_bytes"] < off["activation_bytes"] and on["state_bytes"] == off["state_bytes"]


def test_planned_rank_memory_bubble_follows_the_schedule():
    cfg = model_config("tiny", 97)
    pp2 = TrainConfig(data_dir="-", run_dir="-", parallel={"sharding": "replicate", "pp": 2},
                      batch={"grad_accum_steps": 4})
    assert parallel.planned_rank_memory(cfg, pp2, world=2, seq_len=32)["bubble"] == 0.2
    interleaved = pp2.replace(parallel={"pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2})
    assert parallel.planned_rank_memory(cfg, interleaved, world=2, seq_len=32)["bubble"] == 1 / 9  # (p-1)/(v m + p-1)
