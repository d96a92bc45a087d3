"""labkit.data.clean: every filter on literal frames, with the exact reason it gives."""

from __future__ import annotations

import json
import os

import polars as pl
import pytest

from labkit.config import CleanConfig
from labkit.data.clean import FILTERS, EmptyCorpusError, clean, clean_corpus, describe_filters

GOOD = "push rbp\nmov rbp, rsp\nmov eax, edi\nadd eax, esi\npop rbp\nret"


def reasons(texts: list[str], cfg: CleanConfig, names: list[str] | None = None, arch: str | None = None,
            extra=None) -> list[str | None]:
    data = {"id": [f"{i:016x}" for i in range(len(texts))], "text": texts}
    if names is not None:
        data["name"] = names
    if arch is not None:
        data["arch"] = [arch] * len(texts)
    out = clean(pl.LazyFrame(data), cfg, extra_filters=extra).collect()
    assert out.columns == [*data, "drop_reason"]
    return out["drop_reason"].to_list()


def test_filters_are_listed_in_order():
    assert list(FILTERS) == ["too_short", "too_long", "too_few_lines", "undecodable", "nonprintable",
                             "badly_formatted", "repeated_lines", "boilerplate", "blocklist", "exact_duplicate",
                             "near_duplicate"]
    table = describe_filters(CleanConfig(min_chars=7))
    assert table["reason"].to_list() == list(FILTERS) and table["settings"][0] == "min_chars=7"


@pytest.mark.parametrize("text,cfg,reason", [
    (GOOD, CleanConfig(), None),
    ("nop\nnop\nret", CleanConfig(min_chars=12), "too_short"),            # 11 characters
    ("push rbp\nmov rbp, rsp\nret", CleanConfig(min_chars=0, max_chars=20), "too_long"),
    ("mov eax, 0x12345678\nret", CleanConfig(min_chars=0, min_lines=3), "too_few_lines"),
    (GOOD + "\x01\x02", CleanConfig(max_nonprintable_ratio=0.01), "nonprintable"),   # 2/61 > 1%
    (GOOD + "\x01", CleanConfig(max_nonprintable_ratio=0.02), None),                   # 1/60 < 2%
    (GOOD + "\ufffd", CleanConfig(), "undecodable"),                                  # one replaced byte
    (GOOD + "\x00", CleanConfig(max_nonprintable_ratio=1.0), "undecodable"),           # one NUL
    (GOOD + "\n" + "nop " * 30, CleanConfig(max_line_chars=100), "badly_formatted"),  # a 120-char line
    (GOOD + "\n" + "nop " * 20, CleanConfig(max_line_chars=100), None),
    ("a\tb\r\nc\td\r\n" + GOOD, CleanConfig(max_nonprintable_ratio=0.0), None),      # \t \r \n are fine
    ("nop\nnop\nnop\nmov eax, 1\nret\nret", CleanConfig(min_chars=0, max_repeated_line_ratio=0.5), None),  # 3/6
    ("nop\nnop\nnop\nnop\nnop\nret", CleanConfig(min_chars=0, max_repeated_line_ratio=0.5), "repeated_lines"),  # 4/6
    ("jmp ADDR", CleanConfig(min_chars=0, min_lines=1), "boilerplate"),
    ("endbr64\nbnd jmp qword ptr [rip + REL]", CleanConfig(min_chars=0, min_lines=1), "boilerplate"),
    ("b #ADDR", CleanConfig(min_chars=0, min_lines=1), "boilerplate"),
    ("jmp ADDR", CleanConfig(min_chars=0, min_lines=1, drop_plt_stubs=False), None),
    ("mov eax, 1\njmp ADDR", CleanConfig(min_chars=0, min_lines=1), None),             # not a bare jump
    (GOOD, CleanConfig(blocklist=(r"^nothing", r"add eax, e[sd]i")), "blocklist"),
    (GOOD, CleanConfig(blocklist=(r"add eax, ecx",)), None),
    ("x" * 10, CleanConfig(min_chars=32, min_lines=3), "too_short"),                  # first reason wins
])
def test_each_filter(text, cfg, reason):
    assert reasons([text], cfg) == [reason]


def test_plt_name_and_missing_name_column():
    cfg = CleanConfig()
    assert reasons([GOOD, GOOD + "\nnop"], cfg, names=["puts@plt", "main"]) == ["boilerplate", None]
    assert reasons([GOOD], cfg) == [None]  # no name column: only the text rules apply


def test_exact_dedup_keeps_smallest_id_in_any_order():
    other = GOOD.replace("add", "sub")
    frame = pl.DataFrame({"id": ["0c", "0a", "0b", "0d", "0e"],
                          "text": [GOOD, GOOD, other, other, "tiny"]})
    want = {"0a": None, "0c": "exact_duplicate", "0b": None, "0d": "exact_duplicate", "0e": "too_short"}
    for seed in range(4):
        shuffled = frame.sample(fraction=1.0, shuffle=True, seed=seed)
        out = clean(shuffled.lazy(), CleanConfig()).collect()
        assert out["id"].to_list() == shuffled["id"].to_list()  # input order kept
        assert dict(zip(out["id"], out["drop_reason"])) == want
    # a document dropped earlier (here a PLT stub) does not make its twin a duplicate
    out = clean(pl.LazyFrame({"id": ["01", "02"], "name": ["f@plt", "g"], "text": [GOOD, GOOD]}), CleanConfig())
    assert out.collect()["drop_reason"].to_list() == ["boilerplate", None]
    # an identical row twice keeps one; dedup off keeps both
    twice = pl.LazyFrame({"id": ["01", "01"], "text": [GOOD, GOOD]})
    assert clean(twice, CleanConfig()).collect()["drop_reason"].to_list() == [None, "exact_duplicate"]
    assert clean(twice, CleanConfig(exact_dedup=False)).collect()["drop_reason"].to_list() == [None, None]


