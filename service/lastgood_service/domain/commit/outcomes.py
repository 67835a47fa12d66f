"""How a waiting rank learns its checkpoint's outcome without a thread of its own.

A rank that has voted waits for COMMITTED (or ABANDONED, CORRUPT). Holding a thread per
waiting rank (a waiting CommitRank vote) would cap how many may wait and poll the catalog
once per waiter per interval: at 1,024 ranks most could not wait at all. So a waiter is a
coroutine on the REST server's event loop (GET /api/v1/checkpoints/{id}/outcome?wait=S,
api/routes/outcomes.py) sharing one future per checkpoint, and ONE notifier per service
process decides when to look:

- a change made in this process (a commit, an abort, an expiry: _notify in domain/commit/core.py)
  pokes it, and it reads every watched checkpoint's status in one query at once; a commit
  says which checkpoint it committed, after its transaction, and that checkpoint's waiters
  are answered without the read;
- a change made by another replica on the same catalog is seen by the same one query,
  repeated every `outcome_poll_interval` seconds while anything is watched.

So the catalog sees one small query per interval per service process, whatever the number
of waiting ranks, and a waiting rank costs a connection, a coroutine and a timer. A decided
outcome is one `Outcome` per checkpoint, its JSON made once (`body`) and sent as is to every
waiter, and to every rank that asks within `DECIDED_KEPT_S` after: no read, no encoding per rank.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ...catalog.models import PENDING, Checkpoint, Vote
from ..errors import NotFound

log = logging.getLogger("lastgood.outcomes")

# how long a decided outcome is answered from memory to a rank that asks after it was decided:
# the ranks of a large job arrive over a second or so; a decision made on another replica is
# seen as late as the poll interval anyway
DECIDED_KEPT_S = 2.0


@dataclass(frozen=True)
class Outcome:
    checkpoint_id: int
    status: str
    missing_ranks: list[int]  # only while PENDING: the ranks that have not voted

    def view(self) -> dict:
        return {"checkpoint_id": self.checkpoint_id, "status": self.status, "missing_ranks": self.missing_ranks}

    @cached_property
    def body(self) -> bytes:
        """The answer's JSON, made once however many waiters it is sent to."""
        return json.dumps(self.view(), separators=(",", ":")).encode()


def read_statuses(sessions: sessionmaker[Session], ids: Iterable[int]) -> dict[int, str]:
    """The status of each checkpoint that exists, in one query."""
    ids = list(ids)
    if not ids:
        return {}
    with sessions() as s:
        return dict(s.execute(select(Checkpoint.id, Checkpoint.status).where(Checkpoint.id.in_(ids))).all())


def read_outcome(sessions: sessionmaker[Session], checkpoint_id: int) -> Outcome:
    with sessions() as s:
        ck = s.get(Checkpoint, checkpoint_id) if checkpoint_id > 0 else None
        if ck is None:
            raise NotFound(f"checkpoint {checkpoint_id} does not exist")
        if ck.status != PENDING:
            return Outcome(ck.id, ck.status, [])
        voted = set(s.scalars(select(Vote.rank).where(Vote.checkpoint_id == checkpoint_id)))
        return Outcome(ck.id, ck.status, sorted(set(range(ck.world_size)) - voted))


