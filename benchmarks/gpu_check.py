"""GPU check (run by ``benchmarks/gpu_check.sh``), one call on one NVIDIA GPU, in this order:

1. ``plan``: ``labkit.study.memory.plan_model`` (counted on this machine's CPU as CUDA keeps it)
   against ``torch.cuda.max_memory_allocated`` of the training step, for labkit's bert-120m and
   bert-350m and transformers' ``BertForMaskedLM`` (SDPA, BERT-base shape) at seq 512, two
   micro-batches each (``study.gpu.plan_model_check``); and the formula planner
   (``study.gpu.gpu_memory_check``).
2. ``flops``: ``labkit.model.flops_per_token`` against ``FlopCounterMode`` on CUDA, bert-120m
   with the sparse and the dense head (``study.gpu.flops_check``).
3. ``resume``: a run configured ZeRO-1 with fused AdamW saved at step 2, resumed and stepped to 4; an
   fsdp-configured run with held-out evaluation, saved, resumed and finished (one-rank NCCL groups:
   at dp 1 the builder applies no data-parallel strategy, so both check a one-GPU run's
   checkpoint and resume in a process group).
4. ``configs``: bf16 step time, tokens/s, MFU (FLOPs with the MLM decoder counted) and the
   largest micro-batch of labkit's training step for bert-120m and bert-350m at seq 128 and 512,
   eager and under ``torch.compile``, with the formula planner's peak beside each.
5. ``nccl``: a 1-GPU NCCL process-group init + all_reduce smoke test.

Writes one JSON file and a short markdown summary beside it (.md). It has not run on a GPU yet
(no GPU was available where it was written).

Each configuration of ``configs``: build ``BertMLM`` (labkit/model/encoder.py) and its run as ``train`` builds it
(``labkit.train.build_runtime``: AdamW, the step, the clip), one step
at micro-batch 1 so the optimiser state exists, then ``largest_fitting`` finds the largest
micro-batch whose whole step (the trainer's: bf16 autocast forward/backward through
``Runtime.forward_backward``, its global-norm clip ``Runtime.clip_grad_norm``, AdamW step) runs
without ``torch.cuda.OutOfMemoryError``, emptying the CUDA
cache between tries. It then times ``--steps`` steps (after ``--warmup`` untimed ones) at the
largest power of two not above that micro-batch, with ``measure.StepTimer`` (synchronised).
tokens/s counts every token (the random batches hold no padding); MFU = tokens/s x
``flops_per_token`` / peak (``measure.mfu``, PEAK_FLOPS; None for an unlisted GPU).

CPU mode (``--device cpu``, tiny sizes) exists so the flow is tested without a GPU: nothing runs
out of memory there, so ``--limit`` caps the search; ``plan`` is skipped (no allocator to compare).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import pathlib
import socket
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from labkit import measure  # noqa: E402
from labkit.io import atomic_write_json, atomic_write_text  # noqa: E402
from labkit.config import TrainConfig  # noqa: E402
from labkit.data.mlm import MLMCollator  # noqa: E402
from labkit.model import BertMLM, count_parameters, flops_per_token, model_config  # noqa: E402
from labkit.study.plan import largest_fitting  # noqa: E402
from labkit.train import Runtime, build_runtime, dist  # noqa: E402, F401 (Runtime: tests patch its step)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def check_config(name: str, seq_len: int, *, vocab: int, device: torch.device, limit: int, steps: int,
                 warmup: int, compile_: bool = False, micro_batch: int | None = None) -> dict:
    """Largest micro-batch and bf16 timing of one (model size, seq_len) on ``device``; with
    ``compile_`` the model's forward is ``torch.compile``d (``TrainConfig.compile``). With
    ``micro_batch`` the search is skipped and that micro-batch is timed. The record also holds
    the planner's peak (``plan.memory_plan``, fused attention) for the timed micro-batch against
    ``peak_mem_bytes`` (``max_memory_allocated`` over the timed steps)."""
    from labkit.study import plan

    mcfg = model_config(name, vocab, max_position_embeddings=max(512, seq_len))
    torch.manual_seed(0)
    rt = build_runtime(TrainConfig(data_dir="-", run_dir="-", precision="bf16", compile=compile_), BertMLM(mcfg),
                       device)  # the trainer's builder: AdamW, compile (in place), the step and its clip
    model, optimizer = rt.parts, rt.optimizer
    model.train()
    collate = MLMCollator(vocab_size=vocab, seed=0)
    gen = torch.Generator().manual_seed(0)

    def batch(b: int) -> dict[str, torch.Tensor]:
        rows = torch.randint(5, vocab, (b, seq_len), generator=gen)
        rows[:, 0] = 2
        return {k: v.to(device) for k, v in collate(rows.numpy()).items()}

    def step(mb: dict[str, torch.Tensor]) -> None:
        rt.forward_backward([mb])
        rt.clip_grad_norm(1.0)  # the trainer's one clip (labkit.train.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def fits(b: int) -> bool:
        ok = True
        try:
            step(batch(b))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except RuntimeError as err:  # torch.cuda.OutOfMemoryError is a RuntimeError
            if not _is_oom(err):
                raise
            ok = False
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return ok

    if not fits(1):
        return {"model": name, "seq_len": seq_len, "compile": compile_, "max_micro_batch": 0,
                "error": "micro-batch 1 does not fit"}
    t0 = time.perf_counter()
    tried: list[int] = []
    if micro_batch is None:
        best = largest_fitting(lambda n: tried.append(n) or fits(n), limit=limit)
        b = 1 << (best.bit_length() - 1)  # largest power of two <= best
    else:
        best, b = None, micro_batch
    search_s = time.perf_counter() - t0
    mb = batch(b)
    timer = measure.StepTimer(device)
    for _ in range(warmup):
        step(mb)
    measure.reset_peak_memory(device)
    timer.start()
    for _ in range(steps):
        step(mb)
    step_s = timer.stop() / steps
    tps = measure.tokens_per_s(b * seq_len, step_s)
    fpt = flops_per_token(mcfg, seq_len)  # the MLM decoder counted at the masked positions (sparse head)
    peak = measure.peak_flops(device, "bf16")
    measured_peak = measure.peak_memory_bytes(device)
    planned_peak = plan.memory_plan(mcfg, seq_len=seq_len, micro_batch=b, precision="bf16", attention="flash")["total"]
    out = {"model": name, "seq_len": seq_len, "compile": compile_, "vocab_size": vocab,
           "params": count_parameters(mcfg)["total"],
           "max_micro_batch": best, "search_tries": tried, "search_s": round(search_s, 2),
           "timed_micro_batch": b, "step_time_s": step_s, "tokens_per_s": tps,
           "samples_per_s": measure.samples_per_s(b, step_s), "flops_per_token": fpt, "peak_flops": peak,
           "mfu": measure.mfu(tps, fpt, 1, peak), "peak_mem_bytes": measured_peak,
           "planned_peak_bytes": planned_peak,
           "planned_over_measured": planned_peak / measured_peak if measured_peak else None, "precision": "bf16"}
    del rt, model, optimizer, mb
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def nccl_smoke(timeout_s: float = 60.0) -> dict:
    """1-rank NCCL group (env://, 127.0.0.1, a free port: ``_one_rank_env``) + all_reduce via
    ``dist.all_reduce_smoke_test``; the variables it sets are removed again."""
    with _one_rank_env():
        t0 = time.perf_counter()
        result = dist.all_reduce_smoke_test(timeout_s)
        result["seconds"] = round(time.perf_counter() - t0, 2)
        return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description="labkit GPU check (see module docstring)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default="bert-120m,bert-350m")
    p.add_argument("--seq-lens", default="128,512")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--limit", type=int, default=8192, help="micro-batch cap at seq 128 (scaled by 128/seq)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=400.0, help="skip configurations started after this")
    p.add_argument("--compile-modes", default="0,1",
                   help="0: eager (with the micro-batch search), 1: torch.compile at eager's timed micro-batch")
    p.add_argument("--checks", default="plan,flops,resume,configs,nccl", help="which checks run (module docstring)")
    p.add_argument("--flops-models", default="bert-120m", help="models of the flops check")
    p.add_argument("--resume-model", default="mini", help="model of the resume check")
    args = p.parse_args(argv)
    checks = set(args.checks.split(","))
    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but torch.cuda.is_available() is False (no GPU here)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    report = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, "results": []}
    skipped = {"skipped": "not in --checks"}
    seq = int(args.seq_lens.split(",")[-1])
    report["planner_check"] = planner_check(device, args.vocab, seq) if "plan" in checks else skipped
    print(json.dumps({"planner_check": report["planner_check"]}, default=str), flush=True)
    report["flops_check"] = flops_check(device, args.flops_models.split(","), args.vocab, seq) \
        if "flops" in checks else skipped
    print(json.dumps({"flops_check": report["flops_check"]}), flush=True)
    if "resume" in checks:
        with tempfile.TemporaryDirectory() as tmp:
            report["resume_check"] = resume_check(device, pathlib.Path(tmp), args.resume_model)
    else:
        report["resume_check"] = skipped
    print(json.dumps({"resume_check": report["resume_check"]}), flush=True)
    timed: dict[tuple[str, int], int] = {}  # eager's timed micro-batch, reused by the compiled run
    compile_modes = args.compile_modes.split(",") if "configs" in checks else []
    for compile_ in (m == "1" for m in compile_modes):  # all eager configurations first
        for name in args.models.split(","):
            for seq in map(int, args.seq_lens.split(",")):
                if time.perf_counter() - t_start > args.budget_s:
                    rec = {"model": name, "seq_len": seq, "compile": compile_,
                           "skipped": f"time budget {args.budget_s} s spent"}
                elif compile_ and (name, seq) not in timed and "0" in args.compile_modes.split(","):
                    rec = {"model": name, "seq_len": seq, "compile": True, "skipped": "no eager result to reuse"}
                else:
                    rec = check_config(name, seq, vocab=args.vocab, device=device, steps=args.steps,
                                       warmup=args.warmup, limit=max(1, args.limit * 128 // seq), compile_=compile_,
                                       micro_batch=timed.get((name, seq)) if compile_ else None)
                    if not compile_ and rec.get("timed_micro_batch"):
                        timed[(name, seq)] = rec["timed_micro_batch"]
                report["results"].append(rec)
                print(json.dumps(rec), flush=True)
    report["nccl"] = (nccl_smoke() if device.type == "cuda" else {"skipped": "no CUDA device"}) \
        if "nccl" in checks else skipped
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, report)
    md = out.with_suffix(".md")
    atomic_write_text(md, summary_markdown(report))
    print(json.dumps({"gpu_check": str(out), "summary": str(md), "nccl_ok": report["nccl"].get("ok"),
                      "wall_s": report["wall_s"]}))
    return report


def planner_check(device: torch.device, vocab: int = 32768, seq_len: int = 512) -> dict:
    """Check 1: ``study.gpu.plan_model_check`` for bert-120m, bert-350m and BertForMaskedLM (SDPA)
    at two micro-batches each, and ``study.gpu.gpu_memory_check`` (the formula planner); on CUDA
    only, {"skipped": ...} elsewhere."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    from labkit.study.gpu import gpu_memory_check, hf_bert_mlm, plan_model_check
    from labkit.study.memory import labkit_model

    cases = [("bert-120m", *labkit_model(model_config("bert-120m", vocab), seq_len), (16, 64)),
             ("bert-350m", *labkit_model(model_config("bert-350m", vocab), seq_len), (8, 16)),
             ("BertForMaskedLM-sdpa", *hf_bert_mlm(seq_len), (16, 64))]
    return {"plan_model": plan_model_check(cases), "formula": gpu_memory_check()}


def flops_check(device: torch.device, names: list[str], vocab: int, seq_len: int) -> list[dict]:
    """Check 2: ``study.gpu.flops_check`` for each model name with the sparse and the dense head."""
    from labkit.study.gpu import flops_check as check

    cfgs = [(f"{n} {'sparse' if s else 'dense'}", model_config(n, vocab, sparse_head=s,
                                                                  max_position_embeddings=max(512, seq_len)))
            for n in names for s in (True, False)]
    return check(cfgs, seq_len=seq_len, micro_batch=4)


def resume_check(device: torch.device, workdir: pathlib.Path, model: str = "mini") -> dict:
    """Check 3: runs configured ZeRO-1 and fsdp (with held-out evaluation), each stopped after step 2
    (checkpoint), resumed and run to step 4, bf16, in one-rank process groups (a fresh port per run:
    re-creating a group on one port can hang, pytorch#55967); at dp 1 the builder applies neither
    (``labkit.train.parallel``), so this checks a one-GPU run's checkpoint and resume. Per run:
    {"ok", "resumed_from_step", "steps", "final_loss", "eval_loss", "comm_exposed_s"} or {"ok": False,
    "error"}."""
    import importlib.util

    from labkit.config import TrainConfig
    from labkit.train import train

    spec = importlib.util.spec_from_file_location("tiny_shards", pathlib.Path(__file__).parents[1] / "tests" /
                                                  "tiny_shards.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    shards = tiny.write_tiny_shards(workdir / "shards", n_sequences=64, seq_len=64, heldout_sequences=8)
    out = {}
    for sharding in ("zero1", "fsdp"):
        run_dir = workdir / sharding
        cfg = TrainConfig(data_dir=str(shards), run_dir=str(run_dir), model=model, max_steps=4, stop_after=2,
                          device=device.type, precision="bf16", timeout_s=120,
                          num_threads=4 if device.type == "cpu" else 0, batch={"micro_batch_size": 8},
                          schedule={"warmup_steps": 1}, parallel={"sharding": sharding}, checkpoint={"every": 2},
                          eval={"every": 2, "sequences": 8})
        try:
            for part in (cfg, dataclasses.replace(cfg, stop_after=None, resume=True)):
                with _one_rank_env():
                    result = train(part)
            out[sharding] = {"ok": result["steps"] == 4 and result["resumed_from_step"] == 2,
                             "resumed_from_step": result["resumed_from_step"], "steps": result["steps"],
                             "final_loss": result["final_loss"], "eval_loss": result["eval_loss"],
                             "comm_exposed_s": result["comm_exposed_s"]}  # CommTimer's CUDA-event path
        except Exception as err:  # recorded, not raised: the other checks still run
            out[sharding] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}
    return out


@contextlib.contextmanager
def _one_rank_env():
    """RANK 0 of WORLD_SIZE 1 with MASTER_ADDR/PORT (a free port) for the duration: ``train``
    then creates (and destroys) a one-rank process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def summary_markdown(report: dict) -> str:
    """A short markdown summary of a gpu_check report: one table row per configuration, the
    planner check and the NCCL smoke test."""
    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "n/a"

    lines = [f"# labkit GPU check: {report['device']}", "",
             f"{report['date_utc']}, torch {report['torch']}, CUDA {report['cuda']}, {report.get('wall_s')} s", "",
             "| model | seq | compile | max micro-batch | timed micro-batch | step s | tokens/s | MFU | "
             "planned / measured peak |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['model']} | {r['seq_len']} | {r.get('compile')} | {r.get('skipped') or r.get('error')} "
                         "| | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['seq_len']} | {r['compile']} | {num(r['max_micro_batch'], 'd')} | "
                     f"{r['timed_micro_batch']} | {num(r['step_time_s'], '.4f')} | {num(r['tokens_per_s'], ',.0f')} | "
                     f"{num(r['mfu'], '.3f')} | {num(r.get('planned_over_measured'), '.3f')} |")
    check = report.get("planner_check") or {}
    if "skipped" in check:
        lines += ["", f"Planner check: {check['skipped']}"]
    else:
        lines += ["", "| plan_model: model | micro-batch | planned B | measured B (max_memory_allocated) | ratio "
                  "| ok |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {c['model']} | {c['micro_batch']} | {c['planned']:,} | {c['measured']:,} | {c['ratio']:.3f} | "
                  f"{c['ok']} |" for c in check.get("plan_model", [])]
        lines += ["", "Formula planner (`study.gpu.gpu_memory_check`): " + "; ".join(
            f"{c['model']} b={c['micro_batch']}: peak ratio {c['peak_ratio']:.3f}, ok {c['ok']}"
            for c in check.get("formula", []))]
    flops = report.get("flops_check")
    lines += ["", "FLOPs per token vs FlopCounterMode: " + (flops.get("skipped", "") if isinstance(flops, dict) else
              "; ".join(f"{f['model']}: ratio {f['ratio']:.4f}, ok {f['ok']}" for f in flops))]
    resume = report.get("resume_check") or {}
    lines += ["", "Resume checks: " + ("; ".join(f"{k}: {v}" for k, v in resume.items()))]
    lines += ["", f"NCCL smoke test: {report['nccl']}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
