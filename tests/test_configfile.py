"""TOML config files onto the dataclasses: types checked, unknown keys and bad values refused in
one line naming the dotted key, --set overrides, the train defaults from the work directory."""

from __future__ import annotations

import json

import pytest

from labkit.config import DedupConfig, TrainConfig, to_dict
from labkit.config.tomlfile import apply_overrides, load, parse_override, read_run_config

TOML = """
workdir = "w"
[corpus]
paths = ["/usr/lib"]
max_functions = 500
[clean.near_dedup]
bands = 7
[train]
model = "tiny"
model_overrides = {hidden_dropout = 0.0}
[train.optim]
lr = 1          # an integer where a float is asked for: taken as 1.0
"""


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    return path


def test_file_maps_onto_the_dataclasses(cfg_file):
    cfg = load(cfg_file)
    assert cfg.workdir == "w" and cfg.corpus.paths == ("/usr/lib",) and cfg.corpus.max_functions == 500
    assert cfg.clean.near_dedup == DedupConfig(bands=7)
    assert cfg.train.optim.lr == 1.0 and isinstance(cfg.train.optim.lr, float)
    assert cfg.train.model_overrides == {"hidden_dropout": 0.0}
    assert (cfg.train.data_dir, cfg.train.run_dir, cfg.train.data.tokenizer_path) == (
        "w/shards", "w/runs/main", "w/tokenizer/tokenizer.json")
    assert cfg.tokenizer.vocab_size == 8192, "a missing section takes the dataclass defaults"


def test_text_sources_alone_mean_a_text_only_corpus(tmp_path):
    from labkit.config.data import DEFAULT_ELF_PATHS

    path = tmp_path / "text.toml"
    path.write_text('[corpus]\ntext_paths = ["notes"]\n')
    assert load(path).corpus.paths == ()  # no ELF file is read
    assert load(path, ['corpus.paths=["/usr/lib"]']).corpus.paths == ("/usr/lib",)  # mixing names both
    assert load(None).corpus.paths == DEFAULT_ELF_PATHS  # no source at all: this machine's ELF files


def test_set_overrides_parse_toml_values_else_strings(cfg_file):
    cfg = load(cfg_file, ["train.max_steps=7", "train.model=mini", 'corpus.paths=["/a", "/b"]',
                          "train.num_threads=none", "clean.near_dedup.threshold=0.9", "train.measure.trackers=[]"])
    assert cfg.train.max_steps == 7 and cfg.train.model == "mini" and cfg.corpus.paths == ("/a", "/b")
    assert cfg.train.num_threads is None and cfg.clean.near_dedup.threshold == 0.9 and cfg.train.measure.trackers == ()
    assert parse_override("a.b=x=y") == (["a", "b"], "x=y")
    assert apply_overrides({"train": {"optim": {"lr": 1.0}}}, ["train.optim.lr=2e-3"]) == \
        {"train": {"optim": {"lr": 2e-3}}}


@pytest.mark.parametrize("override, message", [
    ("train.max_step=3", "train.max_step: unknown key; did you mean 'max_steps'?"),
    ("train.zzz=3", "train.zzz: unknown key; TrainConfig has data_dir"),
    ("trainn.lr=1", "trainn: unknown key; did you mean 'train'?"),
    ("train.optim.lrr=1", "train.optim.lrr: unknown key; did you mean 'lr'?"),
    ("train.optim.lr=0", "train.optim.lr: must be positive, got 0.0"),
    ("train.optim.lr=x", "train.optim.lr: expected float, got 'x'"),
    ("train.eval.every=-1", "train.eval.every: must be >= 0, got -1"),
    ("train.parallel.tp=2", "train.parallel.sharding: 'ddp' does not compose with tp/pp > 1"),
    ("train.parallel={pp = 2, sharding = \"fsdp\"}", "train.batch.grad_accum_steps: 1f1b needs at least as many micro-batches"),
    ("train.optim=3", "train.optim: expected a table of OptimConfig fields, got 3"),
    ("train.max_steps=ten", "train.max_steps: expected int, got 'ten'"),
    ("train.max_steps=0", "train.max_steps: must be positive, got 0"),
    ("train.precision=fp8", "train.precision: expected one of 'fp32', 'bf16', 'fp16', got 'fp8'"),
    ("train.resume=1", "train.resume: expected bool, got 1"),
    ("corpus.paths=[1]", "corpus.paths[0]: expected str, got 1"),
    ("clean.near_dedup.bands=x", "clean.near_dedup.bands: expected int, got 'x'"),
    ("xyz.lr=1", "xyz: unknown key; known top-level keys are workdir, scaled_down and the sections cluster"),
    ("cluster.engines=0", "cluster.engines: must be at least 1, got 0"),
    ("train", "--set 'train': expected section.key=value"),
    ("train.batch.ramp=[[10, 32]]", "train.batch.ramp: is read only with batch.schedule = 'ramp', not 'fixed'"),
    ('train.batch={schedule = "ramp", ramp = [[10, "x"]]}', "train.batch.ramp[0][1]: expected int, got 'x'"),
    ("train.batch={schedule = \"ramp\", ramp = [[10, 64], [20, 32]]}",
     "train.batch.ramp: global batch sizes must be positive and strictly ascending, got [64, 32]"),
])
def test_bad_keys_and_values_are_named_in_one_line(cfg_file, override, message):
    with pytest.raises(ValueError) as err:
        load(cfg_file, [override])
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_a_batch_ramp_reads_as_pairs_and_resumes_from_config_json_unchanged(cfg_file):
    from labkit.train.run_config import config_drift

    cfg = load(cfg_file, ['train.batch={schedule = "ramp", ramp = [[200, 32], [400, 64]]}']).train
    assert cfg.batch.ramp == ((200, 32), (400, 64))
    saved = json.loads(json.dumps(to_dict(cfg)))  # config.json: lists
    assert config_drift(saved, to_dict(cfg), None, {}, allow_safe_changes=False) == []
    assert config_drift(saved, to_dict(cfg.replace(batch={"ramp": [[200, 32], [500, 64]]})), None, {},
                        allow_safe_changes=False) == ["batch.ramp: [[200, 32], [400, 64]] -> [[200, 32], [500, 64]]"]


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.toml does not exist"):
        load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = 1\n")
    with pytest.raises(ValueError, match=r"bad.toml: not valid TOML: .*line 1"):
        load(bad)


