"""The main job: the whole lab end to end on the embedded default (``labkit demo``).

Local ipyparallel engines (2 by default), CPU tensors, gloo, and real input: functions
disassembled from this machine's own ELF executables and shared libraries. Every stage is a
call into ``labkit.lab``; the notebooks make the same calls, and are executed afterwards with
the same work directory so that each renders the demo's artifacts as an HTML report.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from labkit.io import atomic_write_json
from labkit.config import DemoConfig, TrainConfig, to_dict

__all__ = ["NOTEBOOKS", "demo_train_config", "notebooks_dir", "run_demo", "run_reports"]

NOTEBOOKS: tuple[str, ...] = ("00_cluster", "01_prepare", "02_stage_and_load", "03_train", "04_scaling",
                              "05_scaling_laws", "06_model_parallel", "07_critical_batch")
"""The notebooks the demo executes and exports, in order."""


def notebooks_dir() -> Path:
    """The repository's ``notebooks/`` folder (labkit is installed in editable mode from it)."""
    return Path(__file__).resolve().parent.parent / "notebooks"


def demo_train_config(cfg: DemoConfig, workdir: Path, *, run: str = "demo") -> TrainConfig:
    """The TrainConfig of the demo's DDP run: one torch thread per rank (2 engines on 2 cores)."""
    return TrainConfig(
        data_dir=str(workdir / "shards"),
        run_dir=str(workdir / "runs" / run),
        model=cfg.model,
        max_steps=cfg.train_steps,
        num_threads=1,
        resume=False,
        timeout_s=300.0,
        data={"tokenizer_path": str(workdir / "tokenizer" / "tokenizer.json")},  # shards of another one are refused
        batch={"micro_batch_size": cfg.micro_batch_size},
        optim={"lr": 1e-3},
        schedule={"kind": "cosine", "warmup_steps": max(1, cfg.train_steps // 10)},
        measure={"log_every": 1},
        eval={"every": max(1, cfg.train_steps // 6)},  # held-out loss (labkit.train.evaluation) 6 times and at the end
        checkpoint={"every": 0},
    )


def _say(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)


def run_demo(cfg: DemoConfig, *, force: bool = False) -> dict[str, Any]:
    """Run every stage of the lab and return (and write to ``<workdir>/demo.json``) a summary
    of what was measured. Raises whatever a stage raises (each names its problem).

    A second run on the same work directory reuses what the same settings made: each data stage
    whose ``made_by`` record matches (``labkit.lab``), the training run when it finished with
    the same config (``labkit.train.run_config.finished_run``), and sweep points measured with
    the same settings; each reuse is said in one line, with when it was made and, for
    measurements, at what load (``labkit.study.sweeps.reused_note``). A changed setting redoes
    what it shapes. ``force`` redoes everything: every stage, the training run (its directory
    is emptied first) and every sweep point."""
    import shutil

    from labkit import lab
    from labkit.cluster import StepProgress, get_client, start_cluster, stop_cluster
    from labkit.train.run_config import finished_run

    t0 = time.perf_counter()
    missing = [p for p in cfg.corpus.paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"corpus.paths: input path(s) do not exist: {', '.join(missing)}")
    work = Path(cfg.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"config": to_dict(cfg), "workdir": str(work)}

    _say(f"starting a local ipyparallel cluster of {cfg.engines} engines (CPU, gloo)", t0)
    cluster = start_cluster(cfg.engines)
    try:
        client = get_client(cluster)

        _say(f"1/7 corpus: disassembling functions from ELF files under {', '.join(cfg.corpus.paths)}", t0)
        corpus = lab.build_corpus(client, cfg.corpus, str(work), force=force)
        _say(f"    {corpus['functions']:,} functions from {corpus['files_read']:,} files "
             f"({corpus['raw_bytes'] / 1e6:.1f} MB of ELF), skipped {corpus['skipped']}", t0)

        _say("2/7 clean, exact and near dedup (polars, MinHash LSH)", t0)
        drops = lab.clean_corpus(client, cfg.clean, str(work), force=force)
        _say(f"    kept {drops['kept']:,} of {drops['input']:,}; dropped {drops['dropped']}", t0)

        _say(f"3/7 tokenizer ({cfg.tokenizer.kind}, vocabulary of at most {cfg.tokenizer.vocab_size}) and "
             f"shards (seq_len {cfg.shards.seq_len})", t0)
        lab.build_tokenizer(client, cfg.tokenizer, str(work), force=force)
        index = lab.build_shards(client, cfg.shards, str(work), force=force)
        prep = lab.preparation_report(str(work))
        summary["preparation"] = prep
        _say(f"    vocabulary {index['vocab_size']:,} (normalised disassembly has few distinct words; "
             f"the size is a cap); {index['n_tokens']:,} tokens in {index['n_sequences']:,} sequences, "
             f"{index['n_bytes'] / 1e6:.1f} MB of shards ({index['dtype']}); "
             f"function dataset {prep['dataset_bytes'] / 1e6:.1f} MB -> training data "
             f"{prep['training_data_bytes'] / 1e6:.1f} MB ({prep['training_to_dataset_ratio']:.2f}x the function "
             f"dataset; machine code {prep['machine_code_bytes'] / 1e6:.1f} MB, ELF files read "
             f"{prep['raw_bytes'] / 1e6:.1f} MB)", t0)

        _say("4/7 staging shards to node-local disk, one engine per node, checksums verified", t0)
        staged = lab.stage(client, str(work))
        summary["staging"] = staged
        for node, rep in staged.items():
            _say(f"    {node}: {rep['bytes'] / 1e6:.1f} MB in {rep['seconds']:.2f} s -> {rep['path']}", t0)

        tcfg = demo_train_config(cfg, work)
        _say(f"5/7 DDP training: model {cfg.model}, {cfg.engines} ranks x micro-batch {cfg.micro_batch_size}, "
             f"{cfg.train_steps} steps", t0)
        if force:
            shutil.rmtree(tcfg.run_dir, ignore_errors=True)
        result = finished_run(tcfg, say=False)
        if result is not None:
            _say(f"    reusing the finished run in {tcfg.run_dir} (ended {result['provenance'].get('end_time')}, "
                 f"same config and data; --force trains again)", t0)
        else:
            result = lab.train_on_cluster(client, tcfg, staged=staged, live=StepProgress(cfg.train_steps, label="train"))
        summary["train"] = result
        _say(f"    loss {result['initial_loss']:.3f} -> {result['final_loss']:.3f}; held-out loss "
             f"{result['eval_loss']:.3f} (perplexity {result['perplexity']:.1f}); "
             f"{result['tokens_per_s']:,.0f} tokens/s over {result['world_size']} ranks", t0)

        _say(f"6/7 scaling sweep: tokens/s at 1..{cfg.engines} ranks; largest micro-batch under "
             f"{cfg.memory_budget_gib} GiB per rank for {', '.join(cfg.sweep_models)}", t0)
        base = tcfg.replace(max_steps=cfg.sweep_steps, schedule={"warmup_steps": 1}, measure={"timing_warmup_steps": 2})
        ranks = lab.sweep_ranks(client, base, str(work), staged=staged, force=force)
        mb = lab.sweep_micro_batch(client, list(cfg.sweep_models), seq_len=cfg.shards.seq_len,
                                   vocab_size=index["vocab_size"],
                                   budget_bytes=int(cfg.memory_budget_gib * 2**30), workdir=str(work), force=force)
        summary["sweep_ranks"] = ranks.to_dicts()
        summary["sweep_micro_batch"] = mb.to_dicts()
        _say_sweeps(ranks, mb, t0)
    finally:
        stop_cluster(cluster)

    _say("7/7 figures and reports", t0)
    figures = _write_figures(work)
    summary["figures"] = figures
    if cfg.reports:
        summary["reports"] = run_reports(cfg, work, t0=t0)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    out = work / "demo.json"
    atomic_write_json(out, summary)
    _say(f"done in {summary['seconds']} s; summary in {out}", t0)
    for path in summary.get("reports", []):
        print(f"  report: {path}")
    return summary


def _say_sweeps(ranks, mb, t0: float) -> None:
    """The sweeps' lines: one per point, a busy machine's flagged, and a reused point labelled
    with when it was measured (``lab.reused_note`` first, with the load then)."""
    from labkit import lab

    for note in filter(None, (lab.reused_note(ranks), lab.reused_note(mb))):
        _say(f"    {note}", t0)
    for r in ranks.iter_rows(named=True):
        busy = (f" (machine busy: load {r['load_avg_1m']:.1f} on {r['cpu_count']} CPUs, the efficiency is not "
                "a scaling measurement)" if r.get("busy") else "")
        old = f" [reused: measured {r.get('measured_at')}]" if r.get("reused") else ""
        _say(f"    {r['ranks']} rank(s): {r['tokens_per_s']:,.0f} tokens/s, efficiency {r['efficiency']:.2f}"
             f"{busy}{old}", t0)
    for r in mb.iter_rows(named=True):
        old = f" [reused: measured {r.get('measured_at')}]" if r.get("reused") else ""
        _say(f"    {r['model']} ({r['params'] / 1e6:.1f} M params): max micro-batch {r['max_micro_batch']}{old}", t0)


def _write_figures(work: Path) -> list[str]:
    """Standalone HTML figures (plotly.js embedded) of the loss curve and both sweeps."""
    import polars as pl

    from labkit import lab, plots

    out = work / "figures"
    out.mkdir(parents=True, exist_ok=True)
    figs = {
        "loss": plots.loss_figure(lab.read_metrics(str(work / "runs" / "demo"))),
        "throughput_vs_ranks": plots.throughput_figure(pl.read_parquet(work / "sweeps" / "ranks.parquet")),
        "micro_batch_vs_model": plots.microbatch_figure(pl.read_parquet(work / "sweeps" / "microbatch.parquet")),
    }
    paths = []
    for name, fig in figs.items():
        path = out / f"{name}.html"
        fig.write_html(path, include_plotlyjs=True, full_html=True)
        paths.append(str(path))
    return paths


def run_reports(cfg: DemoConfig, work: Path, *, t0: float | None = None) -> list[str]:
    """Execute each notebook headlessly on the demo's work directory and export it as a
    self-contained HTML report under ``<workdir>/reports``; returns the report paths."""
    from labkit.report import declared_parameters, execute_notebook

    t0 = time.perf_counter() if t0 is None else t0
    reports = []
    params = {"workdir": str(work), "engines": cfg.engines, "model": cfg.model,
              "micro_batch_size": cfg.micro_batch_size, "max_functions": cfg.corpus.max_functions,
              "vocab_size": cfg.tokenizer.vocab_size, "seq_len": cfg.shards.seq_len,
              "heldout_fraction": cfg.shards.heldout_fraction,
              # the demo's corpus sources: notebook 01 reuses the demo's artifacts only with the same settings
              "elf_paths": list(cfg.corpus.paths), "text_paths": list(cfg.corpus.text_paths),
              "jsonl_paths": list(cfg.corpus.jsonl_paths), "parquet_paths": list(cfg.corpus.parquet_paths),
              "steps": min(cfg.train_steps, 20), "sweep_steps": cfg.sweep_steps,
              "sweep_models": list(cfg.sweep_models), "memory_budget_gib": cfg.memory_budget_gib}
    for name in NOTEBOOKS:
        src = notebooks_dir() / f"{name}.py"  # the jupytext script is the source
        out = work / "reports" / f"{name}.html"
        _say(f"    executing {src.name}", t0)
        declared = declared_parameters(src)  # each report shows only the parameters its notebook uses
        execute_notebook(str(src), str(out), parameters={k: v for k, v in params.items() if k in declared},
                         timeout=900, cwd=str(work))
        reports.append(str(out))
    return reports

