"""The one place that chooses a data path, for a save's writes and a restore's reads.

Direct to the S3 store when the service offers it (directs3.py), else in place on the
store's file system where this host mounts it (directfs.py), else the spool where this
process sees the service's (checked once per Transport, and dropped when the service says
it does not read it), else the stream (paths.py). Reads follow the same choice: direct S3
reads the store itself, every other path reads through the service.
"""

from __future__ import annotations

from lastgood.datapath import directfs, directs3
from lastgood.datapath.paths import DataPath, SpoolPath, StreamPath


def default_path(transport) -> DataPath:
    if terms := directs3.offered(transport):
        return directs3.DirectS3Path(transport, terms)
    if direct := directfs.of(transport):  # this host mounts the service's local store (LASTGOOD_DIRECT_FS_MOUNT)
        return directfs.DirectFSPath(transport, direct)
    return SpoolPath(transport) if transport.spool is not None else StreamPath(transport)
