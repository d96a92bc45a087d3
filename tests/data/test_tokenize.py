"""Tests of labkit/data/tokenize.py: three tokenizer kinds trained on disassembly-like text,
checked against transformers' PreTrainedTokenizerFast loading the same tokenizer.json."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from labkit.config import SPECIAL_TOKENS, TokenizerConfig
from labkit.data.tokenize import (LineCache, corpus_alphabet, encode_flat, iter_texts, load_tokenizer, process_line_cache,
                                  split_rows, text_row_count, tokenizer_sha256, train_tokenizer, unk_rate, unk_report)

KINDS = ("wordpiece", "bpe", "unigram")


def disasm_docs(n_docs: int, seed: int = 0) -> list[str]:
    """Functions of 3-9 x86-64 instructions in labkit's normalised capstone style."""
    rng = random.Random(seed)
    regs = ["rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r12"]
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(rng.randint(3, 9)):
            a, b = rng.choice(regs), rng.choice(regs)
            lines.append(rng.choice([
                f"mov {a}, qword ptr [{b} - {rng.choice([8, 16, 24, 32])}]", f"add {a}, {b}",
                f"xor {a}, {a}", f"push {a}", f"pop {a}", f"lea {a}, [rip + IMM]", "call FUNC",
                f"cmp {a}, IMM", "jne ADDR", "ret"]))
        docs.append("\n".join(lines))
    return docs


from tests.data.real_corpus import libc_functions  # noqa: E402  (real input)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, list[str]]:
    docs = disasm_docs(200)
    path = tmp_path_factory.mktemp("docs") / "docs.parquet"
    pl.DataFrame({"id": [f"{i:016x}" for i in range(len(docs))], "text": docs}).write_parquet(path)
    return str(path), docs


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("tok")
    return {k: train_tokenizer(corpus[0], TokenizerConfig(kind=k, vocab_size=300, min_frequency=2),
                               str(out / f"{k}.json")) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_are_ids_0_to_5(trained, kind):
    tok = load_tokenizer(trained[kind])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4, 5]
    assert [tok.id_to_token(i) for i in range(6)] == list(SPECIAL_TOKENS)
    assert 6 < tok.get_vocab_size() <= 300


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(trained, corpus, kind):
    tok = load_tokenizer(trained[kind])
    docs = corpus[1]
    for enc, doc in zip(tok.encode_batch(docs[:50], add_special_tokens=False), docs[:50]):
        assert 1 not in enc.ids  # every character was seen in training
        if kind == "wordpiece":  # characters and newlines survive; spaces around pieces change
            text = tok.decode(enc.ids)
            assert text.replace(" ", "") == doc.replace(" ", "")
            assert text.count("\n") == doc.count("\n") > 0
        else:
            assert tok.decode(enc.ids) == doc


def test_wordpiece_keeps_case_and_splits_punctuation(trained):
    tok = load_tokenizer(trained["wordpiece"])
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("mov rax, qword ptr [rbp - 8]\ncall FUNC")]
    assert pieces == ["mov", "rax", ",", "qword", "ptr", "[", "rbp", "-", "8", "]", "\n", "call", "FUNC"]
    assert tok.encode("call FUNC", add_special_tokens=False).tokens == ["call", "FUNC"]


@pytest.mark.parametrize("kind", KINDS)
def test_matches_transformers_fast_tokenizer(trained, corpus, kind):
    from transformers import PreTrainedTokenizerFast

    tok = load_tokenizer(trained[kind])
    hf = PreTrainedTokenizerFast(tokenizer_file=trained[kind])
    assert hf.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4, 5]
    for doc in corpus[1][:20]:
        assert hf.encode(doc, add_special_tokens=False) == tok.encode(doc, add_special_tokens=False).ids


def test_saved_file_stats_and_sha256(trained, corpus):
    path = Path(trained["wordpiece"])
    assert tokenizer_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        f"{k}{ext}" for k in ("bpe", "unigram", "wordpiece") for ext in (".json", ".stats.json"))
    stats = json.loads(path.with_name("wordpiece.stats.json").read_text())
    # 200 documents: 20 held out (a tenth), 180 trained on; the held-out UNK report recomputed here
    assert (stats["documents"], stats["train_docs"], stats["held_out_docs"]) == (200, 180, 20)
    train, held = split_rows(200, TokenizerConfig(vocab_size=300))
    assert len(held) == 20 and len(np.intersect1d(train, held)) == 0 and len(train) == 180
    ref = unk_report(load_tokenizer(path), [corpus[1][i] for i in held])
    assert stats["unk_rate"] == ref["unk_rate"] and stats["tokens"] == ref["tokens"] > 20


