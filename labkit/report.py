"""Execute notebooks with injected parameters and export them as self-contained HTML reports.

Parameters are injected papermill-style: a code cell tagged "injected-parameters" right after
the cell tagged "parameters" (at the top when there is none). The kernel runs with
IPP_NONINTERACTIVE=1 (no ipyparallel progress widgets, docs/references.md E) and with this labkit on
its PYTHONPATH. Notebooks call `labkit.plots.setup_notebook_plotting()` so plotly.js is
embedded once and the HTML renders offline; `check_report` verifies that.
"""

from __future__ import annotations

from labkit.io import atomic_write_text

import contextlib
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any

from labkit._nbformat import import_nbformat

nbformat = import_nbformat()  # without jsonschema's IRI checker: 3.7 CPU-s less per process (labkit._nbformat)

__all__ = ["INJECTED_TAG", "PARAMETERS_TAG", "UNIX_PATH_MAX", "check_parameters", "check_report",
           "declared_parameters", "execute_notebook", "execute_notebooks", "inject_parameters", "kernel_over_ipc", "notebook_title",
           "offline_exporter", "parameter_defaults", "read_notebook"]

INJECTED_TAG = "injected-parameters"
PARAMETERS_TAG = "parameters"


def read_notebook(path: str | os.PathLike) -> nbformat.NotebookNode:
    """Read a notebook from its jupytext script (``.py``, the source in ``notebooks/``) or an ``.ipynb``.

    Raises FileNotFoundError naming a missing file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"notebook not found: {path}")
    if path.suffix == ".py":
        import jupytext

        return jupytext.read(path)
    return nbformat.read(path, as_version=4)


def declared_parameters(nb: nbformat.NotebookNode | str | os.PathLike) -> list[str]:
    """Names assigned at top level in the notebook's cell tagged "parameters", in order.

    `nb`: a notebook node or the path of a notebook (``read_notebook``). A notebook without such a
    cell declares none. Raises SyntaxError if that cell is not valid Python."""
    return list(parameter_defaults(nb))


_NOT_LITERAL = object()


def parameter_defaults(nb: nbformat.NotebookNode | str | os.PathLike) -> dict[str, Any]:
    """``{name: default}`` of the notebook's cell tagged "parameters", in order: the value of the
    name's first assignment when it is a Python literal (``ast.literal_eval``), else a private
    sentinel (an expression: no type to check against). SyntaxError if that cell is not valid Python."""
    import ast

    if not isinstance(nb, nbformat.NotebookNode):
        nb = read_notebook(nb)
    defaults: dict[str, Any] = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and PARAMETERS_TAG in cell.get("metadata", {}).get("tags", []):
            for node in ast.parse(cell.source).body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                    if isinstance(node, ast.AnnAssign) else []
                for t in targets:
                    if isinstance(t, ast.Name) and t.id not in defaults:
                        try:
                            defaults[t.id] = ast.literal_eval(node.value) if node.value is not None else _NOT_LITERAL
                        except (ValueError, SyntaxError, TypeError):
                            defaults[t.id] = _NOT_LITERAL
    return defaults


def _same_kind(value: Any, default: Any) -> bool:
    """Whether ``value`` may replace ``default``: the same type, an int for a float, anything for
    a None or non-literal default; bool and int are told apart, list and tuple are not."""
    if default is None or default is _NOT_LITERAL:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


def check_parameters(nb: nbformat.NotebookNode | str | os.PathLike, parameters: dict[str, Any]) -> None:
    """Check ``parameters`` against the notebook's "parameters" cell before anything runs:
    ValueError (one line) naming a key that is not an identifier, a parameter the cell does not
    declare (a misspelt name would otherwise be ignored silently), a value whose repr is not a
    Python literal, or a value of another type than the declared default (``steps = 40`` takes an
    int: ``--param steps=three`` is refused here, not in a cell half-way through the run)."""
    import ast

    defaults = parameter_defaults(nb)
    for name, value in parameters.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise ValueError(f"parameter name {name!r} is not a Python identifier")
        if name not in defaults:
            raise ValueError(f"parameter {name!r} is not declared in the notebook's parameters cell "
                             f"(declared: {', '.join(defaults) or 'none'})")
        try:
            ast.literal_eval(repr(value))
        except (ValueError, SyntaxError) as err:
            raise ValueError(f"parameter {name!r}: value {value!r} is not a Python literal") from err
        if not _same_kind(value, defaults[name]):
            raise ValueError(f"parameter {name!r}: expected {type(defaults[name]).__name__} like its default "
                             f"{defaults[name]!r}, got {value!r}")


def inject_parameters(nb: nbformat.NotebookNode, parameters: dict[str, Any]) -> nbformat.NotebookNode:
    """Insert (in place) a cell assigning `name = repr(value)` after the "parameters" cell.

    Earlier injected cells are removed first. Values must round-trip through repr (str, int,
    float, bool, None, and lists/tuples/dicts of those). Raises ValueError naming a key that is
    not an identifier, a parameter the notebook's "parameters" cell does not declare
    (``declared_parameters``; a misspelt name would otherwise be ignored silently), or a value
    whose repr is not a Python literal, or one of another type than the declared default
    (``check_parameters``).
    """
    check_parameters(nb, parameters)
    lines = ["# Parameters (injected by labkit.report)"]
    for name, value in parameters.items():
        lines.append(f"{name} = {value!r}")
    nb.cells = [c for c in nb.cells if INJECTED_TAG not in c.get("metadata", {}).get("tags", [])]
    where = next((k + 1 for k, c in enumerate(nb.cells)
                  if PARAMETERS_TAG in c.get("metadata", {}).get("tags", [])), 0)
    cell = nbformat.v4.new_code_cell("\n".join(lines), metadata={"tags": [INJECTED_TAG]})
    nb.cells.insert(where, cell)
    return nb


def execute_notebook(
    path: str | os.PathLike,
    out_html: str | os.PathLike,
    *,
    parameters: dict[str, Any],
    timeout: int = 900,
    kernel_name: str = "python3",
    cwd: str | os.PathLike | None = None,
) -> pathlib.Path:
    """Run a notebook top to bottom with `parameters` injected; write `.ipynb` and HTML; return the HTML path.

    `path`: a jupytext ``.py`` script or an ``.ipynb`` (``read_notebook``).
    `timeout`: seconds per cell (nbclient). `cwd`: the kernel's working directory (default: the
    notebook's folder). The report's title is ``notebook_title`` (else the file name). The
    executed notebook is written beside the HTML (same stem, .ipynb),
    both atomically (ValueError if that .ipynb is the source notebook). If a cell fails, the executed-so-far notebook is still written, no HTML is
    written, and nbclient's CellExecutionError (naming the cell and the error) is raised.
    """
    from nbclient import NotebookClient

    src, out_html = pathlib.Path(path), pathlib.Path(out_html)
    nb = read_notebook(src)
    inject_parameters(nb, parameters)
    out_html.parent.mkdir(parents=True, exist_ok=True)
    out_nb = out_html.with_suffix(".ipynb")
    if out_nb.resolve() == src.resolve():
        raise ValueError(f"out_html {out_html} would overwrite the source notebook {src} with its executed copy")
    labkit_root = str(pathlib.Path(__file__).resolve().parent.parent)
    env = dict(os.environ, IPP_NONINTERACTIVE="1",
               PYTHONPATH=os.pathsep.join(p for p in (labkit_root, os.environ.get("PYTHONPATH")) if p))
    run_dir = str(pathlib.Path(cwd) if cwd is not None else src.resolve().parent)
    sockets = tempfile.mkdtemp(prefix="labkit-kernel-")  # 0700: the kernel's IPC sockets, this user's only
    prefix = os.path.join(sockets, "k")
    config = kernel_over_ipc(prefix) if len(os.fsencode(prefix)) <= UNIX_PATH_MAX - 4 else None  # "-<port>"
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name, resources={"metadata": {"path": run_dir}},
                            **({"config": config} if config is not None else {}))
    try:
        client.execute(env=env, cwd=run_dir)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
        atomic_write_text(out_nb, nbformat.writes(nb))
    title = notebook_title(nb) or src.stem
    body, _ = offline_exporter().from_notebook_node(nb, resources={"metadata": {"name": title}})
    atomic_write_text(out_html, body)
    return out_html


_PRELOAD = ["labkit.report", "jupyter_client", "nbclient", "nbconvert", "jupytext"]
"""What the process each notebook of ``execute_notebooks`` runs in has imported before it starts:
it is forked from a ``multiprocessing`` forkserver that imported these once (a fresh interpreter
per notebook spent about 3 CPU-s importing them, every time). ``labkit.report`` first: it imports
nbformat without jsonschema's IRI checker (``labkit._nbformat``) before the others import it."""


