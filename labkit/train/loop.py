"""MLM pretraining: ``train(cfg)`` runs one run in this process, as one rank of many or alone.

The optimiser step reads top to bottom in ``train`` (as nanoGPT's main loop does); the
micro-batch part (count, forwards, backwards) is ``Runtime.forward_backward``
(``labkit.train.runtime``), so the multi-rank gradient tests exercise exactly the code ``train`` runs.

Loss normalisation (``pytorch/torchtitan: torchtitan/trainer.py``):
the number of masked tokens over every micro-batch of the step on every dp rank is all-reduced
once, before the forwards; each micro-batch's loss is ``loss_sum * dp / n_masked_global``
so that the gradient average over dp gives the gradient of (sum of CE over all masked
tokens of the global batch) / (their count), the same as one process on the whole batch.

Run directory (rank 0 writes): config.json (with the run's ``run_id``), metrics.jsonl (one record
per log step, appended and flushed), checkpoints/step-N/, result.json (atomic). Rank 0 alone
decides where the run starts (``checkpoint.plan_run``) and every rank checks it can read that
checkpoint (``checkpoint.agree_on_plan``): the newest checkpoint when resuming, and it must carry
config.json's run id; a new run in a used run_dir first moves the old run's files to
run_dir/previous/<UTC time>-<old run id>/. A checkpoint holds the run's state
(``labkit.train.resume.RunState``: weights, optimiser, step, data position, scaler, the comm hook's
and the noise scale's state, RNG), saved and loaded as one by ``checkpoint.Checkpointer``
(torch.distributed.checkpoint, each rank its own part, a marker last, optionally asynchronously).
It loads at another world size, sharding or split: the global batch is kept by accumulation
(``_keep_global_batch``) and the sampler continues the global sample order. The LR is a pure
function of the step (``lr_at``), so the step is the whole scheduler state. Resume needs a config
and data that match the run directory's config.json / data.json (``labkit.train.run_config``:
one-line refusal naming each field).

Every run is a (pp, dp, tp) mesh, data parallelism alone being pp = tp = 1, built by one builder
(``labkit.train.parallel.build``) and stepped through one ``labkit.train.runtime.Runtime``
whatever the split: its ``forward_backward``, ``clip_grad_norm`` (every mesh dimension and
pipeline stage), its timer of the dp gradient collectives and its per-step measures
(``comm_exposed_s``, ``pipeline_bubble``, ``tp_comm_s``: the last two 0.0 when not split that way).
Data (sampler, masked-token count, held-out set) follows the dp rank;
global batch = micro_batch_size * grad_accum_steps * dp.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import math
import os
import pathlib
import sys
import time
import traceback
import warnings
from typing import Any, Callable

import torch

from labkit import measure
from labkit.config import TrainConfig, to_dict
from labkit.data.mlm import make_loader
from labkit.data.shards import ShardSet, open_shards, packing_of
from labkit.io import atomic_write_json, atomic_write_text
from labkit.model import BertMLM, count_parameters, flops_per_token
from labkit.train import dist, parallel, provenance, rng, sinks, status
from labkit.train.checkpoint import Checkpointer, agree_on_plan, plan_run
from labkit.train.comm import all_reduce_with_sideband
from labkit.train.optim import lr_at
from labkit.train.straggler import culprit
from labkit.train.timeline import Timeline, read_timeline
from labkit.train.run_config import (check_resume, data_identity, finished_run, model_config_of, save_run_config,
                                     with_segments)
from labkit.train.resume import RunState
from labkit.train.runlock import RunLock, RunLocked
from labkit.train.runtime import Runtime, build_runtime

__all__ = ["Run", "to_device", "train"]

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




def _rank_data(cfg: TrainConfig, data: ShardSet, runtime: Runtime, vocab_size: int, device: torch.device) -> tuple:
    """This rank's data, which follows its dp rank: (the MLM ``DataLoader``, its ``RankSampler``,
    the fixed masked held-out set or None; ``_heldout_set``)."""
    loader = make_loader(data, batch_size=cfg.batch.micro_batch_size, rank=runtime.dp_rank, world_size=runtime.dp,
                         seed=cfg.seed, mlm_probability=cfg.data.mlm_probability, vocab_size=vocab_size,
                         num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda")
    return loader, _find_sampler(loader), _heldout_set(cfg, data, runtime.dp_rank, runtime.dp, device)


def _heldout_set(cfg: TrainConfig, data: ShardSet, rank: int, world: int, device: torch.device) -> Any:
    """The fixed masked held-out set (``labkit.train.evaluation.HeldoutSet``) of this rank from the
    run's opened shard set ``data``, or None when eval.enabled is false, or eval.every is 0 and the
    shards have no held-out split (then no evaluation runs)."""
    from labkit.train.evaluation import HeldoutSet

    if not cfg.eval.enabled or (cfg.eval.every == 0 and not data.index.get("heldout")):
        return None
    return HeldoutSet(data, rank=rank, world_size=world,
                      mlm_probability=cfg.data.mlm_probability, max_sequences=cfg.eval.sequences,
                      batch_size=cfg.eval.batch_size or cfg.batch.micro_batch_size, device=device)


def _maybe_evaluate(model: torch.nn.Module, heldout: Any, cfg: TrainConfig, step: int, stop: int,
                    windows: measure.PeakWindows | None = None) -> dict[str, Any]:
    """Collective: {"eval_loss", "perplexity", "eval_masked", "eval_sequences",
    "eval_peak_mem_bytes" (its own peak window in ``windows``)} at the steps that evaluate (every
    eval_every, and the last), else {}."""
    from labkit.train.evaluation import evaluate

    if heldout is None or not ((cfg.eval.every and step % cfg.eval.every == 0) or step == stop):
        return {}
    status.update(phase="evaluate")
    if windows is None:
        return evaluate(model, heldout, precision=cfg.precision)
    out, peak = windows.around("eval", evaluate, model, heldout, precision=cfg.precision)
    return out | {"eval_peak_mem_bytes": peak}


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------


def train(cfg: TrainConfig, *, sink: Callable[[dict], None] | None = None,
          timeline_sink: Callable[[list[dict]], None] | None = None) -> dict[str, Any]:
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
    ``cfg.resume`` (rank 0 says so on stderr, one line with the step; a finished
    run of the same config is returned as saved); ``resume=False`` starts a new run, the files of an
    earlier one moved to run_dir/previous/. Rank 0 holds run_dir/lock.json while it runs
    (``labkit.train.runlock``: a second job is refused in one line naming the holder); with a process
    group each rank keeps run_dir/ranks/rank-<r>.json fresh and a failed collective ends in one line
    naming the rank that stopped answering (``labkit.train.status``). Raises ``FloatingPointError`` on
    a non-finite loss when on_nonfinite="raise", ``ValueError`` naming the field for inconsistent
    settings; shard errors come from
    ``labkit.data.shards``. A process group this call creates is destroyed before it returns.
    Rank 0 also sends each record to the sinks named in ``cfg.measure.trackers`` (``labkit.train.sinks``:
    TensorBoard event files under run_dir/tensorboard by default); config.json and result.json
    carry the run's ``provenance`` (``labkit.train.provenance.collect``). Every rank records its step
    timeline (``labkit.train.timeline``; ``cfg.measure.timeline``) in run_dir/timeline and hands its recent
    rows to ``timeline_sink`` (the engines' live view); result.json then carries the run's
    ``culprit`` (``labkit.train.straggler.culprit``, None when no rank holds the others up) and
    its wall-clock ``goodput`` and ``badput_*`` (``labkit.measure.goodput``).
    """
    # a finished run of this config, resumed: its result as saved, no file opened or written (resume=False: a new run)
    done = finished_run(cfg) if cfg.resume else None
    if done is not None:
        return done
    t_start = time.time()
    rank, local_rank, world = dist.dist_info()
    device = dist.resolve_device(cfg.device, local_rank)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    owns_group = not torch.distributed.is_initialized()
    # rank 0: the run_dir's lock (one job at a time), then the resume step and run id; a new run first moves a used
    # run_dir's files aside (before the sinks open there). A refusal reaches every rank through agree_on_plan.
    lock, plan = _lock_and_plan(cfg, t_start) if rank == 0 else (None, None)
    trackers = sinks.open_sinks(cfg.measure.trackers, cfg.run_dir, main=rank == 0 and lock is not None)  # rank 0 writes
    try:
        dist.init_distributed(cfg.backend, cfg.timeout_s, device)
        result = _run(cfg, sinks.fan_out(sink, trackers), rank, world, device, t_start, plan, timeline_sink)
        status.finish("done")
        return result
    except BaseException as err:  # the failed run's frames hold the model and its process group: clear them, so
        traceback.clear_frames(err.__traceback__)  # the group's sockets close at teardown and the other ranks'
        # collectives fail at once instead of at the collective timeout (an engine lives on after the error);
        # a failed collective ends in one line naming the rank that stopped answering (labkit.train.status)
        line = status.explain(err, cfg.run_dir, world, rank, cfg.timeout_s)
        status.finish("failed")
        if line is not None:
            raise RuntimeError(line) from err
        raise
    finally:
        for tracker in trackers:
            tracker.close()
        if owns_group:
            dist.teardown()
            gc.collect()  # what still held the group (reference cycles) goes now, with its connections
        if lock is not None:
            lock.release()


