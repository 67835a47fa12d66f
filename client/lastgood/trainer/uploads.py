"""The Checkpointer's bookkeeping between save() and its background thread: the queue of
snapshots waiting for upload, and the record of what committed and what was given up.

Why a queue of its own: while the service is away, a snapshot that waits for upload is
worth less with every newer one, and the trainer must not wait for either. When save()
needs a staging buffer and every buffer is taken while uploads are failing (retrying
transient errors, since the last upload that committed), the oldest waiting snapshot is
given up and its buffer reused; if none is waiting, the upload in flight is asked to give up instead (its retry
loop polls `wanted`). With a healthy service save() waits for a free buffer.
Memory stays at the pool's buffers however long the outage lasts.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from lastgood.state.staging import Snapshot

KEEP = 20  # given-up saves remembered in detail (the counters count them all)


class UploadQueue:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._waiting: deque[Snapshot | None] = deque()
        self._busy = False
        self.wanted = False      # a save() waits for a buffer
        self.troubled = False    # uploads are failing transiently (the service is away); until one succeeds

    def put(self, snap: Snapshot | None) -> None:
        with self._cv:
            self._waiting.append(snap)
            self._cv.notify_all()

    def get(self) -> Snapshot | None:
        with self._cv:
            self._cv.wait_for(lambda: bool(self._waiting))
            self._busy = True
            return self._waiting.popleft()

    def task_done(self, committed: bool) -> None:
        with self._cv:
            self._busy = False
            if committed:
                self.troubled = False
            self._cv.notify_all()

    def drop_oldest_if_troubled(self) -> Snapshot | None:
        """The oldest waiting snapshot, removed, if the upload in flight is failing."""
        with self._cv:
            if self.troubled and self._waiting and self._waiting[0] is not None:
                return self._waiting.popleft()
            return None

    def stop_asked(self) -> bool:
        """Asked by the upload's retry loop after each transient failure."""
        with self._cv:
            self.troubled = True
            return self.wanted

    def join(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._waiting and not self._busy)


@dataclass
class SaveRecord:
    """What this rank's saves came to, for wait()'s verdict and the operator. Saves are
    numbered in the order save() was called: the verdict asks whether the newest save
    committed, not whether its step did (a step may be saved twice, launch.py)."""
    requested: int | None = None          # step of the newest save() call
    requested_seq: int | None = None      # its number; None: nothing to report
    committed_seq: int | None = None      # number of the newest save that committed
    saves: int = 0
    committed: list[int] = field(default_factory=list)   # newest KEEP steps
    given_up: list[tuple[int, str]] = field(default_factory=list)  # newest KEEP (step, why)
    unreported: list[tuple[int, str]] = field(default_factory=list)  # not yet posted as an event
    told: int = 0                         # given-up saves wait() has already mentioned
    counts: dict = field(default_factory=lambda: {"saves_committed": 0, "saves_given_up": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, step: int | None) -> int:
        """A save() of `step` (None: the verdict is given; nothing to report): its number."""
        with self.lock:
            self.saves += 1
            self.requested = step
            self.requested_seq = None if step is None else self.saves
            return self.saves

    def commit(self, step: int, seq: int | None = None) -> None:
        """Save number `seq` (None: an older one whose outcome was missed) committed."""
        with self.lock:
            self.counts["saves_committed"] += 1
            self.committed = (self.committed + [step])[-KEEP:]
            if seq is not None:
                self.committed_seq = max(seq, self.committed_seq or 0)

    def give_up(self, step: int, why: str) -> None:
        with self.lock:
            self.counts["saves_given_up"] += 1
            self.given_up = (self.given_up + [(step, why)])[-KEEP:]
            self.unreported = (self.unreported + [(step, why[:300])])[-KEEP:]

    def final_committed(self) -> bool:
        with self.lock:
            return self.requested_seq is None or self.committed_seq == self.requested_seq

    def summary(self) -> str:
        with self.lock:
            done = ", ".join(map(str, self.committed[-5:])) or "none"
            lost = "; ".join(f"step {s}: {why}" for s, why in self.given_up[-5:]) or "none"
            return (f"newest save requested: step {self.requested}; committed: {self.counts['saves_committed']} "
                    f"(latest steps {done}); given up: {self.counts['saves_given_up']} (latest: {lost})")

    def take_unreported(self) -> list[tuple[int, str]]:
        with self.lock:
            out, self.unreported = self.unreported, []
            return out

    def put_back(self, items: list[tuple[int, str]]) -> None:
        with self.lock:
            self.unreported = (items + self.unreported)[-KEEP:]
