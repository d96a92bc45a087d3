"""labkit.data.corpus on real ELF files: a C file compiled here, system libraries, a hand-built
aarch64 ELF, and broken copies. References: nm, objdump, and pyelftools' own symbol parser."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import shutil
import struct
import subprocess

import polars as pl
import pytest
from elftools.elf.elffile import ELFFile

from labkit.config import CorpusConfig
from labkit.data.corpus import (SCHEMA, build_corpus, extract_functions, find_elf_files, normalize_instruction,
                                split_work, write_corpus_part)

C_SOURCE = """
__attribute__((noinline)) static int helper_square(int x) { return x * x; }
int add_numbers(int a, int b) { return a + b; }
int sum_squares(int n) { int s = 0; for (int i = 0; i < n; i++) s += helper_square(i); return s; }
int alias_target(int x) { return x + 7; }
int alias_name(int x) __attribute__((alias("alias_target")));
int main(void) { return sum_squares(3) + add_numbers(1, 2) + alias_name(0) - 15; }
"""
SYSTEM_LIBS = [f"/usr/lib/x86_64-linux-gnu/{n}" for n in
               ("libz.so.1", "libbz2.so.1.0", "liblzma.so.5", "libexpat.so.1", "libm.so.6")]


def raw(**kw) -> CorpusConfig:
    return CorpusConfig(normalize=False, max_functions=None, max_functions_per_file=None, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The C file compiled as a shared object (ET_DYN), a PIE (ET_DYN) and a non-PIE (ET_EXEC)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    d = tmp_path_factory.mktemp("elf")
    (d / "t.c").write_text(C_SOURCE)
    out = {"so": d / "libt.so", "pie": d / "t_pie", "exe": d / "t_exe"}
    for key, flags in (("so", ["-shared", "-fPIC"]), ("pie", ["-pie", "-fPIE"]), ("exe", ["-no-pie"])):
        subprocess.run(["gcc", "-O1", *flags, str(d / "t.c"), "-o", str(out[key])], check=True)
    return out


def nm_functions(path) -> dict[str, int]:
    """name -> address of defined text symbols, from binutils nm."""
    lines = subprocess.run(["nm", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {name: int(addr, 16) for addr, kind, name in (ln.split() for ln in lines.splitlines()) if kind in "tT"}


def objdump_mnemonics(path, name: str) -> list[str]:
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-M", "intel", f"--disassemble={name}", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return [ln.split("\t")[1].split()[0] for ln in out.splitlines() if ln.startswith("  ") and "\t" in ln]


@pytest.mark.parametrize("kind,e_type", [("so", "ET_DYN"), ("pie", "ET_DYN"), ("exe", "ET_EXEC")])
def test_compiled_functions_match_nm_and_objdump(built, kind, e_type):
    path = built[kind]
    with open(path, "rb") as f:
        assert ELFFile(f)["e_type"] == e_type
    df, skipped = extract_functions(path, raw())
    assert skipped == {}
    assert df.schema == pl.Schema(SCHEMA)
    rows = {r["name"]: r for r in df.iter_rows(named=True)}
    expected = {"add_numbers", "sum_squares", "helper_square", "alias_name"}
    assert expected <= set(rows)
    assert "alias_target" not in rows  # alias of alias_name at one address: the smallest name is kept
    assert df["address"].n_unique() == df.height
    nm = nm_functions(path)
    for name in expected:
        r = rows[name]
        assert r["address"] == nm[name]
        assert r["arch"] == "x86_64" and r["source"] == str(path)
        assert r["id"] == hashlib.sha1(f"x86_64|{path}|{name}|{nm[name]}".encode()).hexdigest()[:16]
        mnemonics = [line.split()[0] for line in r["text"].split("\n")]
        assert mnemonics == objdump_mnemonics(path, name)
    assert rows["add_numbers"]["text"].split("\n")[-1] == "ret"
    assert "jne 0x" in rows["sum_squares"]["text"] and "call 0x" in rows["sum_squares"]["text"]
    with open(path, "rb") as f:  # n_bytes is st_size from pyelftools' own parser
        sym = ELFFile(f).get_section_by_name(".symtab").get_symbol_by_name("sum_squares")[0]
    assert rows["sum_squares"]["n_bytes"] == sym["st_size"]


def test_normalised_text_and_stable_ids(built):
    cfg = CorpusConfig(max_functions=None)
    a, _ = extract_functions(built["so"], cfg)
    b, _ = extract_functions(str(built["so"]), cfg)
    assert a.equals(b)
    loop = a.filter(pl.col("name") == "sum_squares")["text"][0]
    assert "call ADDR" in loop and "jne ADDR" in loop and "0x4" not in loop


def test_symbols_match_pyelftools_reference():
    """The numpy symbol-table decoding against pyelftools' per-symbol parser on a system library."""
    path = next((p for p in SYSTEM_LIBS if os.path.exists(p)), None)
    if path is None:
        pytest.skip("no reference system library")
    cfg = raw()
    with open(path, "rb") as f:
        elf = ELFFile(f)
        table = elf.get_section_by_name(".symtab") or elf.get_section_by_name(".dynsym")
        best: dict[int, str] = {}
        for s in table.iter_symbols():
            if s["st_info"]["type"] != "STT_FUNC" or not isinstance(s["st_shndx"], int):
                continue
            sec = elf.get_section(s["st_shndx"])
            if (cfg.min_function_bytes <= s["st_size"] <= cfg.max_function_bytes and sec["sh_flags"] & 4
                    and sec["sh_addr"] <= s["st_value"] <= sec["sh_addr"] + sec["sh_size"] - s["st_size"]):
                best[s["st_value"]] = min(best.get(s["st_value"], s.name), s.name)
    df, skipped = extract_functions(path, cfg)
    assert skipped == {}
    assert dict(zip(df["address"].to_list(), df["name"].to_list())) == best
    capped, _ = extract_functions(path, CorpusConfig(max_functions=7, max_functions_per_file=None))
    assert capped["address"].to_list() == sorted(best)[:7]


