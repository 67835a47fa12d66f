"""Local-filesystem blob store: write to tmp/, fsync the file, rename into place, fsync the directory.

The rename is atomic on POSIX, so a reader sees either no blob or the whole blob; the two
fsyncs make the bytes and the directory entry survive power loss before publish returns.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from lastgood.common import durable
from lastgood.common.durable import fsync_dir as _fsync_dir

from .base import READ_CHUNK, BlobInfo, BlobStore, BlobWriter, check_key
from .capabilities import AdoptsFiles, LendsLocalPaths, ReportsFreeSpace


BLOB_MODE = 0o444  # a published blob is never written again (a new version is a new key)


def _publish(store: "LocalBlobStore", fd: int, tmp: Path, dest: Path) -> None:
    """Make the file read-only, fsync it, rename it into place, fsync the blob's directory
    and every directory above it up to blobs/ whose own entry is not known durable (a
    concurrent publisher may have created one of them, and its entry must be durable before
    we acknowledge). Known durable: a directory of the same inode whose parent this store
    fsync'd after it existed (DurableDirs); a checkpoint's second and third blob (its tensor
    index, its manifest) then fsync only their own directory, its first its new folders.
    Read-only, because the spool lends readers hard links to blobs (domain/dataplane/spool.py),
    which share the blob's inode and mode."""
    os.fchmod(fd, BLOB_MODE)
    os.fsync(fd)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, dest)
    d, below = dest.parent, []
    while True:
        _fsync_dir(d)  # the new entry in it: the blob's, or that of the directory below
        if d == store.blob_dir or store.durable_dirs.known(d):
            break
        below.append((d, os.stat(d).st_ino))  # its entry is durable once its parent is fsync'd, next
        d = d.parent
    store.durable_dirs.add(below)


class DurableDirs:
    """Directories of the store whose entry in their parent is durable: each was seen (by
    inode) before its parent was fsync'd. A directory this store removes (delete) is
    forgotten; one removed and made again by another process is another inode, unless the
    file system hands out the same number again. Bounded: forgotten all at once past LIMIT (the
    next publishes fsync up the chain again)."""

    LIMIT = 65536

    def __init__(self) -> None:
        self._inodes: dict[Path, int] = {}

    def known(self, d: Path) -> bool:
        ino = self._inodes.get(d)
        if ino is None:
            return False
        try:
            return os.stat(d).st_ino == ino
        except OSError:
            return False

    def forget(self, d: Path) -> None:
        self._inodes.pop(d, None)

    def add(self, dirs: list[tuple[Path, int]]) -> None:
        if len(self._inodes) + len(dirs) > self.LIMIT:
            self._inodes = {}
        self._inodes.update(dirs)  # one dict update: atomic under the GIL, for publishers on many threads


class _LocalWriter(BlobWriter):
    def __init__(self, store: "LocalBlobStore", key: str) -> None:
        self._store = store
        self._dest = store._path(key)
        self._tmp = store.tmp_dir / f"{uuid.uuid4().hex}.part"
        self._f = open(self._tmp, "wb", buffering=0)
        self._writeback = durable.Writeback(self._f.fileno())
        self._done = False
        self._written = 0

    def write(self, data) -> None:
        start = self._written
        self._written += durable.write_all(self._f.fileno(), data)  # in pieces the page cache takes fast
        # the disk works while the next chunk arrives: publish's fsync finds little left to do
        self._writeback.start(start, self._written - start)

    def publish(self) -> None:
        _publish(self._store, self._f.fileno(), self._tmp, self._dest)
        self._writeback.close()
        self._f.close()
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._writeback.close()
            self._f.close()
        finally:
            self._tmp.unlink(missing_ok=True)


class _AdoptedWriter(BlobWriter):
    """A spooled file (domain/dataplane/spool.Taken) becomes the blob: its bytes are there already."""

    def __init__(self, store: "LocalBlobStore", key: str, taken) -> None:
        self._store, self._dest, self._taken = store, store._path(key), taken

    def write(self, data) -> None:
        pass  # the caller hashes the file through the same descriptor; nothing to copy

    def publish(self) -> None:
        st, fst = os.lstat(self._taken.path), os.fstat(self._taken.fd)
        if (st.st_ino, st.st_dev) != (fst.st_ino, fst.st_dev):
            raise RuntimeError(f"{self._taken.path} no longer names the file that was hashed")
        _publish(self._store, self._taken.fd, self._taken.path, self._dest)

    def abort(self) -> None:
        pass  # the file stays the caller's (Taken.close() removes it unless published)


