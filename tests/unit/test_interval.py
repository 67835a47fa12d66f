"""The checkpoint interval: Young/Daly, the MTBF estimate, Interval's triggers and the
decisions every rank takes alike (lastgood.common.interval; the service side: tests/service/test_health.py)."""

from __future__ import annotations

import math

import pytest

from lastgood import Interval
from lastgood.common.interval import PROBE_STEPS, Decider, daly, expected_loss, mtbf, young


def test_young_and_daly():
    assert young(10, 3600) == pytest.approx(math.sqrt(2 * 10 * 3600))
    # C << M: Daly's form is Young's within a fraction of a percent ...
    assert daly(1, 1e6) == pytest.approx(young(1, 1e6), rel=1e-3)
    # ... C not << M: smaller, by Daly's correction terms (written out by hand)
    c, m = 600.0, 3600.0
    x = c / (2 * m)
    assert daly(c, m) == pytest.approx(math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c)
    assert daly(c, m) < young(c, m)
    assert daly(8000, 3600) == 3600  # C >= 2M: one interval per failure
    assert expected_loss(100, 10) == 55


def test_mtbf_follows_the_prior_until_failures_are_seen():
    assert mtbf(5000, 0, 86400) == (86400, "prior")
    assert mtbf(5000, 2, 86400) == (2500, "observed")
    assert daly(10, mtbf(5000, 2, 86400)[0]) < daly(10, mtbf(5000, 0, 86400)[0])  # failures shrink it


@pytest.mark.parametrize("text,want", [
    ("auto", Interval(auto=True)), ("500", Interval(every_steps=500)), ("500steps", Interval(every_steps=500)),
    ("30m", Interval(every_minutes=30)), ("1.5min", Interval(every_minutes=1.5)), ("epoch", Interval(epoch_end=True)),
    ("500+epoch", Interval(every_steps=500, epoch_end=True)),
])
def test_parse(text, want):
    assert Interval.parse(text) == want


@pytest.mark.parametrize("bad", ["", "often", "-5", "0", "m", "5h"])
def test_parse_refuses(bad):
    with pytest.raises(ValueError):
        Interval.parse(bad)


def test_an_interval_needs_a_trigger():
    with pytest.raises(ValueError):
        Interval()
    with pytest.raises(ValueError):
        Interval(every_steps=True)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(decider: Decider, clock: Clock, steps: int, step_s: float, stall_s: float = 0.0) -> list[int]:
    saved = []
    for s in range(steps):
        if decider.due(s):
            saved.append(s)
            clock.t += stall_s
            decider.saved()
        clock.t += step_s
    return saved


def test_every_minutes_turns_into_steps():
    clock = Clock()
    d = Decider(Interval(every_minutes=1), lambda: None, lambda v: v, clock)
    saved = run(d, clock, 400, step_s=1.0)  # 60 steps a minute
    gaps = [b - a for a, b in zip(saved, saved[1:])]
    assert saved[0] == 60 and all(g == 60 for g in gaps), saved


def test_auto_saves_once_to_measure_then_follows_the_service():
    clock = Clock()
    answer = {"s": None}
    d = Decider(Interval(auto=True), lambda: answer["s"], lambda v: v, clock)
    assert run(d, clock, 50, step_s=1.0) == [PROBE_STEPS]  # unknown: one probe save, no more
    answer["s"] = 20.0  # the service now knows C and M
    saved = run(d, clock, 100, step_s=1.0)
    gaps = [b - a for a, b in zip(saved, saved[1:])]
    assert gaps and all(g == 20 for g in gaps), saved


def test_ranks_follow_rank_zero():
    """Rank 1's clock runs fast; the broadcast makes it take rank 0's decisions."""
    c0, c1 = Clock(), Clock()
    decisions = {}

    def agree0(v):
        decisions[len(decisions)] = v
        return v

    it = iter(range(10**6))

    def agree1(_v):
        return decisions[next(it)]

    d0 = Decider(Interval(every_minutes=0.5), lambda: None, agree0, c0)
    d1 = Decider(Interval(every_minutes=0.5), lambda: None, agree1, c1)
    s0, s1 = [], []
    for s in range(300):
        if d0.due(s):
            s0.append(s)
            d0.saved()
        if d1.due(s):
            s1.append(s)
            d1.saved()
        c0.t += 1.0
        c1.t += 3.0
    assert s0 == s1 and s0


def test_a_step_time_is_known_when_steps_are_faster_than_the_beats():
    """Ten fast steps between two beats, the first beat before any step: the beat-to-beat
    estimate has nothing to work with, the step-to-step gap does. Without a step time the
    service gives the rank its long first-step allowance and a hang goes unseen for minutes
    (seen in a clean CI run of the supervisor's hang test)."""
    import time as _time

    from lastgood.remote.heartbeat import Heartbeat

    hb = Heartbeat("http://127.0.0.1:9", "r", 0, 1, period=0)  # never started: body() only
    assert hb.body()["step_seconds"] is None
    for step in range(10):
        hb.step(step)
        _time.sleep(0.002)
    body = hb.body()
    assert body["step_seconds"] is not None and body["step_seconds"] > 0