def test_long_hex_and_unseen_characters_are_not_unk(corpus, tmp_path):
    """Training text has no hex digits beyond 0-9 in word-internal position and no 'Q'; a
    140-character hex word and unseen letters must still encode without [UNK]."""
    hex_word = "0x" + "deadbeef0123456789abcdef" * 6  # 146 characters: longer than max_word_chars
    probes = [f"mov rax, {hex_word}", "call sub_a1b2c3d4e5f6a7b8c9d0", "QqZz Vv jJ", "lea rdi, [rip + 0xghij]"]
    for kind in KINDS:
        path = train_tokenizer(corpus[0], TokenizerConfig(kind=kind, vocab_size=300), str(tmp_path / f"{kind}.json"))
        tok = load_tokenizer(path)
        rep = unk_report(tok, probes)
        assert rep["unk_tokens"] == 0, (kind, rep["unk_examples"])
        assert tok.get_vocab_size() <= 300
        if kind == "wordpiece":
            enc = tok.encode(probes[0], add_special_tokens=False)
            assert "".join(t.removeprefix("##") for t in enc.tokens[3:]) == hex_word
    # the old behaviour, for contrast: a 146-char word is one [UNK] when words are not split
    cfg = TokenizerConfig(kind="wordpiece", vocab_size=300, max_word_chars=1000)
    tok = load_tokenizer(train_tokenizer(corpus[0], cfg, str(tmp_path / "long.json")))
    tok.model.max_input_chars_per_word = 100
    rep = unk_report(tok, probes[:1])
    assert rep["unk_tokens"] == 1 and list(rep["unk_examples"]) == [hex_word[:40]]


def test_training_is_deterministic_and_sampled(corpus, tmp_path):
    cfg = TokenizerConfig(kind="bpe", vocab_size=300, max_train_docs=50, seed=3)
    a = train_tokenizer(corpus[0], cfg, str(tmp_path / "a" / "tokenizer.json"))
    b = train_tokenizer(corpus[0], cfg, str(tmp_path / "b" / "tokenizer.json"))
    assert tokenizer_sha256(a) == tokenizer_sha256(b)
    full = train_tokenizer(corpus[0], TokenizerConfig(kind="bpe", vocab_size=300), str(tmp_path / "c.json"))
    assert tokenizer_sha256(full) != tokenizer_sha256(a)  # 50 of 200 docs give other merges


def test_iter_texts_batches_and_sample(corpus):
    path, docs = corpus
    batches = list(iter_texts(path, batch_docs=64))
    assert [len(b) for b in batches] == [64, 64, 64, 8]
    assert sum(batches, []) == docs
    rows = np.array([0, 5, 63, 64, 199])
    assert sum(iter_texts(path, batch_docs=64, rows=rows), []) == [docs[i] for i in rows]


def test_unk_rate(trained):
    tok = load_tokenizer(trained["wordpiece"])
    assert unk_rate(tok, ["mov rax, rbx"]) == 0.0
    # "é" never occurred in training: one unknown word among 4 pieces (mov, rax, ",", é)
    assert unk_rate(tok, ["mov rax, é"]) == pytest.approx(1 / 4)
    assert unk_rate(tok, []) == 0.0
    assert unk_rate(load_tokenizer(trained["bpe"]), ["mov rax, é"]) == 0.0


def test_unk_report_by_distinct_lines_equals_encoding_each_text(trained, corpus):
    """The WordPiece report encodes each distinct line once, weighted by its count: the numbers
    equal those of encoding every text whole (counted here by hand)."""
    tok = load_tokenizer(trained["wordpiece"])
    texts = corpus[1][:50] + ["mov rax, é\nmov rax, é\n", "é", "", "ret\n\nQ\u0301 ☃"]
    rep = unk_report(tok, texts)
    encs = tok.encode_batch(texts, add_special_tokens=False)
    spans = collections.Counter(t[a:b][:40] for t, e in zip(texts, encs)
                                for i, (a, b) in zip(e.ids, e.offsets) if i == SPECIAL_TOKENS.index("[UNK]"))
    assert rep["tokens"] == sum(len(e.ids) for e in encs) > 400
    assert rep["unk_tokens"] == sum(spans.values()) == 5 and rep["unk_examples"] == dict(spans)
    with pytest.raises(TypeError, match=r"texts\[1\] is NoneType"):
        unk_report(tok, ["ret\n", None])


