"""Blob stores, chosen by URL scheme: file:// (local), memory://, s3:// (S3-compatible).
See base.BlobStore for the protocol every one of them keeps."""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlparse

from pydantic import SecretStr

from .base import BlobInfo, BlobStore, BlobWriter
from .local import LocalBlobStore
from .memory import MemoryBlobStore

__all__ = ["BlobInfo", "BlobStore", "BlobWriter", "Credentials", "LocalBlobStore", "MemoryBlobStore",
           "open_blobstore"]


class Credentials(Protocol):
    """What an s3:// store is opened with: the service's settings have both
    (LASTGOOD_S3_ACCESS_KEY, LASTGOOD_S3_SECRET_KEY). The stores know nothing else of the
    settings, which sit above them (.importlinter, service-layers)."""

    s3_access_key: str | None
    s3_secret_key: SecretStr | None


def open_blobstore(url: str, settings: Credentials | None = None) -> BlobStore:
    """The store `url` names. An s3:// store takes its credentials from `settings`
    (LASTGOOD_S3_ACCESS_KEY / LASTGOOD_S3_SECRET_KEY), never from the URL."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalBlobStore(parsed.path)
    if parsed.scheme == "memory":
        return MemoryBlobStore()
    if parsed.scheme == "s3":
        from .s3 import s3_from_url  # the minio client is imported only when an s3:// store is used

        secret = settings.s3_secret_key if settings is not None else None
        return s3_from_url(url, access_key=settings.s3_access_key if settings is not None else None,
                           secret_key=secret.get_secret_value() if secret is not None else None)
    raise ValueError(f"unsupported blob store URL {url!r} (use file:///path, memory:// or "
                     f"s3://bucket?endpoint=host:port)")
