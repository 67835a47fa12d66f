"""lastgood.durable.start_writeback: a file written through it does not sit dirty in the page
cache until its fsync, and where the call cannot work it does nothing."""

from __future__ import annotations

import os
import time

import pytest

from lastgood import durable

MiB = 1 << 20


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
    return best[2] in ("tmpfs", "ramfs")


def write(path, early: bool, size: int = 256 * MiB) -> int:
    block = os.urandom(8 * MiB)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, size, len(block)):
            os.write(fd, block)
            if early:
                durable.start_writeback(fd, off, len(block))
    finally:
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
    os.sync()
    base = dirty_bytes()
    assert write(tmp_path / "plain.bin", early=False) - base >= 192 * MiB  # control
    os.sync()
    base = dirty_bytes()
    write(tmp_path / "early.bin", early=True)
    deadline = time.monotonic() + 10
    while dirty_bytes() - base > 64 * MiB and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dirty_bytes() - base <= 64 * MiB


def test_where_writeback_cannot_be_started_nothing_happens(tmp_path):
    r, w = os.pipe()
    try:
        os.write(w, b"x")
        durable.start_writeback(w, 0, 1)  # a pipe: ESPIPE
    finally:
        os.close(r)
        os.close(w)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)
    durable.start_writeback(fd, 0, 4096)  # closed: EBADF
    with open(tmp_path / "g", "wb") as f:
        f.write(b"y" * 10)
        f.flush()
        durable.start_writeback(f.fileno(), 0, 0)  # nothing to write
        durable.start_writeback(f.fileno(), 0, 10)
        os.fsync(f.fileno())
    assert (tmp_path / "g").read_bytes() == b"y" * 10
