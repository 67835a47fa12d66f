"""Who hashes the bytes of a file a rank handed over by name: LASTGOOD_VERIFICATION.

"Every shard has arrived and been hashed" (I2) must hold where the service does not read
every byte. The mode says who reads the stored bytes and checks them against the
xxh3-128 their writer declared, before the checkpoint may commit:

  service  (default) the service re-reads every byte it adopts.
  peer     another rank reads the file back from the store and checks it - through its
           mount on direct-FS, through a presigned GET the assignment grants it on direct
           S3 (the checker holds no credentials) - and the service reads only the file's
           header (the tensor index). The rule, one place: rank r checks the
           files of rank (r + 1) mod world. Why a ring: every file gets exactly one checker,
           the read load is one file per rank whatever the world size, and a rank never
           checks its own bytes. A job of one rank has no other rank: the service hashes
           its files (`_alone`). Only the assigned rank may ask for or report a check: it
           holds the secret whose commitment its vote carried (`_require_checker`,
           lastgood/wire/peerkey.py), and the assignment never names the declared digest
           (nor do the keys: domain/keys.py).
  store    the store checked each part's CRC32 as it took the bytes (direct S3 uploads:
           domain/dataplane/grants.py), and the service confirms the declared xxh3-128 by
           reading the object back from the store, in the background from the hand-over on
           (no S3 store computes xxh3, and the CRC32s tie the bytes to what the rank
           uploaded, not to the digest it declared). A deployment that cannot (a file
           system never does; direct uploads off) is refused at start (`check_available`).

The mode governs the hand-overs by name: direct-FS (domain/dataplane/directfs.py) and direct S3
uploads (domain/dataplane/grants.py; `service` is refused there: the service would have to read
every object back, undoing the path). Bytes the service receives anyway - a stream, the
same-host spool - are hashed as they pass, whatever the mode.

A peer-checked file is recorded DECLARED, published but not yet VERIFIED; the commit
(protocol.try_commit) waits until no DECLARED file is left. A rank asks which files to
check (`assignment`: the peer's DECLARED files, their size and their path in the store,
never the digest their writer declared: a checker cannot echo it) and reports what it read (`report`): a match makes the file VERIFIED; a
mismatch records a hash_mismatch event and aborts the checkpoint (ABANDONED, with the
reason); a file the checker could not read (it does not mount the store, the blob is
missing) is hashed by the service itself, and so is a file no checker reported within a
grace once every rank has voted (domain/peer/peer_fallback.py, the liveness rule), so a
checker's trouble costs CPU, never the commit's correctness or its liveness.
"""

from __future__ import annotations

import logging

from sqlalchemy import select

from lastgood.wire import peerkey
from lastgood.wire.vocab import Verification

from ...blobstore import capabilities
from ...catalog.models import COMMITTED, DECLARED, PENDING, VERIFIED, Shard, Vote
from ..commit import declared_ranges
from ..commit.core import key_prefix
from ..commit.declared_ranges import fingerprint_of
from ..errors import FailedPrecondition, InvalidArgument, PermissionDenied
from ..events import add_event
from ..runs import fencing
from . import peer_fallback


SERVICE, PEER, STORE = (Verification[n].value for n in ("SERVICE", "PEER", "STORE"))
MODES = tuple(m.value for m in Verification)
MAX_REPORT_FILES = 1000
log = logging.getLogger("lastgood")


class ModeUnavailable(ValueError):
    """The configured verification mode cannot be provided by this deployment."""


