"""Regenerate the derived figures in docs/ from the functions and files that produce them.

Each generated block in a Markdown file sits between ``<!-- generated:NAME -->`` and
``<!-- /generated:NAME -->``; this script rewrites the text between the markers and nothing
else. ``python docs/generate.py`` writes the files; ``python docs/generate.py --check`` exits 1
naming each file whose committed text differs from what the script produces
(tests/test_docs_generated.py runs the same check).

Sources: the planner's blocks are deterministic functions of labkit's code; the measured
blocks read the files the measuring command wrote, kept under docs/data/:

- ``docs/data/demo.json``: ``work/demo/demo.json`` written by ``make demo`` (``labkit demo``);
  ``docs/data/loader.jsonl``: ``work/demo/sweeps/loader.parquet`` written by the demo's
  notebook 04 (the loader-worker sweep), as JSON lines. ``python docs/generate.py --import
  work/demo`` copies both from a demo's work directory, then regenerates.
- ``docs/data/forecast_study.json``: the JSON of ``labkit forecast configs/study.toml --gpus
  1,2,4,8,16,32,64,128,256 --json``.
- ``docs/data/forecast_check.jsonl``: the JSON lines printed by ``python benchmarks/forecast_check.py``
  (the forecast of time to a target held-out loss at 1 and 2 ranks against training to it).
- ``docs/data/network.jsonl``: ``<workdir>/sweeps/network.parquet`` written by ``labkit sweep
  network configs/walkthrough.toml --models mini small`` (root; the shaped-link sweep), as JSON lines.
- ``docs/data/compression_learning.jsonl``: the file ``python benchmarks/compression_learning.py
  configs/walkthrough.toml --out docs/data/compression_learning.jsonl`` writes (steps to a held-out
  loss with each gradient compression, on the walkthrough's shards).
- ``docs/data/branch.jsonl`` / ``branch_runs.jsonl``: ``<workdir>/sweeps/branch.parquet`` and
  ``branch_runs.parquet`` (without run_dir) written by ``labkit sweep branch configs/walkthrough.toml
  --at 25 100 300 --repeats 3 --window 2048 --set train.max_steps=400``, as JSON lines
  (``polars.read_parquet(...).write_ndjson(...)``); ``critical_batch_branching.jsonl`` the same work
  directory's ``labkit sweep batch`` table that run read.
- ``docs/data/bench_ramp.jsonl``: the file ``python benchmarks/bench_ramp.py configs/walkthrough.toml
  --out docs/data/bench_ramp.jsonl`` writes (a batch ramp and the noise scale's against fixed
  batches: steps and examples to a held-out loss, on the walkthrough's shards).
- ``docs/data/plan_counted.jsonl``: the JSON lines ``python docs/count_study.py`` writes
  (``plan_model`` of the study's two models on an H100 NVL).
- ``docs/data/bench_model.jsonl`` / ``bench_ddp.jsonl`` / ``bench_stage.jsonl`` / ``bench_parallel.jsonl``:
  the JSON lines printed by ``python benchmarks/bench_model.py`` / ``bench_ddp.py`` / ``bench_stage.py``
  / ``bench_parallel.py`` (one record per line).
- ``docs/data/prep_scale.jsonl``: the output of ``python benchmarks/bench_prep_scale.py``;
  ``prep_scale_default_threads.jsonl`` that of ``BENCH_SIZES=16 BENCH_ONE_CORE_PER_ENGINE=0
  python benchmarks/bench_prep_scale.py``; ``prep_scale_before.jsonl`` that of ``BENCH_SIZES=16
  python benchmarks/bench_prep_scale.py`` at commit 0cdd4a4; the projection is
  ``benchmarks/project_prep.py``'s.

Blocks: ``demo-summary``, ``demo-times`` (README.md); ``demo-load``, ``lesson1-measured``, ``lesson1-planner``, ``parallel-planner``, ``lesson2-measured``,
``lesson3-measured``, ``lesson3-planner``, ``lesson4-measured``, ``lesson4-planner``, ``lesson4-forecast``, ``lesson4-forecast-check``,
``lesson4-network``, ``lesson4-compression-learning``, ``lesson4-branching``, ``lesson4-bench-ramp``,
``lesson5-measured``, ``lesson5-planner`` (docs/results.md), and docs/generate_study.py's
``tokenizer-study``, ``study-run``, ``study-loaders``, ``study-plan``, ``precision-experiment``,
``one-story`` (docs/results.md, from configs/study.toml and the files its scripts write); ``bench-model`` (docs/model.md);
``bench-ddp`` (docs/training.md); ``bench-parallel`` (docs/parallelism.md); ``bench-stage``, ``prep-scale``, ``prep-projection`` (docs/data_path.md);
docs/generate_cli.py's ``cli-options`` (docs/cli.md, from ``labkit.cli.build_parser``).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
sys.path.insert(0, str(ROOT))

SEQ_LEN = 512
MFU = 0.4
NETWORKS = ("25GbE", "100GbE", "IB-HDR", "IB-NDR")
NETWORK_NAMES = {"25GbE": "25 GbE", "100GbE": "100 GbE", "IB-HDR": "IB HDR 200", "IB-NDR": "IB NDR 400"}


def _eff_256(name: str, micro_batch: int, **kw) -> float:
    import polars as pl

    from labkit.study import scaling

    t = scaling.study_scaling(name, micro_batch=micro_batch, seq_len=kw.pop("seq_len", SEQ_LEN), mfu=MFU,
                              sparse_head=False, **kw)
    return t.filter(pl.col("n_gpus") == 256)["efficiency"].item()


def lesson3_planner() -> str:
    """Planned compute per step and the samples/s the loaders must supply, both study models."""
    from labkit.study import plan, scaling

    lines = []
    for name, b in plan.STUDY_MICRO_BATCH.items():
        t = scaling.study_scaling(name, micro_batch=b, seq_len=SEQ_LEN, mfu=MFU, sparse_head=False)
        s = t["compute_s"][0]
        lines.append(f"{name} at micro-batch {b}: {s:.3f} s per step, {b / s:,.0f} sequences/s "
                     f"({b * SEQ_LEN / s / 1e3:,.0f}k tokens/s) per GPU")
    return ("Planner (`scaling.compute_time`, 40 % MFU, seq 512, FLOPs per token with the dense MLM head:\n"
            "6N + 12·L·H·T + 6·V·H, `model.flops_per_token`), one H100 NVL; the loaders must supply\n"
            "each GPU at this rate:\n\n" + "\n".join(f"- {line}" for line in lines) + "\n")


def lesson4_planner() -> str:
    """Efficiency at 128 nodes per network and accumulation, plus the figures the prose quotes."""
    from labkit.study import parallel, plan
    from labkit.model import count_parameters, model_config

    rows = ["| model, micro-batch | grad. accumulation | " + " | ".join(NETWORK_NAMES[n] for n in NETWORKS) + " |",
            "| --- | --- | " + " | ".join("---" for _ in NETWORKS) + " |"]
    for name, b in plan.STUDY_MICRO_BATCH.items():
        for accum in ((1, 4, 16) if name == "bert-120m" else (1, 16)):
            cells = [f"{_eff_256(name, b, network=n, grad_accum=accum):.0%}" for n in NETWORKS]
            rows.append(f"| {name}, {b} | {accum} | " + " | ".join(cells) + " |")
    grad_mb = 4 * count_parameters(model_config("bert-120m", plan.STUDY_VOCAB))["total"] / 1e6
    bf16 = _eff_256("bert-120m", 184, grad_dtype_bytes=2)
    long = _eff_256("bert-350m", 20, seq_len=2048)
    return ("\n".join(rows) + "\n\n"
            f"A 120M step all-reduces {grad_mb:.0f} MB of fp32 gradients. With bf16 gradient compression\n"
            f"(`grad_dtype_bytes=2`) the 120M efficiency on 25 GbE becomes {bf16:.0%}; 350M at seq 2048\n"
            f"gives {long:.0%}.\n").replace("%", " %")


def _demo() -> dict:
    return json.loads((DATA / "demo.json").read_text())


def _load(d: dict) -> str:
    """How busy the machine was during the demo's rank sweep (its rows record the load average)."""
    rows = [r for r in d["sweep_ranks"] if r.get("load_avg_1m") is not None]
    loads = " and ".join(f"{r['load_avg_1m']:.1f}" for r in rows)
    when = f"just before the rank sweep's point{'s' if len(rows) > 1 else ''} at {' and '.join(str(r['ranks']) for r in rows)} ranks"
    if any(r.get("busy") for r in rows):
        return f"the machine was busy, 1-minute load {loads} on {rows[0]['cpu_count']} CPUs {when}, so its rates are contaminated"
    return f"1-minute load {loads} on {rows[0].get('cpu_count', '?')} CPUs {when}" if rows else "load not recorded"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _prep(d: dict) -> dict:
    """The demo's preparation report with today's keys (``labkit.data.prepared``): a demo.json
    written before the report named its sizes per source kind (function_dataset_bytes,
    reduction_percent) reads the same."""
    p = dict(d["preparation"])
    if "dataset_bytes" not in p:
        p["dataset_bytes"] = p["function_dataset_bytes"]
        p["training_to_dataset_ratio"] = round(p["training_data_bytes"] / p["dataset_bytes"], 4)
    return p


