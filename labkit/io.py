"""Durable file writes and checksums: the one place labkit writes a file that must survive a crash.

Every artifact a later stage trusts (corpus parts, cleaned documents, tokenizer, shards and their
index, checkpoints, run configs and results, reports) is written the same way:

1. write to a temporary file in the destination's own directory (so the rename never crosses a
   file system);
2. flush and ``fsync`` the temporary file, so its bytes are on disk before its name is;
3. ``os.replace`` it onto the destination (atomic on POSIX: a reader sees the old file or the
   new one, never a half-written one);
4. ``fsync`` the directory, so the rename itself survives a power cut.

A crash at any point leaves either the old artifact or none, plus at worst a stray
``.NAME.*.tmp`` file that the next run ignores or removes. This is the pattern of SQLite's and
PostgreSQL's durable renames (fsync file, rename, fsync directory).

``sha256_file`` is the one checksum: shards, staged copies, tokenizer hashes and checkpoints
all use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_dir", "atomic_write", "atomic_write_bytes", "atomic_write_json", "atomic_write_npy",
           "atomic_write_text", "copy_and_hash", "fsync_dir", "fsync_tree", "replace", "sha256_bytes", "sha256_file"]

_CHUNK = 1 << 20


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that renames into it are durable (a no-op where the OS refuses)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    """A fresh temporary name beside ``path`` (same directory, hidden, unique)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(tmp)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` onto ``dst`` atomically (``os.replace``), then fsync ``dst``'s directory.

    ``src`` may be a file or a directory (a directory replaces only a missing or empty ``dst``,
    as ``os.replace`` does). The caller has made ``src``'s contents durable (``atomic_write``
    does that for files).
    """
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any], *, mode: int | None = None,
                 durable: bool = True) -> Path:
    """Call ``write(tmp)`` to fill a temporary file beside ``path``, fsync it, rename it onto ``path``.

    ``write`` receives the temporary path (a ``pathlib.Path``) and writes the whole file there,
    for example ``lambda p: frame.write_parquet(p)`` or ``lambda p: save_file(tensors, p)``.
    ``mode``: permission bits for the final file (default: what ``mkstemp`` gives, 0600, widened
    to 0644 so reports and shards are readable by the group). ``durable=False`` skips both fsyncs:
    the rename is still atomic (a reader sees the old file or the new one), but a power cut may
    lose it; for volatile state rewritten every second (``labkit.train.status``). On any error
    the temporary file is removed and the error re-raised; ``path`` is untouched. Returns ``path``
    as a Path.
    """
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        write(tmp)
        os.chmod(tmp, 0o644 if mode is None else mode)
        if durable:
            _fsync_file(tmp)
            replace(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes | bytearray | memoryview, *,
                       mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically and durably (see the module docstring)."""
    return atomic_write(path, lambda p: p.write_bytes(data), mode=mode)


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int | None = None, durable: bool = True) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically and (unless ``durable=False``) durably."""
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"), mode=mode, durable=durable)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, sort_keys: bool = False,
                      mode: int | None = None, durable: bool = True) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically and (unless ``durable=False``, see
    ``atomic_write``) durably; values JSON cannot hold are written with ``str`` (paths, numpy
    scalars, dtypes). A trailing newline ends the file."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, default=_json_default) + "\n"
    return atomic_write_text(path, text, mode=mode, durable=durable)


def _json_default(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        with contextlib.suppress(Exception):
            return item()
    return str(value)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temporary name beside ``path``; publish it only if the block ends.

    Yields the temporary directory. When the block finishes without an error, every file in it is
    fsynced and the directory is renamed onto ``path`` (which must not exist or be empty), then the
    parent directory is fsynced. On error the temporary directory is removed. Used for
    checkpoints and staged copies, where a set of files is complete only as a whole.
    """
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        fsync_tree(tmp)
        replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file under ``path`` and the directories holding them (before a rename publishes them)."""
    root = Path(path)
    for f in sorted(root.rglob("*")):
        if f.is_file():
            _fsync_file(f)
        elif f.is_dir():
            fsync_dir(f)
    fsync_dir(root)


def sha256_file(path: str | os.PathLike, *, chunk: int = _CHUNK,
                on_block: Callable[[bytes], Any] | None = None) -> str:
    """Hex SHA-256 of a file's bytes, read in ``chunk``-byte blocks (1 MiB; constant memory).
    ``on_block(block)`` sees every block too, so one read can also scan the data (the shard
    verifier checks the largest token id this way)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
            if on_block is not None:
                on_block(block)
    return h.hexdigest()


_buffers = threading.local()  # one reused read buffer per thread (copy_and_hash)


def copy_and_hash(src: str | os.PathLike, dst: str | os.PathLike, *, hashed: bool = True,
                  chunk: int = _CHUNK) -> tuple[int, str | None]:
    """Copy the file ``src`` to ``dst`` in one pass and return (bytes written, hex SHA-256 of
    those bytes, or None when not ``hashed``). Each block (``chunk`` bytes, 1 MiB) is read into a
    buffer the thread reuses, hashed and written from it, so the copy is read once: the hash is
    that of the bytes as written, the way rsync's whole-file checksum covers the data as it
    arrives, rather than a second read of the copy through the page cache (which returns the
    same pages). ``dst`` must not exist (``FileExistsError``); it is created with mode 0o666 less
    the umask, as ``shutil.copyfile`` does, and not fsynced. The reads, writes and the hash of
    blocks above 2 KiB release the GIL, so threads copy in parallel. Raises ``OSError`` from
    the system calls (ENOSPC when the disk fills; ``dst`` is then left partial for the caller
    to remove)."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) != chunk:
        buf = _buffers.buf = bytearray(chunk)
    view = memoryview(buf)
    h = hashlib.sha256() if hashed else None
    n = 0
    fd_in = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            while k := os.readv(fd_in, [buf]):
                block = view[:k]
                if h is not None:
                    h.update(block)
                done = 0
                while done < k:
                    done += os.write(fd_out, block[done:])
                n += k
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)
    return n, h.hexdigest() if h is not None else None


def atomic_write_npy(path: str | os.PathLike, array: Any) -> Path:
    """Write a NumPy array in .npy format to ``path`` atomically (``np.save`` on a path would add
    ".npy" to the temporary name)."""
    import numpy as np

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)

    return atomic_write(path, write)


def sha256_bytes(data: bytes | bytearray | memoryview) -> str:
    """Hex SHA-256 of an in-memory buffer."""
    return hashlib.sha256(data).hexdigest()
