"""The notebook's side of the network-host tests (tests/cluster/test_real_hosts.py), run ON host h1.

Usage: python cluster_driver.py COMMAND JSON-ARGS; prints progress to stderr and one JSON line
(the result) last on stdout. Commands:
  train     start 2 engines (engines="local" on h1, or "slurm": n1 on h1, n2 on h2), check where
            they run, train a tiny BERT with DDP, stop; returns the per-step losses.
  node_loss Slurm engines on h1/h2; take h2's link down mid-training; return the DDPError the
            user sees and the seconds from link down to it; wait for Slurm to end the job
            (NODE_FAIL, not requeued), bring the link up, restart the engines, resume from the
            last checkpoint; check that no old engine is left; returns the resumed run.
  mpi       Open MPI engines on h1 and h2 through the rsh agent: where they run, run_ddp,
            restart_engines (same ids), run_ddp again.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def log(*a):
    print("driver:", *a, file=sys.stderr, flush=True)


def train_slow(cfg, sink=None):
    """labkit.train.train with rank 0's sink slowed to 50 ms a step, so the driver's ~1 Hz live
    poll sees a step long before the last one on any machine."""
    from labkit.train import train

    def slow_sink(record):
        time.sleep(0.05)
        if sink is not None:
            sink(record)

    return train(cfg, sink=slow_sink)


def allreduce_ranks():
    """All-reduce (rank + 1) over gloo; (rank, world size, sum, node, hostname)."""
    import datetime
    import socket

    import torch
    import torch.distributed as dist

    from labkit.cluster.topology import node_name

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), node_name(), socket.gethostname()


def _cfg(a: dict, run_dir: str):
    from labkit.config import TrainConfig

    return TrainConfig(data_dir=a["shards"], run_dir=run_dir, model="tiny", max_steps=a["steps"], num_threads=1,
                       device="cpu", backend="gloo", seed=0, resume=True, timeout_s=a.get("timeout_s", 60),
                       batch={"micro_batch_size": 4}, optim={"lr": 3e-3}, schedule={"warmup_steps": 2},
                       measure={"timing_warmup_steps": 1}, checkpoint={"every": a.get("ckpt_every", 10), "keep": 2})


def _start(a: dict, engines: str):
    from labkit import cluster as C

    kw = dict(profile_dir=a["profile_dir"], env={"PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}, timeout=a.get("start_timeout", 180))
    if engines == "slurm":
        return C.start_cluster(engines="slurm", slurm={"nodes": 2, "gpus_per_node": 1}, **kw)
    if engines == "mpi":
        mpi_args = ["--mca", "plm_rsh_agent", a["rsh_agent"], "--mca", "oob_tcp_if_include", "10.200.0.0/24",
                    "--mca", "btl_tcp_if_include", "10.200.0.0/24", "--mca", "btl", "tcp,self",
                    "--bind-to", "none", "-H", "h1,h2"]
        return C.start_cluster(2, engines="mpi", mpi_args=mpi_args, **kw)
    return C.start_cluster(2, **kw)


def _where(client) -> list[list]:
    from labkit import cluster as C

    return sorted([i["node"], i["hostname"], i["local_id"]] for i in C.engine_info(client))


def _losses(run_dir: str) -> list[float]:
    lines = pathlib.Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if line.strip()]


def cmd_train(a: dict, out: dict) -> dict:
    from labkit import cluster as C

    cl = _start(a, a["engines"])
    try:
        rc = C.get_client(cl)
        where = _where(rc)
        res = C.run_ddp(rc, train_slow, _cfg(a, a["run_dir"]), timeout=300, stream=False)
    finally:
        C.stop_cluster(cl)
    out.update(where=where, losses=_losses(a["run_dir"]), steps=res[0]["steps"], world_size=res[0]["world_size"])
    return out


def _ip_link(host: str, state: str) -> None:
    subprocess.run(["ip", "-n", host, "link", "set", f"veth-{host}", state], check=True)


def _node_state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def _job_state(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip() or "gone"


def _engine_procs(host: str) -> list[int]:
    """pids of ipyparallel engine processes on `host` (not their nannies)."""
    pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
    out = []
    for p in pids:
        try:
            cmd = pathlib.Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ipyparallel.engine" in cmd and not cmd[0].endswith(b"srun"):
            out.append(int(p))
    return out


def _wait(pred, timeout: float, poll: float = 0.5):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    return pred()


def cmd_node_loss(a: dict, out: dict) -> dict:
    from labkit import cluster as C

    cl = _start(a, "slurm")
    try:
        rc = C.get_client(cl)
        out["where"] = _where(rc)
        old_job = next(iter(cl.engines.values())).job_id
        down_at: list[float] = []

        def take_h2_down(records):
            if not down_at and records[-1]["step"] >= a["down_at_step"]:
                _ip_link("h2", "down")
                down_at.append(time.monotonic())
                out["down_at_step"] = records[-1]["step"]
                log(f"link veth-h2 down at step {records[-1]['step']}")

        cfg = _cfg(a, a["run_dir"])
        try:
            C.run_ddp(rc, train_slow, cfg, live=take_h2_down, timeout=300, stream=False)
            out["error"] = None
        except C.DDPError as err:
            out["error_seconds"] = time.monotonic() - down_at[0] if down_at else None
            out.update(error=str(err), error_rank=err.rank, error_lost=err.lost, error_died=err.died,
                       error_engine=err.engine_id)
        # Slurm notices the silent node (SlurmdTimeout) and ends the job: NODE_FAIL, not requeued
        out["old_job_state"] = _wait(lambda: (s := _job_state(old_job)) != "RUNNING" and s, 120)
        out["node_state_down"] = _node_state("n2")
        _ip_link("h2", "up")
        slurmd_n2 = int(pathlib.Path(a["slurm_dir"], "slurmd-n2.pid").read_text().split()[0])
        os.kill(slurmd_n2, signal.SIGHUP)  # register now, as a rebooted node would
        out["node_state_back"] = _wait(lambda: (st := _node_state("n2")) in ("idle", "mixed", "allocated") and st, 60)
        t = time.monotonic()
        out["restarted_ids"] = C.restart_engines(cl, timeout=300)
        out["restart_seconds"] = time.monotonic() - t
        out["old_job_state_after"] = _job_state(old_job)
        out["jobs"] = subprocess.run(["squeue", "-h", "-o", "%i %T %N"], capture_output=True,
                                     text=True).stdout.split("\n")[:-1]
        out["client_ids"] = rc.ids
        out["where_after"] = _where(rc)
        def procs():
            return {h: len(_engine_procs(h)) for h in ("h1", "h2")}

        out["engine_procs"] = _wait(lambda: procs() == {"h1": 1, "h2": 1} and procs(), 120) or procs()
        res = C.run_ddp(rc, train_slow, cfg, timeout=300, stream=False)
        out.update(resumed_from=res[0]["resumed_from_step"], steps=res[0]["steps"], losses=_losses(a["run_dir"]))
    finally:
        C.stop_cluster(cl)
    return out


def _keep_logs(cl, a: dict) -> None:
    """Copy the controller and engine logs next to the run (stop_cluster removes them)."""
    import shutil

    src = pathlib.Path(cl.profile_dir, "log")
    if src.is_dir():
        shutil.copytree(src, pathlib.Path(a["run_dir"]).parent / "logs", dirs_exist_ok=True)
        log(f"logs kept in {pathlib.Path(a['run_dir']).parent / 'logs'}")


def cmd_mpi(a: dict, out: dict) -> dict:
    from labkit import cluster as C

    cl = _start(a, "mpi")
    try:
        rc = C.get_client(cl)
        out.update(where=_where(rc), ids=rc.ids, pids=sorted(i["pid"] for i in C.engine_info(rc)))
        out["ddp"] = sorted(C.run_ddp(rc, allreduce_ranks, timeout=120, stream=False))
        out["restarted_ids"] = C.restart_engines(cl, timeout=120)
        out["pids_after"] = sorted(i["pid"] for i in C.engine_info(rc))
        out["where_after"] = _where(rc)
        out["ddp_after"] = sorted(C.run_ddp(rc, allreduce_ranks, timeout=120, stream=False))
    except BaseException:
        _keep_logs(cl, a)
        raise
    finally:
        C.stop_cluster(cl)
    return out


if __name__ == "__main__":
    sys.path[:0] = [str(HERE), str(HERE.parent)]  # this module by name, and tests/ helpers (tiny_shards)
    import cluster_driver as D  # engines unpickle these functions by module name (tests/ is on their path)

    command, args = sys.argv[1], json.loads(sys.argv[2])
    result: dict = {}
    try:
        getattr(D, f"cmd_{command}")(args, result)
    except BaseException as exc:  # the partial result says how far it got
        result["exception"] = f"{type(exc).__name__}: {exc}"[:2000]
        raise
    finally:
        print(json.dumps(result), flush=True)