def _ratio(r: float) -> str:
    """Lesson 1 as a ratio: "3.9x" the dataset, or "1/80" of it below 1."""
    return f"{r:.2g}x" if r >= 1 else f"1/{1 / r:.0f}"


def demo_summary() -> str:
    """README's paragraph of what the demo measured."""
    d = _demo()
    p, t = _prep(d), d["train"]
    ranks = {r["ranks"]: r for r in d["sweep_ranks"]}
    mb = {r["model"]: r for r in d["sweep_micro_batch"]}
    return (f"On a 2-core VM without a GPU (`make demo`, {d['seconds']:.0f} s for the demo itself; {_load(d)}):\n"
            f"{p['functions']:,} functions disassembled from {p['elf_files_read']}\n"
            f"of this machine's ELF files, {p['documents_kept']:,} kept after cleaning and exact and near dedup,\n"
            f"{p['tokens'] / 1e6:.1f} M training tokens; the training data ({_mb(p['training_data_bytes'])}) is "
            f"{_ratio(p['training_to_dataset_ratio'])} the function dataset\n"
            f"({_mb(p['dataset_bytes'])}; the study's is 1/80: 25 GB from 2 TB; machine code "
            f"{_mb(p['machine_code_bytes'])}, ELF files read {_mb(p['raw_bytes'])}); DDP\n"
            f"training of `{t['model']}` on {t['world_size']} ranks at {t['tokens_per_s']:,.0f} tokens/s with the MLM loss "
            f"falling from {t['initial_loss']:.2f}\n"
            f"to {t['final_loss']:.2f} in {t['steps']} steps and a held-out loss of {t['eval_loss']:.2f} (perplexity "
            f"{t['perplexity']:.1f}); weak-scaling\n"
            f"efficiency {ranks[2]['efficiency']:.2f} from 1 to 2 ranks; largest micro-batch under 2 GiB per rank "
            f"{mb['mini']['max_micro_batch']} for `mini`\n"
            f"({mb['mini']['params'] / 1e6:.1f} M parameters) and {mb['small']['max_micro_batch']} for `small` "
            f"({mb['small']['params'] / 1e6:.1f} M). Generated from `docs/data/demo.json` by\n"
            f"`python docs/generate.py`.\n")


def demo_times() -> str:
    """README's table of where the demo's time went: each stage's wall and CPU seconds and the
    load at its start (demo.json's ``stages``), and each notebook's seconds to its report
    (``report_seconds``; two run at a time, beside the loss sweeps)."""
    d = _demo()
    if "stages" not in d or "report_seconds" not in d:
        return ("`docs/data/demo.json` predates the demo's per-stage and per-notebook times (`labkit demo` now writes\n"
                "them into demo.json as `stages` and `report_seconds`); `make demo`, then `python docs/generate.py\n"
                "--import work/demo`, fills this table.\n")
    load = d.get("load") or {}
    lines = [f"`make demo`'s own {d['seconds']:.0f} s (1-minute load {load.get('start')} at its start, "
             f"{load.get('end')} at its end, on {load.get('cpu_count')} CPUs), by stage:\n", "",
             "| stage | wall s | CPU s (all its processes) | load at its start |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {m['stage']} | {m['wall_s']:.0f} | {m['cpu_s']:.0f} | {m['load_avg_1m']} |" for m in d["stages"]]
    lines += ["", "Each notebook, from its start to its exported report (two at a time, so they overlap):", "",
              "| notebook | s |", "| --- | ---: |"]
    lines += [f"| `{name}` | {sec:.0f} |" for name, sec in d["report_seconds"].items()]
    return "\n".join(lines) + "\n\nGenerated from `docs/data/demo.json` by `python docs/generate.py`.\n"


def demo_load() -> str:
    """docs/results.md's note on when and at what load the demo's numbers were measured (its rank
    sweep's rows record the load just before each point)."""
    d = _demo()
    when = min((r["measured_at"] for r in d["sweep_ranks"] if r.get("measured_at")), default=None)
    return (f"- `demo.json` is `make demo` on a fresh clone{', ' + when[:10] if when else ''}, on a 2-core x86-64 VM "
            f"running nothing else: the demo's own processes loaded it ({_load(d)}), so the machine was not idle\n")


def lesson1_measured() -> str:
    p = _prep(_demo())
    drops = p["dropped"]
    skipped = sum(p["skipped_inputs"].values())
    return ("| quantity | labkit here | study |\n| --- | --- | --- |\n"
            f"| function dataset as first written (corpus Parquet: text + metadata) | {_mb(p['dataset_bytes'])}"
            f" ({p['functions']:,} functions) | 2 TB (unconfirmed) |\n"
            f"| training data (shards, held-out file, index.json) | {_mb(p['training_data_bytes'])}: "
            f"{p['tokens']:,} tokens, vocabulary {p['vocab_size']:,}, uint16 | 25 GB of ids ≈ 12.5 B tokens (derived) |\n"
            f"| training data / function dataset | {_ratio(p['training_to_dataset_ratio'])} | 1/80 (0.0125) |\n"
            f"| context: machine code of the functions / ELF files read | {_mb(p['machine_code_bytes'])} / "
            f"{_mb(p['raw_bytes'])} ({p['elf_files_read']} files, {skipped} without a usable function) | n/a |\n"
            f"| functions kept | {p['documents_kept']:,} of {p['functions']:,} (exact duplicates "
            f"{drops['exact_duplicate']:,}, near duplicates {drops['near_duplicate']:,}, filters "
            f"{sum(v for k, v in drops.items() if not k.endswith('duplicate')):,}); held out "
            f"{p.get('heldout_documents', 0):,} | n/a |\n")


def lesson2_measured() -> str:
    rows = ["| quantity | labkit here | study |", "| --- | --- | --- |"]
    for node, r in _demo()["staging"].items():
        rows.append(f"| staged copy on node `{node}` (bytes, seconds, MB/s) | {_mb(r['bytes'])} in {r['seconds']:.3f} s, "
                    f"{r['mb_per_s']:,.0f} MB/s with sha256 verification (page cache warm) | not reported |")
    return "\n".join(rows) + "\n"


