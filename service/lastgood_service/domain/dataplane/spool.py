"""The spool: a same-host hand-over of shard files, instead of streaming them over a socket.

A trainer on the service's own host writes its shard into the spool directory and sends
only the header (with `spool_file` and the spool's id). The service *takes* the file: it
renames it to a name of its own choosing in `.taken/` (a second request naming the same
file finds nothing), checks with lstat that it is a regular file with one link, owned by
the service's user, of the declared size (no larger, for a file its writer is still
writing: Followed), and opens it without following links and without blocking (a FIFO
swapped in between is refused, never waited on). From then on
the file is handled through that descriptor: hashed, fsync'd, and - on a local blob store
on the same file system - renamed into place as the blob only if the path still names the
same inode. Every byte published was hashed from the descriptor by the service.

Trust: the directory is the service user's (mode 0700, checked at start), so only that
user's processes (and root) can put files there; a file owned by anyone else is declined.

A file handed over is immutable from then on: the service takes it only when no process
holds it open for writing (`Taken.require_no_writer`, a read lease the kernel grants only
then: a descriptor or a shared writable mapping its writer kept is refused, SpoolRefused,
and the client streams the bytes instead), it was renamed where its writer's path no longer
names it, and it is published read-only (0444): a writer with no descriptor left can
change it only by finding it in the store and chmod-ing it. Why a lease and not a re-check
at the vote (size, mtime, ctime): a change through a kept descriptor is then refused before
the service reads a byte, with no window between a check and the commit, and with no state
to keep until the vote. A file system that grants no leases (NFS: EINVAL) cannot tell the
service about a writer, least of all one on another host; there the hash (service mode)
or the peer's read-back (peer mode), both after the take, is what checks the bytes, and a
change after those is caught by every restore's and verify's hash.

A client that cannot read the id file in the directory - another user, another container,
another host behind the same load balancer - streams. The id, random per spool directory,
tells a client that the directory it sees is the one this service reads. Every refusal
that is about the hand-over itself is FAILED_PRECONDITION starting "spool:", with its own
error code: SpoolNotShared for another spool's id (the client streams from then on),
SpoolRefused for a file that is not there or is someone else's (it streams that shard).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lastgood.common import durable
from lastgood.wire import names
from lastgood.wire.info import SpoolOffer

from ..errors import InvalidArgument, SpoolNotShared, SpoolRefused


class Taken:
    """A spool file the service took over: its path in `.taken/` and an open descriptor."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path, self.fd, self.size = path, fd, size
        self._buf: memoryview | None = None

    def chunks(self, chunk: int, start: int = 0, end: int | None = None) -> Iterator[memoryview]:
        """The file's bytes [start, end) (to its end by default) through the descriptor, in
        pieces of at most `chunk`, through one reused buffer: a consumer that keeps a piece
        must copy it. A file that ends before `end` ends the pieces early."""
        if self._buf is None or self._buf.nbytes != chunk:  # one buffer for all of a followed file's ranges
            self._buf = memoryview(bytearray(chunk))
        view = self._buf
        pos = start
        while end is None or pos < end:
            n = os.preadv(self.fd, [view if end is None else view[:min(chunk, end - pos)]], pos)
            if not n:
                return
            pos += n
            yield view[:n]

    def size_now(self) -> int:
        return os.fstat(self.fd).st_size

    def require_no_writer(self, name: str) -> bool:
        """Refuse the file (SpoolRefused) while any process on this host holds it open for
        writing: the kernel grants a read lease only when none does (fcntl(2), F_SETLEASE),
        a descriptor or a shared writable mapping kept by its writer included. The lease is
        released at once: it is a probe, not a hold (a held one would signal this process
        when the file is opened for writing). False when the file system grants no leases
        (NFS, some FUSE: it cannot tell)."""
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EBUSY):
                raise SpoolRefused(f"spool: {name} is still open for writing (a descriptor or a writable mapping "
                                   f"of it is kept); close it before handing it over, or stream the shard") from None
            return False  # EINVAL, ENOLCK, EACCES: no leases here
        fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True

    def close(self) -> None:
        """Close the descriptor and remove the file unless it was published (renamed away)."""
        try:
            os.close(self.fd)
        finally:
            self.path.unlink(missing_ok=True)


