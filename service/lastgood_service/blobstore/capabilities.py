"""What some blob stores can do beyond the minimal BlobStore interface (base.py), each a
small protocol of its own, checked by the caller at the point of use.

  AdoptsFiles      a spooled shard file the service took over becomes the blob itself
                   (the local store, by rename, when the spool can rename into it)
  LendsLocalPaths  a blob is a file on this host, which a same-host reader may link to
  ReportsFreeSpace the store can tell how many bytes it has left (a local file system)
  GrantsDirectAccess trainers may upload and read blobs straight from the store through
                   presigned URLs the service signs (S3; blobstore/s3direct.py, domain/dataplane/grants.py)

A store without a capability is asked nothing: the helpers below answer what the caller
does then (None: copy the file through a writer; stream the chunks; the room is unknown).
Every store that has a capability passes its part of the contract suite
(tests/blobstore/test_contract.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from .base import BlobStore, BlobWriter


@runtime_checkable
class AdoptsFiles(Protocol):
    def adopt_writer(self, key: str, taken) -> BlobWriter | None:
        """A writer whose bytes are already in `taken` (domain/dataplane/spool.Taken: a path and an
        open descriptor): `write` ignores what it is given (the caller hashes the file
        through the descriptor and passes the pieces on), `publish` makes that file the
        blob, `abort` leaves it to its owner. None when this file cannot be adopted."""

    def adopts_from(self, directory: Path) -> bool:
        """Can files in `directory` be adopted (adopt_writer not None)? Asked before a file
        is there: a file handed over while it is written (domain/dataplane/spool.Followed) is
        adopted only once its hash, which names its blob, is known."""


@runtime_checkable
class LendsLocalPaths(Protocol):
    def local_path(self, key: str) -> Path | None:
        """The published blob as a file on this host; None if there is none."""


@runtime_checkable
class ReportsFreeSpace(Protocol):
    def free_bytes(self) -> int | None:
        """Room left for new blobs; None when it cannot tell."""


def adopt_writer(store: BlobStore, key: str, taken) -> BlobWriter | None:
    return store.adopt_writer(key, taken) if isinstance(store, AdoptsFiles) else None


def adopts_from(store: BlobStore, directory: Path) -> bool:
    return isinstance(store, AdoptsFiles) and store.adopts_from(directory)


def local_path(store: BlobStore, key: str) -> Path | None:
    return store.local_path(key) if isinstance(store, LendsLocalPaths) else None


def free_bytes(store: BlobStore) -> int | None:
    return store.free_bytes() if isinstance(store, ReportsFreeSpace) else None


@runtime_checkable
class GrantsDirectAccess(Protocol):
    def direct(self, public_endpoint: str | None = None):
        """The store's direct-access calls (s3direct.S3Direct), signing URLs for trainers
        that reach the store at `public_endpoint` (None: the service's own endpoint)."""


def direct(store: BlobStore, public_endpoint: str | None = None):
    """The store's direct access, or None when it has none (the data goes through the service)."""
    return store.direct(public_endpoint) if isinstance(store, GrantsDirectAccess) else None
