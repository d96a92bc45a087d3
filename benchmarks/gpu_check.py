"""GPU check (run by ``benchmarks/gpu_check.sh``): bf16 step time, tokens/s, MFU and the largest
micro-batch of labkit's training step for bert-120m and bert-350m at seq 128 and 512 on one
NVIDIA GPU, plus a 1-GPU NCCL process-group init + all_reduce smoke test. Writes one JSON file.

Each configuration: build ``BertMLM`` (labkit/model/encoder.py), AdamW as ``train`` builds it, one step
at micro-batch 1 so the optimiser state exists, then ``largest_fitting`` finds the largest
micro-batch whose whole step (bf16 autocast forward/backward through ``train.forward_backward``,
global-norm clip, AdamW step) runs without ``torch.cuda.OutOfMemoryError``, emptying the CUDA
cache between tries. It then times ``--steps`` steps (after ``--warmup`` untimed ones) at the
largest power of two not above that micro-batch, with ``measure.StepTimer`` (synchronised).
tokens/s counts every token (the random batches hold no padding); MFU = tokens/s x
``flops_per_token`` / peak (``measure.mfu``, PEAK_FLOPS; None for an unlisted GPU).

CPU mode (``--device cpu``, tiny sizes) exists so the flow is tested without a GPU: nothing runs
out of memory there, so ``--limit`` caps the search.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import socket
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from labkit import measure  # noqa: E402
from labkit.io import atomic_write_json  # noqa: E402
from labkit.config import TrainConfig  # noqa: E402
from labkit.data.mlm import MLMCollator  # noqa: E402
from labkit.model import BertMLM, count_parameters, flops_per_token, model_config  # noqa: E402
from labkit.study.plan import largest_fitting  # noqa: E402
from labkit.train import build_optimizer, dist, forward_backward  # noqa: E402


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def check_config(name: str, seq_len: int, *, vocab: int, device: torch.device, limit: int, steps: int,
                 warmup: int) -> dict:
    """Largest micro-batch and bf16 timing of one (model size, seq_len) on ``device``."""
    mcfg = model_config(name, vocab, max_position_embeddings=max(512, seq_len))
    torch.manual_seed(0)
    model = BertMLM(mcfg).to(device)
    model.train()
    optimizer = build_optimizer(model, TrainConfig(data_dir="-", run_dir="-"))
    collate = MLMCollator(vocab_size=vocab, seed=0)
    gen = torch.Generator().manual_seed(0)

    def batch(b: int) -> dict[str, torch.Tensor]:
        rows = torch.randint(5, vocab, (b, seq_len), generator=gen)
        rows[:, 0] = 2
        return {k: v.to(device) for k, v in collate(rows.numpy()).items()}

    def step(mb: dict[str, torch.Tensor]) -> None:
        forward_backward(model, [mb], world_size=1, precision="bf16")
        dist.clip_grad_norm(model, 1.0)
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
        return {"model": name, "seq_len": seq_len, "max_micro_batch": 0, "error": "micro-batch 1 does not fit"}
    t0 = time.perf_counter()
    tried: list[int] = []
    best = largest_fitting(lambda n: tried.append(n) or fits(n), limit=limit)
    search_s = time.perf_counter() - t0
    b = 1 << (best.bit_length() - 1)  # largest power of two <= best
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
    fpt = flops_per_token(mcfg, seq_len)
    peak = measure.peak_flops(device, "bf16")
    out = {"model": name, "seq_len": seq_len, "vocab_size": vocab, "params": count_parameters(mcfg)["total"],
           "max_micro_batch": best, "search_tries": tried, "search_s": round(search_s, 2),
           "timed_micro_batch": b, "step_time_s": step_s, "tokens_per_s": tps,
           "samples_per_s": measure.samples_per_s(b, step_s), "flops_per_token": fpt, "peak_flops": peak,
           "mfu": measure.mfu(tps, fpt, 1, peak), "peak_mem_bytes": measure.peak_memory_bytes(device),
           "precision": "bf16"}
    del model, optimizer, mb
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def nccl_smoke(timeout_s: float = 60.0) -> dict:
    """1-rank NCCL group (env://, 127.0.0.1, a free port) + all_reduce via
    ``dist.all_reduce_smoke_test``; the variables it sets are removed again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.perf_counter()
        result = dist.all_reduce_smoke_test(timeout_s)
        result["seconds"] = round(time.perf_counter() - t0, 2)
        return result
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


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
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but torch.cuda.is_available() is False (no GPU here)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    report = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, "results": []}
    for name in args.models.split(","):
        for seq in map(int, args.seq_lens.split(",")):
            if time.perf_counter() - t_start > args.budget_s:
                rec = {"model": name, "seq_len": seq, "skipped": f"time budget {args.budget_s} s spent"}
            else:
                rec = check_config(name, seq, vocab=args.vocab, device=device, steps=args.steps,
                                   warmup=args.warmup, limit=max(1, args.limit * 128 // seq))
            report["results"].append(rec)
            print(json.dumps(rec), flush=True)
    report["nccl"] = nccl_smoke() if device.type == "cuda" else {"skipped": "no CUDA device"}
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, report)
    print(json.dumps({"gpu_check": str(out), "nccl_ok": report["nccl"].get("ok"), "wall_s": report["wall_s"]}))
    return report


if __name__ == "__main__":
    main()
