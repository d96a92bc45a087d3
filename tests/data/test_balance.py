"""labkit.data.balance: cap budgets in closed form, selection against a plain-Python reference,
and balanced shards against packing the selected documents by hand."""

from __future__ import annotations

import random

import numpy as np
import polars as pl
import pytest

from labkit.config import ShardConfig, TokenizerConfig
from labkit.data.balance import cap_budgets, select_documents
from labkit.data.shards import SequenceReader, pack_documents, write_shards
from labkit.data.tokenize import load_tokenizer, train_tokenizer


def test_cap_budgets_closed_form():
    # A at 70 %, cap 50 %: the total becomes 30 / (1 - 0.5) = 60, so A keeps 30
    assert cap_budgets({"A": 70, "B": 30}, {"*": 0.5}) == {"A": 30, "B": 30}
    # caps only for A: B and C are free; T = 40 / (1 - 0.2) = 50, A keeps 10
    assert cap_budgets({"A": 60, "B": 30, "C": 10}, {"A": 0.2}) == {"A": 10, "B": 30, "C": 10}
    # nothing over its cap: unchanged
    assert cap_budgets({"A": 40, "B": 60}, {"*": 0.6}) == {"A": 40, "B": 60}
    # A over 0.4: T = 50 / 0.6 = 83.3, A keeps int(0.4 T) = 33; B (30 <= 33.3) stays free
    assert cap_budgets({"A": 50, "B": 30, "C": 20}, {"*": 0.4}) == {"A": 33, "B": 30, "C": 20}
    # A then B over 0.35: T = 20 / 0.3 = 66.7, each keeps int(0.35 T) = 23; C at 30 % is fine
    assert cap_budgets({"A": 50, "B": 30, "C": 20}, {"*": 0.35}) == {"A": 23, "B": 23, "C": 20}
    with pytest.raises(ValueError, match="source_caps"):
        cap_budgets({"A": 50, "B": 30, "C": 20}, {"*": 0.3})  # three groups cannot all stay <= 30 %


def reference_keep(ids, groups, lengths, weights, caps):
    """Plain Python: per group, ascending id, keep while the running sum stays within budget."""
    def take(rows, budgets):
        out, run = [], {}
        for i in sorted(rows, key=lambda i: (groups[i], ids[i])):
            run[groups[i]] = run.get(groups[i], 0) + lengths[i]
            if run[groups[i]] <= budgets[groups[i]]:
                out.append(i)
        return out

    rows = [i for i in range(len(ids)) if lengths[i] >= 0]
    totals = {}
    for i in rows:
        totals[groups[i]] = totals.get(groups[i], 0) + lengths[i]
    if weights:
        rows = take(rows, {g: int(t * weights.get(g, weights.get("*", 1.0))) for g, t in totals.items()})
    if caps:
        now = {}
        for i in rows:
            now[groups[i]] = now.get(groups[i], 0) + lengths[i]
        rows = take(rows, cap_budgets(now, caps))
    keep = np.zeros(len(ids), dtype=bool)
    keep[rows] = True
    return keep


@pytest.mark.parametrize("weights,caps", [({}, {}), ({"/usr/lib": 0.5}, {}), ({}, {"*": 0.4}),
                                          ({"*": 0.8, "/data/web": 0.25}, {"/usr/lib": 0.5})])
def test_selection_matches_reference(tmp_path, weights, caps):
    rng = random.Random(0)
    n = 300
    sources = [rng.choice(["/usr/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/libc.so", "/usr/bin/ls",
                           "/data/web/a.jsonl", "plain-name"]) for _ in range(n)]
    ids = [f"{rng.getrandbits(64):016x}" for _ in range(n)]
    lengths = np.array([rng.randint(0, 200) if rng.random() > 0.05 else -1 for _ in range(n)])
    pl.DataFrame({"id": ids, "source": sources, "text": ["t"] * n}).write_parquet(tmp_path / "d.parquet")
    cfg = ShardConfig(source_weights=weights, source_caps=caps)
    keep, rep = select_documents(str(tmp_path / "d.parquet"), lengths, cfg)
    groups = [s if not s.startswith("/") else "/".join(s.split("/")[:3]) for s in sources]
    np.testing.assert_array_equal(keep, reference_keep(ids, groups, lengths.tolist(), weights, caps))
    valid = lengths >= 0
    assert rep["documents_before"] == valid.sum() and rep["documents_after"] == keep.sum()
    for g in set(groups):
        mask = np.array([x == g for x in groups])
        assert rep["before"][g] == lengths[mask & valid].sum() and rep["after"][g] == lengths[mask & keep].sum()
    assert sum(rep["share_before"].values()) == pytest.approx(1.0, abs=1e-5)
    if caps.get("*"):
        assert max(rep["share_after"].values()) <= caps["*"] + 0.02  # whole documents: within one doc
    if not weights and not caps:
        assert rep["before"] == rep["after"] and keep.sum() == valid.sum()


def test_balanced_shards_hold_exactly_the_selected_documents(tmp_path):
    rng = random.Random(1)
    docs = ["\n".join(rng.choice(["mov rax, rbx", "add rsp, 8", "call ADDR", "ret", "push rbp"])
                      for _ in range(rng.randint(1, 20))) for _ in range(120)]
    sources = ["/usr/lib/a.so" if i % 3 else "/usr/bin/b" for i in range(120)]
    ids = [f"{rng.getrandbits(64):016x}" for _ in docs]
    pl.DataFrame({"id": ids, "source": sources, "text": docs}).write_parquet(tmp_path / "d.parquet")
    tok_path = train_tokenizer(str(tmp_path / "d.parquet"), TokenizerConfig(vocab_size=100), str(tmp_path / "t.json"))
    cfg = ShardConfig(seq_len=16, sequences_per_shard=9, part_docs=25, source_caps={"/usr/lib": 0.5})
    index = write_shards(str(tmp_path / "d.parquet"), tok_path, str(tmp_path / "s"), cfg, progress=False)
    tok = load_tokenizer(tok_path)
    lengths = np.array([len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False)])
    keep, _ = select_documents(str(tmp_path / "d.parquet"), lengths, cfg)
    assert 0 < keep.sum() < 120 and index["n_documents"] == keep.sum()
    ref = pack_documents([tok.encode(d, add_special_tokens=False).ids for d, k in zip(docs, keep) if k], 16)
    r = SequenceReader(tmp_path / "s", verify=True)
    np.testing.assert_array_equal(np.stack([r[i] for i in range(len(r))]), ref)
    b = index["balance"]
    assert b["share_before"]["/usr/lib"] > 0.6 and b["share_after"]["/usr/lib"] <= 0.5
    assert b["after"]["/usr/bin"] == b["before"]["/usr/bin"]  # the uncapped group keeps everything
