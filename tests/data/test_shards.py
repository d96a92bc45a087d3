"""Tests of labkit/data/shards.py: packing against hand-built rows, shards against a
one-document-at-a-time reference, batch-size independence, and every ShardError path."""

from __future__ import annotations

import hashlib
import json
import pickle
import random

import numpy as np
import polars as pl
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from labkit.config import SPECIAL_TOKENS, ShardConfig, TokenizerConfig
from labkit.data.shards import (ShardError, SequenceReader, check_shards, check_tokenizer, doc_stream,
                                encode_part, finish_shards, pack_documents, pack_rows, parts_dir_for, plan_parts,
                                read_index, shard_dtype, verify_shards, write_shards)
from labkit.data.tokenize import load_tokenizer, tokenizer_sha256, train_tokenizer


def disasm_docs(n_docs: int, seed: int = 0) -> list[str]:
    """Functions of 1-12 x86-64 instructions in labkit's normalised capstone style."""
    rng = random.Random(seed)
    regs = ["rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "r8"]
    return ["\n".join(rng.choice([f"mov {rng.choice(regs)}, qword ptr [{rng.choice(regs)} - 8]",
                                  f"add {rng.choice(regs)}, {rng.choice(regs)}", "call FUNC", "ret"])
                      for _ in range(rng.randint(1, 12))) for _ in range(n_docs)]


from tests.data.real_corpus import libc_functions  # noqa: E402  (real input)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[str, str, list[str]]:
    d = tmp_path_factory.mktemp("in")
    docs = disasm_docs(150)
    docs[7] = ""  # an empty function still contributes its [SEP]
    docs[9] = "[MASK] mov rax, [PAD]"  # special-token strings in text are text, not special ids
    pl.DataFrame({"text": docs}).write_parquet(d / "docs.parquet")
    tok = train_tokenizer(str(d / "docs.parquet"), TokenizerConfig(vocab_size=200), str(d / "tokenizer.json"))
    return str(d / "docs.parquet"), tok, docs


def reference_rows(docs: list[str], tokenizer_path: str, seq_len: int) -> np.ndarray:
    """The packed rows built the slow, obvious way: one encode per document, plain Python lists."""
    tok = load_tokenizer(tokenizer_path)
    tok.encode_special_tokens = True
    stream = []
    for doc in docs:
        stream += tok.encode(doc, add_special_tokens=False).ids + [3]
    rows = []
    for i in range(0, len(stream), seq_len - 1):
        body = stream[i:i + seq_len - 1]
        rows.append([2] + body + [0] * (seq_len - 1 - len(body)))
    return np.array(rows, dtype=np.uint16)


def test_pack_documents_by_hand():
    docs = [[10, 11, 12], [20, 21], [30, 31, 32, 33, 34, 35], [40]]
    expected = np.array([[2, 10, 11, 12, 3, 20, 21, 3],
                         [2, 30, 31, 32, 33, 34, 35, 3],
                         [2, 40, 3, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(pack_documents(docs, 8), expected)
    np.testing.assert_array_equal(pack_documents(docs[:3], 8), expected[:2])  # exact fit: no PAD row
    assert pack_documents([], 8).shape == (0, 8)


def test_pack_rows_carry_over_is_split_independent():
    stream = doc_stream([list(range(5, 5 + n)) for n in (0, 3, 17, 1, 9, 30)])
    whole = pack_rows(stream, 8, final=True)[0]
    for cut in (0, 1, 7, 13, 40, len(stream)):
        first, carry = pack_rows(stream[:cut], 8, final=False)
        second = pack_rows(np.concatenate([carry, stream[cut:]]), 8, final=True)[0]
        np.testing.assert_array_equal(np.concatenate([first, second]), whole)


def test_write_shards_matches_reference(inputs, tmp_path):
    docs_path, tok_path, docs = inputs
    index = write_shards(docs_path, tok_path, str(tmp_path), ShardConfig(seq_len=16, sequences_per_shard=7),
                         progress=False)
    ref = reference_rows(docs, tok_path, 16)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["index.json"] + [s["file"] for s in index["shards"]]
    data = b"".join((tmp_path / s["file"]).read_bytes() for s in index["shards"])
    assert data == ref.astype("<u2").tobytes()
    assert not np.isin(ref[:, 1:], [2, 4]).any()  # the [MASK] string was encoded as text
    assert json.loads((tmp_path / "index.json").read_text()) == index == read_index(tmp_path)
    assert index["format"] == "labkit-shards" and index["version"] == 1 and index["dtype"] == "uint16"
    assert index["seq_len"] == 16 and index["vocab_size"] == load_tokenizer(tok_path).get_vocab_size()
    assert index["tokenizer_sha256"] == tokenizer_sha256(tok_path)
    assert index["special_ids"] == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert index["n_documents"] == len(docs) and index["n_sequences"] == len(ref)
    assert index["n_tokens"] == np.count_nonzero(ref) and index["n_bytes"] == ref.size * 2
    assert [s["n_sequences"] for s in index["shards"]] == [7] * (len(ref) // 7) + [len(ref) % 7] * (len(ref) % 7 > 0)
    for s in index["shards"]:
        raw = (tmp_path / s["file"]).read_bytes()
        assert s["sha256"] == hashlib.sha256(raw).hexdigest() and s["n_bytes"] == len(raw)
    assert verify_shards(tmp_path) == index


def test_streaming_tiny_batches_and_parts_give_the_same_bytes(inputs, tmp_path, monkeypatch):
    import labkit.data.pack

    docs_path, tok_path, _ = inputs
    for b, part in ((3, 7), (10_000, 10_000)):
        monkeypatch.setattr(labkit.data.pack, "SLICE_DOCS", 2 if b == 3 else 4096)  # packing slices too
        write_shards(docs_path, tok_path, str(tmp_path / str(b)),
                     ShardConfig(seq_len=12, sequences_per_shard=5, batch_docs=b, part_docs=part), progress=False)
    small, large = sorted((tmp_path / "3").iterdir()), sorted((tmp_path / "10000").iterdir())
    assert [p.name for p in small] == [p.name for p in large] and len(small) > 3
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(small, large))  # index.json too
    assert len(list((tmp_path / "3.parts").glob("part-*.json"))) == 22  # ceil(150 / 7)


def test_sequence_reader(inputs, tmp_path):
    docs_path, tok_path, docs = inputs
    write_shards(docs_path, tok_path, str(tmp_path), ShardConfig(seq_len=16, sequences_per_shard=7), progress=False)
    ref = reference_rows(docs, tok_path, 16)
    r = SequenceReader(tmp_path, verify=True)
    assert len(r) == len(ref) and r.seq_len == 16 and r.vocab_size == r.index["vocab_size"]
    for i in (0, 6, 7, 8, len(ref) - 1, -1):
        row = r[i]
        assert row.dtype == np.uint16 and row.shape == (16,)
        np.testing.assert_array_equal(row, ref[i])
    with pytest.raises(IndexError):
        r[len(ref)]
    blob = pickle.dumps(r)
    # no data: the index, and each file's identity (size, inode, device, mtime: 32 bytes)
    n_files = len(r.index["shards"]) + 1
    assert len(blob) < len(pickle.dumps(r.index)) + 500 + 32 * n_files < len(pickle.dumps(r.index)) + ref.nbytes
    copy = pickle.loads(blob)
    np.testing.assert_array_equal(np.stack([copy[np.int64(i)] for i in range(len(copy))]), ref)


def test_uint32_for_large_vocabularies(tmp_path):
    assert shard_dtype(65536) == np.uint16 and shard_dtype(65537) == np.uint32
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)} | {f"w{i}": i for i in range(6, 70_000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    pl.DataFrame({"text": ["w6 w69999 w65536", "w70000 w65535"]}).write_parquet(tmp_path / "docs.parquet")
    index = write_shards(str(tmp_path / "docs.parquet"), str(tmp_path / "tokenizer.json"), str(tmp_path / "s"),
                         ShardConfig(seq_len=8), progress=False)
    assert index["dtype"] == "uint32" and index["vocab_size"] == 70_000
    expected = [2, 6, 69999, 65536, 3, 1, 65535, 3]  # w70000 is not in the vocabulary -> [UNK]
    assert np.fromfile(tmp_path / "s" / "shard-00000.bin", dtype="<u4").tolist() == expected
    np.testing.assert_array_equal(SequenceReader(tmp_path / "s")[0], expected)


def test_rewrite_removes_old_shards_and_progress_goes_to_stderr(inputs, tmp_path, capsys):
    docs_path, tok_path, _ = inputs
    write_shards(docs_path, tok_path, str(tmp_path), ShardConfig(seq_len=16, sequences_per_shard=3), progress=False)
    assert capsys.readouterr().err == "" and len(list(tmp_path.iterdir())) > 3
    (tmp_path / ".shard-00042.bin.x1y2z3.tmp").write_bytes(b"left by a crashed run")  # labkit.io temp name
    (tmp_path / "notes.txt").write_text("not ours")
    index = write_shards(docs_path, tok_path, str(tmp_path), ShardConfig(seq_len=16, sequences_per_shard=1000))
    assert "150/150" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json", "notes.txt", "shard-00000.bin"]
    assert sorted(p.name for p in parts_dir_for(tmp_path).iterdir()) == ["keep.npy", "part-00000.ids", "part-00000.json",
                                                                       "part-00000.lens", "shard-00000.json"]
    assert verify_shards(tmp_path) == index


def test_corrupt_byte_names_the_shard(inputs, tmp_path):
    docs_path, tok_path, _ = inputs
    write_shards(docs_path, tok_path, str(tmp_path), ShardConfig(seq_len=16, sequences_per_shard=7), progress=False)
    bad = tmp_path / "shard-00002.bin"
    raw = bytearray(bad.read_bytes())
    raw[5] ^= 0xFF
    bad.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"shard-00002\.bin.*sha256"):
        verify_shards(tmp_path)
    with pytest.raises(ShardError, match=r"shard-00002\.bin"):
        SequenceReader(tmp_path, verify=True)
    assert len(SequenceReader(tmp_path)) > 0  # sizes still match, so an unverified open works


def test_truncated_or_missing_shard(inputs, tmp_path):
    docs_path, tok_path, _ = inputs
    write_shards(docs_path, tok_path, str(tmp_path), ShardConfig(seq_len=16, sequences_per_shard=7), progress=False)
    (tmp_path / "shard-00001.bin").write_bytes((tmp_path / "shard-00001.bin").read_bytes()[:-2])
    with pytest.raises(ShardError, match=r"shard-00001\.bin: 222 bytes on disk, index says 224"):
        SequenceReader(tmp_path)
    (tmp_path / "shard-00001.bin").unlink()
    with pytest.raises(ShardError, match=r"shard-00001\.bin: shard file missing"):
        verify_shards(tmp_path)


def test_index_errors(inputs, tmp_path):
    docs_path, tok_path, _ = inputs
    write_shards(docs_path, tok_path, str(tmp_path), ShardConfig(seq_len=16), progress=False)
    good = (tmp_path / "index.json").read_text()
    cases = [("{not json", "malformed JSON"),
             (good.replace('"labkit-shards"', '"mds"'), "format is 'mds'"),
             (good.replace('"version": 1', '"version": 2'), "unknown version 2"),
             (good.replace('"seq_len"', '"seqlen"'), r"missing fields \['seq_len'\]")]
    for text, message in cases:
        (tmp_path / "index.json").write_text(text)
        with pytest.raises(ShardError, match=message):
            read_index(tmp_path)
    (tmp_path / "index.json").unlink()
    with pytest.raises(ShardError, match=f"not a complete shard set: index.json missing in {tmp_path}"):
        read_index(tmp_path)
    with pytest.raises(ValueError, match="index.json missing"):  # ShardError is a ValueError
        SequenceReader(tmp_path)


def test_check_shards(inputs, tmp_path):
    docs_path, tok_path, _ = inputs
    index = write_shards(docs_path, tok_path, str(tmp_path), ShardConfig(seq_len=16), progress=False)
    assert check_shards(tmp_path, seq_len=16, vocab_size=index["vocab_size"], dtype=index["dtype"],
                        tokenizer_sha256=tokenizer_sha256(tok_path), verify=True) == index
    with pytest.raises(ShardError, match="seq_len: run expects 128, shards have 16"):
        check_shards(tmp_path, seq_len=128)
    with pytest.raises(ShardError, match=r"tokenizer_sha256: run expects 'abc'.*vocab_size: run has 8, smaller"):
        check_shards(tmp_path, vocab_size=8, tokenizer_sha256="abc")


def test_no_documents_and_bad_tokenizer(inputs, tmp_path):
    docs_path, tok_path, _ = inputs
    pl.DataFrame({"text": []}, schema={"text": pl.Utf8}).write_parquet(tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="empty.parquet: no documents"):
        write_shards(str(tmp_path / "empty.parquet"), tok_path, str(tmp_path / "s"), ShardConfig(), progress=False)
    assert not (tmp_path / "s" / "index.json").exists()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "wrong.json"))
    with pytest.raises(ShardError, match=r"wrong\.json: \[PAD\] has id 1, expected 0"):
        write_shards(docs_path, str(tmp_path / "wrong.json"), str(tmp_path / "s"), ShardConfig(), progress=False)


def test_real_libc_disassembly(tmp_path):
    docs = libc_functions(200)
    pl.DataFrame({"text": docs}).write_parquet(tmp_path / "libc.parquet")
    tok = train_tokenizer(str(tmp_path / "libc.parquet"), TokenizerConfig(vocab_size=400), str(tmp_path / "t.json"))
    index = write_shards(str(tmp_path / "libc.parquet"), tok, str(tmp_path / "s"),
                         ShardConfig(seq_len=64, sequences_per_shard=50, batch_docs=17), progress=False)
    ref = reference_rows(docs, tok, 64)
    r = SequenceReader(tmp_path / "s", verify=True)
    np.testing.assert_array_equal(np.stack([r[i] for i in range(len(r))]), ref)
    assert index["n_tokens"] == np.count_nonzero(ref) and len(index["shards"]) == -(-len(ref) // 50)


def test_parts_in_any_order_give_the_single_process_bytes(inputs, tmp_path):
    """Simulated engines: parts encoded in reverse order by separate calls, then one packing pass."""
    docs_path, tok_path, _ = inputs
    cfg = ShardConfig(seq_len=16, sequences_per_shard=6, part_docs=40)
    ref = write_shards(docs_path, tok_path, str(tmp_path / "one"), cfg, progress=False)
    plan = plan_parts(150, 17)  # another part size, as build_shards picks per engine count
    parts_dir = str(parts_dir_for(tmp_path / "many"))
    parts = [encode_part(docs_path, tok_path, parts_dir, i, s, e, batch_docs=5) for i, (s, e) in reversed(list(enumerate(plan)))]
    index = finish_shards(docs_path, tok_path, str(tmp_path / "many"), cfg, parts, progress=False)
    assert index == ref
    for s in ref["shards"]:
        assert (tmp_path / "many" / s["file"]).read_bytes() == (tmp_path / "one" / s["file"]).read_bytes()
    with pytest.raises(ValueError, match="do not tile"):
        finish_shards(docs_path, tok_path, str(tmp_path / "bad"), cfg, parts[1:], progress=False)


def test_interrupted_encoding_resumes_and_skips_finished_parts(inputs, tmp_path, monkeypatch):
    import labkit.data.shards as S

    docs_path, tok_path, _ = inputs
    cfg = ShardConfig(seq_len=16, sequences_per_shard=6, part_docs=30)  # 5 parts
    ref = write_shards(docs_path, tok_path, str(tmp_path / "ref"), cfg, progress=False)
    real, calls = S.encode_part, []

    def crash_after_two(*args, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt("interrupted")
        calls.append(args[3])
        return real(*args, **kw)

    monkeypatch.setattr(S, "encode_part", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        write_shards(docs_path, tok_path, str(tmp_path / "run"), cfg, progress=False)
    with pytest.raises(ShardError, match="index.json missing|does not exist"):
        SequenceReader(tmp_path / "run")  # not a dataset
    monkeypatch.setattr(S, "encode_part", lambda *a, **kw: calls.append(real(*a, **kw)) or calls[-1])
    calls.clear()
    index = write_shards(docs_path, tok_path, str(tmp_path / "run"), cfg, progress=False)
    assert [c["skipped"] for c in calls] == [True, True, False, False, False]
    assert index == ref and verify_shards(tmp_path / "run") == ref
    # a damaged finished part (sha256 mismatch) is encoded again, not trusted
    ids = parts_dir_for(tmp_path / "run") / "part-00001.ids"
    raw = bytearray(ids.read_bytes())
    raw[0] ^= 1
    ids.write_bytes(bytes(raw))
    calls.clear()
    assert write_shards(docs_path, tok_path, str(tmp_path / "run"), cfg, progress=False) == ref
    assert [c["skipped"] for c in calls] == [True, False, True, True, True]


def test_interrupted_packing_skips_finished_shards(inputs, tmp_path, monkeypatch):
    import labkit.data.pack as S  # shards are written by pack.atomic_write_bytes

    docs_path, tok_path, _ = inputs
    cfg = ShardConfig(seq_len=16, sequences_per_shard=6)
    ref = write_shards(docs_path, tok_path, str(tmp_path / "ref"), cfg, progress=False)
    assert len(ref["shards"]) > 5
    real, written = S.atomic_write_bytes, []

    def crash_on_fourth_shard(path, data):
        if path.name.startswith("shard-") and path.suffix == ".bin":
            if len(written) == 3:
                raise OSError("disk full")
            written.append(path.name)
        real(path, data)

    monkeypatch.setattr(S, "atomic_write_bytes", crash_on_fourth_shard)
    with pytest.raises(OSError, match="disk full"):
        write_shards(docs_path, tok_path, str(tmp_path / "run"), cfg, progress=False)
    assert not (tmp_path / "run" / "index.json").exists()
    before = {n: (tmp_path / "run" / n).stat().st_mtime_ns for n in written}
    written.clear()
    monkeypatch.setattr(S, "atomic_write_bytes", lambda path, data: (written.append(path.name) if path.suffix == ".bin" else None)
                        or real(path, data))
    index = write_shards(docs_path, tok_path, str(tmp_path / "run"), cfg, progress=False)
    assert index == ref
    assert written == [s["file"] for s in ref["shards"][3:]]  # the three finished shards were not rewritten
    assert {n: (tmp_path / "run" / n).stat().st_mtime_ns for n in before} == before
    for s in ref["shards"]:
        assert (tmp_path / "run" / s["file"]).read_bytes() == (tmp_path / "ref" / s["file"]).read_bytes()
    # a finished shard damaged on disk (same size) is written again
    bad = tmp_path / "run" / "shard-00002.bin"
    raw = bytearray(bad.read_bytes())
    raw[7] ^= 0xFF
    bad.write_bytes(bytes(raw))
    written.clear()
    assert write_shards(docs_path, tok_path, str(tmp_path / "run"), cfg, progress=False) == ref
    assert written == ["shard-00002.bin"] and verify_shards(tmp_path / "run") == ref


def test_a_different_tokenizer_is_refused(inputs, tmp_path):
    docs_path, tok_path, _ = inputs
    write_shards(docs_path, tok_path, str(tmp_path / "s"), ShardConfig(seq_len=16), progress=False)
    other = train_tokenizer(docs_path, TokenizerConfig(vocab_size=150), str(tmp_path / "other.json"))
    assert check_tokenizer(tmp_path / "s", tok_path)["tokenizer_sha256"] == tokenizer_sha256(tok_path)
    with pytest.raises(ShardError, match=rf"other\.json \(sha256 {tokenizer_sha256(other)}\) is not the tokenizer"):
        check_tokenizer(tmp_path / "s", other)
    with pytest.raises(ShardError, match="is not the tokenizer the shards"):
        SequenceReader(tmp_path / "s", tokenizer_path=other)
    assert len(SequenceReader(tmp_path / "s", tokenizer_path=tok_path)) > 0
    # parts encoded with one tokenizer are never packed under another's name
    parts = [encode_part(docs_path, tok_path, str(tmp_path / "p"), 0, 0, 150)]
    with pytest.raises(ShardError, match="part-00000.ids: encoded with tokenizer"):
        finish_shards(docs_path, other, str(tmp_path / "x"), ShardConfig(seq_len=16), parts, progress=False)


# -- data that changes underneath an opened set ---------------------------------------------


def _rows_set(tmp_path, n=30, per_shard=10, seq_len=16):
    from labkit.data.shards import write_rows

    rows = np.arange(n * seq_len, dtype=np.int64).reshape(n, seq_len) % 90 + 5
    write_rows(tmp_path, rows, vocab_size=96, tokenizer_sha256="ab" * 32, rows_per_shard=per_shard)
    return rows.astype(np.uint16)


def test_a_shard_truncated_under_an_open_reader_names_the_file_and_sizes(tmp_path):
    """A ``cp`` of a shorter file onto a shard truncates the same inode: an already-open reader
    (descriptor open, the shard read before) raises ShardError naming the file and both sizes,
    where a memory map would have died of SIGBUS or failed with a bare ValueError."""
    from labkit.data.shards import open_shards

    rows = _rows_set(tmp_path)
    s = open_shards(tmp_path)
    np.testing.assert_array_equal(s.rows([12, 3, 25]), rows[[12, 3, 25]])  # every shard open
    victim = tmp_path / "shard-00001.bin"
    short = victim.read_bytes()[:5 * 16 * 2]
    with open(victim, "r+b") as f:  # what cp does to an existing destination: O_TRUNC, then write
        f.truncate(0)
        f.write(short)
    np.testing.assert_array_equal(s.rows([0, 29]), rows[[0, 29]])  # untouched shards still read
    with pytest.raises(ShardError, match=r"shard-00001\.bin: changed since the shard set was opened: "
                                         r"size 320 -> 160 bytes"):
        s.rows([11])  # a row that still exists in the shorter file
    with pytest.raises(ShardError, match="size 320 -> 160"):
        s[19]  # a row past the new end: no SIGBUS, no short array


def test_a_replaced_or_rewritten_shard_is_refused_when_read(tmp_path):
    """A rename onto the path (a new inode) is seen when a descriptor opens (here: the first
    read; in a worker: its first read); a same-size rewrite in place changes the mtime."""
    import time

    from labkit.data.shards import open_shards
    from labkit.io import replace

    rows = _rows_set(tmp_path)
    s = open_shards(tmp_path)
    new = tmp_path / "new.bin"
    new.write_bytes((tmp_path / "shard-00002.bin").read_bytes())  # same bytes, another file
    replace(new, tmp_path / "shard-00002.bin")  # a rename onto the path: a new inode
    with pytest.raises(ShardError, match=r"shard-00002\.bin: changed since the shard set was opened: "
                                         r"replaced \(inode \d+ -> \d+\)"):
        s.rows([21])
    t = open_shards(tmp_path)
    np.testing.assert_array_equal(t.rows([5]), rows[[5]])
    time.sleep(0.01)
    with open(tmp_path / "shard-00000.bin", "r+b") as f:
        f.write(b"\x05\x00")  # same size, one id rewritten
    with pytest.raises(ShardError, match=r"shard-00000\.bin: .*modified \(mtime"):
        t.rows([5])
    (tmp_path / "shard-00001.bin").unlink()
    u = pickle.loads(pickle.dumps(t))  # as a DataLoader worker gets it: reopens by path
    with pytest.raises(ShardError, match=r"shard-00001\.bin: removed since the shard set was opened"):
        u.rows([15])


def test_open_shards_reads_the_index_once_and_hashes_it(tmp_path, monkeypatch):
    import hashlib
    import io

    from labkit.data.shards import load_index, open_shards

    _rows_set(tmp_path)
    opened = []
    real = io.open

    def counting_open(file, *a, **kw):
        if str(file).endswith("index.json"):
            opened.append(str(file))
        return real(file, *a, **kw)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr("builtins.open", counting_open)
    s = open_shards(tmp_path, seq_len=16, verify=True)
    assert len(opened) == 1
    assert s.sha256 == hashlib.sha256((tmp_path / "index.json").read_bytes()).hexdigest() == load_index(tmp_path)[1]
    assert s.verified and check_shards(s, verify=True) is s.index and len(opened) == 3  # the two reads just above
    with pytest.raises(ShardError, match="seq_len: run expects 8, shards have 16"):
        open_shards(tmp_path, seq_len=8)
