"""Generated blocks of docs/results.md about the study as its authors ran it (configs/study.toml).

Imported by docs/generate.py, which renders them with its other blocks (``BLOCKS``). Sources:

- the planner's blocks (``study-plan``, ``precision-experiment``, ``one-story``) are deterministic
  functions of labkit's code and configs/study.toml;
- ``tokenizer-study``: ``docs/data/tokenizer_study.json``, written by ``python benchmarks/tokenizer_study.py``;
- ``study-plan`` also reads ``docs/data/study_plan_count.json`` (``labkit plan configs/study.toml
  --count --out docs/data/study_plan_count.json``);
- ``study-run``: ``docs/data/study_run.json`` (``python benchmarks/study_run.py``) beside
  ``docs/data/demo.json`` (``make demo``), labkit's defaults;
- ``study-loaders``: ``docs/data/study_loaders.jsonl`` (``python benchmarks/study_loaders.py``).
"""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"


def _json(name: str) -> dict | None:
    path = DATA / name
    return json.loads(path.read_text()) if path.exists() else None


def _study():
    """(LabConfig of configs/study.toml, its ModelConfig at the [plan] vocabulary)."""
    from labkit.config.tomlfile import load
    from labkit.train.run_config import model_config_of

    lab = load(ROOT / "configs" / "study.toml")
    return lab, model_config_of(lab.train, lab.plan.vocab_size)


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _model(lab, cfg, name: str):
    """The preset ``name`` with configs/study.toml's model options, at ``cfg``'s vocabulary."""
    from labkit.model import model_config

    return model_config(name, cfg.vocab_size, **lab.train.model_overrides)


def _planned(lab, cfg, model: str | None = None, precision: str = "fp32") -> dict:
    from labkit.study import plan

    if model is not None:
        cfg = _model(lab, cfg, model)
    return plan.planned_max_micro_batch(cfg, device=lab.plan.device, seq_len=lab.shards.seq_len, precision=precision,
                                        attention="eager", dp=lab.plan.gpus)


def study_plan() -> str:
    """Lesson 5 at the authors' settings: the planned largest micro-batch beside the reported one."""
    from labkit.model import count_parameters
    from labkit.study.plan import STUDY_MICRO_BATCH, memory_plan

    lab, cfg = _study()
    rows = ["| model (configs/study.toml options) | parameters | precision | planned max micro-batch | study |",
            "| --- | --- | --- | --- | --- |"]
    for name in ("bert-120m", "bert-350m"):
        for precision in ("fp32", "bf16"):
            got = _planned(lab, cfg, name, precision)
            params = count_parameters(_model(lab, cfg, name))["total"]
            bold = f"**{got['max_micro_batch']}**" if abs(got["max_micro_batch"] - STUDY_MICRO_BATCH[name]) <= \
                0.1 * STUDY_MICRO_BATCH[name] else str(got["max_micro_batch"])
            rows.append(f"| {name} | {params / 1e6:.1f} M | {precision} | {bold} | {STUDY_MICRO_BATCH[name]} |")
    at = _planned(lab, cfg)
    m = memory_plan(cfg, seq_len=lab.shards.seq_len, micro_batch=lab.train.batch.micro_batch_size, precision="fp32",
                    attention="eager", dp=lab.plan.gpus)
    return ("\n".join(rows) + "\n\n"
            f"At micro-batch {lab.train.batch.micro_batch_size} (the study's 120M run, fp32, vocabulary "
            f"{cfg.vocab_size:,}, `plan.memory_plan`): model state "
            f"{(m['params'] + m['grads'] + m['optimizer']) / 1e9:.1f} GB, activations {m['activations'] / 1e9:.1f} GB "
            f"(of which the kept attention probabilities {_scores(lab, cfg) / 1e9:.1f} GB), logits "
            f"{m['logits'] / 1e9:.1f} GB, head backward {m['head_backward'] / 1e9:.1f} GB; {m['total'] / 1e9:.1f} GB "
            f"against {at['capacity_bytes'] / 1e9:.1f} GB usable. `labkit plan configs/study.toml --device \"H100 NVL\"` "
            "prints the same." + _counted() + "\n")


