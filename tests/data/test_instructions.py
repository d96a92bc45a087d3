"""Tests of labkit/data/instructions.py, the study's tokenizer, on functions of this machine's libc.

References: a transcription of the authors' ``pretokenize`` (undertale-re/undertale at be7ec98,
undertale/models/item/tokenizer.py; MIT licence) in ``authors_pretokenize`` below; HF
tokenizers' own ``Tokenizer.encode`` and transformers' ``PreTrainedTokenizerFast`` on the
normalised text; and counts taken by brute force.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from labkit.config import TokenizerConfig
from labkit.data import instructions as ins
from labkit.data.tokenize import encode_flat, unk_report
from tests.data.real_corpus import libc_functions


def authors_pretokenize(disassembly: str) -> str:
    """The authors' ``pretokenize`` (be7ec98, tokenizer.py) for capstone's x86-64 syntax, with ONE
    change marked below: their code appends no [NEXT] after an instruction without operands (a
    ``continue`` skips it), which labkit does not copy. Their Rizin-only ``arg``/``var`` branch is
    left out (capstone never prints it)."""
    pretokens = []
    for instruction in disassembly.split("\n"):
        split = instruction.split(" ", maxsplit=1)
        if split[0] in ["xacquire", "xrelease"]:
            pretokens.append(split[0])
            split = split[1].split(" ", maxsplit=1)
        if split[0] in ["lock", "bnd", "notrack", "rep", "repe", "repz", "repne", "repnz"]:
            pretokens.append(split[0])
            split = split[1].split(" ", maxsplit=1)
        if len(split) == 1:
            pretokens += [split[0], "[NEXT]"]  # CHANGED: theirs appends split[0] only, then `continue`
            continue
        mnemonic, operands = split
        pretokens.append(mnemonic)
        for operand in operands.split(","):
            operand = operand.strip()
            if operand.startswith("0x") or operand.startswith("-0x"):
                pretokens.append(str(int(operand, 16)))
            elif "[" in operand:
                if any(size in operand for size in ["qword", "word", "dword", "byte"]):
                    if "ptr" in operand:
                        size, _, operand = operand.split(maxsplit=2)
                    else:
                        size, operand = operand.split(maxsplit=1)
                    pretokens.append(size)
                if ":" in operand:
                    segment, operand = operand.split(":")
                    pretokens.append(segment)
                assert operand[0] == "[" and operand[-1] == "]"
                pretokens.append("[")
                for op in (o.strip() for o in re.split(r"(\+|-|\*)", operand[1:-1])):
                    pretokens.append(str(int(op, 16)) if op.startswith("0x") else op)
                pretokens.append("]")
            else:
                assert " " not in operand
                pretokens.append(operand)
        pretokens.append("[NEXT]")
    if pretokens and pretokens[-1] == "[NEXT]":
        pretokens.pop()
    return " ".join(pretokens)


@pytest.fixture(scope="module")
def functions() -> list[str]:
    return libc_functions(2000)


@pytest.fixture(scope="module")
def trained(functions):
    """(tokenizer trained on the first 1,500 functions with the study's settings, held-out rest)."""
    cfg = TokenizerConfig(kind="instruction", vocab_size=4096, min_frequency=0)
    return ins.train_instruction_tokenizer(functions[:1500], cfg), functions[1500:]


def test_hex_becomes_decimal():
    assert ins.instruction_pieces("mov eax, 0x10") == ["mov", "eax", "16"]
    assert ins.instruction_pieces("mov qword ptr fs:[rax + rcx*8 - 0x18], -0x1") == [
        "mov", "qword", "fs", "[", "rax", "+", "rcx", "*", "8", "-", "24", "]", "-", "1"]
    assert ins.instruction_pieces("movabs rax, 0xffffffffffffffff") == ["movabs", "rax", str(2**64 - 1)]
    assert ins.pretokenize("rep stosq qword ptr [rdi], rax\nret") == "rep stosq qword [ rdi ] rax [NEXT] ret"


def test_hex_becomes_decimal_in_the_trained_tokenizer(trained):
    tok, _ = trained
    enc = tok.encode(ins.pretokenize("mov eax, 0x10"))
    assert enc.tokens[:2] == ["mov", "eax"] and tok.decode(enc.ids[2:]) == "16"


def test_pieces_match_the_authors_pretokenize(functions):
    """Every real function: the authors' pieces with each negative immediate -N written "- N"."""
    for text in functions:
        theirs = re.sub(r"(?<!\S)-(\d)", r"- \1", authors_pretokenize(text))
        assert ins.pretokenize(text) == theirs


def test_next_sits_between_instructions(trained):
    tok, held = trained
    for text in held[:100]:
        lines = [line for line in text.split("\n") if line.strip()]
        ids = tok.encode(ins.pretokenize(text)).ids
        assert ids.count(ins.NEXT_ID) == len(lines) - 1 and ids[0] != ins.NEXT_ID and ids[-1] != ins.NEXT_ID
        split = np.split(np.array(ids), np.flatnonzero(np.array(ids) == ins.NEXT_ID))
        per_line = [s[1:] if s[0] == ins.NEXT_ID else s for s in split]
        assert [p.tolist() for p in per_line] == [tok.encode(" ".join(ins.instruction_pieces(x))).ids for x in lines]


def test_mnemonics_and_registers_are_single_tokens(trained, functions):
    """In the 1,500 training functions every mnemonic, register and other non-immediate piece is
    one token equal to itself; an immediate is one or more BPE pieces that decode to it."""
    tok, _ = trained
    mnemonics, pieces = set(), set()
    for text in functions[:1500]:
        for line in text.split("\n"):
            p = ins.instruction_pieces(line)
            mnemonics.add(next(x for x in p if x not in ins.PREFIXES))
            pieces.update(p)
    for piece in sorted(pieces):
        enc = tok.encode(piece)
        if ins.is_immediate(piece):
            assert tok.decode(enc.ids) == piece and 1 not in enc.ids
        else:
            assert enc.tokens == [piece]
    regs = {"rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rsp", "rbp", "r12", "eax", "edx", "xmm0", "rip"}
    assert regs <= pieces and {"mov", "lea", "call", "ret", "push", "pop"} <= mnemonics and len(mnemonics) > 100


def test_real_functions_round_trip_to_their_normalised_text(trained):
    tok, held = trained
    no_unk = 0
    for text in held:
        enc = tok.encode(ins.pretokenize(text))
        if 1 not in enc.ids:
            assert tok.decode(enc.ids, skip_special_tokens=False) == ins.pretokenize(text)
            no_unk += 1
    assert no_unk >= 0.95 * len(held)


def test_encode_flat_equals_hf_encode_of_the_normalised_text(trained):
    from transformers import PreTrainedTokenizerFast

    tok, held = trained
    flat, lengths = encode_flat(tok, held)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    for i, text in enumerate(held):
        expected = tok.encode(ins.pretokenize(text)).ids
        assert flat[starts[i]:starts[i + 1]].tolist() == expected
        assert hf.encode(ins.pretokenize(text), add_special_tokens=False) == expected


def test_unk_report_counts_like_encoding_each_text(trained):
    tok, held = trained
    report = unk_report(tok, held)
    ids = [tok.encode(ins.pretokenize(t)).ids for t in held]
    assert report["tokens"] == sum(map(len, ids))
    assert report["unk_tokens"] == sum(i.count(1) for i in ids)


def test_detection_and_errors(trained):
    from tokenizers import Tokenizer, models

    assert ins.is_instruction_tokenizer(trained[0])
    assert not ins.is_instruction_tokenizer(Tokenizer(models.BPE()))
    with pytest.raises(ValueError, match="no instruction"):
        ins.train_instruction_tokenizer(["", "  \n"], TokenizerConfig(kind="instruction", vocab_size=64))


def test_train_tokenizer_file_and_shards(functions, tmp_path):
    """The "instruction" kind through labkit's stages: tokenizer.json + stats from the documents
    file, then shards whose rows hold exactly the ids HF's encode gives the normalised texts."""
    import json

    import polars as pl

    from labkit.config import ShardConfig
    from labkit.data.shards import SequenceReader, write_shards
    from labkit.data.tokenize import load_tokenizer, train_tokenizer

    docs = tmp_path / "docs.parquet"
    pl.DataFrame({"id": [f"{i:016x}" for i in range(300)], "text": functions[:300]}).write_parquet(docs)
    path = train_tokenizer(str(docs), TokenizerConfig(kind="instruction", vocab_size=512, held_out_docs=30),
                           str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(path)
    stats = json.loads((tmp_path / "tokenizer.stats.json").read_text())
    assert ins.is_instruction_tokenizer(tok) and stats["kind"] == "instruction" and stats["held_out_docs"] == 30
    index = write_shards(str(docs), path, str(tmp_path / "shards"), ShardConfig(seq_len=64), progress=False)
    assert index["special_ids"]["[NEXT]"] == ins.NEXT_ID
    rows = SequenceReader(tmp_path / "shards").rows(np.arange(index["n_sequences"]))
    stream = rows[:, 1:].reshape(-1)  # packed: [CLS] + 63 stream tokens per row
    expected = np.concatenate([tok.encode(ins.pretokenize(t)).ids + [3] for t in functions[:300]])
    assert stream[:len(expected)].tolist() == expected.tolist()
