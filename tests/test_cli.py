"""The ``labkit`` command line: bad input gets a clear error and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from labkit.cli import main


def test_demo_with_a_missing_input_path_names_it(tmp_path, capsys):
    missing = tmp_path / "no-such-dir"
    assert main(["demo", "--workdir", str(tmp_path / "w"), "--paths", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "do not exist" in err
    assert not (tmp_path / "w").exists(), "nothing is written before the inputs are checked"


def test_demo_with_a_work_directory_it_cannot_create_names_it(tmp_path, capsys):
    """/proc takes no new directories, even from root: the mkdir fails after the path checks."""
    assert main(["demo", "--workdir", "/proc/labkit-no-such-dir", "--paths", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "workdir: cannot create /proc/labkit-no-such-dir: " in err and len(err.splitlines()) == 1, err


def test_verify_refuses_a_directory_without_index(tmp_path, capsys):
    (tmp_path / "shard-00000.bin").write_bytes(b"\0" * 16)
    assert main(["verify", str(tmp_path)]) == 2
    assert "index.json" in capsys.readouterr().err


def test_console_script_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "labkit.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("prepare", "stage", "train", "resume", "sweep", "plan", "export", "demo", "verify", "report"):
        assert command in out.stdout


def test_demo_on_a_stripped_binary_says_no_functions_in_one_line(tmp_path, capsys):
    import shutil

    true = shutil.which("true")
    assert main(["demo", "--workdir", str(tmp_path / "w"), "--paths", true, "--steps", "2", "--no-reports"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("labkit demo: error") and "no document found" in err[-1], err[-3:]
    assert "Traceback" not in "\n".join(err)


def test_interrupt_is_one_line_and_exit_130(monkeypatch, tmp_path, capsys):
    import labkit.demo

    def interrupted(cfg, force=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(labkit.demo, "run_demo", interrupted)
    assert main(["demo", "--workdir", str(tmp_path / "w")]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_verify_names_a_missing_directory(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_every_subcommand_help_shows_an_example():
    from labkit.cli import EXAMPLES, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(EXAMPLES)
    for name, p in sub.choices.items():
        text = p.format_help()
        assert "example:" in text and f"labkit {name}" in text.split("example:")[1], name


def test_a_bad_config_key_is_one_line_and_exit_2(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nmax_step = 3\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("labkit train: error: train.max_step: unknown key"), err
    cfg.write_text("[train]\nmax_steps = 3\n")
    assert main(["prepare", str(cfg), "--set", "train.optim.lr=fast"]) == 2
    assert "train.optim.lr: expected float, got 'fast'" in capsys.readouterr().err
    assert main(["prepare", str(cfg), "--set", "train.lr=fast"]) == 2  # the flat name of before the sections
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["--set train.lr=fast: 'train.lr' is now 'train.optim.lr' (the flat name is read in this release only)",
                   "labkit prepare: error: train.optim.lr: expected float, got 'fast'"]
    cfg.write_text("[train]\nmax_step = 3\n")
    with pytest.raises(ValueError, match="train.max_step: unknown key"):
        main(["train", str(cfg), "--debug"])


def test_resume_and_export_name_a_missing_run(tmp_path, capsys):
    assert main(["resume", str(tmp_path / "run")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def _notebook(path, *cells):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_report_on_a_failing_cell_and_a_dead_kernel_is_one_line(tmp_path, capsys):
    failing = _notebook(tmp_path / "fails.ipynb", "x = 1", "1 / 0")
    assert main(["report", str(failing), str(tmp_path / "out" / "fails.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["labkit report: error: a notebook cell failed: ZeroDivisionError: division by zero"], err
    dies = _notebook(tmp_path / "dies.ipynb", "import os\nos._exit(1)")
    assert main(["report", str(dies), str(tmp_path / "out" / "dies.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kernel died" in err[0] and "DeadKernelError" in err[0], err
    assert main(["report", str(failing), str(tmp_path / "out" / "f.html"), "--param", "novalue"]) == 2
    assert "--param 'novalue': expected key=value" in capsys.readouterr().err


def test_train_without_shards_says_so_before_starting_engines(tmp_path, capsys):
    assert main(["train", "--set", f"workdir={str(tmp_path)!r}", str(tmp_path / "none.toml")]) == 2
    assert "none.toml does not exist" in capsys.readouterr().err
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"workdir = {str(tmp_path / 'w')!r}\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "run labkit prepare first" in err and "starting" not in err


PREFLIGHT = r'''
import contextlib, io, json, sys
from labkit.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    out.append([rc, err.getvalue().strip().splitlines()])
print(json.dumps({"results": out, "torch": "torch" in sys.modules, "ipyparallel": "ipyparallel" in sys.modules}))
'''


def test_values_are_refused_before_any_engine_starts(tmp_path):
    """Presets, devices, paths and ranges are checked before start-up: each bad value is one line
    naming its key, and the process never imported torch or ipyparallel (no engine was started)."""
    import json
    import os

    import numpy as np

    from labkit.data.shards import write_rows
    from labkit.preflight import has_cuda_device, model_presets

    from labkit.model import MODEL_SIZES

    assert model_presets() == MODEL_SIZES  # read from the source without torch: the same table
    work = tmp_path / "w"
    write_rows(work / "shards", np.full((4, 16), 5), vocab_size=64, tokenizer_sha256="0" * 64, rows_per_shard=4)
    (work / "tokenizer").mkdir()
    (work / "tokenizer" / "tokenizer.json").write_text("{}")  # the default train.tokenizer_path exists
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"workdir = {str(work)!r}\n[cluster]\nengines = 2\n[train]\nmodel = \"tiny\"\n")
    c = str(cfg)
    cases = {
        "train.model: unknown model preset 'huge'": ["train", c, "--set", "train.model=huge"],
        # --tp 2 on 2 engines chooses replicate and says so, but only after the checks: the refusal is the one line
        "train.model: unknown model preset 'giant'": ["train", c, "--tp", "2", "--set", "train.model=giant"],
        "train.model_overrides: unknown fields ['hiden']": ["train", c, "--set", "train.model_overrides={hiden=1}"],
        "train.model_overrides: hidden_size: must be positive": ["train", c, "--set", "train.model_overrides={hidden_size=-8}"],
        "train.data.seq_len: 128, but the shards": ["train", c, "--set", "train.data.seq_len=128"],
        "train.eval.every: 5, but the shards": ["train", c, "--set", "train.eval.every=5"],
        "train.data.tokenizer_path: /no/tok.json does not exist": [
            "train", c, "--set", 'train.data.tokenizer_path="/no/tok.json"'],
        "train.parallel.sharding: 'ddp' does not compose with tp/pp > 1": [
            "train", c, "--tp", "2", "--set", 'train.parallel.sharding="ddp"'],
        "train.parallel.sharding: --tp 2 --pp 1 on 4 engines leaves dp 2 model copies; choose": [
            "train", c, "--tp", "2", "--engines", "4"],
        "train.parallel.tp: world size 2 is not divisible by tp x pp = 4 x 1": [
            "train", c, "--tp", "4", "--set", 'train.parallel.sharding="replicate"'],
        "train.parallel.pp: 1 layers cannot fill pp x pp_virtual_stages = 2 x 1": [
            "sweep", "parallel", c, "--set", "train.parallel.pp=2", "--set", 'train.parallel.sharding="replicate"',
            "--set", "train.batch.grad_accum_steps=2", "--set", "train.model_overrides={num_layers=1}"],
        "--ranks: [3] outside 1..2": ["sweep", "ranks", c, "--ranks", "1", "3"],
        "--models: unknown model preset 'bert-9b'": ["sweep", "micro-batch", c, "--models", "tiny", "bert-9b"],
        "--budget-gib: 100000.0 GiB per rank is more than": ["sweep", "micro-batch", c, "--budget-gib", "100000"],
        "--budget-gb: sweep micro-batch takes --budget-gib": ["sweep", "micro-batch", c, "--budget-gb", "2"],
        "--workers: worker counts must be >= 0": ["sweep", "loaders", c, "--workers", "-1"],
        "--at: give the steps of the run to branch from": ["sweep", "branch", c],
        "--window: 12 examples is not a multiple of the branch batch of factor(s) [1, 2]": [
            "sweep", "branch", c, "--at", "5", "--factors", "2", "--window", "12"],
        "--at: branch points [500] outside 1..train.max_steps 100": ["sweep", "branch", c, "--at", "500"],
        "corpus.paths: '/no/such/dir' does not exist": ["prepare", c, "--set", 'corpus.paths=["/no/such/dir"]'],
        "corpus.text_paths: '/no/notes' does not exist": ["prepare", c, "--set", 'corpus.text_paths=["/no/notes"]'],
    }
    afile = tmp_path / "a-file"  # paths: a run_dir or work directory that is a file, or lies under one
    afile.write_text("not a directory")
    cases |= {
        f"train.run_dir: {afile} is a file, not a directory": ["train", c, "--set", f"train.run_dir={str(afile)!r}"],
        f"train.run_dir: {afile}/run cannot be made: {afile} is a file": [
            "train", c, "--set", f"train.run_dir={str(afile / 'run')!r}"],
        f"workdir: {afile} is a file": ["prepare", c, "--set", f"workdir={str(afile)!r}"],
        f"workdir: {afile}/w cannot be made": ["sweep", "ranks", c, "--set", f"workdir={str(afile / 'w')!r}"],
        f"stage.local_root: {afile} is a file": ["stage", c, "--set", f"stage.local_root={str(afile)!r}"],
        f"out: {afile} is a file": ["export", str(tmp_path / "run"), str(afile)],
        f"out: {afile}/r.html cannot be made: {afile} is a file": [
            "report", "notebooks/03_train.py", str(afile / "r.html")],
        f"--workdir: {afile} is a file": ["demo", "--workdir", str(afile)],
        "--batches: need at least 3 distinct global batch sizes": ["sweep", "batch", c, "--batches", "4", "8"],
        "--batches: 10 is not a multiple of its micro-batch 4": ["sweep", "batch", c, "--batches", "4", "10", "16",
                                                                 "--set", "train.batch.micro_batch_size=4"],
        "train.data_dir: the batch sweep reads the held-out loss": ["sweep", "batch", c, "--batches", "4", "8", "16"],
        "--at: give the steps of the run to branch from": ["sweep", "branch", c],
        "--critical-batch: /no/cb.parquet does not exist": ["sweep", "ranks", c, "--critical-batch", "/no/cb.parquet"],
    }
    if os.statvfs("/proc/sys").f_flag & os.ST_RDONLY:  # a read-only file system, where the container has one
        cases["train.run_dir: /proc/sys/labkit-run cannot be written: /proc/sys is on a read-only file system"] = [
            "train", c, "--set", 'train.run_dir="/proc/sys/labkit-run"']
    if not has_cuda_device():
        cases["train.device: 'cuda' was asked for"] = ["train", c, "--set", 'train.device="cuda"']
        cases["--budget-gib: 0 searches the GPU"] = ["sweep", "micro-batch", c, "--budget-gib", "0"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(__import__("pathlib").Path(__file__).parents[1]),
                                                                   os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", PREFLIGHT, json.dumps(list(cases.values()))], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for (expected, argv), (rc, err) in zip(cases.items(), got["results"]):
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"labkit {argv[0]}: error: {expected}"), (argv, err)
    assert not got["torch"] and not got["ipyparallel"], got  # refused before anything that starts engines


def test_train_twice_on_a_finished_run_leaves_every_file_as_it_was(tmp_path, capsys):
    """``labkit train CONFIG`` on the run it already finished: exit 0, one line saying so, no
    engine started, result.json, metrics.jsonl and config.json byte-identical (nothing touched)."""
    import pathlib

    from tiny_shards import write_tiny_shards

    work = tmp_path / "w"
    shards = write_tiny_shards(tmp_path / "shards")  # a data_dir of its own: no tokenizer to check against
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"workdir = {str(work)!r}\n[cluster]\nengines = 1\n[train]\nmodel = \"tiny\"\nmicro_batch_size = 4\n"
                   "max_steps = 3\nwarmup_steps = 1\nnum_threads = 1\nckpt_every = 3\ntrackers = []\n"
                   f"data_dir = {str(shards)!r}\n")
    assert main(["train", str(cfg), "--no-stage"]) == 0
    run = work / "runs" / "main"
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(pathlib.Path(run).rglob("*")) if p.is_file()}
    assert {"result.json", "metrics.jsonl", "config.json"} <= {p.name for p in files}
    out, err = capsys.readouterr()
    result = json.loads((run / "result.json").read_text())
    assert out.startswith(f"{run}: step 3 of 3, loss {result['initial_loss']:.3f} -> {result['final_loss']:.3f}"), out
    assert "3/3" in err and "tokens/s=" in err, err  # the progress bar, drawn here from rank 0's records
    for flags in (["--json"], []):
        assert main(["train", str(cfg), "--no-stage", *flags]) == 0
        out, err = capsys.readouterr()
        if flags:
            assert json.loads(out)["already_finished"] is True and json.loads(out)["steps"] == 3
        else:
            assert out.startswith(f"{run}: already finished, nothing trained; step 3 of 3,"), out
        assert "already finished (3 of 3 steps" in err and "starting" not in err
        assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files} == files


def _no_engines(monkeypatch, train_on_cluster):
    """``labkit train`` with its checks passed, no cluster, and ``train_on_cluster`` replaced."""
    import contextlib

    from labkit import commands, lab, preflight

    monkeypatch.setattr(preflight, "check_train", lambda *a, **k: None)
    monkeypatch.setattr(commands, "cluster_client", lambda cc: contextlib.nullcontext(None))
    monkeypatch.setattr(lab, "train_on_cluster", train_on_cluster)


def test_train_prints_lines_or_json_and_where_a_stopped_run_continues(monkeypatch, tmp_path, capsys):
    """The result for a reader (rounded, with units), the same numbers under stable keys with
    --json; a run stopped by train.stop_after names its last checkpoint and the command that
    continues it, and on Ctrl-C the same (exit 130), or without a checkpoint the command that
    starts it again. The run's wall-clock goodput and culprit line are printed too, and the live
    culprit line (every rank's timeline) runs beside the bar."""
    run = tmp_path / "runs" / "main"
    result = {"initial_loss": 6.91234, "final_loss": 5.1049, "eval_loss": 5.37123, "perplexity": 214.93, "steps": 10,
              "max_steps": 20, "tokens": 1_234_567, "tokens_per_s": 41100.001607, "world_size": 2,
              "global_batch_size": 16, "resumed_from_step": None, "wall_s": 30.04, "goodput": 0.7}
    culprit = {"rank": 1, "line": "culprit: rank 1 (n1) holds the others up"}

    def trained(client, cfg, staged=None, live=None):
        (run / "checkpoints" / "step-10").mkdir(parents=True)
        assert sorted(getattr(cb, "wants", "records") for cb in live) == ["records", "timeline"]
        next(cb for cb in live if not hasattr(cb, "wants"))([{"step": 10, "loss": 5.1, "tokens_per_s": 41100.0}])
        return result | {"culprit": culprit}

    _no_engines(monkeypatch, trained)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"workdir = {str(tmp_path)!r}\n[train]\nstop_after = 10\nmax_steps = 20\n")
    assert main(["train", str(cfg), "--no-stage"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"{run}: step 10 of 20, loss 6.912 -> 5.105, held-out loss 5.371 (perplexity 214.9)",
        "  1.23 M tokens at 41,100 tokens/s on 2 ranks, global batch 16 sequences, 30.0 s, wall-clock goodput 70 %",
        "  culprit: rank 1 (n1) holds the others up",
        f"stopped after step 10 of 20 (train.stop_after); last checkpoint {run}/checkpoints/step-10; to continue: "
        f"labkit resume {run}"], out
    assert "10/10" in err and "loss=5.100" in err and "tokens/s=41,100" in err, err  # the bar, on stderr
    (run / "checkpoints" / "step-10").rmdir()
    assert main(["train", str(cfg), "--no-stage", "--json", "--set", "cluster.profile=\"lab\""]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert {k: raw[k] for k in result} == result and raw["culprit"] == culprit["line"]
    assert raw["stopped_early"] and raw["last_checkpoint"] == f"{run}/checkpoints/step-10"
    assert raw["continue_command"] == f"labkit resume {run} --profile lab" and not raw["already_finished"]

    def interrupted(client, cfg, staged=None, live=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(__import__("labkit.lab").lab, "train_on_cluster", interrupted)
    assert main(["train", str(cfg), "--no-stage"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"labkit train: interrupted; engines were stopped. Last checkpoint: {run}/checkpoints/step-10 (step 10 of 20); "
        f"to continue from it: labkit resume {run}")
    import shutil

    shutil.rmtree(run / "checkpoints")
    assert main(["train", str(cfg), "--no-stage", "--set", "train.checkpoint.every=5"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"labkit train: interrupted; engines were stopped. No checkpoint of {run} was written yet (train.checkpoint.every "
        f"= 5: every 5 steps); to start it again: labkit train {cfg} --no-stage --set train.checkpoint.every=5")


def test_tp_alone_chooses_replicate_when_it_is_the_only_layout(tmp_path, capsys):
    import argparse

    from labkit.cli import _config

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text("[cluster]\nengines = 2\n[train]\nmodel = \"tiny\"\n")
    args = argparse.Namespace(config=str(cfg_file), set=[], tp=2, pp=None, engines=None, profile=None, cluster_id=None)
    from labkit import commands

    cfg = _config(args)  # the choice is said once the command's checks passed (queued, not printed yet)
    assert (cfg.train.parallel.tp, cfg.train.parallel.sharding) == (2, "replicate") and "dp 1" in commands._NOTES[-1]
    assert capsys.readouterr().err == ""
    commands._NOTES.clear()
    pp2 = argparse.Namespace(**{**vars(args), "tp": None, "pp": 2, "set": ["train.batch.grad_accum_steps=2"]})
    assert _config(pp2).train.parallel.sharding == "replicate"
    for key in ("train.parallel.sharding", "train.sharding"):  # the flat name of before the sections too
        explicit = argparse.Namespace(**{**vars(args), "set": [f'{key}="fsdp"']})
        assert _config(explicit).train.parallel.sharding == "fsdp"  # a sharding the user names is kept
    for table in ('[train.parallel]\nsharding = "ddp"\n', '[train]\nsharding = "ddp"\n'):
        cfg_file.write_text(f"[cluster]\nengines = 2\n{table}")
        with pytest.raises(ValueError, match="'ddp' does not compose with tp/pp > 1"):
            _config(args)


def _subparsers():
    import argparse

    from labkit.cli import build_parser

    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_the_docs_name_only_commands_and_options_that_exist():
    """Every ``labkit COMMAND ... --option`` written in README.md and docs/*.md (inline code and
    code blocks) names a subcommand and options it has; docs/cli.md's table names every
    subcommand; the option list under "Options" is docs/generate_cli.py's (tests/test_docs_generated.py
    checks it is current), and the defaults the help states for the demo are DemoConfig's."""
    import pathlib
    import re

    from labkit.config import CorpusConfig, DemoConfig

    root = pathlib.Path(__file__).resolve().parents[1]
    subs = _subparsers()
    bad = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if path.name == "log.md":  # dated findings: the commands as they were then
            continue
        text = path.read_text()
        spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"```bash\n(.*?)```", text, re.S)
        for span in spans:
            for line in span.replace("\\\n", " ").splitlines():
                for m in re.finditer(r"(?:^|&&|;)\s*labkit ([a-zA-Z][a-zA-Z-]*)([^;|#&]*)", line):
                    name, rest = m.groups()
                    if name not in subs:
                        if not name.isupper():  # COMMAND, a placeholder
                            bad.append(f"{path.name}: labkit {name}: no such command")
                        continue
                    known = {o for a in subs[name]._actions for o in a.option_strings}
                    bad += [f"{path.name}: labkit {name} {flag}: no such option"
                            for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest) if flag not in known]
    assert bad == []
    table = (root / "docs" / "cli.md").read_text().split("## Config files")[0]
    assert [n for n in subs if f"`labkit {n}" not in table] == []
    demo = {a.dest: a.help for a in subs["demo"]._actions}
    assert f"default: {DemoConfig().train_steps}," in demo["steps"]
    assert f"default: {CorpusConfig().max_functions}," in demo["max_functions"]
    assert next(a.default for a in subs["demo"]._actions if a.dest == "engines") == DemoConfig().engines
