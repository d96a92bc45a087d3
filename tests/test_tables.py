"""labkit.tables: one record as key/value rows, nested dicts as nested tables, bytes in GB."""

from __future__ import annotations

import html.parser

import polars as pl
import pytest

from labkit import tables


class _Cells(html.parser.HTMLParser):
    """Depth of every <table> and the text of every cell, as a browser would parse them."""

    def __init__(self):
        super().__init__()
        self.depth, self.max_depth, self.text = 0, 0, []

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.depth += 1
            self.max_depth = max(self.max_depth, self.depth)

    def handle_endtag(self, tag):
        if tag == "table":
            self.depth -= 1

    def handle_data(self, data):
        if data.strip():
            self.text.append(data.strip())


REPORT = {"kinds": ["elf", "text"], "dataset_bytes": 6_612_345, "training_to_dataset_ratio": 3.9012345,
          "sources": {"elf": {"files_read": 565, "raw_bytes": 230_812_000}, "text": {"files_read": 12, "raw_bytes": 9_000}},
          "examples": {"text": "first line\nsecond line"}, "unk_rate": None,
          "unk_examples": [{"token": "[UNK]", "count": 3}]}


def test_a_dict_becomes_nested_key_value_tables_with_bytes_in_gb():
    t = tables.show(REPORT, title="Preparation")
    assert t.data is REPORT  # raw values kept
    p = _Cells()
    p.feed(t._repr_html_())
    assert p.depth == 0 and p.max_depth == 3  # report > sources > elf
    assert "0.006612 GB (6,612,345 B)" in p.text and "0.2308 GB (230,812,000 B)" in p.text
    assert "565" in p.text and "3.901" in p.text and "elf, text" in p.text and "-" in p.text
    assert "first line\nsecond line" in p.text  # multi-line text kept whole
    text = repr(t)
    assert text.splitlines()[:2] == ["Preparation", "kinds: elf, text"]
    assert "sources:\n  elf:\n    files_read: 565\n    raw_bytes: 0.2308 GB (230,812,000 B)" in text
    assert "examples:\n  text:\n    first line\n    second line" in text and "…" not in text


def test_a_one_row_frame_is_shown_as_key_value_rows_and_others_unchanged():
    one = pl.DataFrame([{"steps": 4, "final_loss": 5.123456, "peak_mem_bytes": 963_870_720}])
    t = tables.show(one)
    assert isinstance(t, tables.Table) and t.data == one.row(0, named=True)
    assert "peak_mem_bytes: 0.9639 GB (963,870,720 B)" in repr(t)
    many = pl.DataFrame({"a": [1, 2]})
    assert tables.show(many) is many
    with pytest.raises(TypeError, match="expected a dict or a polars DataFrame"):
        tables.show([1, 2])
