"""Durable file-system steps, torch-free: shared by the client's writers (the spool, export)
and the service's local blob store, so there is one way to make a rename survive a crash,
one way to get a large file to the disk soon, one way to keep it from filling the page
cache (DropBehind) and one way to read it back when the page cache does not hold it
(read_into)."""

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


def open_for_overwrite(path):
    """`path` opened unbuffered for writing from its start: an existing file (a recycled
    segment of the memory tier) is overwritten in place, its pages kept, and the writer
    truncates it to its size; else a new file is created."""
    try:
        return open(path, "r+b", buffering=0)
    except FileNotFoundError:
        return open(path, "wb", buffering=0)


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


DIRECT_BLOCK = 4096  # what O_DIRECT asks of a read's file offset, length and memory address (every Linux fs)
# a piece counts as cached, and is read through the page cache, when at least this share of its pages is
COLD_BELOW = 0.5
_LOW_BIT = bytes(i & 1 for i in range(256))


def cached_pieces(fd: int, offset: int, length: int, piece: int) -> "list[bool] | None":
    """For each `piece`-byte piece of the file's range [offset, offset + length): does the
    page cache hold (at least COLD_BELOW of) it now? mincore(2) on a shared map of the range
    with no access at all (PROT_NONE, as util-linux's fincore did): it shows the page cache's
    own pages, is never touched, and charges no memory (a private map would count against
    a strict overcommit limit). None where that cannot be asked (not Linux, an empty range,
    a file that cannot be mapped)."""
    import mmap

    page = mmap.PAGESIZE
    start = offset - offset % page
    try:
        size = min(offset + length, os.fstat(fd).st_size) - start  # a map past the end of the file: SIGBUS
    except OSError:
        return None
    if length <= 0 or size <= 0 or _mincore is None:
        return None
    addr = _map(None, size, _PROT_NONE, mmap.MAP_SHARED, fd, start)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        vec = (ctypes.c_ubyte * -(-size // page))()
        if _mincore(addr, size, vec) != 0:
            return None
        bits = bytes(vec).translate(_LOW_BIT)  # the low bit says resident; the others are reserved
    finally:
        _unmap(addr, size)
    out, pos = [], 0
    while pos < length:  # pages past the end of the file: not cached (their read finds the end)
        a, b = (offset + pos - start) // page, -(-(offset + min(pos + piece, length) - start) // page)
        held = bits[a:min(b, len(bits))]
        out.append(len(held) - held.count(0) >= COLD_BELOW * (b - a) and bool(held))
        pos += piece
    return out


def _libc_calls():
    """libc's mincore, mmap and munmap (Python's mmap module has no mincore, and its maps
    that export an address are writable, so private or shared-writable), or Nones."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mincore, map_, unmap = libc.mincore, libc.mmap, libc.munmap
    except (OSError, AttributeError):
        return None, None, None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    mincore.restype = ctypes.c_int
    map_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    map_.restype = ctypes.c_void_p
    unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    unmap.restype = ctypes.c_int
    return mincore, map_, unmap


_mincore, _map, _unmap = _libc_calls()
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE = 0  # Python's mmap module has no PROT_NONE; it is 0 on every Linux ABI


def read_into(fd: int, view: memoryview, offset: int, piece: int, hasher=None) -> int:
    """Read the file's bytes [offset, offset + len(view)) into `view` in `piece`-byte
    pieces (fewer at the end of the file), handing each to `hasher.update` as it lands;
    the bytes read. A piece the page cache holds is read through it; a piece it does not
    hold is read with O_DIRECT (the file opened again through /proc/self/fd), straight
    from the disk into `view`, or through one page-aligned bounce piece where `view` is not
    aligned; its unaligned tail, and every piece where O_DIRECT is refused, go through the
    page cache.

    Why: a file the page cache has dropped (a large spool file after DropBehind, or any
    checkpoint on a node that restarted) costs a fresh page-cache page per 4 KiB when read
    plainly, plus a copy from it. On this project's machine, 4 GiB read cold took 3.2-4.7 s
    plain and 1.5-1.7 s with O_DIRECT (docs/performance.md). Nothing depends on it: the
    bytes are the same either way and are verified by the caller's hash."""
    length = view.nbytes
    cached = cached_pieces(fd, offset, length, piece)
    direct = _Direct(fd, piece) if cached is not None and not all(cached) else None
    pos = 0
    try:
        while pos < length:
            k = min(piece, length - pos)
            got = direct.read(view[pos:pos + k], offset + pos) if direct and not cached[pos // piece] else None
            if got is None:
                got = os.preadv(fd, [view[pos:pos + k]], offset + pos)
            if got == 0:
                break
            if hasher is not None:
                hasher.update(view[pos:pos + got])
            pos += got
    finally:
        if direct is not None:
            direct.close()
    return pos


class _Direct:
    """O_DIRECT reads of one file, on a descriptor of its own."""

    def __init__(self, fd: int, piece: int) -> None:
        self.fd = -1
        self._bounce = None
        self._piece = piece
        if hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError:  # tmpfs, some FUSE and network file systems: no O_DIRECT
                pass

    def __bool__(self) -> bool:
        return self.fd >= 0

    def read(self, target: memoryview, offset: int) -> "int | None":
        """Read the DIRECT_BLOCK-aligned front of `target` from `offset`: the bytes read (0 at
        the end of the file; the whole front unless at the end), or None where this read
        cannot be direct (an unaligned offset, under one block): the caller reads it
        through the page cache. A file system that refuses O_DIRECT at read time turns it
        off for the rest of the file."""
        front = target.nbytes - target.nbytes % DIRECT_BLOCK
        if self.fd < 0 or offset % DIRECT_BLOCK or not front:
            return None
        try:
            if _address(target) % DIRECT_BLOCK == 0:
                return os.preadv(self.fd, [target[:front]], offset)
            if self._bounce is None:
                import mmap

                self._bounce = mmap.mmap(-1, self._piece)  # page-aligned
            got = os.preadv(self.fd, [memoryview(self._bounce)[:front]], offset)
            target[:got] = memoryview(self._bounce)[:got]
            return got
        except OSError:  # EINVAL: this file system takes O_DIRECT at open but not at read
            self.close()
            return None

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        if self._bounce is not None:
            self._bounce.close()
            self._bounce = None


def new_buffer(nbytes: int):
    """A new writable buffer of `nbytes` zero bytes to read a file into, page-aligned (so
    on a DIRECT_BLOCK boundary: read_into reads a cold file straight into it, not through
    a bounce piece): an anonymous map, whose pages are only touched as bytes land, where a
    bytearray would first be zero-filled; a bytearray when empty."""
    import mmap

    return mmap.mmap(-1, nbytes) if nbytes > 0 else bytearray()


def _address(view: memoryview) -> int:
    """The memory address of a writable view's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


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