def tiny_elf(machine: int, code: bytes, symbols: list[tuple[str, int, int]], *, e_type: int = 3,
             text_addr: int = 0x10000) -> bytes:
    """A minimal little-endian ELF64: .text (at file offset 64, virtual address text_addr),
    .symtab with STT_FUNC symbols (name, address, size), .strtab, .shstrtab."""
    strtab = b"\0" + b"".join(n.encode() + b"\0" for n, _, _ in symbols)
    syms, pos = [bytes(24)], 1
    for name, addr, size in symbols:
        syms.append(struct.pack("<IBBHQQ", pos, 0x12, 0, 1, addr, size))  # GLOBAL FUNC in section 1
        pos += len(name) + 1
    shstr = b"\0.text\0.symtab\0.strtab\0.shstrtab\0"
    blobs = [code, b"".join(syms), strtab, shstr]
    offsets, off = [], 64
    for blob in blobs:
        offsets.append(off)
        off += len(blob)
    shoff = (off + 7) // 8 * 8
    sh = [bytes(64),
          struct.pack("<IIQQQQIIQQ", 1, 1, 6, text_addr, offsets[0], len(code), 0, 0, 4, 0),
          struct.pack("<IIQQQQIIQQ", 7, 2, 0, 0, offsets[1], len(blobs[1]), 3, 1, 8, 24),
          struct.pack("<IIQQQQIIQQ", 15, 3, 0, 0, offsets[2], len(strtab), 0, 0, 1, 0),
          struct.pack("<IIQQQQIIQQ", 23, 3, 0, 0, offsets[3], len(shstr), 0, 0, 1, 0)]
    header = b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack(
        "<HHIQQQIHHHHHH", e_type, machine, 1, text_addr, 0, shoff, 0, 64, 56, 0, 64, len(sh), 4)
    body = header + b"".join(blobs)
    return body + bytes(shoff - len(body)) + b"".join(sh)


AARCH64_CODE = bytes.fromhex(
    "fd7bbfa9" "fd030091" "03000094" "fd7bc1a8" "c0035fd6"  # caller: stp; mov x29, sp; bl callee; ldp; ret
    "40058052" "c0035fd6")                                  # callee: mov w0, #0x2a; ret


