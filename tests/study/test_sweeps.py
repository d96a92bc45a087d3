"""labkit/study/sweeps.py: tidy Parquet tables, and points already measured are not rerun.

The cluster is replaced by a fake whose engine calls run the function in this process, and
training by a stub that records what it was asked to run (the real DDP path is tested in
tests/test_demo.py); what is under test here is the bookkeeping of the sweeps."""

from __future__ import annotations

import dataclasses
import json

import polars as pl
import pytest
import torch

from labkit import lab
from labkit.study import points, sweeps
from labkit.config import TrainConfig


class _Engine:
    def __init__(self, calls):
        self.calls = calls

    def apply_sync(self, fn, *args, **kwargs):
        self.calls.append(args)
        return fn(*args, **kwargs)

    def apply_async(self, fn, *args, **kwargs):
        """A finished ``concurrent.futures.Future`` with AsyncResult's ``get`` (engines.call waits on it)."""
        from concurrent.futures import Future

        done = Future()
        try:
            done.set_result(self.apply_sync(fn, *args, **kwargs))
        except Exception as err:
            done.set_exception(err)
        done.get = done.result
        return done


class FakeClient:
    """``client.ids`` and ``client[id].apply_sync`` / ``apply_async`` run locally, each call recorded."""

    def __init__(self, n):
        self.ids = list(range(n))
        self.calls = []

    def __getitem__(self, i):
        return _Engine(self.calls)


@pytest.fixture
def trained(monkeypatch):
    runs = []

    def fake_train(client, cfg, *, targets=None, staged=None, live=None, timeout=None):
        n = len(targets)
        assert cfg.checkpoint.enabled is False  # sweep runs write metrics and results, no checkpoint
        runs.append((cfg.model, n))
        tps = 1000.0 * n * (0.9 if n > 1 else 1.0) / (2 if cfg.model == "mini" else 1)
        return {"global_batch_size": cfg.batch.micro_batch_size * n, "tokens_per_s": tps, "samples_per_s": tps / 64,
                "data_wait_fraction": 0.01, "comm_exposed_s": 0.01 * (n - 1), "comm_exposed_fraction": 0.02 * (n - 1),
                "b_simple": 10.0 * n if n > 1 else None}  # the in-run noise scale needs dp > 1 (or accumulation)

    monkeypatch.setattr(sweeps, "train_on_cluster", fake_train)
    return runs


def test_sweep_ranks_resumes(tmp_path, trained):
    base = TrainConfig(data_dir=str(tmp_path / "shards"), run_dir=str(tmp_path / "r"), model="tiny",
                       batch={"micro_batch_size": 4})
    client = FakeClient(4)
    df = lab.sweep_ranks(client, base, str(tmp_path), ranks=[1, 2])
    assert trained == [("tiny", 1), ("tiny", 2)]
    assert df["efficiency"].to_list() == pytest.approx([1.0, 0.9])
    df = lab.sweep_ranks(client, base, str(tmp_path), ranks=[1, 2, 4])
    assert trained[2:] == [("tiny", 4)]  # 1 and 2 were read back, not rerun
    assert df["ranks"].to_list() == [1, 2, 4] and df["efficiency"].to_list() == pytest.approx([1.0, 0.9, 0.9])
    assert df["reused"].to_list() == [True, True, False]  # labelled, and the table on disk has no such column
    assert pl.read_parquet(tmp_path / "sweeps" / "ranks.parquet").equals(df.drop("reused"))
    note = lab.reused_note(df)
    assert note.startswith("2 of 3 points reused from earlier runs (measured 20") and "--force" in note
    assert df["comm_exposed_s"].to_list() == pytest.approx([0.0, 0.01, 0.03])  # each run's result.json
    assert df["comm_exposed_fraction"].to_list() == pytest.approx([0.0, 0.02, 0.06])
    # statistical goodput: one B_noise for the table, the in-run B_simple of the 4-rank run (40, also
    # read back from the table for reused rows), B0 the one-rank batch 4: E(B) = (40 + 4)/(40 + B)
    assert df["b_simple"].to_list() == [None, 20.0, 40.0] and df["b_noise"].to_list() == [40.0] * 3
    assert df["b_noise_source"][0].startswith("in-run B_simple of the ranks 4 run")
    eff = [(40 + 4) / (40 + 4 * n) for n in (1, 2, 4)]
    assert df["statistical_efficiency"].to_list() == pytest.approx(eff)
    assert df["goodput_tokens_per_s"].to_list() == pytest.approx([t * e for t, e in zip(df["tokens_per_s"], eff)])
    given = lab.sweep_ranks(client, base, str(tmp_path), ranks=[1, 2, 4], b_noise=12.0, b_noise_source="B_crit of x")
    assert trained[3:] == [] and given["b_noise_source"].to_list() == ["B_crit of x"] * 3  # all reused, B_noise given
    assert given["statistical_efficiency"].to_list() == pytest.approx([(12 + 4) / (12 + 4 * n) for n in (1, 2, 4)])
    # a table written before the column existed (and before rows recorded what made them): its
    # rows cannot be shown to match the settings, so they are measured again
    (tmp_path / "sweeps" / "ranks.parquet").unlink()
    points.save(df.filter(pl.col("ranks") == 1).drop("comm_exposed_s", "comm_exposed_fraction", "made_by"),
                 tmp_path / "sweeps" / "ranks.parquet")
    again = lab.sweep_ranks(client, base, str(tmp_path), ranks=[1, 2])
    assert trained[3:] == [("tiny", 1), ("tiny", 2)] and not again["reused"].any()
    assert again["comm_exposed_s"].to_list() == pytest.approx([0.0, 0.01]) and lab.reused_note(again) is None
    lab.sweep_ranks(client, base, str(tmp_path), ranks=[1], force=True)
    assert trained[5:] == [("tiny", 1)]


