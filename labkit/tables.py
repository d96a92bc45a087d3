"""Tables a person reads in a notebook: one record as key/value rows, dicts as nested tables.

A result dict of 27 keys shown as a one-row DataFrame is cut at the notebook's width, and a dict
inside a table cell becomes a cut string. ``show(obj)`` displays a dict (or a one-row polars
frame) as one row per key, with a dict value as a table of its own inside the cell, a list of
records as a small table, and multi-line text as preformatted text. Numbers are formatted for
reading only: integers with thousands separators, keys ending in ``bytes`` in GB (1e9 bytes,
``"25.8 MB"`` below 1 GB is shown as ``"0.0258 GB"``) with the raw count beside it; the object
keeps the raw values (``Table.data``).

The HTML (``_repr_html_``) is what JupyterLab and exported reports show; the text
(``__repr__``) is an indented listing with the same content, never cut.
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["GB", "format_value", "show", "Table"]

GB = 1e9


def _is_bytes(key: object) -> bool:
    return isinstance(key, str) and (key.endswith("bytes") or key.endswith("_bytes"))


def format_value(value: Any, key: object = None) -> str:
    """One scalar as text: None as "-", bools as is, ints with separators (bytes keys: GB and the
    raw count), floats to 4 significant digits, anything else ``str``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value / GB:.4g} GB ({value:,} B)" if _is_bytes(key) else f"{value:,}"
    if isinstance(value, float):
        return f"{value / GB:.4g} GB" if _is_bytes(key) else f"{value:.4g}"
    return str(value)


def _records(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, dict) for v in value)


def _html(value: Any, key: object = None) -> str:
    if isinstance(value, dict):
        if not value:
            return "<i>(none)</i>"
        rows = "".join(f"<tr><th style='text-align:left;vertical-align:top'>{html.escape(str(k))}</th>"
                       f"<td style='text-align:left'>{_html(v, k)}</td></tr>" for k, v in value.items())
        return f"<table class='labkit-table'>{rows}</table>"
    if _records(value):
        cols = list(dict.fromkeys(k for r in value for k in r))
        head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{_html(r.get(c), c)}</td>" for c in cols)
                       + "</tr>" for r in value)
        return f"<table class='labkit-table'><tr>{head}</tr>{body}</table>"
    if isinstance(value, (list, tuple)):
        return html.escape(", ".join(format_value(v, key) for v in value)) if value else "<i>(none)</i>"
    text = format_value(value, key)
    if "\n" in text:
        return f"<pre style='margin:0;white-space:pre-wrap'>{html.escape(text)}</pre>"
    return html.escape(text)


def _text(value: Any, key: object = None, indent: int = 0) -> list[str]:
    pad = "  " * indent
    if isinstance(value, dict):
        out = []
        for k, v in value.items():
            if isinstance(v, dict) or _records(v) or (isinstance(v, str) and "\n" in v):
                out.append(f"{pad}{k}:")
                out += _text(v, k, indent + 1)
            else:
                out.append(f"{pad}{k}: {_text(v, k)[0].strip()}")
        return out or [f"{pad}(none)"]
    if _records(value):
        return [line for i, r in enumerate(value) for line in [f"{pad}[{i}]"] + _text(r, None, indent + 1)]
    if isinstance(value, (list, tuple)):
        return [pad + (", ".join(format_value(v, key) for v in value) or "(none)")]
    return [pad + line for line in format_value(value, key).splitlines()] or [pad]


class Table:
    """A dict shown as key/value rows (``show``); ``data`` holds the raw values."""

    def __init__(self, data: dict, title: str | None = None):
        self.data, self.title = data, title

    def _repr_html_(self) -> str:
        title = f"<b>{html.escape(self.title)}</b>" if self.title else ""
        return f"<div class='labkit-tables'>{title}{_html(self.data)}</div>"

    def __repr__(self) -> str:
        return "\n".join(([self.title] if self.title else []) + _text(self.data))


def show(obj: Any, *, title: str | None = None) -> Any:
    """``obj`` as a table a person reads: a dict, or a polars DataFrame of one row, as a
    ``Table`` (key/value rows, dicts nested); a frame of several rows is returned unchanged
    (polars shows it). Raises TypeError for anything else."""
    try:
        import polars as pl
    except ImportError:  # pragma: no cover - polars is a dependency
        pl = None
    if pl is not None and isinstance(obj, pl.DataFrame):
        return Table(obj.row(0, named=True), title) if obj.height == 1 else obj
    if isinstance(obj, dict):
        return Table(obj, title)
    raise TypeError(f"show: expected a dict or a polars DataFrame, got {type(obj).__name__}")
