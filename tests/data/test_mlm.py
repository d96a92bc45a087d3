"""labkit.data.mlm: masking statistics, seeding, rank partitions, resume, DataLoader workers,
batch reads from the memory maps, compact labels, bad shard sets stopped before training."""

from __future__ import annotations

import math
import pathlib
import pickle
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from labkit.data.mlm import ArrayBatch, MLMCollator, RankSampler, ShardDataset, check_shards, dense_labels, make_loader
from labkit.data.shards import SequenceReader, ShardError, write_rows

V = 1000


pytestmark = pytest.mark.torch_threads(2)


def write_tiny_shards(out_dir, rows: np.ndarray, vocab_size: int, per_shard: int) -> None:
    """A shard set of these rows, written by labkit's writer (``labkit.data.shards.write_rows``)."""
    write_rows(out_dir, rows, vocab_size=vocab_size, tokenizer_sha256="0" * 64, rows_per_shard=per_shard)


def packed_rows(n: int, t: int, seed: int = 0) -> np.ndarray:
    """[CLS] + ids in [5, V) with a [SEP] now and then; the last row ends in [PAD]."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(5, V, size=(n, t), dtype=np.int64)
    rows[rng.random((n, t)) < 0.05] = 3
    rows[:, 0] = 2
    rows[-1, t // 2:] = 0
    return rows.astype(np.uint16)


def test_masking_statistics_over_a_million_positions():
    rng = np.random.default_rng(1)
    x = rng.integers(0, V, size=(1250, 1000))  # 1.25M positions, ~1.06M of them not special
    x = np.where(rng.random(x.shape) < 0.1, rng.integers(0, 5, size=x.shape), x)  # plenty of special tokens
    x[:, -50:] = 0  # padding tail
    out = MLMCollator(vocab_size=V, seed=0)(x.astype(np.uint16))
    orig = torch.from_numpy(x)
    inp, labels, attn = out["input_ids"], out["labels"], out["attention_mask"]
    assert inp.dtype == labels.dtype == torch.int64 and attn.dtype == torch.bool and inp.shape == (1250, 1000)
    special = orig < 5
    chosen = labels != -100
    n = int((~special).sum())
    assert not (chosen & special).any()
    assert abs(int(chosen.sum()) / n - 0.15) < 4 * math.sqrt(0.15 * 0.85 / n)
    assert torch.equal(labels[chosen], orig[chosen])
    assert torch.equal(inp[~chosen], orig[~chosen])
    assert torch.equal(attn, orig != 0)
    c = int(chosen.sum())
    masked = (inp == 4) & chosen
    replaced = chosen & (inp != 4) & (inp != orig)
    kept = chosen & (inp == orig)
    collide = 1 / (V - 5)  # a random replacement may draw the original id
    for count, p in [(masked, 0.8), (replaced, 0.1 * (1 - collide)), (kept, 0.1 + 0.1 * collide)]:
        assert abs(int(count.sum()) / c - p) < 4 * math.sqrt(p * (1 - p) / c)
    assert int(inp[replaced].min()) >= 5 and int(inp[replaced].max()) < V
    assert len(torch.unique(inp[replaced])) > 0.99 * (V - 5)  # uniform over the non-special ids


def test_masking_is_a_function_of_seed_and_batch():
    rows = packed_rows(8, 64)
    a = MLMCollator(vocab_size=V, seed=3)(rows)
    b = MLMCollator(vocab_size=V, seed=3)(list(rows))
    for k in a:
        assert torch.equal(a[k], b[k])
    c = MLMCollator(vocab_size=V, seed=4)(rows)
    assert not torch.equal(a["labels"], c["labels"])
    collator = MLMCollator(vocab_size=V, seed=3)
    collator(packed_rows(8, 64, seed=9))  # an earlier call does not change the next batch's masks
    assert torch.equal(collator(rows)["labels"], a["labels"])
    free = MLMCollator(vocab_size=V)
    assert not torch.equal(free(rows)["labels"], free(rows)["labels"])


def test_collator_errors_name_the_field():
    with pytest.raises(ValueError, match="mlm_probability"):
        MLMCollator(vocab_size=V, mlm_probability=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        MLMCollator(vocab_size=5)
    with pytest.raises(ValueError, match="special_ids"):
        MLMCollator(vocab_size=V, mask_id=7)
    with pytest.raises(ValueError, match="vocab_size"):
        MLMCollator(vocab_size=V, seed=0)(np.full((2, 8), V))


def _stream(n: int, seed: int, count: int) -> list[int]:
    """The first ``count`` samples of the global stream: epoch e is randperm(n) seeded seed + e."""
    out, e = [], 0
    while len(out) < count:
        out += torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist()
        e += 1
    return out[:count]


def _interleaved(per_rank: list[list[list[int]]]) -> list[int]:
    """The samples of the ranks' micro-batches in global order: micro-batch k is rank k % world's k // world-th."""
    world, n = len(per_rank), min(len(p) for p in per_rank)
    return [i for k in range(n) for r in range(world) for i in per_rank[r][k]]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_ranks_read_one_stream_with_nothing_dropped(world):
    """Three epochs of every rank, interleaved, are the global stream (epoch after epoch, every
    sample once an epoch: 103 is no multiple of world x 4, and a micro-batch straddles each
    epoch's end); the ranks' micro-batches are disjoint within an epoch's span."""
    n, b = 103, 4
    samplers = [RankSampler(n, rank=r, world_size=world, batch_size=b, seed=5) for r in range(world)]
    per_rank = [[x for _ in range(3) for x in s] for s in samplers]
    assert all(len(x) == b for p in per_rank for x in p)
    got = _interleaved(per_rank)
    assert got == _stream(n, 5, len(got)) and len(got) >= 3 * n - world * b
    epoch0 = [list(RankSampler(n, rank=r, world_size=world, batch_size=b, seed=5)) for r in range(world)]
    assert sum(len(p) for p in epoch0) * b in range(n, n + world * b)  # the micro-batches that start in epoch 0


