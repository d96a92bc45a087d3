"""A real cluster on one Debian machine, as root: munge, Slurm, network hosts, Open MPI across them.

- `NetHosts`: two network hosts h1 and h2, i.e. network namespaces joined by a veth pair
  (10.200.0.1/24 on veth-h1, 10.200.0.2/24 on veth-h2, no route anywhere else). `wrap(host)`
  is the command prefix that runs a program "on" a host: in its network namespace, with its own
  hostname and an /etc/hosts naming h1 and h2 (bind-mounted in a private mount namespace).
  `nsenter --net` is used rather than `ip netns exec`, which remounts /sys and makes slurmd
  fail ("No filesystem mounted on /sys/fs/cgroup").
- `Slurm`: munged (if none is running), slurmctld and one `slurmd -N nK` per virtual node, from
  a slurm.conf written to a scratch directory (nothing goes to /etc/slurm; clients find it by
  SLURM_CONF). Each node has `Gres=gpu:G` backed by character device files (mknod c 1 3, the
  /dev/null numbers), so `--gpus-per-node` works without GPUs, and a TaskProlog that exports
  LABKIT_NODE_NAME=$SLURMD_NODENAME, so the virtual nodes have distinct node names although
  they share a host. Without `hosts` all nodes listen on 127.0.0.1; with `hosts`, slurmctld and
  n1 run on h1, n2 on h2.
- `write_rsh_agent`: the `plm_rsh_agent` script Open MPI uses to start its daemon "on" h1/h2.

Everything is started with a pid file and stopped by pid; `Slurm.stop` first cancels the jobs
and ends the processes of this cluster's jobs (found by its SLURM_CONF in their environment),
`NetHosts.stop` ends what still runs in the namespaces and deletes them. Both are safe to call
twice and after a failed start. Command line: ``python -m labkit.testing.realcluster --help``.

The hosts' names, addresses and Slurm's ports are fixed, so only one cluster can run on a machine
at a time: ``NetHosts.start`` and ``Slurm.start`` take ``MACHINE_LOCK`` (an ``flock`` on
``/run/lock/labkit-realcluster.lock``, reentrant within a process) and ``stop`` gives it back. A
second test process (another checkout's suite, a benchmark) waits for it instead of tearing down
the first one's hosts.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
from typing import Callable

__all__ = [
    "MACHINE_LOCK", "MachineLock", "APT_PACKAGES", "HOST_ADDRS", "TOOLS", "hosts_text", "kill_pids", "Munge",
    "NetHosts", "pid_alive", "Slurm",
    "unavailable", "wait_for", "write_rsh_agent", "measure_throughput", "tbf_burst", "unavailable_hosts"
]

TOOLS = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "munged", "munge", "unmunge",
         "mpiexec", "ip", "tc", "nsenter", "unshare", "mknod")
"""Programs the real-cluster tests need (Debian: slurmctld slurmd slurm-client munge openmpi-bin)."""
APT_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "openmpi-bin", "libopenmpi-dev")
HOST_ADDRS = {"h1": "10.200.0.1", "h2": "10.200.0.2"}
"""The only addresses the network hosts ever have (a /24 of their own, inside the namespaces)."""


def hosts_text() -> str:
    """The /etc/hosts of the network hosts: localhost, and each host's address both as IPv4 and
    as the IPv4-mapped IPv6 address (``::ffff:10.200.0.2``). torch's TCPStore listens on a
    dual-stack socket, so it sees its clients at the mapped address and asks getnameinfo for
    that; without the mapped line the lookup went to DNS, which the namespaces cannot reach, and
    c10d printed "The hostname of the client socket cannot be retrieved. err=-3" per connection."""
    return "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n::ffff:{a} {h}\n" for h, a in HOST_ADDRS.items())


def unavailable() -> str | None:
    """Why a real cluster cannot be started here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "needs root (daemons, network namespaces, device files)"
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [t for t in TOOLS if shutil.which(t, path=path) is None]
    if missing:
        return f"missing {' '.join(missing)} (as root, `make test` installs: apt-get install {' '.join(APT_PACKAGES)})"
    return None