def test_a_sweep_point_with_other_settings_is_measured_again(tmp_path, trained, capsys):
    """The sweep's steps (max_steps of each point's run) changed between two calls: the points
    are measured again with the new steps, each change named in one line; unchanged, reused."""
    base = TrainConfig(data_dir=str(tmp_path / "shards"), run_dir=str(tmp_path / "r"), model="tiny", max_steps=4,
                       batch={"micro_batch_size": 4})
    client = FakeClient(2)
    first = lab.sweep_ranks(client, base, str(tmp_path), ranks=[1, 2])
    capsys.readouterr()
    eight = dataclasses.replace(base, max_steps=8)
    df = lab.sweep_ranks(client, eight, str(tmp_path), ranks=[1, 2])
    assert trained == [("tiny", 1), ("tiny", 2)] * 2 and not df["reused"].any()
    err = capsys.readouterr().err.splitlines()
    assert err == ["sweep ranks 1 rank(s): max_steps 4 -> 8, measuring again",
                   "sweep ranks 2 rank(s): max_steps 4 -> 8, measuring again"]
    assert [json.loads(m)["max_steps"] for m in df["made_by"]] == [8, 8]
    assert (df["measured_at"] >= first["measured_at"]).all()
    same = lab.sweep_ranks(client, eight, str(tmp_path), ranks=[1, 2])
    assert len(trained) == 4 and same["reused"].all() and same.drop("reused").equals(df.drop("reused"))


def test_sweep_model_size_resumes(tmp_path, trained, monkeypatch):
    monkeypatch.setattr(sweeps, "read_index", lambda d: {"vocab_size": 512, "seq_len": 64})
    base = TrainConfig(data_dir=str(tmp_path / "shards"), run_dir=str(tmp_path / "r"), model="tiny",
                       batch={"micro_batch_size": 4})
    client = FakeClient(2)
    lab.sweep_model_size(client, base, str(tmp_path), models=["tiny"])
    df = lab.sweep_model_size(client, base, str(tmp_path), models=["tiny", "mini"])
    assert trained == [("tiny", 2), ("mini", 2)]
    assert df["model"].to_list() == ["tiny", "mini"] and df["params"].is_sorted()
    from labkit.model import flops_per_token, model_config

    fpt = flops_per_token(model_config("mini", 512), 64)
    row = df.filter(pl.col("model") == "mini").row(0, named=True)
    assert row["flops_per_token"] == fpt and row["achieved_flops"] == pytest.approx(row["tokens_per_s"] * fpt)


def test_sweep_micro_batch_resumes_with_a_real_measurement(tmp_path):
    torch.set_num_threads(1)
    client = FakeClient(2)
    budget = 64 * 2**20
    lab.sweep_micro_batch(client, ["tiny"], seq_len=32, vocab_size=256, budget_bytes=budget, workdir=str(tmp_path))
    assert len(client.calls) == 2  # the engine's free memory, then the search
    df = lab.sweep_micro_batch(client, ["tiny"], seq_len=32, vocab_size=256, budget_bytes=budget,
                               workdir=str(tmp_path))
    assert len(client.calls) == 2  # read back, not measured again
    from labkit.model import model_config
    from labkit.study.memory import max_micro_batch

    assert df["max_micro_batch"].item() == max_micro_batch(model_config("tiny", 256), 32, budget)["max_micro_batch"]


def test_sweep_micro_batch_refuses_a_budget_the_engine_cannot_have_and_explains_a_death(tmp_path, monkeypatch):
    """A budget above the engine's free memory is refused before the search allocates it; an
    engine that dies in the search is reported with the cause engine_watch.death_cause finds."""
    import ipyparallel.error

    import labkit.cluster.engine_watch as W
    from labkit.measure import available_memory

    free = available_memory()
    monkeypatch.setattr(sweeps, "_engine_memory", lambda: free | {"pid": 4242, "hostname": "elsewhere", "oom_kills": 0})
    client = FakeClient(1)
    with pytest.raises(ValueError, match=r"^budget_bytes: .* GiB per rank is more than the .* GiB this machine can "
                                         r"give now .*labkit plan --model tiny"):
        lab.sweep_micro_batch(client, ["tiny"], seq_len=32, vocab_size=256, budget_bytes=free["bytes"] + 2**30,
                              workdir=str(tmp_path))
    assert len(client.calls) == 1  # only the memory probe: no search was started

    def dies(*args):
        raise ipyparallel.error.EngineError("Engine 0 died while running task 'x'")

    monkeypatch.setattr(sweeps.memory, "max_micro_batch", dies)
    monkeypatch.setattr(W, "death_cause", lambda pid, local, oom_kills_before: f"pid {pid} local {local} oom {oom_kills_before}")
    with pytest.raises(RuntimeError, match=r"micro-batch search for tiny: engine 0 \(pid 4242\) died: "
                                           r"pid 4242 local False oom 0\. Use a smaller budget"):
        lab.sweep_micro_batch(client, ["tiny"], seq_len=32, vocab_size=256, budget_bytes=2**20, workdir=str(tmp_path))


