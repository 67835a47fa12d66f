"""Run health: heartbeats in, verdicts and the checkpoint interval out (docs/health.md).

Every rank beats through its Checkpointer's background thread (client lastgood/remote/heartbeat.py).
A beat is one upsert of the rank's row -- a job of N ranks holds N rows however long it
runs -- which also keeps what the verdicts need from the past: a smoothed step time, a
slowly decaying maximum step time, the smoothed save stall, and when the step or the
phase last changed. Times are the service's clock.

Verdicts (domain/health/verdicts.py) are computed when asked (GET .../health), so any replica
answers alike. A sweep (Service._health_loop, every `health_interval`) computes them for
every run that beat recently, keeps the time each straggler became an outlier, and
records each change of a rank's verdict to hung, straggler or lost as an event of that
kind -- once, even with several replicas: the verdict column changes by a conditional
UPDATE and only the replica whose UPDATE matched records the event.

Interval: the Young/Daly optimum (lastgood/common/interval.py) from C, the largest smoothed
save stall any current rank reports, and M, the run's mean time between failures: the
time since its first launch over the failures seen, or the configured prior before the
first. Failures are relaunches (each launch after the first), torchrun restarts, hangs,
lost ranks and the relaunches `lastgood supervise` records (`supervisor_restart`); signals closer
together than `failure_merge_seconds` are one failure (a hang, the supervisor's kill and
its relaunch are one incident).

Finished: when every rank of the newest launch has closed its Checkpointer (its last beat
says `idle`), the run is finished: no rank is judged, there is no hang timeout, and the
interval's exposure ends at the last beat, so its MTBF stays what it was. A relaunch beats
`train` again and the run is live once more.

`failures` in the answer are the run's recent failure events (events.recent_failures), the
same count as the runs overview's, so the page's badge and `lastgood show` agree.
"""

from __future__ import annotations

import datetime as dt
import logging
import statistics
from collections.abc import Callable
from types import SimpleNamespace

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from lastgood.common import interval as math_
from lastgood.wire import names
from lastgood.wire.vocab import Phase

from ...catalog.models import Checkpoint, Event, Heartbeat, Launch, Run, utcnow
from ..errors import InvalidArgument, NotFound
from ..events import FAILURE_WINDOW_S, add_event, recent_failures
from ..gate import CatalogGate
from ..runs import fencing
from . import verdicts

log = logging.getLogger("lastgood.health")
PHASES = tuple(p.value for p in Phase)

SMOOTH = 0.3          # weight of a new step time in the smoothed one
SLOWEST_DECAY = 0.95  # per beat: a slow step is forgotten over ~14 beats (halved)
STALL_SMOOTH = 0.5
FAILURE_KINDS = ("restart", "hung", "lost", "supervisor_restart")
SWEEP_HORIZON_S = 3600.0  # the sweep looks at runs that beat within this long
MAX_LISTED = 1000    # ranks of a run listed as missing (not beaten yet), at most
MAX_SECONDS = 1e7     # bound on any duration a beat reports (~116 days)


