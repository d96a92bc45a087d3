"""Tests of labkit/data/stage.py: verified copies, idempotence, repair of a bad copy, interrupted
copies, several simulated nodes and the free-space check."""

from __future__ import annotations

import errno
import os
import getpass
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from labkit.config import ShardConfig, TokenizerConfig
from labkit.data import stage
from labkit.data.shards import ShardError, read_index, verify_shards, write_shards
from labkit.data.stage import resolve_local_root, stage_shards
from labkit.data.tokenize import train_tokenizer


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("shared")
    lines = ["mov rax, qword ptr [rbp - 8]", "add rax, rbx", "call FUNC", "ret", "push rbp", "xor eax, eax"]
    docs = ["\n".join(lines[(i + j) % 6] for j in range(2 + i % 9)) for i in range(120)]
    pl.DataFrame({"text": docs}).write_parquet(d / "docs.parquet")
    train_tokenizer(str(d / "docs.parquet"), TokenizerConfig(vocab_size=120), str(d / "tokenizer.json"))
    write_shards(str(d / "docs.parquet"), str(d / "tokenizer.json"), str(d / "shards"),
                 ShardConfig(seq_len=16, sequences_per_shard=20), progress=False)
    return d / "shards"


def expected_dst(src: Path, root: Path) -> Path:
    """Keyed by content: the folder's name and the first 12 hex digits of its index.json's sha256."""
    import hashlib

    return root / f"shards-{hashlib.sha256((src / 'index.json').read_bytes()).hexdigest()[:12]}"


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_copy_verify_and_report(src, tmp_path):
    report = stage_shards(str(src), local_root=str(tmp_path), node_name="node-a")
    dst = expected_dst(src, tmp_path)
    assert report["node"] == "node-a" and report["path"] == str(dst) and report["copied"] is True
    assert report["bytes"] == sum(p.stat().st_size for p in src.iterdir())
    assert report["seconds"] > 0 and report["mb_per_s"] == pytest.approx(report["bytes"] / 1e6 / report["seconds"])
    assert len(read_index(src)["shards"]) > 2 and same_files(src, dst)
    assert verify_shards(dst) == read_index(src)
    assert sorted(p.name for p in tmp_path.iterdir()) == [dst.name]  # no temp dirs left


def test_second_call_keeps_the_copy(src, tmp_path):
    stage_shards(str(src), local_root=str(tmp_path))
    dst = expected_dst(src, tmp_path)
    inode = (dst / "shard-00000.bin").stat().st_ino
    again = stage_shards(str(src), local_root=str(tmp_path))
    assert again["copied"] is False and again["path"] == str(dst)
    assert (dst / "shard-00000.bin").stat().st_ino == inode