def test_aarch64_elf(tmp_path):
    path = tmp_path / "arm.so"
    path.write_bytes(tiny_elf(183, AARCH64_CODE, [("caller", 0x10000, 20), ("callee", 0x10014, 8)]))
    df, skipped = extract_functions(path, CorpusConfig())
    assert skipped == {}
    assert df["arch"].to_list() == ["aarch64", "aarch64"]
    assert df["address"].to_list() == [0x10000, 0x10014]
    assert df["text"].to_list() == [
        "stp x29, x30, [sp, #-0x10]!\nmov x29, sp\nbl #ADDR\nldp x29, x30, [sp], #0x10\nret",
        "mov w0, #0x2a\nret"]
    raw_text = extract_functions(path, raw())[0]["text"][0]
    assert "bl #0x10014" in raw_text  # the virtual address was mapped to file offset 64


def test_bad_files_are_counted(tmp_path, built):
    real = built["so"].read_bytes()
    cases = {
        "text.txt": (b"hello, not an ELF\n", "not_elf"),
        "empty": (b"", "not_elf"),
        "head200": (real[:200], "corrupt"),
        "half": (real[: len(real) // 2], "corrupt"),
        "riscv": (real[:18] + struct.pack("<H", 243) + real[20:], "unsupported_arch"),
        "elf32": (real[:4] + b"\x01" + real[5:], "unsupported_arch"),
        "reloc.o": (tiny_elf(62, b"\xc3" * 8, [("f", 0, 8)], e_type=1, text_addr=0), "unsupported_type"),
        "nosyms": (tiny_elf(62, b"\xc3" * 8, []), "no_functions"),
    }
    for name, (data, reason) in cases.items():
        (tmp_path / name).write_bytes(data)
        df, skipped = extract_functions(tmp_path / name, CorpusConfig())
        assert (name, skipped, df.height) == (name, {reason: 1}, 0)
        assert df.schema == pl.Schema(SCHEMA)
    assert extract_functions(tmp_path / "missing", CorpusConfig())[1] == {"unreadable": 1}
    assert extract_functions(built["so"], CorpusConfig(max_file_bytes=100))[1] == {"too_large": 1}


def test_find_elf_files(tmp_path, built):
    d = (tmp_path / "tree").resolve()  # find_elf_files resolves the given roots
    (d / "sub").mkdir(parents=True)
    for i in range(5):
        shutil.copy(built["so"], d / "sub" / f"lib{i}.so")
    os.link(d / "sub" / "lib0.so", d / "hardlink.so")  # second name of lib0: dropped
    (d / "notes.txt").write_text("\x7fEL but no F")
    (d / "link.so").symlink_to(d / "sub" / "lib1.so")  # symlinks are not followed
    (d / "linkdir").symlink_to(d / "sub", target_is_directory=True)
    cfg = CorpusConfig(paths=(str(d), str(d / "sub")), seed=3)
    files = find_elf_files(cfg)
    expected = [d / "hardlink.so"] + [d / "sub" / f"lib{i}.so" for i in range(1, 5)]
    random.Random(3).shuffle(expected)
    assert files == expected
    assert find_elf_files(CorpusConfig(paths=(str(d),), seed=3, max_files=2)) == expected[:2]
    with pytest.raises(FileNotFoundError, match="nope"):
        find_elf_files(CorpusConfig(paths=(str(d), str(tmp_path / "nope"))))


def test_normalize_instruction():
    cases = [
        (("call", "0x1139"), "call ADDR"),
        (("jne", "0x401125"), "jne ADDR"),
        (("bnd jmp", "0x1020"), "bnd jmp ADDR"),
        (("call", "qword ptr [rip + 0x2fe2]"), "call qword ptr [rip + REL]"),
        (("lea", "r8, [rip - 0x5e]"), "lea r8, [rip + REL]"),
        (("mov", "rax, qword ptr [rip + 0x2fd9]"), "mov rax, qword ptr [rip + REL]"),
        (("sub", "rsp, 0x1000"), "sub rsp, IMM16"),
        (("mov", "esi, 0x186a0"), "mov esi, IMM32"),
        (("movabs", "rax, 0x123456789abcdef"), "movabs rax, IMM64"),
        (("mov", "qword ptr [rbp - 0x18], rdi"), "mov qword ptr [rbp - 0x18], rdi"),
        (("add", "rsp, 8"), "add rsp, 8"),
        (("cmp", "byte ptr [rbp + 0x100], 0xff"), "cmp byte ptr [rbp + IMM16], 0xff"),
        (("ret", ""), "ret"),
        (("bl", "#0x10014"), "bl #ADDR"),
        (("b.ne", "#0x4004"), "b.ne #ADDR"),
        (("cbz", "x1, #0x10a0"), "cbz x1, #ADDR"),
        (("tbnz", "w0, #3, #0x2000"), "tbnz w0, #3, #ADDR"),
        (("adrp", "x0, #0x11000"), "adrp x0, #ADDR"),
        (("ldr", "x0, [x1, #0x1f8]"), "ldr x0, [x1, #IMM16]"),
        (("ldr", "x0, #0x4010"), "ldr x0, #ADDR"),
        (("mov", "w0, #0x2a"), "mov w0, #0x2a"),
    ]
    for (mnemonic, op_str), want in cases:
        assert normalize_instruction(mnemonic, op_str) == want, (mnemonic, op_str)


def test_write_corpus_part_budget_and_skips(tmp_path, built):
    libs = [p for p in SYSTEM_LIBS if os.path.exists(p)][:4]
    if len(libs) < 3:
        pytest.skip("fewer than 3 reference system libraries")
    bad = tmp_path / "bad.txt"
    bad.write_text("not an ELF")
    files = [str(bad), str(built["so"]), *libs]
    cfg = CorpusConfig(max_functions=12, max_functions_per_file=5)
    out = tmp_path / "p" / "part-00000.parquet"
    stats = write_corpus_part(files, cfg, str(out))
    df = pl.read_parquet(out)
    per_file = df.group_by("source", maintain_order=True).len()
    assert per_file["source"].to_list() == files[1:4] and per_file["len"].to_list() == [5, 5, 2]
    assert stats["functions"] == df.height == 12
    assert stats["files_read"] == 4  # the budget was reached in the third ELF; later files unopened
    assert stats["skipped"] == {"not_elf": 1} and stats["skipped_files"] == {str(bad): "not_elf"}
    assert stats["raw_bytes"] == sum(os.path.getsize(p) for p in files[:4])
    assert stats["text_bytes"] == sum(len(t.encode()) for t in df["text"])
    assert sorted(os.listdir(out.parent)) == ["part-00000.parquet"]


def test_build_corpus_parts(tmp_path):
    libs = [p for p in SYSTEM_LIBS if os.path.exists(p)]
    if len(libs) < 3:
        pytest.skip("fewer than 3 reference system libraries")
    cfg = CorpusConfig(paths=tuple(libs), max_functions=41, max_functions_per_file=8)
    stats = build_corpus(cfg, str(tmp_path / "c"), n_parts=2)
    names = sorted(os.listdir(tmp_path / "c"))
    assert names == ["corpus.json", "part-00000.parquet", "part-00001.parquet"]
    assert json.loads((tmp_path / "c" / "corpus.json").read_text()) == stats
    parts = [pl.read_parquet(tmp_path / "c" / n) for n in names[1:]]
    assert [p.height for p in parts] == [min(21, 8 * len(libs[0::2])), min(20, 8 * len(libs[1::2]))]
    assert stats["functions"] == sum(p.height for p in parts)
    assert all(p.height == 0 or p["id"].n_unique() == p.height for p in parts)
    mtimes = [os.stat(tmp_path / "c" / n).st_mtime_ns for n in names]
    assert mtimes[0] >= max(mtimes[1:])  # corpus.json last
    work = split_work(find_elf_files(cfg), cfg, 2)
    assert [w[1].max_functions for w in work] == [21, 20]
    with pytest.raises(ValueError, match="n_parts"):
        split_work([], cfg, 0)
