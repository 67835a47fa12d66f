"""lastgood.common.durable: a file written through Writeback does not sit dirty in the page cache
until its fsync, where the call cannot work it does nothing, and a closed one never touches
its descriptor again; DropBehind keeps a file's head and drops the rest; read_into reads
what the page cache does not hold past it, with the same bytes."""

from __future__ import annotations

import mmap
import os
import threading
import time

import pytest

from lastgood.common import durable

MiB = 1 << 20
PAGE = mmap.PAGESIZE  # one page: what an unaligned tail, read through the page cache, leaves cached


def dirty_bytes() -> int:
    """Bytes the page cache still holds to write back, the whole machine's (Dirty + Writeback)."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields["Dirty"] + fields["Writeback"]


def on_tmpfs(path) -> bool:
    with open("/proc/mounts") as f:
        mounts = [line.split() for line in f]
    best = max((m for m in mounts if str(path).startswith(m[1].rstrip("/") + "/") or str(path) == m[1]),
               key=lambda m: len(m[1]))
    return best[2] in ("tmpfs", "ramfs", "overlay")  # overlay: sync_file_range reaches no pages


def write(path, early: bool, size: int = 256 * MiB) -> int:
    block = os.urandom(8 * MiB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    writeback = durable.Writeback(fd)
    try:
        for off in range(0, size, len(block)):
            os.write(fd, block)
            if early:
                writeback.start(off, len(block))
    finally:
        writeback.close()
        os.close(fd)
    return dirty_bytes()


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads Linux's /proc/meminfo")
def test_a_file_written_with_early_writeback_is_not_left_dirty(tmp_path):
    """256 MiB written piece by piece: with the writeback started after each piece, the
    machine's dirty backlog is back near where it was within seconds, long before any
    fsync. Control: the same file written plainly stays dirty (below the kernel's
    background threshold nothing writes it back for 30 s)."""
    if on_tmpfs(tmp_path):
        pytest.skip("tmpfs has no writeback to start")
    # the dirty backlog is the machine's: another process's heavy writes can cross the
    # kernel's background threshold and flush the control's pages too, so a trial whose
    # control was flushed is repeated; the early write must hold in every trial
    for trial in range(3):
        os.sync()
        base = dirty_bytes()
        t0 = time.monotonic()
        write(tmp_path / "early.bin", early=True)
        deadline = t0 + 10
        while dirty_bytes() - base > 64 * MiB and time.monotonic() < deadline:
            time.sleep(0.05)
        waited = time.monotonic() - t0
        assert dirty_bytes() - base <= 64 * MiB
        os.sync()
        base = dirty_bytes()
        t0 = time.monotonic()
        write(tmp_path / "plain.bin", early=False)
        time.sleep(max(0.0, waited - (time.monotonic() - t0)))  # control: as long as the early one took
        control = dirty_bytes() - base
        if control >= 192 * MiB:
            break
    assert control >= 192 * MiB, f"the plain write left {control} bytes dirty in three trials"


def test_where_writeback_cannot_be_started_nothing_happens(tmp_path):
    r, w = os.pipe()
    try:
        os.write(w, b"x")
        pipe = durable.Writeback(w)
        pipe.start(0, 1)  # a pipe: ESPIPE, on the thread
        pipe.close()
    finally:
        os.close(r)
        os.close(w)
    with open(tmp_path / "g", "wb") as f:
        f.write(b"y" * 10)
        f.flush()
        writeback = durable.Writeback(f.fileno())
        writeback.start(0, 0)  # nothing to write
        writeback.start(0, 10)
        writeback.close()
        os.fsync(f.fileno())
    assert (tmp_path / "g").read_bytes() == b"y" * 10


def test_a_closed_writeback_never_touches_its_descriptor_again(tmp_path, monkeypatch):
    """The writer closes its descriptor right after close(): a range still queued must not
    reach sync_file_range under a number the process may have given to another file."""
    calls, release, closed = [], threading.Event(), [False]

    def slow_sfr(fd, offset, length, flags):  # the first call waits, as one on a full device queue does
        calls.append((fd, offset, closed[0]))
        if offset == 0:
            release.wait(5)
        return 0

    monkeypatch.setattr(durable, "_sfr", slow_sfr)
    fd = os.open(tmp_path / "h", os.O_WRONLY | os.O_CREAT, 0o644)
    writeback = durable.Writeback(fd)
    writeback.start(0, 4096)
    for _ in range(500):  # the thread has taken the first range and is inside the call
        if calls:
            break
        time.sleep(0.01)
    for off in range(4096, 40 * 4096, 4096):
        writeback.start(off, 4096)  # queued behind it
    closing = threading.Thread(target=writeback.close)
    closing.start()
    time.sleep(0.1)
    assert closing.is_alive()  # close() waits for the call in flight ...
    release.set()
    closing.join(5)
    closed[0] = True
    os.close(fd)
    marker_fd = os.open(tmp_path / "h", os.O_RDONLY)  # a range queued behind the others: all are done then
    marker = durable.Writeback(marker_fd)
    marker.start(1, 1)
    for _ in range(500):
        if any(c[:2] == (marker_fd, 1) for c in calls):
            break
        time.sleep(0.01)
    marker.close()
    os.close(marker_fd)
    assert calls[0] == (fd, 0, False)
    assert not [c for c in calls if c[2] and c[1] != 1]  # ... and nothing of the closed one ran after it


def test_the_writeback_thread_outlives_a_failing_call(tmp_path, monkeypatch):
    """A call that raises (not only one that returns an error) must not end the one thread
    every writer of the process queues to."""
    calls = []

    def flaky_sfr(fd, offset, length, flags):
        calls.append(offset)
        if offset == 0:
            raise OSError("a call that fails")
        return 0

    monkeypatch.setattr(durable, "_sfr", flaky_sfr)
    fd = os.open(tmp_path / "k", os.O_WRONLY | os.O_CREAT, 0o644)
    writeback = durable.Writeback(fd)
    try:
        writeback.start(0, 4096)
        writeback.start(4096, 4096)
        for _ in range(500):
            if 4096 in calls:
                break
            time.sleep(0.01)
    finally:
        writeback.close()
        os.close(fd)
    assert calls == [0, 4096]


# ---------------------------------------------------------------------- DropBehind
def _cachestat():
    """cachestat(2) (Linux 6.5): how many of a range's pages the page cache holds, asked
    without mincore, so the tests of durable.cached_pieces do not check it against itself."""
    import ctypes
    import platform

    if platform.machine() not in ("x86_64", "aarch64"):  # 451 on both; not on older ABIs
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    class Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

    class Stat(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]

    def cached(fd: int, start: int, length: int) -> "int | None":
        st = Stat()
        if libc.syscall(451, fd, ctypes.byref(Range(start, length)), ctypes.byref(st), 0) != 0:
            return None  # ENOSYS: an older kernel
        return st.cache
    return cached


_CACHESTAT = _cachestat()


def resident(path, start: int, end: int) -> int:
    """Bytes of the file's range [start, end) the page cache holds now: cachestat(2) where
    the kernel has it, else durable.cached_pieces one page a piece."""
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        if _CACHESTAT is not None:
            lo = start - start % page
            pages = _CACHESTAT(fd, lo, end - lo)
            if pages is not None:
                return pages * page
        pieces = durable.cached_pieces(fd, start, end - start, page)
    finally:
        os.close(fd)
    assert pieces is not None, "neither cachestat(2) nor mincore(2) could be asked"
    return sum(pieces) * page


def write_dropping(path, keep, size: int = 96 * MiB, piece: int = 8 * MiB) -> bytes:
    """Write `size` random bytes in pieces, telling a DropBehind after each that all so far
    was read (as the service's follower does); returns the bytes."""
    data = os.urandom(size)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    behind = durable.DropBehind(fd, keep)
    try:
        for off in range(0, size, piece):
            os.write(fd, data[off:off + piece])
            behind.advance(off + piece)
    finally:
        os.close(fd)
    return data


needs_page_cache = pytest.mark.skipif(durable._sfr is None or not hasattr(os, "posix_fadvise"),
                                      reason="sync_file_range and posix_fadvise (Linux)")


@needs_page_cache
def test_drop_behind_keeps_the_head_and_the_lag_and_drops_the_rest(tmp_path):
    if on_tmpfs(tmp_path):
        pytest.skip("tmpfs pages are the file itself: never dropped")
    path, keep, size = tmp_path / "f.bin", 16 * MiB, 96 * MiB
    data = write_dropping(path, keep, size)
    dropped_until = size - durable.DROP_LAG  # the reader was at the end: what lies DROP_LAG behind it
    assert resident(path, 0, keep) == keep  # the head stays for a restore soon after
    assert resident(path, keep, dropped_until) == 0
    assert resident(path, dropped_until, size) == size - dropped_until
    assert path.read_bytes() == data  # a dropped page is read from the disk: nothing lost


@needs_page_cache
def test_without_a_limit_every_page_stays_cached(tmp_path):
    """The control: the same writes with a negative keep leave the whole file in the page cache."""
    if on_tmpfs(tmp_path):
        pytest.skip("tmpfs")
    path, size = tmp_path / "f.bin", 96 * MiB
    write_dropping(path, -1, size)
    assert resident(path, 0, size) == size


def test_where_dropping_is_not_possible_nothing_happens(tmp_path, monkeypatch):
    monkeypatch.setattr(durable, "_sfr", None)
    path = tmp_path / "f.bin"
    data = write_dropping(path, 0, 24 * MiB)
    assert path.read_bytes() == data


@needs_page_cache
def test_drop_behind_waits_on_a_descriptor_of_its_own_and_stops_at_an_error(tmp_path, monkeypatch):
    """A wait that meets a writeback error consumes it for the file it was called on; the
    waits must never run on the owner's descriptor, whose fsync has to report the error
    before the file is published. A failing wait stops the dropping and leaves the owner's
    descriptor open and working."""
    calls = []
    real = durable._sfr

    def recording(fd, offset, length, flags):
        calls.append((fd, flags))
        return real(fd, offset, length, flags)

    monkeypatch.setattr(durable, "_sfr", recording)
    fd = os.open(tmp_path / "f.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        behind = durable.DropBehind(fd, 0)
        os.write(fd, os.urandom(64 * MiB))
        behind.advance(64 * MiB)
        assert calls and all(c != fd for c, _ in calls)  # the waits ran on another descriptor
        monkeypatch.setattr(durable, "_sfr", lambda *a: -1)  # the next wait fails (as on EIO)
        os.write(fd, os.urandom(16 * MiB))
        behind.advance(80 * MiB)
        assert behind.fd == -1 and behind._own == -1  # stopped, its own descriptor closed
        behind.advance(96 * MiB)  # and nothing more is tried
        os.fsync(fd)  # the owner's descriptor is untouched
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- read_into
def write_file(path, size: int) -> bytes:
    data = os.urandom(size)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def drop(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_back(path, view, offset: int = 0, piece: int = 8 * MiB):
    from lastgood.wire.hashing import StreamHasher, hash_bytes

    hasher = StreamHasher()
    fd = os.open(path, os.O_RDONLY)
    try:
        got = durable.read_into(fd, view, offset, piece, hasher)
    finally:
        os.close(fd)
    return got, hasher.hexdigest(), hash_bytes


def aligned(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, nbytes))  # page-aligned


needs_direct = pytest.mark.skipif(durable._mincore is None or not hasattr(os, "O_DIRECT")
                                  or not hasattr(os, "posix_fadvise"), reason="mincore and O_DIRECT (Linux)")


@needs_direct
def test_a_file_the_page_cache_dropped_is_read_past_it_with_the_same_bytes(tmp_path):
    if on_tmpfs(tmp_path):
        pytest.skip("tmpfs pages are the file itself: never cold")
    size = 3 * 8 * MiB + 12345  # an unaligned tail, read through the page cache
    path = tmp_path / "cold.bin"
    data = write_file(path, size)
    drop(path)
    assert resident(path, 0, size) == 0
    view = aligned(size + 8192)
    got, digest, hash_bytes = read_back(path, view[:size])
    assert got == size and bytes(view[:size]) == data and digest == hash_bytes(data)
    # read straight from the disk: the file is no more cached than the tail's one page
    assert resident(path, 0, size) <= PAGE

    # the control: the same read through the page cache fills it
    drop(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.preadv(fd, [view[:size]], 0) == size
    finally:
        os.close(fd)
    assert resident(path, 0, size) >= size


@needs_direct
def test_cached_pieces_are_read_through_the_page_cache_and_cold_ones_past_it(tmp_path):
    if on_tmpfs(tmp_path):
        pytest.skip("tmpfs pages are the file itself: never cold")
    path, piece = tmp_path / "half.bin", 8 * MiB
    data = write_file(path, 4 * piece)
    drop(path)
    fd = os.open(path, os.O_RDONLY)
    try:  # pieces 0 and 2 in the page cache, 1 and 3 cold
        assert len(os.pread(fd, 4 * piece, 0)) == 4 * piece
        for cold in (1, 3):
            os.posix_fadvise(fd, cold * piece, piece, os.POSIX_FADV_DONTNEED)
        assert durable.cached_pieces(fd, 0, 4 * piece, piece) == [True, False, True, False]
    finally:
        os.close(fd)
    view = aligned(4 * piece)
    got, digest, hash_bytes = read_back(path, view, piece=piece)
    assert got == 4 * piece and bytes(view) == data and digest == hash_bytes(data)
    assert resident(path, 0, 4 * piece) == 2 * piece  # the cold half was not brought in


@needs_direct
def test_a_view_off_the_block_boundary_and_a_file_shorter_than_it(tmp_path):
    if on_tmpfs(tmp_path):
        pytest.skip("tmpfs pages are the file itself: never cold")
    path = tmp_path / "short.bin"
    data = write_file(path, 2 * 8 * MiB + 100)
    drop(path)
    whole = aligned(4 * 8 * MiB)
    view = whole[1:1 + 3 * 8 * MiB]  # not aligned: each cold piece goes through a bounce piece
    got, _, _ = read_back(path, view)
    assert got == len(data) and bytes(view[:got]) == data
    assert resident(path, 0, len(data)) <= PAGE
    drop(path)  # a range from the middle, at an offset off the block boundary (read_range)
    part = aligned(8 * MiB)
    got, _, _ = read_back(path, part, offset=8 * MiB + 7)
    assert got == 8 * MiB and bytes(part) == data[8 * MiB + 7:16 * MiB + 7]


def test_where_the_file_system_refuses_o_direct_the_page_cache_serves(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    data = write_file(path, 8 * MiB + 5)
    real_open, tried = os.open, []

    def no_direct(p, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            tried.append(p)
            raise OSError(22, "Invalid argument")  # as tmpfs answers
        return real_open(p, flags, *a)

    monkeypatch.setattr(durable.os, "open", no_direct)
    monkeypatch.setattr(durable, "cached_pieces", lambda fd, off, n, piece: [False] * -(-n // piece))
    view = aligned(len(data))
    got, digest, hash_bytes = read_back(path, view)
    assert got == len(data) and bytes(view) == data and digest == hash_bytes(data)
    assert len(tried) == 1  # it did ask, once for the file


@needs_direct
def test_where_o_direct_is_refused_at_read_time_the_rest_goes_through_the_page_cache(tmp_path, monkeypatch):
    """Some file systems open with O_DIRECT and answer EINVAL at the first read: that piece
    and every later one of the file are read through the page cache, with the same bytes."""
    if on_tmpfs(tmp_path):
        pytest.skip("tmpfs refuses O_DIRECT at open")
    import fcntl

    path, piece = tmp_path / "f.bin", 8 * MiB
    data = write_file(path, 3 * piece + 5)
    real_preadv, refused, plain = os.preadv, [], []

    def einval_if_direct(fd, buffers, offset, *a):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(22, "Invalid argument")
        plain.append(offset)
        return real_preadv(fd, buffers, offset, *a)

    monkeypatch.setattr(durable.os, "preadv", einval_if_direct)
    monkeypatch.setattr(durable, "cached_pieces", lambda fd, off, n, p: [False] * -(-n // p))
    view = aligned(len(data))
    got, digest, hash_bytes = read_back(path, view, piece=piece)
    assert got == len(data) and bytes(view) == data and digest == hash_bytes(data)
    assert refused == [0]  # asked once; the direct descriptor was closed after the refusal
    assert plain == [0, piece, 2 * piece, 3 * piece]


def test_a_buffer_made_to_read_into_starts_on_a_page():
    """read_file's own buffer (no `into`): page-aligned, so a cold file lands in it with
    O_DIRECT, not through a bounce piece; zero bytes until read into."""
    for n in (1, durable.DIRECT_BLOCK + 1, 8 * MiB):
        buf = durable.new_buffer(n)
        view = memoryview(buf)
        assert view.nbytes == n and not view.readonly and bytes(view[:16]) == bytes(min(n, 16)), n
        assert durable._address(view) % mmap.PAGESIZE == 0, n
        view.release()
    assert len(durable.new_buffer(0)) == 0
