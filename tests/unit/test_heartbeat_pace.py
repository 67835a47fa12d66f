"""A rank that never calls `Checkpointer.step()` is timed by its saves (lastgood.remote.heartbeat
`reached`): the steps between two saves over the time between them, so the service judges it
on its real pace, not the first-step allowance (docs/health.md). No service: the beat's body."""

from __future__ import annotations

import time

import pytest

from lastgood.remote.heartbeat import SAVING, TRAIN, Heartbeat


def rank() -> Heartbeat:
    return Heartbeat("http://127.0.0.1:9", "pace", 0, 1, period=0)  # never started: nothing is sent


def save(hb: Heartbeat, step: int) -> None:
    """What Checkpointer.save() tells its heartbeat."""
    hb.reached(step)
    hb.phase(SAVING)
    hb.phase(TRAIN)


def test_saves_alone_give_progress_and_a_step_time():
    hb = rank()
    save(hb, 2)
    first = hb.body()
    assert first["step"] == 2 and first["step_seconds"] is None  # one save: no pace yet
    time.sleep(0.3)
    save(hb, 5)
    b = hb.body()
    assert b["step"] == 5
    assert b["step_seconds"] == pytest.approx(0.1, abs=0.05)
    # progress is seen only at saves: the longest gap is the time between them, so the
    # service's timeout (a factor over it) never runs out between two saves
    assert b["max_step_seconds"] == pytest.approx(0.3, abs=0.1)
    time.sleep(0.6)
    save(hb, 8)  # slower now: the estimate follows the saves
    assert hb.body()["step_seconds"] == pytest.approx(0.2, abs=0.07)


def test_the_control_without_saves_a_rank_has_no_step_time():
    hb = rank()
    hb.phase(SAVING)
    hb.phase(TRAIN)
    time.sleep(0.1)
    hb.phase(SAVING)
    hb.phase(TRAIN)
    b = hb.body()
    assert b["step"] is None and b["step_seconds"] is None  # the service's first-step allowance applies


def test_step_calls_time_the_steps_and_saves_do_not_add_to_them():
    hb = rank()
    for s in range(4):
        hb.step(s)
        time.sleep(0.05)
    hb.body()
    time.sleep(0.5)
    hb.step(4)
    save(hb, 4)  # the same step, saved after step(): not a step of its own, no gap counted
    b = hb.body()
    assert b["step"] == 4 and b["max_step_seconds"] == pytest.approx(0.55, abs=0.1)


def test_a_restore_starts_the_count_afresh():
    hb = rank()
    save(hb, 9)
    time.sleep(0.5)  # the restore's own time is no step's
    hb.reached(3, restored=True)
    assert hb.body()["step"] == 3
    time.sleep(0.2)
    save(hb, 5)
    assert hb.body()["step_seconds"] == pytest.approx(0.1, abs=0.05)
