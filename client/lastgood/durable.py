"""Durable file-system steps, torch-free: shared by the client's writers (the spool, export)
and the service's local blob store, so there is one way to make a rename survive a crash
and one way to get a large file to the disk soon."""

from __future__ import annotations

import ctypes
import os

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


def fsync_dir(path) -> None:
    """fsync a directory: a rename or a new entry in it is durable only after this."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux (or no libc symbol): writeback starts when the kernel likes
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sfr = _sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing bytes [offset, offset + length) of `fd` to the disk now, without waiting
    for it (Linux's sync_file_range(SYNC_FILE_RANGE_WRITE)).

    Why: a file written into the page cache is written back only once the kernel's dirty
    thresholds are passed, or by the final fsync. Until then the disk sits idle while the
    writer copies and hashes, and the fsync waits for the whole file. Started piece by
    piece as a file is written, the disk works alongside the CPU, and the fsync finds the
    bytes on the disk or on their way. Measured here: 4 GiB in four files, hashed and
    written, then fsync'd, median 1.40 s plain against 1.22 s like this (docs/performance.md).

    Never needed for correctness: fsync still makes the file durable. Where the call is
    unsupported (not Linux, tmpfs, a pipe), or fails, nothing happens."""
    if _sfr is not None and length > 0:
        _sfr(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # an error (EINVAL, ESPIPE, EIO) is left to fsync
