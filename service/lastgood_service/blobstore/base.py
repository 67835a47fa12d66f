"""The one BlobStore interface every backend implements.

Protocol (the service relies on each step):
  1. `open_writer(key)` returns a BlobWriter onto a temporary, invisible object that will
     become `key` (local writes a temp file; S3 buffers one part, then uploads parts of a
     multipart upload for the key).
  2. `write(buf)` appends bytes; nothing is visible yet. A writer holds at most a bounded
     buffer in memory, never the whole blob (memory:// excepted: it is all memory).
  3. `publish()` makes the bytes durable and visible under the key atomically: after it
     returns, a crash cannot lose them, and no reader ever sees a partial blob. Publishing
     the same bytes twice under one key is harmless (keys derive from ids and hashes).
  4. `abort()` discards the temporary object (S3: aborts the multipart upload); it is safe
     after a failed write or publish, and after publish it does nothing. Use the writer
     as a context manager: leaving the block by an exception aborts. (S3 also aborts by
     itself when a write or publish fails.)
Readers: `get(key, offset, length)` yields the bytes of [offset, offset+length) clipped to
the blob, in chunks of at most READ_CHUNK bytes (empty past the end); a missing key raises
FileNotFoundError from the call itself, before any chunk is asked for. `stat` returns
size or None; `list(prefix)` walks keys (in no promised order); `delete` is idempotent.

Keys are produced by the service from ids and hashes, never from user strings; stores
still refuse keys that could escape their namespace.

What only some stores can do (adopt a spooled file, lend a blob as a local file, tell
their free space) is not part of this interface: blobstore/capabilities.py.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterator
from dataclasses import dataclass

_KEY = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*$")
READ_CHUNK = 4 * 1024 * 1024


def check_key(key: str) -> str:
    if not _KEY.match(key) or ".." in key:
        raise ValueError(f"invalid blob key {key!r}")
    return key


@dataclass(frozen=True)
class BlobInfo:
    key: str
    size: int


class BlobWriter(abc.ABC):
    @abc.abstractmethod
    def write(self, data) -> None: ...

    @abc.abstractmethod
    def publish(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None: ...

    def __enter__(self) -> "BlobWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


class BlobStore(abc.ABC):
    @abc.abstractmethod
    def open_writer(self, key: str) -> BlobWriter: ...

    @abc.abstractmethod
    def get(self, key: str, offset: int = 0, length: int | None = None) -> Iterator[bytes]: ...

    @abc.abstractmethod
    def stat(self, key: str) -> BlobInfo | None: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[BlobInfo]: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.open_writer(key) as w:
            w.write(data)
            w.publish()

    def read_all(self, key: str) -> bytes:
        return b"".join(self.get(key))