PROSE = ("The loader maps each segment at its virtual address.\n"
         "Relocations are applied before the entry point runs.\n"
         "Symbols resolve lazily through the PLT unless BIND_NOW is set.")


@pytest.mark.parametrize("text,cfg,reason", [
    (PROSE, CleanConfig(), None),
    ("One line of prose is a document for text sources.", CleanConfig(), None),  # min_lines is for code
    (PROSE + "\nCopyright (c) 2024 Example Corp. All rights reserved.", CleanConfig(), None),  # 1 of 4 lines
    ("Home | About | Contact\nPage 3 of 12\n" + PROSE.split("\n")[0] + "\nAll rights reserved.",
     CleanConfig(), "boilerplate"),                                                      # 3 of 4 lines
    ("Home | About | Contact\nPage 3 of 12\n" + PROSE.split("\n")[0] + "\nAll rights reserved.",
     CleanConfig(text_boilerplate=()), None),
    (PROSE + "\nJust kill yourself.", CleanConfig(), "blocklist"),                     # default text list
    (PROSE + "\nJust kill yourself.", CleanConfig(text_blocklist=()), None),
    (PROSE + "\nskill yourselfie", CleanConfig(), None),                               # word boundaries
    (PROSE + "\nbad\xffbytes".encode("latin-1").decode("utf-8", "replace"), CleanConfig(), "undecodable"),
])
def test_text_filters(text, cfg, reason):
    assert reasons([text], cfg, arch="text") == [reason]


def test_text_rules_do_not_touch_code():
    code = GOOD + "\nkill yourself"  # only text documents see text_blocklist
    assert reasons([code], CleanConfig()) == [None]
    assert reasons(["jmp ADDR"], CleanConfig(min_chars=0), arch="text") == [None]  # thunks are a code rule


def test_extra_filters_extend_the_list():
    extra = {"mentions_syscall": pl.col("text").str.contains("syscall"), "tiny_id": pl.col("id") == "0000000000000002"}
    texts = [GOOD, GOOD + "\nsyscall", GOOD + "\nnop", "x"]
    assert reasons(texts, CleanConfig(), extra=extra) == [None, "mentions_syscall", "tiny_id", "too_short"]
    with pytest.raises(ValueError, match=r"extra_filters: reasons \['blocklist'\]"):
        reasons(texts, CleanConfig(), extra={"blocklist": pl.lit(True)})


def test_invalid_blocklist_names_the_pattern():
    with pytest.raises(ValueError, match=r"blocklist: '\(unclosed'"):
        clean(pl.LazyFrame({"id": ["a"], "text": [GOOD]}), CleanConfig(blocklist=("(unclosed",)))
    with pytest.raises(ValueError, match=r"text_boilerplate: '\[x'"):
        clean(pl.LazyFrame({"id": ["a"], "text": [GOOD]}), CleanConfig(text_boilerplate=("[x",)))


def test_clean_corpus_over_parts(tmp_path):
    other = GOOD.replace("add", "sub")
    pl.DataFrame({"id": ["05", "02", "03"], "name": ["a", "b", "c@plt"], "text": [GOOD, other, other]}
                 ).write_parquet(tmp_path / "part-00000.parquet")
    pl.DataFrame({"id": ["01", "04"], "name": ["d", "e"], "text": [GOOD, "nop"]}
                 ).write_parquet(tmp_path / "part-00001.parquet")
    out = tmp_path / "clean" / "docs.parquet"
    stats = clean_corpus(str(tmp_path / "part-*.parquet"), str(out), CleanConfig())
    assert stats == {"input": 5, "kept": 2, "dropped": {"too_short": 1, "boilerplate": 1, "exact_duplicate": 1}}
    assert json.loads((tmp_path / "clean" / "docs.drops.json").read_text()) == stats
    kept = pl.read_parquet(out)
    assert kept.columns == ["id", "name", "text"] and kept["id"].to_list() == ["02", "01"]
    assert sorted(os.listdir(out.parent)) == ["docs.drops.json", "docs.parquet"]  # no temp files left


def test_clean_corpus_errors(tmp_path):
    pl.DataFrame({"id": ["01", "02"], "text": ["nop", "ret"]}).write_parquet(tmp_path / "part-00000.parquet")
    with pytest.raises(EmptyCorpusError, match=r"part-\*\.parquet.*2 in.*'too_short': 2"):
        clean_corpus(str(tmp_path / "part-*.parquet"), str(tmp_path / "out.parquet"), CleanConfig())
    assert not (tmp_path / "out.parquet").exists()
    with pytest.raises(FileNotFoundError, match="nothing-"):
        clean_corpus(str(tmp_path / "nothing-*.parquet"), str(tmp_path / "out.parquet"), CleanConfig())
