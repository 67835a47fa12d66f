"""The client's one retry policy: which failures are transient, how long to back off, and
for how long to keep trying. torch-free (the transport uses it).

A checkpoint service that restarts, a load balancer that drops a connection, a gRPC
deadline under load: none of these should cost a training job anything. Every call the
Transport makes goes through `RetryPolicy.call`, which retries transient failures with
capped exponential backoff and full jitter (so the ranks of a big job do not reconnect
in lock-step) until the policy's deadline. Everything else -- the service refusing a
request -- is raised at once: retrying a refusal only delays the error.

Its settings are constructor arguments; config.py reads them from the environment
(LASTGOOD_RETRY_DEADLINE, _INITIAL, _MAX_DELAY). What is transient is the error's class
(errors.py: `ServiceError.retryable`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from lastgood.common.joblog import incident
from lastgood.errors import GaveUp, ServiceError

log = logging.getLogger("lastgood")
T = TypeVar("T")
# The jitter's own generator: the global `random` stream belongs to the training, whose Python
# RNG is part of every checkpoint (state/rng.py); a retry on a background thread must not move it
_JITTER = random.Random()

__all__ = ["GaveUp", "NO_RETRY", "RetryPolicy", "is_transient"]


def is_transient(exc: BaseException) -> bool:
    """Would the same request, sent again later, plausibly succeed? Yes for no answer at
    all, an outage, a busy service or an HTTP 5xx (errors.Unavailable); no for every
    refusal, a catalog that needs a rebuild, a full store, and GaveUp (the caller stopped)."""
    return isinstance(exc, ServiceError) and exc.retryable


@dataclass(frozen=True)
class RetryPolicy:
    deadline: float = 120.0   # seconds one call keeps retrying transient failures; 0: try once
    initial: float = 0.1      # the first backoff
    max_delay: float = 2.0    # backoffs double up to this
    multiplier: float = 2.0

    def with_(self, **overrides) -> "RetryPolicy":
        """This policy with the settings in `overrides` that are not None."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def enabled(self) -> bool:
        return self.deadline > 0

    def delays(self):
        """Backoffs: capped exponential with full jitter (uniform in [0, cap])."""
        cap = self.initial
        while True:
            yield _JITTER.uniform(0, cap)
            cap = min(cap * self.multiplier, self.max_delay)

    def call(self, fn: Callable[[], T], what: str, *, deadline: float | None = None,
             stop: Callable[[], bool] | None = None) -> T:
        """fn(), retried on transient failures until `deadline` seconds (default the
        policy's) have passed. `stop()` is asked before each backoff: when it says so,
        GaveUp is raised instead of waiting further. The last failure is raised as it was."""
        budget = self.deadline if deadline is None else deadline
        end = time.monotonic() + budget
        delays = self.delays()
        tries = 0
        while True:
            try:
                result = fn()
            except Exception as e:
                tries += 1
                if not is_transient(e):
                    raise
                left = end - time.monotonic()
                if left <= 0:
                    if tries > 1:
                        log.warning("lastgood: %s: gave up after %d tries in %.0fs: %s", what, tries, budget, e)
                    raise
                if stop is not None and stop():
                    raise GaveUp(f"{what}: stopped retrying ({e})", e) from e
                if tries == 1:
                    incident(log, logging.WARNING, "lastgood: %s failed (%s); retrying for up to %.0fs", what, e, left)
                pause = min(next(delays), left)
                # sleep in short slices so that a newer save need not wait out a long backoff
                wake = time.monotonic() + pause
                while (now := time.monotonic()) < wake:
                    if stop is not None and stop():
                        raise GaveUp(f"{what}: stopped retrying ({e})", e) from e
                    time.sleep(min(0.05, wake - now))
                continue
            if tries:
                incident(log, logging.WARNING, "lastgood: %s succeeded after %d failed tries", what, tries)
            return result


NO_RETRY = RetryPolicy(deadline=0.0)