def test_corrupt_destination_is_replaced_only_after_a_good_copy(src, tmp_path, monkeypatch):
    stage_shards(str(src), local_root=str(tmp_path))
    dst = expected_dst(src, tmp_path)
    bad = dst / "shard-00001.bin"
    bad.write_bytes(b"\x00" + bad.read_bytes()[1:])
    real_copy, calls = stage.copy_and_hash, []

    def failing_copy(a, b, **kw):
        calls.append(a)
        if Path(a).name == "shard-00001.bin":  # by name: shards are copied on several threads
            raise OSError(errno.EIO, "simulated I/O error")
        return real_copy(a, b, **kw)

    monkeypatch.setattr(stage, "copy_and_hash", failing_copy)
    with pytest.raises(OSError, match="simulated"):
        stage_shards(str(src), local_root=str(tmp_path))
    assert (dst / "index.json").exists() and bad.read_bytes()[0] == 0  # the old copy is still there
    monkeypatch.undo()
    report = stage_shards(str(src), local_root=str(tmp_path))
    assert report["copied"] is True and same_files(src, dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == [dst.name]


def test_interrupted_copy_leaves_nothing_complete_and_retry_works(src, tmp_path, monkeypatch):
    real_copy, calls = stage.copy_and_hash, []

    def interrupted(a, b, **kw):
        calls.append(a)
        if Path(a).name == "shard-00002.bin":
            raise KeyboardInterrupt
        return real_copy(a, b, **kw)

    monkeypatch.setattr(stage, "copy_and_hash", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stage_shards(str(src), local_root=str(tmp_path))
    dst = expected_dst(src, tmp_path)
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    # a copy killed outright leaves its temp dir behind: a dead pid's temp dir is removed,
    # a live process's one (it may still be copying) is left alone
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, 1):
        partial = tmp_path / f".tmp-{dst.name}-{pid}"
        partial.mkdir()
        (partial / "shard-00000.bin").write_bytes(b"partial")
    assert stage_shards(str(src), local_root=str(tmp_path))["copied"] is True and same_files(src, dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".tmp-{dst.name}-1", dst.name]


def test_only_an_unverified_copy_is_fsynced(src, tmp_path, monkeypatch):
    """A verified copy is re-hashed before any verifying call keeps it, so it is published
    without forcing its bytes to disk; an unverified one (later calls check sizes only) is."""
    synced = []
    monkeypatch.setattr(stage, "fsync_tree", lambda path: synced.append(Path(path).name))
    stage_shards(str(src), local_root=str(tmp_path / "verified"))
    assert synced == []
    stage_shards(str(src), local_root=str(tmp_path / "unverified"), verify=False)
    assert len(synced) == 1 and synced[0].startswith(".tmp-shards-")


def test_shards_copied_on_threads_match_the_source(src, tmp_path, monkeypatch):
    n = len(read_index(src)["shards"])
    assert n >= 4 and stage.copy_workers(n) == min(4, n, len(os.sched_getaffinity(0)))
    monkeypatch.setattr(stage, "copy_workers", lambda n_files: 4)
    report = stage_shards(str(src), local_root=str(tmp_path))
    assert report["copied"] and same_files(src, Path(report["path"]))
    verify_shards(report["path"])


def test_two_simulated_nodes(src, tmp_path):
    reports = [stage_shards(str(src), local_root=str(tmp_path / node), node_name=node) for node in ("node-a", "node-b")]
    assert [r["node"] for r in reports] == ["node-a", "node-b"] and all(r["copied"] for r in reports)
    for node, r in zip(("node-a", "node-b"), reports):
        assert Path(r["path"]).parent == tmp_path / node
        verify_shards(r["path"])
        assert same_files(src, Path(r["path"]))


def test_not_enough_free_space(src, tmp_path, monkeypatch):
    need = sum(p.stat().st_size for p in src.iterdir())
    monkeypatch.setattr(stage.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(OSError, match=f"need {need} bytes, 100 bytes free") as e:
        stage_shards(str(src), local_root=str(tmp_path))
    assert e.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


def test_bad_sources(src, tmp_path):
    with pytest.raises(ShardError, match="index.json missing"):
        stage_shards(str(tmp_path), local_root=str(tmp_path / "local"))
    broken = tmp_path / "shards"
    shutil.copytree(src, broken)
    raw = bytearray((broken / "shard-00002.bin").read_bytes())
    raw[0] ^= 1
    (broken / "shard-00002.bin").write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"shard-00002\.bin: copy has sha256"):
        stage_shards(str(broken), local_root=str(tmp_path / "local"))
    assert list((tmp_path / "local").iterdir()) == []
    # without verify only sizes are checked, so the same source is staged
    assert stage_shards(str(broken), local_root=str(tmp_path / "local"), verify=False)["copied"] is True


def test_resolve_local_root(monkeypatch, tmp_path):
    user = f"labkit-{getpass.getuser()}"
    assert resolve_local_root(str(tmp_path)) == tmp_path
    monkeypatch.setenv("LABKIT_LOCAL_SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))
    assert resolve_local_root() == tmp_path / "scratch" / user
    monkeypatch.delenv("LABKIT_LOCAL_SCRATCH")
    assert resolve_local_root() == tmp_path / "tmpdir" / user
    monkeypatch.delenv("TMPDIR")
    assert resolve_local_root() == Path("/tmp") / user


def test_disk_full_during_the_copy_keeps_the_old_copy(src, tmp_path, monkeypatch):
    stage_shards(str(src), local_root=str(tmp_path))
    dst = expected_dst(src, tmp_path)
    bad = dst / "shard-00000.bin"
    bad.write_bytes(b"\x01" + bad.read_bytes()[1:])  # a copy that fails verification
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    real_copy, calls = stage.copy_and_hash, []

    def fills_up(a, b, **kw):
        calls.append(a)
        if Path(a).name == "shard-00002.bin":
            real_copy(a, b, **kw)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_copy(a, b, **kw)

    monkeypatch.setattr(stage, "copy_and_hash", fills_up)
    shard_bytes = read_index(src)["shards"][0]["n_bytes"]
    with pytest.raises(OSError, match=rf"disk full while staging {src} into {tmp_path}: {2 * shard_bytes} of "
                                      rf"\d+ bytes copied when shard-00002.bin failed; .*{dst} was left as it was") as e:
        stage_shards(str(src), local_root=str(tmp_path))
    assert e.value.errno == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before  # untouched, bad byte included
    assert sorted(p.name for p in tmp_path.iterdir()) == [dst.name]  # the partial copy is gone


def _stage_twice_info():
    import os

    return os.environ.get("LABKIT_NODE_NAME"), os.environ.get("LABKIT_LOCAL_SCRATCH")


@pytest.mark.timeout(180)
def test_two_simulated_nodes_on_a_real_cluster(src, tmp_path):
    """Two ipyparallel engines told they sit on node-a and node-b, each with its own scratch
    directory: one verified copy per node, and a second round copies nothing."""
    from labkit import cluster as C
    from labkit import lab

    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "shards").symlink_to(src)  # lab.stage stages <workdir>/shards
    cl = C.start_cluster(2, env={"PYTHONPATH": str(Path(__file__).resolve().parent)})
    try:
        rc = C.get_client(cl)
        ids = sorted(rc.ids)
        C.set_node_names(rc, {ids[0]: "node-a", ids[1]: "node-b"})
        C.set_local_roots(rc, {ids[0]: str(tmp_path / "a"), ids[1]: str(tmp_path / "b")})
        assert rc[ids].apply_sync(_stage_twice_info) == [("node-a", str(tmp_path / "a")), ("node-b", str(tmp_path / "b"))]
        first = pl.DataFrame([r for _, r in sorted(lab.stage(rc, str(workdir), local_root="auto").items())])
        user = f"labkit-{getpass.getuser()}"
        assert first["node"].to_list() == ["node-a", "node-b"] and first["copied"].to_list() == [True, True]
        assert first["path"].to_list() == [str(expected_dst(src, tmp_path / n / user)) for n in ("a", "b")]
        assert first["bytes"].to_list() == [sum(p.stat().st_size for p in src.iterdir())] * 2
        for path in first["path"]:
            assert verify_shards(path) == read_index(src) and same_files(src, Path(path))
        again = pl.DataFrame([r for _, r in sorted(lab.stage(rc, str(workdir), local_root="auto").items())])
        assert again["copied"].to_list() == [False, False] and again["path"].to_list() == first["path"].to_list()
        C.set_local_roots(rc, {i: None for i in ids})
        assert rc[ids].apply_sync(_stage_twice_info)[0][1] is None
    finally:
        C.stop_cluster(cl)


def test_same_named_sets_of_one_tokenizer_never_share_a_copy(src, tmp_path):
    """A sequence-length sweep: two sets in folders both named ``shards``, built with one
    tokenizer, get distinct copies, and staging one never evicts the other."""
    docs, tok = src.parent / "docs.parquet", src.parent / "tokenizer.json"
    sets = {}
    for seq_len in (16, 32):
        out = tmp_path / f"sweep-{seq_len}" / "shards"
        write_shards(str(docs), str(tok), str(out), ShardConfig(seq_len=seq_len, sequences_per_shard=20),
                     progress=False)
        sets[seq_len] = out
    assert read_index(sets[16])["tokenizer_sha256"] == read_index(sets[32])["tokenizer_sha256"]
    root = tmp_path / "local"
    first = {n: stage_shards(str(d), local_root=str(root)) for n, d in sets.items()}
    assert first[16]["path"] != first[32]["path"] and all(r["copied"] for r in first.values())
    again = {n: stage_shards(str(d), local_root=str(root)) for n, d in sets.items()}
    assert all(not r["copied"] for r in again.values())
    for n, d in sets.items():
        assert again[n]["path"] == str(expected_dst(d, root)) and same_files(d, Path(again[n]["path"]))
        assert read_index(again[n]["path"])["seq_len"] == n


@pytest.mark.parametrize("verify", [True, False])
def test_a_damaged_heldout_copy_is_found_and_replaced(tmp_path, verify):
    """The held-out file is checked like the shards when a copy is reused: re-hashed with
    ``verify`` (a flipped byte is found), its size checked without (a torn file is found)."""
    from tests.tiny_shards import write_tiny_shards

    src = write_tiny_shards(tmp_path / "shards", heldout_sequences=8)
    root = tmp_path / "local"
    staged = Path(stage_shards(str(src), local_root=str(root), verify=verify)["path"])
    held = staged / "heldout-00000.bin"
    data = held.read_bytes()
    held.write_bytes((bytes([data[0] ^ 1]) + data[1:]) if verify else data[:-2])
    again = stage_shards(str(src), local_root=str(root), verify=verify)
    assert again["copied"] is True and again["path"] == str(staged)
    assert held.read_bytes() == (src / "heldout-00000.bin").read_bytes() and same_files(src, staged)
    assert stage_shards(str(src), local_root=str(root), verify=verify)["copied"] is False


def test_an_unverified_copy_fsyncs_the_heldout_file(tmp_path, monkeypatch):
    """Durability as the shards': without ``verify`` every file of the copy, the held-out file
    among them, is fsynced before the rename publishes it."""
    from tests.tiny_shards import write_tiny_shards

    from labkit import io

    src = write_tiny_shards(tmp_path / "shards", heldout_sequences=8)
    synced = []
    real = io._fsync_file
    monkeypatch.setattr(io, "_fsync_file", lambda p: (synced.append(Path(p).name), real(p)))
    stage_shards(str(src), local_root=str(tmp_path / "local"), verify=False)
    assert {"heldout-00000.bin", "shard-00000.bin", "shard-00001.bin", "index.json"} <= set(synced)
