"""environment.yml and pyproject.toml must agree: pyproject is the one dependency list."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _load():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    return pyproject, env


def test_conda_installs_only_python_and_pip_and_this_package():
    pyproject, env = _load()
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    names = {re.split(r"[=<>! ]", d)[0] for d in conda}
    assert names == {"python", "pip"}, f"conda must only provide python and pip, got {sorted(names)}"
    pip_sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    assert len(pip_sections) == 1
    installs = [line for line in pip_sections[0] if not line.startswith("--")]
    assert len(installs) == 1 and installs[0].startswith("-e .")
    extras = re.findall(r"\[([^\]]+)\]", installs[0])
    for extra in (extras[0].split(",") if extras else []):
        assert extra in pyproject["project"]["optional-dependencies"], f"unknown extra {extra!r}"


def test_python_version_agrees():
    pyproject, env = _load()
    conda_py = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    version = conda_py.split("=")[1]
    minimum = pyproject["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, version.split("."))) >= tuple(map(int, minimum.split(".")))


def test_required_pieces_are_dependencies():
    pyproject, _ = _load()
    names = {re.split(r"[=<>!\[ ]", d)[0].lower() for d in pyproject["project"]["dependencies"]}
    for piece in ("jupyterlab", "ipyparallel", "torch", "tokenizers", "polars", "plotly", "capstone",
                  "pyelftools", "safetensors", "nbclient", "nbconvert", "tqdm", "numpy"):
        assert piece in names, f"{piece} missing from pyproject dependencies"


def test_torch_pin_matches_makefile():
    pyproject, _ = _load()
    pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    makefile = (ROOT / "Makefile").read_text()
    version = re.search(r"TORCH_VERSION := (\S+)", makefile).group(1)
    assert pin == f"torch=={version}"