def lesson3_measured() -> str:
    import polars as pl

    path = DATA / "loader.jsonl"
    if not path.exists():
        return "Loader sweep: no `docs/data/loader.jsonl` (the demo's notebook 04 did not write one).\n"
    df = pl.read_ndjson(path).sort("num_workers")
    cells = "; ".join(f"{r['num_workers']} workers: {r['data_wait_fraction']:.1%} wait, {r['samples_per_s']:,.0f} "
                      f"samples/s" for r in df.iter_rows(named=True))
    knee = df.filter(pl.col("knee"))["num_workers"].to_list()
    return (f"| quantity | labkit here | study |\n| --- | --- | --- |\n"
            f"| loader knee (fewest workers under 5 % data wait) | {knee[0] if knee else 'none'} ({cells}) | tuned, "
            f"count not reported |\n").replace("%", " %").replace("  %", " %")


def lesson4_measured() -> str:
    d = _demo()
    r = {x["ranks"]: x for x in d["sweep_ranks"]}
    return ("| quantity | labkit here | study |\n| --- | --- | --- |\n"
            f"| weak-scaling efficiency, 1 → 2 ranks (CPU, gloo, `{r[1]['model']}`, micro-batch {r[1]['micro_batch_size']}, "
            f"seq {d['train']['seq_len']}; {_load(d)}) | {r[2]['efficiency']:.2f} | \"near-linear\" to 256 GPUs |\n"
            f"| tokens/s at 1 and 2 ranks | {r[1]['tokens_per_s']:,.0f} and {r[2]['tokens_per_s']:,.0f} | not reported |\n"
            + _goodput_row(r))


def _goodput_row(r: dict) -> str:
    """Lesson 4's "2x the GPUs" row from the rank sweep's statistical goodput columns
    (``labkit.study.goodput``), or a line saying this demo.json predates them."""
    if r[2].get("goodput_tokens_per_s") is None or r[1].get("goodput_tokens_per_s") is None:
        return ("| 2x the ranks: throughput and learning per second (statistical goodput) | not in this demo.json "
                "(its rank sweep predates the goodput column: `make demo` again, then `python docs/generate.py "
                "--import work/demo`) | not reported |\n")
    a = r[2]["tokens_per_s"] / r[1]["tokens_per_s"]
    b = r[2]["goodput_tokens_per_s"] / r[1]["goodput_tokens_per_s"]
    return (f"| 2x the ranks (global batch {r[1]['global_batch_size']} → {r[2]['global_batch_size']}): throughput and "
            f"learning per second (statistical goodput = throughput x E(B); B_noise = {r[2]['b_noise']:.1f} "
            f"sequences, the {r[2]['b_noise_source']}) | throughput x{a:.2f}, learning per second x{b:.2f} "
            f"(E(B) = {r[2]['statistical_efficiency']:.2f}) | not reported |\n")


def lesson4_forecast() -> str:
    """docs/results.md: ``labkit forecast configs/study.toml --gpus 1,2,...,256 --json`` kept as
    docs/data/forecast_study.json: time and GPU-hours to the target per GPU count, the knee's rule
    and its sentence (``labkit.study.forecast.knee_sentence``), whether the micro-batch fits."""
    from labkit.study.forecast import knee_sentence

    d = json.loads((DATA / "forecast_study.json").read_text())
    rows = [r for r in d["table"] if r["n_gpus"] in (1, 8, 32, 64, 128, 256)]
    out = ["| GPUs | global batch (sequences) | steps | step (s) | hours | GPU-hours | batch / B_crit | E(B) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    out += [f"| {r['n_gpus']} | {r['global_batch']:,} | {r['steps']:,.0f} | {r['step_s']:.2f} | {r['hours']:.2f} | "
            f"{r['gpu_hours']:.1f} | {r['batch_over_b_crit']:.2f} | {r['statistical_efficiency']:.2f} |" for r in rows]
    by = {r["n_gpus"]: r for r in d["table"]}
    (b, k), = d["knee"].items()
    fits = "" if by[1]["fits"] else (f" Micro-batch {b} is over the planner's largest on the {d['inputs']['device']}, "
                                     f"{d['max_micro_batch']} (`labkit plan configs/study.toml`): the forecast marks "
                                     "it, the study ran it.")
    out.append("")
    out.append(f"The rule: {d['rule'].removeprefix('the knee: ')}. {knee_sentence(k, int(b))[0].upper()}"
               f"{knee_sentence(k, int(b))[1:]}. 256 GPUs reach the target in {by[256]['hours']:.2f} h against "
               f"{by[128]['hours']:.2f} h on 128 and {by[64]['hours']:.2f} h on 64, for {by[256]['gpu_hours']:.0f} "
               f"GPU-hours against {by[128]['gpu_hours']:.0f} and {by[64]['gpu_hours']:.0f}.{fits} Assumptions:")
    out += [f"- {a}" for a in d["assumptions"]]
    return "\n".join(out) + "\n"


def lesson4_forecast_check() -> str:
    """docs/results.md: ``python benchmarks/forecast_check.py`` kept as docs/data/forecast_check.jsonl
    (its JSON lines): the forecast of time to a target held-out loss at 1 and 2 ranks from this
    machine's short measurements, beside the time measured by training to that target."""
    recs = _records("forecast_check.jsonl")
    if not recs:
        return "No record yet (`docs/data/forecast_check.jsonl` is missing).\n"
    d = recs[-1]
    out = ["| ranks | global batch | forecast: steps × step = seconds | measured: steps × mean step = seconds | "
           "measured / forecast: steps, step, time |", "| --- | --- | --- | --- | --- |"]
    for n in ("1", "2"):
        r = d["ranks"][n]
        meas = (f"{r['measured_steps']:.1f} × {r['measured_mean_step_s'] * 1e3:.1f} ms = {r['measured_s']:.2f}"
                if r["measured_s"] is not None else f"not reached in {r['max_steps']} steps")
        ratios = (f"{r['steps_ratio']:.2f}, {r['step_s_ratio']:.2f}, **{r['ratio']:.2f}**"
                  if r["ratio"] is not None else "-")
        out.append(f"| {n} | {r['global_batch']} | {r['forecast_steps']:.1f} × {r['forecast_step_s'] * 1e3:.1f} ms = "
                   f"{r['forecast_s']:.2f} | {meas} | {ratios} |")
    verdict = "within" if d["within_goal"] else "outside"
    worst = max(d["ranks"].values(), key=lambda r: abs(math.log(r["ratio"])) if r["ratio"] else math.inf)
    off = ("the steps" if abs(math.log(worst["steps_ratio"])) > abs(math.log(worst["step_s_ratio"]))
           else "the step time") if worst["ratio"] else "the steps (the target was not reached)"
    out.append("")
    out.append(f"Target: held-out loss {d['target_eval_loss']} nats per masked token, `{d['model']}` model, seq "
               f"{d['seq_len']}, {d['micro_batch_per_rank']} sequences per rank (global batch 1× and 2× that), lr "
               f"{d['lr_at_micro_batch']:g} at {d['micro_batch_per_rank']} scaled by √B. Inputs measured here first: "
               f"B_crit = {d['b_crit']:.1f} sequences ({d['b_crit_low']:.1f}..{d['b_crit_high']:.1f}, 90 % bootstrap) "
               f"and S_min = {d['s_min']:.1f} steps from a sweep at batches "
               f"{', '.join(map(str, d['sweep_batches']))} (not the checked ones; fit rms log residual "
               f"{d['fit_rms_log_residual']:.3f}), and the mean step time of a {d['timing_steps']}-step run at each rank "
               f"count (gloo, CPU, one core per rank). The measured times are {verdict} the goal of ±25 % "
               f"(worst {d['value']:.2f}, at {worst['global_batch'] // d['micro_batch_per_rank']} rank(s), where "
               f"the input further off was {off}). Load average (1 min) {d['load_avg_start'][0]:.1f} at the start, "
               f"{d['load_avg'][0]:.1f} at the end, on {d['cpu_count']} cores; whole run {d['wall_s']:.0f} s.")
    return "\n".join(out) + "\n"


