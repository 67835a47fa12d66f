"""Direct-FS: ranks write their files straight into the store's file system, from any host.

Where trainers mount the service's local store directory (NFS, Lustre, GPFS; a local path
in tests), streaming every byte through the service only adds a hop. A rank instead
writes its file in place, in the staging directory the service announces at
GET /api/v1/info (`direct_fs`: the store's root as the service sees it, the staging
directory's name, its id), hashing each piece as it writes it, fsyncs it, and hands over
only the name, as the spool does on the service's own host (the same name contract,
lastgood.wire.names, and the same hand-over call, Transport.put_shard). The service renames
the file into the store (same file system) and hashes it only in the `service`
verification mode; in `peer` mode another rank reads it back (peer.py).

The mount point as this host sees it may differ from the service's path
(LASTGOOD_DIRECT_FS_MOUNT); the id file in the staging directory proves that both name the
same directory. A host that does not see it (no mount, another store) streams, as does
every rank after the service declined a hand-over.

The save session reaches it as one more data path (`DirectFSPath`, chosen by
datapath/choose.default_path when this host mounts the store), with the three calls of every
path: prepare (write, hash and fsync before begin: a long write never runs into the
lease), send (hand the name over), discard (remove a file never handed over). Underneath,
`DirectFS` keeps those steps as plain calls (`write`, `hand_over`, `discard`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from lastgood.remote import config
from lastgood.wire import names, ranges
from lastgood.wire.vocab import Verification
from lastgood.wire.hashing import StreamHasher, hash_bytes
from lastgood.datapath import handover
from lastgood.datapath.paths import INLINE, Prepared, StreamPath

log = logging.getLogger("lastgood")


@dataclass(frozen=True)
class Handle:
    """A rank's file written in the staging directory, not yet handed over."""
    name: str     # its name there (lastgood.wire.names' hand-over pattern)
    size: int
    range_digests: str = ""  # declared range digests, JSON (peer mode; ranges.py)


class _Both:
    """Feeds the whole-file hasher and the range digests from the one write pass."""

    def __init__(self, hasher: StreamHasher, segments) -> None:
        self.hasher, self.segments = hasher, segments

    @property
    def size(self) -> int:
        return self.hasher.size

    def update(self, data) -> None:
        self.hasher.update(data)
        self.segments.update(data)


class DirectFS:
    """This host's view of the service's direct-FS store: where it is mounted here, and
    the staging directory's hand-over spec (Transport's spool dict)."""

    def __init__(self, transport, mount: str, staging: dict, verification: str) -> None:
        self.transport, self.mount, self.staging, self.verification = transport, mount, staging, verification

    @classmethod
    def find(cls, transport, mount: str | None) -> "DirectFS | None":
        """The direct-FS data path, when this host mounts the store at `mount` (the client's
        LASTGOOD_DIRECT_FS_MOUNT) and the id file there is the service's; else None, and
        the save path streams (or uses the spool)."""
        spec = transport.info.direct_fs
        if not mount:
            return None
        if not spec:
            log.warning("lastgood: %s is set to %s, but the service offers no direct-FS store (an object store, "
                        "or the service turned it off); streaming", config.ENV_DIRECT_FS_MOUNT, mount)
            return None
        if spec.staging != names.DIRECT_STAGING_DIR:
            log.warning("lastgood: the service's direct_fs announcement is malformed (staging directory %r); "
                        "streaming", spec.staging[:80])
            return None
        local = os.path.join(mount, spec.staging)
        staging = handover.find_dir(spec, local)  # the spool's id-file check, with the directory as seen here
        if staging is None:
            log.warning("lastgood: %s is not the service's store directory (its id file %s does not match, or it "
                        "is not writable); streaming", mount, os.path.join(local, names.SPOOL_ID_FILE))
            return None
        return cls(transport, mount, staging, transport.info.verification)

    @property
    def usable(self) -> bool:
        return not self.staging.get("refused")  # the service declined a hand-over: stream from then on

    @property
    def peer(self) -> bool:
        """Do this service's ranks check each other's files (peer.py) before the commit?"""
        return self.verification == Verification.PEER

    def write(self, data, hasher: StreamHasher | None = None) -> Handle | None:
        """Write and fsync the rank's file in the staging directory, feeding `hasher` each
        piece as it is written; None when it cannot be written (then stream)."""
        if not self.usable:
            return None
        name = self.transport.spool_write(data, hasher, spool=self.staging, fsync=True)
        return Handle(name, memoryview(data).nbytes) if name else None

    def hand_over(self, checkpoint_id: int, rank: int, file_name: str, data, digest: str, handle: Handle | None):
        """Hand the written file over by name (or stream `data`, the same bytes, when there is
        no handle or the service declines it): Transport.put_shard's answer."""
        return self.transport.put_shard(checkpoint_id, rank, file_name, data, digest,
                                        spooled=handle.name if handle else None, spool=self.staging,
                                        range_digests=handle.range_digests if handle else "")

    def discard(self, handle: Handle | None) -> None:
        """Remove a written file that was never handed over (the service sweeps it otherwise)."""
        if handle is not None:
            self.transport.spool_discard(handle.name, self.staging)

    def store_path(self, relative: str) -> str:
        """A blob the service named (relative to the store's root) as this host sees it."""
        return os.path.join(self.mount, names.check_store_path(relative))


