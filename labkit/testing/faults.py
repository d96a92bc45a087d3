"""Real slowdowns for straggler tests, as root: a CPU limit on processes, a slow link on one host.

- ``CpuLimit``: a cgroup of its own with a CPU quota (cgroup v2 ``cpu.max``, or the v1 cpu
  controller's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` where the machine mounts cgroups v1),
  holding the processes it is given (``add``: a process and its threads; processes they start
  later are born inside). The kernel's CFS bandwidth control throttles them to ``cpus`` CPUs
  (Documentation/scheduler/sched-bwc.rst). ``close`` moves what is still alive back to the
  root cgroup and removes the group.
- ``shape_host(hosts, host, rate_bits, direction=)``: the link of one network host (``NetHosts``)
  slowed, with tc on that host alone: what it receives ("in": the veth's ingress redirected to
  an ifb device, ``tc filter ... action mirred egress redirect``, tc-mirred(8), with a tbf on
  the ifb), what it sends ("out": a tbf on its veth), or both; ``unshape_host`` removes it.
- ``descendants(pid)``: every process below ``pid`` (a DataLoader's forkserver and its workers).

``cgroup_unavailable()`` / ``ifb_unavailable()`` say in one line why a fault cannot be made here.
"""

from __future__ import annotations

import os
import pathlib
import uuid

from labkit.testing.realcluster import NetHosts, _run, tbf_burst

__all__ = ["CpuLimit", "cgroup_unavailable", "descendants", "ifb_unavailable", "shape_host", "unshape_host"]


def _cpu_hierarchy() -> tuple[str, pathlib.Path] | None:
    """("v1" | "v2", the directory where a new cpu cgroup is made), or None when neither is
    mounted writable with the cpu controller."""
    mounts = pathlib.Path("/proc/mounts").read_text().splitlines()
    for line in mounts:
        _, where, kind, options = line.split()[:4]
        if kind == "cgroup" and "cpu" in options.split(","):
            return "v1", pathlib.Path(where)
    for line in mounts:
        _, where, kind = line.split()[:3]
        controllers = pathlib.Path(where) / "cgroup.controllers"
        if kind == "cgroup2" and controllers.exists() and "cpu" in controllers.read_text().split():
            return "v2", pathlib.Path(where)
    return None


def cgroup_unavailable() -> str | None:
    """Why ``CpuLimit`` cannot work here (one line), or None."""
    if os.geteuid() != 0:
        return "needs root (cgroups)"
    found = _cpu_hierarchy()
    if found is None:
        return "no cgroup hierarchy with the cpu controller is mounted"
    if not os.access(found[1], os.W_OK):
        return f"{found[1]} is not writable"
    return None


class CpuLimit:
    """A cgroup throttling its processes to ``cpus`` CPUs over ``period_s`` (module docstring):
    each period they run at most ``cpus x period_s`` CPU seconds (at least 1 ms, the kernel's
    smallest quota; at most the machine's CPUs). Use as a context manager or call ``close``. Raises
    RuntimeError (``cgroup_unavailable``'s reason) where no cpu cgroup can be made, ValueError
    for a bad setting."""

    def __init__(self, cpus: float, *, period_s: float = 0.1, name: str | None = None) -> None:
        if not 0.001 <= period_s <= 1.0:
            raise ValueError(f"period_s: must be between 0.001 and 1 second, got {period_s}")
        if cpus * period_s * 1e6 < 999.5 or cpus > (os.cpu_count() or 1):
            raise ValueError(f"cpus: cpus x period_s must be at least 1 ms and cpus at most {os.cpu_count()}, "
                             f"got {cpus} x {period_s} s")
        why = cgroup_unavailable()
        if why is not None:
            raise RuntimeError(f"CpuLimit: {why}")
        self.version, root = _cpu_hierarchy()
        self.root = root
        self.path = root / (name or f"labkit-limit-{uuid.uuid4().hex[:8]}")
        self.path.mkdir()
        period, quota = int(period_s * 1e6), int(round(cpus * period_s * 1e6))
        if self.version == "v2":
            control = root / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
            (self.path / "cpu.max").write_text(f"{quota} {period}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        self.cpus = quota / period

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group; its later children are born in it."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        """The processes in the group now."""
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def throttled_s(self) -> float:
        """Seconds the kernel has held the group's processes back so far (cpu.stat)."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        if "throttled_usec" in stat:  # v2
            return int(stat["throttled_usec"]) / 1e6
        return int(stat.get("throttled_time", 0)) / 1e9  # v1: nanoseconds

    def close(self) -> None:
        """Move what is still in the group back to the root cgroup and remove the group (safe to call twice)."""
        if not self.path.exists():
            return
        for pid in self.pids():
            try:
                (self.root / "cgroup.procs").write_text(str(pid))
            except (ProcessLookupError, OSError):
                pass
        self.path.rmdir()

    def __enter__(self) -> "CpuLimit":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), from /proc."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        children = [p for p, pp in parent.items() if pp in frontier]
        out += children
        frontier = children
    return out


def ifb_unavailable() -> str | None:
    """Why ``shape_host`` cannot shape a host's incoming traffic here (one line), or None."""
    if os.geteuid() != 0:
        return "needs root (tc, ifb)"
    name = f"ifbprobe{os.getpid() % 10000}"
    try:
        _run(["ip", "link", "add", name, "type", "ifb"])
    except RuntimeError as err:
        return f"no ifb device: {err}"
    _run(["ip", "link", "del", name])
    return None


def shape_host(hosts: NetHosts, host: str, rate_bits: float, *, direction: str = "both",
               latency: float = 0.05) -> None:
    """Slow ``host``'s link to ``rate_bits`` bit/s for what it receives ("in"), sends ("out") or
    both, with tc on that host alone (module docstring); the other host's end stays as it was.
    ValueError for a bad setting, RuntimeError when tc fails."""
    NetHosts._check_shape(rate_bits, None, latency)
    if direction not in ("in", "out", "both"):
        raise ValueError(f"direction: 'in', 'out' or 'both', got {direction!r}")
    dev, ifb = f"veth-{host}", f"ifb-{host}"
    tbf = ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(tbf_burst(rate_bits)), "latency", f"{latency * 1e3:g}ms"]
    unshape_host(hosts, host)
    if direction in ("out", "both"):
        _run(["tc", "-n", host, "qdisc", "add", "dev", dev, "root", *tbf])
    if direction == "out":
        return
    _run(["ip", "-n", host, "link", "add", ifb, "type", "ifb"])
    _run(["ip", "-n", host, "link", "set", ifb, "up"])
    _run(["tc", "-n", host, "qdisc", "add", "dev", dev, "handle", "ffff:", "ingress"])
    _run(["tc", "-n", host, "filter", "add", "dev", dev, "parent", "ffff:", "protocol", "all", "u32", "match", "u32",
          "0", "0", "action", "mirred", "egress", "redirect", "dev", ifb])
    _run(["tc", "-n", host, "qdisc", "add", "dev", ifb, "root", *tbf])


def unshape_host(hosts: NetHosts, host: str) -> None:
    """Remove ``shape_host``'s shaping of ``host`` (nothing to remove is fine)."""
    import subprocess

    from labkit.testing.realcluster import _env

    dev = f"veth-{host}"
    for cmd in (["tc", "-n", host, "qdisc", "del", "dev", dev, "root"],
                ["tc", "-n", host, "qdisc", "del", "dev", dev, "ingress"],
                ["ip", "-n", host, "link", "del", f"ifb-{host}"]):
        subprocess.run(cmd, capture_output=True, env=_env())
