"""MLM pretraining: ``train(cfg)`` runs one run in this process, as one rank of many or alone.

The optimiser step reads top to bottom in ``train`` (as nanoGPT's main loop does); the
micro-batch part (count, forwards, backwards) is ``forward_backward`` so the 2-rank
gradient test exercises exactly the code ``train`` runs.

Loss normalisation (``pytorch/torchtitan: torchtitan/trainer.py``):
the number of masked tokens over every micro-batch of the step on every rank is all-reduced
once, before the forwards; each micro-batch's loss is ``loss_sum * world_size / n_masked_global``
so that DDP's gradient average over ranks gives the gradient of (sum of CE over all masked
tokens of the global batch) / (their count), the same as one process on the whole batch.

Run directory (rank 0 writes): config.json, metrics.jsonl (one record per log step, appended
and flushed), checkpoints/step-N/ (model.safetensors + state.pt), result.json (atomic).
state.pt = {format, step, epoch, tokens, lr, optimizer, scaler, world_size, sharding, ranks:
[{rng: {torch, cuda?, numpy, python}, sampler: {epoch, position}} per rank]}, all tensors,
numbers and lists so ``torch.load(weights_only=True)`` reads it. Weights and optimiser state
are whole (unsharded) under every sharding: zero1 consolidates the moments on rank 0, fsdp
gathers parameters and moments (keyed by name) to rank 0. The LR is a pure function of the
step (``lr_at``), so the step is the whole scheduler state. Resume needs the same world size
and sharding (sharding "none" in a single process) and a config and data that match the run
directory's config.json / data.json (``labkit.train.run_config``: one-line refusal naming each field).

With tp or pp > 1 the model is split (``labkit.train.parallel.ParallelModel``: pipeline stages,
tensor parallelism, FSDP2 or replicas over dp) and the same loop runs: one visible branch per
step calls its ``forward_backward`` and ``clip_grad_norm`` instead of this module's and
``dist.clip_grad_norm``. Data (sampler, masked-token count, held-out set) follows the dp rank;
global batch = micro_batch_size * grad_accum_steps * dp; records gain ``pipeline_bubble`` and
``tp_comm_s`` (None when not split that way); checkpoints are torch.distributed.checkpoint
directories (``labkit.train.checkpoint.save_split_checkpoint``) that load at another split with
the same dp (``parallel.refuse_checkpoint`` names both splits otherwise).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pathlib
import random
import time
from typing import Any, Callable

import numpy as np
import torch

from labkit import measure
from labkit.config import TrainConfig, to_dict
from labkit.data.mlm import make_loader
from labkit.data.shards import packing_of, read_index
from labkit.io import atomic_write_json, atomic_write_text
from labkit.model import BertMLM, count_parameters, flops_per_token
from labkit.train import dist, parallel, provenance, sinks
from labkit.train.checkpoint import (_rng_state, _set_rng_state, checkpoint_steps, load_checkpoint, save_checkpoint,
                                     save_split_checkpoint)
from labkit.train.comm import compression_hook, time_gradient_collectives
from labkit.train.optim import build_optimizer, lr_at
from labkit.train.run_config import check_resume, data_identity, model_config_of, save_run_config

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def forward_backward(model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], *,
                     world_size: int, precision: str = "fp32",
                     scaler: torch.amp.GradScaler | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accumulate the gradients of one optimiser step over ``micro_batches`` (this rank's).

    Each batch holds input_ids int64[B,T], labels int64[B,T] (-100 = not masked) and
    attention_mask bool[B,T], on the model's device, and may hold what the host knew before the
    copy (``to_device``): ``all_real`` (no [PAD]: the model gets no mask) and ``max_masked``
    (the sparse head's gather size), so the forward needs no host sync. The masked and real-token counts of all
    micro-batches on all ranks are all-reduced once before the forwards; gradient all-reduce
    (DDP) happens on the last micro-batch only (``no_sync`` on the others). Returns
    ``(loss_sum, n_masked_global, n_tokens_global)``: this rank's summed CE (fp32, detached),
    the global masked count and the global real-token count (int64).
    """
    counts = torch.stack([torch.stack([(b["labels"] != -100).sum(), b["attention_mask"].sum()])
                          for b in micro_batches]).sum(0).to(torch.int64)
    dist.all_reduce_sum(counts)
    n_masked_global, n_tokens_global = counts[0], counts[1]
    dtype = AUTOCAST_DTYPES[precision]
    device_type = micro_batches[0]["input_ids"].device.type
    loss_sum = torch.zeros((), dtype=torch.float32, device=counts.device)
    for i, batch in enumerate(micro_batches):
        with dist.no_sync(model, sync=i == len(micro_batches) - 1):
            with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                mask = None if batch.get("all_real") else batch["attention_mask"]  # host facts: no sync
                out = model(batch["input_ids"], attention_mask=mask, labels=batch["labels"],
                            max_masked=batch.get("max_masked"))
            loss = out.loss_sum.float() * world_size / n_masked_global.clamp(min=1)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        loss_sum += out.loss_sum.detach().float()
    return loss_sum, n_masked_global, n_tokens_global


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """A collated CPU batch on ``device`` (non-blocking copies), plus two facts read on the host
    first, so that the forward syncs with the device for neither: ``all_real`` (bool: no [PAD],
    the attention needs no mask) and ``max_masked`` (int: the most labels != -100 in one row)."""
    out: dict[str, Any] = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    out["all_real"] = bool(batch["attention_mask"].all())
    out["max_masked"] = int((batch["labels"] != -100).sum(dim=1).max()) if batch["labels"].numel() else 0
    return out