def _lock_and_plan(cfg: TrainConfig, t_start: float) -> tuple[RunLock | None, dict]:
    """Rank 0: take run_dir's lock (``labkit.train.runlock``), then ``plan_run`` (with this
    invocation's ``segment_start``). When a live job holds it: (None, a plan carrying the one-line
    refusal naming the holder)."""
    try:
        lock = RunLock(cfg.run_dir).acquire()
    except (RunLocked, OSError) as err:
        message = str(err) if isinstance(err, RunLocked) else f"run_dir: cannot take the lock of {cfg.run_dir}: {err}"
        return None, {"step": 0, "run_id": None, "set_aside": None, "error": message, "global_batch_size": None,
                      "segment_start": t_start}
    return lock, plan_run(cfg.run_dir, cfg.resume) | {"segment_start": t_start}


def _build_model(cfg: TrainConfig, index: dict, rank: int, world: int,
                 device: torch.device) -> tuple[Any, BertMLM]:
    """The model config for the shards' vocabulary (``parallel.check_split`` refuses a split that
    cannot work) and ``BertMLM`` built from ``cfg.seed`` (the same init on every rank), then each
    rank's dropout streams seeded on ``device`` (``labkit.train.rng.seed_streams``). ValueError when
    the shards' sequence length exceeds the model's positions."""
    seq_len, vocab_size = int(index["seq_len"]), int(index["vocab_size"])
    mcfg = model_config_of(cfg, vocab_size)
    if seq_len > mcfg.max_position_embeddings:
        raise ValueError(f"model_overrides: shards in {cfg.data_dir} have seq_len {seq_len} > "
                         f"max_position_embeddings {mcfg.max_position_embeddings}")
    if mcfg.position_embedding == "instruction" and "[NEXT]" not in index["special_ids"]:
        raise ValueError(f"model_overrides: position_embedding 'instruction' counts [NEXT] tokens, but the shards in "
                         f"{cfg.data_dir} come from a tokenizer without [NEXT] (special_ids {index['special_ids']})")
    parallel.check_split(cfg, mcfg, world, seq_len, rank)
    torch.manual_seed(cfg.seed)  # identical init on every rank (DDP also broadcasts rank 0's)
    model = BertMLM(mcfg)
    rng.seed_streams(cfg.seed, rank, world, cfg.parallel.tp, device)  # dropout: one stream per rank, and with tp a
    return mcfg, model  # shared one for the replicated regions of the tp group (labkit.train.rng)


