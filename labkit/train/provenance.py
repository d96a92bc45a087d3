"""What a run ran on: code version, library versions, hosts, devices, command line, times.

``collect`` is called by every rank of a run (it gathers each rank's host and device name);
rank 0 writes the result into config.json (at the start) and result.json (with the end time).
"""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import shlex
import socket
import subprocess
import sys
from typing import Any

import torch

from labkit import env
from labkit.train import dist

__all__ = ["COMMAND_ENV", "collect", "command_line", "device_name", "git_commit", "labkit_version", "library_versions",
           "now_iso"]

COMMAND_ENV = env.COMMAND_ENV  # "LABKIT_COMMAND", defined in labkit.env (the CLI sets it without importing torch)
"""Environment variable the ``labkit`` command sets to its own command line, so engines it
starts (which inherit its environment) record the command a researcher typed, not ipengine's."""


def now_iso() -> str:
    """The current UTC time as ISO 8601 with seconds (``2026-11-30T16:03:28+00:00``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def labkit_version() -> str:
    """The installed labkit distribution's version (``importlib.metadata``), "unknown" if none."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("labkit")
    except PackageNotFoundError:
        return "unknown"


def git_commit(root: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the git checkout holding this labkit (``root``:
    another directory), or None when it is not in a checkout or git is not installed. Dirty
    means tracked files differ from the commit (``git status --porcelain --untracked-files=no``)."""
    where = pathlib.Path(root) if root is not None else pathlib.Path(__file__).resolve().parents[2]
    if not (where / ".git").exists():
        return None
    try:
        sha = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(status.strip())}


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` for a CUDA device; for the CPU, the processor's model name
    from /proc/cpuinfo (``platform.processor()`` or the machine type where there is none)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_versions() -> dict[str, str | None]:
    """Python, torch, CUDA (torch's build; None for a CPU build) and NCCL (None without CUDA)."""
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            nccl = None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl}


def command_line() -> str:
    """This process's command line; a module run with ``-m`` (argv[0] is its file) is written
    as ``python -m <module>``; under torchrun (TORCHELASTIC_RUN_ID set) it says so."""
    argv = list(sys.argv)
    root = pathlib.Path(__file__).resolve().parents[2]  # the directory holding labkit/
    if argv and argv[0].endswith(".py") and pathlib.Path(argv[0]).resolve().is_relative_to(root / "labkit"):
        module = ".".join(pathlib.Path(argv[0]).resolve().relative_to(root).with_suffix("").parts)
        argv[:1] = ["-m", module.removesuffix(".__main__")]
    text = shlex.join([sys.executable, *argv])
    return f"torchrun worker: {text}" if "TORCHELASTIC_RUN_ID" in os.environ else text


def collect(device: torch.device, *, start_time: str | None = None) -> dict[str, Any]:
    """Provenance of this run; collective (every rank calls it once the process group exists).

    Returns ``{"labkit_version", "git": {"commit", "dirty"} | None, "python", "torch", "cuda",
    "nccl", "world_size", "hostnames": [per rank], "devices": [device name per rank],
    "command": the command line (``$LABKIT_COMMAND`` or this process's argv), "start_time"}``
    with times in ISO 8601 UTC."""
    ranks = dist.all_gather_object({"host": socket.gethostname(), "device": device_name(device)})
    command = os.environ.get(COMMAND_ENV) or command_line()
    return {"labkit_version": labkit_version(), "git": git_commit() if dist.is_main() else None,
            **library_versions(), "world_size": len(ranks), "hostnames": [r["host"] for r in ranks],
            "devices": [r["device"] for r in ranks], "command": command, "start_time": start_time or now_iso()}
