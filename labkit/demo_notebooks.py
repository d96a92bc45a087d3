"""The demo's notebooks: which it executes, with what parameters, and how, into HTML reports.

``labkit demo`` passes each notebook of ``NOTEBOOKS`` its own settings (``notebook_parameters``)
and measures, as its stages, every sweep a notebook shows with the values the notebook will run
with (``settings``: the notebook's defaults and what the demo passes it), so that the notebooks
find each point made with their settings and read it back (``labkit.study.points``).
``run_reports`` then executes them, two at a time.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from labkit.config import DemoConfig

__all__ = ["NOTEBOOKS", "notebook_parameters", "notebooks_dir", "run_reports", "say", "settings"]


def say(msg: str, t0: float) -> None:
    """One line of the demo's log: seconds since ``t0`` (``time.perf_counter``), then ``msg``."""
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)


NOTEBOOKS: tuple[str, ...] = ("00_cluster", "01_prepare", "02_stage_and_load", "03_train", "04_scaling",
                              "05_scaling_laws", "06_model_parallel", "07_critical_batch")
"""The notebooks the demo executes and exports, in order."""


def notebooks_dir() -> Path:
    """The repository's ``notebooks/`` folder (labkit is installed in editable mode from it)."""
    return Path(__file__).resolve().parent.parent / "notebooks"


def notebook_parameters(cfg: DemoConfig, work: Path, cluster_id: str | None = None,
                        extra: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """{notebook: {parameter: value}}: what the demo passes each notebook of ``NOTEBOOKS`` (its
    work directory, engines -- or the running cluster ``cluster_id`` --, model and data settings,
    the demo's training run for notebook 03 to show, the sweeps' steps, models and budget, and ``extra``),
    restricted to the parameters the notebook declares, so each report shows only the ones it
    uses. Raises ValueError naming a parameter of ``extra`` that no notebook declares."""
    from labkit.report import declared_parameters

    given = {"workdir": str(work), "engines": cfg.engines, "cluster_id": cluster_id, "model": cfg.model,
             "micro_batch_size": cfg.micro_batch_size, "max_functions": cfg.corpus.max_functions,
             "vocab_size": cfg.tokenizer.vocab_size, "seq_len": cfg.shards.seq_len,
             "heldout_fraction": cfg.shards.heldout_fraction,
             # the demo's corpus sources: notebook 01 reuses the demo's artifacts only with the same settings
             "elf_paths": list(cfg.corpus.paths), "text_paths": list(cfg.corpus.text_paths),
             "jsonl_paths": list(cfg.corpus.jsonl_paths), "parquet_paths": list(cfg.corpus.parquet_paths),
             # notebook 03 shows the run the demo's stage 5 has just trained (demo_train_config's run_dir)
             "run": str(work / "runs" / "demo"), "sweep_steps": cfg.sweep_steps,
             "sweep_models": list(cfg.sweep_models), "memory_budget_gib": cfg.memory_budget_gib} | (extra or {})
    out, seen = {}, set()
    for name in NOTEBOOKS:
        declared = declared_parameters(notebooks_dir() / f"{name}.py")
        out[name] = {k: v for k, v in given.items() if k in declared}
        seen |= set(declared)
    unknown = sorted(set(extra or {}) - seen)
    if unknown:
        raise ValueError(f"parameters: no notebook declares {', '.join(unknown)}")
    return out


def settings(name: str, passed: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The values notebook ``name`` will run with: its parameters cell's defaults, overridden by
    what the demo passes it."""
    from labkit.report import parameter_defaults

    return parameter_defaults(notebooks_dir() / f"{name}.py") | passed[name]


def run_reports(cfg: DemoConfig, work: Path, *, t0: float | None = None, cluster_id: str | None = None,
                jobs: int = 2, parameters: dict[str, Any] | None = None,
                after: dict[str, Future] | None = None, seconds: dict[str, float] | None = None,
                nice: int = 0) -> list[str]:
    """Execute each notebook headlessly on the demo's work directory and export it as a
    self-contained HTML report under ``<workdir>/reports``, with the demo's parameters and
    ``parameters`` (``notebook_parameters``); returns the report paths in ``NOTEBOOKS`` order.

    Each notebook runs in a process of its own, up to ``jobs`` at once
    (``labkit.report.execute_notebooks``). With ``cluster_id`` (a running cluster,
    ``labkit.cluster.connect_cluster``) the notebooks that use engines use that cluster's, one
    after another (two notebooks' DDP runs on the same engines would wait for each other), while
    the others run beside them; without it, each notebook starts and stops its own engines. A
    notebook in ``after`` ({name: Future}) starts once its future is done (what it shows is
    measured then). ``seconds``, when given, gets each notebook's wall seconds from its start to
    its exported report ({name: s}). ``nice``: added to each notebook's niceness (``labkit demo``
    passes 10: the loss sweeps that 05 and 07 wait for train beside the notebooks, ahead of them).
    Raises RuntimeError naming the first notebook that failed."""
    from labkit.report import execute_notebooks

    t0 = time.perf_counter() if t0 is None else t0
    params = notebook_parameters(cfg, work, cluster_id, parameters)
    shared = [n for n in _REPORT_ORDER if "cluster_id" in params[n]] if cluster_id else []
    lanes = ([shared] if shared else []) + [[n] for n in _REPORT_ORDER if n not in shared]
    say(f"    executing notebooks {NOTEBOOKS[0]}..{NOTEBOOKS[-1]}, {jobs} at a time"
        + (f" ({', '.join(shared)} on the demo's engines, in turn)" if shared else ""), t0)
    execute_notebooks([[(notebooks_dir() / f"{n}.py", work / "reports" / f"{n}.html", params[n]) for n in lane]
                       for lane in lanes], jobs=jobs, cwd=work, after=after,
                      done=lambda name, took: _done(name, took, seconds, t0), nice=nice)
    return [str(work / "reports" / f"{name}.html") for name in NOTEBOOKS]


def _done(name: str, took: float, seconds: dict | None, t0: float) -> None:
    say(f"    {name}.html ({took:.0f} s)", t0)
    if seconds is not None:
        seconds[name] = round(took, 1)


_REPORT_ORDER = ("00_cluster", "01_prepare", "02_stage_and_load", "03_train", "04_scaling", "06_model_parallel",
                 "05_scaling_laws", "07_critical_batch")
"""The order ``run_reports`` starts the notebooks in: those on the demo's engines (which read
back what the stages measured, 03 the demo's run) in order, then 05 and 07, each once the loss
sweeps it shows are done."""
