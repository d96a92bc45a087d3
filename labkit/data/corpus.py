"""Corpus stage: functions disassembled from this machine's ELF files, one document per function.

The study this lab reproduces (Interrante-Grant et al., arXiv:2509.05258) pretrains on
disassembled binary-code functions. Here pyelftools reads the ELF header and section headers,
the symbol table is decoded with numpy (24-byte ``Elf64_Sym`` records; far faster than
pyelftools' per-symbol parsing on large libraries), and capstone disassembles each function's
bytes (``disasm_lite``, detail off).

A document is one function symbol: ``STT_FUNC``, size > 0, defined in an executable
``SHT_PROGBITS`` section, taken from ``.symtab`` if the file has one, else from ``.dynsym``
(stripped Debian binaries export only their dynamic symbols). Several symbols at one address
(aliases) give one document, named after the smallest name. Supported: 64-bit little-endian
x86_64 and aarch64 executables and shared objects (``ET_EXEC``, ``ET_DYN``). A bad file is
counted under one reason and never raises:

=================== ===========================================================================
reason              meaning
=================== ===========================================================================
``unreadable``      the file cannot be opened or mapped (missing, permissions, I/O error)
``not_elf``         empty or does not start with ``b"\\x7fELF"``
``too_large``       larger than ``cfg.max_file_bytes``
``corrupt``         headers, section table or symbol table cannot be parsed or lie outside the file
``unsupported_arch`` not 64-bit little-endian x86_64/aarch64 (e.g. i386, armhf, RISC-V)
``unsupported_type`` not an executable or shared object (relocatable ``.o``/``.ko``, core dump)
``no_symbols``      neither ``.symtab`` nor ``.dynsym``
``no_functions``    symbol tables hold no function within the size bounds in executable code
``timeout``         parsing and disassembly took longer than ``cfg.max_file_seconds``
=================== ===========================================================================

A function whose disassembly stops before its last byte (capstone cannot decode a byte: data in
code, an instruction set extension capstone lacks) is not kept -- its first lines alone would be
a wrong document -- and is counted per file under ``disassembly_stopped`` (``extract_functions``'
``dropped`` argument; ``corpus.json``'s ``dropped_functions``; the cleaning report's
``extraction``). pyelftools >= 0.33 is required: 0.31 loops forever on a 0.5 KB file whose
section-header count is 0 and whose section 0 claims a huge size (the real count).

Normalisation (``cfg.normalize``; see ``normalize_instruction``) abstracts what differs between
binaries but not between programs: branch/call targets, rip-relative displacements and large
constants. Registers, mnemonics and small constants stay.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import mmap
import os
import pathlib
import random
import re
import shutil
import signal
import threading
import time

import numpy as np
import polars as pl

from labkit.config import CorpusConfig, to_dict
from labkit.data.documents import SCHEMA
from labkit.data.sources import find_source_files, write_source_part
from labkit.io import atomic_write, atomic_write_json

__all__ = ["build_corpus", "extract_functions", "find_elf_files", "merge_stats", "normalize_instruction", "split_work",
           "write_corpus_part"]

_ARCHES = {"EM_X86_64": "x86_64", "EM_AARCH64": "aarch64"}
_SHF_EXECINSTR, _STT_FUNC = 0x4, 2
_SYM_DTYPE = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                       ("value", "<u8"), ("size", "<u8")])  # Elf64_Sym, 24 bytes

# --- normalisation ------------------------------------------------------------------------
_BRANCH = re.compile(  # direct branch/call/pc-relative target: the line's last operand, a literal
    r"^((?:bnd |notrack )?(?:j[a-z]+|call|loop[a-z]*|jrcxz|xbegin"            # x86_64
    r"|b|bl|b\.[a-z]+|cbn?z|tbn?z|adrp?|ldr|ldrsw|prfm) (?:[^\n]*, )?#?)"      # aarch64
    r"-?0x[0-9a-f]+$", re.M)
_REL = re.compile(r"\[rip [+-] 0x[0-9a-f]+\]")
_IMM64 = re.compile(r"0x[0-9a-f]{9,16}\b")
_IMM32 = re.compile(r"0x[0-9a-f]{5,8}\b")
_IMM16 = re.compile(r"0x[0-9a-f]{3,4}\b")


def _normalize_text(text: str) -> str:
    """``normalize_instruction`` applied to every line of ``text`` at once (same regexes)."""
    text = _BRANCH.sub(r"\1ADDR", text)
    text = _REL.sub("[rip + REL]", text)
    text = _IMM64.sub("IMM64", text)
    text = _IMM32.sub("IMM32", text)
    return _IMM16.sub("IMM16", text)


def normalize_instruction(mnemonic: str, op_str: str) -> str:
    """One capstone instruction as ``"mnemonic operands"`` with addresses and constants abstracted.

    Rules, applied in this order (capstone prints 0-9 in decimal, larger values in lower-case hex):

    1. a direct branch, call or pc-relative target -> ``ADDR`` (x86_64 ``j*``, ``call``,
       ``loop*``, ``xbegin``; aarch64 ``b``, ``bl``, ``b.cond``, ``cb(n)z``, ``tb(n)z``, ``adr(p)``
       and literal ``ldr``/``prfm``): ``call 0x1139`` -> ``call ADDR``,
       ``cbz x1, #0x10a0`` -> ``cbz x1, #ADDR``;
    2. a rip-relative memory operand -> ``[rip + REL]``:
       ``mov rax, qword ptr [rip + 0x2fd9]`` -> ``mov rax, qword ptr [rip + REL]``;
    3. any other hex literal by its size: below 0x100 kept verbatim (stack offsets, small
       constants, shift counts carry meaning and number only 256); 0x100-0xffff -> ``IMM16``;
       up to 32 bits -> ``IMM32``; wider -> ``IMM64``. Signs and ``#`` prefixes stay:
       ``sub rsp, 0x1000`` -> ``sub rsp, IMM16``, ``[rbp - 0x18]`` stays.

    Registers, mnemonics and operand syntax are unchanged.
    """
    return _normalize_text(f"{mnemonic} {op_str}" if op_str else mnemonic)


# --- discovery ----------------------------------------------------------------------------
def _is_elf(path: str) -> bool:
    """True when ``path`` starts with the ELF magic ``b"\\x7fELF"`` (False when unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return os.read(fd, 4) == b"\x7fELF"
    except OSError:
        return False
    finally:
        os.close(fd)


def _regular_files(root: str, out: list[tuple[str, int, int]]) -> None:
    """Append ``(path, st_dev, st_ino)`` of every regular file below directory ``root`` to
    ``out``, never following symlinks. One ``stat`` per directory (its entries share its
    device), file types and inodes from the directory entries themselves (``os.scandir``)."""
    stack = [root]
    while stack:
        top = stack.pop()
        try:
            dev = os.stat(top, follow_symlinks=False).st_dev
            with os.scandir(top) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    out.append((e.path, dev, e.inode()))
            except OSError:
                continue


def find_elf_files(cfg: CorpusConfig) -> list[pathlib.Path]:
    """ELF files under ``cfg.paths``: sorted, shuffled with ``random.Random(cfg.seed)``, cut to
    ``cfg.max_files``.

    A path may be a file or a directory (walked recursively). Symlinks below a given path are
    never followed (a given path that is itself a symlink, such as ``/lib -> usr/lib``, is
    resolved). A file is kept if it is regular, readable and starts with ``b"\\x7fELF"``; hard
    links and files reached twice keep only their first path in sorted order (Mesa's
    ``dri/*.so`` are 13 links to one file).

    Raises FileNotFoundError naming the first path of ``cfg.paths`` that does not exist.
    """
    roots: list[pathlib.Path] = []
    for given in cfg.paths:
        if not os.path.exists(given):
            raise FileNotFoundError(f"CorpusConfig.paths: {given!r} does not exist")
        roots.append(pathlib.Path(given).resolve())
    found: list[tuple[str, int, int]] = []
    for root in sorted(set(roots)):
        if any(root.is_relative_to(other) for other in roots if other != root):
            continue  # inside another root (e.g. /lib resolved to /usr/lib): walked there
        if root.is_file():
            st = os.stat(root)
            found.append((str(root), st.st_dev, st.st_ino))
        else:
            _regular_files(str(root), found)
    seen: set[tuple[int, int]] = set()
    elf: list[pathlib.Path] = []
    for path, dev, ino in sorted(set(found)):
        if (dev, ino) in seen:
            continue  # a second link to a file we have
        seen.add((dev, ino))
        if _is_elf(path):
            elf.append(pathlib.Path(path))
    random.Random(cfg.seed).shuffle(elf)
    return elf[: cfg.max_files]


# --- extraction ---------------------------------------------------------------------------
@functools.cache
def _disassembler(arch: str):
    import capstone  # capstone 5 names: CS_ARCH_ARM64 (CS_ARCH_AARCH64 from 6.0)

    if arch == "x86_64":
        return capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    return capstone.Cs(getattr(capstone, "CS_ARCH_ARM64", None) or capstone.CS_ARCH_AARCH64,
                       capstone.CS_MODE_ARM)


def _empty() -> pl.DataFrame:
    return pl.DataFrame(schema=SCHEMA)


class _Skip(Exception):
    """A file is skipped; ``args[0]`` is the reason."""


def _select_functions(mm, elf, cfg: CorpusConfig) -> list[tuple[str, int, int, int]]:
    """(name, address, size, file offset) of the functions to disassemble, sorted by address,
    one per address (smallest name), at most cfg.max_functions."""
    sections = list(elf.iter_sections())
    table = elf.get_section_by_name(".symtab") or elf.get_section_by_name(".dynsym")
    if table is None or table["sh_entsize"] != _SYM_DTYPE.itemsize:
        raise _Skip("no_symbols")
    strtab = sections[table["sh_link"]]
    size = len(mm)
    for sec in (table, strtab):
        if sec["sh_offset"] + sec["sh_size"] > size:
            raise _Skip("corrupt")
    syms = np.frombuffer(mm[table["sh_offset"]: table["sh_offset"] + table["sh_size"]], _SYM_DTYPE)
    # Per-section arrays, indexed by st_shndx: executable code present in the file.
    lo = np.array([s["sh_addr"] for s in sections], dtype=np.uint64)
    hi = lo + np.array([s["sh_size"] for s in sections], dtype=np.uint64)
    off = np.array([s["sh_offset"] for s in sections], dtype=np.uint64)
    code = np.array([bool(s["sh_flags"] & _SHF_EXECINSTR) and s["sh_type"] == "SHT_PROGBITS"
                     and s["sh_offset"] + s["sh_size"] <= size for s in sections])
    shndx = syms["shndx"].astype(np.int64)
    ok = ((syms["info"] & 0xF) == _STT_FUNC) & (syms["size"] >= cfg.min_function_bytes) \
        & (syms["size"] <= cfg.max_function_bytes) & (shndx > 0) & (shndx < len(sections))
    ok[ok] = code[shndx[ok]]
    ok[ok] = (syms["value"][ok] >= lo[shndx[ok]]) & (syms["value"][ok] + syms["size"][ok] <= hi[shndx[ok]])
    cand = np.flatnonzero(ok)
    if cand.size == 0:
        raise _Skip("no_functions")
    caps = [n for n in (cfg.max_functions, cfg.max_functions_per_file) if n is not None]
    addresses = np.unique(syms["value"][cand])[: min(caps, default=None)]  # sorted; lowest first
    cand = cand[np.isin(syms["value"][cand], addresses)]
    names = mm[strtab["sh_offset"]: strtab["sh_offset"] + strtab["sh_size"]]
    best: dict[int, tuple[str, int]] = {}
    for i in cand.tolist():
        start = int(syms["name"][i])
        end = names.find(b"\0", start)
        name = names[start: end if end >= 0 else len(names)].decode("utf-8", "replace")
        address = int(syms["value"][i])
        if address not in best or name < best[address][0]:
            best[address] = (name, i)
    out = []
    for address in sorted(best):
        name, i = best[address]
        j = int(shndx[i])
        out.append((name, address, int(syms["size"][i]), int(off[j] + (syms["value"][i] - lo[j]))))
    return out


class _Timeout(BaseException):  # not an Exception: parser errors are caught as "corrupt", this is not
    """A file took longer than ``cfg.max_file_seconds``."""


class _deadline:
    """Raise ``_Timeout`` in this (main) thread after ``seconds`` (SIGALRM via ``setitimer``), so a
    parser stuck inside a library call is interrupted; elsewhere (another thread, or an alarm
    already set) only the per-function checks of ``extract_functions`` apply."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.armed = seconds, False

    def __enter__(self):
        if (threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
                and signal.getitimer(signal.ITIMER_REAL)[0] == 0 and signal.getsignal(signal.SIGALRM) in
                (signal.SIG_DFL, signal.SIG_IGN, None)):
            def on_alarm(signum, frame):
                raise _Timeout()
            self.previous = signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
            self.armed = True
        return self

    def __exit__(self, *exc) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


def extract_functions(path, cfg: CorpusConfig,
                      dropped: dict[str, int] | None = None) -> tuple[pl.DataFrame, dict[str, int]]:
    """Disassemble the functions of one ELF file.

    Returns a frame with ``SCHEMA``'s columns, one row per function address, sorted by address:
    ``id`` = ``sha1(f"{arch}|{source}|{name}|{address}").hexdigest()[:16]``, ``source`` =
    ``str(path)`` as given, ``address`` the symbol's virtual address (UInt64), ``n_bytes`` the
    symbol size in bytes (UInt32), ``text`` one ``"mnemonic operands"`` line per instruction
    (normalised if ``cfg.normalize``); a function capstone cannot decode to its last byte is
    left out. At most ``cfg.max_functions`` and ``cfg.max_functions_per_file`` rows: the lowest
    addresses; only those are disassembled.

    The second value counts skipped files by reason (see the module docstring), e.g.
    ``{"corrupt": 1}`` with an empty frame; ``{}`` when the file was used. Never raises for a
    bad file. Functions whose disassembly stopped early are left out and counted in ``dropped``
    (a dict updated in place, when given) under "disassembly_stopped". The whole call is
    bounded by ``cfg.max_file_seconds`` ("timeout").
    """
    try:
        with _deadline(cfg.max_file_seconds):
            return _extract(path, cfg, dropped, time.monotonic() + cfg.max_file_seconds)
    except _Timeout:
        return _empty(), {"timeout": 1}


def _extract(path, cfg: CorpusConfig, dropped: dict[str, int] | None, deadline: float):
    """``extract_functions`` without the alarm; raises ``_Timeout`` past ``deadline`` (monotonic)."""
    source = str(path)
    try:
        with open(source, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            ident = f.read(20)  # e_ident[16], e_type, e_machine
            if size < 4 or ident[:4] != b"\x7fELF":
                return _empty(), {"not_elf": 1}
            if size > cfg.max_file_bytes:
                return _empty(), {"too_large": 1}
            if len(ident) < 20:
                return _empty(), {"corrupt": 1}
            # ELFCLASS64, ELFDATA2LSB, e_machine EM_X86_64 (62) or EM_AARCH64 (183)
            if ident[4] != 2 or ident[5] != 1 or int.from_bytes(ident[18:20], "little") not in (62, 183):
                return _empty(), {"unsupported_arch": 1}
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError:
        return _empty(), {"unreadable": 1}
    try:
        from elftools.elf.elffile import ELFFile

        try:
            elf = ELFFile(mm)
            arch = _ARCHES[elf["e_machine"]]
            if elf["e_type"] not in ("ET_EXEC", "ET_DYN"):
                raise _Skip("unsupported_type")
            functions = _select_functions(mm, elf, cfg)
        except _Skip as skip:
            return _empty(), {skip.args[0]: 1}
        except Exception:  # pyelftools raises ELFError, construct errors, IndexError, ... on bad input
            return _empty(), {"corrupt": 1}
        md = _disassembler(arch)
        ids, names, addresses, n_bytes, texts = [], [], [], [], []
        stopped = 0
        for name, address, n, offset in functions:
            if time.monotonic() > deadline:
                raise _Timeout()
            insns = list(md.disasm_lite(mm[offset: offset + n], address))  # (address, size, mnemonic, op_str)
            if sum(i[1] for i in insns) < n:  # capstone stopped at a byte it cannot decode
                stopped += 1
                continue
            text = "\n".join(f"{m} {o}" if o else m for _, _, m, o in insns)
            ids.append(hashlib.sha1(f"{arch}|{source}|{name}|{address}".encode()).hexdigest()[:16])
            names.append(name)
            addresses.append(address)
            n_bytes.append(n)
            texts.append(_normalize_text(text) if cfg.normalize else text)
    finally:
        mm.close()
    if stopped and dropped is not None:
        dropped["disassembly_stopped"] = dropped.get("disassembly_stopped", 0) + stopped
    frame = pl.DataFrame({"id": ids, "source": [source] * len(ids), "name": names, "address": addresses,
                          "arch": [arch] * len(ids), "n_bytes": n_bytes, "text": texts}, schema=SCHEMA)
    return frame, {}


# --- parts --------------------------------------------------------------------------------
def _atomic_write_json(data: dict, path: pathlib.Path) -> None:
    atomic_write_json(path, data, sort_keys=True)


def write_corpus_part(files: list[str], cfg: CorpusConfig, out_path: str, *, flush_rows: int = 16_384) -> dict:
    """Extract functions from ``files`` in order until ``cfg.max_functions`` (this call's budget)
    are reached; write them to one Parquet file at ``out_path`` (temp file + rename).

    Returns ``{"files_read", "functions", "raw_bytes", "text_bytes", "skipped", "skipped_files",
    "dropped_functions"}``: files opened (used or skipped), rows written, summed sizes of the
    files opened (bytes on disk, too-large and unreadable files excluded), summed UTF-8 bytes
    of ``text``, counts by skip reason, ``{path: reason}`` for every skipped file, and functions
    left out by reason (``{"disassembly_stopped": n}``). Memory: one file's functions plus
    ``flush_rows`` rows; more are spilled to temporary files and streamed into ``out_path``.
    Files after the budget is reached are not opened. Callers splitting files over engines split the budget too
    (``split_work``).
    """
    frames, skipped, skipped_files, dropped = [], {}, {}, {}
    files_read = raw_bytes = functions = text_bytes = 0
    out = pathlib.Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    spill_dir = out.with_name(f".{out.name}.spill-{os.getpid()}")
    spills: list[pathlib.Path] = []

    def spill() -> None:  # the frames so far to one temporary file: memory stays at ~flush_rows rows
        spill_dir.mkdir(exist_ok=True)
        spills.append(spill_dir / f"{len(spills):05d}.parquet")
        pl.concat(frames).write_parquet(spills[-1])
        frames.clear()

    try:
        for path in files:
            if cfg.max_functions is not None and functions >= cfg.max_functions:
                break
            remaining = None if cfg.max_functions is None else cfg.max_functions - functions
            frame, skips = extract_functions(path, dataclasses.replace(cfg, max_functions=remaining), dropped)
            files_read += 1
            for reason in skips:
                skipped[reason] = skipped.get(reason, 0) + 1
                skipped_files[str(path)] = reason
            if not skips.keys() & {"unreadable", "too_large"}:
                try:
                    raw_bytes += os.path.getsize(path)
                except OSError:  # removed since it was read
                    pass
            if frame.height:
                frames.append(frame)
                functions += frame.height
                text_bytes += int(frame["text"].str.len_bytes().sum() or 0)
                if sum(f.height for f in frames) >= flush_rows:
                    spill()
        if spills:
            if frames:
                spill()
            atomic_write(out, lambda tmp: pl.scan_parquet(spills).sink_parquet(tmp))
        else:
            atomic_write(out, (pl.concat(frames) if frames else pl.DataFrame(schema=SCHEMA)).write_parquet)
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)
    return {"files_read": files_read, "functions": functions, "raw_bytes": raw_bytes,
            "text_bytes": text_bytes, "skipped": skipped, "skipped_files": skipped_files, "dropped_functions": dropped}


def split_work(files: list, cfg: CorpusConfig, n_parts: int) -> list[tuple[list[str], CorpusConfig]]:
    """Round-robin ``files`` into ``n_parts`` shares, each with its share of ``cfg.max_functions``
    (the first ``max_functions % n_parts`` shares get one more), for ``write_corpus_part`` on
    each engine. Raises ValueError naming ``n_parts`` if it is not positive."""
    if n_parts < 1:
        raise ValueError(f"n_parts: must be positive, got {n_parts}")
    work = []
    for i in range(n_parts):
        budget = cfg.max_functions
        if budget is not None:
            budget = budget // n_parts + (i < budget % n_parts)
        part_cfg = dataclasses.replace(cfg, max_functions=max(budget, 1) if budget is not None else None)
        work.append(([str(p) for p in files[i::n_parts]], part_cfg))
    return work


def merge_stats(parts: list[dict]) -> dict:
    """Sum ``write_corpus_part`` results: counts added, skip reasons added, skipped files merged."""
    total = {"files_read": 0, "functions": 0, "raw_bytes": 0, "text_bytes": 0, "skipped": {}, "skipped_files": {},
             "dropped_functions": {}}
    for part in parts:
        for reason, n in part.get("dropped_functions", {}).items():
            total["dropped_functions"][reason] = total["dropped_functions"].get(reason, 0) + n
        for key in ("files_read", "functions", "raw_bytes", "text_bytes"):
            total[key] += part[key]
        for reason, n in part["skipped"].items():
            total["skipped"][reason] = total["skipped"].get(reason, 0) + n
        total["skipped_files"].update(part["skipped_files"])
    return total


def build_corpus(cfg: CorpusConfig, out_dir: str, *, n_parts: int = 1) -> dict:
    """Single-process corpus: ``find_elf_files``, ``split_work`` into ``n_parts``, write
    ``out_dir/part-XXXXX.parquet`` for each, one more part per text source kind with files
    (``labkit.data.sources``; "functions" then counts their documents too), then
    ``out_dir/corpus.json`` last (atomic).

    ``corpus.json`` (and the return value) is ``merge_stats`` of the parts plus ``n_parts``,
    ``parts`` (file names) and ``config`` (``to_dict(cfg)``). Raises FileNotFoundError naming a
    missing ``cfg.paths`` entry and ValueError for ``n_parts < 1``.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = find_elf_files(cfg) if cfg.paths else []
    results, names = [], []
    for i, (share, part_cfg) in enumerate(split_work(files, cfg, n_parts) if files else []):
        names.append(f"part-{i:05d}.parquet")
        results.append(write_corpus_part(share, part_cfg, str(out / names[-1])))
    for kind in ("text", "jsonl", "parquet"):  # text sources: one more part per kind that has files
        text_files = find_source_files(kind, cfg)
        if text_files:
            names.append(f"part-{len(names):05d}.parquet")
            results.append(write_source_part(kind, text_files, cfg, str(out / names[-1])))
    stats = merge_stats(results) | {"n_parts": n_parts, "parts": names, "config": to_dict(cfg)}
    stats = json.loads(json.dumps(stats))  # the return value equals corpus.json (tuples as lists)
    _atomic_write_json(stats, out / "corpus.json")
    return stats
