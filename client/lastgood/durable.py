"""Durable file-system steps, torch-free: shared by the client's writers (the spool, export)
and the service's local blob store, so there is one way to make a rename survive a crash
and one way to get a large file to the disk soon."""

from __future__ import annotations

import ctypes
import os
import queue
import threading

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
# The most one write() hands the page cache (write_all). Why not more: the kernel backs a
# larger write with large folios (2 MiB and up), taken from the free lists' largest
# blocks, the very blocks a VM with free page reporting has handed back to its host; each
# then costs a host fault. Measured here, 1 GiB into the page cache: 8, 4 or 2 MiB writes
# took 0.6-1.5 s in 7-8 of 12 tries and 0.2 s in the others; 1 MiB writes 0.20-0.24 s
# in 24 of 24 (docs/performance.md). Elsewhere it costs 1,024 syscalls a GiB: a few ms.
WRITE_BYTES = 1 << 20


def fsync_dir(path) -> None:
    """fsync a directory: a rename or a new entry in it is durable only after this."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data) -> int:
    """Write all of `data` to `fd` in pieces of at most WRITE_BYTES; the bytes written."""
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        done += os.write(fd, view[done:done + WRITE_BYTES])
    return done


def _sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux (or no libc symbol): writeback starts when the kernel likes
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sfr = _sync_file_range()


class Writeback:
    """Starts writing a file's bytes to the disk as they are written, without waiting for
    it (Linux's sync_file_range(SYNC_FILE_RANGE_WRITE)), on a thread of its own. One per
    open descriptor: `start(offset, length)` after each piece, `close()` before the
    descriptor is closed.

    Why: a file written into the page cache is written back only once the kernel's dirty
    thresholds are passed, or by the final fsync. Until then the disk sits idle while the
    writer copies and hashes, and the fsync waits for the whole file. Started piece by
    piece, the disk works alongside the CPU and the fsync finds the bytes on the disk or
    on their way. Measured here: 1 GiB written in 8 MiB pieces, then fsync'd, median
    0.70 s plain against 0.47 s like this; a followed 1 GiB save 1.2 s without it against
    0.86 s with it (docs/performance.md).

    Why a thread: sync_file_range submits the I/O in its caller and blocks while the
    device's queue is full: about 0.14 s a GiB of the writer's own time here. On its own
    thread that overlaps the writer's copying: 4 GiB, 6 interleaved reps, save -> commit
    median 2.28 s against 2.52 s inline (4 files), 3.65 s against 4.74 s (1 file); at
    1 GiB the two were alike. The writer only queues the range; close() waits for at
    most the one call in flight on its descriptor, so the thread never touches a
    descriptor number after its file is closed.

    Never needed for correctness: fsync still makes the file durable. Where the call is
    unsupported (not Linux, tmpfs, a pipe), or fails, nothing happens."""

    __slots__ = ("fd", "_lock")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()

    def start(self, offset: int, length: int) -> None:
        if _sfr is not None and length > 0 and self.fd >= 0:
            _writeback_queue().put((self, offset, length))

    def close(self) -> None:
        with self._lock:  # a call in flight on this descriptor ends first
            self.fd = -1

    def _run(self, offset: int, length: int) -> None:
        with self._lock:
            if self.fd >= 0:
                _sfr(self.fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # an error (EINVAL, ESPIPE, EIO) is left to fsync


_WAIT_WRITE = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER: the range is on the disk after it
DROP_LAG = 32 << 20  # how far behind the reader's position drop-behind keeps the page cache


class DropBehind:
    """Keeps a large file from taking its whole size in page-cache pages while it is
    written: beyond its first `keep` bytes, each range the file's one reader has read (the
    service's hash of a followed spool file) is waited for on the disk and dropped from the
    page cache (POSIX_FADV_DONTNEED) once it lies DROP_LAG behind that reader, so the file
    recycles a few tens of MiB of page cache instead of taking a page per byte. `advance(pos)`
    after bytes [0, pos) have been read; a negative `keep` never drops.

    Why: on this project's machine, a VM that hands memory freed a while ago back to its
    host, taking 4 GiB of fresh page-cache pages is what bounds a 4 GiB save, not the disk:
    4 GiB written plain took 7.6 s, the same with drop-behind 2.1 s, while at 1 GiB plain
    wins, 0.42 s against 0.55 s (bench/pagecache.py, docs/performance.md). On any host it
    keeps a checkpoint from evicting the training's own cached data and bounds its dirty
    pages. The first `keep` bytes stay cached, so a restore on the same host soon after
    still reads most of a moderate file from memory.

    Never needed for correctness: the fsync still makes the file durable, and a page
    dropped is read from the disk when asked for. The waits run on a descriptor of their
    own (the file opened again through /proc/self/fd): a wait that meets a writeback error
    consumes it for its own open file only (Linux's per-file error cursor), so the owner's
    fsync on `fd` still reports it and the file is never published as durable. Where the
    calls are unsupported or fail, nothing more is dropped. `close()` when done."""

    __slots__ = ("fd", "done", "_own")

    def __init__(self, fd: int, keep: int) -> None:
        usable = keep >= 0 and _sfr is not None and hasattr(os, "posix_fadvise")
        self.fd = fd if usable else -1
        self.done = -(-max(keep, 0) // WRITE_BYTES) * WRITE_BYTES  # bytes [keep, done) are dropped
        self._own = -1

    def advance(self, pos: int) -> None:
        upto = (pos - DROP_LAG) & ~(WRITE_BYTES - 1)
        if self.fd < 0 or upto <= self.done:
            return
        try:
            if self._own < 0:
                self._own = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
            if _sfr(self._own, self.done, upto - self.done, _WAIT_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "sync_file_range")
            os.posix_fadvise(self._own, self.done, upto - self.done, os.POSIX_FADV_DONTNEED)
        except OSError:  # the owner's fsync reports what matters; nothing more is dropped
            self.close()
            self.fd = -1
            return
        self.done = upto

    def close(self) -> None:
        own, self._own = self._own, -1
        if own >= 0:
            os.close(own)


_queue: "queue.SimpleQueue | None" = None
_queue_lock = threading.Lock()


def _writeback_queue() -> "queue.SimpleQueue":
    global _queue
    with _queue_lock:
        if _queue is None:
            _queue = queue.SimpleQueue()
            threading.Thread(target=_writeback, args=(_queue,), name="lastgood-writeback", daemon=True).start()
        return _queue


def _writeback(q: "queue.SimpleQueue") -> None:
    while True:
        writer, offset, length = q.get()
        try:
            writer._run(offset, length)
        except Exception:  # noqa: BLE001 - never needed for correctness; the thread must outlive any one call
            pass


def _forked() -> None:  # the thread does not exist in a forked child: it starts its own when asked
    global _queue, _queue_lock
    _queue, _queue_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
