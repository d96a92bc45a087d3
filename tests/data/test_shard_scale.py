"""Shard sets at scale: thousands of shards under a low open-files limit, ids above 65,535 in a
tokenizer with gaps, parallel packing groups, and verify and reader agreeing on every defect."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import resource
import shutil

import numpy as np
import polars as pl
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from labkit.config import SPECIAL_TOKENS, ShardConfig, TokenizerConfig
from labkit.data.mlm import ShardDataset, check_shards
from labkit.data.shards import SequenceReader, ShardError, verify_shards, write_shards
from labkit.data.tokenize import train_tokenizer
from tests.data.test_shards import disasm_docs


def write_many_shards(out, n_shards: int, seq_len: int = 8, rows_per_shard: int = 2):
    """A valid shard set of ``n_shards`` tiny uint16 shards, written directly; sequence i of the
    set is [2, i % 60000 + 5, ...] so a read can be checked by value."""
    out.mkdir(parents=True)
    shards = []
    for k in range(n_shards):
        ids = np.arange(k * rows_per_shard, (k + 1) * rows_per_shard)
        block = np.full((rows_per_shard, seq_len), 7, dtype="<u2")
        block[:, 0], block[:, 1] = 2, ids % 60000 + 5
        data = block.tobytes()
        (out / f"shard-{k:05d}.bin").write_bytes(data)
        shards.append({"file": f"shard-{k:05d}.bin", "n_sequences": rows_per_shard, "n_bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()})
    n = n_shards * rows_per_shard
    index = {"format": "labkit-shards", "version": 1, "dtype": "uint16", "seq_len": seq_len, "vocab_size": 60005,
             "tokenizer_sha256": "ab" * 32, "special_ids": {t: i for i, t in enumerate(SPECIAL_TOKENS)},
             "n_documents": n, "n_sequences": n, "n_tokens": n * seq_len, "n_bytes": n * seq_len * 2, "shards": shards}
    (out / "index.json").write_text(json.dumps(index))
    return out


def test_5000_shards_read_with_256_open_files(tmp_path):
    data = write_many_shards(tmp_path / "s", 5000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        reader = SequenceReader(data)  # default max_open=64
        order = np.random.default_rng(0).permutation(len(reader))
        got = reader.rows(order)[:, 1]  # every shard touched, in random order
        assert len(reader) == 10_000 and got.tolist() == (order % 60000 + 5).tolist()
        assert len(reader._fds) == 64 and len(os.listdir("/proc/self/fd")) < 256
        ds = ShardDataset(str(data), max_open=16)
        assert ds.__getitems__([9999, 0, 4321])[:, 1].tolist() == [10004, 5, 4326]
        assert verify_shards(data)["n_sequences"] == 10_000
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def gapped_tokenizer(path) -> str:
    """A WordPiece tokenizer of 1,006 pieces whose ids go up to 70,999: a count below 65,536, ids above."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)} | {f"w{i}": 70_000 + i for i in range(1000)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    assert tok.get_vocab_size() == 1006
    return str(path)


def test_ids_above_65535_give_uint32_shards_that_round_trip(tmp_path):
    tok = gapped_tokenizer(tmp_path / "tokenizer.json")
    texts = ["w0 w999 w5", "w17 w0", "w998"]
    pl.DataFrame({"text": texts}).write_parquet(tmp_path / "docs.parquet")
    index = write_shards(str(tmp_path / "docs.parquet"), tok, str(tmp_path / "s"), ShardConfig(seq_len=8),
                         progress=False)
    assert index["dtype"] == "uint32" and index["vocab_size"] == 71_000  # the largest id + 1, not the count
    expected = [2, 70_000, 70_999, 70_005, 3, 70_017, 70_000, 3, 2, 70_998, 3, 0, 0, 0, 0, 0]
    assert SequenceReader(tmp_path / "s", verify=True).rows([0, 1]).reshape(-1).tolist() == expected
    # a model whose vocabulary is smaller than the largest id: refused when writing and when loading
    with pytest.raises(ShardError, match=r"emits ids up to 70999, not below the model's vocabulary size 65536") as e:
        write_shards(str(tmp_path / "docs.parquet"), tok, str(tmp_path / "t"),
                     ShardConfig(seq_len=8, model_vocab_size=65536), progress=False)
    assert "\n" not in str(e.value)
    with pytest.raises(ShardError, match="vocab_size: run has 65536, smaller than the shards' 71000") as e:
        check_shards(str(tmp_path / "s"), vocab_size=65536)
    assert "\n" not in str(e.value)