# ------------------------------------------------------------------------------------------
# Checkpoints and run files
# ------------------------------------------------------------------------------------------


def _iterate(loader: torch.utils.data.DataLoader) -> Any:
    """``iter(loader)`` without touching torch's global RNG: a new DataLoader iterator draws a
    worker base seed from it, persistent workers do not, so the dropout stream would depend on
    num_workers and on where a resumed run restarted it."""
    with torch.random.fork_rng(devices=[]):
        return iter(loader)


def _tokenizer_sha256(path: str | None) -> str | None:
    """sha256 of the tokenizer file the run expects (None: no check); FileNotFoundError names it."""
    if path is None:
        return None
    from labkit.data.tokenize import tokenizer_sha256

    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer_path: {path} does not exist")
    return tokenizer_sha256(path)


def _find_sampler(loader: torch.utils.data.DataLoader) -> Any:
    """The RankSampler inside ``loader`` (as sampler, batch sampler or the batch sampler's sampler)."""
    for cand in (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)):
        if hasattr(cand, "set_epoch") and hasattr(cand, "state_dict"):
            return cand
    raise TypeError("make_loader returned a DataLoader without a RankSampler (set_epoch/state_dict)")




def _heldout_set(cfg: TrainConfig, rank: int, world: int, vocab_size: int, device: torch.device) -> Any:
    """The fixed masked held-out set (``labkit.train.evaluation.HeldoutSet``) of this rank, or None
    when eval_every is 0 and the shards have no held-out split (then no evaluation runs)."""
    from labkit.train.evaluation import HeldoutSet

    if cfg.eval_every == 0 and not read_index(cfg.data_dir).get("heldout"):
        return None
    return HeldoutSet(cfg.data_dir, rank=rank, world_size=world, vocab_size=vocab_size,
                      mlm_probability=cfg.mlm_probability, max_sequences=cfg.eval_sequences,
                      batch_size=cfg.eval_batch_size or cfg.micro_batch_size, device=device)


def _maybe_evaluate(model: torch.nn.Module, heldout: Any, cfg: TrainConfig, step: int, stop: int,
                    windows: measure.PeakWindows | None = None) -> dict[str, Any]:
    """Collective: {"eval_loss", "perplexity", "eval_masked", "eval_sequences",
    "eval_peak_mem_bytes" (its own peak window in ``windows``)} at the steps that evaluate (every
    eval_every, and the last), else {}."""
    from labkit.train.evaluation import evaluate

    if heldout is None or not ((cfg.eval_every and step % cfg.eval_every == 0) or step == stop):
        return {}
    if windows is None:
        return evaluate(model, heldout, precision=cfg.precision)
    out, peak = windows.around("eval", evaluate, model, heldout, precision=cfg.precision)
    return out | {"eval_peak_mem_bytes": peak}


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------


