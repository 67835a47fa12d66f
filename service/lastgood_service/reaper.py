"""The service's background passes over pending checkpoints, each run when it can have work.

Three passes share one thread: lease expiry (a rank died: ABANDONED), peer verification's
liveness pass (domain/peer/peer_fallback.py: the service hashes what no checker reported, and
commits what is left), and the spool's sweep (files whose writer died). Run on every
`reaper_interval` (1 s), the first two would be two catalog transactions a second whatever
was pending: most of an idle service's CPU, paid by a pending save the longer it takes
(bench/README.md, "Data paths"). So each pass says when it can next have work, and the
thread sleeps until the earliest of them:

- expiry: the earliest lease of a PENDING checkpoint, or a lease from now when none is
  pending, and never more than EXPIRY_RECHECK_S. A checkpoint begun or renewed later
  expires later than that (every lease is `lease_seconds` from its last renewal), so an
  expiry is found as soon as a pass every `reaper_interval` would find it. The cap is for
  replicas sharing a catalog with different leases (a rolling change of
  `LASTGOOD_LEASE_SECONDS`): a checkpoint begun by a replica with a shorter lease, which
  then stops, is found at most that late;
- the peer pass: `peer_fallback.PeerFallback.next_in` (the grace of the youngest
  checkpoint's begin, or every `sweep_interval` while an older one is pending);
- the spool: every SPOOL_SWEEP_INTERVAL.

Never more often than `reaper_interval`, and a pass that fails runs again after it.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time

from .catalog import txtimer

log = logging.getLogger("lastgood")

SPOOL_SWEEP_INTERVAL = 60.0
EXPIRY_RECHECK_S = 30.0  # the longest the expiry pass sleeps, whatever this replica's lease (see above)


class Reaper:
    def __init__(self, service) -> None:
        self.service = service

    def until(self, when: dt.datetime | None, cap: float) -> float:
        """Seconds from now (the commit service's clock) until `when`, within 0..cap."""
        if when is None:
            return cap
        return min(cap, max(0.0, (when - self.service.commits.clock()).total_seconds()))

    def run(self, stop: threading.Event) -> None:
        svc, s = self.service, self.service.settings
        every = s.reaper_interval
        # time.monotonic() of each pass's next run: the first of each after one interval
        expire_at = check_at = spool_at = time.monotonic() + every
        fallback = svc.peer_fallback
        while not stop.wait(max(0.0, min(expire_at, check_at, spool_at) - time.monotonic())):
            now = time.monotonic()
            if now >= check_at:
                check_at = now + every  # unless the pass says otherwise
                try:  # peer verification's liveness rule: unchecked files of fully voted checkpoints
                    with txtimer.labelled("peer_sweep"):  # /metrics counts each pass's transactions
                        fallback.sweep()
                    check_at = time.monotonic() + max(every, fallback.next_in)
                except Exception:
                    log.exception("peer-check fallback pass failed; will retry")
            if now >= expire_at:
                expire_at = now + every
                try:
                    with txtimer.labelled("expire"):
                        svc.commits.expire_leases()
                    expire_at = time.monotonic() + max(every, self.until(svc.commits.next_expiry,
                                                                       min(s.lease_seconds, EXPIRY_RECHECK_S)))
                except Exception:
                    log.exception("lease reaper pass failed; will retry")
            if now >= spool_at:
                spool_at = now + max(every, SPOOL_SWEEP_INTERVAL)
                self._sweep_spool()

    def _sweep_spool(self) -> None:
        svc, s = self.service, self.service.settings
        if not svc.spool:
            return
        try:  # files whose writer died before handing them over, links whose reader died
            svc.spool.sweep(max(s.gc_grace_seconds, s.lease_seconds))
            svc.spool.sweep_lent(max(s.lease_seconds, SPOOL_SWEEP_INTERVAL))
            if svc.direct_fs:  # direct-FS writers that died before handing over
                svc.direct_fs.sweep(max(s.gc_grace_seconds, s.lease_seconds))
        except Exception:
            log.exception("spool sweep failed; will retry")
