"""Provenance of a run in one process: versions, host, device, the checkout's commit, the command."""

from __future__ import annotations

import pathlib
import platform
import socket
import subprocess
import sys

import torch

from labkit.train import provenance

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_collect_in_one_process(monkeypatch):
    monkeypatch.delenv(provenance.COMMAND_ENV, raising=False)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "labkit" / "train" / "__main__.py"), "run.toml"])
    prov = provenance.collect(torch.device("cpu"), start_time="2026-01-01T00:00:00+00:00")
    assert prov["world_size"] == 1 and prov["hostnames"] == [socket.gethostname()]
    assert prov["python"] == platform.python_version() and prov["torch"] == torch.__version__
    assert prov["cuda"] == torch.version.cuda and len(prov["devices"]) == 1 and prov["devices"][0]
    assert prov["command"] == f"{sys.executable} -m labkit.train run.toml"
    assert prov["start_time"] == "2026-01-01T00:00:00+00:00"
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        assert prov["git"]["commit"] == head.stdout.strip()
    monkeypatch.setenv(provenance.COMMAND_ENV, "labkit train c.toml")
    assert provenance.collect(torch.device("cpu"))["command"] == "labkit train c.toml"


def test_no_checkout_no_commit(tmp_path):
    assert provenance.git_commit(tmp_path) is None
