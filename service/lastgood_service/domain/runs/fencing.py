"""Fencing: each launch of a job gets a generation; writes of older generations are refused.

A launch registers once per (run, attempt) -- every rank may call, the first creates it.
Registration is one transaction on the run's row:

    UPDATE runs SET generation = generation + 1 WHERE id = :run      -- takes the row lock
    INSERT INTO launches (run, attempt, generation)                    -- unique (run, attempt)
    UPDATE checkpoints SET status = 'ABANDONED'
     WHERE run = :run AND status = 'PENDING' AND 0 < generation < :new

so generations are monotone with any number of service replicas over one PostgreSQL
(the UPDATE serialises registrations; two ranks of one launch racing both increment,
but the second INSERT violates the unique key and its transaction, increment included,
rolls back and is retried, finding the first one's row). SQLite serialises every
transaction anyway (BEGIN IMMEDIATE).

The race with an in-flight commit: the commit transaction locks the same run row first
and then changes its checkpoint with a conditional UPDATE that also requires the
checkpoint's generation to be the run's newest (domain/commit/protocol.py, try_commit). So the two
transactions are ordered by that lock: either the commit lands first -- the checkpoint is
COMMITTED, last-good moved, and the relaunch, which reads last-good only after it has
registered, restores it -- or the registration lands first, and then the checkpoint is
already ABANDONED and the commit's UPDATE matches no row. Never both, never a commit of
an older generation after a newer one registered.

Generation 0 is a client that never registered. It writes checkpoints only into a run that
no launch has registered for: once one has, a begin, upload or vote of generation 0 is
refused as fenced (a zombie that drops its generation is not let back in), and registration
abandons pending generation-0 checkpoints like those of older generations. Callers that curate (tag, pin, rollback) without a generation
are operators, never fenced.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from lastgood.wire import names

from ...catalog.models import ABANDONED, PENDING, Checkpoint, Launch, Run, utcnow
from ...metrics import Metrics
from ..errors import Conflict, Fenced, InvalidArgument, NotFound, RateLimited
from ..events import add_event
from ..gate import CatalogGate


def launch_view(launch: Launch, run: Run, current: int) -> dict:
    return {"run": run.name, "attempt": launch.attempt, "generation": launch.generation,
            "world_size": launch.world_size, "registered_at": launch.registered_at.isoformat(),
            "current_generation": current, "fenced": launch.generation < current}


def check_names(run_name: str, attempt: str) -> None:
    """A run name and a launch's attempt id, as begin and registration both take them."""
    try:
        names.check_run_name(run_name)
        names.check_attempt(attempt)
    except names.InvalidName as e:
        raise InvalidArgument(str(e)) from None


# How far a run's generation jumps when its catalog is rebuilt from the store (repair.py):
# past every generation the lost catalog can have handed out after its newest commit, whose
# manifest names its generation. No job registers a million launches without committing.
GENERATION_GAP = 1_000_000


def check(s: Session, run_id: int, generation: int | None, what: str, writes_checkpoints: bool = False) -> None:
    """Refuse `what` when `generation` (the caller's launch) is older than the run's newest.
    None or 0: a caller that did not register; never fenced when it curates, fenced when it
    `writes_checkpoints` (begin, upload, vote) into a run that a launch has registered for.
    (A pending generation-0 checkpoint never commits past a registration either: the
    registration abandons it, under the run's row lock that the commit takes too.)"""
    if not generation:
        # a launch row, not the run's counter: a rebuilt catalog advances the counter of runs
        # whose clients never registered (repair.py), and they write on until one does
        newest = s.scalar(select(Launch).where(Launch.run_id == run_id).order_by(Launch.generation.desc()).limit(1)) \
            if writes_checkpoints else None
        if newest is not None:
            raise Fenced(f"{what} refused: run {s.get(Run, run_id).name!r} takes checkpoints only from registered "
                         f"launches and this caller sent no generation (0); launch {newest.attempt!r} registered "
                         f"at {newest.registered_at.isoformat()} is generation {newest.generation}")
        return
    run = s.get(Run, run_id)
    if generation > run.generation:
        raise InvalidArgument(f"{what}: generation {generation} was never registered for run {run.name!r} "
                              f"(newest: {run.generation})")
    if generation < run.generation:
        newer = s.scalar(select(Launch).where(Launch.run_id == run_id, Launch.generation == run.generation))
        by = f"launch {newer.attempt!r} registered at {newer.registered_at.isoformat()}" if newer else "a newer launch"
        raise Fenced(f"{what} refused: generation {generation} of run {run.name!r} is fenced; "
                     f"{by} is generation {run.generation}")