class Followed:
    """A spooled file its writer is still writing (a followed hand-over, ShardHeader.follow):
    its bytes, read behind the writer as it reports them written.

    Why: handed over only once written, a file is hashed by the service after the writer
    is done, while the disk is idle, and its fsync waits for all of it; followed, the
    service hashes each range a moment after it is written, while it is still in the
    page cache, the writer's early writeback (lastgood.common.durable) keeps the disk busy, and
    the hand-over ends a few milliseconds after the last byte instead of a whole re-read
    later (docs/performance.md). The trust is the spool's: the writer is the service's own
    user, trusted not to change bytes it has reported, and a later change is caught by
    every restore's and verify's hash.

    `reports` yields (written, xxh3_128) pairs in the order the writer sent them:
    `written` never goes back and never beyond the declared size; the last pair carries
    the writer's hash of the whole file (else ""), reports the whole file, and comes after
    the writer closed it. `digest` is that hash once `chunks()` has yielded every byte."""

    def __init__(self, taken: Taken, reports: Iterator[tuple[int, str]], name: str,
                 cache_bytes: int = -1) -> None:
        """`cache_bytes`: beyond this many first bytes, what has been hashed is dropped from
        the page cache once on the disk (lastgood.common.durable.DropBehind; negative: never)."""
        self.taken, self.reports, self.name = taken, reports, name
        self.digest: str | None = None
        self._behind = durable.DropBehind(taken.fd, cache_bytes)

    def chunks(self, chunk: int) -> Iterator[memoryview]:
        try:
            yield from self._chunks(chunk)
        finally:
            self._behind.close()

    def _chunks(self, chunk: int) -> Iterator[memoryview]:
        pos, size = 0, self.taken.size
        for written, digest in self.reports:
            if not pos <= written <= size:
                raise InvalidArgument(f"followed hand-over of {self.name}: written went from {pos} to {written} "
                                      f"(declared size {size})")
            for piece in self.taken.chunks(chunk, pos, written):
                pos += piece.nbytes
                yield piece
            self._behind.advance(pos)  # every byte before pos is hashed now
            if pos != written:
                raise InvalidArgument(f"followed hand-over of {self.name}: {written} bytes reported written, "
                                      f"the file holds {pos}")
            if digest:
                if written != size:
                    raise InvalidArgument(f"followed hand-over of {self.name}: the last message reports {written} "
                                          f"of the declared {size} bytes")
                if next(self.reports, None) is not None:
                    raise InvalidArgument(f"followed hand-over of {self.name}: a message after the last")
                if self.taken.size_now() != size:
                    raise InvalidArgument(f"followed hand-over of {self.name}: the file holds "
                                          f"{self.taken.size_now()} bytes, the header declares {size}")
                self.taken.require_no_writer(self.name)  # its writer closed it before the last message
                self.digest = digest
                return
        raise InvalidArgument(f"followed hand-over of {self.name} ended after {pos} of {size} bytes, "
                              f"without its last message")