def test_sweep_loader_workers_resumes(tmp_path, monkeypatch):
    seen = []

    def fake(data_dir, *, batch_size, step_time_s, workers, n_batches, gpu_index, **kw):
        seen.append(list(workers))
        return pl.DataFrame({"num_workers": list(workers), "samples_per_s": [100.0 * (1 + w) for w in workers],
                             "data_wait_fraction": [0.5 / (1 + 4 * w) for w in workers],
                             "knee": [False] * len(workers)})

    monkeypatch.setattr(sweeps, "sweep_loader", fake)
    client = FakeClient(1)
    lab.sweep_loader_workers(client, str(tmp_path), batch_size=8, step_time_s=0.01, workers=[0, 1])
    df = lab.sweep_loader_workers(client, str(tmp_path), batch_size=8, step_time_s=0.01, workers=[0, 1, 2, 3])
    assert seen == [[0, 1], [2, 3]]
    assert df["num_workers"].to_list() == [0, 1, 2, 3]
    assert df.filter(pl.col("knee"))["num_workers"].to_list() == [3]  # 0.5/13 < 0.05 first at 3
    assert df["busy"].dtype == pl.Boolean and df["load_avg_1m"].null_count() == 0  # each point's load, flagged
    assert df["reused"].to_list() == [True, True, False, False]


def test_sweep_micro_batch_until_out_of_memory_resumes(tmp_path, monkeypatch):
    """budget_bytes=None measures on the engine's GPU until out of memory; stubbed here (the
    real search, ``labkit.study.gpu.max_micro_batch_cuda``, needs CUDA)."""
    import labkit.study.gpu as gpu

    seen = []

    def fake_cuda(cfg, seq_len):
        seen.append(cfg.hidden_size)
        return {"max_micro_batch": 4096 // cfg.hidden_size, "peak_bytes": 1, "budget_bytes": 94 * 10**9,
                "params": cfg.hidden_size * 1000, "seq_len": seq_len}

    monkeypatch.setattr(gpu, "max_micro_batch_cuda", fake_cuda)
    client = FakeClient(1)
    lab.sweep_micro_batch(client, ["tiny"], seq_len=32, vocab_size=256, budget_bytes=None, workdir=str(tmp_path))
    df = lab.sweep_micro_batch(client, ["tiny", "mini"], seq_len=32, vocab_size=256, budget_bytes=None,
                               workdir=str(tmp_path))
    assert seen == [64, 256]  # tiny was not measured again
    assert df["method"].to_list() == ["cuda_oom", "cuda_oom"] and df["max_micro_batch"].to_list() == [64, 16]
    assert df["budget_bytes"].to_list() == [94 * 10**9] * 2


@pytest.mark.gpu
def test_max_micro_batch_cuda_finds_the_out_of_memory_edge():
    from labkit.model import model_config
    from labkit.study.gpu import max_micro_batch_cuda

    # cap this process at 2 GiB so that out of memory, not the search's limit, ends the doubling
    cap = 2 * 2**30
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        rep = max_micro_batch_cuda(model_config("mini", 1024), 128, limit=1 << 16)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert 1 <= rep["max_micro_batch"] < 1 << 16  # stopped at the out-of-memory edge, far below the limit
    assert rep["peak_bytes"] <= cap


def test_sweep_rows_record_the_machine_load_and_flag_a_busy_machine(tmp_path, trained, monkeypatch):
    import os

    base = TrainConfig(data_dir=str(tmp_path / "shards"), run_dir=str(tmp_path / "r"), model="tiny",
                       batch={"micro_batch_size": 4})
    load = sweeps.machine_load()
    assert load["cpu_count"] == len(os.sched_getaffinity(0))
    assert load["load_avg_1m"] == pytest.approx(os.getloadavg()[0], abs=1.0)
    loads = iter([{"load_avg_1m": 0.2, "load_avg_5m": 0.5, "cpu_count": 2},
                  {"load_avg_1m": 2.5, "load_avg_5m": 1.0, "cpu_count": 2}])
    monkeypatch.setattr(points, "machine_load", lambda: next(loads))
    df = lab.sweep_ranks(FakeClient(2), base, str(tmp_path), ranks=[1, 2])
    assert df.select("ranks", "load_avg_1m", "cpu_count", "busy").rows() == [(1, 0.2, 2, False), (2, 2.5, 2, True)]
