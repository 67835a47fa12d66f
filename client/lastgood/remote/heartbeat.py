"""Heartbeats: each rank tells the service it is alive and how far it has got. torch-free.

The training thread only records: `step(n)` stores the step and a timestamp, `phase()`
says the rank is saving or restoring, and `reached(n)` (called by save() and restore())
stores a step the Checkpointer saw: a script that never calls `step()` is timed by its
saves -- the steps between two saves over the time between them -- so it is judged on
its real pace, not the first-step allowance; its longest "step" is the time between two
saves, as its progress is seen only then. A daemon thread of the Checkpointer sends the
latest of it every period (`LASTGOOD_HEARTBEAT_SECONDS`, default 10 s; 0 turns beats off)
and when the phase changes (at once, or a second after the previous beat: PHASE_BEAT_GAP), as

    POST /api/v1/runs/{run}/heartbeats
    {"rank", "world_size", "step", "step_seconds", "phase", "attempt", "generation",
     "max_step_seconds", "period_s", "save_stall_s"}

The service keeps the latest beat per (run, rank) and derives hang and straggler verdicts
from them (service domain/health/heartbeats.py, docs/health.md). A beat that fails is logged (once
per streak of failures) and never raised: a checkpoint service that is away must not
cost the job its training. Beats are never retried either; the next one is due soon.

The phase names and the body's fields are the wire contract the service validates with.
"""

from __future__ import annotations

import logging
import threading
import time

from lastgood.common.joblog import incident
from lastgood.remote import config
from lastgood.wire.vocab import Phase

log = logging.getLogger("lastgood")

TRAIN, SAVING, RESTORING, IDLE = Phase.TRAIN, Phase.SAVING, Phase.RESTORING, Phase.IDLE
PHASES = tuple(Phase)
INTERVAL_REFRESH_BEATS = 6  # rank 0 asks for the run's auto interval every this many beats
# A phase change is beaten at once, but never sooner than this after the previous beat (or the
# period, if shorter): then at that moment, with the phase current then. A save takes two
# phase changes and its wait() two more; saves every few tens of milliseconds (a small state,
# the memory tier) were a beat each at the service (~10 % of its CPU, bench/tiny_save.py). A
# save long enough to need the save allowance is still reported within a second.
PHASE_BEAT_GAP = 1.0