def _counted() -> str:
    """The count of what the step keeps, from the file ``labkit plan configs/study.toml --count`` wrote."""
    d = _json("study_plan_count.json")
    if d is None:
        return ""
    return (f" Counting what the step keeps instead of summing the formula's terms (`study.memory.plan_model`, "
            f"`labkit plan configs/study.toml --count --out docs/data/study_plan_count.json`): "
            f"{d['max_micro_batch']} for the 120M model in fp32.")


def _scores(lab, cfg) -> int:
    from labkit.study.plan import activation_terms

    return activation_terms(cfg, lab.shards.seq_len, lab.train.batch.micro_batch_size, precision="fp32",
                            attention="eager")["attention_scores"]


def precision_experiment() -> str:
    """Lesson 4 at the authors' settings: planned DP efficiency per precision, 1..256 GPUs."""
    import polars as pl

    from labkit.study import scaling

    lab, cfg = _study()
    t = scaling.precision_experiment(cfg, micro_batch=lab.train.batch.micro_batch_size, seq_len=lab.shards.seq_len,
                                     device=lab.plan.device, network=lab.plan.network,
                                     gpus_per_node=lab.plan.gpus_per_node, mfu=lab.plan.mfu)
    wide = t.pivot(on="precision", index="n_gpus", values="efficiency")
    rows = ["| GPUs | " + " | ".join(scaling.STUDY_PRECISIONS) + " |", "| --- |" + " --- |" * 3]
    for r in wide.filter(pl.col("n_gpus").is_in([1, 2, 4, 16, 64, 128, 256])).iter_rows(named=True):
        rows.append(f"| {r['n_gpus']} | " + " | ".join(_pct(r[p]) for p in scaling.STUDY_PRECISIONS) + " |")
    s = scaling.precision_summary(t, mfu=lab.plan.mfu)
    lines = []
    for r in s.iter_rows(named=True):
        limit = (f"the all-reduce shows from {r['first_exposed_n']} GPUs" if r["first_exposed_n"]
                 else "the all-reduce stays hidden at every size")
        even = ("never hidden (its last bucket is most of it)" if r["break_even_mfu"] is None
                else f"hidden only below {r['break_even_mfu']:.0%} MFU" if r["break_even_mfu"] < 1
                else f"hidden at any MFU (break-even {r['break_even_mfu']:.0%})")
        lines.append(f"- {r['precision']} (peak {r['peak_flops'] / 1e12:g} TFLOP/s): step {r['compute_s']:.2f} s on one "
                     f"GPU; at {r['n_gpus']} GPUs the all-reduce takes {r['comm_s']:.2f} s, {limit}; at "
                     f"{r['n_gpus']} GPUs it is {even}.")
    return ("\n".join(rows) + "\n\n" + "\n".join(lines)).replace("%", " %").replace("  %", " %") + "\n"


def tokenizer_study() -> str:
    d = _json("tokenizer_study.json")
    if d is None:
        return "No record yet (`python benchmarks/tokenizer_study.py` writes `docs/data/tokenizer_study.json`).\n"
    wp, st = (next(r for r in d["rows"] if r["kind"] == k) for k in ("wordpiece", "instruction"))

    spec = [
        ("vocabulary reached (asked)", lambda r: f"{r['vocab_size']:,} ({r['settings']['vocab_size']:,}"
         + (" BPE pieces + the whole pieces seen)" if r["kind"] == "instruction" else " cap)")),
        ("tokens per function: mean / median / 90th percentile", lambda r: f"{r['tokens_per_function']['mean']:.0f} / "
         f"{r['tokens_per_function']['median']:.0f} / {r['tokens_per_function']['p90']:.0f}"),
        ("functions longer than 512 tokens (truncated when padded)", lambda r: _pct(r["tokens_per_function"]["over_512"])),
        ("UNK rate on the held-out functions", lambda r: f"{r['unk_rate']:.2e}" + (
            f" ({', '.join(list(r['unk_examples'])[:3])})" if r["unk_examples"] else "")),
        ("packing efficiency of padded 512-token rows", lambda r: _pct(r["packing"]["efficiency"])),
        (f"held-out MLM loss after {wp['train']['steps']} steps (per masked token; perplexity)",
         lambda r: f"{r['train']['eval_loss']:.2f} ({r['train']['perplexity']:.1f})"),
    ]
    rows = ["| quantity | labkit's WordPiece (defaults) | the study's tokenizer |", "| --- | --- | --- |"]
    rows += [f"| {name} | {fn(wp)} | {fn(st)} |" for name, fn in spec]
    return ("\n".join(rows) + "\n\n"
            f"Same {d['documents']:,} cleaned functions (raw capstone text, `{d['corpus']}`), the tokenizers' "
            f"{wp['held_out_docs']:,} held-out functions for the rates; the same `{d['model']}` model (absolute "
            f"positions), seed, batch {wp['train']['global_batch_size']} and schedule on each tokenizer's padded "
            f"512-token shards. Generated from `docs/data/tokenizer_study.json` (`{d['command']}`; 1-minute load "
            f"{d['load_before'][0]} before, {d['load_after'][0]} after, on 2 CPUs).\n")


