"""Direct-FS: the service's side of ranks that write into the store's own file system.

Where trainers mount the local store's directory (NFS, Lustre, GPFS), a rank on any host
writes its file in place in a staging directory under the store's root, fsyncs it and
hands over only its name - the spool's hand-over (domain/dataplane/spool.py), with the same name
contract (lastgood.wire.names), the same take-and-check, and the same id file that proves a
client sees this directory. The staging directory *is* a Spool, rooted in the store: the
service renames a taken file into the store (same file system, no copy) and hashes it
only in the `service` verification mode (domain/peer/verification_modes.py).

Trust is the spool's: the staging directory is the service user's (mode 0700), so only
processes running as that user - on every host that mounts it - can hand files over.

GET /api/v1/info announces `direct_fs`: the store's root as the service sees it, the
staging directory's name under it, and its id. A peer that checks another rank's file
reads the blob at the store path `path_of` gives, relative to that root.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lastgood.wire import names
from lastgood.wire.info import DirectFSOffer

from ...blobstore import capabilities
from ...blobstore.base import BlobStore
from .spool import Spool

log = logging.getLogger("lastgood")


class DirectFS:
    def __init__(self, root: Path, store: BlobStore) -> None:
        self.root = Path(root).resolve()
        self.store = store
        self.staging = Spool(self.root / names.DIRECT_STAGING_DIR)

    @classmethod
    def open(cls, store: BlobStore, enabled: bool) -> "DirectFS | None":
        """The direct-FS data path over `store`, when it is a directory trainers can mount
        (a local store) and the setting allows it; None otherwise (clients stream)."""
        root = getattr(store, "root", None)
        if not enabled or root is None or not isinstance(store, capabilities.LendsLocalPaths):
            return None
        try:
            return cls(root, store)
        except OSError as e:
            log.warning("no direct-FS staging directory (clients stream): %s", e)
            return None

    @property
    def id(self) -> str:
        return self.staging.id

    def info(self) -> DirectFSOffer:
        return DirectFSOffer(dir=str(self.root), staging=names.DIRECT_STAGING_DIR, id=self.staging.id)

    def path_of(self, key: str) -> str | None:
        """The published blob `key` relative to the store's root (what a mounting peer opens)."""
        path = capabilities.local_path(self.store, key)
        if path is None:
            return None
        return str(Path(path).resolve().relative_to(self.root))

    def sweep(self, max_age_seconds: float) -> int:
        return self.staging.sweep(max_age_seconds)
