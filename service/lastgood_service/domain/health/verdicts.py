"""Hang and straggler verdicts from the latest beat of each rank. Pure functions: the
catalog half is domain/health/heartbeats.py, the numbers' meaning docs/health.md.

Hang. A rank is `hung` when it has made no progress (its step or phase has not changed)
for longer than its timeout, or has not beaten for that long. The timeout is computed
from the run itself, as NVIDIA's fault-tolerance launcher does, so nobody has to guess
it: a safety factor over the slowest recent step of any rank (collectives make every
rank as slow as the slowest), never under a floor, and never under three beat periods
(progress is only seen at each beat). A rank that has not finished two steps yet (no
step time: start-up, compilation, the first step after a restore) gets the longer
first-step allowance, and a rank that says it is saving or restoring gets the save
allowance. A rank silent for twice its timeout is `lost` (its process is gone or
frozen). An `idle` rank (closed its Checkpointer) is never hung.

Straggler. Among the ranks that are training and have a smoothed step time, a rank is an
outlier when its robust z-score (0.6745·(t − median)/MAD, Iglewicz and Hoaglin) exceeds
the threshold AND it is at least `ratio` times the median (a job of near-identical ranks
has a tiny MAD, and a few percent must not be an outlier). It is a `straggler` once it has
been an outlier for the whole window. Fewer than three timed ranks: no verdict (two
values have no meaningful median and spread).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from lastgood.wire.vocab import Phase

IDLE, RESTORING, SAVING = Phase.IDLE.value, Phase.RESTORING.value, Phase.SAVING.value

OK, HUNG, STRAGGLER, LOST = "ok", "hung", "straggler", "lost"


@dataclass(frozen=True)
class Limits:
    factor: float = 5.0            # timeout = factor x the slowest recent step ...
    floor_s: float = 60.0          # ... but at least this
    first_step_s: float = 600.0    # until a rank has a step time
    save_s: float = 600.0          # while a rank is saving or restoring
    override_s: float | None = None  # a fixed steady-state timeout (setting or ?hang_timeout=)
    z: float = 3.5                 # straggler: robust z-score over ...
    ratio: float = 1.5             # ... and at least this times the median step time ...
    window_s: float = 60.0         # ... for this long


@dataclass
class Rank:
    """What the verdicts read of one rank's latest beat (ages in seconds, now - then)."""
    rank: int
    phase: str
    step_seconds: float | None
    typical_step_s: float | None
    slowest_step_s: float | None
    period_s: float | None
    beat_age: float
    progress_age: float
    outlier_age: float | None  # how long it has been an outlier (None: it is not one)


def steady_timeout(ranks: list[Rank], limits: Limits) -> float:
    """The run's timeout for a rank that is training and has a step time."""
    period = max((r.period_s or 0.0 for r in ranks), default=0.0)
    if limits.override_s is not None:
        return limits.override_s
    slowest = max((r.slowest_step_s or 0.0 for r in ranks), default=0.0)
    return max(limits.floor_s, limits.factor * slowest, 3.0 * period)


def rank_timeout(r: Rank, steady: float, limits: Limits) -> float:
    if r.phase in (SAVING, RESTORING):
        return max(steady, limits.save_s)
    if r.step_seconds is None:
        return max(steady, limits.first_step_s)
    return steady


def outliers(ranks: list[Rank], limits: Limits) -> set[int]:
    """Ranks whose smoothed step time is a robust outlier right now."""
    timed = [r for r in ranks if r.phase not in (IDLE, SAVING, RESTORING) and r.typical_step_s]
    if len(timed) < 3:
        return set()
    times = [r.typical_step_s for r in timed]
    med = statistics.median(times)
    mad = statistics.median(abs(t - med) for t in times)
    out = set()
    for r in timed:
        t = r.typical_step_s
        if t < limits.ratio * med:
            continue
        z = float("inf") if mad == 0 else 0.6745 * (t - med) / mad
        if z > limits.z:
            out.add(r.rank)
    return out


def judge(ranks: list[Rank], limits: Limits) -> tuple[float, dict[int, str]]:
    """(the steady timeout, {rank: ok | hung | straggler | lost})."""
    steady = steady_timeout(ranks, limits)
    slow = outliers(ranks, limits)
    states = {}
    for r in ranks:
        limit = rank_timeout(r, steady, limits)
        if r.phase == IDLE:
            state = OK
        elif r.beat_age > 2 * limit:
            state = LOST
        elif r.beat_age > limit or r.progress_age > limit:
            state = HUNG
        elif r.rank in slow and r.outlier_age is not None and r.outlier_age >= limits.window_s:
            state = STRAGGLER
        else:
            state = OK
        states[r.rank] = state
    return steady, states
