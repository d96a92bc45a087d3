"""The package's shape, checked from its source: no import cycles (imports inside functions
included), no function over 100 lines, files written only through ``labkit.io``, and citations
only of documents the repository contains."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "labkit"
MAX_FUNCTION_LINES = 100


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module -> labkit modules it imports, at any depth of the file (inside functions too).

    ``from pkg import name`` depends on ``pkg.name`` when that is a module, else on ``pkg``."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                deps.update(subs if len(subs) == len(node.names) else [target, *subs])
        resolved = set()
        for dep in deps:
            while dep not in mods and "." in dep:
                dep = dep.rpartition(".")[0]
            if dep in mods and dep != name and dep.startswith("labkit"):
                resolved.add(dep)
        graph[name] = resolved
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "labkit.cluster.launch" in graph and graph["labkit.lab"]  # the parser sees the package
    assert _cycles(graph) == []


LAYERS = {"model": 0, "data": 0, "train": 1, "cluster": 2, "study": 3}
"""Imports run one way: the lab surface (top-level lab, plots, report, demo, cli) -> study ->
cluster -> train -> model / data. ``config``, ``io``, ``measure`` and ``workdir`` are leaves."""


def test_imports_run_one_way():
    bad = []
    for mod, deps in import_graph().items():
        parts = mod.split(".")
        if len(parts) < 3 or parts[1] not in LAYERS:
            continue
        for dep in deps:
            dparts = dep.split(".")
            if len(dparts) < 2:
                continue
            if dparts[1] in LAYERS and dparts[1] != parts[1] and LAYERS[dparts[1]] >= LAYERS[parts[1]]:
                bad.append(f"{mod} -> {dep}")
            elif len(dparts) == 2 and dparts[1] in ("lab", "plots", "report", "demo", "cli"):
                bad.append(f"{mod} -> {dep} (the lab surface)")
    assert bad == []


def test_no_function_over_100_lines():
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def test_files_are_replaced_only_in_labkit_io():
    hits = []
    for base in ("labkit", "tests", "benchmarks"):
        for path in sorted((ROOT / base).rglob("*.py")):
            if path == PKG / "io.py" or path == pathlib.Path(__file__):
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\bos\.(replace|rename)\(", line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}")
    assert hits == []


def test_cited_documents_exist():
    """The design notes a team keeps outside the repository (its design, style, references,
    contract and cluster notes) are never cited unless the repository holds them: a user who
    clones labkit can follow every citation. docs/ holds what they said, in our words."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    names = {pathlib.Path(p).name for p in tracked}
    missing = set()
    for rel in tracked:
        if not rel.startswith(("labkit/", "tests/", "benchmarks/", "notebooks/", "docs/")) and rel != "README.md":
            continue
        path = ROOT / rel
        if path.suffix not in (".py", ".md", ".ipynb", ".sh") or not path.exists():
            continue
        if path == pathlib.Path(__file__):
            continue
        for cited in re.findall(r"\b((?:DESIGN|STYLE|REFERENCES|CONTRACT|REAL_CLUSTER)\.md)\b", path.read_text(errors="replace")):
            if cited not in names:
                missing.add(f"{rel}: {cited}")
    assert sorted(missing) == []


SPLIT_BRANCH = re.compile(r"ParallelModel|isinstance\(.*parallel\.|if split|split is None|split is not None|split else")


def test_the_loop_has_no_branch_on_the_kind_of_split():
    """Every run is a (pp, dp, tp) mesh and the step goes through ``labkit.train.runtime.Runtime``
    (issue 28): no ``ParallelModel`` check and no ``if split`` anywhere in labkit/train/loop.py (the
    one place that chooses by split when a run starts is ``labkit.train.resume``)."""
    path = PKG / "train" / "loop.py"
    hits = [f"loop.py:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if SPLIT_BRANCH.search(line)]
    assert hits == []



ALL_PENDING: set[str] = set()
"""Modules whose ``__all__`` waits for the branches editing them now (issue 31); empty it after they land."""


def _defined_public(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(public functions and classes defined at top level, every top-level name bound)."""
    public, bound = set(), set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            if not node.name.startswith("_"):
                public.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                bound |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    bound |= {(a.asname or a.name).split(".")[0] for a in sub.names}
    return public, bound


def test_every_module_lists_its_public_names_in_all():
    """Each module's ``__all__`` (a literal list) names only what the module binds, and every
    public function and class it defines; packages and modules that define nothing need none."""
    problems = []
    for name, path in _modules().items():
        if name in ALL_PENDING or path.name == "__main__.py":
            continue
        tree = ast.parse(path.read_text())
        public, bound = _defined_public(tree)
        listed = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                       and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)), None)
        if listed is None:
            if public:
                problems.append(f"{name}: no __all__ (defines {sorted(public)[:3]}...)")
            continue
        if missing := public - set(listed):
            problems.append(f"{name}: __all__ lacks {sorted(missing)}")
        if unbound := set(listed) - bound:
            problems.append(f"{name}: __all__ names {sorted(unbound)}, not bound in the module")
    assert not problems, problems


def test_the_package_has_a_docstring():
    import labkit
    import labkit.data

    assert labkit.__doc__ and "labkit.train" in labkit.__doc__ and labkit.data.__doc__
