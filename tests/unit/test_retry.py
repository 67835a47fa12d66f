"""The client's retry policy: what counts as transient, its settings, and its deadline.
(The policy against a real service restart: tests/multiproc/test_outage.py and
tests/client/test_commit_across_restart.py.)"""

from __future__ import annotations

import pytest

from lastgood.errors import ServiceError, ServiceUnreachable
from lastgood.remote.config import retry_policy
from lastgood.remote.retry import GaveUp, RetryPolicy, is_transient


@pytest.mark.parametrize("exc,transient", [
    (ServiceUnreachable("refused"), True),
    (ServiceError("x", "UNAVAILABLE"), True),
    (ServiceError("x", "DEADLINE_EXCEEDED"), True),
    (ServiceError("x", 503, None, "x"), True),
    (ServiceError("x", 500, None, "x"), True),
    (ServiceError("x", 507, "store_full", "x"), False),
    (ServiceError("x", 404, "not_found", "x"), False),
    (ServiceError("x", 409, "conflict", "x"), False),
    (ServiceError("x", "FAILED_PRECONDITION"), False),
    (ServiceError("x", "ALREADY_EXISTS"), False),
    (ServiceError("GetShard ended after 1 of 2 bytes"), False),
    (GaveUp("x", ServiceError("x", "UNAVAILABLE")), False),
    (ValueError("x"), False),
])
def test_only_failures_that_say_nothing_about_the_request_are_retried(exc, transient):
    assert is_transient(exc) is transient


def test_settings_from_the_environment_and_arguments(monkeypatch):
    monkeypatch.setenv("LASTGOOD_RETRY_DEADLINE", "7.5")
    monkeypatch.setenv("LASTGOOD_RETRY_MAX_DELAY", "0.5")
    p = retry_policy()
    assert (p.deadline, p.max_delay, p.initial) == (7.5, 0.5, RetryPolicy.initial)
    assert retry_policy(deadline=3.0).deadline == 3.0  # an argument wins
    monkeypatch.setenv("LASTGOOD_RETRY_DEADLINE", "0")
    assert not retry_policy().enabled


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_a_bad_setting_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setenv("LASTGOOD_RETRY_DEADLINE", raw)
    with pytest.raises(ValueError, match="LASTGOOD_RETRY_DEADLINE"):
        retry_policy()


def test_backoff_is_capped_and_jittered():
    p = RetryPolicy(initial=0.1, max_delay=0.4)
    delays = [d for d, _ in zip(p.delays(), range(50))]
    assert all(0 <= d <= 0.4 for d in delays) and len(set(delays)) > 1


def test_retries_transient_failures_until_the_deadline_and_refusals_never():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ServiceError("down", "UNAVAILABLE")
        return "ok"

    assert RetryPolicy(deadline=30, initial=0.01).call(flaky, "flaky") == "ok" and len(calls) == 3

    def refused():
        calls.append(1)
        raise ServiceError("no", "PERMISSION_DENIED")

    calls.clear()
    with pytest.raises(ServiceError, match="no"):
        RetryPolicy(deadline=30, initial=0.01).call(refused, "refused")
    assert len(calls) == 1

    def down():
        calls.append(1)
        raise ServiceUnreachable("down")

    calls.clear()  # no retries: one try
    with pytest.raises(ServiceUnreachable):
        RetryPolicy(deadline=0).call(down, "down")
    assert len(calls) == 1
    with pytest.raises(GaveUp):  # a caller that no longer needs the answer stops the retries
        RetryPolicy(deadline=30, initial=0.01).call(down, "down", stop=lambda: True)


def test_the_jitter_never_draws_from_the_trainings_python_rng():
    """A retry's backoff must not consume the global `random` stream: the training's Python RNG
    is part of the checkpoint (state/rng.py), and a transient failure retried under load on a
    background thread would move it, so a resumed run's python RNG differed from an
    uninterrupted one (seen in a fresh-clone CI run: test_mission[plain], "final python_rng
    differs"). The jitter has a generator of its own."""
    import random

    from lastgood.remote.retry import RetryPolicy

    random.seed(1234)
    before = random.getstate()
    delays = RetryPolicy(initial=0.1, max_delay=2.0).delays()
    drawn = [next(delays) for _ in range(20)]
    assert random.getstate() == before
    assert len(set(drawn)) == 20  # still jittered
