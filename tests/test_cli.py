"""The ``labkit`` command line: bad input gets a clear error and exit status 2."""

from __future__ import annotations

import subprocess
import sys

from labkit.cli import main


def test_demo_with_a_missing_input_path_names_it(tmp_path, capsys):
    missing = tmp_path / "no-such-dir"
    assert main(["demo", "--workdir", str(tmp_path / "w"), "--paths", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "do not exist" in err
    assert not (tmp_path / "w").exists(), "nothing is written before the inputs are checked"


def test_verify_refuses_a_directory_without_index(tmp_path, capsys):
    (tmp_path / "shard-00000.bin").write_bytes(b"\0" * 16)
    assert main(["verify", str(tmp_path)]) == 2
    assert "index.json" in capsys.readouterr().err


def test_console_script_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "labkit.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("demo", "verify", "report"):
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

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(labkit.demo, "run_demo", interrupted)
    assert main(["demo", "--workdir", str(tmp_path / "w")]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_verify_names_a_missing_directory(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