def _age(now: dt.datetime, then: dt.datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


class Health:
    def __init__(self, sessions: sessionmaker[Session], limits: verdicts.Limits, mtbf_prior_s: float,
                 failure_merge_s: float, clock: Callable[[], dt.datetime] = utcnow, metrics=None,
                 gate: CatalogGate | None = None) -> None:
        self.sessions = sessions
        self.limits = limits
        self.mtbf_prior_s = mtbf_prior_s
        self.failure_merge_s = failure_merge_s
        self.clock = clock
        self.metrics = metrics
        self.gate = gate or CatalogGate()
        # Beats sent while this process was not running could not arrive: silence is counted
        # from when it could hear at the earliest, so an outage longer than the hang timeout
        # does not make every rank hung (and a supervisor kill a healthy job) when it ends.
        self.up_since = clock()

    @classmethod
    def from_settings(cls, sessions, settings, **kw) -> "Health":
        limits = verdicts.Limits(factor=settings.hang_factor, floor_s=settings.hang_floor_seconds,
                                 first_step_s=settings.hang_first_step_seconds, save_s=settings.hang_save_seconds,
                                 override_s=settings.hang_timeout, z=settings.straggler_z,
                                 ratio=settings.straggler_ratio, window_s=settings.straggler_window_seconds)
        return cls(sessions, limits, settings.mtbf_prior_hours * 3600.0, settings.failure_merge_seconds, **kw)

    # ---------------------------------------------------------------- beats
    def beat(self, run_name: str, b: dict) -> None:
        """Upsert the rank's row from one beat (validated by the router's model; checked again
        here, as every domain entry point does)."""
        self.gate.check()
        _check(run_name, b)
        for attempt in range(3):
            try:
                self._beat_once(run_name, b)
                break
            except IntegrityError:  # two first beats of one rank raced: the second updates
                if attempt == 2:
                    raise
        if self.metrics:
            self.metrics.heartbeats.inc()

    def _beat_once(self, run_name: str, b: dict) -> None:
        now = self.clock()
        gen = b.get("generation") or 0
        with self.sessions() as s, s.begin():
            run = s.scalar(select(Run).where(Run.name == run_name))
            if run is None:
                raise NotFound(f"run {run_name!r} does not exist (register a launch or save first)")
            fencing.check(s, run.id, gen, "heartbeat")
            _within_world(s, run, gen, b)
            row = s.get(Heartbeat, (run.id, b["rank"]), with_for_update=True)
            if row is not None and gen < row.generation:
                return  # an unregistered straggler of an older launch: the newer row stays
            if row is None or gen > row.generation or b.get("attempt") != row.attempt:
                if row is None:
                    row = Heartbeat(run_id=run.id, rank=b["rank"])
                    s.add(row)
                _reset(row, now)  # a new launch: its past step times and verdicts are not this one's
            if b.get("step") != row.step or b["phase"] != row.phase:
                row.progress_at = now
            x = b.get("step_seconds")
            if x is not None:
                row.typical_step_s = x if row.typical_step_s is None else SMOOTH * x + (1 - SMOOTH) * row.typical_step_s
            longest = max(b.get("max_step_seconds") or 0.0, x or 0.0)
            if longest or row.slowest_step_s:
                row.slowest_step_s = max(longest, (row.slowest_step_s or 0.0) * SLOWEST_DECAY)
            stall = b.get("save_stall_s")
            if stall is not None:
                row.save_stall_s = stall if row.save_stall_s is None else (
                    STALL_SMOOTH * stall + (1 - STALL_SMOOTH) * row.save_stall_s)
            row.world_size, row.generation, row.attempt = b["world_size"], gen, b.get("attempt")
            row.step, row.step_seconds, row.phase = b.get("step"), x, b["phase"]
            row.period_s = b.get("period_s")
            row.beats = (row.beats or 0) + 1
            row.beat_at = now

    # ---------------------------------------------------------------- verdicts
    def view(self, run_name: str, hang_timeout: float | None = None) -> dict:
        """The run's health: per rank its latest beat and verdict, the hung, straggling and
        lost ranks, the timeout in force, and the checkpoint interval."""
        limits = self.limits if hang_timeout is None else _with_override(self.limits, hang_timeout)
        now = self.clock()
        with self.sessions() as s, s.begin():
            run = s.scalar(select(Run).where(Run.name == run_name))
            if run is None:
                raise NotFound(f"run {run_name!r} does not exist")
            rows = _current(_rows(s, run.id))
            ended = finished_at(rows)
            iv = self._interval(s, run, rows, ended or now)
            fails = recent_failures(s, [run.id]).get(run.id, {"count": 0, "last_at": None, "kinds": {}})
        ranks = [_rank(r, now, self.up_since) for r in rows]
        steady, states = verdicts.judge(ranks, limits)
        world = max(rows, key=lambda r: r.beat_at).world_size if rows else None
        seen = {r.rank for r in rows}
        items = []
        for r, v in zip(rows, ranks):
            items.append({"rank": r.rank, "step": r.step, "phase": r.phase, "age_s": round(v.beat_age, 3),
                          "progress_age_s": round(v.progress_age, 3), "step_seconds": r.step_seconds,
                          "typical_step_s": r.typical_step_s, "save_stall_s": r.save_stall_s,
                          "timeout_s": None if ended else verdicts.rank_timeout(v, steady, limits),
                          "state": states[r.rank]})
        return {"run": run.name, "world_size": world, "generation": rows[0].generation if rows else None,
                "finished": ended is not None, "finished_at": ended.isoformat() if ended else None,
                "timeout_s": steady if rows and not ended else None, "ranks": items,
                "failures": {"window_s": FAILURE_WINDOW_S, "count": fails["count"], "kinds": fails["kinds"],
                             "last_at": fails["last_at"].isoformat() if fails["last_at"] else None},
                "hung": sorted(k for k, st in states.items() if st == verdicts.HUNG),
                "stragglers": sorted(k for k, st in states.items() if st == verdicts.STRAGGLER),
                "lost": sorted(k for k, st in states.items() if st == verdicts.LOST),
                "missing": [k for k in range(min(world or 0, MAX_LISTED + len(seen))) if k not in seen][:MAX_LISTED],
                "checked_at": now.isoformat(), "interval": iv}

    def sweep(self) -> dict:
        """Judge every run that beat within the horizon; record verdict changes as events."""
        now = self.clock()
        since = now - dt.timedelta(seconds=SWEEP_HORIZON_S)
        with self.sessions() as s, s.begin():
            run_ids = list(s.scalars(select(Heartbeat.run_id).where(Heartbeat.beat_at > since).distinct()))
        totals = {verdicts.HUNG: 0, verdicts.STRAGGLER: 0, verdicts.LOST: 0}
        for run_id in run_ids:
            try:
                for st in self._sweep_run(run_id, now).values():
                    if st in totals:
                        totals[st] += 1
            except Exception:  # one run's trouble must not stop the others' verdicts
                log.exception("health sweep of run %s failed", run_id)
        if self.metrics:
            for st, n in totals.items():
                self.metrics.ranks_by_verdict.labels(st).set(n)
        return totals

    def _sweep_run(self, run_id: int, now: dt.datetime) -> dict[int, str]:
        with self.sessions() as s, s.begin():
            rows = _current(_rows(s, run_id))
            if finished_at(rows) is not None:
                return {r.rank: verdicts.OK for r in rows}  # finished: nothing to judge
            slow = verdicts.outliers([_rank(r, now, self.up_since) for r in rows], self.limits)
            for r in rows:  # when each outlier became one; cleared when it is not
                since = (r.outlier_since or now) if r.rank in slow else None
                if since != r.outlier_since:
                    s.execute(update(Heartbeat).where(Heartbeat.run_id == run_id, Heartbeat.rank == r.rank,
                                                      Heartbeat.generation == r.generation)
                              .values(outlier_since=since))
                    r.outlier_since = since
            ranks = [_rank(r, now, self.up_since) for r in rows]
            steady, states = verdicts.judge(ranks, self.limits)
            for r, v in zip(rows, ranks):
                new = states[r.rank]
                if new == r.verdict:
                    continue
                changed = s.execute(update(Heartbeat).where(
                    Heartbeat.run_id == run_id, Heartbeat.rank == r.rank, Heartbeat.verdict == r.verdict)
                    .values(verdict=new)).rowcount
                if changed and new != verdicts.OK:
                    add_event(s, new, run_id, None, rank=r.rank, step=r.step, phase=r.phase,
                              age_s=round(v.beat_age, 3), progress_age_s=round(v.progress_age, 3),
                              timeout_s=verdicts.rank_timeout(v, steady, self.limits),
                              typical_step_s=r.typical_step_s, generation=r.generation)
                    log.warning("run %s rank %s is %s (step %s, no progress for %.1fs, timeout %.1fs)",
                                run_id, r.rank, new, r.step, v.progress_age, steady)
                    if self.metrics:
                        self.metrics.verdicts.labels(new).inc()
            return states

    # ---------------------------------------------------------------- interval
    def _interval(self, s: Session, run: Run, rows: list[SimpleNamespace], now: dt.datetime) -> dict:
        first = s.scalar(select(Launch.registered_at).where(Launch.run_id == run.id)
                         .order_by(Launch.generation).limit(1)) or run.created_at
        exposure = _age(now, first) or 0.0
        failures = self.failures(s, run.id)
        mtbf, source = math_.mtbf(exposure, failures, self.mtbf_prior_s)
        stalls = [r.save_stall_s for r in rows if r.save_stall_s is not None]
        cost = max(stalls) if stalls else None
        out = {"mode": "auto", "seconds": None, "young_s": None, "cost_s": cost, "mtbf_s": mtbf,
               "mtbf_source": source, "failures": failures, "exposure_s": round(exposure, 3),
               "prior_mtbf_s": self.mtbf_prior_s, "expected_loss_s": None, "steps": None}
        if cost:
            tau = math_.daly(cost, mtbf)
            out.update(seconds=tau, young_s=math_.young(cost, mtbf), expected_loss_s=math_.expected_loss(tau, cost))
            times = [r.typical_step_s for r in rows if r.typical_step_s]
            if times:
                out["steps"] = max(1, round(tau / statistics.median(times)))
        return out

    def failures(self, s: Session, run_id: int) -> int:
        """Failures of the run: failure events and relaunches, merged within the window."""
        rows = s.execute(select(Event.kind, Event.at, Event.data_json).where(
            Event.run_id == run_id, Event.kind.in_((*FAILURE_KINDS, "launch"))).order_by(Event.at, Event.id)).all()
        times, launches = [], 0
        for kind, at, _data in rows:
            if kind == "launch":
                launches += 1
                if launches == 1:
                    continue  # the run's first launch starts it; every later one follows a failure
            times.append(at)
        n, last = 0, None
        for at in times:
            if last is None or (at - last).total_seconds() > self.failure_merge_s:
                n += 1
            last = at
        return n


def finished_at(rows: list[SimpleNamespace]) -> dt.datetime | None:
    """When the newest launch finished: every one of its ranks beat `idle` (closed its
    Checkpointer); the last of those beats. None while any rank is missing or not idle."""
    if not rows or len(rows) < max(rows, key=lambda r: r.beat_at).world_size \
            or any(r.phase != verdicts.IDLE for r in rows):
        return None
    return max(r.beat_at for r in rows)


def _with_override(limits: verdicts.Limits, seconds: float) -> verdicts.Limits:
    from dataclasses import replace

    return replace(limits, override_s=seconds)


def _reset(row: Heartbeat, now: dt.datetime) -> None:
    row.started_at = row.progress_at = now
    row.typical_step_s = row.slowest_step_s = row.save_stall_s = row.outlier_since = None
    row.step = None
    row.verdict = verdicts.OK
    row.beats = 0


def _rows(s: Session, run_id: int) -> list[SimpleNamespace]:
    """The run's heartbeat rows as plain records: a Core select, not ORM objects, since a big
    job's health reads thousands of them every sweep and every page poll."""
    t = Heartbeat.__table__
    return [SimpleNamespace(**r._mapping) for r in s.execute(select(t).where(t.c.run_id == run_id))]


def _current(rows: list[SimpleNamespace]) -> list[SimpleNamespace]:
    """The rows of the run's newest launch, within its world size, by rank: a relaunch at a
    smaller world size leaves the old ranks' rows behind, and they are no one's health."""
    if not rows:
        return []
    gen = max(r.generation for r in rows)
    mine = [r for r in rows if r.generation == gen]
    world = max(mine, key=lambda r: r.beat_at).world_size
    return sorted((r for r in mine if r.rank < world), key=lambda r: r.rank)


def _rank(r: SimpleNamespace, now: dt.datetime, up_since: dt.datetime) -> verdicts.Rank:
    """Ages count from `up_since` at the earliest: a rank cannot be heard while we are down."""
    heard = lambda t: None if t is None else max(t, up_since)  # noqa: E731
    return verdicts.Rank(rank=r.rank, phase=r.phase, step_seconds=r.step_seconds, typical_step_s=r.typical_step_s,
                         slowest_step_s=r.slowest_step_s, period_s=r.period_s, beat_age=_age(now, heard(r.beat_at)),
                         progress_age=_age(now, heard(r.progress_at)), outlier_age=_age(now, r.outlier_since))


def _within_world(s: Session, run: Run, gen: int, b: dict) -> None:
    """A beat's rank lies in [0, world) of its launch (its generation's; for generation 0 the
    run's newest launch, else its newest checkpoint) and names that launch's world size:
    invented ranks would each add a row to the run and a line to its health page."""
    own = s.scalar(select(Launch.world_size).where(Launch.run_id == run.id, Launch.generation == gen)) if gen else None
    world = own or s.scalar(select(Launch.world_size).where(Launch.run_id == run.id)
                            .order_by(Launch.generation.desc()).limit(1)) \
        or s.scalar(select(Checkpoint.world_size).where(Checkpoint.run_id == run.id)
                    .order_by(Checkpoint.id.desc()).limit(1))
    if world is None:
        return
    if b["rank"] >= world or (b["world_size"] != world if own else b["world_size"] > world):
        raise InvalidArgument(f"heartbeat of rank {b['rank']} (world size {b['world_size']}) refused: "
                              f"{'its launch' if own else 'the run'} has world size {world}")


def _check(run_name: str, b: dict) -> None:
    try:
        names.check_run_name(run_name)
        names.check_int("rank", b["rank"], names.MAX_RANK)
        names.check_int("world_size", b["world_size"], names.MAX_RANK, 1)
        if b.get("step") is not None:
            names.check_int("step", b["step"])
        if b.get("generation") is not None:
            names.check_int("generation", b["generation"])
        if b.get("attempt") is not None:
            names.check_attempt(b["attempt"])
    except names.InvalidValue as e:
        raise InvalidArgument(str(e)) from None
    if b["rank"] >= b["world_size"]:
        raise InvalidArgument(f"rank {b['rank']} is outside world size {b['world_size']}")
    if b.get("phase") not in PHASES:
        raise InvalidArgument(f"phase must be one of {', '.join(PHASES)}")
    for k in ("step_seconds", "max_step_seconds", "period_s", "save_stall_s"):
        v = b.get(k)
        if v is not None and not (isinstance(v, (int, float)) and 0 <= v <= MAX_SECONDS):
            raise InvalidArgument(f"{k} must be a number of seconds in 0..{MAX_SECONDS:.0f}")
