"""In-memory blob store, for tests of the domain logic and as a reference implementation."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from .base import READ_CHUNK, BlobInfo, BlobStore, BlobWriter, check_key


class _MemoryWriter(BlobWriter):
    def __init__(self, store: "MemoryBlobStore", key: str) -> None:
        self._store = store
        self._key = check_key(key)
        self._buf = bytearray()

    def write(self, data) -> None:
        self._buf += memoryview(data)

    def publish(self) -> None:
        with self._store._lock:
            self._store._blobs[self._key] = bytes(self._buf)

    def abort(self) -> None:
        self._buf = bytearray()


class MemoryBlobStore(BlobStore):
    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def open_writer(self, key: str) -> BlobWriter:
        return _MemoryWriter(self, key)

    def get(self, key: str, offset: int = 0, length: int | None = None) -> Iterator[bytes]:
        with self._lock:
            data = self._blobs.get(check_key(key))
        if data is None:
            raise FileNotFoundError(key)
        end = len(data) if length is None else min(len(data), offset + length)
        return (data[i:min(i + READ_CHUNK, end)] for i in range(offset, end, READ_CHUNK))

    def stat(self, key: str) -> BlobInfo | None:
        with self._lock:
            data = self._blobs.get(check_key(key))
        return None if data is None else BlobInfo(key, len(data))

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        with self._lock:
            items = sorted((k, len(v)) for k, v in self._blobs.items() if k.startswith(prefix))
        return (BlobInfo(k, n) for k, n in items)

    def delete(self, key: str) -> None:
        with self._lock:
            self._blobs.pop(check_key(key), None)
