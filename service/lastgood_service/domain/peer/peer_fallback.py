"""The liveness rule of peer verification (domain/peer/verification_modes.py), one place.

A peer-checked file is DECLARED until a rank reads it back and reports its digest. Ranks
can fail to: a checker crashed after its vote, a rank that does not wait for the outcome
(DCP's non-coordinators) checks only what is there when it votes, a client started before
the service was switched to `peer` never checks at all, a checker could not read the file.
None of that may cost the commit, so:

  once every rank of a checkpoint has voted, a DECLARED file no checker has reported
  within `peer_check_grace_seconds` (default: half the lease) is hashed by the service
  itself, in the background, and the checkpoint's lease is renewed while it does; and
  such a checkpoint with no DECLARED file left, still PENDING after the grace (the commit
  attempt after the last check or hash failed: a transient catalog or store error, or the
  service stopped inside it), is committed by the service.

The grace is shorter than the lease, and the last vote renewed the lease, so a fully voted
checkpoint never expires waiting for a check: either a rank reports in time or the service
takes over before the lease is out (the reaper runs the pass once a pending checkpoint is
older than the grace, then every `sweep_interval`: a tenth of what the lease leaves after
the grace, or of the grace if shorter). A file a checker reports unread is handed over at
once. The hash runs on a thread of this module, never inside a request (a multi-GB file
would outlast the client's timeout, and each retry would start another hash); a file
already being hashed is not hashed again, and ranks are not asked to check it. A grace at
or past the lease turns the rule off: such checkpoints end ABANDONED when their lease
runs out (the control in tests/service/test_peer_liveness.py).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time

from sqlalchemy import func, select

from lastgood.wire.ranges import FileCheck, fingerprint

from ...catalog.models import DECLARED, DURABLE, PENDING, VERIFIED, Checkpoint, Shard, Vote
from ..commit import declared_ranges
from ..commit.core import key_prefix
from ..commit.declared_ranges import fingerprint_of
from ..commit.types import ShardHeader

log = logging.getLogger("lastgood.commit")


# files the service reads back at once (`store` mode's confirmations, a peer's unread files,
# the grace's): more would only share the same download bandwidth and cores; a thread waiting
# for its turn renews its checkpoint's lease, so a queue of many files never expires it
MAX_READS = 8


def grace_seconds(settings) -> float:
    """How long after the last vote a DECLARED file waits for its checker."""
    g = settings.peer_check_grace_seconds
    return settings.lease_seconds / 2 if g is None else g


def sweep_interval(settings) -> float:
    """How often the lease reaper runs `sweep` while a checkpoint older than the grace is
    pending (before, it has nothing to do: reaper.py): a tenth of the shorter of the grace
    and what the lease leaves after it, so the service's hash (or commit) starts at most
    that late and still well before the lease runs out; never more often than the reaper's
    own pass."""
    grace = grace_seconds(settings)
    room = min(grace, settings.lease_seconds - grace)
    return max(settings.reaper_interval, room / 10)


class PeerFallback:
    """The service's own hash of DECLARED files nobody checked. One per commit service,
    built by the composition root (main.py) and shared by the lease reaper's sweep and the
    peer checks of the requests (verification_modes.PeerChecks), so that a file is never
    hashed twice at once."""

    def __init__(self, commits) -> None:
        self.commits = commits
        self._lock = threading.Lock()
        self._hashing: set[tuple[int, int, str]] = set()  # (checkpoint, rank, file) being hashed here
        self._committing: set[int] = set()  # checkpoints the sweep is trying to commit again here
        self.next_in = 0.0  # seconds until a sweep can next find work, as of the last one (reaper.py)
        self._reads = threading.BoundedSemaphore(MAX_READS)

    def hashing(self, checkpoint_id: int, rank: int, name: str) -> bool:
        with self._lock:
            return (checkpoint_id, rank, name) in self._hashing

    def sweep(self) -> list[int]:
        """One pass (the lease reaper's): start hashing the fully voted checkpoints' DECLARED
        files whose grace is over, and in `peer` mode try again the commit of those with none
        left (the commit that followed a hash or the last report failed: nothing else would
        try it, and the lease would abandon a checkpoint every rank saved). Only in `peer`
        mode: there the ranks vote before the checks, so the commit is the service's; in the
        other modes the completing vote commits, a rank whose vote failed votes again, and a
        commit cut short by a crash before its manifest is left to the lease
        (lifecycle.recover, tests/service/test_recovery.py). Returns the checkpoints it
        started hashing.

        Its first query is all a pass costs while nothing is that old: only a checkpoint
        begun before the grace started can have a last vote as old (votes follow the begin)."""
        c = self.commits
        grace = grace_seconds(c.settings)
        if grace >= c.settings.lease_seconds:
            self.next_in = c.settings.lease_seconds  # the rule is off: the lease decides
            return []
        now = c.clock()
        due = now - dt.timedelta(seconds=grace)
        with c.sessions() as s, s.begin():
            # a memory checkpoint's DECLARED files have no blob: agents' reports verify them
            # (domain/commit/tiering.py), and the lease decides if they never do
            pending = s.execute(select(Checkpoint.id, Checkpoint.world_size, Checkpoint.created_at)
                                .where(Checkpoint.status == PENDING, Checkpoint.tier == DURABLE)).all()
            old = {ck_id: world for ck_id, world, created in pending if created <= due}
            # nothing to do until the grace has passed since the earliest begin of those
            # pending (one begun later: later still); while one that old is pending, every
            # sweep_interval (its last vote may be recent, a hash may have failed)
            young = [created for _id, _w, created in pending if created > due]
            self.next_in = sweep_interval(c.settings) if old else (
                (min(young) - due).total_seconds() if young else grace)
            if not old:
                return []
            votes = {cid: (n, last) for cid, n, last in s.execute(
                select(Vote.checkpoint_id, func.count(), func.max(Vote.created_at))
                .where(Vote.checkpoint_id.in_(old)).group_by(Vote.checkpoint_id))}
            ready = sorted(cid for cid, (n, last) in votes.items() if n == old[cid] and last <= due)
            declared = list(s.execute(select(Shard.checkpoint_id, Shard.rank, Shard.file_name).where(
                Shard.checkpoint_id.in_(ready), Shard.status == DECLARED))) if ready else []
        started = []
        for cid in ready:
            files = [(r, name) for c_id, r, name in declared if c_id == cid]
            if files:
                if self.start(cid, files, "no checker reported it within the grace"):
                    started.append(cid)
            elif c.settings.verification == "peer":
                self.commit_again(cid)
        return started

    def commit_again(self, checkpoint_id: int) -> bool:
        """Try the commit of a fully voted checkpoint with every file verified, on a thread,
        unless this process is at it already (hashing its files, whose thread commits after;
        a voter committing it; a try of this one). try_commit is safe beside any other
        committer, here or on another replica: the manifest it writes is the same bytes,
        and only one conditional update from PENDING wins."""
        if self.commits.committing(checkpoint_id):
            return False
        with self._lock:
            if checkpoint_id in self._committing or any(k[0] == checkpoint_id for k in self._hashing):
                return False
            self._committing.add(checkpoint_id)
        threading.Thread(target=self._commit, args=(checkpoint_id,), daemon=True,
                         name=f"peer-commit-{checkpoint_id}").start()
        return True

    def _commit(self, checkpoint_id: int) -> None:
        try:
            if not self.commits.shards_present(checkpoint_id):  # lost since they were verified: the lease decides
                log.warning("checkpoint %s: a verified file is missing from the store; not committed", checkpoint_id)
            elif self.commits.try_commit(checkpoint_id):
                log.warning("checkpoint %s: committed by the sweep (no earlier commit attempt succeeded)", checkpoint_id)
        except Exception as e:  # noqa: BLE001 - the next sweep tries again, until the lease decides
            log.warning("checkpoint %s: the sweep's commit attempt failed; will retry: %s", checkpoint_id, e)
        finally:
            with self._lock:
                self._committing.discard(checkpoint_id)

    def start(self, checkpoint_id: int, files: list[tuple[int, str]], why: str) -> bool:
        """Hash these (rank, file) of the checkpoint on a thread, unless already hashing them."""
        with self._lock:
            todo = [(r, n) for r, n in files if (checkpoint_id, r, n) not in self._hashing]
            self._hashing.update((checkpoint_id, r, n) for r, n in todo)
        if not todo:
            return False
        threading.Thread(target=self._run, args=(checkpoint_id, todo, why), daemon=True,
                         name=f"peer-fallback-{checkpoint_id}").start()
        return True

    def _run(self, checkpoint_id: int, files: list[tuple[int, str]], why: str) -> None:
        c = self.commits
        try:
            bad = []
            for rank, name in files:
                with c.sessions() as s, s.begin():
                    sh = s.scalar(select(Shard).where(Shard.checkpoint_id == checkpoint_id, Shard.rank == rank,
                                                      Shard.file_name == name, Shard.status == DECLARED))
                    ck = s.get(Checkpoint, checkpoint_id)
                    if sh is None or ck is None or ck.status != PENDING:
                        continue  # a checker reported it meanwhile, or the checkpoint is decided
                    key, size, want = sh.blob_key, sh.size, sh.xxh3_128
                    ranges = declared_ranges.of_shard(c.store, key_prefix(s, ck), sh)  # the writer's, if declared
                while not self._reads.acquire(timeout=c.settings.lease_seconds / 4):
                    c.renew(checkpoint_id)  # waiting for a turn to read is progress too
                try:
                    got, got_ranges = self._hash(checkpoint_id, key, size, declared_ranges.rule_of(ranges))
                finally:
                    self._reads.release()
                if got == want and got_ranges != fingerprint_of(ranges):  # the bytes are, their range digests not
                    bad.append((rank, name, want, f"{got}, range digests {got_ranges} (not the declared "
                                                  f"{fingerprint_of(ranges)})"))
                elif got == want:
                    self._mark_verified(checkpoint_id, rank, name)
                    log.info("checkpoint %s: the service hashed rank %s's %s (%s)", checkpoint_id, rank, name, why)
                else:
                    bad.append((rank, name, want, got))
            if bad:
                refuse(c, checkpoint_id, [(r, n, w, g, f"the service hashed it: {why}") for r, n, w, g in bad])
            else:
                c.try_commit(checkpoint_id)
        except Exception:  # the next sweep starts over on what is still DECLARED, or commits (sweep)
            log.exception("checkpoint %s: the service's hash of unchecked files failed; will retry", checkpoint_id)
        finally:
            with self._lock:
                self._hashing.difference_update((checkpoint_id, r, n) for r, n in files)

    def _hash(self, checkpoint_id: int, key: str, size: int, rule: dict | None = None
              ) -> tuple[str | None, str | None]:
        """The blob's xxh3-128 and the fingerprint of its range digests recomputed by `rule`
        (None without), renewing the lease as it reads; None if it cannot be read whole."""
        c = self.commits
        hasher = FileCheck(rule)
        renewed = time.monotonic()
        try:
            for chunk in c.store.get(key):  # unmetered: re-hashing serves nobody (core.py)
                hasher.update(chunk)
                if time.monotonic() - renewed > c.settings.lease_seconds / 4:
                    c.renew(checkpoint_id)
                    renewed = time.monotonic()
        except OSError as e:  # missing, or EIO: the stored file is not what was declared
            log.warning("checkpoint %s: cannot read %s: %s", checkpoint_id, key, e)
            return None, None
        if hasher.size != size:
            return None, None
        return hasher.hasher.hexdigest(), fingerprint(hasher.digests())

    def _mark_verified(self, checkpoint_id: int, rank: int, name: str) -> None:
        """Under the checkpoint's row lock, as a report marks its files (then the shards, the
        same order): a report and this hash are serialised, so whichever commits last sees
        no DECLARED file left and tries the commit (tests/catalog/test_peer_check_race.py)."""
        c = self.commits
        with c.sessions() as s, s.begin():
            c.get_checkpoint(s, checkpoint_id, lock=True)
            sh = s.scalar(select(Shard).where(Shard.checkpoint_id == checkpoint_id, Shard.rank == rank,
                                              Shard.file_name == name, Shard.status == DECLARED))
            if sh is not None:
                sh.status = VERIFIED


def refuse(commits, checkpoint_id: int, bad: list, rank: int | None = None) -> tuple[str, str]:
    """Files whose stored bytes are not what their writer declared - (rank, file, declared,
    read or None, how it was read) each: a hash_mismatch event each, and the checkpoint is
    aborted. Returns its status then and the reason."""
    c = commits
    for r, name, want, got, _how in bad:
        c.record_mismatch(ShardHeader(checkpoint_id, r, name, 0, want), got or "unreadable")
    r, name, want, got, how = bad[0]
    reason = (f"peer check: rank {r}'s {name} in the store has xxh3-128 {got or '(unreadable)'}, its writer "
              f"declared {want} ({how}); the checkpoint is not committed")
    try:
        status = c.abort(checkpoint_id, reason, r if rank is None else rank)
    except Exception:  # noqa: BLE001 - committed or expired meanwhile: say what it is
        with c.sessions() as s, s.begin():
            status = c.get_checkpoint(s, checkpoint_id).status
    log.warning("checkpoint %s: %s", checkpoint_id, reason)
    return status, reason