class Heartbeat:
    """The beating thread of one rank. `step()`, `phase()` and `saved()` are called from the
    training thread and only store values; everything else runs on the thread."""

    def __init__(self, url: str, run: str, rank: int, world_size: int, *, token: str | None = None,
                 attempt: str | None = None, generation: int | None = None, period: float | None = None,
                 want_interval: bool = False) -> None:
        from lastgood.remote.rest import RestClient

        self.period = config.heartbeat_period() if period is None else period
        self.run, self.rank, self.world_size = run, rank, world_size
        self.attempt, self.generation = attempt, generation
        self.rest = RestClient(url, timeout=max(2.0, min(10.0, self.period * 2)), token=token)
        self.want_interval = want_interval and rank == 0
        self.interval_s: float | None = None  # the run's auto interval, as the service last said
        self.health: dict | None = None
        self.beats = self.failures = 0
        # written by the training thread, read by the beating thread (single assignments)
        self._step: int | None = None
        self._t: float | None = None         # when _step was recorded
        self._max_gap = 0.0                  # longest gap between two step() calls since the last beat
        self._phase = TRAIN
        self._stall: float | None = None     # the training thread's stall in the last save
        self._reached: tuple[int, float] | None = None  # (step, time) of the last save or restore
        self._pace: float | None = None      # time per step between the last two saves (no step() calls)
        # the beating thread's own
        self._sent: tuple[int, float] | None = None  # (step, time) of the previous beat
        self._step_seconds: float | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- training thread
    def step(self, step: int) -> None:
        now = time.monotonic()
        if self._t is not None and self._step is not None and step > self._step:
            gap = (now - self._t) / (step - self._step)
            if gap > self._max_gap:
                self._max_gap = gap
        self._step, self._t = step, now

    def reached(self, step: int, restored: bool = False) -> None:
        """A step the Checkpointer saw (a save, or the step a restore returned). When `step()`
        is not ahead of it, it is the rank's progress, and the pace since the previous save
        is a step time; a restore starts the count afresh (the time it took is no step's)."""
        now = time.monotonic()
        last, self._reached = self._reached, (step, now)
        if restored:
            self._step, self._t = step, None
            return
        if self._step is not None and step <= self._step:
            return  # step() is called: it times the steps
        if last is not None and step > last[0]:
            # the pace is per step; the longest gap is the whole time between the saves:
            # progress is seen only at saves, so the timeout must cover that time
            self._pace = (now - last[1]) / (step - last[0])
            self._max_gap = max(self._max_gap, now - last[1])
        self._step = step

    def phase(self, phase: str) -> None:
        """Enter a phase; the thread beats at once so the service sees saves and restores."""
        if phase != self._phase:
            self._phase = phase
            if phase != TRAIN:
                self._t = None  # the time spent saving or restoring is no step's time
            self._wake.set()

    def saved(self, stall_s: float) -> None:
        self._stall = stall_s

    # ---------------------------------------------------------------- the thread
    def start(self) -> "Heartbeat":
        if self.period > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="lastgood-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self, final_phase: str = IDLE, timeout: float = 5.0) -> None:
        """Send a last beat in `final_phase` (idle: this rank is done, not hung) and stop."""
        if self._thread is None:
            return
        self._phase = final_phase
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self._thread = None

    def _loop(self) -> None:
        gap = min(PHASE_BEAT_GAP, self.period)
        while True:
            stopping = self._stop.is_set()
            sent = time.monotonic()
            self.beat()
            if stopping:
                return
            if self.want_interval and self.beats % INTERVAL_REFRESH_BEATS == 1:
                self.refresh_interval()
            self._wake.wait(self.period)
            # woken by a phase change: no sooner than `gap` after the last beat (phase changes
            # within it are one beat); a stop is beaten at once
            self._stop.wait(sent + gap - time.monotonic())
            self._wake.clear()

    def body(self) -> dict:
        step, t = self._step, self._t
        timed = False
        if step is not None and t is not None:
            if self._sent is not None and step > self._sent[0] and t > self._sent[1]:
                self._step_seconds = (t - self._sent[1]) / (step - self._sent[0])
                timed = True
            if self._sent is None or step != self._sent[0]:
                self._sent = (step, t)
        elif step is None:
            self._sent = None
        gap, self._max_gap = self._max_gap, 0.0
        if gap and self._t is None and not timed and self._pace is not None:
            self._step_seconds = self._pace  # timed by its saves alone (no step() since the last save)
        elif self._step_seconds is None and gap:
            # steps faster than the beats (or each beat landing on a save) give no estimate
            # from beat to beat; the training thread's own step-to-step gap is one, so a rank
            # that hangs early is judged by the steady timeout, not the first-step allowance
            self._step_seconds = gap
        return {"rank": self.rank, "world_size": self.world_size, "step": step,
                "step_seconds": self._step_seconds, "phase": self._phase, "attempt": self.attempt,
                "generation": self.generation, "max_step_seconds": gap or None, "period_s": self.period,
                "save_stall_s": self._stall}

    def beat(self) -> bool:
        """Send one beat now; False (logged) when it did not arrive."""
        try:
            self.rest.heartbeat(self.run, self.body())
        except Exception as e:  # noqa: BLE001 - a beat never raises into training
            self.failures += 1
            if self.failures == 1:
                incident(log, logging.WARNING, "lastgood: heartbeat of run %s failed (will keep trying, logged once): %s",
                         self.run, e)
            return False
        if self.failures:
            incident(log, logging.INFO, "lastgood: heartbeats of run %s arrive again after %s failures", self.run,
                     self.failures)
        self.failures = 0
        self.beats += 1
        return True

    def refresh_interval(self) -> None:
        try:
            self.health = self.rest.health(self.run)
            self.interval_s = (self.health.get("interval") or {}).get("seconds")
        except Exception as e:  # noqa: BLE001 - the interval stays as it was
            log.debug("lastgood: could not read the auto interval of %s: %s", self.run, e)
