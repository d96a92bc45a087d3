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

__all__ = ["ENCODER", "check_device", "check_model", "check_prepare", "check_sweep", "check_train", "has_cuda_device",
           "model_presets"]

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


def _index(data_dir: str, key: str) -> dict:
    path = pathlib.Path(data_dir) / "index.json"
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {data_dir} holds no shard set (index.json); run labkit prepare first")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{key}: {path} is not a readable shard index ({err})") from None


def check_train(cfg: TrainConfig, *, engines: int, local: bool, key: str = "train") -> None:
    """Everything of a training run that needs no engine: the shard set exists and matches the
    run (sequence length, tokenizer file, a held-out split when ``eval.every`` asks for one), the
    model preset and overrides, the device, and a tensor/pipeline split against the preset and the
    ``engines`` (``labkit.config.split.check_split``)."""
    check_model(cfg.model, cfg.model_overrides, key=f"{key}.model")
    check_device(cfg, local=local, key=key)
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
    """Every corpus input path exists (ELF ``paths`` and the text sources)."""
    c = cfg.corpus
    for field in ("paths", "text_paths", "jsonl_paths", "parquet_paths"):
        missing = [p for p in getattr(c, field) if not os.path.lexists(p)]
        if missing:
            raise FileNotFoundError(f"corpus.{field}: {', '.join(map(repr, missing))} does not exist")


def check_sweep(kind: str, cfg: LabConfig, args: Any) -> None:
    """A sweep's flags against the config and this machine: ranks within 1..engines, model
    presets, a memory budget this machine can give (local engines; ``check_cpu_budget``), worker
    counts and the consumer's step time; then the training run the sweep's points are made of."""
    local = cfg.cluster.kind == "local" and not cfg.cluster.cluster_id
    engines = cfg.cluster.engines
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
    check_train(cfg.train, engines=engines, local=local)
