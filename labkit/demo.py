"""The main job: the whole lab end to end on the embedded default (``labkit demo``).

Local ipyparallel engines (2 by default), CPU tensors, gloo, and real input: functions
disassembled from this machine's own ELF executables and shared libraries. Every stage is a
call into ``labkit.lab`` (and ``labkit.study``); the notebooks make the same calls, and are
executed afterwards with the same work directory so that each renders the demo's artifacts as an
HTML report.

Every measurement a notebook shows is made here first, as a stage, with the notebook's own
parameters (``notebook_parameters``: the notebook's defaults and what the demo passes it): the
timing sweeps one after another with nothing else running (their numbers are times), the loss
sweeps (notebooks 05 and 07) in this process on one thread beside the reports of the other
notebooks (their numbers are losses, which the load does not change). The notebooks then find
each point made with their settings from the same shards and read it back through the same
``made_by`` check (``labkit.study.points``), so they measure nothing again and run two at a time
(``labkit.demo_notebooks.run_reports``). ``demo.json`` records each stage's wall and CPU seconds
and the load at its start (``stages``), and each notebook's seconds to its report
(``report_seconds``).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from labkit.config import DemoConfig, TrainConfig, to_dict
from labkit.demo_notebooks import NOTEBOOKS, notebook_parameters, notebooks_dir, run_reports
from labkit.demo_notebooks import say as _say
from labkit.demo_notebooks import settings as _settings
from labkit.io import atomic_write_json

__all__ = ["NOTEBOOKS", "demo_train_config", "notebook_parameters", "notebooks_dir", "run_demo", "run_reports"]
"""``NOTEBOOKS``, ``notebook_parameters``, ``notebooks_dir`` and ``run_reports`` live in
``labkit.demo_notebooks`` and are re-exported here."""


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


def run_demo(cfg: DemoConfig, *, force: bool = False, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every stage of the lab and return (and write to ``<workdir>/demo.json``) a summary
    of what was measured. Raises whatever a stage raises (each names its problem); FileNotFoundError
    naming missing corpus paths and ValueError naming a workdir it cannot create, before any engine starts.

    A second run on the same work directory reuses what the same settings made: each data stage
    whose ``made_by`` record matches (``labkit.lab``), the training run when it finished with
    the same config (``labkit.train.run_config.finished_run``), and sweep points measured with
    the same settings; each reuse is said in one line, with when it was made and, for
    measurements, at what load (``labkit.study.points.reused_note``). A changed setting redoes
    what it shapes. ``force`` redoes everything: every stage, the training run (its directory
    is emptied first) and every sweep point. ``parameters``: notebook parameters to pass on top of
    the demo's own (``notebook_parameters``; e.g. smaller sweeps in a test), which the stages
    measure with as the notebooks will."""
    from labkit.cluster import get_client, start_cluster, stop_cluster
    from labkit.report import check_parameters

    t0 = time.perf_counter()
    missing = [p for p in cfg.corpus.paths if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"corpus.paths: input path(s) do not exist: {', '.join(missing)}")
    work = Path(cfg.workdir).resolve()
    for name, given in notebook_parameters(cfg, work, None, parameters).items():  # names, types: before any work
        check_parameters(notebooks_dir() / f"{name}.py", given)
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a read-only place, a file in the way: named before any engine starts
        raise ValueError(f"workdir: cannot create {work}: {err.strerror or err}") from None
    summary: dict[str, Any] = {"config": to_dict(cfg), "workdir": str(work)}

    clock = _Clock()
    _say(f"starting a local ipyparallel cluster of {cfg.engines} engines (CPU, gloo)", t0)
    imports = _in_background(_import_stages)  # while the engines start: the stages' modules (torch, polars)
    elf_files = _in_background(_find_elf_files, cfg)  # and the walk over the corpus paths (disk reads when cold)
    cluster = start_cluster(cfg.engines)
    try:
        imports.result()
        client = get_client(cluster)
        clock.mark("engines started")
        index, staged = _data_stages(client, cfg, work, force, summary, t0, elf_files.result())
        clock.mark("1-4 data")
        summary["train"] = _train_stage(client, cfg, work, staged, force, t0)
        clock.mark("5 training")

        nb = notebook_parameters(cfg, work, cluster.cluster_id, parameters)
        summary |= _timing_sweeps(client, work, index, nb, staged, force, t0)
        clock.mark("6 timing sweeps")
        s5, s7 = _settings("05_scaling_laws", nb), _settings("07_critical_batch", nb)
        _say(f"7/8 loss sweeps, in this process beside the reports that do not show them: scaling-law widths "
             f"{s5['law_widths']} ({s5['law_steps']} steps); critical batch at global batches {s7['batch_sizes']} "
             f"({s7['batch_examples']:,} sequences each); branches x{s7['branch_factors']} of one run at steps "
             f"{s7['branch_at']} ({s7['branch_window']:,} sequences each)", t0)
        law_done: Future = Future()  # notebook 05 needs only the first of the two
        loss = _in_background(_loss_sweeps, work, s5, s7, force, t0, law_done)
        _say("8/8 figures and reports", t0)
        summary["figures"] = _write_figures(cfg, work)
        if cfg.reports:  # the notebooks that use engines use these, one notebook at a time
            took: dict[str, float] = {}
            summary["reports"] = run_reports(cfg, work, t0=t0, cluster_id=cluster.cluster_id, parameters=parameters,
                                             after={"05_scaling_laws": law_done, "07_critical_batch": loss},
                                             seconds=took, nice=10)  # the loss sweeps, which 05 and 07 wait for, first
            summary["report_seconds"] = {name: took[name] for name in NOTEBOOKS if name in took}
        summary |= loss.result()
        clock.mark("7-8 loss sweeps beside the figures and reports")
    finally:
        stop_cluster(cluster)
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["stages"] = clock.marks
    cpu = sum(m["cpu_s"] for m in clock.marks)
    load = f"1-minute load {clock.marks[0]['load_avg_1m']} at the start, {os.getloadavg()[0]:.2f} at the end"
    summary["load"] = {"start": clock.marks[0]["load_avg_1m"], "end": round(os.getloadavg()[0], 2),
                       "cpu_count": len(os.sched_getaffinity(0))}
    out = work / "demo.json"
    atomic_write_json(out, summary)
    _say(f"done in {summary['seconds']} s, {cpu:.0f} CPU-s in all its processes ({load}, "
         f"{summary['load']['cpu_count']} CPUs); stages and summary in {out}", t0)
    for path in summary.get("reports", []):
        print(f"  report: {path}")
    return summary


