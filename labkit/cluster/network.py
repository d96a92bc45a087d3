"""Networks between the notebook's host and the engines' nodes: interface addresses, the
controller address labkit picks by default, and the environment Open MPI must be told to pass.

Used by labkit.cluster.engines (start_cluster's `network_interface` and `controller_ip`).
"""

from __future__ import annotations

import socket
import subprocess

__all__ = ["default_controller_ip", "interface_address", "mpi_exports"]


def interface_address(name: str) -> str:
    """The IPv4 address of this host's network interface `name`; ValueError listing the
    interfaces when it has none."""
    import psutil

    addrs = psutil.net_if_addrs()
    found = [a.address for a in addrs.get(name, []) if a.family == socket.AF_INET]
    if not found:
        have = ", ".join(f"{i} {a.address}" for i, lst in sorted(addrs.items()) for a in lst
                         if a.family == socket.AF_INET)
        raise ValueError(f"network_interface={name!r}: no IPv4 address on this host (interfaces: {have})")
    return found[0]


def default_controller_ip(engines: str, network_interface: str | None, mpi_args: list[str]) -> str:
    """See start_cluster's controller_ip."""
    if network_interface:
        return interface_address(network_interface)
    if engines == "local":
        return "127.0.0.1"
    host = socket.gethostname()
    addr = socket.gethostbyname(host)
    many_hosts = any(a in ("-H", "--host", "-host", "--hostfile", "-hostfile", "--machinefile") for a in mpi_args)
    if addr.startswith("127.") and (engines == "slurm" or many_hosts):
        import psutil

        have = ", ".join(f"{i} {a.address}" for i, lst in sorted(psutil.net_if_addrs().items()) for a in lst
                         if a.family == socket.AF_INET and not a.address.startswith("127."))
        raise ValueError(f"controller_ip: this host's name {host!r} resolves to {addr}, which other nodes cannot "
                         f"reach; pass controller_ip='<address>' or network_interface='<name>' "
                         f"(this host has: {have or 'loopback only'}; 127.0.0.1 only if all nodes are this host)")
    return addr


def mpi_exports(environment: dict) -> list[str]:
    """Open MPI's mpiexec passes only OMPI_* variables to ranks on other hosts: `-x NAME` for the
    engines' environment and ipyparallel's IPP_CLUSTER_ID / IPP_PROFILE_DIR (MPICH's hydra
    forwards the whole environment; nothing is added there or without mpiexec)."""
    import shutil

    exe = shutil.which("mpiexec")
    if exe is None:
        return []
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    if "Open MPI" not in version and "OpenRTE" not in version:
        return []
    names = sorted({"IPP_CLUSTER_ID", "IPP_PROFILE_DIR", *environment})
    return [arg for name in names for arg in ("-x", name)]