def unavailable_hosts() -> str | None:
    """Why the network hosts alone (``NetHosts``, no Slurm) cannot be made here (one line), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [t for t in ("ip", "tc", "nsenter", "unshare") if shutil.which(t, path=path) is None]
    if missing:
        return f"missing {' '.join(missing)} (apt-get install iproute2 util-linux)"
    return None


def wait_for(pred: Callable[[], object], timeout: float, what: str, poll: float = 0.1) -> object:
    """Poll pred() until it returns something true; that value. Raises TimeoutError naming `what`."""
    end = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(poll)


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def kill_pids(pids: list[int], timeout: float = 10.0) -> None:
    """SIGTERM each pid, wait up to `timeout` s, then SIGKILL what is left."""
    pids = [p for p in pids if p and p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(pid_alive(p) for p in pids):
            time.sleep(0.05)
        if not any(pid_alive(p) for p in pids):
            return


def _read_pid(path: pathlib.Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def _env(extra: dict | None = None) -> dict[str, str]:
    """os.environ (+ extra) with /usr/sbin and /sbin on PATH, where Debian puts the daemons."""
    env = {**os.environ, **(extra or {})}
    env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
    return env


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a setup command; raise RuntimeError with its stderr when it fails."""
    env = _env(kw.pop("env", None))
    cmd = [shutil.which(cmd[0], path=env["PATH"]) or cmd[0], *cmd[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 60), env=env, **kw)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {(out.stderr or out.stdout).strip()}")
    return out


# ---------------------------------------------------------------- one cluster per machine


class MachineLock:
    """An exclusive ``flock`` on ``path`` held while a real cluster runs, counted so that one
    process may take it several times (hosts, then Slurm on them). ``acquire`` waits up to
    ``timeout`` seconds (TimeoutError naming the holder's pid); the kernel drops the lock when the
    holding process dies, so a crashed run never leaves it held."""

    def __init__(self, path: str | os.PathLike = "/run/lock/labkit-realcluster.lock"):
        self.path = pathlib.Path(path)
        self._fd: int | None = None
        self._count = 0

    def acquire(self, timeout: float = 3600.0) -> None:
        if self._count:
            self._count += 1
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    raise TimeoutError(f"another real cluster runs on this machine (pid {holder}, "
                                       f"{self.path}); waited {timeout:.0f} s") from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd, self._count = fd, 1

    def release(self) -> None:
        if not self._count:
            return
        self._count -= 1
        if not self._count and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


MACHINE_LOCK = MachineLock()
"""This process's hold on the machine's one real cluster (module docstring)."""


# ---------------------------------------------------------------- network hosts


def tbf_burst(rate_bits: float) -> int:
    """Default token-bucket depth in bytes for a tbf shaping ``rate_bits`` bit/s: 10 ms of the
    rate, at least 256 KiB. tbf needs a bucket of at least rate/HZ bytes to reach its rate
    (tc-tbf(8)); the veth sends GSO super-packets of up to 64 KiB, which must fit too. Over a
    transfer of T seconds the bucket lets through burst/T bytes/s above the rate (< 2 % for
    transfers of a second or more at 200 Mbit/s)."""
    return max(256 * 1024, int(rate_bits / 8 * 0.01))