def test_sampler_epochs_and_resume():
    s = RankSampler(50, rank=1, world_size=2, batch_size=3, seed=7)
    epoch0 = list(s)
    epoch1 = list(s)  # finishing an epoch moves to the next
    glob = {"batch_size": 3, "world_size": 2, "n_samples": 50}
    assert s.epoch == 2 and epoch0 != epoch1 and len(epoch0) == 8 and len(epoch1) == 9  # starts 3, 9, ..., 45; 51, ...
    s.set_epoch(0)
    assert list(s) == epoch0
    s.set_epoch(1)
    it = iter(s)
    head = [next(it) for _ in range(3)]
    state = s.state_dict()
    assert state == {"samples": 8 * 6 + 3 * 6, "epoch": 1, **glob} and head == epoch1[:3]
    resumed = RankSampler(50, rank=1, world_size=2, batch_size=3, seed=7)
    resumed.load_state_dict(state)
    assert list(resumed) == epoch1[3:]
    # a format-2 state (global micro-batches of its epoch): the same place in the same epoch
    resumed.load_state_dict({"epoch": 1, "position": 3, "micro_batches": 6, "batch_size": 3, "epoch_samples": 48})
    assert next(iter(resumed)) == _stream(50, 7, 50 + 6 * 3 + 3 + 3)[-3:]  # after 6 micro-batches, rank 1's
    with pytest.raises(ValueError, match="^sampler: the saved position is in a stream of 60 samples an epoch; "
                                         "this shard set has 50$"):
        resumed.load_state_dict({**state, "n_samples": 60})
    with pytest.raises(ValueError, match="rank"):
        RankSampler(50, rank=2, world_size=2, batch_size=3)
    with pytest.raises(ValueError, match="n_samples"):
        RankSampler(5, rank=0, world_size=2, batch_size=3)