def _agree(plan: dict | None, run_dir: pathlib.Path, cfg: TrainConfig, rank: int, world: int) -> dict:
    """Collective: rank 0's plan on every rank (``checkpoint.agree_on_plan``: its refusal raised on
    every rank), then, with 2 or more ranks, this rank's status file run_dir/ranks/rank-<r>.json
    kept fresh from here on (``labkit.train.status``: heartbeat, step, phase, collective, stack)."""
    plan = agree_on_plan(plan, run_dir)
    if world > 1:  # run_ddp's (started on the engine before this call), else one of this call's own
        status.begin(run_dir / "ranks", rank, world, timeout_s=cfg.timeout_s, run_id=plan["run_id"],
                     token=f"{plan['run_id']}-{plan['segment_start']:.3f}")
    return plan


def _keeps_global_batch(given: TrainConfig, plan: dict, world: int) -> bool:
    """Whether ``given`` (as the user set it) makes the checkpoint's global batch at this world size:
    then a grad_accum_steps that differs from the saved config's is the same step split otherwise."""
    dp = world // (given.parallel.tp * given.parallel.pp)
    return plan.get("global_batch_size") == given.batch.micro_batch_size * given.batch.grad_accum_steps * dp


def _keep_global_batch(cfg: TrainConfig, saved: int | None, dp: int) -> TrainConfig:
    """``cfg`` with grad_accum_steps such that micro_batch_size x grad_accum_steps x dp is the
    checkpoint's global batch ``saved`` (None: a fresh run, or a checkpoint without one: ``cfg`` as it
    is): fewer data-parallel ranks accumulate more micro-batches. ValueError (one line) when
    ``saved`` is not a multiple of micro_batch_size x dp."""
    if not saved or saved == cfg.batch.micro_batch_size * cfg.batch.grad_accum_steps * dp:
        return cfg
    accum, rest = divmod(saved, cfg.batch.micro_batch_size * dp)
    if rest or accum < 1:
        raise ValueError(f"grad_accum_steps: the checkpoint's global batch {saved} is not micro_batch_size "
                         f"{cfg.batch.micro_batch_size} x dp {dp} x a whole number of accumulation steps (resume at "
                         "a dp "
                         f"dividing {saved} / micro_batch_size)")
    return cfg.replace(batch={"grad_accum_steps": accum})