BLOB_DIR = "blobs"  # under a local store's root: the published blobs (tmp/ holds the writers')


def key_path(root: str | os.PathLike, key: str) -> Path:
    """Where the local store rooted at `root` keeps the blob, or the folder of blobs, named
    `key`; without opening the store (opening it clears crashed writers' files)."""
    return Path(root).resolve() / BLOB_DIR / check_key(key)


class LocalBlobStore(BlobStore, AdoptsFiles, LendsLocalPaths, ReportsFreeSpace):
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).resolve()
        self.blob_dir = self.root / BLOB_DIR
        self.tmp_dir = self.root / "tmp"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self._rename_ok: dict[Path, bool] = {}
        self.durable_dirs = DurableDirs()  # _publish: ancestors whose entry needs no fsync again
        for stale in self.tmp_dir.glob("*.part"):  # writers of a process that crashed
            stale.unlink(missing_ok=True)

    def _path(self, key: str) -> Path:
        return self.blob_dir / check_key(key)

    def open_writer(self, key: str) -> BlobWriter:
        return _LocalWriter(self, key)

    def free_bytes(self) -> int | None:
        return shutil.disk_usage(self.blob_dir).free

    def local_path(self, key: str) -> Path | None:
        path = self._path(key)
        return path if path.is_file() else None

    def adopt_writer(self, key: str, taken) -> BlobWriter | None:
        """A taken spool file (domain/dataplane/spool.Taken) becomes the blob by rename, fsync'd like a
        written one, when its directory can rename into this store; else it is copied."""
        return _AdoptedWriter(self, key, taken) if self._renames_from(taken.path.parent) else None

    def adopts_from(self, directory: Path) -> bool:
        return self._renames_from(Path(directory))

    def _renames_from(self, directory: Path) -> bool:
        """Can a file in `directory` be renamed into this store? Same st_dev is not enough
        (two bind mounts of one file system): try it once per directory with an empty file."""
        if directory not in self._rename_ok:
            probe = directory / f".probe-{uuid.uuid4().hex}"
            probe.touch()
            try:
                os.rename(probe, self.tmp_dir / probe.name)
                (self.tmp_dir / probe.name).unlink()
                self._rename_ok[directory] = True
            except OSError:  # EXDEV
                probe.unlink(missing_ok=True)
                self._rename_ok[directory] = False
        return self._rename_ok[directory]

    def get(self, key: str, offset: int = 0, length: int | None = None) -> Iterator[bytes]:
        path = self._path(key)
        f = open(path, "rb")  # raises FileNotFoundError before the first yield is asked for
        return self._read(f, offset, length)

    @staticmethod
    def _read(f, offset: int, length: int | None) -> Iterator[bytes]:
        with f:
            f.seek(offset)
            left = length
            while left is None or left > 0:
                n = READ_CHUNK if left is None else min(READ_CHUNK, left)
                buf = f.read(n)
                if not buf:
                    return
                if left is not None:
                    left -= len(buf)
                yield buf

    def stat(self, key: str) -> BlobInfo | None:
        try:
            return BlobInfo(key, self._path(key).stat().st_size)
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        for dirpath, _dirs, files in os.walk(self.blob_dir):
            for name in files:
                p = Path(dirpath) / name
                key = p.relative_to(self.blob_dir).as_posix()
                if key.startswith(prefix):
                    yield BlobInfo(key, p.stat().st_size)

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # prune the directories this leaves empty, below the top level (ckpt/ stays)
        d = path.parent
        while d.parent != self.blob_dir and d != self.blob_dir:
            try:
                d.rmdir()
            except OSError:  # not empty, or already gone
                break
            self.durable_dirs.forget(d)  # made again, it is new: fsync'd up the chain (its inode may recur)
            d = d.parent
