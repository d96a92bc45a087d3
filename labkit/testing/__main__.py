"""``python -m labkit.testing``: start and stop the one-machine cluster of labkit.testing.realcluster
by hand (as root), e.g. to try labkit's Slurm and MPI paths (docs/slurm.md, "Try it on one machine").

  python -m labkit.testing up [--dir D] [--hosts [--rate-mbit R]] [--gpus-per-node G]
                                                                         start munge + Slurm (+ h1/h2)
  python -m labkit.testing shape --rate-mbit R|none [--dir D]            change the h1-h2 link's rate
  python -m labkit.testing on h1 -- CMD...                               run CMD on network host h1
  python -m labkit.testing down [--dir D]                                 stop everything by pid

`up` prints the SLURM_CONF line to export. With --hosts, Slurm's nodes are n1 on h1 and n2 on
h2 and clients (and the notebook) must run on h1; the rsh agent for Open MPI is D/rsh-agent.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from labkit.testing import realcluster as R

DEFAULT_DIR = "/tmp/labkit-cluster"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit.testing", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start munge, Slurm (two nodes) and, with --hosts, network hosts h1/h2")
    up.add_argument("--dir", default=DEFAULT_DIR)
    up.add_argument("--hosts", action="store_true", help="n1 on host h1, n2 on host h2 (network namespaces)")
    up.add_argument("--gpus-per-node", type=int, default=2)
    up.add_argument("--rate-mbit", type=float, default=None,
                    help="shape the h1-h2 link to this many Mbit/s (tbf on both ends); default unshaped")
    shape = sub.add_parser("shape", help="change the h1-h2 link's rate while everything runs (tc qdisc change)")
    shape.add_argument("--rate-mbit", required=True, help="Mbit/s, or 'none' to remove the shaping")
    shape.add_argument("--dir", default=DEFAULT_DIR)
    down = sub.add_parser("down", help="stop what `up` started (by pid) and delete h1/h2")
    down.add_argument("--dir", default=DEFAULT_DIR)
    on = sub.add_parser("on", help="run a command on network host h1 or h2")
    on.add_argument("host", choices=list(R.HOST_ADDRS))
    on.add_argument("--dir", default=DEFAULT_DIR)
    on.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    why = R.unavailable()
    if why:
        print(f"labkit.testing: cannot run here: {why}", file=sys.stderr)
        return 2
    d = pathlib.Path(a.dir)
    state = d / "state.json"
    if a.cmd == "up":
        rate = None if a.rate_mbit is None else a.rate_mbit * 1e6
        hosts = R.NetHosts(d / "net", rate_bits=rate).start() if a.hosts else None
        try:
            slurm = R.Slurm(d / "slurm", hosts=hosts, gpus_per_node=a.gpus_per_node).start()
        except BaseException:
            if hosts:
                hosts.stop()
            raise
        extra = {}
        if hosts:
            extra["rsh_agent"] = R.write_rsh_agent(d / "rsh-agent", hosts)
        state.write_text(json.dumps({"hosts": bool(hosts), "gpus_per_node": a.gpus_per_node,
                                     "munged_pid": slurm.munge.pid, **extra}))
        print(f"export SLURM_CONF={slurm.conf}")
        print(f"# nodes: {slurm.node_states()}" + ("; run clients on h1: python -m labkit.testing on h1 -- CMD"
                                                    if hosts else ""))
        return 0
    saved = json.loads(state.read_text()) if state.exists() else {"hosts": True}
    hosts = R.NetHosts(d / "net")
    if a.cmd == "shape":
        hosts.shape(None if a.rate_mbit == "none" else float(a.rate_mbit) * 1e6)
        print(hosts.qdisc("h1"))
        return 0
    if a.cmd == "on":
        cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
        os.execvpe(hosts.wrap(a.host)[0], hosts.wrap(a.host) + (cmd or ["/bin/bash"]),
                   {**os.environ, "SLURM_CONF": str(d / "slurm" / "slurm.conf")})
    slurm = R.Slurm(d / "slurm", hosts=hosts if saved.get("hosts") else None,
                    gpus_per_node=saved.get("gpus_per_node", 2))
    slurm.munge.pid = saved.get("munged_pid")  # only the munged that `up` started
    slurm.stop()
    if saved.get("hosts"):
        hosts.stop()
    state.unlink(missing_ok=True)
    print("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