class Launches:
    def __init__(self, sessions: sessionmaker[Session], clock: Callable[[], dt.datetime] = utcnow,
                 notify: Callable[[], None] | None = None, metrics: Metrics | None = None,
                 gate: CatalogGate | None = None, max_world_size: int = names.MAX_RANK,
                 rate: tuple[int, float] | None = None) -> None:
        self.sessions = sessions
        self.max_world_size = max_world_size
        # (n, seconds): at most n new launches of one run within any `seconds` (settings.launch_rate_*)
        self.rate = rate
        self.gate = gate or CatalogGate()  # closed: a registration would hand out a lost generation again
        self.clock = clock
        self.notify = notify  # wakes votes waiting in this process: their checkpoint may be abandoned
        self.metrics = metrics or Metrics()  # a private registry when the caller keeps none

    def register(self, run_name: str, attempt: str, world_size: int) -> dict:
        """The launch's generation: a new one the first time (run, attempt) registers, the
        same one after that. Creates the run if it has none yet."""
        self.gate.check()
        check_names(run_name, attempt)
        if not 1 <= world_size <= self.max_world_size:
            raise InvalidArgument(f"world size must be 1..{self.max_world_size}, got {world_size}")
        for _ in range(5):
            try:
                view, abandoned = self._register_once(run_name, attempt, world_size)
            except IntegrityError:  # another rank of the launch, or the run's creation, won: read it
                continue
            if abandoned:
                self.metrics.abandoned.labels("fenced").inc(len(abandoned))
                if self.notify:
                    self.notify()
            return view
        raise Conflict(f"concurrent registrations of run {run_name} attempt {attempt} did not settle")

    def _register_once(self, run_name: str, attempt: str, world_size: int) -> tuple[dict, list[int]]:
        with self.sessions() as s, s.begin():
            run = s.scalar(select(Run).where(Run.name == run_name))
            if run is None:
                run = Run(name=run_name, created_at=self.clock(), generation=0)
                s.add(run)
                s.flush()
            old = s.scalar(select(Launch).where(Launch.run_id == run.id, Launch.attempt == attempt))
            if old is not None:
                return launch_view(old, run, s.scalar(select(Run.generation).where(Run.id == run.id))), []
            s.execute(update(Run).where(Run.id == run.id).values(generation=Run.generation + 1))
            now = self.clock()
            self._within_rate(s, run, now)  # under the run's row lock: replicas count alike
            generation = s.scalar(select(Run.generation).where(Run.id == run.id))
            launch = Launch(run_id=run.id, attempt=attempt, generation=generation, world_size=world_size,
                            registered_at=now)
            s.add(launch)
            s.flush()  # the unique (run, attempt) key: a concurrent rank of this launch fails here
            abandoned = sorted(s.scalars(select(Checkpoint.id).where(
                Checkpoint.run_id == run.id, Checkpoint.status == PENDING, Checkpoint.generation < generation)))
            if abandoned:
                s.execute(update(Checkpoint).where(Checkpoint.id.in_(abandoned), Checkpoint.status == PENDING)
                          .values(status=ABANDONED, lease_expires_at=now))
            add_event(s, "launch", run.id, None, generation=generation, attempt=attempt, world_size=world_size)
            if generation > 1:
                prev = s.scalar(select(Launch).where(Launch.run_id == run.id, Launch.generation < generation)
                                .order_by(Launch.generation.desc()).limit(1))
                # where the relaunch resumes, so that the lineage page can mark it on the timeline
                lg = s.get(Checkpoint, run.last_good_id) if run.last_good_id else None
                add_event(s, "fenced", run.id, None, generation=prev.generation if prev else generation - 1,
                          attempt=prev.attempt if prev else None, by_generation=generation, by_attempt=attempt,
                          abandoned=abandoned, last_good_id=lg.id if lg else None, last_good_step=lg.step if lg else None)
            return launch_view(launch, run, generation), abandoned

    def _within_rate(self, s: Session, run: Run, now: dt.datetime) -> None:
        """Refuse a new launch when the run registered `n` within the last `seconds`: each
        one fences the job and abandons its pending saves, so one writer token must not be
        able to do that hundreds of times a minute. A job's own relaunches (torchrun restarts,
        elastic rounds, `lastgood supervise`) each take seconds at least."""
        if not self.rate:
            return
        n, seconds = self.rate
        nth = s.scalar(select(Launch.registered_at).where(Launch.run_id == run.id)
                       .order_by(Launch.generation.desc()).offset(n - 1).limit(1))
        if nth is not None and (wait := (nth - now).total_seconds() + seconds) > 0:
            raise RateLimited(f"run {run.name!r} registered {n} launches in the last {seconds:g} s, the most it "
                              f"may (LASTGOOD_LAUNCH_RATE_MAX per LASTGOOD_LAUNCH_RATE_WINDOW); the next one may "
                              f"register in {wait:.1f} s")

    def current(self, run_name: str) -> dict:
        """The run's newest launch."""
        with self.sessions() as s, s.begin():
            run = s.scalar(select(Run).where(Run.name == run_name))
            if run is None:
                raise NotFound(f"run {run_name!r} does not exist")
            launch = s.scalar(select(Launch).where(Launch.run_id == run.id, Launch.generation == run.generation))
            if launch is None:
                raise NotFound(f"no launch of run {run_name!r} has registered")
            return launch_view(launch, run, run.generation)



def record_refusal(sessions: sessionmaker[Session], run_name: str, checkpoint_id: int | None, **data) -> None:
    """A write of a fenced generation was refused: a zombie of an earlier launch is alive."""
    with sessions() as s, s.begin():
        run_id = s.scalar(select(Run.id).where(Run.name == run_name))
        add_event(s, "fenced_write", run_id, checkpoint_id, **data)
