"""What a ``labkit`` command can check before it starts engines: presets, devices, paths, ranges.

Starting engines takes seconds (10-15 s on 2 cores); a misspelt preset or a missing path should
not cost them. Each ``check_*`` raises ``ValueError`` (or ``FileNotFoundError``) with one line
naming the key or flag, as the config loader does (``labkit.config.tomlfile``), and imports
neither torch nor ipyparallel: a refused value fails in a fraction of a second.

Engines re-check everything they use (a config built in a notebook never passes through here);
this module only moves the failures that need no engine to before the start-up.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import json
import os
import pathlib
from typing import Any

from labkit.config import ModelConfig, TrainConfig, did_you_mean
from labkit.config.tomlfile import LabConfig

__all__ = ["ENCODER", "check_device", "check_model", "check_prepare", "check_stage", "check_sweep", "check_train",
           "check_writable_dir", "check_writable_file", "has_cuda_device", "model_presets"]

ENCODER = pathlib.Path(__file__).resolve().parent / "model" / "encoder.py"


def model_presets() -> dict[str, dict]:
    """``labkit.model.MODEL_SIZES`` read from the source of ``labkit/model/encoder.py`` (its
    literal ``dict(...)`` entries, without importing torch); the imported table when the source
    holds something else (tests/test_cli.py checks that the two agree)."""
    try:
        tree = ast.parse(ENCODER.read_text())
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(target, ast.Name) and target.id == "MODEL_SIZES" and isinstance(node.value, ast.Dict):
                out = {}
                for key, value in zip(node.value.keys, node.value.values):
                    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "dict" and not value.args:
                        out[ast.literal_eval(key)] = {k.arg: ast.literal_eval(k.value) for k in value.keywords}
                    else:
                        out[ast.literal_eval(key)] = ast.literal_eval(value)
                return out
    except (OSError, SyntaxError, ValueError, AttributeError, TypeError):
        pass
    from labkit.model import MODEL_SIZES

    return dict(MODEL_SIZES)


def check_model(name: str, overrides: dict[str, Any], *, key: str = "train.model", vocab_size: int = 30522) -> None:
    """``name`` is a preset and ``overrides`` make a valid ``ModelConfig`` with it (the field
    checks of ``ModelConfig.__post_init__``). ValueError naming ``key`` or the override."""
    presets = model_presets()
    if name not in presets:
        raise ValueError(f"{key}: unknown model preset {name!r}; known presets are {', '.join(presets)}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"{key.rsplit('.', 1)[0]}.model_overrides: unknown fields {unknown}; "
                         + did_you_mean(unknown[0], sorted(fields), f"ModelConfig has {', '.join(sorted(fields))}"))
    shape = {k: v for k, v in presets[name].items() if k != "source"}
    try:
        ModelConfig(**{**shape, "vocab_size": vocab_size, **overrides})
    except (ValueError, TypeError) as err:
        raise ValueError(f"{key.rsplit('.', 1)[0]}.model_overrides: {err}") from None


def has_cuda_device() -> bool:
    """Whether this machine shows an NVIDIA device node (``/dev/nvidia0``...), without torch."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def check_device(cfg: TrainConfig, *, local: bool, key: str = "train") -> None:
    """``device = "cuda"`` (or ``backend = "nccl"``) on local engines of a machine without a GPU."""
    if not local:
        return
    if cfg.device == "cuda" and not has_cuda_device():
        raise ValueError(f"{key}.device: 'cuda' was asked for, but this machine has no NVIDIA device "
                         "(/dev/nvidia*); use device = \"auto\" or \"cpu\"")
    if cfg.backend == "nccl" and (cfg.device == "cpu" or not has_cuda_device()):
        raise ValueError(f"{key}.backend: 'nccl' needs CUDA devices; on CPU use backend = \"gloo\" (or \"auto\")")


def check_writable_dir(path: str | os.PathLike, key: str) -> None:
    """``path`` is, or can be made as, a directory this process writes in: it is a directory, or
    the nearest part of it that exists is one (not a file, not a broken link), which this user may
    create entries in (``os.access`` W_OK and X_OK) on a file system mounted read-write. ValueError
    (one line naming ``key``, the path and the part that is wrong) otherwise. Nothing is created."""
    p = pathlib.Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{key}: {path} is a file, not a directory")
    _check_writable_under(p, path, key)


def check_writable_file(path: str | os.PathLike, key: str) -> None:
    """``path`` can be written as a file: it is not a directory, and its directory is, or can be
    made as, one this process writes in (``check_writable_dir``'s rules). ValueError naming
    ``key`` otherwise. Nothing is created."""
    p = pathlib.Path(path).absolute()
    if p.is_dir():
        raise ValueError(f"{key}: {path} is a directory; give the file to write")
    _check_writable_under(p.parent, path, key)


