"""Docs that cannot go stale unnoticed: every repository path (``labkit/...``, ``tests/...``,
``docs/...``, ``benchmarks/...``, ``configs/...``, ``notebooks/...``, ``etc/...``) and every
``labkit.<module>[.<name>]`` that the README, docs/, config files, notebooks, the Makefile or
labkit's own docstrings name must exist. A file moved or renamed without its mentions fails here.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATH = re.compile(r"(?<![\w./~$-])((?:labkit|tests|docs|benchmarks|configs|notebooks|etc)/[\w.*/-]*[\w*/])")
MODULE = re.compile(r"(?<![\w./-])(labkit(?:\.[A-Za-z_]\w*)+)")
PENDING: dict[str, str] = {}
"""Names a branch in flight documents ahead of its code; each entry goes once the code is merged."""
PLACEHOLDER = ("<", "{", "-<", "_<", "-{")
"""What follows a path that is a pattern, not a file (``bench_<name>.py``, ``config-<k>.json``)."""


def documents() -> list[pathlib.Path]:
    """The files whose text names repository paths for a reader."""
    out = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "environment.yml",
           *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").glob("*.toml")),
           *sorted((ROOT / "notebooks").glob("*.py")), *sorted((ROOT / "labkit").rglob("*.py")),
           *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.sh"))]
    return [p for p in out if p.is_file()]


def _path_exists(p: str) -> bool:
    if "*" in p:
        return bool(glob.glob(str(ROOT / p)))
    if (ROOT / p).exists():
        return True
    last = p.rstrip("/").rsplit("/", 1)[-1]
    if "." not in last and not p.endswith("/"):  # a notebook named without .py, or a rate such as docs/s
        return len(last) <= 1 or any((ROOT / f"{p}{ext}").exists() for ext in (".py", ".md"))
    return False


def _module_exists(name: str) -> bool:
    """``labkit.a.b.c``: the longest importable module prefix, then attributes (dataclass fields count,
    and a field holding a section dataclass is followed into it: ``TrainConfig.data.seq_len``)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
                field = next(f for f in dataclasses.fields(obj) if f.name == attr)
                if not dataclasses.is_dataclass(field.default_factory):
                    return True
                obj = field.default_factory
            else:
                return False
        return True
    return False


def missing_references(text: str, name: str) -> list[str]:
    """``"<name>:<line>: <path or module>"`` for each repository path or labkit name in ``text``
    that does not exist."""
    bad = []
    for m in PATH.finditer(text):
        if text[m.end():m.end() + 2].startswith(PLACEHOLDER):
            continue
        p = m.group(1).rstrip(".")
        if not _path_exists(p):
            bad.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {p}")
    for m in MODULE.finditer(text):
        dotted = m.group(1).rstrip(".")
        if dotted not in PENDING and not _module_exists(dotted):
            bad.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {dotted}")
    return bad


def test_no_document_names_a_path_outside_the_repository():
    """A reader of a clone has the repository only: no mention of the team's shared notes by
    absolute path (docs/references.md holds what they said)."""
    bad = [f"{d.relative_to(ROOT)}: {m}" for d in documents()
           for m in re.findall(r"/work/shared/\S+", d.read_text(errors="replace"))]
    assert bad == [], "\n".join(bad)


def test_the_checker_finds_a_planted_stale_path():
    text = ("see labkit/train.py and `labkit.configfile`, not labkit/lab.py or labkit.lab.stage\n"
            "or labkit.config.TrainConfig.data.seq_len or labkit.config.TrainConfig.data.seq; benchmarks/bench_<name>.py is a pattern, tokens/s a rate\n")
    assert missing_references(text, "x.md") == ["x.md:1: labkit/train.py", "x.md:1: labkit.configfile",
                                                "x.md:2: labkit.config.TrainConfig.data.seq"]


def test_pending_names_are_still_pending():
    """An entry of PENDING whose module exists now must leave the list (so it cannot hide a typo)."""
    assert [name for name in PENDING if _module_exists(name)] == []


def test_docs_name_only_paths_and_modules_that_exist():
    bad = [line for doc in documents() for line in missing_references(doc.read_text(errors="replace"),
                                                                      str(doc.relative_to(ROOT)))]
    assert bad == [], "\n".join(bad)
