"""The Checkpointer's background half: the thread that uploads each snapshot save() queued.

One snapshot at a time, in order: settle the checkpoints whose outcome this rank missed,
converge the ranks on a step while saves are given up or failing (an outage), then begin,
stream, vote and wait for the commit (or hand a memory save to the memory tier). A save
that fails is given up (logged, counted, posted as a `save_given_up` event once the service
answers again) and its buffer goes back to the pool; a refusal because a newer launch
registered fences the Checkpointer. wait() reports what this thread recorded
(docs/availability.md, docs/fencing.md).

UploadWorker is a mixin of Checkpointer (trainer/checkpointer.py): it works on the
attributes Checkpointer sets up (transport, session, pool, queue, record, fence).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lastgood.common import joblog
from lastgood.errors import Fenced, ServiceError
from lastgood.state.staging import Snapshot
from lastgood.wire import tiers
from lastgood.wire.format import file_names

log = logging.getLogger("lastgood")


@dataclass
class SaveResult:
    step: int
    checkpoint_id: int


class UploadWorker:
    """The upload thread's loop and the steps of one upload (mixed into Checkpointer)."""

    def _given_up(self, step: int, why: str) -> None:
        joblog.incident(log, logging.WARNING, "lastgood: run %s: save of step %s given up, training goes on: %s",
                        self.run, step, why)
        self._gave_up_since_commit = True
        self._record.give_up(step, why)

    def _run(self) -> None:
        while True:
            snap = self._jobs.get()
            committed = False
            try:
                if snap is None:
                    return
                if self._fenced is None:  # a fenced launch uploads nothing more
                    with self.transport.stoppable(self._jobs.stop_asked):
                        if self._upload(snap) is False:  # a memory save given up: an event said so
                            continue
                        committed = True
                        self._gave_up_since_commit = False
                        self._record.commit(snap.step, snap.seq)
                        self._report_given_up()
            except BaseException as e:  # noqa: BLE001 - every failure is reported by wait()
                fenced = self._as_fenced(e)
                if fenced is not None:
                    log.error("lastgood: %s", fenced)
                    self._fenced = self._fenced or fenced
                else:
                    self._last_error = e
                    self._given_up(snap.step, str(e))
            finally:
                if snap is not None:
                    self._pool.release(snap.buffer)
                self._jobs.task_done(committed)

    def _report_given_up(self) -> None:
        """The service answers again: tell it which saves were given up meanwhile."""
        items = self._record.take_unreported()
        if not items:
            return
        try:
            self.transport.record_event(self.run, "save_given_up", {
                "rank": self.rank, "count": len(items), "steps": [s for s, _ in items], "reason": items[-1][1]})
        except ServiceError as e:
            joblog.incident(log, logging.WARNING, "lastgood: could not record the given-up saves: %s", e)
            self._record.put_back(items)

    def _upload(self, snap: Snapshot) -> bool | None:
        if self._jobs.troubled:
            # the service was away at the last try: wait for it (retrying, until a newer save
            # wants this buffer) before writing a whole shard to the spool for nothing
            self.transport.service_info()
        self._session.settle(self._committed_after_all)
        # while saves are given up or failing (an outage), the ranks converge on a step
        converging = lambda: self._jobs.troubled or self._gave_up_since_commit  # noqa: E731
        if converging():
            self._session.converge(snap.step, snap.attempt)
        if getattr(snap, "tier", None) == tiers.Tier.MEMORY:
            cid = self.memory.save(self._session, snap.step, self.world_size, snap.attempt,
                                   list(zip(file_names(self.file_name, len(snap.views())), snap.views())))
            return cid is not None
        up = self._session.checkpoint(snap.step)
        # on the service's host the shard is handed over as a file, hashed as it is written;
        # written before begin, so that a long write never runs into the checkpoint's lease
        # a large state as several files, written, hashed and handed over concurrently (state/split.py)
        views = snap.views()
        up.add_all(list(zip(file_names(self.file_name, len(views)), views)))
        up.begin(self.world_size, snap.attempt)
        up.commit(converging=converging)
        self.last_saved = SaveResult(snap.step, up.checkpoint_id)

    def _committed_after_all(self, step: int, cid: int) -> None:
        """A save whose outcome this rank missed did commit, with its bytes."""
        self.last_saved = SaveResult(step, cid)
        self._record.commit(step)

    def _as_fenced(self, e: BaseException) -> Fenced | None:
        """Fenced, if the service refused a write of this save because a newer launch registered."""
        while e is not None:
            if isinstance(e, Fenced) and not e.coded:  # said here already
                return e
            if isinstance(e, Fenced):  # the service's refusal: say what it means for this job
                return Fenced(f"run {self.run!r}: this launch (attempt {self.launch}, generation {self.generation}) "
                              f"is fenced by a newer launch of the job; stop training. {e}")
            e = e.__cause__
        return None