def test_an_id_too_large_for_the_index_is_refused_by_verify(tmp_path):
    data = write_many_shards(tmp_path / "s", 3)
    raw = bytearray((data / "shard-00001.bin").read_bytes())
    raw[2:4] = (60005).to_bytes(2, "little")  # not below vocab_size 60005
    (data / "shard-00001.bin").write_bytes(bytes(raw))
    index = json.loads((data / "index.json").read_text())
    index["shards"][1]["sha256"] = hashlib.sha256(bytes(raw)).hexdigest()
    (data / "index.json").write_text(json.dumps(index))
    with pytest.raises(ShardError, match=r"shard-00001\.bin: holds id 60005, not below the index's vocab_size 60005"):
        verify_shards(data)


def _damage(data, how: str) -> str:
    """Damage a valid set one way; the file the error must name."""
    index = json.loads((data / "index.json").read_text())
    if how == "empty_shard":
        (data / "shard-00001.bin").write_bytes(b"")
        index["shards"][1].update(n_sequences=0, n_bytes=0, sha256=hashlib.sha256(b"").hexdigest())
        index["n_sequences"] -= 2
        name = "shard-00001.bin"
    elif how == "partial_sequence":
        (data / "shard-00002.bin").write_bytes((data / "shard-00002.bin").read_bytes()[:-6])
        name = "shard-00002.bin"
    elif how == "missing":
        (data / "shard-00000.bin").unlink()
        name = "shard-00000.bin"
    elif how == "extra":
        shutil.copy(data / "shard-00000.bin", data / "shard-00004.bin")
        name = "shard-00004.bin"
    elif how == "duplicated":
        index["shards"].append(dict(index["shards"][0]))
        index["n_sequences"] += 2
        name = "shard-00000.bin"
    elif how == "other_dtype":  # an index of another tokenizer: ids above uint16 in a uint16 set
        index["vocab_size"] = 70_000
        name = "index.json"
    (data / "index.json").write_text(json.dumps(index))
    return name


@pytest.mark.parametrize("how", ["empty_shard", "partial_sequence", "missing", "extra", "duplicated", "other_dtype"])
def test_verify_and_reader_refuse_the_same_sets_naming_the_file(tmp_path, how):
    data = write_many_shards(tmp_path / "s", 4)
    name = _damage(data, how)
    for check in (verify_shards, SequenceReader, ShardDataset):
        with pytest.raises(ShardError) as e:
            check(data)
        assert str(e.value).startswith(str(data / name)) and "\n" not in str(e.value), (check, str(e.value))


def test_an_index_of_another_tokenizer_is_refused_by_both(tmp_path):
    data = write_many_shards(tmp_path / "s", 2)
    tok = gapped_tokenizer(tmp_path / "tokenizer.json")
    for check in (verify_shards, SequenceReader):
        with pytest.raises(ShardError, match="is not the tokenizer the shards"):
            check(data, tokenizer_path=tok)


@pytest.fixture(scope="module")
def real_docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("groups")
    pl.DataFrame({"text": disasm_docs(400, seed=3)}).write_parquet(d / "docs.parquet")
    tok = train_tokenizer(str(d / "docs.parquet"), TokenizerConfig(vocab_size=200), str(d / "tokenizer.json"))
    return str(d / "docs.parquet"), tok


@pytest.mark.parametrize("groups", [2, 3])
def test_packing_groups_keep_the_token_multiset_and_are_deterministic(real_docs, tmp_path, groups):
    docs, tok = real_docs
    cfg = ShardConfig(seq_len=16, sequences_per_shard=10, part_docs=70)
    one = write_shards(docs, tok, str(tmp_path / "one"), cfg, progress=False)
    many = write_shards(docs, tok, str(tmp_path / "many"), cfg, progress=False, groups=groups)
    again = write_shards(docs, tok, str(tmp_path / "again"), ShardConfig(seq_len=16, sequences_per_shard=10,
                                                                         part_docs=33), progress=False, groups=groups)
    assert many == again and many["pack_groups"] == groups  # the parts' layout does not matter

    def tokens(d):  # document tokens and their [SEP]s (not [CLS]/[PAD]) as a multiset
        ids = SequenceReader(d, verify=True).rows(np.arange(len(SequenceReader(d))))
        return collections.Counter(ids[(ids != 0) & (ids != 2)].tolist())

    assert tokens(tmp_path / "many") == tokens(tmp_path / "one")
    assert [s["file"] for s in many["shards"]] == [f"shard-{k:05d}.bin" for k in range(len(many["shards"]))]
    assert many["n_documents"] == one["n_documents"] == 400
    assert one["n_sequences"] <= many["n_sequences"] <= one["n_sequences"] + groups - 1  # one padded row per group


def test_default_shards_are_tens_of_mib():
    from labkit.data.shards import rows_per_shard

    cfg = ShardConfig()
    assert rows_per_shard(cfg, np.dtype("<u2")) * cfg.seq_len * 2 == 32 * 2**20
    assert rows_per_shard(ShardConfig(seq_len=512), np.dtype("<u4")) * 512 * 4 == 32 * 2**20