def test_run_config_reads_back_without_provenance(tmp_path):
    cfg = TrainConfig(data_dir="d", run_dir=str(tmp_path), model="tiny", max_steps=9, stop_after=3,
                      optim={"lr": 2e-3}, eval={"batch_size": 4})
    (tmp_path / "config.json").write_text(json.dumps(to_dict(cfg) | {"provenance": {"world_size": 2}}))
    assert read_run_config(tmp_path) == cfg
    assert read_run_config(tmp_path, ["train.max_steps=12"]).max_steps == 12
    assert read_run_config(tmp_path, ["train.optim.beta1=0.5"]).optim == cfg.optim.__class__(lr=2e-3, beta1=0.5)
    # a run directory from before the sections: flat names (and null for None), read silently
    flat = {"data_dir": "d", "run_dir": str(tmp_path), "model": "tiny", "max_steps": 9, "stop_after": 3, "lr": 2e-3,
            "eval_batch_size": 4, "eval_every": 0, "seq_len": None, "trackers": ["tensorboard"], "schedule": "linear",
            "run_id": "abc", "provenance": {"world_size": 2}}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert read_run_config(tmp_path) == cfg
    with pytest.raises(ValueError, match="a run directory holds a \\[train\\] config only"):
        read_run_config(tmp_path, ["corpus.max_functions=1"])
    with pytest.raises(FileNotFoundError, match="is not a run directory"):
        read_run_config(tmp_path / "elsewhere")


def test_the_toml_examples_in_the_docs_load():
    """Every ```toml block of README.md and docs/*.md is a config file labkit accepts as written."""
    import pathlib
    import re
    import tomllib

    from labkit.config.tomlfile import from_mapping

    root = pathlib.Path(__file__).resolve().parent.parent
    blocks = [(p.name, b) for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
              for b in re.findall(r"```toml\n(.*?)```", p.read_text(), re.S)]
    configs = {}
    for name, block in blocks:
        configs.setdefault(name, []).append(from_mapping(tomllib.loads(block)))  # raises on a bad key or value
    text_only, mixed = configs["data_path.md"][:2]  # "Your own data": text alone, then a mix
    assert text_only.corpus.paths == () and text_only.corpus.text_paths and text_only.corpus.jsonl_paths
    assert mixed.corpus.paths == ("/usr/lib",) and mixed.corpus.parquet_paths and mixed.shards.source_caps


def test_every_shipped_config_loads_and_the_study_scales_down():
    import pathlib

    for path in sorted(pathlib.Path("configs").glob("*.toml")):
        load(path)
    full, small = load("configs/study.toml"), load("configs/study.toml", ["train.max_steps=7"], scaled_down=True)
    assert (full.train.batch.micro_batch_size, full.shards.packing, full.tokenizer.kind) == (184, "padded", "instruction")
    assert full.scaled_down == small.scaled_down and len(small.scaled_down) >= 5
    assert small.train.model == "mini" and small.train.max_steps == 7  # --set after the file's own overrides
    assert small.train.model_overrides == full.train.model_overrides and small.shards == full.shards
    with pytest.raises(ValueError, match="^scaled_down: configs/walkthrough.toml names no scaled-down overrides"):
        load("configs/walkthrough.toml", scaled_down=True)
    with pytest.raises(ValueError, match=r"^plan\.mfu: must be in \(0, 1\]"):
        load("configs/study.toml", ["plan.mfu=2.0"])