def test_a_full_line_cache_starts_over_with_the_same_ids(trained, corpus):
    tok = load_tokenizer(trained["wordpiece"])
    texts = corpus[1]
    ref = tok.encode_batch(texts, add_special_tokens=False)
    small = LineCache(max_lines=7)  # far fewer than the distinct lines: emptied on almost every batch
    for lo in range(0, len(texts), 40):
        ids, lengths = encode_flat(tok, texts[lo:lo + 40], cache=small)
        assert lengths.tolist() == [len(e.ids) for e in ref[lo:lo + 40]]
        assert ids.tolist() == [i for e in ref[lo:lo + 40] for i in e.ids]
        assert small.table.height <= max(7, len({ln for t in texts[lo:lo + 40] for ln in t.splitlines(True)}))
    assert process_line_cache("a") is process_line_cache("a") is not process_line_cache("b")


def test_errors_name_the_problem(tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        text_row_count(str(tmp_path / "missing.parquet"))
    bad = tmp_path / "notext.parquet"
    pl.DataFrame({"body": ["x"]}).write_parquet(bad)
    with pytest.raises(ValueError, match="no 'text' column"):
        train_tokenizer(str(bad), TokenizerConfig(vocab_size=300), str(tmp_path / "t.json"))
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="kind"):
        TokenizerConfig(kind="sentencepiece")


def test_real_libc_disassembly(tmp_path):
    from transformers import PreTrainedTokenizerFast

    funcs = libc_functions(300)
    train, held_out = funcs[:250], funcs[250:]
    pl.DataFrame({"text": train}).write_parquet(tmp_path / "libc.parquet")
    for kind in KINDS:
        path = train_tokenizer(str(tmp_path / "libc.parquet"), TokenizerConfig(kind=kind, vocab_size=500),
                               str(tmp_path / f"{kind}.json"))
        tok, hf = load_tokenizer(path), PreTrainedTokenizerFast(tokenizer_file=path)
        assert unk_rate(tok, held_out) < 0.01  # capstone text is ASCII; every character was seen
        for doc in held_out[:10]:
            ids = tok.encode(doc, add_special_tokens=False).ids
            assert hf.encode(doc, add_special_tokens=False) == ids
            if kind != "wordpiece":
                assert tok.decode(ids) == doc


@pytest.mark.parametrize("kind", ["wordpiece", "unigram"])
def test_the_alphabet_comes_from_the_whole_corpus(tmp_path, kind):
    """A user's own text: two documents with "João", "café", "Zürich" among 2,000 of
    disassembly, both outside the 300-document training sample. With the ASCII alphabet alone
    (alphabet_limit=0) their letters are [UNK]; with the corpus's alphabet (the default) none is."""
    docs = disasm_docs(2000, seed=1)
    cfg = TokenizerConfig(kind=kind, vocab_size=1024, max_train_docs=300, held_out_docs=0)
    train, _ = split_rows(len(docs), cfg)
    outside = [i for i in range(len(docs)) if i not in set(train.tolist())][:2]
    docs[outside[0]], docs[outside[1]] = "João paid the café in São Paulo", "naïve Zürich résumé"
    pl.DataFrame({"text": docs}).write_parquet(tmp_path / "docs.parquet")
    probe = ["João café São Zürich naïve résumé"]
    ascii_cfg = dataclasses.replace(cfg, alphabet_limit=0)
    ascii_only = load_tokenizer(train_tokenizer(str(tmp_path / "docs.parquet"), ascii_cfg, str(tmp_path / "ascii.json")))
    assert unk_report(ascii_only, probe)["unk_tokens"] > 0  # the old default
    path = train_tokenizer(str(tmp_path / "docs.parquet"), cfg, str(tmp_path / "tok.json"))
    rep = unk_report(load_tokenizer(path), probe)
    assert rep["unk_tokens"] == 0, rep["unk_examples"]
    assert sorted(corpus_alphabet(str(tmp_path / "docs.parquet"), cfg)) == sorted("ãéïü")
    stats = json.loads(Path(path).with_name("tok.stats.json").read_text())
    assert stats["alphabet"] == len(cfg.initial_alphabet) + 4 and "unk_rate" in stats


