"""A testing-only wrapper that makes a store's writes fail with EIO (LASTGOOD_FAILPOINT=blob_eio):
how the chaos tests show that a failing device reaches the trainer as UNAVAILABLE "I/O error
on ...", not as an internal error. Reads and everything else pass through."""

from __future__ import annotations

import errno
import os

from . import capabilities
from .base import BlobStore, BlobWriter
from .capabilities import AdoptsFiles, ReportsFreeSpace


class _FailingWriter(BlobWriter):
    def __init__(self, inner: BlobWriter, key: str) -> None:
        self.inner, self.key = inner, key

    def write(self, data) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), self.key)

    def publish(self) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), self.key)

    def abort(self) -> None:
        self.inner.abort()


class WriteEIO(BlobStore, AdoptsFiles, ReportsFreeSpace):
    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner

    def open_writer(self, key: str) -> BlobWriter:
        return _FailingWriter(self.inner.open_writer(key), key)

    def adopt_writer(self, key: str, taken):
        return None  # every hand-over goes through the failing writer

    def adopts_from(self, directory) -> bool:
        return False

    def free_bytes(self):
        return capabilities.free_bytes(self.inner)

    def get(self, key, offset=0, length=None):
        return self.inner.get(key, offset, length)

    def stat(self, key):
        return self.inner.stat(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, key):
        self.inner.delete(key)