def test_unknown_fields_suggest_the_closest_one_in_one_line():
    from labkit.config import ModelConfig, from_dict
    from labkit.preflight import check_model

    with pytest.raises(ValueError, match=r"^train.model_overrides: unknown fields \['hiden_size'\]; did you mean "
                                         r"'hidden_size'\?$"):
        check_model("tiny", {"hiden_size": 8})
    with pytest.raises(ValueError, match=r"^ModelConfig: unknown fields \['num_layer'\]; did you mean 'num_layers'\?$"):
        from_dict(ModelConfig, {"num_layer": 2})


# -- TrainConfig in sections, and the flat names of before them -----------------------------------


def test_train_config_has_sections_given_as_dicts_or_objects():
    from labkit.config import TRAIN_SECTIONS, OptimConfig

    assert len(TRAIN_SECTIONS) >= 5
    a = TrainConfig(data_dir="d", run_dir="r", optim={"lr": 3e-4}, batch={"micro_batch_size": 8})
    assert a == TrainConfig(data_dir="d", run_dir="r", optim=OptimConfig(lr=3e-4), batch={"micro_batch_size": 8})
    assert a.optim.beta2 == OptimConfig().beta2 and a.batch.grad_accum_steps == 1
    b = a.replace(max_steps=5, optim={"beta1": 0.5})  # a section's dict changes its keys, keeps the others
    assert (b.max_steps, b.optim.lr, b.optim.beta1, b.batch.micro_batch_size) == (5, 3e-4, 0.5, 8)
    for kwargs, message in (({"lr": 1e-3}, "lr: is now optim.lr: TrainConfig(..., optim={'lr': ...})"),
                            ({"schedule": "cosine"}, "schedule: is now schedule.kind"),
                            ({"optim": {"lr": -1.0}}, "optim.lr: must be positive, got -1.0"),
                            ({"optim": {"lrr": 1.0}}, "optim.lrr: unknown key; did you mean 'lr'?")):
        with pytest.raises(ValueError) as err:
            TrainConfig(data_dir="d", run_dir="r", **kwargs)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="^ckpt_every: is now checkpoint.every$"):
        a.replace(ckpt_every=3)
    assert not hasattr(a, "lr") and not hasattr(a, "ckpt_every")  # read as a.optim.lr, a.checkpoint.every only


def test_flat_names_still_load_with_one_warning_line_each(tmp_path, capfd):
    """A [train] table and --set items with the flat names of before the sections give the same
    config as the sectioned ones, each with one line naming the new key; both at once is refused."""
    flat = tmp_path / "flat.toml"
    flat.write_text('[train]\nmodel = "tiny"\nlr = 2e-3\nckpt_every = 5\nschedule = "cosine"\nwarmup_steps = 3\n')
    nested = tmp_path / "nested.toml"
    nested.write_text('[train]\nmodel = "tiny"\noptim.lr = 2e-3\ncheckpoint.every = 5\n'
                      '[train.schedule]\nkind = "cosine"\nwarmup_steps = 3\n')
    capfd.readouterr()
    old = load(flat, ["train.sharding=zero1", "train.eval_every=4", "train.max_steps=8"])
    err = capfd.readouterr().err.strip().splitlines()
    new = load(nested, ["train.parallel.sharding=zero1", "train.eval.every=4", "train.max_steps=8"])
    assert old.train == new.train and capfd.readouterr().err == ""
    tail = " (the flat name is read in this release only)"
    assert err == [f"{flat}: 'train.lr' is now 'train.optim.lr'{tail}",
                   f"{flat}: 'train.ckpt_every' is now 'train.checkpoint.every'{tail}",
                   f"{flat}: 'train.schedule' is now 'train.schedule.kind'{tail}",
                   f"{flat}: 'train.warmup_steps' is now 'train.schedule.warmup_steps'{tail}",
                   f"--set train.sharding=zero1: 'train.sharding' is now 'train.parallel.sharding'{tail}",
                   f"--set train.eval_every=4: 'train.eval_every' is now 'train.eval.every'{tail}"]
    flat.write_text('[train]\nlr = 2e-3\n[train.optim]\nlr = 1e-3\n')
    with pytest.raises(ValueError, match=r"^train.lr: given twice, as train.lr and train.optim.lr"):
        load(flat)


def test_the_resume_policy_is_on_the_fields():
    from labkit.config import resume_policy
    from labkit.train.run_config import FREE_FIELDS, SAFE_FIELDS

    policy = resume_policy()
    assert policy["optim.lr"] == policy["batch.micro_batch_size"] == policy["seed"] == "same"
    assert policy["parallel.tp"] == policy["checkpoint.every"] == policy["max_steps"] == "safe"
    assert policy["data.num_workers"] == policy["run_dir"] == policy["checkpoint.asynchronous"] == "free"
    assert SAFE_FIELDS == {k for k, v in policy.items() if v == "safe"} and not FREE_FIELDS & SAFE_FIELDS
    assert set(policy) == {f"{s}.{k}" if s else k for s, _, k in (n.rpartition(".") for n in policy)}