def test_corpus_alphabet_keeps_within_half_the_vocabulary(tmp_path):
    pl.DataFrame({"text": ["".join(chr(0x4E00 + i) for i in range(k, k + 50)) for k in range(0, 2000, 50)]}) \
        .write_parquet(tmp_path / "cjk.parquet")
    cfg = TokenizerConfig(vocab_size=1024)
    got = corpus_alphabet(str(tmp_path / "cjk.parquet"), cfg)
    assert len(got) == (1024 // 2 - 2 * len(cfg.initial_alphabet)) // 2 == 162
    assert corpus_alphabet(str(tmp_path / "cjk.parquet"), TokenizerConfig(vocab_size=1024, alphabet_limit=10)) == \
        "".join(chr(0x4E00 + i) for i in range(10))  # equal counts: by code point
    assert corpus_alphabet(str(tmp_path / "cjk.parquet"), TokenizerConfig(vocab_size=300)) == ""  # no room


WORLD = ("João paid the café in São Paulo", "naïve Zürich résumé", "Tiếng Việt có dấu", "한국어 문장입니다",
         "ἄλφα καὶ ὠμέγα", "हिन्दी पाठ", "Привет мир", "ﬁne x²")
"""Words in Latin with accents, Vietnamese (stacked marks), Hangul (NFD splits each syllable into
jamo), polytonic Greek, Devanagari, Cyrillic and compatibility characters (NFKC/NFKD replace them)."""
FORMS = ("NFC", "NFD", "NFKC", "NFKD")


@pytest.mark.parametrize("kind", ["wordpiece", "unigram"])
def test_text_in_any_normalisation_form_has_no_unk_for_characters_the_corpus_holds(tmp_path, kind):
    """The corpus holds WORLD's documents (outside the training sample, not held out) stored in one
    normalisation form; the same text in any of the four forms encodes without [UNK]. The alphabet
    used to be collected from the raw characters, so NFD text gave the normaliser's composed
    "ã" and Hangul syllables as [UNK]."""
    import unicodedata

    forms = FORMS if kind == "wordpiece" else ("NFD",)
    for form in forms:
        docs = disasm_docs(400, seed=2)
        cfg = TokenizerConfig(kind=kind, vocab_size=1024, max_train_docs=150, held_out_docs=10)
        train, held = split_rows(len(docs), cfg)
        outside = [i for i in range(len(docs)) if i not in set(train.tolist()) | set(held.tolist())][:len(WORLD)]
        for i, text in zip(outside, WORLD):
            docs[i] = unicodedata.normalize(form, text)
        pl.DataFrame({"text": docs}).write_parquet(tmp_path / f"{form}.parquet")
        tok = load_tokenizer(train_tokenizer(str(tmp_path / f"{form}.parquet"), cfg, str(tmp_path / f"{form}.json")))
        for probe_form in FORMS:
            probe = [unicodedata.normalize(probe_form, t) for t in WORLD]
            if form.startswith("NFK") and not probe_form.startswith("NFK"):
                probe = probe[:-1]  # a corpus stored as NFK* holds "fi" and "2", never "ﬁ" or "²"
            rep = unk_report(tok, probe)
            assert rep["unk_tokens"] == 0, (form, probe_form, rep["unk_examples"])


def test_the_held_out_unk_rate_counts_what_the_tokenizer_did_per_script(tmp_path):
    """Held-out documents are kept out of the alphabet too: a script found only there (Cyrillic
    here) is [UNK], and the rate in tokenizer.stats.json, overall and per script, equals the
    [UNK] ids of encoding those documents here; "é", held elsewhere in the corpus, is no [UNK]."""
    docs = disasm_docs(300, seed=3)
    cfg = TokenizerConfig(kind="wordpiece", vocab_size=512, held_out_docs=30)
    train, held = split_rows(len(docs), cfg)
    docs[int(held[0])] = "Привет мир\nmov rax, rbx"
    docs[int(held[1])] = "café au lait"
    docs[int(train[0])] = "un café"
    pl.DataFrame({"text": docs}).write_parquet(tmp_path / "docs.parquet")
    path = train_tokenizer(str(tmp_path / "docs.parquet"), cfg, str(tmp_path / "tok.json"))
    stats = json.loads(Path(path).with_name("tok.stats.json").read_text())
    tok = load_tokenizer(path)
    encs = tok.encode_batch([docs[int(i)] for i in held], add_special_tokens=False)
    unk = sum(e.ids.count(SPECIAL_TOKENS.index("[UNK]")) for e in encs)
    assert stats["unk_tokens"] == unk == 2 and stats["tokens"] == sum(len(e.ids) for e in encs)
    assert stats["unk_rate"] == pytest.approx(2 / stats["tokens"]) and stats["unk_rate"] > 0
    assert stats["by_script"]["Cyrillic"] == {"tokens": 2, "unk_tokens": 2, "unk_rate": 1.0}
    assert stats["by_script"]["Latin"]["unk_tokens"] == 0 and stats["by_script"]["Common"]["unk_tokens"] == 0
    assert list(stats["unk_examples"]) == ["Привет", "мир"]