@pytest.mark.parametrize("n", range(16, 72))
def test_any_world_size_resumes_the_global_position(n):
    """The issue's case: dp 2 -> 1 (and 1 -> 2, 2 -> 4 at the same global batch) continues the
    global stream for every shard-set size, whatever the epochs' lengths at either world size;
    nothing is refused. 3 steps at one split, then 4 at the other: the stream's first samples."""
    b = 4
    for (w1, a1), (w2, a2) in (((2, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 2), (4, 1))):
        if n < 4 * b:
            continue
        consumed, state = [], None
        for world, accum, steps in ((w1, a1, 3), (w2, a2, 4)):
            samplers = [RankSampler(n, rank=r, world_size=world, batch_size=b, seed=3) for r in range(world)]
            its, epochs, positions = [], [], []
            for s in samplers:
                if state is not None:
                    s.load_state_dict(state)
                its.append(iter(s))
                epochs.append(s.epoch)
                positions.append(s.position)
            for _ in range(steps):
                for _ in range(accum):
                    for r, s in enumerate(samplers):
                        batch = next(its[r], None)
                        if batch is None:  # the loop's _next_epoch
                            epochs[r], positions[r] = epochs[r] + 1, 0
                            s.set_epoch(epochs[r])
                            its[r] = iter(s)
                            batch = next(its[r])
                        positions[r] += 1
                        consumed += batch
            states = [s.state_at(epochs[r], positions[r]) for r, s in enumerate(samplers)]
            assert all(st == states[0] for st in states) and states[0]["samples"] == len(consumed)
            state = states[0]
        assert consumed == _stream(n, 3, len(consumed)), (n, w1, w2)


def test_the_global_micro_batch_order_does_not_depend_on_the_world_size():
    """World 2 and world 1 see the same micro-batches (so the same masks) in the same global order:
    world 1's batch 2k + r is rank r's batch k, and a state saved at world 2 resumes at world 1
    with the remaining micro-batches."""
    n, b = 50, 4
    two = [RankSampler(n, rank=r, world_size=2, batch_size=b, seed=3).batches(0) for r in range(2)]
    one = RankSampler(n, rank=0, world_size=1, batch_size=b, seed=3)
    assert len(one) == 13 and all(torch.equal(one.batches(0)[2 * k + r], two[r][k]) for k in range(6) for r in range(2))
    state = RankSampler(n, rank=1, world_size=2, batch_size=b, seed=3).state_at(0, 2)
    assert state["samples"] == 16
    one.load_state_dict(state)
    assert list(one) == RankSampler(n, rank=0, world_size=1, batch_size=b, seed=3).batches(0)[4:].tolist()


def batches_equal(xs, ys) -> bool:
    return len(xs) == len(ys) and all(all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(xs, ys))


@pytest.mark.timeout(60)
def test_dataloader_workers_give_the_single_process_batches():
    rows = packed_rows(64, 32)

    def loader(workers):
        sampler = RankSampler(len(rows), rank=0, world_size=2, batch_size=4, seed=1)
        return DataLoader(rows, batch_sampler=sampler, collate_fn=MLMCollator(vocab_size=V, seed=1),
                          num_workers=workers, multiprocessing_context="forkserver" if workers else None)

    assert batches_equal(list(loader(0)), list(loader(2)))


def test_make_loader_resumes_exactly(tmp_path):
    rows = packed_rows(90, 32, seed=2)
    write_tiny_shards(tmp_path, rows, V, per_shard=40)
    kw = dict(batch_size=4, rank=1, world_size=2, seed=3, mlm_probability=0.15, vocab_size=V)
    full = list(make_loader(tmp_path, **kw))
    assert len(full) == 90 // 8
    ids = RankSampler(90, rank=1, world_size=2, batch_size=4, seed=3).batches(0)
    torch.testing.assert_close(full[0]["labels"][full[0]["labels"] != -100],
                               torch.from_numpy(rows[ids[0].numpy()].astype(np.int64))[full[0]["labels"] != -100])
    resumed = make_loader(tmp_path, **kw)
    resumed.batch_sampler.load_state_dict({"epoch": 0, "position": 5})
    assert batches_equal(list(resumed), full[5:])
    with pytest.raises(ValueError, match="vocab_size"):
        make_loader(tmp_path, **{**kw, "vocab_size": 500})