def study_run() -> str:
    d, demo = _json("study_run.json"), _json("demo.json")
    if d is None or demo is None:
        return "No record yet (`python benchmarks/study_run.py` writes `docs/data/study_run.json`).\n"
    s, t = d["train"], demo["train"]
    p, q = d["preparation"], demo["preparation"]
    demo_eff = q["tokens"] / (q["sequences"] * q["seq_len"])
    rows = [("functions kept / in the training shards", f"{q['documents_kept']:,}",
             f"{p['documents_kept']:,} / {p['documents_per_stage']['in_shards']:,}"),
            ("tokenizer, vocabulary", f"WordPiece, {q['vocab_size']:,}", f"instruction (BPE 4,096 + whole pieces), "
                                                                         f"{p['vocab_size']:,}"),
            ("rows", f"packed, {q['seq_len']} tokens", f"padded, one function per row, {p['seq_len']} tokens"),
            ("packing efficiency (real tokens / positions)", _pct(demo_eff), _pct(d["index_packing"]["efficiency"])),
            ("documents attend across boundaries", "yes", "no"),
            ("model", f"`{t['model']}`, BERT options, {t['params'] / 1e6:.1f} M",
             f"`{s['model']}` + the study's options, {s['params'] / 1e6:.1f} M"),
            ("precision, steps, global batch", f"{t['precision']}, {t['steps']}, {t['global_batch_size']}",
             f"{s['precision']}, {s['steps']}, {s['global_batch_size']}"),
            ("MLM loss, first → last step", f"{t['initial_loss']:.2f} → {t['final_loss']:.2f}",
             f"{s['initial_loss']:.2f} → {s['final_loss']:.2f}"),
            ("held-out loss (perplexity)", f"{t['eval_loss']:.2f} ({t['perplexity']:.1f})",
             f"{s['eval_loss']:.2f} ({s['perplexity']:.1f})"),
            ("tokens/s (real tokens, 2 ranks; load differs)", f"{t['tokens_per_s']:,.0f}",
             f"{s['tokens_per_s']:,.0f} (1-minute load {d['load_before_train']['load_1min']})")]
    table = ["| quantity | labkit's defaults (`make demo`) | the study's configuration, scaled down |",
             "| --- | --- | --- |"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return ("\n".join(table) + "\n\n"
            f"Study run: `{d['command']}` (configs/study.toml with `--scaled-down`: "
            f"{', '.join('`' + o + '`' for o in d['overrides'])}), 2 local engines, CPU; `docs/data/study_run.json`. "
            "Defaults: `docs/data/demo.json`. The losses are per masked token of different vocabularies and "
            "learning rates (the study's 1e-4, the demo's 1e-3), so they show each run learning, not which "
            "is better.\n")


def study_loaders() -> str:
    import polars as pl

    path = DATA / "study_loaders.jsonl"
    if not path.exists():
        return "No record yet (`python benchmarks/study_loaders.py` writes `docs/data/study_loaders.jsonl`).\n"
    df = pl.read_ndjson(path)
    workers = sorted(df["num_workers"].unique().to_list())
    rows = ["| precision | planned step (s) | " + " | ".join(f"{w} workers: wait" for w in workers) + " | knee |",
            "| --- | --- |" + " --- |" * (len(workers) + 1)]
    for precision in df["precision"].unique(maintain_order=True).to_list():
        part = df.filter(pl.col("precision") == precision).sort("num_workers")
        knee = part.filter(pl.col("knee"))["num_workers"].to_list()
        rows.append(f"| {precision} | {part['planned_step_s'][0]:.2f} | "
                    + " | ".join(_pct(x) for x in part["data_wait_fraction"]) + f" | {knee[0] if knee else 'none'} |")
    load = ", ".join(f"{x:.1f}" for x in df["load_avg_1m"].unique(maintain_order=True))
    return ("\n".join(rows) + "\n\n"
            f"Batch {df['samples'][0] // df['batches'][0]} padded 512-token functions from the study run's shards; "
            f"1-minute load {load} on {df['cpus'][0]} CPUs. `docs/data/study_loaders.jsonl` "
            "(`python benchmarks/study_loaders.py`).\n")


def one_story() -> str:
    """Which lessons hold under the authors' settings, from the planner and the files above."""
    from labkit.study import scaling
    from labkit.study.plan import STUDY_MICRO_BATCH

    lab, cfg = _study()
    got = _planned(lab, cfg)["max_micro_batch"]
    large = _planned(lab, cfg, "bert-350m")["max_micro_batch"]
    s = scaling.precision_summary(scaling.precision_experiment(
        cfg, micro_batch=lab.train.batch.micro_batch_size, seq_len=lab.shards.seq_len, device=lab.plan.device,
        network=lab.plan.network, gpus_per_node=lab.plan.gpus_per_node, mfu=lab.plan.mfu), mfu=lab.plan.mfu)
    eff = {r["precision"]: r for r in s.iter_rows(named=True)}
    b = lab.train.batch.micro_batch_size
    return (f"- Lesson 5, 120M: **holds**. The authors' model in fp32 at 512 tokens plans to {got} sequences per "
            f"94 GB GPU ({(got - b) / b:+.1%} against their {b}): their batch is that model filled to memory.\n"
            f"- Lesson 4: **holds in fp32, as they ran it**. At {b} x 512 tokens an fp32 step takes "
            f"{eff['fp32']['compute_s']:.2f} s at {lab.plan.mfu:.0%} of the CUDA-core peak, long enough to hide "
            f"the {eff['fp32']['comm_s']:.2f} s all-reduce of fp32 gradients over 25 GbE: "
            f"{eff['fp32']['efficiency']:.0%} at {eff['fp32']['n_gpus']} GPUs, at any MFU. The same run in TF32 "
            f"would reach {eff['tf32']['efficiency']:.0%} and in bf16 {eff['bf16']['efficiency']:.0%}: the "
            f"network would be the limit from {eff['tf32']['first_exposed_n']} and {eff['bf16']['first_exposed_n']} "
            "GPUs. Near-linear scaling was bought with slow steps.\n"
            f"- Lesson 5, 350M: **not explained**. Nothing in the code gives the 350M model; a BERT-Large shape "
            f"with the same options plans to {large} in fp32, not {STUDY_MICRO_BATCH['bert-350m']}.\n"
            "- Lessons 1-3 are the authors' practice, now labkit options: their tokenizer and padding "
            "(lesson 1's table), rsync to node-local disk before training (`labkit stage`), 8 loader workers "
            "per GPU (lesson 3's table shows how few an fp32 step needs).\n").replace("%", " %").replace("  %", " %")


BLOCKS = {("docs/results.md", "study-plan"): study_plan,
          ("docs/results.md", "precision-experiment"): precision_experiment,
          ("docs/results.md", "tokenizer-study"): tokenizer_study,
          ("docs/results.md", "study-run"): study_run,
          ("docs/results.md", "study-loaders"): study_loaders,
          ("docs/results.md", "one-story"): one_story}