def _check_writable_under(p: pathlib.Path, path: str | os.PathLike, key: str) -> None:
    """The nearest existing part of ``p`` is a directory this user may create entries in, on a
    file system mounted read-write (ValueError naming ``key`` and ``path``)."""
    probe = p
    while not probe.exists():
        if os.path.lexists(probe):
            raise ValueError(f"{key}: {path} cannot be made: {probe} is a broken symbolic link")
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{key}: {path} cannot be made: {probe} is a file, not a directory")
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        raise ValueError(f"{key}: {path} cannot be written: {probe} is on a read-only file system")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{key}: {path} cannot be written: no permission to create entries in {probe}")


def _index(data_dir: str, key: str) -> dict:
    path = pathlib.Path(data_dir) / "index.json"
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {data_dir} holds no shard set (index.json); run labkit prepare first")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{key}: {path} is not a readable shard index ({err})") from None


def check_train(cfg: TrainConfig, *, engines: int, local: bool, key: str = "train", run_dir: bool = True) -> None:
    """Everything of a training run that needs no engine: the run directory can be written
    (``check_writable_dir``), the shard set exists and matches the run (sequence length, tokenizer
    file, a held-out split when ``eval.every`` asks for one), the model preset and overrides, the
    device, and a tensor/pipeline split against the preset and the ``engines``
    (``labkit.config.split.check_split``). ``run_dir=False`` leaves the run directory out (a
    sweep's points write under its work directory instead)."""
    check_model(cfg.model, cfg.model_overrides, key=f"{key}.model")
    check_device(cfg, local=local, key=key)
    if run_dir:
        check_writable_dir(cfg.run_dir, f"{key}.run_dir")
    index = _index(cfg.data_dir, f"{key}.data_dir")
    data = cfg.data
    if data.seq_len is not None and data.seq_len != index.get("seq_len"):
        raise ValueError(f"{key}.data.seq_len: {data.seq_len}, but the shards in {cfg.data_dir} hold sequences of "
                         f"{index.get('seq_len')} tokens")
    if data.tokenizer_path is not None and not os.path.isfile(data.tokenizer_path):
        raise FileNotFoundError(f"{key}.data.tokenizer_path: {data.tokenizer_path} does not exist")
    if cfg.eval.every > 0 and not index.get("heldout"):
        raise ValueError(f"{key}.eval.every: {cfg.eval.every}, but the shards in {cfg.data_dir} have no held-out "
                         "split (set shards.heldout_fraction > 0 and prepare again, or eval.every = 0)")
    if engines < 1:
        raise ValueError(f"cluster.engines: must be at least 1, got {engines}")
    if cfg.parallel.is_split:  # the model-parallel split against the preset and the engines
        from labkit.config.split import check_split

        shape = {k: v for k, v in model_presets()[cfg.model].items() if k != "source"}
        mcfg = ModelConfig(**{**shape, "vocab_size": int(index.get("vocab_size", 30522)), **cfg.model_overrides})
        try:
            check_split(cfg, mcfg, engines, int(index.get("seq_len", 0)))
        except ValueError as err:
            raise ValueError(f"{key}.{err}") from None


def check_prepare(cfg: LabConfig) -> None:
    """Every corpus input path exists (ELF ``paths`` and the text sources), and the work
    directory can be written (``check_writable_dir``)."""
    check_writable_dir(cfg.workdir, "workdir")
    for field in ("paths", "text_paths", "jsonl_paths", "parquet_paths"):
        missing = [p for p in getattr(cfg.corpus, field) if not os.path.lexists(p)]
        if missing:
            raise FileNotFoundError(f"corpus.{field}: {', '.join(map(repr, missing))} does not exist")


def check_stage(cfg: LabConfig) -> None:
    """Where staging writes each node's copy can be written: ``stage.local_root`` when it is a path
    and the engines are local processes of this machine (a remote node's scratch is checked
    there), else ``<workdir>/local`` (``check_writable_dir``)."""
    root = cfg.stage.local_root
    if root is None:
        check_writable_dir(pathlib.Path(cfg.workdir) / "local", "workdir")
    elif root != "auto" and cfg.cluster.kind == "local" and not cfg.cluster.cluster_id:
        check_writable_dir(root, "stage.local_root")


def _uses_workdir_shards(cfg: LabConfig) -> bool:
    return pathlib.Path(cfg.train.data_dir).resolve() == (pathlib.Path(cfg.workdir) / "shards").resolve()


