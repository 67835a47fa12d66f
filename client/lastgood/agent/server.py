"""The agent process: its HTTP protocol (stdlib http.server: a handful of routes, streamed
bodies, no dependency the agent would not otherwise need), the ready path of a rank's files,
and the loop that frees segments the service no longer lists live.

HTTP rather than gRPC: a replica and a ranged read are one streamed body each, and a
`Range:` header is the whole read plan; the rank's call is a local JSON post.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lastgood.errors import Refused
from lastgood.wire import tiers
from lastgood.wire.codes import HASH_MISMATCH
from lastgood.wire.hashing import is_valid_hex

from .replicate import Job, Replicator, TokenBucket
from .segments import BudgetExceeded, SegmentMissing, Segments, check_key
from .service import SERVICE_ERRORS, ServiceLink

log = logging.getLogger("lastgood.agent")
MAX_JSON = 1 << 20
MAX_EVENTS = 1000
_RANGE = re.compile(r"bytes=(\d{1,15})-(\d{0,15})")


class Agent:
    """One node's agent. `peers` ({host label: address}) fixes the placement when no service
    link is given (a test, or a service without the agents route); with one, the placement is
    the service's list of registered agents."""

    def __init__(self, segments: Segments, host: str, *, rack: str = "", switch: str = "",
                 bind: tuple[str, int] = ("127.0.0.1", 0), advertise: str | None = None,
                 service: ServiceLink | None = None, peers: dict[str, str] | None = None,
                 rate: float | None = None, live_every: float = 5.0, adopt: bool = True) -> None:
        self.segments = segments
        self.host, self.rack, self.switch = (tiers.check_label("host", host),
                                             tiers.check_label("rack", rack) if rack else "",
                                             tiers.check_label("switch", switch) if switch else "")
        self.httpd = ThreadingHTTPServer(bind, _handler(self))
        self.httpd.daemon_threads = True
        self.address = advertise or f"{bind[0]}:{self.httpd.server_address[1]}"
        self.service, self.peers, self.live_every = service, dict(peers or {}), live_every
        self.events: list[dict] = []
        self.replicator = Replicator(segments, TokenBucket(rate), self.event)
        self._stop = threading.Event()
        self.adopt = adopt
        self.served_bytes = 0  # segment bytes sent to readers (ranks restoring, ranged reads)
        self._served = threading.Lock()
        self._unreported: list[tuple[str, int, int, list[dict]]] = []  # adopted, not yet reported

    # ---------------------------------------------------------------- life
    def _take_over(self) -> None:
        """What an earlier agent left on the node (segments.adopt): held again and reported
        (the service lists a new agent's copies only once reported, and its live list keeps
        only those), or removed (`adopt=False`: `lastgood agent --fresh`). Until a report of
        an adopted rank is answered, the live loop frees none of its checkpoint."""
        if not self.adopt:
            self.segments.drop_all()
            return
        self._unreported = self.segments.adopt()
        if self._unreported:
            self.event("adopted", checkpoints=sorted({(r, c) for r, c, _, _ in self._unreported}),
                       files=sum(len(f) for *_, f in self._unreported),
                       bytes=sum(x["size"] for *_, f in self._unreported for x in f))

    def _report_adopted(self) -> None:
        left = []
        for run, cid, rank, files in self._unreported:
            try:
                self.service.report(cid, rank, files)
            except Refused:  # answered (gone, decided otherwise): the live list settles it
                continue
            except SERVICE_ERRORS as e:
                self.event("report_failed", run=run, checkpoint_id=cid, rank=rank, detail=str(e)[:300])
                left.append((run, cid, rank, files))
        self._unreported = left

    def start(self) -> None:
        self._take_over()
        if self.service is not None:
            self.service.address = self.address
            if self.register():
                self._report_adopted()
        self.replicator.start()
        threading.Thread(target=self.httpd.serve_forever, name="lastgood-agent-http", daemon=True).start()
        if self.service is not None:
            threading.Thread(target=self._live_loop, name="lastgood-agent-live", daemon=True).start()

    def register(self) -> bool:
        """Register with the service; while it cannot (an outage, a service without the agents
        route) the agent serves what it holds and reports nothing: memory checkpoints of its
        node cannot commit. The live loop tries again."""
        try:
            self.service.register()
            return True
        except SERVICE_ERRORS as e:
            self.event("register_failed", detail=str(e)[:300])
            return False

    def stop(self) -> None:
        self._stop.set()
        self.replicator.stop()
        self.httpd.shutdown()
        self.httpd.server_close()

    def served(self, nbytes: int) -> None:
        with self._served:
            self.served_bytes += nbytes

    def event(self, kind: str, **fields) -> None:
        log.warning("%s %s", kind, fields)
        self.events.append({"kind": kind, "at": time.time(), **fields})
        del self.events[:-MAX_EVENTS]

    # ---------------------------------------------------------------- placement
    def partners(self, replicas: int) -> list[str]:
        if replicas == 0:
            return []
        if self.service is not None:
            try:
                ring = self.service.agents()
            except SERVICE_ERRORS as e:    # no placement while the service is away
                self.event("placement_unknown", detail=str(e)[:300])
                return []
            own = self.service.place()
        else:
            hosts = sorted({self.host, *self.peers})
            ring = {tiers.AgentPlace(host=h, agent_id=i): self.peers[h]
                    for i, h in enumerate(hosts) if h != self.host}
            own = tiers.AgentPlace(self.rack, self.switch, self.host, hosts.index(self.host))
        ring.pop(own, None)
        return [ring[p] for p in tiers.partners(list(ring), own, replicas)]

    # ---------------------------------------------------------------- a rank's files
    def ready(self, run: str, checkpoint_id: int, rank: int, files: list[str], replicas: int) -> dict:
        partners = self.partners(replicas)
        if len(partners) < replicas:
            self.event("memory_given_up", run=run, checkpoint_id=checkpoint_id, rank=rank,
                       detail=f"{replicas} partner(s) needed on other hosts, {len(partners)} known")
            raise LookupError(f"{replicas} partner agent(s) on other hosts are needed, {len(partners)} known")
        digests = self.segments.seal(run, checkpoint_id, rank, files)
        self._report(run, checkpoint_id, rank, digests)
        self.replicator.submit(Job(run, checkpoint_id, rank, tuple(digests), tuple(partners)))
        return {"files": digests, "partners": partners}

    def received(self, run: str, checkpoint_id: int, rank: int, digest: dict) -> None:
        self._report(run, checkpoint_id, rank, [digest])

    def _report(self, run: str, checkpoint_id: int, rank: int, files: list[dict]) -> None:
        if self.service is None or self.service.agent_id is None:
            return
        try:
            self.service.report(checkpoint_id, rank, files)
        except SERVICE_ERRORS as e:
            self.event("report_failed", run=run, checkpoint_id=checkpoint_id, rank=rank, detail=str(e)[:300])

    def _live_loop(self) -> None:
        while not self._stop.wait(self.live_every):
            if self.service.agent_id is not None or self.register():
                self._report_adopted()
                self.free_dead()

    def free_dead(self) -> None:
        """Free every held checkpoint the service does not list live (never on an outage)."""
        try:
            live = self.service.live()
        except SERVICE_ERRORS as e:
            self.event("live_unknown", detail=str(e)[:300])
            return
        unreported = {(run, cid) for run, cid, _, _ in self._unreported}
        for key in self.segments.keys() - live - unreported:
            self.segments.free(*key)

    def status(self) -> dict:
        return {"host": self.host, "address": self.address,
                "agent_id": self.service.agent_id if self.service else None,
                "budget": self.segments.budget, "held_bytes": self.segments.held_bytes(),
                "pooled_bytes": self.segments.pooled_bytes(), "recycled_files": self.segments.recycled,
                "segments": self.segments.listing(), "freed": [list(k) for k in self.segments.freed],
                "replicated_bytes": self.replicator.sent_bytes, "served_bytes": self.served_bytes, "replication_jobs_done": self.replicator.done,
                "replication_seconds": round(self.replicator.sent_seconds, 6),
                "events": list(self.events)}