def _execute_child(src: str, out: str, parameters: dict, cwd: str, timeout: int, env: dict, log: str,
                   nice: int = 0) -> None:
    """In a notebook's own process (``execute_notebooks``): the caller's environment, this
    process's stdout and stderr (and so the kernel's) into ``log``, ``nice`` added to its
    niceness (the kernel's too), then ``execute_notebook``."""
    if nice:
        os.nice(nice)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        execute_notebook(src, out, parameters=parameters, timeout=timeout, cwd=cwd)
    except BaseException:
        import traceback

        traceback.print_exc()
        raise SystemExit(1) from None


def execute_notebooks(lanes: list[list[tuple]], *, jobs: int = 2, cwd: str | os.PathLike, timeout: int = 900,
                      after: dict | None = None, done=None, nice: int = 0) -> None:
    """Execute notebooks, each in a process of its own (``execute_notebook``; forked from a
    ``multiprocessing`` forkserver that imported ``_PRELOAD`` once, with this process's
    environment): the notebooks of a lane one after another, up to ``jobs`` lanes at once.
    ``lanes``: lists of (source, out_html, parameters); ``cwd``: the kernels' working directory;
    ``timeout``: seconds per cell; ``after``: {source stem: concurrent.futures.Future} -- that
    notebook starts once its future is done (its exception fails the notebook's lane);
    ``done(stem, seconds)`` is called as each notebook finishes; ``nice``: added to the niceness of
    each notebook's process and kernel (``os.nice``; 0 leaves it).

    On a failure, or Ctrl-C here, no other notebook starts, and those still running after 5 s are
    interrupted (SIGINT: nbclient then shuts their kernels down; killed after 30 more s). Raises RuntimeError
    naming the first notebook that failed, with the end of its output (nbclient's
    CellExecutionError names the cell and the exception)."""
    import multiprocessing
    import signal
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor, wait

    after = after or {}
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    procs: list = []
    stopping = threading.Event()
    logs = tempfile.mkdtemp(prefix="labkit-notebooks-")  # 0700: each notebook's output, read on failure

    def run(lane: list[tuple]) -> None:
        for src, out, parameters in lane:
            name = pathlib.Path(src).stem
            while name in after and not stopping.is_set() and not wait([after[name]], timeout=0.5).done:
                pass
            if stopping.is_set():
                return
            if name in after:
                after[name].result()  # its exception fails this lane
            start = time.perf_counter()
            log = os.path.join(logs, f"{name}.log")
            proc = ctx.Process(target=_execute_child, args=(str(src), str(out), parameters, str(cwd), timeout,
                                                            dict(os.environ), log, nice), name=f"labkit-notebook-{name}")
            proc.start()
            procs.append(proc)
            proc.join()
            if proc.exitcode:
                stopping.set()
                output = pathlib.Path(log).read_text(errors="replace") if os.path.exists(log) else ""
                raise RuntimeError(f"notebook {name} failed (exit {proc.exitcode}):\n"
                                   + "\n".join(output.strip().splitlines()[-25:]))
            if done is not None:
                done(name, time.perf_counter() - start)

    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        for future in [pool.submit(run, lane) for lane in lanes]:
            future.result()
    finally:
        stopping.set()
        end = time.monotonic() + 5  # Ctrl-C in a terminal reached them too: let them stop their kernels first
        for proc in procs:
            proc.join(timeout=max(0.0, end - time.monotonic()))
        for proc in procs:
            if proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGINT)
        for proc in procs:
            proc.join(timeout=30)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(logs, ignore_errors=True)


