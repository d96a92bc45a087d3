"""Real input for data tests: functions of this machine's libc, through labkit's own extractor."""

from __future__ import annotations

import glob

import pytest


def libc_functions(n: int) -> list[str]:
    """Disassembly (capstone's "mnemonic operands" per line, not normalised, so hex constants
    stay) of the first ``n`` functions of this machine's libc by address, extracted with
    ``labkit.data.corpus.extract_functions``. Skips the test when there is no usable libc."""
    from labkit.config import CorpusConfig
    from labkit.data.corpus import extract_functions

    cfg = CorpusConfig(normalize=False, max_functions=None, max_functions_per_file=None)
    for path in sorted(glob.glob("/usr/lib/*/libc.so.6") + glob.glob("/lib/*/libc.so.6")):
        frame, _skipped = extract_functions(path, cfg)
        if frame.height:
            return frame.sort("address")["text"].head(n).to_list()
    pytest.skip("no libc.so.6 of a supported architecture on this machine")