def _range(r: dict, key: str) -> str:
    """"12.3 (8.1-20.4)", "at least 128 (...)" when censored, "-" when missing."""
    if r.get(key) is None:
        return "-"
    low, high = r.get(f"{key}_low"), r.get(f"{key}_high")
    text = ("at least " if r.get(f"{key}_censored") else "") + f"{r[key]:.1f}"
    return text + (f" ({low:.1f}-{high:.1f})" if low is not None and high is not None else "")


def lesson4_branching() -> str:
    """docs/results.md: ``labkit sweep branch`` on the walkthrough, its
    <workdir>/sweeps/branch.parquet and branch_runs.parquet kept as docs/data/branch.jsonl and
    branch_runs.jsonl (JSON lines): per branch point the local critical batch, the noise scale the
    branches imply, the run's in-run B_simple and the batch sweep's B_crit, which agree."""
    points, runs = _records("branch.jsonl"), _records("branch_runs.jsonl")
    if not points:
        return "No record yet (`docs/data/branch.jsonl` is missing).\n"
    p0 = points[0]
    out = ["| step | tokens seen | held-out loss | efficiency at " + ", ".join(f"{k}x" for k in p0["factors"][1:])
           + f" | local critical batch (keeps pace within {100 * p0['tolerance']:.0f} %) | B_noise implied by the "
           "branches | in-run B_simple | batch sweep's B_crit |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        eff = []
        for k in p["factors"][1:]:
            e = [r["efficiency"] for r in runs if r["step"] == p["step"] and r["factor"] == k]
            eff.append(f"{e[0]:.2f}" if e and e[0] is not None else "-")
        out.append(f"| {p['step']} | {p['tokens']:,} | {p['loss_start']:.3f} | {', '.join(eff)} | "
                   f"{_range(p, 'b_keep_pace')} | "
                   f"{_range(p, 'b_noise')} | {_range(p, 'b_simple')} | {_range(p, 'b_crit_sweep')} |")
    agree = {key: sum(1 for p in points if p.get(f"{key}_agrees")) for key in ("b_simple", "b_crit_sweep")}
    first, last = points[0], points[-1]
    grows = all(a["b_keep_pace"] < b["b_keep_pace"] for a, b in zip(points, points[1:]))
    trend = (f"The local critical batch {'grows at every point' if grows else 'moves'}, from "
             f"{first['b_keep_pace']:.1f} at {first['tokens']:,} tokens to {last['b_keep_pace']:.1f} at "
             f"{last['tokens']:,}. ")
    out.append("")
    out.append(trend + f"Base run: `configs/walkthrough.toml`'s model at global batch {p0['batch']} (one process, "
               f"{p0['lr_rule']} lr rule), branches at {', '.join(str(k) for k in p0['factors'])} x that batch over "
               f"{p0['window']:,} examples each, {p0['repeats']} window(s) per point (the efficiencies pooled over "
               f"them). Ranges: {100 * p0['level']:.0f} % bootstrap over the held-out sequences and the "
               "windows. The batch sweep's B_crit: "
               + (f"at held-out loss {p0['b_crit_sweep_target']:.3f}" if p0.get("b_crit_sweep") is not None
                  else "none in the work directory")
               + (f" (`labkit sweep batch`: the whole run's, from runs at several batch sizes to that loss)"
                  if p0.get("b_crit_sweep") is not None else "")
               + f". With the noise scale the branches imply, the in-run B_simple agrees at "
               f"{agree['b_simple']} of {len(points)} points and the batch sweep's B_crit at "
               f"{agree['b_crit_sweep']} of {len(points)}:")
    out += [f"- {p['agreement']}" for p in points]
    return "\n".join(out) + "\n"


def _network() -> list[dict]:
    return [json.loads(line) for line in (DATA / "network.jsonl").read_text().splitlines() if line.strip()]


def lesson4_network() -> str:
    """The shaped-link sweep (docs/data/network.jsonl, ``labkit sweep network``'s Parquet as JSON
    lines): measured efficiency against link time / compute, the model beside it; where the
    study's 256-GPU 25 GbE run sits on the same axis per precision and what each compression
    gives there (``scaling.compression_table``, the planner's compute at 40 % MFU); the efficiency
    and bytes of each compression on the shaped link from bench_network --compression
    (docs/data/bench_network.jsonl) when present (its cost in learning: ``lesson4_compression_learning``)."""
    from labkit.study import scaling

    rows = _network()
    out = ["| model | link (measured TCP) | link time / compute | efficiency | exposed comm. | step: measured / model | 1-min load |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["model"], -r["link_mbit"])):
        if r["grad_compression"] != "none":
            continue
        link = (f"unshaped ({r['link_mbit'] / 1e3:.1f} Gbit/s)" if r["rate_mbit"] is None
                else f"{r['rate_mbit']:g} Mbit/s set, {r['link_mbit']:.0f} measured")
        out.append(f"| {r['model']} | {link} | {1 / r['bandwidth_ratio']:.2f} | {r['efficiency']:.2f} | "
                   f"{r['comm_exposed_s']:.2f} s | {r['predicted_ratio']:.2f} | {r['load_avg_1m']:.1f} |")
    ratios = [r["predicted_ratio"] for r in rows]
    from generate_study import _study

    lab, cfg = _study()  # configs/study.toml: the authors' model, batch, cluster
    levers = scaling.compression_table(cfg, micro_batch=lab.train.batch.micro_batch_size, seq_len=lab.shards.seq_len,
                                       device=lab.plan.device, network=lab.plan.network,
                                       gpus_per_node=lab.plan.gpus_per_node, mfu=lab.plan.mfu)
    study = []
    for precision in scaling.STUDY_PRECISIONS:
        t = {r["grad_compression"]: r for r in levers.iter_rows(named=True) if r["precision"] == precision}
        link = scaling.ring_allreduce_time(t["none"]["grad_bytes"], 256, **{k: scaling.NETWORKS["25GbE"][k]
                                                                             for k in ("bandwidth", "latency")})
        study.append(f"| {precision} | {link / t['none']['compute_s']:.2f} | {t['none']['efficiency']:.2f} | "
                     f"{t['bf16']['efficiency']:.2f} | {t['powersgd']['efficiency']:.2f} |")
    text = ("\n".join(out) + "\n\n"
            f"Measured step time over the model's: {min(ratios):.2f} to {max(ratios):.2f} at all {len(rows)} points. "
            "Link time = a step's gradient bytes / the link's measured TCP goodput (at 2 ranks a ring sends one copy "
            "each way); above 1 the link cannot keep up with compute, and no overlap helps.\n\n"
            f"The study's run as configs/study.toml states it (micro-batch {lab.train.batch.micro_batch_size}, seq "
            f"{lab.shards.seq_len}, {lab.plan.mfu:.0%} of each precision's peak) at 256 GPUs on {lab.plan.network}, "
            "on the same axis "
            "(ring: 2(n-1)/n copies), and the planner's efficiency with each gradient compression "
            "(`labkit plan configs/study.toml`; PowerSGD at rank 4):\n\n"
            "| precision | link time / compute | efficiency, fp32 gradients | bf16 compression | PowerSGD |\n"
            "| --- | --- | --- | --- | --- |\n" + "\n".join(study) + "\n")
    bench = DATA / "bench_network.jsonl"
    comp = [json.loads(line) for line in bench.read_text().splitlines() if '"network_compression"' in line] \
        if bench.exists() else []
    if comp:
        c = comp[-1]
        g = c["efficiency_gain"]
        text += (f"\nMeasured on the shaped link (`{c['model']}`, {c['rate_mbit']:g} Mbit/s, {c['rounds']} paired rounds, "
                 f"bench_network --compression): efficiency {c['efficiency']['none']['median']:.2f} with fp32 gradients, "
                 f"{c['efficiency']['bf16']['median']:.2f} with bf16 (x{g['bf16']['median']:.2f}, spread "
                 f"{g['bf16']['min']:.2f}-{g['bf16']['max']:.2f}), {c['efficiency']['powersgd']['median']:.2f} with "
                 f"PowerSGD (x{g['powersgd']['median']:.2f}, spread {g['powersgd']['min']:.2f}-{g['powersgd']['max']:.2f}); "
                 f"bytes per step {c['comm_bytes']['none'] / 1e6:.1f}, {c['comm_bytes']['bf16'] / 1e6:.1f} and "
                 f"{c['comm_bytes']['powersgd'] / 1e6:.1f} MB.\n")
    return text


def _runs_to_target(name: str) -> tuple[list[dict], dict, float] | str:
    """docs/data/<name>, JSON lines of a benchmark that trains runs to a held-out loss: (its run
    records, "record": "run"; its last record, the summary; the summary's target_eval_loss), or the
    "No record yet" line when the file is missing."""
    recs = _records(name)
    if not recs:
        return f"No record yet (`docs/data/{name}` is missing).\n"
    return [r for r in recs if r.get("record") == "run"], recs[-1], recs[-1]["target_eval_loss"]


COMPRESSION_NAMES = {"none": "fp32 (none)", "none-seed2": "fp32, the next seed", "bf16": "bf16",
                     "powersgd-r1": "PowerSGD rank 1", "powersgd-r4": "PowerSGD rank 4"}


def lesson4_compression_learning() -> str:
    """docs/results.md: what each gradient compression costs in learning on real data, from
    docs/data/compression_learning.jsonl (``benchmarks/compression_learning.py``): steps to a
    held-out loss and their ratio to fp32's, the next seed's ratio as the yardstick of noise."""
    got = _runs_to_target("compression_learning.jsonl")
    if isinstance(got, str):
        return got
    runs, d, t = got
    out = [f"| gradients | bytes per step | steps to held-out loss {t:.3f} | × fp32's | best held-out loss in "
           f"{d['steps']} steps |", "| --- | --- | --- | --- | --- |"]
    for r in runs:
        s = r["steps_to_target"]
        out.append(f"| {COMPRESSION_NAMES.get(r['name'], r['name'])} | {r['comm_bytes_per_step'] / 1e6:.2f} MB | "
                   + (f"{s:.1f} | {r['ratio_to_none']:.2f}" if s is not None else "not reached | -")
                   + f" | {r['best_eval_loss']:.3f} |")
    by = {r["name"]: r for r in runs}
    noise = abs(math.log(by["none-seed2"]["ratio_to_none"])) if by.get("none-seed2", {}).get("ratio_to_none") else None
    verdicts = []
    for name in ("bf16", "powersgd-r4", "powersgd-r1"):
        r = by.get(name)
        if r is None:
            continue
        if r["ratio_to_none"] is None:
            verdicts.append(f"{COMPRESSION_NAMES[name]} did not reach it")
        elif noise is not None and abs(math.log(r["ratio_to_none"])) <= noise:
            verdicts.append(f"{COMPRESSION_NAMES[name]} is within that (x{r['ratio_to_none']:.2f})")
        else:
            last = r["steps_to_target"] >= r["curve"][-1][0]  # the target is its best, at its last evaluation
            verdicts.append(f"{COMPRESSION_NAMES[name]} needs x{r['ratio_to_none']:.2f} the steps"
                            + (" (the target is its own best held-out loss, reached only at its last evaluation as"
                               " the learning rate decayed to its floor)" if last else ""))
    out.append("")
    out.append(f"`{d['model']}` model on `{d['config']}`'s shards ({d['sequences']:,} sequences of {d['seq_len']} "
               f"tokens, vocabulary {d['vocab_size']:,}), {d['ranks']} gloo ranks × micro-batch "
               f"{d['micro_batch_per_rank']} (global batch {d['global_batch']}), lr {d['lr']:g} with {d['warmup_steps']} "
               f"warm-up steps and a {d['schedule']} decay over {d['steps']} steps, the same seed, data order and "
               f"schedule for every run; held-out loss every {d['eval_every']} steps, steps to the target interpolated "
               f"between evaluations; PowerSGD all-reduces fp32 for its first {d['powersgd_start_iter']} steps, then "
               f"compresses with error feedback. Target: the worst run's best held-out loss"
               f"{'' if d['target_rule'] != 'given' else ' (given)'}. "
               + (f"The next seed alone moves the steps by x{by['none-seed2']['ratio_to_none']:.2f}; " if noise is not None
                  else "") + "; ".join(verdicts) + ".")
    return "\n".join(out) + "\n"


def lesson4_bench_ramp() -> str:
    """docs/results.md: a batch ramp and the noise scale's growing batch against fixed batches, from
    docs/data/bench_ramp.jsonl (``benchmarks/bench_ramp.py``): steps and examples to a held-out loss,
    and the steps saved against the fixed batch that uses the same examples (issue 36's goal: 25 %)."""
    got = _runs_to_target("bench_ramp.jsonl")
    if isinstance(got, str):
        return got
    runs, d, t = got
    out = [f"| run | global batch | steps to held-out loss {t:.3f} | examples to it | steps saved at the same "
           "examples | best held-out loss (steps run) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        s, e = r["steps_to_target"], r["examples_to_target"]
        batch = str(r["start_batch"]) if r["schedule"] == "fixed" else " → ".join(
            str(c["global_batch_size"]) + (f" (after {c['step']})" if c["step"] else "") for c in r["changes"])
        saved = "-"
        if r.get("steps_saved") is not None:
            against = (f"fixed {r['matched_fixed_batch']}: {r['matched_fixed_steps']:.1f} steps, "
                       f"{r['matched_fixed_examples']:,.0f} examples, x{e / r['matched_fixed_examples']:.2f} of them"
                       if r["compared_with"] == "measured" else
                       f"the fit's batch {r['fit_batch_same_examples']:.1f}: {r['fit_steps_same_examples']:.1f} steps")
            saved = f"{100 * r['steps_saved']:.0f} % (against {against})"
        out.append(f"| {r['name']} | {batch} | " + (f"{s:.1f} | {e:,.0f}" if s is not None else "not reached | -")
                   + f" | {saved} | {r['best_eval_loss']:.3f} ({r['curve'][-1][0]}) |")
    fit = d.get("fit") or {}
    met = [r["name"] for r in runs if r.get("goal_met")]
    out.append("")
    out.append(f"`{d['model']}` model on `{d['config']}`'s shards ({d['sequences']:,} sequences of {d['seq_len']} "
               f"tokens), {d['ranks']} gloo ranks × micro-batch {d['micro_batch_per_rank']}; the fixed runs as `labkit "
               f"sweep batch` makes them ({d['examples']:,} examples each, lr {d['lr']:g} at batch {d['start_batch']} "
               f"scaled by the {d['lr_rule']} rule); the ramp runs start at {d['start_batch']} on that batch's "
               f"{d['schedule']} schedule ({d['examples'] // d['start_batch']} steps), lr by the same rule at each "
               f"change, and stop after {d['stop_factor']:g} x the steps the fixed {d['start_batch']} run took to the target; held-out "
               f"loss every {d['eval_examples']} examples. Target: the worst fixed run's best held-out loss"
               f"{'' if d['target_rule'] != 'given' else ' (given)'}. "
               + (f"The fixed runs fit B_crit = {fit['b_crit']:.1f}, S_min = {fit['s_min']:.1f}, E_min = "
                  f"{fit['e_min']:.0f} (S(B) = S_min(1 + B_crit/B)), which gives the fixed batch with a ramp's "
                  "examples where no measured run is within 10 % of them. " if fit.get("b_crit") else "")
               + ("Goal (25 % fewer steps at the same examples) met by " + ", ".join(met) if met
                  else "Goal (25 % fewer steps at the same examples) not met") + ".")
    return "\n".join(out) + "\n"


def lesson5_measured() -> str:
    rows = ["| model | labkit here: max micro-batch under 2 GiB per rank (CPU, fp32, seq 128, counted) |", "| --- | --- |"]
    demo_rows = _demo()["sweep_micro_batch"]
    for r in demo_rows:
        transient = f", transients {_mb(r['transient_bytes'])} at the answer" if r.get("transient_bytes") else ""
        rows.append(f"| `{r['model']}` ({r['params'] / 1e6:.1f} M parameters) | {r['max_micro_batch']} (state "
                    f"{_mb(r['state_bytes'])}, {_mb(r['act_bytes_per_sample'])} of saved activations per sequence"
                    f"{transient}) |")
    if demo_rows and not any(r.get("transient_bytes") for r in demo_rows):
        rows.append("\nThis demo ran before `plan_model` counted the step's transients: its rows are state at 16 B per "
                    "parameter plus the saved activations only.")
    return "\n".join(rows) + "\n"


def lesson5_planner() -> str:
    """parallel.study_table rows at seq 512 and every row within 10 % of the study, plus the breakdown."""
    import polars as pl

    from labkit.study import parallel, plan
    from labkit.model import model_config

    t = parallel.study_table()
    shown = t.filter((pl.col("seq_len") == 512) | pl.col("within_10pct")).sort("model", "seq_len", "precision",
                                                                                "attention", "sparse_head")
    counted = {(r["model"], r["seq_len"], r["precision"], r["sparse_head"]): r
               for r in _records("plan_counted.jsonl")}
    rows = ["| model | seq | precision | attention | head | planned max micro-batch (formula) | counted "
            "(`plan_model`) | study |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in shown.iter_rows(named=True):
        planned = f"**{r['planned']}**" if r["within_10pct"] else str(r["planned"])
        c = counted.get((r["model"], r["seq_len"], r["precision"], r["sparse_head"])) if r["attention"] == "flash" \
            else None
        rows.append(f"| {r['model']} | {r['seq_len']} | {r['precision']} | {r['attention']} | "
                    f"{'sparse' if r['sparse_head'] else 'dense'} | {planned} | "
                    f"{c['max_micro_batch'] if c else ''} | {r['study']} |")
    parts = []
    for sparse in (False, True):
        m = plan.memory_plan(model_config("bert-120m", plan.STUDY_VOCAB, sparse_head=sparse), seq_len=512,
                             micro_batch=184, precision="bf16", attention="flash")
        parts.append(f"{'sparse' if sparse else 'dense'} head: model state "
                     f"{(m['params'] + m['grads'] + m['optimizer']) / 1e9:.1f} GB, autocast weight copies "
                     f"{m['autocast_copies'] / 1e9:.1f} GB, activations {m['activations'] / 1e9:.1f} GB, logits "
                     f"{m['logits'] / 1e9:.1f} GB, head backward {m['head_backward'] / 1e9:.1f} GB; "
                     f"{m['total'] / 1e9:.1f} GB in total")
    keys = [(r["planned"], (r["model"], r["seq_len"], r["precision"], r["sparse_head"]))
            for r in shown.iter_rows(named=True) if r["attention"] == "flash"]
    pairs = [(planned, counted[k]["max_micro_batch"]) for planned, k in keys if k in counted]
    note = ("\n\nThe counted column is `labkit.study.memory.plan_model` on labkit's model as CUDA keeps it "
            "(fused attention, 1-byte dropout masks, CUDA's fp32 autocast ops), with the held logits, their "
            "gradient and the other backward temporaries counted; it has no eager rows, as labkit's model always "
            "calls SDPA. Written by `python docs/count_study.py` to docs/data/plan_counted.jsonl "
            f"({len(counted)} settings); the formula's answer equals the count's in "
            f"{sum(a == b for a, b in pairs)} of {len(pairs)}.") if counted else ""
    return ("\n".join(rows) + note + "\n\nBreakdown at bert-120m, micro-batch 184, seq 512, bf16, fused attention "
            "(`plan.memory_plan`):\n\n" + "\n".join(f"- {x}" for x in parts) + "\n")


def lesson1_planner() -> str:
    """laws.check_allocation of the study's two models on its 12.5 B tokens (Chinchilla's law)."""
    from labkit.study import laws

    small, large = (laws.check_allocation(n, 12.5e9) for n in (120e6, 350e6))
    opt = small["optimal"]
    return (f"Planner: at 20 tokens per parameter the study's 12.5 B tokens suit a model of about "
            f"{12.5e9 / 20 / 1e6:.0f}M\nparameters. Under Chinchilla's constants (decoders on web text, "
            f"`laws.check_allocation`), the\n120M model on 12.5 B tokens is \"{small['verdict'][6:]}\": it gives up "
            f"{small['loss_given_up']:.3f} nats against the\ncompute-optimal {opt['n_params'] / 1e6:.0f}M / "
            f"{opt['n_tokens'] / 1e9:.1f} B split of the same {opt['flops']:.0e} FLOPs. The 350M model on 12.5 B "
            f"tokens is\nwithin {max(large['loss_given_up'], 0.001):.3f} nats of optimal. MLM on code needs its own "
            f"constants (notebook 05).\n")


def parallel_planner() -> str:
    """parallel.parallel_plans / first_fit for the 22 B encoder of notebook 04 on 16 H100 NVL."""
    import polars as pl

    from labkit.study import parallel, plan
    from labkit.model import count_parameters, model_config

    big = model_config("bert-1.3b", plan.STUDY_VOCAB, hidden_size=6144, num_heads=48, num_layers=48,
                       intermediate_size=None)
    splits = parallel.parallel_plans(big, n_gpus=16, seq_len=512, micro_batch=4, sequence_parallel=True)
    ddp = splits.filter((pl.col("dp") == 16) & (pl.col("zero_stage") == 0)).row(0, named=True)
    fit = parallel.first_fit(splits)
    no_zero = parallel.first_fit(splits.filter(pl.col("zero_stage") == 0))
    return (f"`parallel.parallel_plans` / `parallel.first_fit`, for a {count_parameters(big)['total'] / 1e9:.1f} B-parameter "
            f"encoder (48 layers, width\n6144) on 16 H100 NVL at micro-batch 4, seq 512:\n\n"
            f"- plain DDP needs {ddp['total'] / 1e9:.0f} GB per GPU;\n"
            f"- the first split that fits is ZeRO-{fit['zero_stage']} at DP {fit['dp']} x TP {fit['tp']} x PP {fit['pp']} "
            f"({fit['total'] / 1e9:.0f} GB per GPU);\n"
            f"- without ZeRO, the first is DP {no_zero['dp']} × TP {no_zero['tp']} × PP {no_zero['pp']} "
            f"({no_zero['total'] / 1e9:.0f} GB per GPU with sequence parallelism, GPipe bubble {no_zero['bubble']:.0%} at 8\n  micro-batches).\n"
            ).replace("%", " %")


def _records(name: str) -> list[dict]:
    path = DATA / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def bench_model() -> str:
    recs = [r for r in _records("bench_model.jsonl") if r.get("benchmark") == "model" and "preset" in r]
    if not recs:
        return "No record yet (`docs/data/bench_model.jsonl` is empty).\n"
    paths = sorted({k for r in recs for k in r["paths"]}, key=["dense", "sparse", "dense_compiled",
                                                                 "sparse_compiled"].index)
    rows = ["| preset | seq x batch | best path / HF sdpa (paired spread min-max) | " + " | ".join(paths)
            + " | losses within | load avg |", "| --- | --- | --- | " + " | ".join("---" for _ in paths) + " | --- | --- |"]
    for r in recs:
        s = r["ratio_paired_spread"]
        cells = []
        for k in paths:
            c = r["paths"].get(k)
            cells.append("" if c is None else f"{c['ratio']}" + (f" (compile {r['compile_s'][k]} s)" if k in r.get(
                "compile_s", {}) else ""))
        rows.append(f"| {r['preset']} | {r['seq_len']} x {r['batch_size']} | {r['best_path']} {r['ratio']} "
                    f"({s['min']}-{s['max']}) | " + " | ".join(cells)
                    + f" | {r['loss_max_rel_diff']:.1e} | {r['load_avg_1m']} |")
    summary = [r for r in _records("bench_model.jsonl") if r.get("setting") == "all"]
    tail = ""
    if summary:
        t = summary[-1]
        tail = (f"\nSmallest best-path ratio over the settings: {t['ratio']} (goal {t['goal']}, met: {t['met']}); "
                f"compiled paths measured: {t['compiled']}; load average at the end {t['load_avg_1m']}.\n")
    return "\n".join(rows) + "\n" + tail + "\nRecords:\n\n" + "".join(
        f"    {json.dumps(r)}\n" for r in _records("bench_model.jsonl"))


def bench_stage() -> str:
    recs = [r for r in _records("bench_stage.jsonl") if r.get("benchmark") == "stage" and r.get("set") != "all"]
    if not recs:
        return "No record yet (`docs/data/bench_stage.jsonl` is empty).\n"
    rows = ["| set | files | MB | labkit MB/s | cp -r + sha256sum MB/s | ratio (paired spread min-max) | "
            "file create, us | load avg |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in recs:
        s = r["ratio_paired_spread"]
        rows.append(f"| {r['set']} | {r['n_files']:,} | {r['bytes'] / 1e6:.1f} | {r['value']:.0f} | "
                    f"{r['baseline_value']:.0f} | {r['ratio']} ({s['min']}-{s['max']}) | {r['create_us_per_file']} | "
                    f"{r['load_avg_1m']} |")
    return "\n".join(rows) + "\n\nRecords:\n\n" + "".join(f"    {json.dumps(r)}\n" for r in _records("bench_stage.jsonl"))


def bench_ddp() -> str:
    recs = [r for r in _records("bench_ddp.jsonl") if r.get("benchmark") == "ddp"]
    if not recs:
        return "No record yet (`docs/data/bench_ddp.jsonl` is empty).\n"
    rows = []
    for r in recs:
        s = r["efficiency_spread"]
        line = (f"- `{r['model']}`, seq {r['seq_len']}, micro-batch {r['micro_batch_per_rank']} per rank, "
                f"{r['rounds']} paired rounds, load average {r['load_avg_1m']:.1f}: efficiency {r['value']:.3f} "
                f"(per-round min {s['min']:.3f}, median {s['median']:.3f}, max {s['max']:.3f}); 1 rank "
                f"{r['tokens_per_s_1rank']:,.0f} tokens/s, 2 ranks {r['tokens_per_s_2ranks']:,.0f}.")
        if "comm_exposed_s" in r:
            parts = r["step_loss_parts_s"]
            line += (f" Bucket {r['bucket_cap_mb']:g} MiB: exposed communication {r['comm_exposed_s'] * 1e3:.0f} ms "
                     f"({100 * r['comm_exposed_fraction']:.1f} % of the 2-rank step); step {r['step_time_s_1rank']:.3f} s "
                     f"-> {r['step_time_s_2ranks']:.3f} s = training-thread CPU {parts['compute_s']:+.3f} s "
                     f"(x{r['compute_slowdown']:.3f}) + exposed {parts['exposed_s']:.3f} s + rest {parts['rest_s']:+.3f} s; "
                     f"gloo's threads {r['other_threads_cpu_s_2ranks']:.3f} CPU s per step.")
        rows.append(line)
        for b in r.get("bucket_sweep", []):
            rows.append(f"  - bucket {b['bucket_cap_mb']:g} MiB: 2 ranks {b['tokens_per_s_2ranks']:,.0f} tokens/s, "
                        f"exposed {b['comm_exposed_s'] * 1e3:.0f} ms ({100 * b['comm_exposed_fraction']:.1f} %), "
                        f"{b['rounds']} runs, load average {b['load_avg_1m']:.1f}")
    return "\n".join(rows) + "\n\nRecords:\n\n" + "".join(f"    {json.dumps(r)}\n" for r in recs)


def bench_parallel() -> str:
    """docs/parallelism.md: the JSON lines of ``python benchmarks/bench_parallel.py``."""
    recs = _records("bench_parallel.jsonl")
    summaries = [r for r in recs if r.get("benchmark") == "parallel"]
    if not summaries:
        return "No record yet (`docs/data/bench_parallel.jsonl` is empty).\n"
    s = summaries[-1]
    points = [r for r in recs if str(r.get("point", "")).startswith("pp2-")]
    rows = ["| schedule | micro-batches | tokens/s | bubble measured (median) | planned | difference |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    rows += [f"| {r['schedule']} | {r['micro_batches']} | {r['tokens_per_s']:,.0f} | {r['bubble_measured']:.3f} | "
             f"{r['bubble_planned']:.3f} | {r['abs_error']:.3f} |" for r in points]
    load = f"load average {s['load_before']['load_avg_1m']:.1f} before, {s['load_after']['load_avg_1m']:.1f} after, " \
           f"{s['load_before']['cpu_count']} CPUs"
    goal = "met" if s["met"] else "not met"
    return ("\n".join(rows) + f"\n\nBubble goal (GPipe, every m within {s['goal']}): {goal}, largest difference "
            f"{s['value']:.3f} (1F1B {s['max_abs_error_1f1b']:.3f}); {load}. Memory at tp 2, planned / measured "
            f"(largest rank): {s['memory_planned_over_measured_tp2_sp']:.3f} with sequence parallelism (goal within "
            f"{s['memory_goal']:.0%}: {'met' if s['memory_met'] else 'not met'}), "
            f"{s['memory_planned_over_measured_tp2_no_sp']:.3f} without.\n").replace("%", " %")


def _prep_runs(name: str) -> tuple[dict[tuple[int, int], dict], dict]:
    recs = _records(name)
    return {(r["size"], r["engines"]): r for r in recs if "stages" in r}, next(r for r in recs if "goals" in r)


def prep_scale() -> str:
    runs, summary = _prep_runs("prep_scale.jsonl")
    default_runs, default_summary = _prep_runs("prep_scale_default_threads.jsonl")
    before_runs, before = _prep_runs("prep_scale_before.jsonl")
    before_run = before_runs[max(before_runs)]
    keys = sorted(runs)
    big = max(s for s, _ in keys)
    rows = ["| | " + " | ".join(f"{s}x, {e} engine{'s' if e > 1 else ''}" for s, e in keys) + " |",
            "| --- |" + " ---: |" * len(keys)]
    for label, fn in (("documents in", lambda r: f"{r['documents']:,}"),
                      ("real functions", lambda r: f"{r['real_functions']:,}"),
                      ("kept", lambda r: f"{r['kept']:,}"),
                      ("seconds, whole preparation", lambda r: f"{r['seconds']:.1f}"),
                      ("peak RSS per engine (MiB)", lambda r: f"{r['peak_rss_mib_per_engine']:.0f}")):
        rows.append(f"| {label} | " + " | ".join(fn(runs[k]) for k in keys) + " |")
    one, two = runs[(big, 1)]["stages"], runs[(big, 2)]["stages"]
    names = {"extract": "extract", "clean_dedup": "clean and dedup", "tokenizer": "tokenizer",
             "encode_pack": "encode and pack"}
    per_stage = ", ".join(f"{names[k]} {one[k]['seconds']:.1f} / {two[k]['seconds']:.1f}" for k in one)
    sp = summary["speedup_2_engines_per_stage"]
    dsp = default_summary["speedup_2_engines_per_stage"]
    met = summary["met"]
    rss_4, rss_16 = runs[(4, 2)]["peak_rss_mib_per_engine"], runs[(big, 2)]["peak_rss_mib_per_engine"]
    return (
        "\n".join(rows) + "\n\n"
        f"At {big}x, seconds with 1 / 2 engines: {per_stage}. Per engine with 2 engines: "
        f"{two['extract']['docs_per_s_per_engine']:,.0f} functions/s extracted, "
        f"{two['clean_dedup']['docs_per_s_per_engine']:,.0f} documents/s cleaned and deduplicated, "
        f"{two['encode_pack']['docs_per_s_per_engine']:,.0f} documents/s encoded and packed; the tokenizer "
        f"trained on {runs[(big, 2)]['tokenizer_train_docs']:,} documents; engine warm-up "
        f"{runs[(big, 2)]['engine_warmup_s']} s. Load average (1 min) when the run ended: "
        f"{summary['load_average_1min']}. Against the goals:\n\n"
        f"- `cost_ratio_16x_1x` = {summary['cost_ratio_16x_1x']} (goal: at most 1.2): "
        f"{'met' if met['cost_ratio_16x_1x'] else 'not met'}.\n"
        f"- `speedup_2_engines` = {summary['speedup_2_engines']} (goal: at least 1.7): "
        f"{'met' if met['speedup_2_engines'] else 'not met'}. Per stage: "
        + ", ".join(f"{names[k]} {v}" for k, v in sp.items())
        + f"; without the tokenizer {summary['speedup_2_engines_without_tokenizer']}.\n"
        f"- `rss_ratio_16x_4x` = {summary['rss_ratio_16x_4x']} ({rss_16:.0f} / {rss_4:.0f} MiB, 2 engines; goal: at "
        f"most 1.25): {'met' if met['rss_ratio_16x_4x'] else 'not met'}.\n"
        f"- Default thread pools (`docs/data/prep_scale_default_threads.jsonl`): `speedup_2_engines` = "
        f"{default_summary['speedup_2_engines']}; whole preparation {default_runs[(big, 1)]['seconds']:.1f} s with 1 "
        f"engine and {default_runs[(big, 2)]['seconds']:.1f} s with 2 (one core per engine: "
        f"{runs[(big, 1)]['seconds']:.1f} / {runs[(big, 2)]['seconds']:.1f}); per stage "
        + ", ".join(f"{names[k]} {v}" for k, v in dsp.items()) + ".\n"
        f"- Before this round (`docs/data/prep_scale_before.jsonl`: the script at commit 0cdd4a4, "
        f"`BENCH_SIZES=16`, {before_run['documents']:,} documents, default thread pools): `speedup_2_engines` = "
        f"{before['speedup_2_engines']}.\n")


def prep_projection() -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("project_prep", ROOT / "benchmarks" / "project_prep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table, out = module.project(_records("prep_scale.jsonl"))
    return (table + "\n"
            f"Kept documents: {out['study_kept_docs']:,} (12.5 B tokens at the measured {out['tokens_per_kept_doc']} "
            f"tokens per kept document). Partitions: {out['partitions']['exact']} for exact dedup "
            f"({out['docs_per_partition']['exact'] / 1e6:.2f} M documents each) and {out['partitions']['near']} for "
            f"band buckets ({out['docs_per_partition']['near'] / 1e6:.2f} M documents each), each within the 256 MiB "
            f"budgets. One-engine steps that grow with the corpus, estimated, not timed: connected components about "
            f"{out['components_mib_one_engine'] / 1024:.1f} GiB ({out['near_duplicate_share']:.1%} of documents near "
            f"duplicates, 16 B per edge and the Python ids of those documents); the packing plan about "
            f"{out['pack_plan_mib_one_engine'] / 1024:.2f} GiB (lengths, selection and balance columns of the kept "
            "documents).\n").replace("%", " %")


BLOCKS = {("README.md", "demo-summary"): demo_summary,
          ("README.md", "demo-times"): demo_times,
          ("docs/results.md", "demo-load"): demo_load,
          ("docs/results.md", "lesson1-measured"): lesson1_measured,
          ("docs/results.md", "lesson1-planner"): lesson1_planner,
          ("docs/results.md", "parallel-planner"): parallel_planner,
          ("docs/results.md", "lesson2-measured"): lesson2_measured,
          ("docs/results.md", "lesson3-measured"): lesson3_measured,
          ("docs/results.md", "lesson3-planner"): lesson3_planner,
          ("docs/results.md", "lesson4-measured"): lesson4_measured,
          ("docs/results.md", "lesson4-planner"): lesson4_planner,
          ("docs/results.md", "lesson4-forecast"): lesson4_forecast,
          ("docs/results.md", "lesson4-forecast-check"): lesson4_forecast_check,
          ("docs/results.md", "lesson4-network"): lesson4_network,
          ("docs/results.md", "lesson4-branching"): lesson4_branching,
          ("docs/results.md", "lesson4-compression-learning"): lesson4_compression_learning,
          ("docs/results.md", "lesson4-bench-ramp"): lesson4_bench_ramp,
          ("docs/results.md", "lesson5-measured"): lesson5_measured,
          ("docs/results.md", "lesson5-planner"): lesson5_planner,
          ("docs/model.md", "bench-model"): bench_model,
          ("docs/training.md", "bench-ddp"): bench_ddp,
          ("docs/data_path.md", "bench-stage"): bench_stage,
          ("docs/parallelism.md", "bench-parallel"): bench_parallel,
          ("docs/data_path.md", "prep-scale"): prep_scale,
          ("docs/data_path.md", "prep-projection"): prep_projection}


sys.path.insert(0, str(ROOT / "docs"))
import generate_cli  # noqa: E402  (docs/cli.md's option reference, from the parser --help prints)
import generate_study  # noqa: E402  (the study as its authors ran it: configs/study.toml)

BLOCKS.update(generate_study.BLOCKS)
BLOCKS.update(generate_cli.BLOCKS)


def render(text: str, name: str, body: str) -> str:
    """``text`` with the block ``name`` replaced by ``body``; ValueError if its markers are missing."""
    pattern = re.compile(rf"(<!-- generated:{re.escape(name)} -->\n).*?(<!-- /generated:{re.escape(name)} -->)",
                         re.S)
    if not pattern.search(text):
        raise ValueError(f"{name}: markers <!-- generated:{name} --> ... <!-- /generated:{name} --> not found")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text)


def generate() -> dict[str, str]:
    """{relative path: regenerated text} for every file with a generated block."""
    out: dict[str, str] = {}
    for (path, name), fn in BLOCKS.items():
        text = out.get(path) or (ROOT / path).read_text()
        out[path] = render(text, name, fn())
    return out


def import_demo(workdir: str) -> None:
    """Copy one demo run's measurements into docs/data: ``<workdir>/demo.json`` as demo.json and
    ``<workdir>/sweeps/loader.parquet`` as loader.jsonl (one JSON row per line; Parquet, like every
    generated table, stays out of git)."""
    import polars as pl

    work = pathlib.Path(workdir)
    DATA.mkdir(parents=True, exist_ok=True)
    (DATA / "demo.json").write_text((work / "demo.json").read_text())
    loader = work / "sweeps" / "loader.parquet"
    if loader.exists():
        pl.read_parquet(loader).write_ndjson(DATA / "loader.jsonl")


def main(argv: list[str]) -> int:
    if "--import" in argv:  # python docs/generate.py --import work/demo
        import_demo(argv[argv.index("--import") + 1])
    stale = []
    for path, text in generate().items():
        if (ROOT / path).read_text() != text:
            stale.append(path)
            if "--check" not in argv:
                (ROOT / path).write_text(text)
    if "--check" in argv and stale:
        print(f"stale generated docs: {', '.join(stale)} (run python docs/generate.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
