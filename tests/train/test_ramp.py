"""The global batch over a run (labkit.train.ramp, ``batch.schedule``): a declared ramp and the
noise scale's ("critical") grow it through accumulation with the lr by batch.lr_rule, each change a
line of batch_changes.jsonl, and a run stopped mid-ramp and resumed is the uninterrupted run bit
for bit (losses, lr, batches, weights) at 2 gloo ranks, dropout on.

One spawn of 2 ranks runs, in order: the ramp run uninterrupted; the same stopped after step 3
(between its two changes: resumed at the accumulation of the first) and resumed; the critical run
uninterrupted; the same stopped after the step S at which it decided its first doubling (its
checkpoint holds the decision pending for step S + 1) and resumed."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch
import torch.multiprocessing as mp

from gloo_group import free_port, gloo_group
from labkit.config import TrainConfig, from_dict, to_dict

pytestmark = pytest.mark.torch_threads(1)

MICRO, RAMP_STEPS, CRITICAL_STEPS = 1, 8, 12
RAMP = [[2, 4], [5, 8]]  # from a starting global batch of 2 (micro-batch 1 x dp 2)


def _changes(run_dir: str | pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in (pathlib.Path(run_dir) / "batch_changes.jsonl").read_text().splitlines()]


def _records(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _worker(rank: int, world: int, port: int, entries: list) -> None:
    """train() each config in turn; ["stop-at-first-change", cfg, reference run_dir]: the config
    stopped after the step of the reference run's first change, then resumed to its end."""
    import torch.distributed as tdist

    from labkit.train import train

    with gloo_group(rank, world, port):
        for entry in entries:
            if isinstance(entry, list):
                cfg = from_dict(TrainConfig, json.loads(entry[1]))
                train(cfg.replace(stop_after=_changes(entry[2])[1]["step"]))
                train(cfg)
            else:
                train(from_dict(TrainConfig, json.loads(entry)))
            tdist.barrier()


def _cfg(shards: pathlib.Path, run_dir: pathlib.Path, **kw) -> TrainConfig:
    return TrainConfig(data_dir=str(shards), run_dir=str(run_dir), model="tiny", device="cpu", num_threads=1,
                       timeout_s=120, optim={"lr": 3e-3}, schedule={"warmup_steps": 2}, measure={"trackers": ()},
                       checkpoint={"every": 0, "keep": 1}, eval={"every": 0}, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> pathlib.Path:
    from tiny_shards import write_tiny_shards  # tests/ is on sys.path (pytest rootdir import)

    root = tmp_path_factory.mktemp("ramp")
    shards = write_tiny_shards(root / "shards", n_sequences=128)
    ramp = _cfg(shards, root / "ramp", max_steps=RAMP_STEPS,
                batch={"micro_batch_size": MICRO, "schedule": "ramp", "ramp": RAMP})
    critical = _cfg(shards, root / "critical", max_steps=CRITICAL_STEPS,
                    batch={"micro_batch_size": MICRO, "schedule": "critical"})
    entries = [json.dumps(to_dict(ramp)), json.dumps(to_dict(ramp.replace(run_dir=str(root / "ramp-stopped"),
                                                                            stop_after=3))),
               json.dumps(to_dict(ramp.replace(run_dir=str(root / "ramp-stopped")))),
               json.dumps(to_dict(critical)),
               ["stop-at-first-change", json.dumps(to_dict(critical.replace(run_dir=str(root / "critical-stopped")))),
                str(root / "critical")]]
    mp.spawn(_worker, args=(2, free_port(), entries), nprocs=2, join=True)
    return root


def _same_run(a: pathlib.Path, b: pathlib.Path, steps: int) -> None:
    """Bitwise: every record's loss, lr, grad norm and batch, the changes, the final weights."""
    from labkit.train.checkpoint import load_weights

    keys = ("step", "loss", "lr", "grad_norm", "global_batch_size", "grad_accum_steps", "b_simple", "b_simple_low")
    ra, rb = _records(a), _records(b)
    assert len(ra) == len(rb) == steps
    assert [[r[k] for k in keys] for r in ra] == [[r[k] for k in keys] for r in rb]
    assert _changes(a) == _changes(b)
    wa, wb = (load_weights(d / "checkpoints" / f"step-{steps}") for d in (a, b))
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


def _lr_follows_the_rule(records: list[dict], cfg: TrainConfig) -> None:
    """Each step's lr is lr_at(step) x sqrt(its global batch / the starting batch) (batch.lr_rule sqrt)."""
    from labkit.train.optim import lr_at

    base = records[0]["global_batch_size"]
    for r in records:
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg) * math.sqrt(r["global_batch_size"] / base), rel=1e-12)


