"""Replication: each sealed segment is streamed to the node's partner agents in the
background, throttled by a token bucket so it takes at most a configured share of the link.
The rank never waits on it; a partner that cannot be reached is an event, and the memory
checkpoint does not commit (its copy is never reported)."""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
import time
import urllib.parse
from dataclasses import dataclass

from lastgood.datapath.agents import connect
from lastgood.wire.tiers import AGENT_DIGEST_HEADER, AGENT_SEGMENTS_PATH

from .segments import CHUNK, Segments

log = logging.getLogger("lastgood.agent")
MAX_STATES = 4096  # the replication states kept for ranks to ask about (the newest jobs')


class TokenBucket:
    """At most `rate` bytes per second on average, bursts of at most `burst` bytes."""

    def __init__(self, rate: float | None, burst: int = CHUNK, clock=time.monotonic, sleep=time.sleep) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"a replication rate must be > 0 bytes/s, got {rate!r}")
        self.rate, self.burst = rate, burst
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait:
            self._sleep(wait)


def segment_path(run: str, checkpoint_id: int, rank: int, name: str) -> str:
    q = urllib.parse.quote
    return f"{AGENT_SEGMENTS_PATH}/{q(run, safe='')}/{checkpoint_id}/{rank}/{q(name, safe='')}"


@dataclass(frozen=True)
class Job:
    run: str
    checkpoint_id: int
    rank: int
    files: tuple[dict, ...]      # {"name", "size", "xxh3_128"} as this agent hashed them
    partners: tuple[str, ...]    # host:port of each partner agent


class Replicator:
    def __init__(self, segments: Segments, bucket: TokenBucket, on_event, timeout: float = 30.0) -> None:
        self.segments, self.bucket, self.on_event, self.timeout = segments, bucket, on_event, timeout
        self.q: queue.Queue[Job | None] = queue.Queue()
        self.sent_bytes = 0
        self.sent_seconds = 0.0  # time spent in sends that the partner acknowledged (throughput = bytes / this)
        self.done = 0
        # (run, checkpoint id, rank) -> how its replication stands: {"state": queued | sent | failed,
        # "partner", "detail"} for the newest MAX_STATES jobs; a rank waiting on its memory
        # commit asks (AGENT_REPLICATION_PATH) and gives the save up at once when a partner failed
        self.states: OrderedDict[tuple[str, int, int], dict] = OrderedDict()
        self._states_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="lastgood-agent-replicate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.q.put(None)

    def submit(self, job: Job) -> None:
        self._set(job, {"state": "queued"})
        self.q.put(job)

    def state(self, run: str, checkpoint_id: int, rank: int) -> dict | None:
        with self._states_lock:
            got = self.states.get((run, checkpoint_id, rank))
            return dict(got) if got is not None else None

    def _set(self, job: Job, state: dict) -> None:
        with self._states_lock:
            self.states[(job.run, job.checkpoint_id, job.rank)] = state
            self.states.move_to_end((job.run, job.checkpoint_id, job.rank))
            while len(self.states) > MAX_STATES:
                self.states.popitem(last=False)

    def _loop(self) -> None:
        while (job := self.q.get()) is not None:
            failed = None
            for partner in job.partners:
                for f in job.files:
                    try:
                        self._send(job, partner, f)
                    except Exception as e:  # noqa: BLE001 - any failure is the partner's event, never the agent's end
                        self.on_event("partner_unreachable", run=job.run, checkpoint_id=job.checkpoint_id,
                                      rank=job.rank, partner=partner, file=f["name"], detail=str(e)[:300])
                        failed = failed or {"state": "failed", "partner": partner, "detail": str(e)[:300]}
                        break
            self._set(job, failed or {"state": "sent"})
            self.done += 1
            self.q.task_done()

    def _send(self, job: Job, partner: str, f: dict) -> None:
        conn = connect(partner, self.timeout)  # a partner that is gone fails within the connect timeout
        start = time.perf_counter()
        try:
            conn.putrequest("PUT", segment_path(job.run, job.checkpoint_id, job.rank, f["name"]))
            conn.putheader("Content-Length", str(f["size"]))
            conn.putheader(AGENT_DIGEST_HEADER, f["xxh3_128"])
            conn.endheaders()
            with self.segments.open(job.run, job.checkpoint_id, job.rank, f["name"]) as src:
                # sendfile from the segment (shared memory) to the socket, a bucket's chunk
                # at a time: no copy through Python
                sent, size = 0, f["size"]
                while sent < size:
                    n = min(CHUNK, size - sent)
                    self.bucket.take(n)
                    n = conn.sock.sendfile(src, sent, n)  # waits on a socket with a timeout, as os.sendfile does not
                    if not n:
                        raise ConnectionError(f"the segment of {f['name']} ended after {sent} of {size} bytes")
                    sent += n
                    self.sent_bytes += n
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise ConnectionError(f"{partner} answered {resp.status}: {body[:200]!r}")
            self.sent_seconds += time.perf_counter() - start
        finally:
            conn.close()