UNIX_PATH_MAX = 107
"""Longest path of a Unix-domain socket (sockaddr_un.sun_path is 108 bytes on Linux, NUL included):
under a longer ``$TMPDIR`` the kernel runs over TCP as before."""


def kernel_over_ipc(prefix: str):
    """traitlets Config for a kernel on this machine talking over Unix-domain sockets
    ``<prefix>-<port>`` instead of TCP on 127.0.0.1 (jupyter_client's ``KernelManager.transport``
    "ipc"): nothing listens on a port, and ipykernel has no reason to print its "Kernel is running
    over TCP without encryption" warning. `prefix` must lie in a directory only this user can
    enter (``execute_notebook`` uses a fresh ``tempfile.mkdtemp``)."""
    from traitlets.config import Config

    return Config({"KernelManager": {"transport": "ipc", "ip": prefix}})


def notebook_title(nb: nbformat.NotebookNode) -> str | None:
    """The notebook's title: ``metadata.title`` if set, else the text of the first level-1
    heading (``# ...``) of its markdown cells, else None. ``execute_notebook`` gives it to the
    exported report's ``<title>`` (nbconvert's default is "Notebook")."""
    if nb.metadata.get("title"):
        return str(nb.metadata["title"])
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return None


_OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def offline_exporter():
    """nbconvert's JupyterLab HTML exporter without the CDN scripts of its template (require.js,
    MathJax, mermaid): a labkit report loads nothing from the network. plotly figures need none of
    them (plotly.js is embedded by ``labkit.plots.setup_notebook_plotting``); the notebooks use
    no LaTeX. Returns an ``nbconvert.HTMLExporter``."""
    import jinja2
    from nbconvert import HTMLExporter

    return HTMLExporter(extra_loaders=[jinja2.DictLoader({"labkit_offline.html.j2": _OFFLINE_TEMPLATE})],
                        template_file="labkit_offline.html.j2")