@pytest.mark.timeout(60)
def test_make_loader_with_two_workers(tmp_path):
    write_tiny_shards(tmp_path, packed_rows(40, 16, seed=4), V, per_shard=16)
    kw = dict(batch_size=4, rank=0, world_size=1, seed=0, mlm_probability=0.15, vocab_size=V)
    loader = make_loader(tmp_path, num_workers=2, **kw)
    assert loader.persistent_workers and loader.multiprocessing_context is not None
    assert len(pickle.dumps(loader.dataset)) < 2000  # memory maps are reopened in workers, not copied
    epoch0 = list(loader)
    assert batches_equal(epoch0, list(make_loader(tmp_path, **kw)))
    epoch1 = list(loader)  # persistent workers, next epoch's order
    assert len(epoch1) == 10 and not batches_equal(epoch0, epoch1)


def test_compact_labels_are_the_dense_ones_and_what_a_sparse_head_gathers():
    rows = packed_rows(16, 128, seed=5)
    dense = MLMCollator(vocab_size=V, seed=2)(rows)
    compact = MLMCollator(vocab_size=V, seed=2, compact=True)(rows)
    assert "labels" not in compact and torch.equal(compact["input_ids"], dense["input_ids"])
    chosen = dense["labels"] != -100
    assert torch.equal(compact["masked_positions"], chosen.view(-1).nonzero().squeeze(1))
    assert torch.equal(compact["masked_labels"], dense["labels"][chosen])
    assert torch.equal(dense_labels(compact["masked_positions"], compact["masked_labels"], rows.shape), dense["labels"])
    hidden = torch.randn(16, 128, 8)
    assert torch.equal(hidden.reshape(-1, 8)[compact["masked_positions"]], hidden[chosen])  # the sparse head's rows


def test_other_special_ids_are_never_chosen_nor_drawn():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 50, size=(400, 500))  # 200k positions, ~2 % each id
    out = MLMCollator(vocab_size=50, special_ids=(0, 2, 3, 4, 9), seed=1)(x)  # not 0..k: the isin path
    chosen = out["labels"] != -100
    special = torch.isin(torch.from_numpy(x), torch.tensor([0, 2, 3, 4, 9]))
    assert not (chosen & special).any() and chosen.sum() > 0.14 * (~special).sum()
    replaced = chosen & (out["input_ids"] != 4) & (out["input_ids"] != torch.from_numpy(x))
    assert int(out["input_ids"][replaced].min()) >= 10 and int(out["input_ids"][replaced].max()) < 50
    assert torch.equal(out["input_ids"][special], torch.from_numpy(x)[special])


def test_batch_reads_equal_single_reads(tmp_path):
    rows = packed_rows(90, 32, seed=6)
    write_tiny_shards(tmp_path, rows, V, per_shard=40)
    ds, reader = ShardDataset(tmp_path), SequenceReader(tmp_path)
    ids = [89, 0, 39, 40, 41, 5, 5, 80]  # unsorted, repeated, across all three shards
    batch = ds.__getitems__(ids)
    assert batch.dtype == np.uint16 and batch.shape == (8, 32)
    np.testing.assert_array_equal(batch, np.stack([reader[i] for i in ids]))
    np.testing.assert_array_equal(batch, rows[ids])
    np.testing.assert_array_equal(ds[41], rows[41])
    with pytest.raises(IndexError, match=r"\[0, 90\)"):
        ds.__getitems__([3, 90])
    copy = pickle.loads(pickle.dumps(ds))  # reopens its maps lazily
    np.testing.assert_array_equal(copy.__getitems__(ids), batch)


