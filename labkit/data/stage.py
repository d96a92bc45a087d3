"""Copy a complete shard set to a node's local disk and verify it (lesson 2 of arXiv:2509.05258).

``stage_shards`` runs once per node (one engine per host). A copy is keyed by content: its name
ends in the first 12 hex digits of the sha256 of the source's ``index.json``, which lists every
file's sha256 (``labkit.data.shards.load_index``). The copy goes to a temporary
directory ``<local_root>/.tmp-<name>-<pid>`` beside the destination, every shard and the
held-out file (``labkit.data.heldout``) is checked against the source ``index.json`` (size, and
sha256 when ``verify``: each file is read once and hashed as it is written,
``labkit.io.copy_and_hash``), index.json is copied last (and must hash as the source's did),
and the directory is renamed into place. So the destination either does not exist or holds a
complete, verified set; an interrupted copy leaves only a ``.tmp-`` directory, which a later
call removes once its process is gone (so ``local_root`` must be node-local: process ids are
checked on this node). A verified copy already in place is kept. Pattern:
mosaicml/streaming ``streaming/base/stream.py`` (temp name + rename, hashes from the index).

Durability, the same for the shards and the held-out file: with ``verify`` they are not
fsynced before the rename. A copy is a cache of the source, and every verifying call re-hashes
every file of a copy (shards and held-out file) before it keeps it, so a copy torn by a
crash (short or stale blocks) is found and replaced; forcing the copy to disk was the largest
cost of staging after the hash (docs/data_path.md, "Staging": the profile and
``benchmarks/bench_stage.py``; ``cp -r`` + ``sha256sum`` do not fsync either), and one fsync
per file grows with the file count. Without ``verify`` a later call checks every file's size
only, so the copy is fsynced (``labkit.io.fsync_tree``) before it is published. The rename itself is always made durable
(``labkit.io.replace`` fsyncs the parent directory).
"""

from __future__ import annotations

import errno
import getpass
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from labkit import env
from labkit.data.shards import INDEX_NAME, ShardError, load_index, verify_shards
from labkit.env import SCRATCH_ENV
from labkit.io import copy_and_hash, fsync_tree, replace, sha256_file

__all__ = ["copy_workers", "resolve_local_root", "stage_shards"]


def resolve_local_root(local_root: str | None = None) -> Path:
    """Node-local scratch root: ``local_root`` as given, else ``$LABKIT_LOCAL_SCRATCH``, else
    ``$TMPDIR``, else ``/tmp``, with ``labkit-<user>`` appended to the latter three. Read when
    called, on the node that will hold the copy. Nothing is created."""
    if local_root is not None:
        return Path(local_root).expanduser()
    base = os.environ.get(SCRATCH_ENV) or os.environ.get("TMPDIR") or "/tmp"
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        user = str(os.getuid())
    return Path(base).expanduser() / f"labkit-{user}"


def _set_bytes(src: Path, index: dict) -> int:
    held = sum(s["n_bytes"] for s in (index.get("heldout") or {}).get("shards", []))
    return index["n_bytes"] + held + (src / INDEX_NAME).stat().st_size


def _files(index: dict) -> list[dict]:
    """The index entries of every file a copy holds: the shards, then the held-out file."""
    return index["shards"] + (index.get("heldout") or {}).get("shards", [])


def _copy_is_good(dst: Path, sha256: str, verify: bool) -> bool:
    """True when ``dst`` holds the source's index (the same bytes: ``sha256``) and its files check
    out: every shard and the held-out file of the index's size, and with ``verify`` of its
    sha256 (``verify_shards`` for the shards, ``labkit.io.sha256_file`` for the held-out file)."""
    try:
        index, sha = load_index(dst)
        if sha != sha256:
            return False
        if verify:
            verify_shards(dst)
        for s in _files(index):
            path = dst / s["file"]
            if path.stat().st_size != s["n_bytes"]:
                return False
            if verify and s not in index["shards"] and sha256_file(path) != s["sha256"]:
                return False
    except (ShardError, OSError):
        return False
    return True


