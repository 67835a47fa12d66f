"""Blob stores, chosen by URL scheme: file:// (local), memory://. See base.BlobStore."""

from __future__ import annotations

from urllib.parse import urlparse

from .base import BlobInfo, BlobStore, BlobWriter
from .local import LocalBlobStore
from .memory import MemoryBlobStore

__all__ = ["BlobInfo", "BlobStore", "BlobWriter", "LocalBlobStore", "MemoryBlobStore", "open_blobstore"]


def open_blobstore(url: str) -> BlobStore:
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalBlobStore(parsed.path)
    if parsed.scheme == "memory":
        return MemoryBlobStore()
    raise ValueError(f"unsupported blob store URL {url!r} (use file:///path or memory://)")
