"""Hostile and undecodable input to labkit.data.corpus: a tiny ELF that stalled pyelftools 0.31,
the per-file time bound, and functions whose disassembly stops early (counted, not kept)."""

from __future__ import annotations

import os
import struct
import time

import pytest
from elftools.elf.elffile import ELFFile

from labkit.config import CorpusConfig
from labkit.data.corpus import extract_functions, write_corpus_part

LIBZ = "/usr/lib/x86_64-linux-gnu/libz.so.1"


def hostile_elf() -> bytes:
    """512 bytes: a valid x86-64 ET_DYN header with e_shnum = 0 (so the real section count is
    section 0's sh_size) and section 0 claiming 2^62 sections."""
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, 64, 0, 64, 0, 0, 64, 0, 0)
    section0 = struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 1 << 62, 0, 0, 0, 0)
    return (header + section0).ljust(512, b"\0")


def test_pyelftools_is_the_release_that_survives_malformed_headers():
    import importlib.metadata

    major, minor = (int(x) for x in importlib.metadata.version("pyelftools").split(".")[:2])
    assert (major, minor) >= (0, 33)


def test_a_hostile_header_is_corrupt_not_a_stall(tmp_path):
    path = tmp_path / "hostile.so"
    path.write_bytes(hostile_elf())
    t0 = time.monotonic()
    frame, skips = extract_functions(path, CorpusConfig(max_file_seconds=20.0))
    assert frame.height == 0 and skips in ({"corrupt": 1}, {"timeout": 1})
    assert time.monotonic() - t0 < 20.0 + 5.0  # bounded either way (20 s alarm)


def test_a_file_over_its_time_budget_is_skipped_as_timeout():
    if not os.path.exists(LIBZ):
        pytest.skip("libz not installed")
    frame, skips = extract_functions(LIBZ, CorpusConfig(max_file_seconds=1e-6, max_functions=None))
    assert frame.height == 0 and skips == {"timeout": 1}


def test_undecodable_bytes_drop_the_function_and_are_counted(tmp_path):
    if not os.path.exists(LIBZ):
        pytest.skip("libz not installed")
    cfg = CorpusConfig(max_functions=None, max_functions_per_file=None, normalize=False)
    dropped_before: dict[str, int] = {}
    before, _ = extract_functions(LIBZ, cfg, dropped_before)
    victim = before.filter(before["n_bytes"] > 64).row(0, named=True)
    with open(LIBZ, "rb") as f:
        elf = ELFFile(f)
        text = elf.get_section_by_name(".text")
        offset = victim["address"] - text["sh_addr"] + text["sh_offset"]
    raw = bytearray(open(LIBZ, "rb").read())
    # after 16 decodable bytes of the function, 0x06 ("push es"), invalid in 64-bit mode
    import capstone

    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cut = 0
    for _, size, _, _ in md.disasm_lite(bytes(raw[offset:offset + victim["n_bytes"]]), 0):
        cut += size
        if cut >= 16:
            break
    raw[offset + cut] = 0x06
    patched = tmp_path / "libz_patched.so"
    patched.write_bytes(bytes(raw))
    dropped: dict[str, int] = {}
    after, skips = extract_functions(patched, cfg, dropped)
    assert skips == {}
    assert dropped == {"disassembly_stopped": dropped_before.get("disassembly_stopped", 0) + 1}
    assert set(before["name"]) - set(after["name"]) == {victim["name"]}
    stats = write_corpus_part([str(patched)], cfg, str(tmp_path / "part.parquet"))
    assert stats["dropped_functions"] == dropped and stats["functions"] == after.height


def test_spilled_parts_equal_one_in_memory(tmp_path):
    if not os.path.exists(LIBZ):
        pytest.skip("libz not installed")
    cfg = CorpusConfig(max_functions=None, max_functions_per_file=None)
    one = write_corpus_part([LIBZ, LIBZ], cfg, str(tmp_path / "one.parquet"))
    many = write_corpus_part([LIBZ, LIBZ], cfg, str(tmp_path / "many.parquet"), flush_rows=10)
    import polars as pl

    assert one == many and pl.read_parquet(tmp_path / "one.parquet").equals(pl.read_parquet(tmp_path / "many.parquet"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many.parquet", "one.parquet"]