class _Clock:
    """Wall and CPU seconds per stage of the demo: ``mark(name)`` ends a stage. CPU seconds are
    user + system time of this process and every process under it (engines, kernels, the ones
    already ended included: psutil's ``children_*`` times). ``marks``: one dict per stage (stage,
    wall_s, cpu_s, load_avg_1m at its start)."""

    def __init__(self) -> None:
        self.marks: list[dict] = []
        self._t, self._cpu, self._load = time.perf_counter(), self.cpu(), round(os.getloadavg()[0], 2)

    @staticmethod
    def cpu() -> float:
        import contextlib

        import psutil

        me, total = psutil.Process(), 0.0
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
        return total

    def mark(self, name: str) -> None:
        t, cpu = time.perf_counter(), self.cpu()
        self.marks.append({"stage": name, "wall_s": round(t - self._t, 1), "cpu_s": round(cpu - self._cpu, 1),
                           "load_avg_1m": self._load})
        self._t, self._cpu, self._load = t, cpu, round(os.getloadavg()[0], 2)


def _data_stages(client, cfg: DemoConfig, work: Path, force: bool, summary: dict, t0: float,
                 elf_files: tuple[list[str], float]) -> tuple[dict, dict]:
    """Stages 1-4 (corpus, clean and dedup, tokenizer and shards, staging): the shard index and
    the staged copies; the preparation report and staging go into ``summary``. ``elf_files``:
    ``_find_elf_files(cfg)`` (the files, and the seconds the walk took)."""
    from labkit import lab

    files, walked = elf_files
    _say(f"1/8 corpus: {len(files):,} ELF files under {', '.join(cfg.corpus.paths)} (walked in {walked:.1f} s, "
         f"while the engines started); disassembling functions from them"
         + (f", at most {cfg.corpus.max_functions:,}" if cfg.corpus.max_functions is not None else ""), t0)
    corpus = lab.build_corpus(client, cfg.corpus, str(work), force=force, elf_files=files)
    _say(f"    {corpus['functions']:,} functions from {corpus['files_read']:,} files "
         f"({corpus['raw_bytes'] / 1e6:.1f} MB of ELF), skipped {corpus['skipped']}", t0)

    _say("2/8 clean, exact and near dedup (polars, MinHash LSH)", t0)
    drops = lab.clean_corpus(client, cfg.clean, str(work), force=force)
    _say(f"    kept {drops['kept']:,} of {drops['input']:,}; dropped {drops['dropped']}", t0)

    _say(f"3/8 tokenizer ({cfg.tokenizer.kind}, vocabulary of at most {cfg.tokenizer.vocab_size}) and "
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

    _say("4/8 staging shards to node-local disk, one engine per node, checksums verified", t0)
    staged = lab.stage(client, str(work))
    summary["staging"] = staged
    for node, rep in staged.items():
        _say(f"    {node}: {rep['bytes'] / 1e6:.1f} MB in {rep['seconds']:.2f} s -> {rep['path']}", t0)
    return index, staged


def _train_stage(client, cfg: DemoConfig, work: Path, staged: dict, force: bool, t0: float) -> dict:
    """Stage 5: the DDP training run (reused when it finished with the same config and data)."""
    import shutil

    from labkit import lab
    from labkit.cluster import StepProgress
    from labkit.train.run_config import finished_run

    tcfg = demo_train_config(cfg, work)
    _say(f"5/8 DDP training: model {cfg.model}, {cfg.engines} ranks x micro-batch {cfg.micro_batch_size}, "
         f"{cfg.train_steps} steps", t0)
    if force:
        shutil.rmtree(tcfg.run_dir, ignore_errors=True)
    result = finished_run(tcfg, say=False)
    if result is not None:
        _say(f"    reusing the finished run in {tcfg.run_dir} (ended {result['provenance'].get('end_time')}, "
             f"same config and data; --force trains again)", t0)
    else:
        result = lab.train_on_cluster(client, tcfg, staged=staged, live=StepProgress(cfg.train_steps, label="train"))
    _say(f"    loss {result['initial_loss']:.3f} -> {result['final_loss']:.3f}; held-out loss "
         f"{result['eval_loss']:.3f} (perplexity {result['perplexity']:.1f}); "
         f"{result['tokens_per_s']:,.0f} tokens/s over {result['world_size']} ranks", t0)
    return result


def _timing_sweeps(client, work: Path, index: dict, nb: dict, staged: dict, force: bool, t0: float) -> dict:
    """Stage 6: the sweeps of notebooks 04 and 06, with their settings, one after another and
    nothing else running: tokens/s at 1..N ranks, the largest micro-batch under the memory
    budget, tokens/s per model size, DataLoader workers, and every data x tensor x pipeline split."""
    from labkit import lab

    s4, s6 = _settings("04_scaling", nb), _settings("06_model_parallel", nb)
    w = str(work)
    _say(f"6/8 sweeps of notebooks 04 and 06, one at a time, nothing beside them (their quantity is a time): tokens/s at 1..{len(client.ids)} ranks; "
         f"largest micro-batch under {s4['memory_budget_gib']} GiB per rank for {', '.join(s4['sweep_models'])}; "
         f"tokens/s per model size; DataLoader workers {s4['loader_workers']}; each dp x tp x pp split", t0)
    base = lab.sweep_config(w, model=s4["model"], max_steps=s4["sweep_steps"],
                            batch={"micro_batch_size": s4["micro_batch_size"]})
    ranks = lab.sweep_ranks(client, base, w, staged=staged, force=force)
    mb = lab.sweep_micro_batch(client, list(s4["sweep_models"]), seq_len=index["seq_len"],
                               vocab_size=index["vocab_size"], budget_bytes=int(s4["memory_budget_gib"] * 2**30),
                               workdir=w, force=force)
    sizes = lab.sweep_model_size(client, base.replace(max_steps=s4["size_steps"]),
                                 w, models=list(s4["sweep_models"]), staged=staged, force=force)
    loader = lab.sweep_loader_workers(client, w, batch_size=s4["micro_batch_size"],
                                      step_time_s=s4["loader_step_time_s"], workers=s4["loader_workers"],
                                      staged=staged, force=force)
    split = lab.sweep_config(w, model=s6["model"], batch={"micro_batch_size": s6["split_micro_batch_size"]})
    splits = lab.sweep_parallel(client, split, w, micro_batches=s6["micro_batches"], steps=s6["split_steps"],
                                staged=staged, force=force)
    _say_sweeps(ranks, mb, sizes, loader, splits, t0)
    return {"sweep_ranks": ranks.to_dicts(), "sweep_micro_batch": mb.to_dicts(), "sweep_model_size": sizes.to_dicts(),
            "sweep_loader": loader.to_dicts(), "sweep_parallel": splits.to_dicts()}


def _import_stages() -> None:
    """Import what the stages use (``labkit.lab`` with polars, ``labkit.train`` with torch): a few
    CPU-seconds that ``run_demo`` spends while the engines start."""
    import labkit.lab  # noqa: F401
    import labkit.train.run_config  # noqa: F401


def _find_elf_files(cfg: DemoConfig) -> tuple[list[str], float]:
    """The corpus's ELF files (``labkit.data.corpus.find_elf_files``), found while the engines
    start, and the seconds the walk took: on a cold page cache (a fresh machine) it reads the first
    4 bytes of every file under the corpus paths, disk reads rather than CPU
    (``python benchmarks/bench_elf_walk.py``)."""
    from labkit.data.corpus import find_elf_files

    start = time.perf_counter()
    files = [str(p) for p in find_elf_files(cfg.corpus)]
    return files, time.perf_counter() - start


def _in_background(fn, *args) -> Future:
    """``fn(*args)`` in a daemon thread (Ctrl-C ends the demo without waiting for it); its Future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 (handed to whoever waits on the future)
            future.set_exception(err)

    threading.Thread(target=run, name=f"labkit-demo-{fn.__name__}", daemon=True).start()
    return future


def _loss_sweeps(work: Path, s5: dict, s7: dict, force: bool, t0: float, law_done: Future) -> dict:
    """Stage 7: the runs of notebooks 05 (scaling-law widths) and 07 (critical batch: the batch
    sweep, and the branches of one run) with their settings (``s5``, ``s7``: ``_settings``), while
    the reports of the other notebooks run beside them (their quantity is a loss, which the load
    does not change). Two lanes: this thread runs the scaling-law runs, then the branches; a
    process of its own (``_batch_sweep``, spawned) runs the batch sweep beside them, since two runs
    in one process would share torch's default generator (init, dropout). The branches' table
    reads the batch sweep's B_crit once that is done. ``law_done`` is set once the scaling-law
    runs are done (or failed)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from labkit.study.branching import notebook_run, sweep_branch
    from labkit.study.law_runs import sweep_law_runs

    w, start, cpu = str(work), time.perf_counter(), time.thread_time()
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    try:
        batch = pool.submit(_batch_sweep, w, s7, force)
        try:
            law = sweep_law_runs(w, widths=list(s5["law_widths"]), steps=s5["law_steps"],
                                 micro_batch=s5["law_micro_batch"], points=s5["law_points"], force=force)
        except BaseException as err:
            law_done.set_exception(err)
            raise
        law_done.set_result(None)
        _say(f"    scaling-law runs: {law['width'].n_unique()} widths, {law.height} (N, D, held-out loss) points", t0)
        run = notebook_run(w, model=s7["batch_model"], micro_batch=s7["batch_micro_batch"], lr=s7["lr"],
                           steps=s7["branch_steps"])
        points, _ = sweep_branch(run, w, at=list(s7["branch_at"]), factors=list(s7["branch_factors"]),
                                 window=s7["branch_window"], n_boot=300, force=force, wait=batch.result)
        runs, fit, batch_cpu = batch.result()  # the branches' table is read after it: <workdir>/sweeps/critical_batch.parquet
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if "b_crit" in fit:
        _say(f"    critical batch B_crit = {fit['b_crit']:.1f} sequences ({100 * fit['level']:.0f} % bootstrap range "
             f"{fit['b_crit_low']:.1f}-{fit['b_crit_high']:.1f}) at held-out loss {fit['target_eval_loss']:.3f}", t0)
    else:
        _say(f"    critical batch: only {fit['reached']} batch sizes reached held-out loss "
             f"{fit['target_eval_loss']:.3f}, no fit", t0)
    _say(f"    critical batch by branching at steps {s7['branch_at']}: local critical batch "
         f"{', '.join('-' if b is None else f'{b:.0f}' for b in points['b_keep_pace'].to_list())} sequences", t0)
    took = {"wall_s": round(time.perf_counter() - start, 1),
            "cpu_s": round(time.thread_time() - cpu + batch_cpu, 1)}
    _say(f"    loss sweeps done in {took['wall_s']} s ({took['cpu_s']} CPU-s: their thread here and the batch "
         "sweep's process)", t0)
    return {"law_points": law.to_dicts(), "critical_batch": runs.to_dicts(), "critical_batch_fit": fit,
            "branch": points.to_dicts(), "loss_sweeps": took}


def _batch_sweep(w: str, s7: dict, force: bool) -> tuple:
    """Notebook 07's batch sweep with its settings ``s7``, in a process of its own
    (``_loss_sweeps``): (runs, fit, CPU seconds of this process)."""
    from labkit.study.critical_batch import batch_base, sweep_batch

    base = batch_base(w, model=s7["batch_model"], micro_batch=s7["batch_micro_batch"], lr=s7["lr"])
    runs, fit = sweep_batch(base, w, batch_sizes=list(s7["batch_sizes"]), max_examples=s7["batch_examples"],
                            force=force)
    return runs, fit, time.process_time()


def _say_sweeps(ranks, mb, sizes, loader, splits, t0: float) -> None:
    """The sweeps' lines: one per point, a busy machine's flagged, and a reused point labelled
    with when it was measured (``lab.reused_note`` first, with the load then)."""
    from labkit import lab, plots

    for what, df in (("ranks", ranks), ("micro-batch", mb), ("model size", sizes), ("loader workers", loader),
                     ("splits", splits)):
        note = lab.reused_note(df)
        if note:
            _say(f"    {what}: {note}", t0)
    for r in ranks.iter_rows(named=True):
        busy = (f" (machine busy: load {r['load_avg_1m']:.1f} on {r['cpu_count']} CPUs, the efficiency is not "
                "a scaling measurement)" if r.get("busy") else "")
        old = f" [reused: measured {r.get('measured_at')}]" if r.get("reused") else ""
        _say(f"    {r['ranks']} rank(s): {r['tokens_per_s']:,.0f} tokens/s, efficiency {r['efficiency']:.2f}"
             f"{busy}{old}", t0)
    for r in mb.iter_rows(named=True):
        old = f" [reused: measured {r.get('measured_at')}]" if r.get("reused") else ""
        _say(f"    {r['model']} ({r['params'] / 1e6:.1f} M params): max micro-batch {r['max_micro_batch']}{old}", t0)
    _say("    tokens/s per model size at {} ranks: {}".format(
        sizes["ranks"].max(), ", ".join(f"{r['model']} {r['tokens_per_s']:,.0f}" for r in sizes.iter_rows(named=True))), t0)
    knee = loader.filter(loader["knee"])["num_workers"].to_list()
    _say("    DataLoader workers: data-wait fraction {}; knee {}".format(
        ", ".join(f"{r['num_workers']}: {r['data_wait_fraction']:.0%}" for r in loader.iter_rows(named=True)),
        f"at {knee[0]} worker{'' if knee[0] == 1 else 's'}" if knee else "not reached"), t0)
    _say("    splits: " + ", ".join(f"{plots.split_label(r)} {r['tokens_per_s']:,.0f} tokens/s"
                                   for r in splits.iter_rows(named=True)), t0)


def _write_figures(cfg: DemoConfig, work: Path) -> list[str]:
    """Standalone HTML figures (plotly.js embedded) of the loss curve and the two sweeps of the
    summary (the demo's model and micro-batch; its models under its budget), each titled with its
    settings."""
    import polars as pl

    from labkit import lab, plots

    out = work / "figures"
    out.mkdir(parents=True, exist_ok=True)
    ranks = pl.read_parquet(work / "sweeps" / "ranks.parquet").filter(
        (pl.col("model") == cfg.model) & (pl.col("micro_batch_size") == cfg.micro_batch_size))
    mb = pl.read_parquet(work / "sweeps" / "microbatch.parquet").filter(
        pl.col("model").is_in(list(cfg.sweep_models)) & (pl.col("seq_len") == cfg.shards.seq_len)
        & (pl.col("budget_bytes") == int(cfg.memory_budget_gib * 2**30)))
    figs = {
        "loss": plots.loss_figure(lab.read_metrics(str(work / "runs" / "demo")),
                                  title=f"Training loss of {cfg.model}: {cfg.engines} ranks x micro-batch "
                                        f"{cfg.micro_batch_size} of {cfg.shards.seq_len} tokens, {cfg.train_steps} steps"),
        "throughput_vs_ranks": plots.throughput_figure(ranks),
        "micro_batch_vs_model": plots.microbatch_figure(mb),
    }
    paths = []
    for name, fig in figs.items():
        path = out / f"{name}.html"
        fig.write_html(path, include_plotlyjs=True, full_html=True)
        paths.append(str(path))
    return paths


