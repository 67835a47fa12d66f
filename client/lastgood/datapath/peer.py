"""Peer verification, the rank's half (the service's: domain/peer/verification_modes.py).

Under LASTGOOD_VERIFICATION=peer the service does not read the files ranks write in place
on direct-FS (directfs.py) or upload straight to S3 (directs3.py); before the checkpoint may
commit, each file is read back from the store by another rank - rank r checks rank
(r + 1) mod world, a rule the service applies, so the rank just asks - and its xxh3-128
compared with what its writer declared.

After its own vote a rank asks which files to check (the service names them, with their
size and their path under the store's root, or a presigned GET of the object: the rank
holds no store credentials; never their declared digest), reads and hashes each through its
own mount or that URL, and reports the digests it got. Both requests carry this process's
secret for the rank, whose commitment its vote carried (lastgood/wire/peerkey.py): the
service takes a check only from the rank assigned to it. A job of one rank checks nothing:
its assignment is empty and the service hashes its files. It repeats until its peer has voted and nothing of
the peer's is left unchecked, or the checkpoint is decided. A mismatch aborts
the checkpoint on the service; the rank learns it from the answer, as every other rank
learns it from its vote. A file it cannot read (no mount, a missing blob) is reported as
unread, and the service hashes that one itself; so it does a file no rank reported
within a grace after the last vote (a checker that died, a rank that does not wait).

`check(..., read=...)` takes the function that reads and hashes a file: a test passes one
that does not read, to show what the check is for (tests/client/test_directfs.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from lastgood.wire.vocab import Status, Verification
from lastgood.datapath import directs3
from lastgood.errors import SaveFailed
from lastgood.wire.ranges import FileCheck, fingerprint

log = logging.getLogger("lastgood")
_PIECE = 8 * 1024 * 1024
_POLL = 0.2  # seconds between asks while the peer has not voted yet


def wanted(transport) -> bool:
    """Does this service want its ranks to check each other's files (LASTGOOD_VERIFICATION=peer)?"""
    info = getattr(transport, "info", None)
    return info is not None and info.verification == Verification.PEER


def read_and_hash(direct, entry: dict) -> tuple[str, str | None] | None:
    """The xxh3-128 of the stored file the service named, read through this host's mount
    (direct-FS) or through the presigned GET the service granted (`url`: direct S3, where
    the rank holds no store credentials), and, when its writer declared range digests (the
    entry's `ranges`: their rule), the fingerprint of those digests recomputed from the same
    bytes in the same pass (ranges.FileCheck); None when it cannot be read whole (the
    service then reads it itself)."""
    if entry.get("url"):
        return directs3.hash_object(entry["url"], int(entry["size"]), entry.get("ranges"))
    if direct is None or not entry.get("path"):
        return None
    try:
        fd = os.open(direct.store_path(entry["path"]), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, ValueError) as e:
        log.warning("lastgood: peer check cannot open %s: %s", entry.get("path"), e)
        return None
    hasher = FileCheck(entry.get("ranges"))
    buf = bytearray(_PIECE)
    view = memoryview(buf)
    try:
        # read what the store holds, not what this host's page cache kept of the writer's
        # pages (a peer on the writer's host): cached pages of the file are dropped first
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        while n := os.readv(fd, [view]):
            hasher.update(view[:n])
    except OSError as e:  # EIO and the like mid-read: unread, and the service hashes it itself
        log.warning("lastgood: peer check cannot read %s: %s", entry.get("path"), e)
        return None
    finally:
        os.close(fd)
    if hasher.size != entry.get("size"):
        return None  # the service looks at it itself
    return hasher.hasher.hexdigest(), fingerprint(hasher.digests())


def check(transport, direct, checkpoint_id: int, rank: int, deadline: float,
          read: Callable[[object, dict], str | None] = read_and_hash, *, wait_for_peer: bool = True) -> str:
    """Check this rank's peer's files until none is left; the checkpoint's status then.
    Raises SaveFailed when a check found a mismatch (the checkpoint is aborted) or the
    peer has not voted by `deadline` (time.monotonic).

    `wait_for_peer=False` (a rank that does not wait for the outcome: DCP's non-coordinators)
    checks what its peer has handed over so far and returns: its peer may vote only after
    this rank returns (DCP's coordinator votes last), so waiting for it could deadlock; the
    files it leaves are hashed by the service once the grace is over (domain/peer/peer_fallback.py)."""
    while True:
        a = transport.peer_assignment(checkpoint_id, rank)
        if a["status"] != Status.PENDING:
            return a["status"]
        if a["files"]:
            got = [report_entry(f["name"], read(direct, f)) for f in a["files"]]
            r = transport.peer_report(checkpoint_id, rank, {"peer_rank": a["peer_rank"], "files": got})
            if r.get("mismatched"):
                raise SaveFailed(f"checkpoint {checkpoint_id}: {r.get('reason', 'peer check failed')}")
            if r.get("status", Status.PENDING) != Status.PENDING:
                return r["status"]  # decided (this report's commit, most often): nothing left to ask
            continue
        if a["peer_voted"] or not wait_for_peer:
            return a["status"]
        if time.monotonic() > deadline:
            raise SaveFailed(f"checkpoint {checkpoint_id}: rank {a['peer_rank']} did not vote in time for its peer "
                             f"check by rank {rank}")
        time.sleep(_POLL)


def report_entry(name: str, got) -> dict:
    """One file of the report: what `read` returned (a digest, or digest and range digests'
    fingerprint, or None: unread)."""
    xxh3, ranges = got if isinstance(got, tuple) else (got, None)
    return {"name": name, "xxh3_128": xxh3, **({"ranges_xxh3_128": ranges} if ranges else {})}