def test_a_declared_ramp_grows_the_batch_by_accumulation_and_resumes_exactly(runs):
    records = _records(runs / "ramp")
    assert [(r["global_batch_size"], r["grad_accum_steps"]) for r in records] == \
        [(2, 1)] * 2 + [(4, 2)] * 3 + [(8, 4)] * 3  # after step 2: 4; after step 5: 8 (micro-batch 1 x dp 2)
    assert [(c["step"], c["global_batch_size"], c["grad_accum_steps"]) for c in _changes(runs / "ramp")] == \
        [(0, 2, 1), (2, 4, 2), (5, 8, 4)]
    _lr_follows_the_rule(records, _config(runs / "ramp"))
    result = json.loads((runs / "ramp" / "result.json").read_text())
    assert result["global_batch_size"] == 8 and result["batch_changes"] == _changes(runs / "ramp")
    _same_run(runs / "ramp", runs / "ramp-stopped", RAMP_STEPS)
    assert json.loads((runs / "ramp-stopped" / "result.json").read_text())["resumed_from_step"] == 3


def _config(run_dir: pathlib.Path) -> TrainConfig:
    saved = json.loads((run_dir / "config.json").read_text())
    return from_dict(TrainConfig, {k: v for k, v in saved.items() if k not in ("run_id", "provenance")})


def test_critical_doubles_when_the_noise_scale_allows_and_resumes_mid_decision_exactly(runs):
    records = _records(runs / "critical")
    changes = _changes(runs / "critical")
    assert len(changes) >= 2, "the noise scale never allowed a doubling: the test's premise"
    batches = [r["global_batch_size"] for r in records]
    for now, after in zip(records, records[1:]):  # the rule, from the recorded interval
        grew = after["global_batch_size"] > now["global_batch_size"]
        low = now["b_simple_low"]
        assert grew == (low is not None and low >= 2 * now["global_batch_size"]), now["step"]
        assert after["global_batch_size"] in (now["global_batch_size"], 2 * now["global_batch_size"])
    assert [c["step"] for c in changes[1:]] == [r["step"] for r, b in zip(records, batches[1:])
                                                if b > r["global_batch_size"]]
    assert "b_simple_low" in changes[1]["why"]
    _lr_follows_the_rule(records, _config(runs / "critical"))
    stopped = json.loads((runs / "critical-stopped" / "result.json").read_text())
    assert stopped["resumed_from_step"] == changes[1]["step"]  # its checkpoint held the pending doubling
    _same_run(runs / "critical", runs / "critical-stopped", CRITICAL_STEPS)


@pytest.mark.parametrize("batch, message", [
    ({"schedule": "ramp"}, "batch.ramp: batch.schedule 'ramp' needs at least one"),
    ({"ramp": [[10, 32]]}, "batch.ramp: is read only with batch.schedule = 'ramp', not 'fixed'"),
    ({"schedule": "ramp", "ramp": [[10, 32], [5, 64]]}, "batch.ramp: steps must be >= 1 and strictly ascending"),
    ({"schedule": "ramp", "ramp": [[10, 64], [20, 32]]}, "batch.ramp: global batch sizes must be positive and "
                                                         "strictly ascending"),
    ({"schedule": "ramp", "ramp": [10, 32]}, "batch.ramp: expected a list of [step, global_batch_size] pairs"),
    ({"max_global_batch_size": 64}, "batch.max_global_batch_size: is read only with batch.schedule = 'critical'"),
    ({"schedule": "growing"}, "batch.schedule: got 'growing'; allowed values are 'fixed', 'ramp', 'critical'"),
])
def test_bad_ramps_are_refused_in_one_line(batch, message):
    with pytest.raises(ValueError) as err:
        TrainConfig(data_dir="d", run_dir="r", batch=batch)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_pipeline_refuses_a_ramp():
    with pytest.raises(ValueError, match=r"^batch.schedule: 'critical' changes the micro-batches per step"):
        TrainConfig(data_dir="d", run_dir="r", batch={"schedule": "critical", "grad_accum_steps": 2},
                    parallel={"pp": 2, "sharding": "replicate"})


@pytest.mark.parametrize("batch, message", [
    ({"micro_batch_size": 4, "schedule": "ramp", "ramp": [[2, 6]]},
     "batch.ramp: global batch(es) [6] are not multiples of micro_batch_size 4 x dp 1 above the starting batch 4"),
    ({"micro_batch_size": 4, "schedule": "critical"},
     "batch.schedule: 'critical' reads the in-run noise scale, which this run does not measure"),
])
def test_a_ramp_this_run_cannot_train_is_refused_before_the_first_step(tmp_path, batch, message):
    from labkit.train import train
    from tiny_shards import write_tiny_shards

    cfg = _cfg(write_tiny_shards(tmp_path / "shards", n_sequences=16), tmp_path / "run", max_steps=4, batch=batch)
    with pytest.raises(ValueError) as err:
        train(cfg)
    assert str(err.value).startswith(message)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
