"""What a streaming RPC may hold, and for how long.

The gRPC server runs every call on one of a fixed pool of worker threads, and a streaming
call holds its worker for as long as its stream is open, even while it waits for a client
that sends nothing. Two limits keep such streams from taking the whole pool:

- `StreamSlots`: at most `total` streams open at once in the service (well below the worker
  count, so unary and control RPCs always find a worker), and at most `per_principal` for
  one caller (a token; with tokens off, one connection), so one caller's stalled streams do
  not refuse another's. Both are checked when a call starts, before a byte of its body is
  read, and the excess is refused at once.
- `IdleWatch`: a stream that neither delivers nor accepts a message for `idle_seconds` is
  cancelled, which frees its worker and its slot. One thread watches every stream; a
  message costs a clock read.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from ..domain.errors import StreamsBusy

log = logging.getLogger("lastgood.grpc")


class StreamSlots:
    def __init__(self, total: int, per_principal: int) -> None:
        self.total, self.per_principal = total, per_principal
        self._open: dict[str, int] = {}
        self._count = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, key: str):
        with self._lock:
            if self._count >= self.total:
                raise StreamsBusy(f"the service has {self.total} streams open, its limit "
                               f"(LASTGOOD_GRPC_MAX_STREAMS); retry later")
            if self._open.get(key, 0) >= self.per_principal:
                raise StreamsBusy(f"{self.per_principal} streams are already open for this caller "
                               f"(LASTGOOD_MAX_STREAMS_PER_CLIENT); retry later")
            self._open[key] = self._open.get(key, 0) + 1
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
                self._open[key] -= 1
                if not self._open[key]:
                    del self._open[key]


class _Watched:
    """One stream's clock: `busy()` while the service itself works (hashing, writing a blob:
    not the client's idleness), `waiting()` while it waits on the client."""

    __slots__ = ("context", "since", "method")

    def __init__(self, context, method: str) -> None:
        self.context, self.method = context, method
        self.since = time.monotonic()

    def waiting(self) -> None:
        self.since = time.monotonic()

    def busy(self) -> None:
        self.since = None


class IdleWatch:
    def __init__(self, idle_seconds: float) -> None:
        self.idle_seconds = idle_seconds
        self._streams: dict[int, _Watched] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, context, method: str):
        """Watch one stream from now on (it starts out waiting for the client)."""
        w = _Watched(context, method)
        with self._lock:
            self._streams[id(w)] = w
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="grpc-idle-watch", daemon=True)
                self._thread.start()
        try:
            yield w
        finally:
            with self._lock:
                del self._streams[id(w)]

    def _loop(self) -> None:
        tick = min(1.0, self.idle_seconds / 4)
        while True:
            time.sleep(tick)
            now = time.monotonic()
            with self._lock:
                idle = [w for w in self._streams.values()
                        if w.since is not None and now - w.since > self.idle_seconds]
            for w in idle:
                w.since = None  # cancelled once
                log.warning("%s: no message for %.1f s (LASTGOOD_GRPC_IDLE_TIMEOUT); cancelling the stream",
                            w.method, self.idle_seconds)
                w.context.cancel()  # unblocks the worker: its read or write ends