def check_sweep(kind: str, cfg: LabConfig, args: Any) -> None:
    """A sweep's flags against the config and this machine: the work directory its table and runs
    go to, ranks within 1..engines, model presets, a memory budget this machine can give (local
    engines; ``check_cpu_budget``), worker counts and the consumer's step time, the batch sweep's
    batch sizes, the branch sweep's steps, a --critical-batch table, the network sweep's rates and
    steps and the network hosts it needs; then the
    training run the sweep's points are made of, and the staged copies when it stages."""
    local = cfg.cluster.kind == "local" and not cfg.cluster.cluster_id
    engines = cfg.cluster.engines
    check_writable_dir(cfg.workdir, "workdir")
    if kind in ("ranks", "loaders", "parallel") and _uses_workdir_shards(cfg):
        check_stage(cfg)
    if kind == "ranks":
        bad = [n for n in (args.ranks or []) if not 1 <= n <= engines]
        if bad and local:
            raise ValueError(f"--ranks: {bad} outside 1..{engines} (the engines: --engines / cluster.engines)")
    if kind == "micro-batch":
        for name in args.models or [cfg.train.model]:
            check_model(name, {}, key="--models")
        if getattr(args, "budget_gb", None) is not None:
            raise ValueError("--budget-gb: sweep micro-batch takes --budget-gib (GiB, 2**30 bytes per rank); "
                             "--budget-gb is labkit plan's, in GB (1e9 bytes)")
        if args.budget_gib is not None and args.budget_gib < 0:
            raise ValueError(f"--budget-gib: must be >= 0 (0: the GPU until out of memory), got {args.budget_gib}")
        if not args.budget_gib and local and not has_cuda_device():
            raise ValueError("--budget-gib: 0 searches the GPU until out of memory, but this machine has no NVIDIA "
                             "device; give a CPU budget in GiB per rank")
        if args.budget_gib and local:
            from labkit.measure import available_memory, check_cpu_budget

            check_cpu_budget(int(args.budget_gib * 2**30), available_memory(), key="--budget-gib",
                             model=(args.models or [cfg.train.model])[0])
        _index(cfg.train.data_dir, "train.data_dir")
        return
    if kind == "loaders":
        if any(w < 0 for w in args.workers):
            raise ValueError(f"--workers: worker counts must be >= 0, got {args.workers}")
        if not args.step_time_s > 0:
            raise ValueError(f"--step-time-s: must be positive, got {args.step_time_s}")
        _index(cfg.train.data_dir, "train.data_dir")
        return
    if kind == "network":
        _check_network(cfg, args)
    if kind == "batch":
        _check_batch(cfg, args)
    if kind == "branch" and not args.at:
        raise ValueError("--at: give the steps of the run to branch from (e.g. --at 25 100 300)")
    if getattr(args, "critical_batch", None) and not os.path.isfile(args.critical_batch):
        raise FileNotFoundError(f"--critical-batch: {args.critical_batch} does not exist (labkit sweep batch writes "
                                "<workdir>/sweeps/critical_batch.parquet)")
    # the points' runs go under <workdir> (runs/, sweeps/), not to train.run_dir
    check_train(cfg.train, engines=2 if kind == "network" else 1 if kind in ("batch", "branch") else engines,
                local=local, run_dir=False)


def _check_network(cfg: LabConfig, args: Any) -> None:
    """``labkit sweep network``: presets, rates, steps, and the network hosts (root, iproute2)."""
    for name in args.models or [cfg.train.model]:
        check_model(name, {}, key="--models")
    if any(r < 0 for r in args.rates_mbit):
        raise ValueError(f"--rates-mbit: must be >= 0 (0: unshaped), got {args.rates_mbit}")
    if (args.steps or 6) < 4:
        raise ValueError(f"--steps: the network sweep needs at least 4 (the first 2 untimed: DDP all-reduces the "
                         f"whole model as one bucket until it rebuilt its buckets), got {args.steps}")
    from labkit.testing.realcluster import unavailable_hosts

    why = unavailable_hosts()
    if why:
        raise RuntimeError(f"network sweep: cannot run here: {why}")


def _check_batch(cfg: LabConfig, args: Any) -> None:
    """``labkit sweep batch``: at least 3 distinct batch sizes, each a multiple of its micro-batch
    (``min(micro_batch_size, batch // 2)``, as ``critical_batch.sweep_batch`` splits it), a positive
    --examples, and shards with a held-out split (the sweep reads the held-out loss)."""
    if len(set(args.batches)) < 3 or min(args.batches) < 2:
        raise ValueError(f"--batches: need at least 3 distinct global batch sizes of 2 or more, got {args.batches}")
    for batch in args.batches:
        m = min(cfg.train.batch.micro_batch_size, batch // 2)
        if batch % m:
            raise ValueError(f"--batches: {batch} is not a multiple of its micro-batch {m} "
                             f"(min(train.batch.micro_batch_size, batch / 2))")
    if args.examples is not None and args.examples < 1:
        raise ValueError(f"--examples: must be positive, got {args.examples}")
    if not _index(cfg.train.data_dir, "train.data_dir").get("heldout"):
        raise ValueError(f"train.data_dir: the batch sweep reads the held-out loss, but the shards in "
                         f"{cfg.train.data_dir} have no held-out split (shards.heldout_fraction > 0, then prepare again)")