def train(cfg: TrainConfig, *, sink: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Run MLM pretraining per ``cfg`` as this process's rank (RANK/WORLD_SIZE/LOCAL_RANK/
    MASTER_ADDR/MASTER_PORT from the environment; absent = one process, no process group).

    Returns the result dict (also rank 0's result.json): initial_loss, final_loss, eval_loss and
    perplexity (the last held-out evaluation, ``labkit.train.evaluation``; None without one),
    peak_mem_bytes (the training steps' own peak; eval_peak_mem_bytes and
    checkpoint_peak_mem_bytes in their own windows, also in the records they belong to), tokens_per_s
    and samples_per_s (time-weighted over this invocation's steps after timing_warmup_steps),
    data_wait_fraction, comm_exposed_s (mean seconds per timed step of gradient communication
    not hidden behind backward, rank 0; ``labkit.measure.comm_exposed_s``) and comm_exposed_fraction
    (of the step time), mfu, world_size, global_batch_size, steps, params, ... ``sink(record)``
    is called on rank 0 with each metrics record. Resumes from the newest checkpoint when
    ``cfg.resume``. Raises ``FloatingPointError`` on a non-finite loss when on_nonfinite="raise",
    ``ValueError`` naming the field for inconsistent settings; shard errors come from
    ``labkit.data.shards``. A process group this call creates is destroyed before it returns.
    Rank 0 also sends each record to the sinks named in ``cfg.trackers`` (``labkit.train.sinks``:
    TensorBoard event files under run_dir/tensorboard by default); config.json and result.json
    carry the run's ``provenance`` (``labkit.train.provenance.collect``).
    """
    t_start = time.time()
    rank, local_rank, world = dist.dist_info()
    device = dist.resolve_device(cfg.device, local_rank)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    owns_group = not torch.distributed.is_initialized()
    trackers = sinks.open_sinks(cfg.trackers, cfg.run_dir, main=rank == 0)  # rank 0 writes
    try:
        dist.init_distributed(cfg.backend, cfg.timeout_s, device)
        return _run(cfg, sinks.fan_out(sink, trackers), rank, world, device, t_start)
    finally:
        for tracker in trackers:
            tracker.close()
        if owns_group:
            dist.teardown()


def _build_model(cfg: TrainConfig, index: dict, rank: int, world: int) -> tuple[Any, BertMLM, parallel.Split | None]:
    """The model config for the shards' vocabulary, the tensor/pipeline split (None without one;
    ``parallel.check_split`` refuses one that cannot work) and ``BertMLM`` built from ``cfg.seed``
    (the same init on every rank), then each rank's own dropout stream seeded. ValueError when the
    shards' sequence length exceeds the model's positions."""
    seq_len, vocab_size = int(index["seq_len"]), int(index["vocab_size"])
    mcfg = model_config_of(cfg, vocab_size)
    if seq_len > mcfg.max_position_embeddings:
        raise ValueError(f"model_overrides: shards in {cfg.data_dir} have seq_len {seq_len} > "
                         f"max_position_embeddings {mcfg.max_position_embeddings}")
    if mcfg.position_embedding == "instruction" and "[NEXT]" not in index["special_ids"]:
        raise ValueError(f"model_overrides: position_embedding 'instruction' counts [NEXT] tokens, but the shards in "
                         f"{cfg.data_dir} come from a tokenizer without [NEXT] (special_ids {index['special_ids']})")
    split = parallel.check_split(cfg, mcfg, world, seq_len, rank) if parallel.is_split(cfg) else None
    torch.manual_seed(cfg.seed)  # identical init on every rank (DDP also broadcasts rank 0's)
    model = BertMLM(mcfg)
    seed = cfg.seed + 1 + rank // cfg.tp  # dropout streams differ per rank, except across a tp group,
    torch.manual_seed(seed)  # whose ranks compute the same replicated activations
    random.seed(seed)
    np.random.seed(seed)
    return mcfg, model, split


def _restore(state: dict | None, model: torch.nn.Module, optimizer: Any, scaler: Any, sampler: Any, *,
             rank: int, world: int, sharding: str, where: str) -> tuple[int, int, int, int]:
    """Optimiser, scaler and sampler state from a checkpoint's ``state`` (None: a fresh run).
    Returns (step, epoch, position in the epoch, tokens seen). ValueError when the checkpoint was
    written by another world size or sharding (``where`` names it). A split model's optimiser was
    loaded with its weights (``load_split_checkpoint``); its rank entry is ``parallel.rank_entry``'s."""
    if state is None:
        sampler.set_epoch(0)
        return 0, 0, 0, 0
    if isinstance(model, parallel.ParallelModel):
        mine = parallel.rank_entry(state, rank, model.split)
        scaler.load_state_dict(state["scaler"])
        sampler.set_epoch(state["epoch"])
        sampler.load_state_dict(mine["sampler"])
        return state["step"], state["epoch"], mine["sampler"]["position"], state["tokens"]
    if len(state["ranks"]) != world:
        raise ValueError(f"resume: checkpoint {where} was written by "
                         f"{len(state['ranks'])} ranks; this run has {world} (set resume=False)")
    if state.get("sharding", sharding) != sharding:
        raise ValueError(f"sharding: checkpoint {where} was written with "
                         f"{state.get('sharding')!r}, this run uses {sharding!r} (set resume=False)")
    dist.load_optimizer_state_dict(model, optimizer, state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    mine = state["ranks"][rank]
    sampler.set_epoch(state["epoch"])
    sampler.load_state_dict(mine["sampler"])
    return state["step"], state["epoch"], mine["sampler"]["position"], state["tokens"]


def _forward_backward(model: Any, micro_batches: list[dict[str, torch.Tensor]], cfg: TrainConfig, world: int,
                      scaler: Any, split: parallel.Split | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's forwards and backwards: ``forward_backward`` (data parallel), or the split model's
    own (tensor / pipeline parallel, ``labkit.train.parallel``: the schedule, or tp-split stages)."""
    if split is None:
        return forward_backward(model, micro_batches, world_size=world, precision=cfg.precision, scaler=scaler)
    return model.forward_backward(micro_batches, dtype=AUTOCAST_DTYPES[cfg.precision])


def _load_and_wrap(cfg: TrainConfig, model: BertMLM, device: torch.device, split: parallel.Split | None,
                   ckpt: pathlib.Path | None, world: int) -> tuple[Any, Any, Any, str, dict | None]:
    """The checkpoint ``ckpt`` (None: a fresh run) loaded and the model wrapped, in the order each
    kind needs; returns (model, optimizer, scaler, sharding, state.pt or None). Data parallel:
    the whole weights into the one-device model, then ``_parallelize``. Tensor / pipeline parallel:
    ``parallel.build`` splits first, then loads through torch.distributed.checkpoint. A checkpoint
    of another kind, or at another dp, is refused naming both splits (``parallel.refuse_checkpoint``)."""
    if ckpt is not None:
        parallel.refuse_checkpoint(ckpt, split, world)
    if split is not None:
        return parallel.build(cfg, model, device, split, ckpt)
    state = load_checkpoint(ckpt, model) if ckpt is not None else None
    return (*_parallelize(cfg, model, device), state)


def _start_files(run_dir: pathlib.Path, cfg: TrainConfig, identity: dict, prov: dict, *, resumed: bool,
                 step: int) -> pathlib.Path | None:
    """Rank 0: config.json (earlier configs kept in configs/; provenance is not compared) and
    metrics.jsonl cut back to the checkpoint's step. Returns the metrics file on rank 0, else None."""
    if not dist.is_main():
        return None
    metrics_path = run_dir / "metrics.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    save_run_config(run_dir, to_dict(cfg) | {"provenance": prov}, identity, atomic_write_json)
    old = metrics_path.read_text().splitlines() if resumed and metrics_path.exists() else []
    kept = [line for line in old if line.strip() and json.loads(line)["step"] <= step]
    atomic_write_text(metrics_path, "".join(line + "\n" for line in kept))  # drop records after the checkpoint
    return metrics_path


def _run(cfg: TrainConfig, sink: Callable[[dict], None] | None, rank: int, world: int,
         device: torch.device, t_start: float) -> dict[str, Any]:
    """The run: build, resume, then the optimiser step, top to bottom, until ``stop``."""
    run_dir = pathlib.Path(cfg.run_dir)
    index = read_index(cfg.data_dir)
    seq_len = int(index["seq_len"])
    mcfg, model, split = _build_model(cfg, index, rank, world)
    dp_rank, dp = (split.dp_rank, split.dp) if split else (rank, world)  # data follows the dp rank
    global_batch = cfg.micro_batch_size * cfg.grad_accum_steps * dp
    params = count_parameters(model)
    fpt = flops_per_token(mcfg, seq_len, mlm_probability=cfg.mlm_probability)

    resume_step = (checkpoint_steps(run_dir) or [0])[-1] if cfg.resume else 0
    identity = data_identity(index)
    if resume_step:  # refuse to continue a run under another configuration (labkit.train.run_config)
        check_resume(run_dir, to_dict(cfg), identity, allow_safe_changes=cfg.allow_safe_changes)
    ckpt = run_dir / "checkpoints" / f"step-{resume_step}" if resume_step else None
    model, optimizer, scaler, sharding, state = _load_and_wrap(cfg, model, device, split, ckpt, world)
    loader = make_loader(cfg.data_dir, batch_size=cfg.micro_batch_size, rank=dp_rank, world_size=dp,
                         seed=cfg.seed, mlm_probability=cfg.mlm_probability, vocab_size=mcfg.vocab_size,
                         num_workers=cfg.num_workers, pin_memory=device.type == "cuda",
                         seq_len=cfg.seq_len, tokenizer_sha256=_tokenizer_sha256(cfg.tokenizer_path),
                         verify=cfg.verify_data)  # refuses mismatched shards before any step
    sampler = _find_sampler(loader)
    heldout = _heldout_set(cfg, dp_rank, dp, mcfg.vocab_size, device)  # fixed masked held-out set
    # position: batches of this epoch consumed
    step, epoch, position, tokens_seen = _restore(state, model, optimizer, scaler, sampler, rank=rank, world=world,
                                                  sharding=sharding, where=f"step-{resume_step} in {run_dir}")
    prov = provenance.collect(device, start_time=provenance.now_iso())  # collective: every rank's host, device
    # rank 0 appends to metrics_file per record: no handle to leak
    metrics_file = _start_files(run_dir, cfg, identity, prov, resumed=state is not None, step=step)
    batches_iter = _iterate(loader)
    if state is not None:
        _set_rng_state(parallel.rank_entry(state, rank, split)["rng"])  # last, so nothing above consumes randomness

    stop = min(cfg.max_steps, cfg.stop_after or cfg.max_steps)
    peak = measure.peak_flops(device, cfg.precision)
    reduce, reduce_state, wire_bytes = compression_hook(cfg) if not split else (None, None, None)
    timer = measure.StepTimer(device, comm=None if split else time_gradient_collectives(
        model, device, reduce=reduce, reduce_state=reduce_state, wire_bytes=wire_bytes))
    timings: list[tuple] = []  # (tokens, samples, step time, wait, exposed comm or None) per step
    last_record, skipped = {}, 0
    windows = measure.PeakWindows(device)  # peak memory of the steps, each evaluation, each checkpoint
    model.train()
    while step < stop:
        timer.start()
        windows.start()
        # 1. fetch this rank's micro-batches, timing the wait (a new epoch reshuffles)
        micro_batches, wait = [], 0.0
        for _ in range(cfg.grad_accum_steps):
            t0 = time.perf_counter()
            batch = next(batches_iter, None)
            if batch is None:  # epoch over: reshuffle and start again
                epoch, position, batches_iter = epoch + 1, 0, _next_epoch(loader, sampler, epoch + 1, cfg, dp)
                batch = next(batches_iter)
            position += 1
            micro_batches.append(to_device(batch, device))
            wait += time.perf_counter() - t0
        # 2. set the learning rate (the schedule is a pure function of the step), count masked
        #    tokens globally, then forward/backward every micro-batch
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum, n_masked, n_tokens = _forward_backward(model, micro_batches, cfg, world, scaler, split)
        summed = dist.all_reduce_sum(torch.stack([loss_sum.double(), torch.tensor(wait, dtype=torch.float64,
                                                                                    device=loss_sum.device)]))
        loss = summed[0].item() / max(1, n_masked.item())
        wait_mean = summed[1].item() / world
        # 3. unscale (fp16), clip the global grad norm, step; a non-finite loss (or, fp32/bf16,
        #    grad norm) skips the step or raises
        grad_norm, finite = _clip_and_step(cfg, model, optimizer, scaler, loss, step)
        skipped += not finite
        optimizer.zero_grad(set_to_none=True)
        step += 1
        step_time = timer.stop()
        windows.end_step()
        comm_fields = timer.comm.step_fields() if timer.comm is not None else {}  # every rank: may all-reduce
        # 4. measure and record
        n_tokens_i = int(n_tokens.item())
        tokens_seen += n_tokens_i
        timings.append((n_tokens_i, global_batch, step_time, wait_mean, None if split else timer.comm_exposed_s))
        evaluated = _maybe_evaluate(model, heldout, cfg, step, stop, windows)  # held-out loss, outside the step time
        if step % cfg.log_every == 0 or step == stop or evaluated:
            tps = measure.tokens_per_s(n_tokens_i, step_time)
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens_seen,
                      "step_tokens": n_tokens_i, "n_masked": int(n_masked.item()), "tokens_per_s": tps,
                      "packing_efficiency": measure.packing_efficiency(n_tokens_i, global_batch, seq_len),
                      **_rates(global_batch, timer, step_time, wait_mean, model), **comm_fields,
                      "mfu": measure.mfu(tps, fpt, world, peak), **windows.take(), "world_size": world,
                      "global_batch_size": global_batch, "epoch": epoch, "skipped": not finite, **evaluated, "time": time.time()}
            last_record = _log(record, metrics_file, sink)
        if cfg.checkpoints and ((cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == stop):
            windows.around("checkpoint", _save, cfg, run_dir, model, optimizer, scaler, sampler, step=step, epoch=epoch,
                           position=position, tokens=tokens_seen, world=world, sharding=sharding)

    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()] \
        if metrics_file is not None and metrics_file.exists() else [last_record]
    result = _result(cfg, records, timings, fpt=fpt, peak=peak, world=world, global_batch=global_batch, step=step,
                     params=params, tokens_seen=tokens_seen, resume_step=resume_step, skipped=skipped, mcfg=mcfg,
                     index=index, device=device, sharding=sharding, t_start=t_start, prov=prov) | windows.maxima
    if dist.is_main():
        atomic_write_json(run_dir / "result.json", result)
    return result


def _parallelize(cfg: TrainConfig, model: torch.nn.Module, device: torch.device) -> tuple[Any, Any, Any, str]:
    """Applied from outside the model, in this order: move to ``device``, ``torch.compile``
    (``cfg.compile``; in place, so state-dict keys keep their names), wrap for data parallelism
    (DDP, or FSDP2 ``fully_shard``), then the optimiser (AdamW, or ZeRO-1) and the fp16 grad
    scaler. Returns (model, optimizer, scaler, sharding in effect: "none" in one process)."""
    model = model.to(device)
    if cfg.compile:
        model.compile()  # in place: state_dict keys unchanged (no _orig_mod prefix)
    model = dist.wrap_model(model, cfg, device)  # DDP, or FSDP2 fully_shard (in place)
    optimizer = build_optimizer(model, cfg)  # AdamW, or ZeroRedundancyOptimizer (zero1)
    scaler = dist.grad_scaler(model, device, enabled=cfg.precision == "fp16")
    sharding = cfg.sharding if torch.distributed.is_initialized() else "none"  # one process: nothing to shard
    return model, optimizer, scaler, sharding


def _clip_and_step(cfg: TrainConfig, model: torch.nn.Module, optimizer: Any, scaler: Any, loss: float,
                   step: int) -> tuple[float, bool]:
    """Unscale (fp16), clip the global grad norm (correct under any sharding), step. Returns
    (grad_norm, finite). A non-finite loss (or, in fp32/bf16, grad norm) skips the step, or raises
    FloatingPointError with ``on_nonfinite="raise"``; an fp16 overflow in the grads alone is the
    scaler's business: it skips that step and lowers the scale (finite is then False)."""
    fp16 = cfg.precision == "fp16"
    finite = math.isfinite(loss)
    grad_norm = float("nan")
    if finite or fp16:
        scaler.unscale_(optimizer)
        if isinstance(model, parallel.ParallelModel):  # across meshes and pipeline stages
            grad_norm = model.clip_grad_norm(cfg.grad_clip or float("inf"))
        else:
            grad_norm = dist.clip_grad_norm(model, cfg.grad_clip or float("inf"))  # global norm, any sharding
        finite = finite and (fp16 or math.isfinite(grad_norm))
    if not finite and cfg.on_nonfinite == "raise":
        raise FloatingPointError(f"step {step + 1}: non-finite loss {loss} / grad norm {grad_norm} "
                                 "(on_nonfinite='raise')")
    if finite or fp16:
        scale = scaler.get_scale() if fp16 else 1.0
        scaler.step(optimizer)  # fp16: skipped when the grads hold inf/nan
        scaler.update()
        finite = finite and not (fp16 and scaler.get_scale() < scale)
    return grad_norm, finite


def _log(record: dict, metrics_file: pathlib.Path | None, sink: Callable[[dict], None] | None) -> dict:
    """Rank 0: append ``record`` to metrics.jsonl (opened per record: no handle to leak) and send
    it to ``sink``. Returns the record."""
    if metrics_file is not None:
        with open(metrics_file, "a") as f:
            f.write(json.dumps(record) + "\n")
        if sink is not None:
            sink(record)
    return record


def _save(cfg: TrainConfig, run_dir: pathlib.Path, model: torch.nn.Module, optimizer: Any, scaler: Any,
          sampler: Any, *, step: int, epoch: int, position: int, tokens: int, world: int, sharding: str) -> None:
    """Collective: checkpoint step-N (``labkit.train.checkpoint.save_checkpoint``) with the
    optimiser (gathered), scaler, step, epoch and tokens, and per rank the RNG states and the
    batches consumed, in RankSampler's state format (with workers the sampler itself runs ahead
    of the trainer, so ``position`` is the trainer's). A split model: ``save_split_checkpoint``
    (weights and optimiser through torch.distributed.checkpoint) with its split."""
    per_rank = {"rng": _rng_state(), "sampler": {**sampler.state_dict(), "epoch": epoch, "position": position}}
    if isinstance(model, parallel.ParallelModel):
        save_split_checkpoint(run_dir, step, model, optimizer,
                              {"format": 1, "step": step, "epoch": epoch, "tokens": tokens, "lr": lr_at(step, cfg),
                               "scaler": scaler.state_dict(), "world_size": world, "sharding": sharding,
                               "split": parallel.split_record(model.split, cfg)}, per_rank, keep=cfg.keep_checkpoints)
        return
    save_checkpoint(run_dir, step, model,
                    {"format": 1, "step": step, "epoch": epoch, "tokens": tokens,
                     "optimizer": dist.optimizer_state_dict(model, optimizer),  # collective
                     "lr": lr_at(step, cfg), "scaler": scaler.state_dict(), "world_size": world,
                     "sharding": sharding},
                    per_rank, keep=cfg.keep_checkpoints)


def _next_epoch(loader: Any, sampler: Any, epoch: int, cfg: TrainConfig, world: int) -> Any:
    """A fresh iterator over ``loader`` for ``epoch`` (the sampler reshuffles). ValueError when
    the shards hold fewer sequences than one batch of every rank."""
    sampler.set_epoch(epoch)
    batches = _iterate(loader)
    first = next(batches, None)
    if first is None:
        raise ValueError(f"data_dir: {cfg.data_dir} holds too few sequences for "
                         f"micro_batch_size {cfg.micro_batch_size} x {world} ranks")
    return itertools.chain([first], batches)


def _rates(global_batch: int, timer: measure.StepTimer, step_time: float, wait_mean: float,
           model: Any = None) -> dict[str, Any]:
    """The per-step rates of a metrics record (docs/measurement.md): the step timer's CPU seconds
    and exposed gradient communication (rank 0's; None for a split model, whose collectives the
    timer does not see), and with a split ``model`` its measured pipeline bubble and time in TP
    collectives (``parallel.measures``: collective; None for both otherwise)."""
    split = isinstance(model, parallel.ParallelModel)
    return {"samples_per_s": measure.samples_per_s(global_batch, step_time), "step_time_s": step_time,
            "comm_exposed_s": None if split else timer.comm_exposed_s, "cpu_s": timer.cpu_s,
            "thread_cpu_s": timer.thread_cpu_s, "data_wait_s": wait_mean,
            "data_wait_fraction": measure.data_wait_fraction(wait_mean, step_time), **parallel.measures(model)}


def _result(cfg: TrainConfig, records: list[dict], timings: list[tuple], *, fpt: float,
            peak: float | None, world: int, global_batch: int, step: int, params: dict, tokens_seen: int,
            resume_step: int, skipped: int, mcfg: Any, index: dict, device: torch.device, sharding: str,
            t_start: float, prov: dict) -> dict[str, Any]:
    """result.json: losses, the last held-out evaluation, throughput over the timed steps (after
    ``cfg.timing_warmup_steps``), sizes and settings, and the provenance with the end time."""
    seq_len, vocab_size = int(index["seq_len"]), int(index["vocab_size"])
    timed = timings[cfg.timing_warmup_steps:] or timings  # too short a run: time every step
    tok, samples, seconds, wait_s = (sum(t[i] for t in timed) for i in range(4))
    exposed = [t[4] for t in timed if t[4] is not None]  # none for a split model
    exposed_s = sum(exposed) if exposed else None
    tps = measure.tokens_per_s(tok, seconds) if timed else None
    evals = [r for r in records if r.get("eval_loss") is not None]
    result = {"initial_loss": records[0].get("loss") if records else None,
              "final_loss": records[-1].get("loss") if records else None,
              "eval_loss": evals[-1]["eval_loss"] if evals else None,
              "perplexity": evals[-1]["perplexity"] if evals else None,
              "tokens_per_s": tps,
              "samples_per_s": measure.samples_per_s(samples, seconds) if timed else None,
              "data_wait_fraction": measure.data_wait_fraction(wait_s, seconds) if timed else None,
              "comm_exposed_s": exposed_s / len(exposed) if exposed else None,  # mean per timed step, rank 0
              "comm_exposed_fraction": exposed_s / seconds if exposed else None,
              "packing_efficiency": measure.packing_efficiency(tok, samples, seq_len) if timed else None,
              "packing": packing_of(index),
              "mfu": measure.mfu(tps, fpt, world, peak) if tps else None,
              "world_size": world, "global_batch_size": global_batch, "steps": step,
              "max_steps": cfg.max_steps, "params": params["total"],
              "non_embedding_params": params["non_embedding"], "flops_per_token": fpt, "tokens": tokens_seen,
              "peak_mem_bytes": max((r.get("peak_mem_bytes") or 0) for r in records) if records else None,
              "resumed_from_step": resume_step or None, "skipped_steps": skipped, "model": cfg.model,
              "model_config": to_dict(mcfg), "seq_len": seq_len, "vocab_size": vocab_size,
              "device": str(device), "precision": cfg.precision, "sharding": sharding,
              "activation_checkpointing": mcfg.activation_checkpointing, "wall_s": time.time() - t_start,
              "provenance": prov | {"end_time": provenance.now_iso()}}
    dp = global_batch // (cfg.micro_batch_size * cfg.grad_accum_steps)
    return result | parallel.result_fields(cfg, dp, records)  # the split, its measured means
