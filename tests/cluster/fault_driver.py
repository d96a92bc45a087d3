"""The notebook's side of tests/cluster/test_cluster_faults.py, run ON host h1: one Slurm cluster of
4 engines (2 on n1/h1, 2 on n2/h2), then two faults in turn on the same engines.

Usage: python fault_driver.py JSON-ARGS; progress on stderr, one JSON line (the result) last on
stdout.

1. stuck: a tiny BERT trains on 4 ranks; rank 3 (on h2) is SIGSTOPped at step ``stop_at``. A thread
   waits for the notebook view (``labkit.live.StallView``) to name a stuck rank, runs the CLI
   (``labkit ranks RUN_DIR``) while the others still wait, then sends this process SIGINT (Ctrl-C).
   Rank 3 is continued (SIGCONT); the same engines then run the next call, which resumes the run
   from its checkpoint to the end: the reference run, at world size 4 throughout.
2. elastic: the same run in a new run_dir with ``run_ddp_resumable(..., elastic=True)``; h2's two
   engines are SIGKILLed at step ``kill_at``; the run finishes on the 2 engines left.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent


def log(*a):
    print("fault driver:", *a, file=sys.stderr, flush=True)


def _losses(run_dir: str) -> list[float]:
    return [json.loads(line)["loss"] for line in pathlib.Path(run_dir, "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def _ranks(rc) -> dict[int, dict]:
    from labkit import cluster as C

    infos = C.engine_info(rc)
    env = C.assign_ranks(infos, master_port=1)
    return {int(env[i["engine_id"]]["RANK"]): i for i in infos}


def _cli_then_ctrl_c(view, run_dir: str, out: dict, t0: list[float]) -> None:
    """Wait for the view to name a stuck rank; run ``labkit ranks RUN_DIR``; Ctrl-C this process."""
    end = time.monotonic() + 120
    while not (t0 and view.text.startswith("stuck")) and time.monotonic() < end:
        time.sleep(0.1)
    out["view_s"] = time.monotonic() - t0[0] if t0 else None
    out.update(view_text=view.text, view_html=view.html, view_lines=list(view.lines))
    log(f"view after {out['view_s']:.1f} s: {view.text}")
    t = time.monotonic()
    cli = subprocess.run([sys.executable, "-m", "labkit.cli", "ranks", run_dir], capture_output=True, text=True,
                         timeout=60)
    out.update(cli_s=time.monotonic() - t0[0], cli_seconds=time.monotonic() - t, cli_rc=cli.returncode,
               cli=cli.stdout.splitlines(), cli_err=cli.stderr[-2000:])
    log(f"cli ({time.monotonic() - t:.1f} s): {cli.stdout.splitlines()[:1]}")
    end = time.monotonic() + 10  # the view takes the stack py-spy read at its next poll (about a second)
    while "py-spy" not in view.html and time.monotonic() < end:
        time.sleep(0.1)
    out.update(view_text_last=view.text, view_html_last=view.html)
    os.kill(os.getpid(), signal.SIGINT)


def stuck(rc, cfg, a: dict, out: dict) -> None:
    from cluster_driver import train_slow
    from labkit import cluster as C
    from labkit.cluster.stuck import read_statuses
    from labkit.live import StallView

    ranks = _ranks(rc)
    pid3, t0 = ranks[3]["pid"], []

    def stop_rank_3(records):
        if not t0 and records[-1]["step"] >= a["stop_at"]:
            os.kill(pid3, signal.SIGSTOP)
            t0.append(time.monotonic())
            out["stopped_at_step"] = records[-1]["step"]
            log(f"rank 3 (pid {pid3}) stopped at step {records[-1]['step']}")

    view = StallView()
    threading.Thread(target=_cli_then_ctrl_c, args=(view, cfg.run_dir, out, t0), daemon=True).start()
    try:
        C.run_ddp(rc, train_slow, cfg, live=stop_rank_3, stall_view=view, timeout=300, stream=False)
        out["stuck_error"] = "the run finished: it was not interrupted"
    except KeyboardInterrupt:
        out["interrupt_returned_s"] = time.monotonic() - t0[0]
    except C.DDPError as err:
        out["stuck_error"] = str(err)
    end, status = time.monotonic() + 60, pathlib.Path(cfg.run_dir, "ranks")
    ended = ("done", "failed")
    while not all(read_statuses(status).get(r, {}).get("phase") in ended for r in (0, 1, 2)) and time.monotonic() < end:
        time.sleep(0.2)
    out["after_interrupt"] = {r: {k: s.get(k) for k in ("freed", "freed_at", "phase", "time")} | {
        "since": (s.get("collective") or {}).get("since")} for r, s in read_statuses(status).items()}
    os.kill(pid3, signal.SIGCONT)
    out["ids_after_interrupt"] = sorted(rc.ids)
    t = time.monotonic()
    res = C.run_ddp(rc, train_slow, cfg, timeout=300, stream=False)  # the next cell, on the same engines
    out.update(next_cell_s=time.monotonic() - t, pids_next=sorted(i["pid"] for i in _ranks(rc).values()),
               resumed_from=res[0]["resumed_from_step"], steps=res[0]["steps"], world_size=res[0]["world_size"],
               losses=_losses(cfg.run_dir))


def elastic(rc, cfg, a: dict, out: dict) -> None:
    from cluster_driver import train_slow
    from labkit import cluster as C

    ranks = _ranks(rc)
    h2 = sorted(r for r, i in ranks.items() if i["hostname"] == "h2")
    killed: list = []

    def kill_h2(records):
        if not killed and records[-1]["step"] >= a["kill_at"]:
            for r in h2:
                os.kill(ranks[r]["pid"], signal.SIGKILL)
            killed.append(records[-1]["step"])
            log(f"h2's engines (ranks {h2}) killed at step {records[-1]['step']}")

    t = time.monotonic()
    res = C.run_ddp_resumable(rc, train_slow, cfg, elastic=True, restarts=1, live=kill_h2, timeout=300, stream=False)
    run = pathlib.Path(cfg.run_dir)
    out.update(elastic_s=time.monotonic() - t, killed_ranks=h2, killed_at_step=killed[0] if killed else None,
               elastic_steps=res[0]["steps"], elastic_world_size=res[0]["world_size"],
               elastic_result_changes=res[0].get("world_size_changes"),
               elastic_saved_changes=json.loads((run / "result.json").read_text()).get("world_size_changes"),
               elastic_changes_file=[json.loads(x) for x in (run / "world_size_changes.jsonl").read_text().splitlines()],
               elastic_losses=_losses(cfg.run_dir),
               elastic_worlds=[json.loads(x)["world_size"] for x in (run / "metrics.jsonl").read_text().splitlines()])


def main(a: dict, out: dict) -> None:
    from labkit import cluster as C
    from labkit.config import TrainConfig

    cl = C.start_cluster(engines="slurm", slurm={"nodes": 2, "gpus_per_node": 2}, profile_dir=a["profile_dir"],
                         env={"PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}, timeout=180)
    try:
        rc = C.get_client(cl)
        out["where"] = sorted([r, i["node"], i["hostname"]] for r, i in _ranks(rc).items())
        out["ids"] = sorted(rc.ids)
        cfg = TrainConfig(data_dir=a["shards"], run_dir=a["stuck_run"], model="tiny", max_steps=a["steps"],
                          num_threads=1, device="cpu", backend="gloo", seed=0, resume=True,
                          timeout_s=a["stuck_timeout_s"], batch={"micro_batch_size": 4}, optim={"lr": 3e-3},
                          schedule={"warmup_steps": 2}, measure={"timing_warmup_steps": 1, "trackers": ()},
                          checkpoint={"every": 5, "keep": 3},
                          model_overrides={"hidden_dropout": 0.0, "attention_dropout": 0.0})
        stuck(rc, cfg, a, out)
        elastic(rc, dataclasses.replace(cfg, run_dir=a["elastic_run"], resume=False, timeout_s=a["timeout_s"]), a, out)
    finally:
        C.stop_cluster(cl)


if __name__ == "__main__":
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    result: dict = {}
    try:
        main(json.loads(sys.argv[1]), result)
    except BaseException as exc:  # the partial result says how far it got
        result["exception"] = f"{type(exc).__name__}: {exc}"[:3000]
        raise
    finally:
        print(json.dumps(result), flush=True)