_EXTERNAL_PLOTLY = re.compile(r"<script[^>]*\bsrc\s*=\s*[\"']?[^\"'>]*plotly[^\"'>]*", re.I)
_EXTERNAL = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//[^\"'>\s]*", re.I)
_PLOTLY_JS = re.compile(r"plotly\.js v\d+\.\d+\.\d+")


def check_report(html_path: str | os.PathLike) -> dict:
    """Inspect an exported report for offline viewing.

    Returns {"bytes": file size, "plotly_js_embedded": True if the plotly.js library source is
    inline, "external_plotly_scripts": <script src=...plotly...> tags (must be empty to work
    offline), "figures": number of plotly figure divs, "widgets": number of widget-view+json
    outputs (blank in HTML), "external_resources": script/link/img/iframe tags loading from
    another host (require.js or MathJax from a CDN, say), "ok": embedded, no external resources
    and no widgets}. Raises FileNotFoundError naming a missing file.
    """
    p = pathlib.Path(html_path)
    if not p.is_file():
        raise FileNotFoundError(f"report not found: {p}")
    html = p.read_text(encoding="utf-8", errors="replace")
    external = _EXTERNAL_PLOTLY.findall(html)
    info = {"bytes": p.stat().st_size,
            "plotly_js_embedded": bool(_PLOTLY_JS.search(html)),
            "external_plotly_scripts": external,
            "figures": len(re.findall(r"class=\"plotly-graph-div\"", html)),
            "widgets": html.count("application/vnd.jupyter.widget-view+json"),
            "external_resources": _EXTERNAL.findall(html)}
    info["ok"] = (info["plotly_js_embedded"] and not external and not info["external_resources"]
                  and info["widgets"] == 0)
    return info