class NetHosts:
    """Network hosts h1 and h2 on this machine (see the module docstring). Use as a context
    manager or call start()/stop(); `workdir` holds the hosts file.

    ``rate_bits``: shape the link to this many bit/s (None: unshaped, a veth runs at memory
    speed, ~17 Gbit/s seen) with a token-bucket filter (``tc qdisc ... tbf``, tc-tbf(8)) on both
    ends, so the link is symmetric; ``burst`` (bytes, default ``tbf_burst(rate_bits)``) and
    ``latency`` (seconds a packet may wait in the tbf queue before it is dropped, default 0.05)
    are tbf's. ``shape`` changes the setting while the hosts run (``tc qdisc change``, no
    restart; open connections carry on at the new rate)."""

    names = tuple(HOST_ADDRS)

    def __init__(self, workdir: str | os.PathLike, *, rate_bits: float | None = None, burst: int | None = None,
                 latency: float = 0.05):
        self.dir = pathlib.Path(workdir)
        self.hosts_file = self.dir / "hosts"
        self._check_shape(rate_bits, burst, latency)
        self.rate_bits, self.burst, self.latency = rate_bits, burst, latency

    @staticmethod
    def _check_shape(rate_bits: float | None, burst: int | None, latency: float) -> None:
        if rate_bits is not None and not rate_bits >= 8000:
            raise ValueError(f"rate_bits: must be at least 8000 bit/s or None (unshaped), got {rate_bits}")
        if burst is not None and not burst >= 2048:
            raise ValueError(f"burst: must be at least 2048 bytes or None (tbf_burst), got {burst}")
        if not latency > 0:
            raise ValueError(f"latency: must be positive seconds, got {latency}")

    def start(self) -> "NetHosts":
        if not getattr(self, "_locked", False):
            MACHINE_LOCK.acquire()
            self._locked = True
        self.dir.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text(hosts_text())
        self._teardown()  # leftovers of a run that was killed
        for h in self.names:
            _run(["ip", "netns", "add", h])
        _run(["ip", "link", "add", "veth-h1", "type", "veth", "peer", "name", "veth-h2"])
        for h, addr in HOST_ADDRS.items():
            _run(["ip", "link", "set", f"veth-{h}", "netns", h])
            _run(["ip", "-n", h, "addr", "add", f"{addr}/24", "dev", f"veth-{h}"])
            _run(["ip", "-n", h, "link", "set", "lo", "up"])
            _run(["ip", "-n", h, "link", "set", f"veth-{h}", "up"])
        self.shape(self.rate_bits, burst=self.burst, latency=self.latency)
        return self

    def shape(self, rate_bits: float | None, *, burst: int | None = None, latency: float = 0.05) -> None:
        """Shape both ends of the running link to ``rate_bits`` bit/s (a tbf root qdisc on veth-h1
        and veth-h2: ``tc qdisc add`` the first time, ``tc qdisc change`` after, so it also works
        from another process on hosts started elsewhere), or remove the shaping (None). ``burst`` in bytes (None: ``tbf_burst``), ``latency`` in seconds. Raises
        ValueError for a bad setting, RuntimeError when tc fails."""
        self._check_shape(rate_bits, burst, latency)
        for h in self.names:
            dev, shaped = f"veth-{h}", "qdisc tbf" in self.qdisc(h)
            if rate_bits is None:
                if shaped:
                    _run(["tc", "-n", h, "qdisc", "del", "dev", dev, "root"])
                continue
            _run(["tc", "-n", h, "qdisc", "change" if shaped else "add", "dev", dev, "root", "tbf", "rate",
                  f"{int(rate_bits)}bit", "burst", str(burst or tbf_burst(rate_bits)), "latency", f"{latency * 1e3:g}ms"])
        self.rate_bits, self.burst, self.latency = rate_bits, burst, latency

    def qdisc(self, host: str) -> str:
        """``tc qdisc show`` of `host`'s end of the link (one line per qdisc)."""
        if host not in HOST_ADDRS:
            raise ValueError(f"host must be one of {self.names}, got {host!r}")
        return _run(["tc", "-n", host, "qdisc", "show", "dev", f"veth-{host}"]).stdout.strip()

    def link_bytes(self, host: str) -> dict[str, int]:
        """Bytes and packets `host`'s veth has sent and received since it was made ({"tx_bytes",
        "rx_bytes", "tx_packets", "rx_packets"}): the kernel's counters, read with ``ip -s -j link``
        in the host's namespace (/sys/class/net outside it shows the machine's own devices).
        Ethernet frames: they count the IP and TCP headers and gloo's protocol bytes."""
        import json

        if host not in HOST_ADDRS:
            raise ValueError(f"host must be one of {self.names}, got {host!r}")
        link = json.loads(_run(["ip", "-s", "-j", "-n", host, "link", "show", "dev", f"veth-{host}"]).stdout)[0]
        stats = link["stats64"]
        return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
                "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"]}

    def wrap(self, host: str) -> list[str]:
        """Command prefix running the rest of a command line on `host` (h1 or h2)."""
        if host not in HOST_ADDRS:
            raise ValueError(f"host must be one of {self.names}, got {host!r}")
        script = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{host}", "unshare", "--mount", "--uts", "--propagation", "private",
                "/bin/sh", "-c", script, host, str(self.hosts_file)]

    def link(self, host: str, up: bool) -> None:
        """Take `host`'s end of the link down (node loss) or bring it up again."""
        _run(["ip", "-n", host, "link", "set", f"veth-{host}", "up" if up else "down"])

    def pids(self, host: str) -> list[int]:
        """Processes running on `host` (in its network namespace)."""
        out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True, env=_env())
        return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []

    def stop(self) -> None:
        """End every process on h1/h2 and delete the namespaces (the veth pair goes with them);
        give back ``MACHINE_LOCK``."""
        self._teardown()
        if getattr(self, "_locked", False):
            self._locked = False
            MACHINE_LOCK.release()

    def _teardown(self) -> None:
        present = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
        for h in self.names:
            if h in present:
                kill_pids(self.pids(h), timeout=5)
                subprocess.run(["ip", "netns", "del", h], capture_output=True, env=_env())
        subprocess.run(["ip", "link", "del", "veth-h1"], capture_output=True, env=_env())  # if it never moved

    def __enter__(self) -> "NetHosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_RECEIVER = """\
