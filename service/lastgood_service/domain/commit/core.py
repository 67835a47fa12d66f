"""What every part of the commit shares: the catalog, the store, the clock, the lease, and
the condition a waiting vote sleeps on (domain/commit/__init__.py assembles the parts)."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable

from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from ...blobstore import BlobStore, capabilities
from ...blobstore.metered import MeteredBlobStore
from ...catalog.models import PENDING, Checkpoint, Run, utcnow
from ...failpoints import Failpoint
from ...metrics import Metrics
from ...settings import Settings
from .. import keys
from ..runs import fencing
from ..errors import FailedPrecondition, InvalidArgument, NotFound, StoreFull
from ..gate import CatalogGate
from ..sealing import ManifestKeys
from .votebatch import VoteBatcher


def key_prefix(s: Session, ck: Checkpoint) -> str:
    """The folder of ck's blobs (domain/keys.py says why it is not the id alone)."""
    return keys.prefix(ck.id, s.get(Run, ck.run_id).name, ck.step, ck.attempt)


class CommitCore:
    """The state the parts share; each part is a subclass, CommitService is all of them."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], blobs: BlobStore,
                 clock: Callable[[], dt.datetime] = utcnow, metrics: Metrics | None = None,
                 gate: CatalogGate | None = None, manifest_keys: ManifestKeys | None = None) -> None:
        self.settings = settings
        # what seals every manifest written (domain/sealing.py): main.py passes the settings'
        # keys; without them, a key of this object's own (in-process tests and tools)
        self.manifest_keys = manifest_keys or ManifestKeys.generate()
        self.gate = gate or CatalogGate()
        self.sessions = sessions
        self.clock = clock
        self.metrics = metrics or Metrics()  # a private registry when the caller keeps none
        # The data path (uploads, downloads) goes through the meter, which counts the shard
        # bytes; verification reads `store` itself: re-hashing is not serving anyone.
        self.store = blobs
        self.blobs = MeteredBlobStore(blobs, self.metrics)
        self._changed = threading.Condition()
        # set when a memory checkpoint commits: the composition root (main.py) then runs GC's
        # incremental pass, so the memory retention frees agents' segments within seconds
        self.memory_committed = threading.Event()
        # told of every change _notify announces, with what was decided if known (domain/commit/outcomes.py)
        self.listeners: list[Callable[[dict[int, str] | None], None]] = []
        # told of the checkpoints that ended without a commit (an abort, a lease expiry), after
        # the transaction: the composition root (main.py) has the direct S3 uploads they left
        # open aborted (domain/dataplane/grants.py, DirectUploads.end)
        self.end_listeners: list[Callable[[list[int]], None]] = []
        # hashes recorded DECLARED files of a checkpoint now, in the background: (checkpoint, [(rank,
        # file)], why). The composition root sets the process's one peer fallback's `start`
        # (domain/peer/peer_fallback.py); unset, the fallback's sweep hashes them after the grace
        self.confirm: Callable[[int, list[tuple[int, str]], str], object] | None = None
        # votes that arrive together are written in one transaction (votebatch.py)
        self.vote_batches = VoteBatcher(self, settings.vote_batch_window, settings.failpoint)
        self._fail_commit_once = settings.failpoint == Failpoint.COMMIT_FAILS_ONCE  # testing only (protocol.try_commit)
        self.launches = fencing.Launches(sessions, clock, notify=self._notify, metrics=self.metrics, gate=self.gate,
                                         max_world_size=settings.max_world_size,
                                         rate=(settings.launch_rate_max, settings.launch_rate_window))

    # ------------------------------------------------------------ shared by the parts and
    # by the commit's neighbours (the data paths, peer verification): public, so that no
    # neighbour reaches into the commit's private state
    def lease_from_now(self) -> dt.datetime:
        """When a lease renewed now ends: what rank activity sets `lease_expires_at` to
        (settings.lease_seconds)."""
        return self.clock() + dt.timedelta(seconds=self.settings.lease_seconds)

    def _lease_slack(self) -> dt.timedelta:
        """How stale a lease may be before a begin renews it: a quarter of it (puts renew as often)."""
        return dt.timedelta(seconds=self.settings.lease_seconds / 4)

    def renew(self, checkpoint_id: int) -> None:
        """Renew the lease of a PENDING checkpoint, in a transaction of its own (a long read
        of one of its files is rank activity too); a checkpoint no longer PENDING is left alone."""
        with self.sessions() as s, s.begin():
            s.execute(update(Checkpoint)
                      .where(Checkpoint.id == checkpoint_id, Checkpoint.status == PENDING)
                      .values(lease_expires_at=self.lease_from_now()))

    def get_checkpoint(self, s: Session, checkpoint_id: int, lock: bool = False) -> Checkpoint:
        """The checkpoint's row in the caller's transaction, NotFound if there is none.
        `lock`: its row lock, which serialises votes, file records, peer reports and commits."""
        ck = s.get(Checkpoint, checkpoint_id, with_for_update=lock) if checkpoint_id > 0 else None
        if ck is None:
            raise NotFound(f"checkpoint {checkpoint_id} does not exist")
        return ck

    def check_rank(self, ck: Checkpoint, rank: int) -> None:
        """InvalidArgument unless `rank` is one of the checkpoint's world."""
        if not 0 <= rank < ck.world_size:
            raise InvalidArgument(f"rank {rank} is outside world size {ck.world_size} of checkpoint {ck.id}")

    @staticmethod
    def require_pending(ck: Checkpoint, what: str) -> None:
        """FailedPrecondition unless the checkpoint is PENDING; `what` names the operation."""
        if ck.status != PENDING:
            raise FailedPrecondition(f"cannot {what}: checkpoint {ck.id} is {ck.status}, not PENDING")

    def _require_room(self, size: int) -> None:
        """Refuse a shard the store cannot hold before a byte of it is written, keeping
        `store_reserve_bytes` free for the catalog and for GC's own writes (0: unknown size)."""
        free = capabilities.free_bytes(self.blobs) if size else None
        if free is not None and size > free - self.settings.store_reserve_bytes:
            raise StoreFull(f"store full: {free} bytes free, a shard of {size} bytes does not fit beside the "
                            f"{self.settings.store_reserve_bytes}-byte reserve; free space (GC, retention) "
                            f"or grow the volume")

    def committing(self, checkpoint_id: int) -> bool:
        """Is a voter of this process committing the checkpoint right now (votebatch.py)?"""
        return self.vote_batches.committing(checkpoint_id)

    def _notify(self, decided: dict[int, str] | None = None) -> None:
        """Wake whoever waits on a change. `decided`: checkpoints whose new status the caller
        knows and has committed (the commit's), passed on so that their waiters are answered
        without a catalog read (domain/commit/outcomes.py)."""
        with self._changed:
            self._changed.notify_all()
        for listener in self.listeners:
            listener(decided)
