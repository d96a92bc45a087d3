"""Tests of the packing modes of labkit/data/pack.py and shards.py: padded rows against one
encode per document, packing efficiency against a count of the rows, and shard sets whose
tokenizer has the special tokens of an older labkit (ids 0..4, no [NEXT])."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from labkit.config import LEGACY_SPECIAL_TOKENS, SPECIAL_TOKENS, ShardConfig
from labkit.data.mlm import make_loader
from labkit.data.pack import pad_rows
from labkit.data.heldout import read_heldout
from labkit.data.shards import SequenceReader, packing_of, read_index, write_shards

WORDS = [f"w{i}" for i in range(40)]


def _word_tokenizer(path, specials=SPECIAL_TOKENS) -> str:
    """A WordLevel tokenizer: the specials at 0.., then w0..w39 (one id per word)."""
    vocab = {t: i for i, t in enumerate(specials)} | {w: len(specials) + i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return str(path)


@pytest.fixture()
def docs(tmp_path):
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 30)))) for _ in range(200)]
    texts[5] = ""  # no token: no row in padded mode
    path = tmp_path / "docs.parquet"
    pl.DataFrame({"text": texts}).write_parquet(path)
    return str(path), texts


def test_pad_rows_by_hand():
    flat, lens = np.arange(10, 22), np.array([3, 0, 7, 2])
    expected = np.array([[10, 11, 12, 0, 0], [0, 0, 0, 0, 0], [13, 14, 15, 16, 17], [20, 21, 0, 0, 0]])
    np.testing.assert_array_equal(pad_rows(flat, lens, 5), expected)


@pytest.mark.parametrize("groups", [1, 3])
def test_padded_rows_are_one_document_each(docs, tmp_path, groups):
    docs_path, texts = docs
    tok_path = _word_tokenizer(tmp_path / "tokenizer.json")
    cfg = ShardConfig(seq_len=16, packing="padded", sequences_per_shard=50, heldout_fraction=0.1)
    index = write_shards(docs_path, tok_path, str(tmp_path / "s"), cfg, progress=False, groups=groups)
    tok = Tokenizer.from_file(tok_path)
    held = np.random.default_rng(0).random(len(texts)) < 0.1  # labkit.data.heldout's rule
    ref = [tok.encode(t).ids[:16] for i, t in enumerate(texts) if t and not held[i]]
    ref = np.array([r + [0] * (16 - len(r)) for r in ref])
    rows = SequenceReader(tmp_path / "s").rows(np.arange(index["n_sequences"]))
    np.testing.assert_array_equal(rows, ref)
    held_ref = [tok.encode(t).ids[:16] for i, t in enumerate(texts) if t and held[i]]
    np.testing.assert_array_equal(read_heldout(tmp_path / "s"), [r + [0] * (16 - len(r)) for r in held_ref])
    lens = np.array([len(t.split()) for i, t in enumerate(texts) if not held[i]])
    assert index["packing"] == {"mode": "padded", "efficiency": np.count_nonzero(ref) / ref.size,
                                "cross_document_attention": False, "truncated_documents": int((lens > 16).sum()),
                                "truncated_tokens": int(np.maximum(lens - 16, 0).sum())}
    assert index["n_tokens"] == np.count_nonzero(ref) and index["n_documents"] == len(lens)


def test_packed_efficiency_and_old_indexes(docs, tmp_path):
    docs_path, _ = docs
    tok_path = _word_tokenizer(tmp_path / "tokenizer.json")
    index = write_shards(docs_path, tok_path, str(tmp_path / "s"), ShardConfig(seq_len=16), progress=False)
    rows = SequenceReader(tmp_path / "s").rows(np.arange(index["n_sequences"]))
    assert index["packing"] == {"mode": "packed", "efficiency": np.count_nonzero(rows) / rows.size,
                                "cross_document_attention": True, "truncated_documents": 0, "truncated_tokens": 0}
    old = {k: v for k, v in read_index(tmp_path / "s").items() if k != "packing"}  # an index from before
    assert packing_of(old) == index["packing"]


def test_a_tokenizer_without_next_keeps_id_5_an_ordinary_token(docs, tmp_path):
    """Shards from a tokenizer of the five older specials record them; masking then chooses and
    draws id 5 (w0) like any word, and never [PAD]..[MASK]."""
    docs_path, _ = docs
    tok_path = _word_tokenizer(tmp_path / "tokenizer.json", specials=LEGACY_SPECIAL_TOKENS)
    index = write_shards(docs_path, tok_path, str(tmp_path / "s"), ShardConfig(seq_len=16), progress=False)
    assert index["special_ids"] == {t: i for i, t in enumerate(LEGACY_SPECIAL_TOKENS)}
    loader = make_loader(str(tmp_path / "s"), batch_size=8, rank=0, world_size=1, seed=0, mlm_probability=0.5,
                         vocab_size=index["vocab_size"])
    labels = np.concatenate([b["labels"].numpy().ravel() for b in loader])
    assert (labels == 5).any() and not np.isin(labels, [0, 1, 2, 3, 4]).any()
    assert loader.collate_fn.low == 5


def test_a_tokenizer_with_next_elsewhere_is_refused(docs, tmp_path):
    from labkit.data.shards import ShardError

    vocab = {t: i for i, t in enumerate(LEGACY_SPECIAL_TOKENS)} | {"w0": 5, "[NEXT]": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ShardError, match=r"\[NEXT\] has id 6, expected 5"):
        write_shards(docs[0], str(tmp_path / "tokenizer.json"), str(tmp_path / "s"), ShardConfig(seq_len=16),
                     progress=False)