class Spool:
    def __init__(self, directory: Path, follow: Callable[[Path], bool] | None = None) -> None:
        """`follow(taken_dir)`: can the blob store adopt files from there? Then the spool
        offers followed hand-overs (Followed; GET /api/v1/info: spool.follow)."""
        self.dir = Path(directory).resolve()
        self.taken_dir = self.dir / ".taken"
        self.out_dir = self.dir / names.SPOOL_OUT_DIR
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.taken_dir.mkdir(mode=0o700, exist_ok=True)
        self.out_dir.mkdir(mode=0o700, exist_ok=True)
        for d in (self.dir, self.taken_dir, self.out_dir):
            st = d.stat()
            if st.st_uid != os.geteuid():
                raise PermissionError(f"spool directory {d} belongs to uid {st.st_uid}, not to this service")
            if st.st_mode & 0o077:
                os.chmod(d, 0o700)  # ours: only this user may hand files over
        id_file = self.dir / names.SPOOL_ID_FILE
        if not id_file.exists():
            tmp = self.dir / f"{names.SPOOL_ID_FILE}.{secrets.token_hex(4)}.tmp"
            tmp.write_text(secrets.token_hex(16))
            os.replace(tmp, id_file)
        self.id = id_file.read_text().strip()
        for stale in self.taken_dir.iterdir():  # taken by a process that died before publishing
            _remove(stale)
        self.sweep_lent(0)
        self.follow = bool(follow and follow(self.taken_dir))

    def info(self) -> SpoolOffer:
        return SpoolOffer(dir=str(self.dir), id=self.id, follow=self.follow)

    def take(self, name: str, spool_id: str, size: int, growing: bool = False) -> Taken:
        """Move the client's file out of its reach and check it; the caller owns the result
        and must close() it. `growing`: its writer is still writing it (Followed), so it
        may hold fewer bytes than `size` yet, never more."""
        if spool_id != self.id:
            raise SpoolNotShared("spool: the header names another spool (another host or data directory); "
                                     "stream the shard instead")
        if not names.is_spool_name(name):
            raise InvalidArgument(f"spool_file must be 32 hex digits + '.part', got {name[:80]!r}")
        taken = self.taken_dir / names.new_spool_name()
        try:
            os.rename(self.dir / name, taken)  # atomic; a symlink moves as a link and is refused below
        except FileNotFoundError:
            raise SpoolRefused(f"spool: {name} is not in the spool (taken already, or swept); "
                                     f"stream the shard instead") from None
        try:
            st = os.lstat(taken)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise InvalidArgument(f"spool_file {name} is not a regular file with one link")
            if st.st_uid != os.geteuid():
                raise SpoolRefused(f"spool: {name} belongs to uid {st.st_uid}, not to the service's user; "
                                         f"stream the shard instead")
            try:
                fd = os.open(taken, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                raise InvalidArgument(f"spool_file {name} is not a regular file") from None
            st2 = os.fstat(fd)
            if (st2.st_ino, st2.st_dev) != (st.st_ino, st.st_dev) or not stat.S_ISREG(st2.st_mode):
                os.close(fd)
                raise InvalidArgument(f"spool_file {name} changed while it was taken")
        except BaseException:
            _remove(taken)
            raise
        if st2.st_size > size or (st2.st_size != size and not growing):
            Taken(taken, fd, st2.st_size).close()
            raise InvalidArgument(f"spool_file {name} holds {st2.st_size} bytes, the header declares {size}")
        t = Taken(taken, fd, size)
        if not growing:  # a followed file's writer writes on: checked after its last message (Followed)
            try:
                t.require_no_writer(name)
            except BaseException:
                t.close()
                raise
        return t

    def lend(self, blob: Path) -> str | None:
        """A read-only hard link to a blob for a reader on this host (the read direction of
        the hand-over): its name relative to the spool, or None when no link can be made
        (the blob is elsewhere, on another file system, or in an object store).

        A hard link is the blob's own inode, so its mode is the blob's: the local store
        publishes blobs read-only (0444), and a blob published before it did so is made
        read-only here - the blob itself, which nothing writes after publishing anyway."""
        name = names.new_lent_name(time.time())
        link = self.out_dir / name
        try:
            os.link(blob, link)
            mode = stat.S_IMODE(os.lstat(link).st_mode)
            if mode & 0o222:
                os.chmod(link, mode & ~0o222)
        except OSError:
            link.unlink(missing_ok=True)
            return None
        return f"{names.SPOOL_OUT_DIR}/{name}"

    def sweep_lent(self, max_age_seconds: float) -> int:
        """Remove links whose reader did not remove them (it died) older than max_age, aged
        by the time in their name (names.new_lent_name), not by the inode's ctime: that is
        the blob's, moved by every later link of it, so a link lent again and again would
        never age. A name that holds no past time (not ours) falls back to the ctime."""
        now, n = time.time(), 0
        for p in self.out_dir.iterdir():
            try:
                made = names.lent_at(p.name)
                if made is None or made > now + 60:
                    made = p.lstat().st_ctime
                if now - made >= max_age_seconds:
                    _remove(p)
                    n += 1
            except FileNotFoundError:
                pass
        return n

    def sweep(self, max_age_seconds: float) -> int:
        """Remove client files never handed over (their writer died) older than max_age."""
        now, n = time.time(), 0
        for p in self.dir.iterdir():
            if p.name.startswith(".") or not names.is_spool_name(p.name):
                continue
            try:
                if now - p.lstat().st_mtime > max_age_seconds:
                    _remove(p)
                    n += 1
            except FileNotFoundError:
                pass
        return n


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
