"""nbformat, imported without jsonschema's IRI format checker (``import_nbformat``).

jsonschema, installed with the ``format-nongpl`` extra that Jupyter asks for, imports
``rfc3987_syntax`` as it loads its format checkers, and ``rfc3987_syntax`` builds a Lark grammar
at import. On this project's 2-core test machine that is 3.7 s of CPU (``python -X importtime -c
"import nbformat"``) in every process that imports nbformat: each notebook kernel (plotly's
notebook renderer imports it), each notebook that ``labkit report`` or ``labkit demo`` executes.
The checker serves only the "iri" and "iri-reference" formats, which no nbformat schema uses
(python-jsonschema/jsonschema#1428; #1521 moves to a fork that loads lazily).
"""

from __future__ import annotations

import sys
from types import ModuleType

__all__ = ["import_nbformat"]


def import_nbformat() -> ModuleType:
    """``nbformat``, with jsonschema loaded (if it was not yet) while ``rfc3987_syntax`` cannot
    be imported: jsonschema then leaves out its "iri"/"iri-reference" format checkers and
    nothing else. ``rfc3987_syntax`` stays importable afterwards. A process that has already
    imported jsonschema or rfc3987_syntax is left as it is."""
    if "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules:
        sys.modules["rfc3987_syntax"] = None  # type: ignore[assignment]  # its import raises ImportError
        try:
            import jsonschema  # noqa: F401 (its format checkers load here, without the IRI one)
        finally:
            del sys.modules["rfc3987_syntax"]
    import nbformat

    return nbformat
