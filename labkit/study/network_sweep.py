"""Lesson 4 on a network that really limits: ``labkit sweep network CONFIG``.

The same model trains on 2 ranks across the two network hosts h1 and h2
(``labkit.testing.realcluster.NetHosts``: network namespaces joined by a veth pair, root only),
with the link shaped by a token-bucket filter to each bandwidth in turn, from unshaped (memory
speed: compute-bound) to tens of Mbit/s (network-bound). Each rank is a
``python -m labkit.train`` process started on its host (rank 0 on h1, ``MASTER_ADDR=h1``).

Per model and bandwidth it first measures the 1-rank compute time: two independent 1-rank runs,
one on each host at once, so the CPU is shared as it is by the 2-rank run, right before the
2-rank runs (on a shared machine the compute time of a step moves by tens of per cent within
minutes; one 1-rank measurement per model put the model 40 % off). Then it measures the link (a bounded TCP transfer, ``measure_throughput``) and the 2-rank run, and puts
the model's prediction beside it (``labkit.study.scaling.link_step_time`` from the measured
1-rank compute time, the run's own gradient buckets, the measured link bandwidth, and gloo's
bytes on the wire per gradient byte, measured from h2's veth counters at the unshaped setting,
and the CPU's rate of gloo's all-reduce on one host, ``measure_collective_rate``).

Rows (``sweeps/network.parquet``): model, grad_compression, rate_mbit (None: unshaped),
link_mbit (measured TCP goodput), params, comm_bytes (per step per rank, after compression),
buckets, wire_ratio, collective_mbyte_s (gloo's all-reduce rate on one host: its CPU cost,
``measure_collective_rate``, MB/s), compute_s (1 rank: the slower host's, as a synchronised step waits for
the slower rank), compute_s_hosts (both hosts'), step_s (2 ranks, median of the timed steps),
tokens_per_s (2 ranks), tokens_per_s_1rank (per rank), efficiency (compute_s / step_s),
comm_exposed_s, predicted_step_s, predicted_exposed_s, predicted_ratio (measured / predicted),
bandwidth_ratio (link bytes/s / (comm_bytes / compute_s): < 1 is network-bound), loss (after
the run's steps), steps, load_avg_1m, cpu_count, measured_at, made_by.

Each (model, link setting) is a point of the sweep (``labkit.study.points``): its 1-rank compute
time, the link and the 2-rank runs at each compression are measured together, in emptied run
directories, so every setting's compute time is its own. A point already in the table is read
back only when it was made with the same settings (model, rate, compressions, steps, micro-batch,
overrides, the config file's and the shard set's sha256); a sweep that reads every point back
starts no host and says so, with when and at what load they were measured. ``force`` measures
every point again.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["measure_collective_rate", "run_network_sweep"]

RATES_MBIT = (None, 1000.0, 200.0, 50.0)
"""The default link settings: unshaped, 1 Gbit/s, 200 Mbit/s, 50 Mbit/s."""
MODELS = ("mini", "small")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(hosts, host: str, config: str, sets: list[str], env: dict[str, str]) -> subprocess.Popen:
    cmd = hosts.wrap(host) + [sys.executable, "-m", "labkit.train", config]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env})


_PROBE = """
import json, statistics, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
nbytes, reps = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
x = torch.ones(nbytes // 4)
times = []
for i in range(reps + 1):
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(json.dumps({"seconds": statistics.median(times[1:])}))
dist.destroy_process_group()
"""


def measure_collective_rate(hosts, nbytes: int, *, host: str = "h1", reps: int = 5, timeout_s: float = 120.0) -> float:
    """Bytes per second of gloo's all-reduce of ``nbytes`` (fp32) between two processes on ONE host
    (``host``, over its loopback: no link in the way, one thread each, as the sweep's ranks run):
    the CPU cost of the collective (copying, summing, the kernel's TCP path), which the link's
    TCP goodput does not show. Median of ``reps`` timed all-reduces after one untimed. Raises
    RuntimeError when a process fails or does not finish within ``timeout_s`` seconds.
    Used by ``labkit.study.scaling.link_step_time`` (``collective_rate``)."""
    if nbytes < 4:
        raise ValueError(f"nbytes: must be at least 4, got {nbytes}")
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs = [subprocess.Popen(hosts.wrap(host) + [sys.executable, "-c", _PROBE, str(nbytes), str(reps)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **env, "RANK": str(k)}) for k in range(2)]
    out = _wait(procs, timeout_s, "the collective probe")[0]
    return nbytes / json.loads(out.strip().splitlines()[-1])["seconds"]


def _wait(procs: list[subprocess.Popen], timeout: float, what: str) -> list[str]:
    """Each process's standard output, once all have exited; RuntimeError naming ``what`` (and the
    first failure's last line of stderr) when one fails or they run past ``timeout`` seconds."""
    end = time.monotonic() + timeout
    errors, outs = [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"network sweep: {what} did not finish within {timeout:.0f} s")
        if p.returncode:
            errors.append(err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}")
        outs.append(out or "")
    if errors:
        raise RuntimeError(f"network sweep: {what} failed: {errors[0]}")
    return outs


def _timed(run_dir: pathlib.Path, warmup: int) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return records[warmup:] or records


def _settings(config: str, data_dir: str | None, model: str, rate, compressions, steps: int, warmup_steps: int,
              micro_batch: int | None, overrides) -> dict[str, Any]:
    """The record of one (model, link setting) point: what shapes its numbers."""
    from labkit.config.tomlfile import load
    from labkit.data.made_by import file_identity

    shards = data_dir or load(config).train.data_dir
    return {"model": model, "rate_mbit": rate, "compressions": sorted(compressions), "steps": steps,
            "warmup_steps": warmup_steps, "micro_batch": micro_batch, "overrides": list(overrides),
            "config": file_identity(config), "data": file_identity(pathlib.Path(shards) / "index.json"),
            "measures": "network: 1-rank compute, link, 2-rank step"}


def _measure_point(hosts, ctx: dict, model: str, rate, settings: dict) -> list[dict[str, Any]]:
    """One (model, link setting) point: the 1-rank compute on both hosts, the link, then the
    2-rank run at each compression, every run in an emptied directory; its rows. ``ctx``: the
    sweep's config, base --set list, out_dir, compressions, steps, warmup_steps, timeout_s, and
    the per-model ``wire`` ratio and ``collective_rate`` (updated here)."""
    from labkit.study.points import load_columns, point
    from labkit.study.scaling import link_step_time
    from labkit.testing import realcluster as R

    config, base, out_dir, warmup_steps = ctx["config"], ctx["base"], ctx["out_dir"], ctx["warmup_steps"]
    timeout_s, steps, wire, collective_rate = ctx["timeout_s"], ctx["steps"], ctx["wire"], ctx["collective_rate"]
    rows: list[dict[str, Any]] = []
    wire_ratio = wire.get(model)
    load = load_columns()
    # 1 rank on each host at once, just before the 2-rank runs of this setting: the CPU
    # shared as in them, and within the same minutes of the machine's load; every run
    # in an emptied directory (a finished run of the same config would not train)
    runs = [out_dir / f"{model}-1rank-{h}" for h in hosts.names]
    for d in runs:
        shutil.rmtree(d, ignore_errors=True)
    hosts.shape(None)
    procs = [_launch(hosts, h, config, base + [f'train.model="{model}"', f'train.run_dir="{d}"'], {})
             for h, d in zip(hosts.names, runs)]
    _wait(procs, timeout_s, f"{model} at 1 rank")
    each = [statistics.median(r["step_time_s"] for r in _timed(d, warmup_steps)) for d in runs]
    compute_s = max(each)  # a synchronised step waits for the slower rank
    result1 = json.loads((runs[0] / "result.json").read_text())
    tokens_1 = statistics.median(r["tokens_per_s"] for r in _timed(runs[0], warmup_steps))
    hosts.shape(None if rate is None else rate * 1e6)
    link = R.measure_throughput(hosts, int((rate or 4000.0) * 1e6 / 8 * 1.5), port=_free_port())
    for comp in ctx["compressions"]:
        name = f"{model}-{'unshaped' if rate is None else f'{rate:g}mbit'}-{comp}"
        run_dir = out_dir / name
        shutil.rmtree(run_dir, ignore_errors=True)
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": "h1", "MASTER_PORT": str(_free_port())}
        sets = base + [f'train.model="{model}"', f'train.run_dir="{run_dir}"',
                       f'train.parallel.grad_compression="{comp}"']
        before = hosts.link_bytes("h2")["tx_bytes"]
        procs = [_launch(hosts, h, config, sets, {**env, "RANK": str(k), "LOCAL_RANK": "0"})
                 for k, h in enumerate(hosts.names)]
        _wait(procs, timeout_s, f"{name} at 2 ranks")
        sent = hosts.link_bytes("h2")["tx_bytes"] - before
        timed = _timed(run_dir, warmup_steps)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        comm_bytes = statistics.median(r["comm_bytes"] for r in timed)
        if wire_ratio is None or (rate is None and comp == "none"):
            # gloo's bytes per gradient byte: rank 1 sends only its all-reduce shares
            wire_ratio = sent / max(1.0, sum(r["comm_bytes"] for r in records))
            wire[model] = wire_ratio if rate is None and comp == "none" else wire.get(model, wire_ratio)
        buckets = timed[-1]["comm_bucket_bytes"]
        if model not in collective_rate:  # the CPU's rate of the collective, once per model
            collective_rate[model] = measure_collective_rate(hosts, int(max(buckets)))
        step_s = statistics.median(r["step_time_s"] for r in timed)
        pred = link_step_time(compute_s=compute_s, bucket_bytes=buckets, bandwidth=link["goodput_bits"] / 8,
                              wire_ratio=wire_ratio, collective_rate=collective_rate.get(model))
        rows.append({
            "model": model, "grad_compression": comp, "rate_mbit": rate,
            "link_mbit": link["goodput_bits"] / 1e6, "params": result1.get("params"),
            "comm_bytes": comm_bytes, "buckets": len(buckets), "wire_ratio": wire_ratio,
            "collective_mbyte_s": collective_rate[model] / 1e6 if model in collective_rate else None,
            "compute_s": compute_s, "compute_s_hosts": each, "step_s": step_s,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "tokens_per_s_1rank": tokens_1, "efficiency": compute_s / step_s,
            "comm_exposed_s": statistics.median(r["comm_exposed_s"] for r in timed),
            "predicted_step_s": pred["step_s"], "predicted_exposed_s": pred["exposed_s"],
            "predicted_ratio": step_s / pred["step_s"],
            "bandwidth_ratio": (link["goodput_bits"] / 8) / (comm_bytes / compute_s),
            "loss": records[-1]["loss"], "steps": steps, **point(settings, load)})
        ctx["done"] += 1
        if ctx.get("bar") is not None:
            ctx["bar"].record({"point": ctx["done"], "loss": rows[-1]["loss"]})
    return rows


def run_network_sweep(config: str, workdir: str | os.PathLike, *, models=MODELS, rates_mbit=RATES_MBIT,
                      compressions=("none",), steps: int = 6, warmup_steps: int = 2, micro_batch: int | None = None,
                      data_dir: str | None = None, timeout_s: float = 900.0, net_dir: str | os.PathLike | None = None,
                      overrides=(), force: bool = False, progress: bool = False):
    """Run the sweep (module docstring) and write ``<workdir>/sweeps/network.parquet``; returns
    it as a polars DataFrame, with ``reused`` (True: a point read back from the table, measured at
    its ``measured_at``). ``config``: the TOML file whose ``[train]`` is the run (its
    ``data_dir`` unless ``data_dir`` is given); ``steps`` optimiser steps per run, the first
    ``warmup_steps`` untimed; ``micro_batch`` overrides ``batch.micro_batch_size``; ``compressions``
    are ``TrainConfig.parallel.grad_compression`` values, each measured at every bandwidth; ``overrides``
    are ``--set SECTION.KEY=VALUE`` strings given to every run before the sweep's own; ``force``
    measures every point again. Needs root, iproute2 and util-linux to measure (RuntimeError
    naming what is missing); h1/h2 are created and deleted. ``progress``: a bar over the points
    measured now (``labkit.cluster.progress.StepProgress``, key "point"; one per compression)."""
    import contextlib

    import polars as pl

    from labkit.cluster.progress import StepProgress

    from labkit.data.made_by import say
    from labkit.study.points import done_rows, reusable, reused_note, save
    from labkit.testing import realcluster as R

    if steps <= warmup_steps:
        raise ValueError(f"steps: must exceed warmup_steps ({warmup_steps}), got {steps}")
    if not rates_mbit:
        raise ValueError("rates_mbit: give at least one link setting")
    workdir = pathlib.Path(workdir).resolve()
    out_dir = workdir / "sweeps" / "network-runs"
    config = str(pathlib.Path(config).resolve())
    table = workdir / "sweeps" / "network.parquet"
    saved = done_rows(table, force)
    keep: dict[tuple, list[dict]] = {}  # (model, rate) -> the rows read back
    todo: list[tuple] = []
    for model in models:
        for rate in rates_mbit:
            settings = _settings(config, data_dir, model, rate, compressions, steps, warmup_steps, micro_batch,
                                 overrides)
            old = [r for r in saved if r["model"] == model and r["rate_mbit"] == rate]
            name = f"{model} {'unshaped' if rate is None else f'{rate:g} Mbit/s'}"
            if old and {r["grad_compression"] for r in old} == set(compressions) and \
                    reusable("network", name, old[0], settings):
                keep[(model, rate)] = old
            else:
                todo.append((model, rate, settings))
    if not todo:
        df = pl.DataFrame([r for m in models for rate in rates_mbit for r in keep[(m, rate)]], infer_schema_length=None)
        say(f"sweep network: {reused_note(df)}")
        return save(df, table)
    why = R.unavailable_hosts()
    if why:
        raise RuntimeError(f"network sweep: cannot run here: {why}")
    out_dir.mkdir(parents=True, exist_ok=True)
    base = [*overrides, f"train.max_steps={steps}", f"train.measure.timing_warmup_steps={warmup_steps}",
            "train.checkpoint.enabled=false", "train.eval.every=0", "train.eval.sequences=4", "train.num_threads=1",
            'train.device="cpu"', 'train.backend="gloo"', "train.measure.trackers=[]", "train.timeout_s=600"]
    if micro_batch:
        base.append(f"train.batch.micro_batch_size={micro_batch}")
    if data_dir:
        base.append(f'train.data_dir="{pathlib.Path(data_dir).resolve()}"')
    measured: dict[tuple, list[dict]] = {}
    # carried within a model from its unshaped point (measured or read back): gloo's bytes on the
    # wire per gradient byte, and the CPU's rate of the collective
    wire: dict[str, float] = {r["model"]: r["wire_ratio"] for rows in keep.values() for r in rows
                              if r["rate_mbit"] is None and r["grad_compression"] == "none"}
    collective_rate: dict[str, float] = {r["model"]: r["collective_mbyte_s"] * 1e6 for rows in keep.values()
                                         for r in rows if r.get("collective_mbyte_s")}
    ctx = {"config": config, "base": base, "out_dir": out_dir, "compressions": compressions, "steps": steps,
           "warmup_steps": warmup_steps, "timeout_s": timeout_s, "wire": wire, "collective_rate": collective_rate}
    hosts = R.NetHosts(pathlib.Path(net_dir or out_dir / "net"))
    points = len(todo) * len(compressions)
    with hosts, StepProgress(points, label="sweep network", key="point") if progress else contextlib.nullcontext() as bar:
        ctx["bar"], ctx["done"] = bar, 0
        for model, rate, settings in todo:
            measured[(model, rate)] = _measure_point(hosts, ctx, model, rate, settings)
    df = pl.DataFrame([r for m in models for rate in rates_mbit for r in (keep | measured)[(m, rate)]],
                      infer_schema_length=None)
    note = reused_note(df)
    if note:
        say(f"sweep network: {note}")
    return save(df, table)