def check_available(mode: str, store, direct_s3: bool) -> None:
    """Refuse, at start, a mode the data paths cannot provide. `store` needs the direct S3
    uploads (domain/dataplane/grants.py), where the store verifies each part's declared CRC32 as it
    takes it: a store that grants no direct access, or a service with them off, has
    nothing that would verify a file it does not hash. Direct uploads take `store` or
    `peer` (ranks read each other's objects back through presigned GETs: the one mode
    that needs no checking store, so the one for a store that does not check, as moto).
    Direct uploads on a store that grants no direct access (a file system) are refused."""
    if mode not in MODES:
        raise ModeUnavailable(f"LASTGOOD_VERIFICATION must be one of {', '.join(MODES)}, got {mode!r}")
    if direct_s3 and mode == SERVICE:
        # the service never sees the bytes of a direct upload, and reading every object back
        # would undo what the path is for: the store, or the ranks, verify them
        raise ModeUnavailable(
            f"LASTGOOD_DIRECT_S3=true needs LASTGOOD_VERIFICATION=store or peer, not {mode!r}: the ranks' bytes "
            f"go straight to the store; `store`: the store verifies each part's CRC32 as it takes it and the "
            f"service reads each object back for its xxh3-128; `peer`: each rank reads another rank's object back")
    if mode == STORE and not (direct_s3 and isinstance(store, capabilities.GrantsDirectAccess)):
        why = ("direct uploads are off (LASTGOOD_DIRECT_S3)" if isinstance(store, capabilities.GrantsDirectAccess)
               else f"the blob store ({type(store).__name__}) does not verify the checksums writers declare (a file "
                    f"system never does)")
        raise ModeUnavailable(
            f"LASTGOOD_VERIFICATION=store: {why}, so nothing would verify a file the service does not hash; "
            f"use `service` (the service hashes every byte) or `peer` (ranks check each other's files)")
    if direct_s3 and not isinstance(store, capabilities.GrantsDirectAccess):  # `peer`: past the rules above
        raise ModeUnavailable(
            f"LASTGOOD_DIRECT_S3=true: the blob store ({type(store).__name__}) grants no direct access (only an S3 "
            f"store does), so the setting would do nothing; unset it, or use an S3 blob store")


def service_hashes(mode: str) -> bool:
    """Does the service hash a file handed over by name (direct-FS) in this mode?"""
    return mode == SERVICE


def store_verifies(mode: str) -> bool:
    """Do the store's part checksums stand for a direct S3 upload (`store`: every part's CRC32
    must be reported and equal, and the service confirms the declared xxh3-128 by reading the
    object back), or a peer's read-back (`peer`)?"""
    return mode == STORE


def peer_of(rank: int, world_size: int) -> int:
    """The rank whose files `rank` checks."""
    return (rank + 1) % world_size


