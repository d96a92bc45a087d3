"""Run and stage settings from one TOML file, mapped onto the dataclasses of ``labkit.config``.

The file is read with the standard library (``tomllib``, as torchtitan reads its job files).
Top-level keys and one table per stage::

    workdir = "work/demo"          # root of every artifact (the layout of labkit.lab)
    [cluster]                      # ClusterConfig below: engines, kind, profile, cluster_id, slurm
    [corpus]                       # labkit.config.CorpusConfig
    [clean]  [clean.near_dedup]    # CleanConfig and its DedupConfig
    [tokenizer]                    # TokenizerConfig
    [shards]                       # ShardConfig
    [stage]                        # StageConfig
    [train]                        # TrainConfig's own fields; run_dir defaults to <workdir>/runs/main,
                                   # data_dir to <workdir>/shards and then data.tokenizer_path to
                                   # <workdir>/tokenizer/tokenizer.json
    [train.optim] [train.schedule] [train.batch] [train.parallel]
    [train.checkpoint] [train.eval] [train.data] [train.measure]
                                   # TrainConfig's sections (labkit.config.TRAIN_SECTIONS)
    [plan]                         # PlanConfig below: what ``labkit plan CONFIG`` plans at full size
    scaled_down = ["train.model=mini", ...]
                                   # overrides that fit the file's run to a small machine, applied
                                   # (before --set) by ``load(..., scaled_down=True)``, ``--scaled-down``

``--set section.key=value`` overrides one key (the value is read as a TOML value, else taken as
a string: ``--set train.max_steps=20``, ``--set train.optim.lr=3e-4``,
``--set corpus.paths=["/usr/lib"]``). TOML has no null: for a field that may be None (and is
not a string) the string ``"none"`` means None.

The flat [train] names of before the sections (``lr``, ``ckpt_every``, ...;
``labkit.config.FLAT_KEYS``) are still read in a file's [train] table and in ``--set train.lr=...``
for this release, each with one warning line on stderr naming the new key (rank 0 only).

Every key is checked against the dataclass field's annotation before the dataclass is built;
an unknown section or key, a value of the wrong type or one that ``__post_init__`` refuses
raises ``ValueError`` whose one-line message starts with the dotted key
(``train.max_steps: must be positive, got 0``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from labkit.config import (
    FLAT_KEYS,
    TRAIN_SECTIONS,
    CleanConfig,
    CorpusConfig,
    ShardConfig,
    StageConfig,
    TokenizerConfig,
    TrainConfig,
    did_you_mean,
)

__all__ = ["SECTIONS", "TOP_LEVEL", "apply_overrides", "build", "ClusterConfig", "from_mapping", "LabConfig", "load",
           "parse_override", "PlanConfig", "read_run_config", "upgrade_flat_train"]


@dataclass(kw_only=True)
class ClusterConfig:
    """Which ipyparallel engines a command runs on (``labkit.cluster.start_cluster``)."""

    engines: int = 2
    """Engines to start (one per GPU); for Slurm, nodes * gpus_per_node of ``slurm``."""
    kind: Literal["local", "slurm", "mpi"] = "local"
    """Engine launcher: local processes, one Slurm batch job, or mpiexec."""
    profile: str | None = None
    """IPython profile holding the cluster's files (None: ipyparallel's default)."""
    cluster_id: str | None = None
    """Connect to this running cluster (``labkit.cluster.connect_cluster``) instead of starting one."""
    slurm: dict[str, Any] = field(default_factory=dict)
    """Keywords of ``labkit.cluster.slurm_batch_template`` (nodes, gpus_per_node, partition, ...)."""

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"engines: must be at least 1, got {self.engines}")
        if self.kind not in ("local", "slurm", "mpi"):
            raise ValueError(f"kind: got {self.kind!r}; allowed values are 'local', 'slurm', 'mpi'")


@dataclass(kw_only=True)
class PlanConfig:
    """What ``labkit plan CONFIG`` plans for the file's [train] model at full size
    (``labkit.planning.plan_config``; ``labkit forecast CONFIG`` reads it too); each field has a
    ``labkit plan`` option that overrides it."""

    device: str = "H100 NVL"
    """A ``labkit.study.plan.DEVICES`` name."""
    gpus: int = 256
    """GPUs in all (data parallel)."""
    gpus_per_node: int = 2
    """GPUs sharing one node's network link."""
    network: str = "25GbE"
    """A ``labkit.study.scaling.NETWORKS`` name."""
    vocab_size: int | None = None
    """Vocabulary of the planned model; None: the work directory's shards' (``labkit prepare``)."""
    mfu: float = 0.4
    """Achieved share of each precision's dense peak, for the planned step time."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"gpus: gpus and gpus_per_node must be positive, got {self.gpus}, {self.gpus_per_node}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu: must be in (0, 1], got {self.mfu}")


SECTIONS: dict[str, type] = {"cluster": ClusterConfig, "corpus": CorpusConfig, "clean": CleanConfig,
                             "tokenizer": TokenizerConfig, "shards": ShardConfig, "stage": StageConfig,
                             "train": TrainConfig, "plan": PlanConfig}
"""Table name -> the dataclass it fills."""

TOP_LEVEL: dict[str, Any] = {"workdir": str, "scaled_down": tuple[str, ...]}
"""Top-level keys and their types."""


@dataclass(kw_only=True)
class LabConfig:
    """Everything one config file describes: the work directory and one config per stage."""

    workdir: str
    cluster: ClusterConfig
    corpus: CorpusConfig
    clean: CleanConfig
    tokenizer: TokenizerConfig
    shards: ShardConfig
    stage: StageConfig
    train: TrainConfig
    plan: PlanConfig
    scaled_down: tuple[str, ...] = ()


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"section.key=value"`` -> (["section", "key"], value). The value is read as a TOML value
    (``20``, ``1e-3``, ``true``, ``["a", "b"]``, ``{k = 1}``), else kept as the raw string.
    Raises ValueError for an item without ``=`` or an empty key."""
    key, sep, raw = item.partition("=")
    path = [p.strip() for p in key.strip().split(".")]
    if not sep or not all(path):
        raise ValueError(f"--set {item!r}: expected section.key=value (for example train.max_steps=20)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def _is_flat(key: str, value: Any) -> bool:
    """Whether [train] ``key`` = ``value`` is a flat name of before the sections (``schedule`` is
    both: a string is the old field, a table the section)."""
    return key in FLAT_KEYS and not (key in TRAIN_SECTIONS and isinstance(value, dict))


def _warn(message: str) -> None:
    """One warning line on stderr, from rank 0 only (every rank of a torchrun job reads the file)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{message} (the flat name is read in this release only)", file=sys.stderr, flush=True)


def upgrade_flat_train(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``data`` (a raw TOML dict) with its [train] table's flat names moved into their sections
    (``FLAT_KEYS``), one warning line each naming ``where`` and the new key. ValueError when a
    key is given both ways."""
    train = data.get("train")
    if not isinstance(train, dict) or not any(_is_flat(k, v) for k, v in train.items()):
        return data
    out = {k: v for k, v in train.items() if not _is_flat(k, v)}
    for key, value in train.items():
        if not _is_flat(key, value):
            continue
        section, name = FLAT_KEYS[key].split(".")
        table = out.get(section, {})
        if isinstance(table, dict) and name in table:
            raise ValueError(f"train.{key}: given twice, as train.{key} and train.{section}.{name}; keep the second")
        out[section] = {**table, name: value} if isinstance(table, dict) else table
        _warn(f"{where}: 'train.{key}' is now 'train.{section}.{name}'")
    return data | {"train": out}


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """A copy of the raw TOML dict ``data`` with every ``section.key=value`` of ``overrides`` set
    (tables are created as needed; later items win). A flat [train] name of before the sections
    (``train.lr=...``) sets its new key, with one warning line."""
    out = json.loads(json.dumps(data))  # deep copy of plain TOML values
    for item in overrides:
        path, value = parse_override(item)
        if len(path) == 2 and path[0] == "train" and _is_flat(path[1], value):
            new = ["train", *FLAT_KEYS[path[1]].split(".")]
            _warn(f"--set {item}: '{'.'.join(path)}' is now '{'.'.join(new)}'")
            path = new
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{'.'.join(path)}: {part} is not a table")
        node[path[-1]] = value
    return out


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if origin is dict or hint is dict:
        return "a table"
    if dataclasses.is_dataclass(hint):
        return f"a table of {hint.__name__} fields"
    return "none" if hint is type(None) else getattr(hint, "__name__", str(hint))


def _convert(key: str, value: Any, hint: Any) -> Any:
    """``value`` as the type ``hint`` asks for; ValueError "<key>: expected ..., got ..." if it
    is not one."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value == "none" and type(None) in args and str not in args:
            return None
        nested = [a for a in args if dataclasses.is_dataclass(a)]
        if nested and isinstance(value, dict):  # a table for a nested config: its own errors
            return build(nested[0], value, key)
        arms = [a for a in args if a is not type(None)]
        for arm in arms:
            try:
                return _convert(key, value, arm)
            except ValueError:
                if len(arms) == 1:  # "X or None": X's own message names the element that is wrong
                    raise
                continue
    elif origin is Literal:
        if value in args:
            return value
    elif origin is tuple and isinstance(value, list):
        return tuple(_convert(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    elif (origin is dict or hint is dict) and isinstance(value, dict):
        return dict(value)
    elif dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return build(hint, value, key)
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ValueError(f"{key}: expected {_describe(hint)}, got {value!r}")


def build(cls: type, table: dict[str, Any], prefix: str) -> Any:
    """``cls(**table)`` with every key checked: an unknown key, a value of the wrong type or one
    that ``cls.__post_init__`` refuses raises ValueError naming ``<prefix>.<key>``."""
    if not isinstance(table, dict):
        raise ValueError(f"{prefix}: expected a table of {cls.__name__} fields, got {table!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in table.items():
        if key not in names:
            raise ValueError(f"{prefix}.{key}: unknown key; "
                             + did_you_mean(key, names, f"{cls.__name__} has {', '.join(names)}"))
        kwargs[key] = _convert(f"{prefix}.{key}", value, hints[key])
    try:
        return cls(**kwargs)
    except ValueError as err:
        parent, _, last = prefix.rpartition(".")
        if parent and str(err).startswith(f"{last}."):  # a section names its fields itself (optim.lr)
            raise ValueError(f"{parent}.{err}") from None
        raise ValueError(f"{prefix}.{err}") from None
    except TypeError as err:  # a required field is missing
        raise ValueError(f"{prefix}: {err}") from None


def _train_defaults(train: dict[str, Any], workdir: str) -> dict[str, Any]:
    """run_dir defaults to <workdir>/runs/main; data_dir to <workdir>/shards, and then (only
    then) data.tokenizer_path to <workdir>/tokenizer/tokenizer.json, the tokenizer those shards
    are checked against."""
    w = pathlib.Path(workdir)
    out = {"run_dir": str(w / "runs" / "main")} | train
    if "data_dir" not in train:
        out["data_dir"] = str(w / "shards")
        data = train.get("data", {})
        if isinstance(data, dict) and "tokenizer_path" not in data:
            out["data"] = data | {"tokenizer_path": str(w / "tokenizer" / "tokenizer.json")}
    return out


def from_mapping(data: dict[str, Any]) -> LabConfig:
    """A ``LabConfig`` from a parsed TOML dict (after overrides). Missing sections take the
    dataclass defaults; flat [train] names of before the sections are moved into them, one warning
    line each (``upgrade_flat_train``). Raises ValueError naming the first bad key."""
    data = upgrade_flat_train(data, "[train]")
    for key in data:
        if key not in SECTIONS and key not in TOP_LEVEL:
            raise ValueError(f"{key}: unknown key; " + did_you_mean(
                key, [*TOP_LEVEL, *SECTIONS],
                f"known top-level keys are {', '.join(TOP_LEVEL)} and the sections {', '.join(SECTIONS)}"))
    workdir = _convert("workdir", data.get("workdir", "work/demo"), str)
    scaled = _convert("scaled_down", data.get("scaled_down", []), tuple[str, ...])
    built: dict[str, Any] = {"scaled_down": scaled}
    for name, cls in SECTIONS.items():
        table = data.get(name, {})
        if name == "train" and isinstance(table, dict):
            table = _train_defaults(table, workdir)
        built[name] = build(cls, table, name)
    return LabConfig(workdir=workdir, **built)


def load(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = (), *,
         scaled_down: bool = False) -> LabConfig:
    """Read the TOML file at ``path`` (None: no file, defaults only), apply the file's own
    ``scaled_down`` overrides when ``scaled_down``, then ``overrides`` (``section.key=value``),
    and build every section's dataclass.

    Raises FileNotFoundError naming a missing file, ValueError naming a TOML syntax error (with
    its line), the first bad key (see the module docstring), or ``scaled_down`` asked of a file
    that names no such overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = pathlib.Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} does not exist")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{p}: not valid TOML: {err}") from None
        data = upgrade_flat_train(data, str(p))
    if scaled_down:
        scaled = _convert("scaled_down", data.get("scaled_down", []), tuple[str, ...])
        if not scaled:
            raise ValueError(f"scaled_down: {path} names no scaled-down overrides (a top-level scaled_down = [...])")
        overrides = [*scaled, *overrides]
    return from_mapping(apply_overrides(data, overrides))


def read_run_config(run_dir: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The ``TrainConfig`` a run was started with, from ``<run_dir>/config.json`` (its provenance
    and any other non-field record are left out; a config.json from before the sections, with
    flat names, reads the same), with ``train.key=value`` overrides applied. Raises
    FileNotFoundError when the run has no config.json, ValueError for an override of another
    section or a bad key."""
    path = pathlib.Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: {path} does not exist")
    saved = json.loads(path.read_text())
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    table: dict[str, Any] = {}
    for key, value in saved.items():  # the flat names of an old run's config.json, silently
        section, _, name = FLAT_KEYS.get(key, key).rpartition(".") if _is_flat(key, value) else ("", "", key)
        if section and value is not None:
            table.setdefault(section, {})[name] = value
        elif key in names and value is not None:
            table[key] = {k: v for k, v in value.items() if v is not None} if key in TRAIN_SECTIONS else value
    for item in overrides:
        key_path, _ = parse_override(item)
        if key_path[0] != "train" or len(key_path) < 2:
            raise ValueError(f"--set {item!r}: a run directory holds a [train] config only (train.key=value)")
    merged = apply_overrides({"train": table}, overrides)["train"]
    return build(TrainConfig, merged, "train")
