"""A rank's files written, hashed and read on a small pool of threads (hashing, os.write
and gRPC release the GIL), every call finished before the first error is raised."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

WORKERS = 4     # threads per rank that write (or read) its files
# PutShard streams a rank opens at once: the service allows max_streams_per_client (16) per
# token, and the ranks of a host usually share one: four each would overrun it on 8 ranks
STREAM_WORKERS = 2
T = TypeVar("T")


def run_all(fns: list[Callable[[], T]], workers: int = WORKERS, transport=None,
            undo: Callable[[T], None] | None = None) -> list[T]:
    """Call every function, at most `workers` at a time; results in order. Every call has
    finished before the first error is raised, so nothing runs on behind the caller; then
    `undo(result)` is called for each call that did succeed. `transport`: each worker's
    calls stop retrying when the caller's would (Transport.stoppable is per thread)."""
    stop = getattr(transport, "current_stop", lambda: None)()

    def call(fn):
        if stop is None:
            return fn()
        with transport.stoppable(stop):
            return fn()

    if len(fns) <= 1 or workers <= 1:
        futures = []
        for fn in fns:
            try:
                futures.append((fn(), None))
            except BaseException as e:  # noqa: BLE001 - raised below, after undo
                futures.append((None, e))
                break
        results = futures
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(fns)), thread_name_prefix="lastgood-file") as pool:
            futures = [pool.submit(call, fn) for fn in fns]
            results = [(None, f.exception()) if f.exception() is not None else (f.result(), None) for f in futures]
    first = next((e for _, e in results if e is not None), None)
    if first is not None:
        if undo is not None:
            for value, e in results:
                if e is None:
                    undo(value)
        raise first
    return [value for value, _ in results]
