"""The generated blocks in docs/ equal what docs/generate.py produces from the committed code and data."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_docs_equal_the_generators_output():
    gen = _generator()
    for path, text in gen.generate().items():
        assert (ROOT / path).read_text() == text, f"{path} is stale: run python docs/generate.py"


def test_render_replaces_only_between_markers_and_names_missing_ones():
    gen = _generator()
    text = "a\n<!-- generated:x -->\nold\n<!-- /generated:x -->\nb\n"
    assert gen.render(text, "x", "new\n") == "a\n<!-- generated:x -->\nnew\n<!-- /generated:x -->\nb\n"
    with pytest.raises(ValueError, match="y: markers"):
        gen.render(text, "y", "new\n")