class OutcomeNotifier:
    """One per service process. `poke()` may be called from any thread; `wait()` runs on
    the event loop that serves the waiters (uvicorn's)."""

    def __init__(self, sessions: sessionmaker[Session], interval: float,
                 read: Callable[[Iterable[int]], dict[int, str]] | None = None) -> None:
        self.sessions = sessions
        self.interval = interval
        self._read = read or (lambda ids: read_statuses(sessions, ids))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: dict[int, asyncio.Future] = {}  # checkpoint id -> its Outcome (or None: no such id)
        self._decided: dict[int, tuple[float, Outcome]] = {}  # checkpoint id -> (when, its outcome): DECIDED_KEPT_S
        self._wake: asyncio.Event | None = None
        self._pending: dict[int, tuple[float, asyncio.Future]] = {}  # checkpoint id -> (when, its read)
        self._task: asyncio.Task | None = None
        self.reads = 0  # catalog reads made, for the benchmark and /metrics-style checks

    def poke(self, decided: Mapping[int, str] | None = None) -> None:
        """Something changed in this process: look now (thread-safe, never blocks).
        `decided`: checkpoints whose new status is known and already committed to the
        catalog (a commit's): their waiters are answered at once, without a read."""
        loop = self._loop
        if loop is not None and self._wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._poked, dict(decided or {}))
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _poked(self, decided: dict[int, str]) -> None:
        if not decided:  # a change this poke does not name (abort, expiry, corruption):
            self._decided = {}  # nothing remembered may outlive it
        for cid, status in decided.items():
            self._resolve(cid, status, keep=True)
        self._wake.set()

    def _resolve(self, cid: int, status: str | None, keep: bool = False) -> None:
        """Answer every waiter of a decided checkpoint (status None: it does not exist) with
        one shared Outcome; `keep` (a commit's own poke, made after its transaction)
        remembers it for the ranks that ask shortly after. What a read found is not kept:
        the read may have raced a later change whose poke already came."""
        outcome = Outcome(cid, status, []) if status is not None else None
        if outcome is not None and keep:
            now = self._loop.time()
            self._decided = {k: v for k, v in self._decided.items() if now - v[0] < DECIDED_KEPT_S}
            self._decided[cid] = (now, outcome)
        fut = self._watched.pop(cid, None)
        self._pending.pop(cid, None)
        if fut is not None and not fut.done():
            fut.set_result(outcome)

    def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # first use, or a new loop (tests run apps on several)
            self._loop, self._watched, self._task, self._pending, self._decided = loop, {}, None, {}, {}
            self._wake = asyncio.Event()

    async def wait(self, checkpoint_id: int, timeout: float) -> Outcome:
        """The checkpoint's outcome as soon as it is decided, or its state after `timeout`."""
        if timeout <= 0:
            return await asyncio.to_thread(read_outcome, self.sessions, checkpoint_id)
        self._bind()
        known = self._decided.get(checkpoint_id)
        if known is not None and self._loop.time() - known[0] < DECIDED_KEPT_S:
            return known[1]
        fut = self._watched.get(checkpoint_id)
        if fut is None:
            fut = self._watched[checkpoint_id] = self._loop.create_future()
            self._wake.set()  # a new checkpoint to watch: read it at once (it may be decided already)
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._watch())
        # asyncio.wait does not cancel the shared future when this waiter times out
        await asyncio.wait((fut,), timeout=timeout)
        if fut.done():
            outcome = fut.result()
            if outcome is None:
                raise NotFound(f"checkpoint {checkpoint_id} does not exist")
            return outcome
        return await self._still_pending(checkpoint_id)

    async def _still_pending(self, checkpoint_id: int) -> Outcome:
        """Who has not voted, for a waiter whose wait ran out: one read per checkpoint per
        interval, shared by every waiter that times out meanwhile (a thousand ranks waiting
        2 s each time out 500 times a second; a read each queued them behind one another
        and, on SQLite, behind the votes for the write lock)."""
        now = self._loop.time()
        entry = self._pending.get(checkpoint_id)
        if entry is None or (entry[1].done() and now - entry[0] >= self.interval):
            entry = self._pending[checkpoint_id] = (now, asyncio.ensure_future(
                asyncio.to_thread(read_outcome, self.sessions, checkpoint_id)))
        return await asyncio.shield(entry[1])

    async def _watch(self) -> None:
        """Read every watched checkpoint's status in one query: at once when poked or when a
        new checkpoint is watched, else every interval; ends when nothing is watched."""
        while self._watched:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except asyncio.TimeoutError:  # the builtin only from Python 3.11
                pass
            self._wake.clear()
            ids = list(self._watched)
            if not ids:  # a commit answered everything watched (_poked): nothing to read
                continue
            try:
                statuses = await asyncio.to_thread(self._read, ids)
                self.reads += 1
            except Exception:  # the catalog is away: the waiters time out and ask again
                log.exception("reading checkpoint outcomes failed; will retry")
                await asyncio.sleep(self.interval)
                continue
            for cid in ids:
                status = statuses.get(cid)
                if status != PENDING and cid in self._watched:
                    self._resolve(cid, status)