def test_bad_shard_sets_stop_before_training_naming_file_and_difference(tmp_path):
    rows = packed_rows(40, 16, seed=7)
    write_tiny_shards(tmp_path, rows, V, per_shard=16)
    kw = dict(batch_size=4, rank=0, world_size=1, seed=0, mlm_probability=0.15, vocab_size=V)
    index_path = str(tmp_path / "index.json")
    assert check_shards(tmp_path, seq_len=16, dtype="uint16", vocab_size=V, tokenizer_sha256="0" * 64, verify=True)
    with pytest.raises(ShardError, match=rf"{index_path}: seq_len: run expects 128, shards have 16"):
        make_loader(tmp_path, seq_len=128, **kw)
    with pytest.raises(ShardError, match=rf"{index_path}: dtype: run expects 'uint32', shards have 'uint16'"):
        make_loader(tmp_path, dtype="uint32", **kw)
    with pytest.raises(ShardError, match=r"tokenizer_sha256: run expects 'abc', shards have '0000"):
        make_loader(tmp_path, tokenizer_sha256="abc", **kw)
    raw = bytearray((tmp_path / "shard-00001.bin").read_bytes())
    raw[5] ^= 1
    (tmp_path / "shard-00001.bin").write_bytes(bytes(raw))
    make_loader(tmp_path, **kw)  # sizes still match: only verify finds it
    with pytest.raises(ShardError, match=r"shard-00001\.bin: sha256 [0-9a-f]{64} does not match"):
        make_loader(tmp_path, verify=True, **kw)
    (tmp_path / "shard-00002.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ShardError, match=r"shard-00002\.bin: 10 bytes on disk, index says 256"):
        make_loader(tmp_path, **kw)
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(ShardError, match=rf"{index_path}: malformed JSON"):
        make_loader(tmp_path, **kw)
    (tmp_path / "index.json").unlink()
    with pytest.raises(ShardError, match=rf"index.json missing in {tmp_path}"):
        make_loader(tmp_path, **kw)


def test_worker_batches_arrive_as_arrays_and_are_yielded_as_tensors(tmp_path):
    write_tiny_shards(tmp_path, packed_rows(40, 16, seed=8), V, per_shard=16)
    kw = dict(batch_size=4, rank=0, world_size=1, seed=0, mlm_probability=0.15, vocab_size=V)
    loader = make_loader(tmp_path, num_workers=1, prefetch_factor=3, compact=True, **kw)
    assert loader.prefetch_factor == 3 and loader.worker_init_fn is not None
    rows = loader.dataset.__getitems__([0, 1, 2, 3])
    packed = loader.collate_fn(rows)
    assert isinstance(packed, ArrayBatch) and packed.input_ids.dtype == packed.masked_labels.dtype == np.uint16
    assert packed.masked_positions.dtype == np.int32
    assert batches_equal([packed.tensors()], [MLMCollator(vocab_size=V, seed=0, compact=True)(rows)])
    dense = MLMCollator(vocab_size=V, seed=0)
    assert batches_equal([dense.packed(rows).tensors()], [dense(rows)])
    assert len(pickle.dumps(dense.packed(packed_rows(32, 512)))) < 64 * 1024  # one pipe buffer
    got = list(loader)
    assert all(isinstance(v, torch.Tensor) for b in got for v in b.values())
    assert batches_equal(got, list(make_loader(tmp_path, compact=True, **kw)))
    with pytest.raises(ValueError, match="prefetch_factor"):
        make_loader(tmp_path, num_workers=1, prefetch_factor=0, **kw)


@pytest.mark.timeout(120)
def test_workers_after_tokenizer_and_polars_thread_pools_finish(tmp_path):
    """The parent has run the tokenizers (rayon) and polars thread pools, then starts 2 workers:
    no fork deadlock: the run finishes within the timeout with every batch."""
    write_tiny_shards(tmp_path, packed_rows(64, 32, seed=9), V, per_shard=16)
    script = textwrap.dedent(f"""
        import polars as pl, torch
        from tokenizers import Tokenizer, models, pre_tokenizers
        from labkit.data.mlm import make_loader
        if __name__ == "__main__":
            torch.set_num_threads(2)
            tok = Tokenizer(models.WordLevel({{"[UNK]": 0, "mov": 1, "rax": 2}}, unk_token="[UNK]"))
            tok.pre_tokenizer = pre_tokenizers.Whitespace()
            assert len(tok.encode_batch(["mov rax"] * 2000)) == 2000  # parallel encode
            assert pl.DataFrame({{"a": range(100000)}}).lazy().select(pl.col("a").sum()).collect().item() > 0
            loader = make_loader({str(tmp_path)!r}, batch_size=4, rank=0, world_size=1, seed=0,
                                 mlm_probability=0.15, vocab_size={V}, num_workers=2)
            n = sum(len(b["input_ids"]) for epoch in range(2) for b in loader)
            print("samples", n)
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != "TOKENIZERS_PARALLELISM"}
    env["TOKENIZERS_PARALLELISM"] = "true"  # the pools are really used in the parent
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, env=env,
                          cwd=__import__("pathlib").Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["samples", "128"]


@pytest.mark.gpu
def test_pinned_batches_from_workers(tmp_path):
    write_tiny_shards(tmp_path, packed_rows(40, 16, seed=10), V, per_shard=16)
    loader = make_loader(tmp_path, batch_size=4, rank=0, world_size=1, seed=0, mlm_probability=0.15,
                         vocab_size=V, num_workers=1, pin_memory=True)
    batch = next(iter(loader))
    assert all(v.is_pinned() for v in batch.values())


def test_iter_draws_torch_rng_when_called_like_a_plain_dataloader(tmp_path):
    """A resuming trainer calls iter(loader) and then restores torch's RNG state; the loader must
    have drawn its base seed by then, as a plain DataLoader does."""
    write_tiny_shards(tmp_path, packed_rows(40, 16, seed=11), V, per_shard=16)
    loader = make_loader(tmp_path, batch_size=4, rank=0, world_size=1, seed=0, mlm_probability=0.15, vocab_size=V)
    torch.manual_seed(123)
    it = iter(loader)
    after_ours = torch.rand(3)
    torch.manual_seed(123)
    iter(DataLoader(list(range(8)), batch_size=4))
    assert torch.equal(after_ours, torch.rand(3))
    torch.manual_seed(123)
    assert not torch.equal(after_ours, torch.rand(3))  # iter() did draw
    assert len(list(it)) == 10


@pytest.mark.timeout(120)
def test_a_shard_truncated_under_loader_workers_raises_shard_error(tmp_path):
    """num_workers=2: a ``cp``-style truncation of a shard while the workers run reaches the
    trainer as ShardError naming the file and both sizes (the DataLoader re-raises the worker's
    exception), not as a worker killed by SIGBUS."""
    rows = packed_rows(40, 16, seed=8)
    write_tiny_shards(tmp_path, rows, V, per_shard=20)
    loader = make_loader(tmp_path, batch_size=4, rank=0, world_size=1, seed=0, mlm_probability=0.15,
                         vocab_size=V, num_workers=2)
    batches = iter(loader)
    first = next(batches)
    assert first["input_ids"].shape == (4, 16)
    victim = tmp_path / "shard-00000.bin"
    with open(victim, "r+b") as f:  # cp of a shorter file onto the path: same inode, truncated
        f.truncate(0)
        f.write(rows[:3].tobytes())
    with pytest.raises(ShardError) as err:
        for _ in range(3 * len(loader)):  # past the prefetched batches, into the next epochs
            for _ in batches:
                pass
            batches = iter(loader)
    # a worker may read between the truncation and the write (as under a real cp): 0 or 96 bytes
    assert re.search(re.escape(f"{victim}: changed since the shard set was opened: size 640 -> ") + r"(0|96) bytes",
                     str(err.value)), str(err.value)
    assert "DataLoader worker process" in str(err.value)  # raised in a worker, re-raised here


def test_loader_and_heldout_from_one_shard_set_read_the_index_once(tmp_path, monkeypatch):
    """A run opens its data once: ``open_shards`` reads index.json; the loader (its check,
    dataset and sampler) and the held-out set built from that ShardSet read it no more."""
    import io

    from labkit.data.shards import open_shards
    from labkit.train.evaluation import HeldoutSet
    from tiny_shards import write_tiny_shards as tiny_set  # tests/ is on sys.path

    tiny_set(tmp_path, n_sequences=32, heldout_sequences=6)
    opened, real = [], io.open

    def counting_open(file, *a, **kw):
        if str(file).endswith("index.json"):
            opened.append(str(file))
        return real(file, *a, **kw)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr("builtins.open", counting_open)
    shards = open_shards(tmp_path, seq_len=32, tokenizer_sha256="ab" * 32)
    loader = make_loader(shards, batch_size=4, rank=0, world_size=1, seed=0, mlm_probability=0.15,
                         vocab_size=96, seq_len=32, tokenizer_sha256="ab" * 32)
    heldout = HeldoutSet(shards, rank=0, world_size=1, mlm_probability=0.15, max_sequences=4,
                         batch_size=2, device=torch.device("cpu"))
    n_batches = sum(1 for _ in loader)
    assert opened == [str(tmp_path / "index.json")]
    assert loader.dataset._reader is shards and n_batches == 8 and heldout.n_sequences == 4
    assert len(RankSampler(shards, rank=0, world_size=2, batch_size=4)) == 4
    path_heldout = HeldoutSet(tmp_path, rank=0, world_size=1, mlm_probability=0.15,
                              max_sequences=4, batch_size=2, device=torch.device("cpu"))
    for a, b in zip(heldout.batches, path_heldout.batches):  # the same set as from a path
        assert all(torch.equal(a[k], b[k]) for k in a)


_RANK = """
import pathlib, sys, time
sys.path.insert(0, {tests!r})
import torch
from labkit.data.mlm import make_loader
torch.set_num_threads(1)
loader = make_loader({shards!r}, batch_size=64, rank=0, world_size=1, seed=0, mlm_probability=0.15, vocab_size=96,
                     num_workers=2, prefetch_factor=4)
batches = iter(loader)
next(batches)  # the workers run and fill their pipe: 64 kB batches, 4 in flight each
pathlib.Path({ready!r}).write_text("1")
time.sleep(600)
"""


@pytest.mark.timeout(180)
def test_loader_workers_die_with_a_killed_rank(tmp_path):
    """A rank process SIGKILLed with its DataLoader workers busy (their results fill the pipe, so
    their exit would block): every worker, and the forkserver they came from, is gone within
    seconds (prctl PR_SET_PDEATHSIG and a watch of the rank's pid; before, one set lived for more
    than 30 minutes)."""
    import signal
    import time

    import psutil
    from tiny_shards import write_tiny_shards as tiny_set  # tests/ is on sys.path

    shards = tiny_set(tmp_path / "shards", n_sequences=256, seq_len=512)
    ready = tmp_path / "ready"
    script = _RANK.format(tests=str(pathlib.Path(__file__).resolve().parents[1]), shards=str(shards),
                          ready=str(ready))
    rank = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 150
    while not ready.exists():
        assert rank.poll() is None and time.monotonic() < deadline, rank.stderr.read().decode()[-2000:]
        time.sleep(0.1)
    kids = psutil.Process(rank.pid).children(recursive=True)
    assert len(kids) >= 3, kids  # the forkserver and its 2 workers (and the resource tracker)
    time.sleep(1.0)  # the workers' results are in the pipe now
    rank.send_signal(signal.SIGKILL)
    rank.wait()
    gone, alive = psutil.wait_procs(kids, timeout=15)
    assert not alive, [(p.pid, p.name(), p.cmdline()[-2:]) for p in alive]