def copy_workers(n_files: int) -> int:
    """Threads that copy and hash shards at once: one per usable CPU (``sched_getaffinity``), at
    most 4 and at most ``n_files``. The reads, writes and sha256 (OpenSSL) release the GIL."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cpus, n_files))


def _copy_one(src: Path, tmp: Path, shard: dict, verify: bool) -> None:
    """Copy one shard into ``tmp`` in one pass (``labkit.io.copy_and_hash``: read once, hashed
    as written) and check the bytes written and, with ``verify``, their sha256 against the
    index entry ``shard``."""
    size, digest = copy_and_hash(src / shard["file"], tmp / shard["file"], hashed=verify)
    if size != shard["n_bytes"]:
        raise ShardError(f"{src / shard['file']}: copied {size} bytes, index says {shard['n_bytes']}")
    if verify and digest != shard["sha256"]:
        raise ShardError(f"{src / shard['file']}: copy has sha256 {digest}, index says {shard['sha256']}")


def _copy_shards(src: Path, tmp: Path, shards: list[dict], *, verify: bool, where: str, n_bytes: int,
                 dst: Path) -> None:
    """Copy and check ``shards`` on ``copy_workers`` threads; the first failure in shard order is
    raised (the others are cancelled or finish), a full disk as ``OSError`` (ENOSPC) naming the
    bytes of the shards before the failed one."""
    with ThreadPoolExecutor(copy_workers(len(shards))) as pool:
        futures = [pool.submit(_copy_one, src, tmp, shard, verify) for shard in shards]
        copied = 0
        try:
            for shard, future in zip(shards, futures):
                try:
                    future.result()
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    raise OSError(errno.ENOSPC, f"disk full while staging {where}: {copied} of {n_bytes} "
                                                f"bytes copied when {shard['file']} failed; the partial copy was "
                                                f"removed and {dst} was left as it was"
                                  + ("" if dst.exists() else " (absent)")) from e
                copied += shard["n_bytes"]
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _make_durable(tmp: Path, verify: bool) -> None:
    """Before the rename: fsync the copy's files and directory only when the copy will not be
    re-hashed before reuse (``verify`` False); see the module docstring."""
    if not verify:
        fsync_tree(tmp)


def _remove_stale_tmp(root: Path, name: str) -> None:
    """Remove ``.tmp-<name>-<pid>`` / ``.old-<name>-<pid>`` dirs left by processes that are gone."""
    for prefix in (".tmp-", ".old-"):
        for path in root.glob(f"{prefix}{name}-*"):
            pid = path.name.rsplit("-", 1)[-1]
            if not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)
                alive = int(pid) != os.getpid()  # our own leftovers are from a failed earlier call
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
            if not alive:
                shutil.rmtree(path, ignore_errors=True)


def stage_shards(src_dir: str, *, local_root: str | None = None, node_name: str | None = None,
                 verify: bool = True) -> dict:
    """Copy the complete shard set ``src_dir`` to ``<local_root>/<basename(src_dir)>-<sha12>``
    (sha12 = first 12 hex digits of the sha256 of its ``index.json``: ``labkit.data.shards.load_index``;
    the index lists every file's sha256, so two sets share a copy only when their contents are
    equal, and two sets in same-named folders -- a sequence-length sweep with one tokenizer --
    never evict each other's) and return
    {"node": node_name or $LABKIT_NODE_NAME or hostname, "path": destination (str),
    "copied": False when a good copy was already there, "bytes": size of the set (shards,
    held-out file and index.json), "seconds": wall time of this call, "mb_per_s": bytes / 1e6 / seconds (the copy
    rate, or the verification rate when nothing was copied)}.

    ``local_root`` as in ``resolve_local_root``; ``node_name`` only labels the report (to
    simulate several nodes on one machine, give each its own local_root, or its engine its own
    $LABKIT_LOCAL_SCRATCH and $LABKIT_NODE_NAME: ``labkit.cluster.set_local_roots``). A destination that fails
    verification is replaced, but only after the new copy has verified.
    Raises ``ShardError`` when ``src_dir`` is not a complete set or a copied shard does not
    match the index (naming the shard), ``OSError`` (ENOSPC) naming needed and free bytes when
    the local disk is too small, and ``OSError`` (ENOSPC) naming the set, the bytes copied and
    the kept destination when the disk fills during the copy (the temporary copy is removed; an
    existing copy is never touched before the new one has verified).
    """
    t0 = time.perf_counter()
    src = Path(src_dir)
    index, index_sha = load_index(src)
    root = resolve_local_root(local_root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"{src.resolve().name}-{index_sha[:12]}"  # keyed by content: the index lists every file's sha256
    dst = root / name
    n_bytes = _set_bytes(src, index)
    node = node_name or env.node_name()

    def report(copied: bool) -> dict:
        seconds = time.perf_counter() - t0
        return {"node": node, "path": str(dst), "copied": copied, "bytes": n_bytes, "seconds": seconds,
                "mb_per_s": n_bytes / 1e6 / seconds if seconds > 0 else float("inf")}

    _remove_stale_tmp(root, name)
    if dst.exists() and _copy_is_good(dst, index_sha, verify):
        return report(False)

    free = shutil.disk_usage(root).free
    if n_bytes > free:
        raise OSError(errno.ENOSPC, f"not enough free space in {root} to stage {src}: "
                                    f"need {n_bytes} bytes, {free} bytes free")
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _copy_shards(src, tmp, _files(index),  # the held-out file too: copied and checked as a shard
                     verify=verify, where=f"{src} into {root}", n_bytes=n_bytes, dst=dst)
        shutil.copyfile(src / INDEX_NAME, tmp / INDEX_NAME)
        if load_index(tmp)[1] != index_sha:
            raise ShardError(f"{src / INDEX_NAME}: changed while it was being staged")
        if dst.exists():  # a bad copy: move it aside only now that the new one verified
            old = root / f".old-{name}-{os.getpid()}"
            _make_durable(tmp, verify)
            replace(dst, old)
            replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                _make_durable(tmp, verify)
                replace(tmp, dst)
            except OSError:  # another process on this node staged the same set meanwhile
                if not _copy_is_good(dst, index_sha, verify):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
                return report(False)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report(True)