class PeerChecks:
    """The service's half of peer verification, over the commit service's catalog and store."""

    def __init__(self, commits, fallback: peer_fallback.PeerFallback, directfs=None) -> None:
        """`fallback`: the commit service's one PeerFallback (main.py builds both)."""
        self.commits, self.fallback, self.directfs = commits, fallback, directfs

    def _where(self):
        """How a checker reaches a stored file: (file -> {"path"} under its mount, direct-FS;
        file -> {"url"}, a presigned GET of the object, direct S3 uploads)."""
        settings = self.commits.settings
        d = capabilities.direct(self.commits.store, settings.s3_public_endpoint) if settings.direct_s3 else None
        if d is not None:
            seconds = settings.direct_s3_grant_seconds
            return lambda sh: {"path": None, "url": d.presign_get(sh.blob_key, seconds)}
        return lambda sh: {"path": self.directfs.path_of(sh.blob_key) if self.directfs else None}

    @property
    def mode(self) -> str:
        return self.commits.settings.verification

    def assignment(self, checkpoint_id: int, rank: int, secret: str | None = None) -> dict:
        """What `rank` checks now: its peer's DECLARED files, with size and where to read each
        (`_where`: a path under the store's root, or a presigned GET). `secret`: the rank's
        peer-check secret, whose commitment its vote carried (`_require_checker`). A job of one
        rank checks nothing: the service hashes its files (`_alone`)."""
        c = self.commits
        with c.sessions() as s, s.begin():
            ck = c.get_checkpoint(s, checkpoint_id)
            c.check_rank(ck, rank)
            # a zombie of a fenced launch gets no presigned GET of the store's objects
            fencing.check(s, ck.run_id, ck.generation, f"peer check on checkpoint {ck.id}")
            if ck.world_size == 1:
                alone = [(0, n) for n in s.scalars(select(Shard.file_name).where(
                    Shard.checkpoint_id == checkpoint_id, Shard.status == DECLARED))] if ck.status == PENDING else []
                status = ck.status
            else:
                alone = None if self._require_checker(s, ck, rank, secret) else []
            peer = peer_of(rank, ck.world_size)
            voted = s.get(Vote, (checkpoint_id, peer)) is not None
            shards = list(s.scalars(select(Shard).where(Shard.checkpoint_id == checkpoint_id, Shard.rank == peer,
                                                        Shard.status == DECLARED).order_by(Shard.file_name)))
            status, world = ck.status, ck.world_size
            pfx = key_prefix(s, ck)
        if alone is not None:  # alone, or a rank that voted without a key: the service hashes its peer's files
            if world > 1 and status == PENDING:
                alone = [(peer, sh.file_name) for sh in shards]
            return self._alone(checkpoint_id, alone, status, voted, peer)
        where = self._where() if shards and status == PENDING else None
        # no declared digest: the checker reports what it read, the service compares (report);
        # each file's writer's range digests, if any, by their rule: recomputed by the checker
        # (domain/commit/declared_ranges.py);
        # files the service hashes itself (the fallback) are nobody's to check
        files = [{"name": sh.file_name, "size": sh.size, **where(sh),
                  "ranges": declared_ranges.rule_of(declared_ranges.of_shard(c.store, pfx, sh))} for sh in shards
                 if not self.fallback.hashing(checkpoint_id, peer, sh.file_name)] if where else []
        return {"verification": self.mode, "status": status, "peer_rank": peer, "peer_voted": voted,
                "files": files if status == PENDING else []}

    def _require_checker(self, s, ck, rank: int, secret: str | None) -> bool:
        """Only the rank assigned to check may ask for or report its assignment: the caller
        must hold the secret whose commitment `rank`'s vote carried (lastgood/wire/peerkey.py).
        Every rank of a job holds the same token, so without this any of them - the writer of
        the files included - could file the checker's report. A rank checks after its vote."""
        vote = s.get(Vote, (ck.id, rank))
        if vote is None:
            raise FailedPrecondition(f"rank {rank} has not voted on checkpoint {ck.id}: a rank checks its peer's "
                                     f"files after its own vote")
        if vote.peer_key is None:  # a client that sends none (older): not refused, but no check of its is taken
            return False
        if not peerkey.matches(secret, vote.peer_key):
            raise PermissionDenied(f"peer check of rank {rank}'s assignment on checkpoint {ck.id}: the "
                                   f"{peerkey.HEADER} is not the secret rank {rank} voted with; only that rank "
                                   f"may check its peer's files")
        return True

    def _alone(self, checkpoint_id: int, files: list, status: str, voted: bool, peer: int) -> dict:
        """Files no rank may check: a job of one rank's (no other rank can, and one reading
        back its own file could report the digest it declared without reading it), or the
        peer's of a rank that voted without a peer key (a client that sends none). The
        service hashes them itself, now (peer_fallback), and commits once all voted."""
        left = [f for f in files if not self.fallback.hashing(checkpoint_id, *f)]
        if left:
            self.fallback.start(checkpoint_id, left, "no rank may check it (a job of one rank, or a checker "
                                                     "that voted without a peer key)")
        return {"verification": self.mode, "status": status, "peer_rank": peer, "peer_voted": voted, "files": []}

    def report(self, checkpoint_id: int, rank: int, peer_rank: int, files: list[dict],
               secret: str | None = None) -> dict:
        """What `rank` read of its peer's files: {"name", "xxh3_128"} each, xxh3_128 None when
        it could not read the file. Idempotent: files already checked are passed over.
        `secret`: as for `assignment`; a report without the right one is refused and recorded
        (peer_report_refused)."""
        try:
            return self._report(checkpoint_id, rank, peer_rank, files, secret)
        except PermissionDenied as denied:  # recorded in a transaction of its own: nothing else changed
            with self.commits.sessions() as s, s.begin():
                ck = self.commits.get_checkpoint(s, checkpoint_id)
                add_event(s, "peer_report_refused", ck.run_id, ck.id, rank=rank, reason=str(denied)[:300])
            log.warning("checkpoint %s: %s", checkpoint_id, denied)
            raise

    def _report(self, checkpoint_id: int, rank: int, peer_rank: int, files: list[dict], secret: str | None) -> dict:
        c = self.commits
        c.gate.check()
        if len(files) > MAX_REPORT_FILES:
            raise InvalidArgument(f"a report names at most {MAX_REPORT_FILES} files")
        with c.sessions() as s, s.begin():
            ck = c.get_checkpoint(s, checkpoint_id, lock=True)  # serialises with votes and commits
            c.check_rank(ck, rank)
            fencing.check(s, ck.run_id, ck.generation, f"peer check on checkpoint {ck.id}")
            if ck.world_size == 1:
                raise InvalidArgument(f"checkpoint {ck.id} has one rank, which does not check its own files: "
                                      f"the service hashes them")
            if peer_rank != peer_of(rank, ck.world_size):
                raise InvalidArgument(f"rank {rank} checks the files of rank {peer_of(rank, ck.world_size)}, "
                                      f"not of rank {peer_rank}")
            if not self._require_checker(s, ck, rank, secret):
                raise PermissionDenied(f"rank {rank} voted on checkpoint {ck.id} without a peer key, so no check of "
                                       f"its is accepted: the service hashes its peer's files itself")
            if ck.status != PENDING:
                return {"status": ck.status, "verified": [], "mismatched": []}
            ck.lease_expires_at = c.lease_from_now()  # a check is progressing: the checkpoint is alive
            declared = {sh.file_name: sh for sh in s.scalars(select(Shard).where(
                Shard.checkpoint_id == checkpoint_id, Shard.rank == peer_rank, Shard.status == DECLARED))}
            pfx = key_prefix(s, ck)
            verified, bad, unread = [], [], []
            for f in files:
                sh = declared.get(f.get("name"))
                if sh is None:
                    continue  # checked already (a retried report), or never declared
                got = f.get("xxh3_128")
                ranges = declared_ranges.of_shard(c.store, pfx, sh) if got == sh.xxh3_128 else None
                if got is None or (ranges is not None and f.get("ranges_xxh3_128") is None):
                    unread.append((peer_rank, sh.file_name))  # the service reads it (and its ranges) itself
                elif got == sh.xxh3_128 and fingerprint_of(ranges) in (None, f.get("ranges_xxh3_128")):
                    sh.status = VERIFIED
                    verified.append(sh.file_name)
                elif got == sh.xxh3_128:  # the bytes are as declared, the declared range digests are not theirs
                    bad.append((sh.file_name, sh.xxh3_128, f"{got}, range digests {f.get('ranges_xxh3_128')} (not "
                                f"the declared {fingerprint_of(ranges)})", f"rank {rank} read it back from the store"))
                else:
                    bad.append((sh.file_name, sh.xxh3_128, got, f"rank {rank} read it back from the store"))
            if verified:
                add_event(s, "peer_verified", ck.run_id, ck.id, rank=peer_rank, checked_by=rank, files=verified)
            # try_commit reads every vote and file of the checkpoint: called on every report it
            # would make a checkpoint's reports cost O(world²) (bench/cluster.py); only once none is left
            left = s.scalar(select(Shard.id).where(Shard.checkpoint_id == checkpoint_id,
                                                   Shard.status == DECLARED).limit(1)) is not None
            # the last file verified: what the commit writes is read here, under the row lock
            # this report holds, not again in a transaction of its own (try_commit's plan)
            plan = None
            if not left and not unread and not bad:
                try:
                    plan = c.commit_plan(s, ck)
                except FailedPrecondition:  # votes and files disagree: try_commit says so, after
                    pass  # this report's checks are recorded
        if unread:  # the checker could not read them: the service hashes them, on its own thread
            self.fallback.start(checkpoint_id, unread, f"rank {rank} could not read it")
        if bad:
            return self._refuse(checkpoint_id, rank, peer_rank, bad, verified)
        # the status as this call knows it, without another transaction: PENDING while a
        # file is left (as of the locked read above), COMMITTED when its own try_commit
        # committed; read back only when the last report's try_commit did not commit
        if left:
            status = PENDING
        elif c.try_commit(checkpoint_id, plan=plan):
            status = COMMITTED
        else:
            with c.sessions() as s, s.begin():
                status = c.get_checkpoint(s, checkpoint_id).status
        return {"status": status, "verified": verified, "mismatched": []}

    def _refuse(self, checkpoint_id: int, rank: int, peer_rank: int, bad: list, verified: list) -> dict:
        """A file whose stored bytes are not what its writer declared: the checkpoint never commits."""
        status, reason = peer_fallback.refuse(self.commits, checkpoint_id,
                                              [(peer_rank, *b) for b in bad], rank)
        return {"status": status, "verified": verified, "mismatched": [b[0] for b in bad], "reason": reason}
