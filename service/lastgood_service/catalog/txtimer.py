"""Per-transaction lock timings of a catalog engine, labelled by who ran the transaction.

For each transaction: how long BEGIN waited (on SQLite, BEGIN IMMEDIATE waits here for the
single write lock; on PostgreSQL it returns at once and row locks are waited for inside)
and how long it then held on until COMMIT or ROLLBACK. GC reads its own longest
transaction from here, the benchmark the longest of all, and tests bound a commit's wait
by the holds of the transactions it waited behind - figures from the catalog itself, not
from a wall clock around a whole request.
"""

from __future__ import annotations

import contextvars
import functools
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import event
from sqlalchemy.engine import Engine

READ_ONLY = "lastgood_read_only"  # the execution option of catalog/db.py's read-only sessions
_label: contextvars.ContextVar[str] = contextvars.ContextVar("lastgood_tx_label", default="")
KEEP = 20_000  # the newest transactions kept for reading back (a few MB)


@dataclass(frozen=True)
class TxTiming:
    label: str
    started: float   # time.perf_counter() when BEGIN was asked for
    wait: float      # seconds BEGIN took (the write lock, on SQLite)
    hold: float      # seconds from BEGIN's return to COMMIT/ROLLBACK
    read_only: bool = False  # began as a reader (on SQLite: without the write lock)
    # this thread's CPU seconds during the hold: the transaction's own work (on SQLite its
    # SQL too), apart from time lost to other threads and processes on a loaded machine
    cpu: float = 0.0

    @property
    def ended(self) -> float:
        return self.started + self.wait + self.hold


class TxTimer:
    def __init__(self, keep: int = KEEP) -> None:
        self.records: deque[TxTiming] = deque(maxlen=keep)
        self.total = 0  # transactions recorded ever: a mark for since()
        self.counts: dict[str, int] = {}  # transactions ended ever, by label ("" unlabelled): for /metrics
        self._waiting: dict[int, float] = {}  # id(conn.info) -> when its BEGIN was asked for
        self._lock = threading.Lock()

    def install(self, engine: Engine, then=None) -> "TxTimer":
        """Listen on engine; `then(engine)` adds the listeners whose BEGIN is to be timed
        (db.py's BEGIN IMMEDIATE): "begin" listeners run in the order they were added."""
        event.listen(engine, "begin", self._asked)
        if then is not None:
            then(engine)
        event.listen(engine, "begin", self._begun)
        event.listen(engine, "commit", self._ended)
        event.listen(engine, "rollback", self._ended)
        engine.lastgood_txtimer = self  # type: ignore[attr-defined]
        return self

    def _asked(self, conn) -> None:
        now = time.perf_counter()
        conn.info["lastgood_tx"] = [_label.get(), now, None, bool(conn.get_execution_options().get(READ_ONLY)), 0.0]
        with self._lock:
            self._waiting[id(conn.info)] = now

    def _begun(self, conn) -> None:
        with self._lock:
            self._waiting.pop(id(conn.info), None)
        if (t := conn.info.get("lastgood_tx")) is not None:
            t[2] = time.perf_counter()
            t[4] = time.thread_time()

    def waiting(self, stale: float = 60.0) -> int:
        """Transactions waiting in BEGIN now (one whose BEGIN failed is forgotten after `stale` s)."""
        now = time.perf_counter()
        with self._lock:
            return sum(1 for t in self._waiting.values() if now - t < stale)

    def let_waiters_in(self, timeout: float) -> None:
        """Wait (at most `timeout` s) until no transaction waits for BEGIN: a background
        writer calls it between its short transactions. SQLite's busy handler retries a
        waiting BEGIN after sleeps of up to 100 ms, so a writer that begins again at once
        takes the lock back every time and a commit waits for the whole pass; this hands
        the lock to the waiters first. (Within this process: the embedded service is the
        only writer of its SQLite file.)"""
        deadline = time.monotonic() + timeout
        while self.waiting() and time.monotonic() < deadline:
            time.sleep(0.001)

    def _ended(self, conn) -> None:
        t = conn.info.pop("lastgood_tx", None)
        if t is None or t[2] is None:
            return
        self.records.append(TxTiming(t[0], t[1], t[2] - t[1], time.perf_counter() - t[2], t[3],
                                     time.thread_time() - t[4]))
        with self._lock:
            self.total += 1
            self.counts[t[0]] = self.counts.get(t[0], 0) + 1

    def since(self, mark: int = 0, label: str | None = None) -> list[TxTiming]:
        """Transactions recorded after `mark` (`total` taken earlier; the newest KEEP at most),
        of one label or all."""
        records = list(self.records)
        new = min(self.total - mark, len(records))
        return [r for r in (records[-new:] if new > 0 else []) if label is None or r.label == label]


@contextmanager
def labelled(name: str) -> Iterator[None]:
    """Transactions of this thread (or task) inside the block carry `name`."""
    token = _label.set(name)
    try:
        yield
    finally:
        _label.reset(token)


def label(name: str):
    """Decorator: the function's transactions carry `name` (labelled, for a whole call)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with labelled(name):
                return fn(*args, **kwargs)
        return call
    return wrap


def of(sessions) -> TxTimer | None:
    """The timer installed on a sessionmaker's engine, if any."""
    bind = getattr(sessions, "kw", {}).get("bind")
    return getattr(bind, "lastgood_txtimer", None)
