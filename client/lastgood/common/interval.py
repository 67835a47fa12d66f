"""How often to checkpoint: the Young/Daly optimum, and the per-step decision. torch-free math.

A job that checkpoints every τ seconds of work pays C (the checkpoint's cost) every τ, and
on each failure redoes on average half an interval. With failures every M seconds on
average, the waste per unit of time is about C/τ + τ/(2M), smallest at Young's

    τ = √(2·C·M)

Daly (2006, "A higher order estimate of the optimum checkpoint interval for restart
dumps") keeps the next terms, which matter once C is not ≪ M:

    τ = √(2·C·M) · (1 + ⅓·√(C/(2M)) + ⅑·C/(2M)) − C      for C < 2M
    τ = M                                                  otherwise

We always use Daly's form: for C ≪ M it is Young's within a fraction of a percent, and it
stays right when checkpoints are expensive or the job fails often. The expected work lost
per failure is (τ + C)/2: half an interval on average, the failure falling anywhere in it
or in the checkpoint that closes it. The service computes τ for a run from the cost its
ranks report and the failures it has seen (domain/health/heartbeats.py); `Interval` turns τ into
save decisions that every rank takes at the same step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


def young(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum √(2·C·M)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (seconds of work between checkpoints)."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def expected_loss(interval_s: float, cost_s: float) -> float:
    """Work redone per failure, on average: half of an interval and its checkpoint."""
    return (interval_s + cost_s) / 2.0


def mtbf(exposure_s: float, failures: int, prior_s: float) -> tuple[float, str]:
    """The run's mean time between failures: observed (exposure / failures) once it has
    failed, else the configured prior. Returns (seconds, "observed" | "prior")."""
    if failures > 0:
        return max(exposure_s, 1e-3) / failures, "observed"
    return prior_s, "prior"


# ---------------------------------------------------------------------------- the decision
PROBE_STEPS = 10  # steps timed before a time-based interval turns into a step count
REVISIT_S = 300.0  # a time-based decision is taken again at least this often


@dataclass
class Interval:
    """When to save. Any of the triggers may be combined; `due()` is true when one fires.

    every_steps:   every N steps (step % N == 0; no coordination needed)
    every_minutes: every T minutes of training
    epoch_end:     at every epoch end (pass `epoch_end=True` to `due()` there)
    auto:          the Young/Daly interval the service computes for the run from the
                   measured checkpoint cost and its failures (docs/health.md); until the
                   service knows a cost, one save after the first PROBE_STEPS measures it

    Time-based triggers must fire at the same step on every rank (a save is collective),
    while each rank's clock differs. So at agreed decision steps rank 0 decides from its
    clock and step time and broadcasts the decision and the next decision step (one
    int64 broadcast per decision, not per step); between decisions nobody talks.
    """

    every_steps: int | None = None
    every_minutes: float | None = None
    epoch_end: bool = False
    auto: bool = False

    def __post_init__(self) -> None:
        if self.every_steps is not None and (isinstance(self.every_steps, bool) or not isinstance(
                self.every_steps, int) or self.every_steps < 1):
            raise ValueError(f"every_steps must be a positive int, got {self.every_steps!r}")
        if self.every_minutes is not None and not (isinstance(self.every_minutes, (int, float))
                                                   and math.isfinite(self.every_minutes) and self.every_minutes > 0):
            raise ValueError(f"every_minutes must be a positive number, got {self.every_minutes!r}")
        if not (self.every_steps or self.every_minutes or self.epoch_end or self.auto):
            raise ValueError("an Interval needs a trigger: every_steps, every_minutes, epoch_end or auto")

    @classmethod
    def parse(cls, text: str) -> "Interval":
        """`auto`, `500` or `500steps`, `30m`/`30min`, `epoch`; joined with `+` (`500+epoch`)."""
        kw: dict = {}
        for part in str(text).strip().lower().split("+"):
            part = part.strip()
            if part == "auto":
                kw["auto"] = True
            elif part == "epoch":
                kw["epoch_end"] = True
            elif part.endswith(("min", "m")) and part.rstrip("min").replace(".", "", 1).isdigit():
                kw["every_minutes"] = float(part.rstrip("min"))
            elif part.removesuffix("steps").isdigit():
                kw["every_steps"] = int(part.removesuffix("steps"))
            else:
                raise ValueError(f"cannot read interval {text!r}: use auto, N (steps), Nm (minutes), epoch, "
                                 f"joined with '+'")
        return cls(**kw)


class Decider:
    """One Checkpointer's save decisions under an Interval. `seconds()` gives the service's
    auto interval (None: not known yet) and `agree(value)` broadcasts rank 0's value to
    every rank (the identity without a process group). Seconds per step are measured
    between decision steps, saves included: the rate at which the job really advances."""

    def __init__(self, interval: Interval, seconds, agree, clock=time.monotonic) -> None:
        self.interval = interval
        self._seconds = seconds
        self._agree = agree
        self._clock = clock
        self.next_decision: int | None = None
        self._probed = False  # auto: the one save made to measure the cost has been asked for
        self._mark: tuple[int, float] | None = None  # (step, time) of the previous decision
        self.last_save = clock()  # this Checkpointer's start, then its last save (any reason)

    def restart(self) -> None:
        """After a restore the steps jump (back, on a rollback): decide afresh."""
        self.next_decision = self._mark = None

    def saved(self) -> None:
        self.last_save = self._clock()

    def target(self) -> float | None:
        """The time-based interval in force (the smaller of the two when both are set)."""
        out = []
        if self.interval.every_minutes:
            out.append(self.interval.every_minutes * 60.0)
        if self.interval.auto:
            auto = self._seconds()
            if auto is not None:
                out.append(auto)
        return min(out) if out else None

    def due(self, step: int, epoch_end: bool = False) -> bool:
        iv = self.interval
        fire = bool(epoch_end and iv.epoch_end) or bool(iv.every_steps and step > 0 and step % iv.every_steps == 0)
        if not (iv.every_minutes or iv.auto):
            return fire
        if self.next_decision is None:
            self.next_decision = step + PROBE_STEPS
            self._mark = (step, self._clock())
        if step < self.next_decision:
            return fire
        # a decision step: every rank is here at the same step; rank 0 decides for all
        decided = self._agree(self._decide(step))
        self.next_decision = step + max(1, decided >> 1)
        return fire or bool(decided & 1)

    def _decide(self, step: int) -> int:
        """(steps to the next decision) << 1 | save now."""
        target = self.target()
        now = self._clock()
        per_step = 0.0
        if self._mark is not None and step > self._mark[0]:
            per_step = (now - self._mark[1]) / (step - self._mark[0])
        self._mark = (step, now)
        elapsed = now - self.last_save
        if target is None:  # auto, and the service knows no cost yet: save once to measure it
            probe, self._probed = not self._probed, True
            return PROBE_STEPS << 1 | int(probe)
        save = elapsed >= target - per_step / 2
        left = target if save else target - elapsed
        if per_step <= 0:
            return PROBE_STEPS << 1 | int(save)
        # decide again at least every REVISIT_S: the auto interval moves as failures are seen
        steps = max(1, min(round(left / per_step), round(REVISIT_S / per_step)))
        return min(steps, 2**40) << 1 | int(save)