import json, socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, _ = srv.accept()
buf, got, first = bytearray(1 << 20), 0, None
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    now = time.perf_counter()
    first = first or now
    got += n
print(json.dumps({"bytes": got, "seconds": now - first}), flush=True)
"""
_SENDER = """\
import socket, sys
total, chunk = int(sys.argv[3]), bytes(1 << 20)
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as s:
    while total > 0:
        s.sendall(chunk[:min(total, len(chunk))])
        total -= len(chunk)
"""


def measure_throughput(hosts: NetHosts, nbytes: int, *, src: str = "h1", dst: str = "h2", port: int = 29571,
                       timeout: float = 120) -> dict[str, float]:
    """Send ``nbytes`` over one TCP connection from `src` to `dst` (only the hosts' own addresses)
    and time it at the receiver, from its first byte to its last. Returns {"bytes", "seconds",
    "goodput_bits" (payload bit/s), "wire_bits" (bit/s of Ethernet frames leaving `src`'s veth over
    the same seconds, from ``link_bytes``)}. The first byte arrives after TCP's handshake, so the
    time is the transfer's; tbf's bucket lets ``burst`` bytes through at once, so send several
    seconds' worth. Raises RuntimeError when either side fails."""
    import json
    import sys

    if nbytes <= 0:
        raise ValueError(f"nbytes: must be positive, got {nbytes}")
    recv = subprocess.Popen(hosts.wrap(dst) + [sys.executable, "-c", _RECEIVER, HOST_ADDRS[dst], str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = recv.stdout.readline()
        if line.strip() != "listening":
            raise RuntimeError(f"throughput receiver on {dst} did not start: {recv.stderr.read()[-2000:]}")
        before = hosts.link_bytes(src)["tx_bytes"]
        send = subprocess.run(hosts.wrap(src) + [sys.executable, "-c", _SENDER, HOST_ADDRS[dst], str(port),
                                                 str(nbytes)], capture_output=True, text=True, timeout=timeout)
        if send.returncode:
            raise RuntimeError(f"throughput sender on {src} failed: {send.stderr[-2000:]}")
        out, err = recv.communicate(timeout=timeout)
        wire = hosts.link_bytes(src)["tx_bytes"] - before
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    if recv.returncode:
        raise RuntimeError(f"throughput receiver on {dst} failed: {err[-2000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    seconds = res["seconds"]
    return {"bytes": res["bytes"], "seconds": seconds, "goodput_bits": 8 * res["bytes"] / seconds,
            "wire_bits": 8 * wire / seconds}


def write_rsh_agent(path: str | os.PathLike, hosts: NetHosts) -> str:
    """Write Open MPI's rsh agent (`--mca plm_rsh_agent PATH`): `PATH HOST CMD...` runs CMD on
    HOST (h1, h2 or its address) through `hosts.wrap`. Returns the path."""
    cases = "\n".join(f"  {h}|{a}) host={h} ;;" for h, a in HOST_ADDRS.items())
    enter = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'
    text = (f"#!/bin/bash\n# Open MPI rsh agent for labkit's network hosts: $1 is the host, the rest the command.\n"
            f"case \"$1\" in\n{cases}\n  *) echo \"rsh agent: unknown host $1\" >&2; exit 255 ;;\nesac\nshift\n"
            f"exec nsenter --net=/run/netns/$host unshare --mount --uts --propagation private /bin/sh -c "
            f"'{enter}' \"$host\" '{hosts.hosts_file}' /bin/sh -c \"$*\"\n")
    p = pathlib.Path(path)
    p.write_text(text)
    p.chmod(0o755)
    return str(p)


# ---------------------------------------------------------------- munge + Slurm


class Munge:
    """munged for Slurm's authentication: started (as user munge) only if none answers yet;
    stop() ends it only if this object started it."""

    pid_file = pathlib.Path("/run/munge/munged.pid")

    def __init__(self):
        self.pid: int | None = None

    @staticmethod
    def running() -> bool:
        enc = subprocess.run(["munge", "-n"], capture_output=True)
        dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True) if enc.returncode == 0 else enc
        return enc.returncode == 0 and dec.returncode == 0

    def start(self) -> "Munge":
        if self.running():
            return self
        run = pathlib.Path("/run/munge")
        run.mkdir(parents=True, exist_ok=True)
        shutil.chown(run, "munge", "munge")
        _run(["runuser", "-u", "munge", "--", shutil.which("munged", path=_env()["PATH"]) or "/usr/sbin/munged"])
        self.pid = wait_for(lambda: _read_pid(self.pid_file), 10, "munged pid file")
        wait_for(self.running, 10, "munge -n | unmunge")
        return self

    def stop(self) -> None:
        if self.pid:
            kill_pids([self.pid])
            self.pid = None


class Slurm:
    """slurmctld + one slurmd per virtual node n1..nN (see the module docstring).

    workdir: scratch directory for slurm.conf, gres.conf, the TaskProlog, state, spool, logs
    and pid files. hosts: a started NetHosts (then nodes must be 2: n1 on h1, n2 on h2, and
    clients must run on h1: `run` and `client_prefix` do that), or None for all on 127.0.0.1.
    gpus_per_node: GRES gpu count per node (device files). slurmd_timeout: seconds before
    slurmctld marks a silent node down (SlurmdTimeout). ctld_port, node_port: slurmctld's port
    and the first slurmd port.
    """

    def __init__(self, workdir: str | os.PathLike, *, hosts: NetHosts | None = None, nodes: int = 2,
                 gpus_per_node: int = 2, cpus: int = 2, slurmd_timeout: int = 30, ctld_port: int = 6817,
                 node_port: int = 17001):
        if hosts is not None and nodes != 2:
            raise ValueError(f"nodes must be 2 on the network hosts h1/h2, got {nodes}")
        self.dir = pathlib.Path(workdir).resolve()
        self.hosts, self.nodes, self.gpus, self.cpus = hosts, nodes, gpus_per_node, cpus
        self.slurmd_timeout, self.ctld_port, self.node_port = slurmd_timeout, ctld_port, node_port
        self.conf = self.dir / "slurm.conf"
        self.munge = Munge()
        self._locked = False
        self.node_names = [f"n{k}" for k in range(1, nodes + 1)]

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm clients and jobs: SLURM_CONF."""
        return {"SLURM_CONF": str(self.conf)}

    def _host_of(self, node: str) -> str | None:
        return None if self.hosts is None else f"h{node[1:]}"

    @property
    def client_prefix(self) -> list[str]:
        """Prefix for Slurm client commands (on h1 with network hosts, else nothing)."""
        return [] if self.hosts is None else self.hosts.wrap("h1")

    def run(self, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sinfo, squeue, ...) where the controller is reachable."""
        return subprocess.run(self.client_prefix + cmd, capture_output=True, text=True, timeout=timeout,
                              env=_env(self.env))

    def conf_text(self) -> str:
        """slurm.conf for this cluster (no cgroups, no accounting, no mail, GRES gpus)."""
        d = self.dir
        if self.hosts is None:
            me = socket.gethostname().split(".")[0]
            ctld = f"{me}(127.0.0.1)"
            last = self.node_port + self.nodes - 1
            node_lines = [f"NodeName=n[1-{self.nodes}] NodeHostname={me} NodeAddr=127.0.0.1 "
                          f"Port=[{self.node_port}-{last}]"]
        else:
            ctld = f"h1({HOST_ADDRS['h1']})"
            node_lines = [f"NodeName={n} NodeHostname=h{n[1:]} NodeAddr={HOST_ADDRS['h' + n[1:]]} "
                          f"Port={self.node_port + k}" for k, n in enumerate(self.node_names)]
        res = f" CPUs={self.cpus} RealMemory=2000 Gres=gpu:{self.gpus} State=UNKNOWN"
        lines = [
            "ClusterName=labkit", f"SlurmctldHost={ctld}", f"SlurmctldPort={self.ctld_port}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", f"TaskProlog={d}/taskprolog.sh",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "MpiDefault=none", "MailProg=/bin/true",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SlurmdParameters=config_overrides",
            "ReturnToService=2", f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "SlurmctldTimeout=30", f"SlurmdTimeout={self.slurmd_timeout}", "KillWait=5", "MinJobAge=30",
            "GresTypes=gpu", *(line + res for line in node_lines),
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]
        return "\n".join(lines)

    def _write_files(self) -> None:
        d = self.dir
        for sub in ("state", "log", "fakedev", *(f"spool-{n}" for n in self.node_names)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for k in range(self.gpus):
            dev = d / "fakedev" / f"gpu{k}"
            if not dev.exists():
                _run(["mknod", str(dev), "c", "1", "3"])
        self.conf.write_text(self.conf_text())
        (d / "gres.conf").write_text(f"Name=gpu File={d}/fakedev/gpu[0-{self.gpus - 1}]\n")
        prolog = d / "taskprolog.sh"
        prolog.write_text("#!/bin/sh\n# Slurm TaskProlog: lines printed as 'export X=Y' enter the task's environment.\n"
                          "echo \"export LABKIT_NODE_NAME=$SLURMD_NODENAME\"\n")
        prolog.chmod(0o755)

    def start(self, timeout: float = 60) -> "Slurm":
        """Start munged (if needed), slurmctld and the slurmds; wait until every node is idle.
        Raises RuntimeError / TimeoutError with the daemon's log tail; stops what it started."""
        if not self._locked:
            MACHINE_LOCK.acquire()
            self._locked = True
        try:
            self._write_files()
            self.munge.start()
            env = self.env
            ctld_prefix = [] if self.hosts is None else self.hosts.wrap("h1")
            _run(ctld_prefix + ["slurmctld", "-f", str(self.conf)], env=env)
            for n in self.node_names:
                prefix = [] if self.hosts is None else self.hosts.wrap(self._host_of(n))
                _run(prefix + ["slurmd", "-f", str(self.conf), "-N", n], env=env)
            wait_for(self._all_idle, timeout, f"Slurm nodes idle (logs in {self.dir / 'log'})", poll=0.25)
        except BaseException:
            self.stop()
            raise
        return self

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"])
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return out.returncode == 0 and all(states.get(n) == "idle" for n in self.node_names)

    def jobs(self, states: str = "") -> list[dict]:
        """squeue as dicts: job_id, name, state, nodes (`states`: squeue -t, e.g. "all")."""
        out = self.run(["squeue", "-h", "-o", "%i|%j|%T|%N", *(["-t", states] if states else [])])
        if out.returncode:
            raise RuntimeError(f"squeue failed: {out.stderr.strip()}")
        keys = ("job_id", "name", "state", "nodes")
        return [dict(zip(keys, line.split("|"))) for line in out.stdout.splitlines() if line.strip()]

    def node_states(self) -> dict[str, str]:
        """{node: state} from sinfo (idle, allocated, down*, ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"])
        return dict(line.split() for line in out.stdout.splitlines() if line.strip())

    def job_pids(self) -> list[int]:
        """Processes of this cluster's jobs and steps: those with this SLURM_CONF in their environment."""
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for p in pathlib.Path("/proc").iterdir():
            if p.name.isdigit() and int(p.name) != os.getpid():
                try:
                    if mark in (p / "environ").read_bytes().split(b"\0"):
                        pids.append(int(p.name))
                except OSError:
                    continue
        return pids

    def stop(self) -> None:
        """Cancel every job, end the jobs' processes, stop slurmds, slurmctld and our munged."""
        if (self.dir / "slurmctld.pid").exists():
            ids = [j["job_id"] for j in self.jobs()] if self._ctld_alive() else []
            if ids:
                self.run(["scancel", *ids])
                with_timeout = time.monotonic() + 15
                while time.monotonic() < with_timeout and self.jobs():
                    time.sleep(0.2)
        kill_pids(self.job_pids(), timeout=5)
        daemons = [_read_pid(self.dir / f"slurmd-{n}.pid") for n in self.node_names]
        daemons.append(_read_pid(self.dir / "slurmctld.pid"))
        kill_pids([p for p in daemons if p], timeout=10)
        for n in self.node_names:
            (self.dir / f"slurmd-{n}.pid").unlink(missing_ok=True)
        (self.dir / "slurmctld.pid").unlink(missing_ok=True)
        kill_pids(self.job_pids(), timeout=5)  # slurmstepd left by a slurmd that died first
        self.munge.stop()
        if self._locked:
            self._locked = False
            MACHINE_LOCK.release()

    def reregister(self, node: str) -> None:
        """Make `node`'s slurmd register with slurmctld now (SIGHUP: reconfigure), as a rebooted
        node does; after a network partition slurmctld itself pings a DOWN node only every
        ~100 s before it returns it to service (ReturnToService=2)."""
        pid = _read_pid(self.dir / f"slurmd-{node}.pid")
        if not pid:
            raise RuntimeError(f"no slurmd pid file for {node} in {self.dir}")
        os.kill(pid, signal.SIGHUP)

    def _ctld_alive(self) -> bool:
        pid = _read_pid(self.dir / "slurmctld.pid")
        return bool(pid) and pid_alive(pid)

    def __enter__(self) -> "Slurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