def _branch_point(cfg: TrainConfig) -> pathlib.Path | None:
    """``cfg.checkpoint.init_from`` (another run's checkpoint a new run starts from: a branch), or
    None. FileNotFoundError (one line) when it is not a complete checkpoint."""
    from labkit.train.checkpoint import is_complete

    if cfg.checkpoint.init_from is None:
        return None
    path = pathlib.Path(cfg.checkpoint.init_from)
    if not is_complete(path):
        raise FileNotFoundError(f"checkpoint.init_from: {path} is not a complete checkpoint directory")
    return path


def _start_files(run_dir: pathlib.Path, cfg: TrainConfig, identity: dict, prov: dict, *, resumed: bool,
                 step: int, run_id: str) -> pathlib.Path | None:
    """Rank 0: config.json with the run's ``run_id`` (earlier configs kept in configs/; provenance
    is not compared) and metrics.jsonl cut back to the checkpoint's step. A torn last line (a crash
    during its append) is dropped with a warning naming the file and line; an unreadable line
    before the last is a ValueError naming both. Returns the metrics file on rank 0, else None."""
    if not dist.is_main():
        return None
    metrics_path = run_dir / "metrics.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    save_run_config(run_dir, to_dict(cfg) | {"run_id": run_id, "provenance": prov}, identity, atomic_write_json)
    old = metrics_path.read_text().splitlines() if resumed and metrics_path.exists() else []
    kept = []
    for number, line in enumerate(old, 1):
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            if number < len(old):
                raise ValueError(f"{metrics_path}: line {number} is not a JSON record") from None
            warnings.warn(f"{metrics_path}: line {number} is torn (cut off during its append); dropped on resume",
                          stacklevel=2)
            continue
        if record is not None and record["step"] <= step:
            kept.append(line)
    atomic_write_text(metrics_path, "".join(line + "\n" for line in kept))  # drop records after the checkpoint
    return metrics_path


@dataclasses.dataclass
class Run:
    """One invocation of a run on this rank (``_start`` builds it; the loop in ``_run`` reads and
    advances it): the config as run (``cfg``: the accumulation that keeps a checkpoint's global
    batch) and as given (``given``: config.json's), where it sits (``rank``, ``world``, ``device``),
    what it is (``run_id``, ``resume_step``: the checkpoint it continued, 0 for a fresh run; the
    opened shard set ``data``, the model config ``mcfg``, its ``params`` counts and FLOPs per token
    ``fpt``), its ``runtime`` (the builder's model, optimiser, scaler and the step),
    ``state`` (``RunState``: everything that shapes the next step), the ``loader`` and held-out set,
    the ``checkpointer`` and ``timeline``, the run files (``prov``, ``metrics_file``: rank 0's), and
    the measures (``timer``, peak memory ``windows``, ``timings`` per step, ``skipped`` steps)."""

    cfg: TrainConfig
    given: TrainConfig
    rank: int
    world: int
    device: torch.device
    t_start: float
    run_id: str
    resume_step: int
    data: ShardSet
    mcfg: Any
    params: dict
    fpt: float
    runtime: Runtime
    state: RunState
    loader: Any
    heldout: Any
    checkpointer: Checkpointer
    timeline: Timeline
    prov: dict = dataclasses.field(default_factory=dict)
    metrics_file: pathlib.Path | None = None
    timer: Any = None
    windows: Any = None
    timings: list = dataclasses.field(default_factory=list)  # (tokens, samples, step s, wait s, exposed s) per step
    skipped: int = 0
    last_record: dict = dataclasses.field(default_factory=dict)

    @property
    def run_dir(self) -> pathlib.Path:
        return pathlib.Path(self.cfg.run_dir)

    @property
    def stop(self) -> int:
        """The step this invocation ends after (``stop_after``, a simulated interruption, or max_steps)."""
        return min(self.cfg.max_steps, self.cfg.stop_after or self.cfg.max_steps)

    @property
    def global_batch(self) -> int:
        """Sequences per optimiser step: micro_batch_size x grad_accum_steps x dp (data follows the dp rank)."""
        return self.cfg.batch.micro_batch_size * self.cfg.batch.grad_accum_steps * self.runtime.dp

    @property
    def sharding(self) -> str:
        return self.state.sharding