_NOT_FOUND = object()


def of(transport) -> DirectFS | None:
    """The direct-FS data path of this transport's host (looked for once per transport, at
    its LASTGOOD_DIRECT_FS_MOUNT), or None."""
    found = getattr(transport, "_direct_fs", _NOT_FOUND)
    if found is _NOT_FOUND:
        found = DirectFS.find(transport, getattr(transport, "direct_fs_mount", None))
        transport._direct_fs = found
    return found if found is not None and found.usable else None


class DirectFSPath(StreamPath):
    """The save session's data path for direct-FS (datapath/paths.py): the file written in place
    before begin, its name handed over after; streamed whenever that is not possible."""

    name = "direct-fs"

    def __init__(self, transport, direct: DirectFS) -> None:
        super().__init__(transport)
        self.direct = direct

    def prepare(self, name: str, data) -> Prepared:
        data = memoryview(data).cast("B")
        hasher = StreamHasher()  # fed as the file is written: one pass over the bytes
        # in `peer` mode the service reads only the header: the file's range digests are
        # computed here, in the same pass, and declared with the name (a peer recomputes them)
        segments = ranges.hasher_of(data, self.transport.info.range_block_bytes) \
            if self.direct.peer and name.endswith(".safetensors") else None
        handle = self.direct.write(data, hasher if segments is None else _Both(hasher, segments))
        if handle is None:  # not writable here: streamed
            return super().prepare(name, data)
        whole = hasher.size == data.nbytes
        digest = hasher.hexdigest() if whole else hash_bytes(data)
        declared = segments.digests() if segments is not None and whole else None
        handle = Handle(handle.name, handle.size, json.dumps(declared, separators=(",", ":"))
                        if ranges.declarable(declared) else "")
        return Prepared(name, data, digest, expected_bytes=0, token=handle)

    def send(self, checkpoint_id: int, rank: int, handle: Prepared) -> None:
        if handle.token is None or handle.token is INLINE:  # not written here (streamed, or small)
            return super().send(checkpoint_id, rank, handle)
        try:  # a hand-over that fails for any reason is streamed (Transport.put_shard)
            self.direct.hand_over(checkpoint_id, rank, handle.name, handle.data, handle.digest, handle.token)
        finally:
            self.direct.discard(handle.token)  # gone already when the service took it
        handle.token = None

    def discard(self, handle: Prepared) -> None:
        if handle.token is not None and handle.token is not INLINE:
            self.direct.discard(handle.token)
        handle.token = None
