"""Streaming: clean, near dedup and the whole single-process preparation give the same output
with 7-row batches as with one batch, and clean_corpus equals the in-memory ``clean``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import polars as pl
import pytest

from labkit.config import CleanConfig, CorpusConfig, DedupConfig, ShardConfig, TokenizerConfig
from labkit.data.clean import FILTERS, EmptyCorpusError, clean, clean_corpus
from labkit.data.dedup import near_dedup, near_dedup_parquet, signature_part

LIBS = [f"/usr/lib/x86_64-linux-gnu/{n}" for n in ("libz.so.1", "libbz2.so.1.0", "liblzma.so.5")]
HUGE = 10**9


def _libc(n: int) -> list[str]:
    from tests.data.real_corpus import libc_functions

    return libc_functions(n)


def _reference_clean_corpus(corpus_glob: str, cfg: CleanConfig, extra_filters=None) -> tuple[dict, pl.DataFrame]:
    """clean_corpus as it was before streaming: the whole corpus through ``clean`` in memory."""
    marked = clean(pl.scan_parquet(corpus_glob), cfg, extra_filters=extra_filters).collect()
    counts = marked.group_by("drop_reason").len().drop_nulls("drop_reason")
    order = [*list(FILTERS)[:-2], *(extra_filters or {}), *list(FILTERS)[-2:]]
    dropped = {r: int(n) for r, n in sorted(counts.iter_rows(), key=lambda rn: order.index(rn[0]))}
    kept = marked.filter(pl.col("drop_reason").is_null()).drop("drop_reason")
    return {"input": marked.height, "kept": kept.height, "dropped": dropped}, kept


@pytest.fixture(scope="module")
def tricky_corpus(tmp_path_factory):
    """Real libc functions in 3 parts, with exact copies across parts and inside one, a row equal
    in id and text to an earlier one, a twin whose first copy is a PLT stub, null ids and texts."""
    d = tmp_path_factory.mktemp("corpus")
    texts = _libc(90)
    ids = [hashlib.sha1(str(i).encode()).hexdigest()[:16] for i in range(len(texts))]
    names = [f"f{i}" for i in range(len(texts))]
    rows = list(zip(ids, names, texts))
    rows += [(f"0{i:015x}", f"copy{i}", texts[i]) for i in range(0, 40, 3)]   # smaller ids: the copies win
    rows += [(f"f{i:015x}", f"late{i}", texts[i]) for i in range(1, 40, 4)]   # larger ids: the copies lose
    rows += [rows[5], rows[61], (ids[7], "f7@plt", texts[7])]                  # (id, text) repeats
    rows.insert(3, ("0000000000000000", "g@plt", texts[50]))                   # first copy is dropped
    rows += [("0000000000000000", "g", texts[50])]
    rows += [(None, "noid", texts[60]), (None, "noid2", texts[60]), (None, "noid3", texts[61]),
             ("e000000000000000", "notext", None), ("e000000000000001", "notext2", None), ("x1", "tiny", "nop")]
    frame = pl.DataFrame(rows, schema={"id": pl.Utf8, "name": pl.Utf8, "text": pl.Utf8}, orient="row")
    cuts = [0, 41, 42, 97, frame.height]
    for k in range(4):
        frame.slice(cuts[k], cuts[k + 1] - cuts[k]).write_parquet(d / f"part-{k:05d}.parquet")
    return str(d / "part-*.parquet")


@pytest.mark.parametrize("cfg,extra", [
    (CleanConfig(), None),
    (CleanConfig(exact_dedup=False, min_lines=5), None),
    (CleanConfig(), {"long_id": pl.col("id").str.len_chars() > 16, "odd_name": pl.col("name").str.ends_with("3")}),
])
def test_clean_corpus_streams_to_the_in_memory_result(tricky_corpus, tmp_path, cfg, extra):
    want_stats, want = _reference_clean_corpus(tricky_corpus, cfg, extra)
    assert want_stats["dropped"].get("exact_duplicate", 0) >= (20 if cfg.exact_dedup else 0)
    for batch in (1, 7, 41, HUGE):
        out = tmp_path / str(batch) / "docs.parquet"
        stats = clean_corpus(tricky_corpus, str(out), dataclasses.replace(cfg, batch_rows=batch), extra_filters=extra)
        assert stats == want_stats, batch
        assert (out.parent / "docs.drops.json").read_text() == json.dumps(want_stats, indent=2) + "\n"
        got = pl.read_parquet(out)
        assert got.schema == want.schema and got.equals(want), batch
        assert sorted(os.listdir(out.parent)) == ["docs.drops.json", "docs.parquet"]  # parts removed


def test_clean_corpus_streamed_errors(tmp_path):
    pl.DataFrame({"id": ["01", "02", "03"], "text": ["nop", "ret", "nop"]}).write_parquet(tmp_path / "p.parquet")
    with pytest.raises(EmptyCorpusError, match=r"3 in, dropped \{'too_short': 3\}"):
        clean_corpus(str(tmp_path / "p.parquet"), str(tmp_path / "o.parquet"), CleanConfig(batch_rows=2))
    assert sorted(os.listdir(tmp_path)) == ["p.parquet"]
    with pytest.raises(ValueError, match="batch_rows"):
        CleanConfig(batch_rows=0)
    with pytest.raises(ValueError, match="batch_rows"):
        DedupConfig(batch_rows=0)


def test_near_dedup_batches_do_not_change_the_result(tmp_path):
    texts = _libc(80)
    texts = texts + texts[:8] + [t + "\nnop" for t in texts[8:16]]
    ids = [hashlib.sha1(str(i).encode()).hexdigest()[:16] for i in range(len(texts))]
    reason = [None] * len(texts)
    reason[3] = "too_short"
    lf = pl.LazyFrame({"id": ids, "text": texts, "drop_reason": reason})
    want = near_dedup(lf, DedupConfig(batch_rows=HUGE)).collect()
    assert want["drop_reason"].eq("near_duplicate").sum() >= 8
    for batch in (1, 7):
        assert near_dedup(lf, DedupConfig(batch_rows=batch)).collect().equals(want)
    docs = tmp_path / "docs.parquet"
    pl.DataFrame({"id": ids, "text": texts}).write_parquet(docs)
    outs = {}
    for batch in (7, HUGE):
        cfg = DedupConfig(batch_rows=batch)
        paths = [str(tmp_path / f"{batch}-{k}.npy") for k in range(2)]
        signature_part(str(docs), 0, 50, cfg, paths[0])
        signature_part(str(docs), 50, 200, cfg, paths[1])  # past the end: the rows that exist
        outs[batch] = near_dedup_parquet(str(docs), paths, str(tmp_path / f"{batch}.parquet"), cfg)
        assert sum(len(np.load(p)) for p in paths) == len(texts)
    np.testing.assert_array_equal(np.load(tmp_path / "7-1.npy"), np.load(tmp_path / f"{HUGE}-1.npy"))
    assert outs[7] | {"seconds": 0, "docs_per_s": 0} == outs[HUGE] | {"seconds": 0, "docs_per_s": 0}
    for suffix in (".parquet", ".near_duplicates.parquet"):
        assert pl.read_parquet(tmp_path / f"7{suffix}").equals(pl.read_parquet(tmp_path / f"{HUGE}{suffix}"))
    every = near_dedup(lf.drop("drop_reason"), DedupConfig()).collect()  # row 3 takes part here too
    assert pl.read_parquet(tmp_path / "7.parquet")["id"].to_list() == every.filter(
        pl.col("drop_reason").is_null())["id"].to_list()


def _prepare(corpus_glob: str, work: str, batch: int, tokenizer: str | None = None) -> dict:
    """The single-process steps of labkit.lab: clean_corpus, signature_part over 3 row ranges,
    near_dedup_parquet, train_tokenizer (unless ``tokenizer`` is given), write_shards -- every
    batch size set from ``batch``."""
    from labkit.data.shards import write_shards
    from labkit.data.tokenize import text_row_count, train_tokenizer

    cfg = CleanConfig(batch_rows=batch, near_dedup=DedupConfig(batch_rows=batch))
    filtered, docs = os.path.join(work, "filtered.parquet"), os.path.join(work, "docs.parquet")
    clean_corpus(corpus_glob, filtered, cfg)
    n = text_row_count(filtered)
    sigs = [os.path.join(work, f"sig-{k}.npy") for k in range(3)]
    for k, path in enumerate(sigs):
        signature_part(filtered, k * n // 3, (k + 1) * n // 3, cfg.near_dedup, path)
    near_dedup_parquet(filtered, sigs, docs, cfg.near_dedup)
    if tokenizer is None:
        tokenizer = train_tokenizer(docs, TokenizerConfig(vocab_size=400, held_out_docs=20),
                                    os.path.join(work, "tokenizer.json"))
    shard_cfg = ShardConfig(seq_len=32, sequences_per_shard=50, batch_docs=min(batch, 4096),
                            part_docs=min(max(batch, 13), 20_000))
    return write_shards(docs, tokenizer, os.path.join(work, "shards"), shard_cfg, progress=False)


def test_whole_preparation_gives_identical_shards_with_tiny_and_large_batches(tmp_path):
    """Real ELF functions (plus exact copies under other ids) through every step with 7-row
    batches and with one batch. HF's WordPiece trainer is not reproducible run to run (ids of
    its ``##`` pieces follow hash-map order, huggingface/tokenizers#1794), whatever the batches,
    so the large run encodes with the tokenizer trained in the tiny run, on identical documents."""
    from labkit.data.corpus import build_corpus

    libs = [p for p in LIBS if os.path.exists(p)]
    if len(libs) < 2:
        pytest.skip("fewer than 2 reference system libraries")
    build_corpus(CorpusConfig(paths=tuple(libs), max_functions=240, max_functions_per_file=120),
                 str(tmp_path / "corpus"), n_parts=3)
    part = pl.read_parquet(tmp_path / "corpus" / "part-00000.parquet")
    copies = part.head(30).with_columns(id=pl.lit("0") + pl.col("id").str.slice(1))  # exact copies, other ids
    copies.write_parquet(tmp_path / "corpus" / "part-00009.parquet")
    corpus_glob = str(tmp_path / "corpus" / "part-*.parquet")
    index = {7: _prepare(corpus_glob, str(tmp_path / "7"), 7)}
    index[HUGE] = _prepare(corpus_glob, str(tmp_path / "huge"), HUGE, str(tmp_path / "7" / "tokenizer.json"))
    for name in ("filtered.parquet", "filtered.drops.json", "docs.parquet", "docs.near_duplicates.parquet"):
        small, large = tmp_path / "7" / name, tmp_path / "huge" / name
        if name.endswith(".json"):
            assert small.read_text() == large.read_text()
        else:
            assert pl.read_parquet(small).equals(pl.read_parquet(large)), name
    assert index[7] == index[HUGE] and index[7]["n_sequences"] > 100 and len(index[7]["shards"]) > 2
    for name in ["index.json", *(s["file"] for s in index[7]["shards"])]:
        assert (tmp_path / "7" / "shards" / name).read_bytes() == (tmp_path / "huge" / "shards" / name).read_bytes()
    drops = json.loads((tmp_path / "7" / "filtered.drops.json").read_text())
    assert drops["dropped"]["exact_duplicate"] >= 30 and drops["kept"] > 150
