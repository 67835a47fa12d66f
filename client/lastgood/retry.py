"""The client's one retry policy: which failures are transient, how long to back off, and
for how long to keep trying. torch-free (the transport uses it).

A checkpoint service that restarts, a load balancer that drops a connection, a gRPC
deadline under load: none of these should cost a training job anything. Every call the
Transport makes goes through `RetryPolicy.call`, which retries transient failures with
capped exponential backoff and full jitter (so the ranks of a big job do not reconnect
in lock-step) until the policy's deadline. Everything else -- the service refusing a
request -- is raised at once: retrying a refusal only delays the error.

Settings (constructor arguments, or the environment; read here and nowhere else):

    LASTGOOD_RETRY_DEADLINE   seconds one call keeps retrying (default 120; 0 = no retries)
    LASTGOOD_RETRY_INITIAL    first backoff in seconds (default 0.1)
    LASTGOOD_RETRY_MAX_DELAY  longest backoff in seconds (default 2.0)
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from .errors import CATALOG_BEHIND, ServiceError

log = logging.getLogger("lastgood")
T = TypeVar("T")

ENV_DEADLINE = "LASTGOOD_RETRY_DEADLINE"
ENV_INITIAL = "LASTGOOD_RETRY_INITIAL"
ENV_MAX_DELAY = "LASTGOOD_RETRY_MAX_DELAY"

# gRPC status names of failures that say nothing about the request itself
TRANSIENT_GRPC = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
# HTTP 5xx that say so for good: not implemented, version not supported, the store is full
# (retrying would only delay the error; an operator has to act)
PERMANENT_HTTP = frozenset({501, 505, 507})


class GaveUp(ServiceError):
    """A call stopped retrying before its deadline because the caller no longer needs it
    (a newer save is waiting). `last` is the transient failure it was retrying."""

    def __init__(self, message: str, last: BaseException) -> None:
        super().__init__(message, getattr(last, "code", None))
        self.last = last


def is_transient(exc: BaseException) -> bool:
    """Would the same request, sent again later, plausibly succeed? Unreachable (refused,
    reset, timed out), gRPC UNAVAILABLE / DEADLINE_EXCEEDED, an HTTP 5xx (but 501, 505,
    507), or a stream refused because the service has too many open (nothing was read)."""
    from .transport import ServiceUnreachable  # the error types live with the wire

    if isinstance(exc, GaveUp):
        return False
    if isinstance(exc, ServiceUnreachable):
        return True
    if isinstance(exc, ServiceError):
        if exc.reason == CATALOG_BEHIND:  # an operator must run `lastgood-service rebuild`
            return False
        if getattr(exc, "busy", False):  # the service has too many streams open (transport._busy)
            return True
        code = exc.code
        if isinstance(code, int):
            return 500 <= code <= 599 and code not in PERMANENT_HTTP
        return code in TRANSIENT_GRPC
    return False


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {raw!r}")
    return value


@dataclass(frozen=True)
class RetryPolicy:
    deadline: float = 120.0   # seconds one call keeps retrying transient failures; 0: try once
    initial: float = 0.1      # the first backoff
    max_delay: float = 2.0    # backoffs double up to this
    multiplier: float = 2.0

    @classmethod
    def from_env(cls, **overrides) -> "RetryPolicy":
        """The defaults, then the LASTGOOD_RETRY_* environment, then explicit arguments."""
        base = cls(deadline=_env_float(ENV_DEADLINE, cls.deadline), initial=_env_float(ENV_INITIAL, cls.initial),
                   max_delay=_env_float(ENV_MAX_DELAY, cls.max_delay))
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def enabled(self) -> bool:
        return self.deadline > 0

    def delays(self):
        """Backoffs: capped exponential with full jitter (uniform in [0, cap])."""
        cap = self.initial
        while True:
            yield random.uniform(0, cap)
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
                    log.warning("lastgood: %s failed (%s); retrying for up to %.0fs", what, e, left)
                pause = min(next(delays), left)
                # sleep in short slices so that a newer save need not wait out a long backoff
                wake = time.monotonic() + pause
                while (now := time.monotonic()) < wake:
                    if stop is not None and stop():
                        raise GaveUp(f"{what}: stopped retrying ({e})", e) from e
                    time.sleep(min(0.05, wake - now))
                continue
            if tries:
                log.warning("lastgood: %s succeeded after %d failed tries", what, tries)
            return result


NO_RETRY = RetryPolicy(deadline=0.0)