def _run(cfg: TrainConfig, sink: Callable[[dict], None] | None, rank: int, world: int, device: torch.device,
         t_start: float, plan: dict | None, timeline_sink: Callable[[list[dict]], None] | None) -> dict[str, Any]:
    """The run: build and resume (``_start``), then the optimiser step, top to bottom, until
    ``Run.stop``. ``plan``: rank 0's ``plan_run`` (None on the other ranks)."""
    run = _start(cfg, plan, rank, world, device, t_start, timeline_sink)
    cfg, rt, state, tl = run.cfg, run.runtime, run.state, run.timeline
    batches = _iterate(run.loader)  # fork_rng: draws nothing from the restored streams
    rt.parts.train()
    while state.step < run.stop:
        status.update(step=state.step + 1, phase="train")  # run_dir/ranks/rank-<r>.json (labkit.train.status)
        cfg = _ramp(run)  # the global batch from this step on (labkit.train.ramp: fixed, a ramp, or critical)
        run.timer.start()
        run.windows.start()
        tl.start(state.step + 1)
        # 1. fetch this rank's micro-batches, timing the wait (a new epoch reshuffles)
        micro_batches, wait, batches = tl.around("data", _fetch, batches, run.loader, state, cfg, rt.dp, device)
        # 2. set the learning rate (the schedule is a pure function of the step), count masked
        #    tokens globally, then forward/backward every micro-batch
        lr = lr_at(state.step, cfg) * state.ramp.lr_factor  # batch.lr_rule at the ramp's batch (1 when fixed)
        for group in rt.optimizer.param_groups:
            group["lr"] = lr
        loss_sum, n_masked, n_tokens = rt.forward_backward(micro_batches, mark=tl.mark)
        summed = all_reduce_with_sideband(torch.stack([loss_sum.double(), torch.tensor(  # + the observers' sums (gns)
            wait, dtype=torch.float64, device=loss_sum.device)]), rt.comm)
        loss, wait_mean = summed[0].item() / max(1, n_masked.item()), summed[1].item() / world
        tl.mark("sync")
        # 3. unscale (fp16), clip the global grad norm, step; a non-finite loss (or, fp32/bf16,
        #    grad norm) skips the step or raises
        grad_norm, finite = tl.around("optimizer", _clip_and_step, cfg, rt, loss, state.step)
        run.skipped += not finite
        rt.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        step_time = run.timer.stop()
        run.windows.end_step()
        # 4. measure (collective: every rank, every step), evaluate, record, checkpoint
        measures = rt.step_measures(run.timer)
        n_tokens_i = int(n_tokens.item())
        state.tokens += n_tokens_i
        run.timings.append((n_tokens_i, run.global_batch, step_time, wait_mean, measures["comm_exposed_s"]))
        evaluated = tl.around("eval", _maybe_evaluate, rt.parts, run.heldout, cfg, state.step, run.stop, run.windows)
        if state.step % cfg.measure.log_every == 0 or state.step == run.stop or evaluated:
            values = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "step_tokens": n_tokens_i,
                      "n_masked": int(n_masked.item()), "skipped": not finite, **measures, **evaluated}
            run.last_record = _log(_record(run, values, step_time, wait_mean), run.metrics_file, sink)
        state.ramp.decide(state.step, measures)  # critical: the noise scale may double the next step's batch
        if cfg.checkpoint.enabled and ((cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0)
                                       or state.step == run.stop):
            tl.around("checkpoint", run.windows.around, "checkpoint", run.checkpointer.save, state.step, state)
        tl.end(step_s=step_time, comm_exposed_s=measures["comm_exposed_s"])
    run.checkpointer.close()  # the last asynchronous save written and published
    return _finish(run)