class BadRequest(ValueError):
    pass


def _handler(agent: Agent):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # the agent logs events, not every request
            pass

        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _json(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            if not 0 < n <= MAX_JSON:
                raise BadRequest(f"a JSON body of 1..{MAX_JSON} bytes is expected")
            try:
                body = json.loads(self.rfile.read(n))
            except ValueError as e:
                raise BadRequest(f"the body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            return body

        def _key(self, prefix: str, with_file: bool) -> tuple:
            """(run, checkpoint id, rank[, file]) from `prefix`/<run>/<checkpoint id>/<rank>[/<file>], checked."""
            parts = urllib.parse.urlsplit(self.path).path[len(prefix) + 1:].split("/")
            if len(parts) != 3 + with_file or not parts[1].isdigit() or not parts[2].isdigit():
                raise BadRequest(f"{prefix}/<run>/<checkpoint id>/<rank>{'/<file>' if with_file else ''} expected")
            key = (urllib.parse.unquote(parts[0]), int(parts[1]), int(parts[2]),
                   *([urllib.parse.unquote(parts[3])] if with_file else []))
            check_key(*key)
            return key

        def _segment(self) -> tuple[str, int, int, str]:
            return self._key(tiers.AGENT_SEGMENTS_PATH, True)

        def _local(self) -> None:
            """Where a held file lies on this host, for a rank here to read it itself (no copy
            through this process; the rank hashes what it reads against the manifest)."""
            key = self._key(tiers.AGENT_LOCAL_PATH, True)
            size, digest = agent.segments.digest(*key)
            self._answer(200, {"path": str(agent.segments.path(*key)), "size": size, "xxh3_128": digest})

        def _guarded(self, fn) -> None:
            try:
                fn()
            except BudgetExceeded as e:
                agent.event("memory_refused", detail=str(e)[:300])
                self._answer(507, {"error": "budget", "detail": str(e)})
            except (SegmentMissing, LookupError) as e:
                self._answer(404 if isinstance(e, SegmentMissing) else 409, {"error": "missing", "detail": str(e)})
            except (BadRequest, ValueError, TypeError, KeyError) as e:
                self._answer(400, {"error": "bad_request", "detail": str(e)[:500]})
            except (ConnectionError, TimeoutError) as e:
                self.close_connection = True
                agent.event("copy_cut_short", detail=str(e)[:300])

        def do_GET(self) -> None:
            path = urllib.parse.urlsplit(self.path).path
            if path == tiers.AGENT_STATUS_PATH:
                return self._answer(200, agent.status())
            if path.startswith(tiers.AGENT_SEGMENTS_PATH + "/"):
                return self._guarded(self._read)
            if path.startswith(tiers.AGENT_LOCAL_PATH + "/"):
                return self._guarded(self._local)
            if path.startswith(tiers.AGENT_REPLICATION_PATH + "/"):
                return self._guarded(self._replication)
            self._answer(404, {"error": "no_route", "detail": path[:200]})

        def _replication(self) -> None:
            run, cid, rank = self._key(tiers.AGENT_REPLICATION_PATH, False)
            got = agent.replicator.state(run, cid, rank)
            if got is None:
                raise SegmentMissing(f"no replication of {run}/{cid}/{rank} is known here")
            self._answer(200, got)

        def _read(self) -> None:
            key = self._segment()
            size, digest = agent.segments.digest(*key)
            start, end = 0, size
            rng = self.headers.get("Range")
            if rng is not None:
                m = _RANGE.fullmatch(rng.strip())
                if not m:
                    raise BadRequest(f"Range must be bytes=START-[END], got {rng[:60]!r}")
                start, end = int(m.group(1)), (int(m.group(2)) + 1 if m.group(2) else size)
                if not start <= end <= size:
                    raise BadRequest(f"range {start}-{end} is outside the file's {size} bytes")
            with agent.segments.open(*key) as f:
                f.seek(start)
                self.send_response(206 if rng is not None else 200)
                self.send_header("Content-Length", str(end - start))
                self.send_header(tiers.AGENT_DIGEST_HEADER, digest)
                self.end_headers()
                self.wfile.flush()
                self.connection.sendfile(f, start, end - start)   # os.sendfile: no copy through Python
            agent.served(end - start)

        def do_PUT(self) -> None:
            if not urllib.parse.urlsplit(self.path).path.startswith(tiers.AGENT_SEGMENTS_PATH + "/"):
                return self._answer(404, {"error": "no_route"})
            self._guarded(self._receive)

        def _receive(self) -> None:
            key = self._segment()
            size = int(self.headers.get("Content-Length") or -1)
            if size < 0:
                raise BadRequest("Content-Length is required")
            got = agent.segments.receive(*key, size, self.rfile.readinto)
            agent.received(key[0], key[1], key[2], got)
            claimed = self.headers.get(tiers.AGENT_DIGEST_HEADER, "")
            if is_valid_hex(claimed) and claimed != got["xxh3_128"]:
                agent.event(HASH_MISMATCH, run=key[0], checkpoint_id=key[1], rank=key[2], file=key[3],
                            sent=claimed, received=got["xxh3_128"])
            self._answer(200, got)

        def do_POST(self) -> None:
            path = urllib.parse.urlsplit(self.path).path
            if path == tiers.AGENT_READY_PATH:
                return self._guarded(self._ready)
            if path == tiers.AGENT_RESERVE_PATH:
                return self._guarded(self._reserve)
            self._answer(404, {"error": "no_route", "detail": path[:200]})

        def _ready(self) -> None:
            b = self._json()
            files = b["files"]
            if not isinstance(files, list) or not files:
                raise BadRequest("files must be a non-empty list of file names")
            replicas = b.get("replicas", tiers.DEFAULT_REPLICAS)
            if not isinstance(replicas, int) or not 0 <= replicas <= tiers.MAX_REPLICAS:
                raise BadRequest(f"replicas must be 0..{tiers.MAX_REPLICAS}")
            self._answer(200, agent.ready(b["run"], b["checkpoint_id"], b["rank"], files, replicas))

        def _reserve(self) -> None:
            b = self._json()
            files = b.get("files") or []
            if not isinstance(files, list) or not all(
                    isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("size"), int)
                    and not isinstance(f.get("size"), bool) and f["size"] >= 0 for f in files):
                raise BadRequest("files must be a list of {name, size} (a non-negative integer)")
            d = agent.segments.reserve(b["run"], b["checkpoint_id"], b["rank"], b["bytes"],
                                       [(f["name"], f["size"]) for f in files])
            self._answer(200, {"directory": str(d)})

    return Handler
