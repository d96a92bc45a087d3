"""The held-out split (labkit/data/heldout.py): by document, deterministic, disjoint from the
training shards, recorded in index.json, staged with the shards."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from labkit.config import ShardConfig, TokenizerConfig
from labkit.data.heldout import heldout_documents, read_heldout, split_keep
from labkit.data.heldout import HeldoutError
from labkit.data.shards import pack_documents, write_shards
from labkit.data.tokenize import load_tokenizer, train_tokenizer
from tests.data.test_shards import disasm_docs


def test_heldout_documents_is_deterministic_and_about_the_fraction():
    a, b = heldout_documents(20_000, 0.05, 3), heldout_documents(20_000, 0.05, 3)
    np.testing.assert_array_equal(a, b)
    assert 0.045 < a.mean() < 0.055
    assert not np.array_equal(a, heldout_documents(20_000, 0.05, 4))
    assert not heldout_documents(100, 0.0, 0).any()
    keep = np.arange(20_000) % 3 != 0
    train, held = split_keep(keep, 0.05, 3)
    assert not (train & held).any() and np.array_equal(train | held, keep)
    with pytest.raises(ValueError, match="heldout_fraction"):
        heldout_documents(10, 1.0, 0)
    with pytest.raises(ValueError, match="heldout_fraction"):
        ShardConfig(heldout_fraction=-0.1)


def test_no_document_on_both_sides_and_index_records_the_split(tmp_path):
    docs = [f"{d}\nnop" for d in disasm_docs(400, seed=5)]
    docs = [f"mov r{i}, {i}\n{d}" for i, d in enumerate(docs)]  # every document distinct
    pl.DataFrame({"text": docs}).write_parquet(tmp_path / "docs.parquet")
    tok_path = train_tokenizer(str(tmp_path / "docs.parquet"), TokenizerConfig(vocab_size=300),
                               str(tmp_path / "tokenizer.json"))
    cfg = ShardConfig(seq_len=16, sequences_per_shard=50, heldout_fraction=0.1, heldout_seed=7)
    index = write_shards(str(tmp_path / "docs.parquet"), tok_path, str(tmp_path / "out"), cfg, progress=False)
    held = heldout_documents(len(docs), 0.1, 7)
    entry = index["heldout"]
    assert entry["n_documents"] == held.sum() > 20 and index["n_documents"] == len(docs) - held.sum()
    assert entry["fraction"] == 0.1 and entry["seed"] == 7 and "default_rng" in entry["rule"]
    tok = load_tokenizer(tok_path)
    tok.encode_special_tokens = True
    ids = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    # both sides are exactly the packing of their own documents, in file order
    expected_held = pack_documents([ids[i] for i in np.flatnonzero(held)], 16)
    np.testing.assert_array_equal(read_heldout(tmp_path / "out"), expected_held)
    train = np.concatenate([np.fromfile(tmp_path / "out" / s["file"], dtype="<u2").reshape(-1, 16)
                            for s in index["shards"]])
    np.testing.assert_array_equal(train, pack_documents([ids[i] for i in np.flatnonzero(~held)], 16))
    assert read_heldout(tmp_path / "out", max_sequences=3).shape == (3, 16)
    none = write_shards(str(tmp_path / "docs.parquet"), tok_path, str(tmp_path / "none"),
                        ShardConfig(seq_len=16), progress=False)
    assert "heldout" not in none
    with pytest.raises(HeldoutError, match="no held-out split"):
        read_heldout(tmp_path / "none")
    (tmp_path / "out" / entry["shards"][0]["file"]).write_bytes(b"\0\0")
    with pytest.raises(HeldoutError, match="held-out file"):
        read_heldout(tmp_path / "out")


def test_staging_copies_the_heldout_file(tmp_path):
    from labkit.data.stage import stage_shards
    from tests.tiny_shards import write_tiny_shards

    src = write_tiny_shards(tmp_path / "src", heldout_sequences=8)
    staged = stage_shards(str(src), local_root=str(tmp_path / "local"))
    np.testing.assert_array_equal(read_heldout(staged["path"]), read_heldout(src))


def test_verify_covers_the_heldout_file_and_prints_one_line(tmp_path, capsys):
    from labkit.cli import main
    from labkit.data.shards import ShardError, verify_shards
    from tests.tiny_shards import write_tiny_shards

    src = write_tiny_shards(tmp_path / "s", heldout_sequences=8)
    assert main(["verify", str(src)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "2 shards" in out[0] and "held-out 8 sequences" in out[0], out
    held = src / "heldout-00000.bin"
    data = bytearray(held.read_bytes())
    data[37] ^= 0x01  # one flipped bit, same size: only the sha256 can tell
    held.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="heldout-00000.bin: sha256"):
        verify_shards(src)
    assert main(["verify", str(src)]) == 2
    err = capsys.readouterr().err
    assert str(held) in err and "sha256" in err
    held.unlink()
    with pytest.raises(ShardError, match="heldout-00000.bin: held-out file missing"):
        verify_shards(src)