def _start(cfg: TrainConfig, plan: dict | None, rank: int, world: int, device: torch.device, t_start: float,
           timeline_sink: Callable[[list[dict]], None] | None) -> Run:
    """Everything before the first step: rank 0's plan agreed by every rank, the shards opened once,
    the model built from the seed and by the one builder (``build_runtime``), this rank's data, the
    run state continued from the plan's checkpoint or ``checkpoint.init_from`` (``Checkpointer.load``:
    weights, optimiser, counters, sampler, scaler, hook, noise scale, batch ramp, RNG last), the run files."""
    run_dir = pathlib.Path(cfg.run_dir)
    plan = _agree(plan, run_dir, cfg, rank, world)  # collective: rank 0's plan on every rank, or one refusal
    given, cfg = cfg, _keep_global_batch(cfg, plan.get("global_batch_size"),
                                         world // (cfg.parallel.tp * cfg.parallel.pp))
    data = open_shards(cfg.data_dir, seq_len=cfg.data.seq_len, verify=cfg.data.verify_data,  # the run's one opening:
                       tokenizer_sha256=_tokenizer_sha256(cfg.data.tokenizer_path))  # index read once, ids recorded
    mcfg, model = _build_model(cfg, data.index, rank, world, device)
    resume_step, identity = plan["step"], data_identity(data.index)
    if resume_step:  # refuse to continue a run under another configuration (labkit.train.run_config)
        check_resume(run_dir, to_dict(given), identity, allow_safe_changes=cfg.allow_safe_changes,
                     same_global_batch=_keeps_global_batch(given, plan, world))  # grad_accum_steps set by hand
    ckpt = run_dir / "checkpoints" / f"step-{resume_step}" if resume_step else _branch_point(cfg)
    params = count_parameters(model)
    runtime = build_runtime(cfg, model, device)  # the one builder; the step on the (pp, dp, tp) mesh
    loader, sampler, heldout = _rank_data(cfg, data, runtime, mcfg.vocab_size, device)  # held out: fixed, masked
    run = Run(cfg=cfg, given=given, rank=rank, world=world, device=device, t_start=t_start, run_id=plan["run_id"],
              resume_step=resume_step, data=data, mcfg=mcfg, params=params, runtime=runtime,
              fpt=flops_per_token(mcfg, int(data.index["seq_len"]), mlm_probability=cfg.data.mlm_probability),
              state=RunState(cfg, runtime, sampler, plan["run_id"]), loader=loader, heldout=heldout,
              checkpointer=Checkpointer(run_dir, keep=cfg.checkpoint.keep, asynchronous=cfg.checkpoint.asynchronous),
              timeline=Timeline(run_dir, rank=rank, world_size=world, resumed_from=resume_step, comm=runtime.comm,
                                enabled=cfg.measure.timeline, segment_start=plan["segment_start"],
                                publish=timeline_sink))
    if ckpt is not None:  # weights, optimiser, counters, sampler, scaler, hook, noise scale, ramp; RNG last
        run.checkpointer.load(ckpt, run.state)
    run.state.ramp.start(cfg, run.state.step, measured=runtime.noise is not None)  # or one refusal, nothing written
    if resume_step:  # one line from rank 0 on stderr
        dist.print0(f"train: resuming from step {run.state.step} (checkpoint {ckpt.name} in {run_dir})", file=sys.stderr)
    run.prov = provenance.collect(device, start_time=provenance.now_iso())  # collective: every rank's host, device
    run.metrics_file = _start_files(run_dir, given, identity, run.prov, resumed=ckpt is not None,
                                    step=run.state.step, run_id=run.run_id)
    if dist.is_main():
        run.state.ramp.write(run_dir)  # batch_changes.jsonl (a resumed run's: cut back to its checkpoint)
    run.timer = measure.StepTimer(device, comm=runtime.comm)  # the dp gradient collectives, every mode
    run.windows = measure.PeakWindows(device)  # peak memory of the steps, each evaluation, each checkpoint
    return run


def _ramp(run: Run) -> TrainConfig:
    """The config the next step trains at: ``run.cfg``, with the global batch the ramp makes due
    now (``labkit.train.ramp.BatchRamp.due``) through accumulation (``RunState.set_batch``); rank 0
    rewrites batch_changes.jsonl with the change."""
    due = run.state.ramp.due(run.state.step)
    if due is not None:
        run.state.set_batch(*due)
        run.cfg = run.cfg.replace(batch={"grad_accum_steps": run.state.ramp.grad_accum_steps})
        if dist.is_main():
            run.state.ramp.write(run.run_dir)
    return run.cfg


def _record(run: Run, values: dict[str, Any], step_time: float, wait_mean: float) -> dict[str, Any]:
    """One metrics record of the step just taken: ``values`` (loss, lr, grad norm, the step's tokens
    and masked count, skipped, the runtime's measures, the evaluation) with the run's rates and
    counters (docs/training.md, Metrics)."""
    state, tokens = run.state, values["step_tokens"]
    tps = measure.tokens_per_s(tokens, step_time)
    return {"step": state.step, **values, "tokens": state.tokens, "tokens_per_s": tps,
            "packing_efficiency": measure.packing_efficiency(tokens, run.global_batch, int(run.data.index["seq_len"])),
            **_rates(run.global_batch, run.timer, step_time, wait_mean),
            "mfu": measure.mfu(tps, run.fpt, run.world, measure.peak_flops(run.device, run.cfg.precision)),
            **run.windows.take(), "world_size": run.world, "global_batch_size": run.global_batch,
            "grad_accum_steps": run.cfg.batch.grad_accum_steps,
            "epoch": state.epoch, **run.checkpointer.take(), "time": time.time()}


def _finish(run: Run) -> dict[str, Any]:
    """After the last step: result.json from every record of this invocation (rank 0's metrics.jsonl),
    the measures, the run's ids and checkpoint times and the timeline's culprit and goodput
    (collective); rank 0 writes it covering the whole run (``run_config.with_segments``)."""
    path = run.metrics_file
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path is not None and path.exists() else [run.last_record]
    result = _result(run, records) | run.windows.maxima
    result |= {"run_id": run.run_id, "checkpoint_stall_s": run.checkpointer.stalls,
               "checkpoint_save_s": run.checkpointer.saved_s,
               **_timeline_fields(run.cfg, run.run_dir, run.timeline)}  # every rank's timeline closed
    if dist.is_main():  # result.json covers the whole run: every segment (run_config.with_segments)
        result = with_segments(run.run_dir, result, run.cfg.measure.timing_warmup_steps)
        atomic_write_json(run.run_dir / "result.json", result)
    return result


def _timeline_fields(cfg: TrainConfig, run_dir: pathlib.Path, timeline: Timeline) -> dict[str, Any]:
    """Close this rank's ``timeline`` (its rows into run_dir/timeline/rank-NNNNN.parquet), then,
    collective (a barrier: every rank has closed its own), on rank 0: the run's
    ``culprit`` over its last timed steps (``labkit.train.straggler.culprit``; None when no rank
    holds the others up) and its wall-clock ``goodput`` with each ``badput_*`` cause, up to now
    (``labkit.measure.goodput``), from every rank's timeline in run_dir (a file system the ranks
    share, as checkpoints need). {} without a timeline; other ranks get {}."""
    timeline.close()
    if not cfg.measure.timeline:
        return {}
    dist.barrier()
    if not dist.is_main():
        return {}
    frame = read_timeline(run_dir)
    if frame.height == 0:
        return {}
    found = culprit(frame, window=frame["step"].n_unique(), skip=cfg.measure.timing_warmup_steps)
    return {"culprit": found, **measure.goodput(frame, end=time.time())}


def _fetch(batches_iter: Any, loader: Any, state: RunState, cfg: TrainConfig, dp: int,
           device: torch.device) -> tuple[list[dict[str, Any]], float, Any]:
    """This rank's ``cfg.batch.grad_accum_steps`` micro-batches of the step, on ``device`` (``to_device``),
    and the seconds spent waiting for them; advances ``state``'s epoch and position (batches of the
    epoch consumed); at the end of an epoch the sampler reshuffles and the next one starts
    (``_next_epoch``). Returns (micro_batches, wait_s, the batch iterator)."""
    micro_batches, wait = [], 0.0
    for _ in range(cfg.batch.grad_accum_steps):
        t0 = time.perf_counter()
        batch = next(batches_iter, None)
        if batch is None:  # epoch over: reshuffle and start again
            state.epoch, state.position = state.epoch + 1, 0
            batches_iter = _next_epoch(loader, state.sampler, state.epoch, cfg, dp)
            batch = next(batches_iter)
        state.position += 1
        micro_batches.append(to_device(batch, device))
        wait += time.perf_counter() - t0
    return micro_batches, wait, batches_iter


def _clip_and_step(cfg: TrainConfig, runtime: Runtime, loss: float, step: int) -> tuple[float, bool]:
    """Unscale (fp16), clip the global grad norm (``Runtime.clip_grad_norm``: every mesh dimension
    and pipeline stage), step the runtime's optimiser through its scaler. Returns
    (grad_norm, finite). A non-finite loss (or, in fp32/bf16, grad norm) skips the step, or raises
    FloatingPointError with ``on_nonfinite="raise"``; an fp16 overflow in the grads alone is the
    scaler's business: it skips that step and lowers the scale (finite is then False)."""
    fp16, optimizer, scaler = cfg.precision == "fp16", runtime.optimizer, runtime.scaler
    finite = math.isfinite(loss)
    grad_norm = float("nan")
    if finite or fp16:
        scaler.unscale_(optimizer)
        grad_norm = runtime.clip_grad_norm(cfg.optim.grad_clip or float("inf"))  # global norm, any split
        finite = finite and (fp16 or math.isfinite(grad_norm))
    if not finite and cfg.on_nonfinite == "raise":
        raise FloatingPointError(f"step {step + 1}: non-finite loss {loss} / grad norm {grad_norm} "
                                 "(on_nonfinite='raise')")
    if finite or fp16:
        scale = scaler.get_scale() if fp16 else 1.0
        scaler.step(optimizer)  # fp16: skipped when the grads hold inf/nan
        scaler.update()
        finite = finite and not (fp16 and scaler.get_scale() < scale)
    status.step_done(step + 1)  # this rank's status file (labkit.train.status): optimiser step step + 1 is done
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


def _next_epoch(loader: Any, sampler: Any, epoch: int, cfg: TrainConfig, world: int) -> Any:
    """A fresh iterator over ``loader`` for ``epoch`` (the sampler reshuffles). ValueError when
    the shards hold fewer sequences than one batch of every rank."""
    sampler.set_epoch(epoch)
    batches = _iterate(loader)
    first = next(batches, None)
    if first is None:
        raise ValueError(f"data_dir: {cfg.data_dir} holds too few sequences for "
                         f"micro_batch_size {cfg.batch.micro_batch_size} x {world} ranks")
    return itertools.chain([first], batches)


def _rates(global_batch: int, timer: measure.StepTimer, step_time: float, wait_mean: float) -> dict[str, Any]:
    """The per-step rates of a metrics record (docs/measurement.md): samples per second, the step
    timer's wall and CPU seconds, and the mean data wait over ranks. ``comm_exposed_s``, the
    pipeline bubble and ``tp_comm_s`` are ``Runtime.step_measures``'."""
    return {"samples_per_s": measure.samples_per_s(global_batch, step_time), "step_time_s": step_time,
            "cpu_s": timer.cpu_s, "thread_cpu_s": timer.thread_cpu_s, "data_wait_s": wait_mean,
            "data_wait_fraction": measure.data_wait_fraction(wait_mean, step_time)}


def _result(run: Run, records: list[dict]) -> dict[str, Any]:
    """result.json: losses, the last held-out evaluation, throughput over the timed steps (after
    ``measure.timing_warmup_steps``), sizes and settings, and the provenance with the end time."""
    cfg, index, timings = run.cfg, run.data.index, run.timings
    seq_len, vocab_size = int(index["seq_len"]), int(index["vocab_size"])
    timed = timings[cfg.measure.timing_warmup_steps:] or timings  # too short a run: time every step
    tok, samples, seconds, wait_s = (sum(t[i] for t in timed) for i in range(4))
    exposed = [t[4] for t in timed if t[4] is not None]
    exposed_s = sum(exposed) if exposed else None
    tps = measure.tokens_per_s(tok, seconds) if timed else None
    evals = [r for r in records if r.get("eval_loss") is not None]
    peak = measure.peak_flops(run.device, cfg.precision)
    result = {"initial_loss": records[0].get("loss") if records else None,
              "final_loss": records[-1].get("loss") if records else None,
              "eval_loss": evals[-1]["eval_loss"] if evals else None,
              "perplexity": evals[-1]["perplexity"] if evals else None,
              "tokens_per_s": tps, "timed_seconds": seconds if timed else None,
              "samples_per_s": measure.samples_per_s(samples, seconds) if timed else None,
              "data_wait_fraction": measure.data_wait_fraction(wait_s, seconds) if timed else None,
              "comm_exposed_s": exposed_s / len(exposed) if exposed else None,  # mean per timed step, rank 0
              "comm_exposed_fraction": exposed_s / seconds if exposed else None,
              "packing_efficiency": measure.packing_efficiency(tok, samples, seq_len) if timed else None,
              "packing": packing_of(index),
              "mfu": measure.mfu(tps, run.fpt, run.world, peak) if tps else None,
              "world_size": run.world, "global_batch_size": run.global_batch, "steps": run.state.step,
              "max_steps": cfg.max_steps, "params": run.params["total"],
              "non_embedding_params": run.params["non_embedding"], "flops_per_token": run.fpt,
              "tokens": run.state.tokens,
              "peak_mem_bytes": max((r.get("peak_mem_bytes") or 0) for r in records) if records else None,
              "resumed_from_step": run.resume_step or None, "skipped_steps": run.skipped, "model": cfg.model,
              "batch_schedule": cfg.batch.schedule,
              "batch_changes": run.state.ramp.changes if cfg.batch.schedule != "fixed" else None,
              "model_config": to_dict(run.mcfg), "seq_len": seq_len, "vocab_size": vocab_size,
              "device": str(run.device), "precision": cfg.precision, "sharding": run.sharding,
              "activation_checkpointing": run.mcfg.activation_checkpointing, "wall_s": time.time() - run.t_start,
              "provenance": run.prov | {"end_time": provenance.now_iso()}}
    noisy = [r for r in records if r.get("b_simple") is not None]  # labkit.train.gns: the last EMA
    result |= {k: noisy[-1][k] if noisy else None for k in ("b_simple", "b_simple_low", "b_simple_high",
                                                            "b_simple_tokens")}
    return result | parallel.result_fields(cfg, run.runtime.dp, records)  # the split, its measured means
