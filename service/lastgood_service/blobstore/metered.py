"""A metering wrapper (restic's wrapper layers are the model): the same BlobStore interface
over another store, counting the shard bytes that pass through it, so that no domain code
feeds the byte counters by hand.

What is counted: the streaming paths, which carry shard bytes -- a writer's bytes once it
has published them (`lastgood_bytes_ingested`; bytes of a writer that aborts, because the
hash did not match or the stream broke, were never stored), and every chunk a reader takes
from `get` (`lastgood_bytes_served`, with the time to the last chunk as
`lastgood_restore_seconds`). Not counted: the whole-object calls `put_bytes` and
`read_all`, which carry the service's own manifests, and everything that reads the store
without serving anyone (verification, recovery, GC and repair hold the store unwrapped).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from . import capabilities
from .base import BlobInfo, BlobStore, BlobWriter
from .capabilities import AdoptsFiles, LendsLocalPaths, ReportsFreeSpace


class _MeteredWriter(BlobWriter):
    """`adopted`: the size of the file an adopting writer makes the blob, counted whatever
    passed through write() (a file followed while it was written passes nothing: its
    writer is made once its hash is known, domain/commit/put.py)."""

    def __init__(self, inner: BlobWriter, metrics, adopted: int | None = None) -> None:
        self.inner, self.metrics, self.size, self.adopted = inner, metrics, 0, adopted

    def write(self, data) -> None:
        self.inner.write(data)
        self.size += len(data)

    def publish(self) -> None:
        self.inner.publish()
        self.metrics.bytes_ingested.inc(self.size if self.adopted is None else self.adopted)

    def abort(self) -> None:
        self.inner.abort()


class MeteredBlobStore(BlobStore, AdoptsFiles, LendsLocalPaths, ReportsFreeSpace):
    """`metrics`: lastgood_service.metrics.Metrics. It forwards each optional capability
    (capabilities.py), answering None where the store it wraps lacks it."""

    def __init__(self, inner: BlobStore, metrics) -> None:
        self.inner, self.metrics = inner, metrics

    def open_writer(self, key: str) -> BlobWriter:
        return _MeteredWriter(self.inner.open_writer(key), self.metrics)

    def adopt_writer(self, key: str, taken) -> BlobWriter | None:
        writer = capabilities.adopt_writer(self.inner, key, taken)
        return _MeteredWriter(writer, self.metrics, adopted=taken.size) if writer is not None else None

    def adopts_from(self, directory) -> bool:
        return capabilities.adopts_from(self.inner, directory)

    def get(self, key: str, offset: int = 0, length: int | None = None) -> Iterator[bytes]:
        return self._served(self.inner.get(key, offset, length))  # a missing key raises here, as inner's does

    def _served(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        start = time.monotonic()
        for chunk in chunks:
            self.metrics.bytes_served.inc(len(chunk))
            yield chunk
        self.metrics.restore_seconds.observe(time.monotonic() - start)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)

    def read_all(self, key: str) -> bytes:
        return self.inner.read_all(key)

    def free_bytes(self) -> int | None:
        return capabilities.free_bytes(self.inner)

    def local_path(self, key: str):
        return capabilities.local_path(self.inner, key)

    def stat(self, key: str) -> BlobInfo | None:
        return self.inner.stat(key)

    def list(self, prefix: str = "") -> Iterator[BlobInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
