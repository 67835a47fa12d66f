"""RestClient: the service's REST API, one method per call. torch-free and grpc-free.

The command line uses it alone (no gRPC channel is opened); Transport (transport.py) adds
the gRPC data path on top, and the Checkpointer, SpikeGuard and the DCP adapter reach the
catalog through these methods. Every call goes through the client's RetryPolicy; an error
answer becomes the class errors.from_http gives it (NotFound, Fenced, DataLoss, ...), and
no answer at all ServiceUnreachable. Without a policy it tries once (the command line).
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import threading
import urllib.error
import urllib.parse
import urllib.request

from lastgood.wire.vocab import Status
from lastgood import errors
from lastgood.errors import NotFound, ServiceUnreachable
from lastgood.wire import peerkey, tiers
from lastgood.wire.codes import GENERATION_HEADER
from lastgood.wire.info import Info
from lastgood.wire.manifest import IndexMismatch, Manifest
from lastgood.remote.retry import NO_RETRY, RetryPolicy

API_PREFIX = "/api/v1"  # every REST path below starts with it


def service_base(url: str) -> str:
    """The service's base URL from what a user gave: a URL copied from an API answer or the
    OpenAPI page (ending in /api/v1) names the same service."""
    url = url.rstrip("/")
    return url[: -len(API_PREFIX)] if url.endswith(API_PREFIX) else url


def q(segment: str) -> str:
    """One URL path segment, quoted (run names are safe already; tags are free text)."""
    return urllib.parse.quote(str(segment), safe="")


class RestClient:
    def __init__(self, base_url: str, timeout: float = 30.0, token: str | None = None,
                 retry: RetryPolicy | None = None) -> None:
        self.base_url = service_base(base_url)
        self.timeout = timeout
        self.retry = retry or NO_RETRY
        self._local = threading.local()  # this thread's stop() for retries, see stoppable()
        # a service with auth required wants `Authorization: Bearer <token>` on every call
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        # this launch's generation once registered (register_launch): sent with every call,
        # so that the service refuses a fenced launch's tags, pins and rollbacks
        self.generation: int | None = None
        # metadata this client fetched: path -> times, and bytes in all (manifests, tensor
        # indexes, last-good); what tests and bench/manifest.py count a restore by
        self.fetched: collections.Counter[str] = collections.Counter()
        self.fetched_bytes = 0

    def _metadata(self, path: str, query: dict | None = None) -> bytes:
        body = self._request("GET", path, query)
        self.fetched[path] += 1
        self.fetched_bytes += len(body)
        return body

    # ------------------------------------------------------------------ the wire
    def open(self, method: str, path: str, query: dict | None = None, body: dict | None = None,
             headers: dict | None = None):
        """Send one request; the open response (a context manager with read(n)) on 2xx.
        Raises the error the answer means (errors.from_http), or ServiceUnreachable."""
        url = self.base_url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method in ("POST", "PUT") else None)
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        if self.generation:
            hdrs[GENERATION_HEADER] = str(self.generation)
        req = urllib.request.Request(url, method=method, data=data, headers={**hdrs, **self._auth, **(headers or {})})
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise errors.from_http(method, path, e.code, e.read()) from None
        except urllib.error.URLError as e:
            raise ServiceUnreachable(f"cannot reach the lastgood service at {self.base_url}: {e.reason}") from None
        except (OSError, http.client.HTTPException) as e:  # timeouts, resets, no status line
            raise ServiceUnreachable(f"{method} {path}: no answer from the lastgood service: {e}") from None

    @contextlib.contextmanager
    def stoppable(self, stop):
        """Calls made by this thread inside `with client.stoppable(stop):` stop retrying
        (GaveUp) as soon as stop() says so."""
        self._local.stop = stop
        try:
            yield
        finally:
            self._local.stop = None

    def current_stop(self):
        """This thread's stop() (None outside stoppable()): a worker thread takes it on."""
        return getattr(self._local, "stop", None)

    def _retrying(self, fn, what: str):
        return self.retry.call(fn, what, stop=getattr(self._local, "stop", None))

    def _request(self, method: str, path: str, query: dict | None = None, body: dict | None = None,
                 headers: dict | None = None) -> bytes:
        def once() -> bytes:
            resp = self.open(method, path, query, body, headers)
            try:
                with resp:
                    return resp.read()
            except (OSError, http.client.HTTPException) as e:  # timeouts, resets, an answer cut short
                raise ServiceUnreachable(f"{method} {path}: no answer from the lastgood service: {e}") from None
        return self._retrying(once, f"{method} {path}")

    # the generic calls, for a route that has no method below yet
    def get_json(self, path: str, query: dict | None = None, headers: dict | None = None):
        return json.loads(self._request("GET", path, query, headers=headers))

    def post_json(self, path: str, body: dict | None = None, query: dict | None = None, headers: dict | None = None):
        return json.loads(self._request("POST", path, query, body, headers))

    def call(self, method: str, path: str, body: dict | None = None):
        return json.loads(self._request(method, path, None, body))

    # ------------------------------------------------------------------ service
    def service_info(self) -> Info:
        """The service's version, limits, gRPC endpoint and data paths (GET /api/v1/info)."""
        return Info.from_dict(self.get_json("/api/v1/info"))

    # ------------------------------------------------------------------ runs
    def runs(self, limit: int = 100, offset: int = 0) -> dict:
        return self.get_json("/api/v1/runs", {"limit": limit, "offset": offset})

    def run(self, run: str) -> dict:
        """One run: its last-good, counts and retention (NotFound: no such run)."""
        return self.get_json(f"/api/v1/runs/{q(run)}")

    def health(self, run: str, hang_timeout: float | None = None) -> dict:
        """The run's health: per rank its latest beat and verdict, the hung and straggling
        ranks, the timeout in force and the checkpoint interval (docs/health.md)."""
        return self.get_json(f"/api/v1/runs/{q(run)}/health",
                             {"hang_timeout": hang_timeout} if hang_timeout is not None else None)

    def heartbeat(self, run: str, beat: dict) -> None:
        """One rank's beat (client health.py builds it); tried once: the next beat is due soon."""
        with self.open("POST", f"/api/v1/runs/{q(run)}/heartbeats", body=beat):
            pass

    def last_good(self, run: str, *, required: bool = False) -> dict | None:
        """The run's last-good (its manifest read and checked by the service, not sent), or None
        when the service says the run has none: the run is unknown or never committed a
        checkpoint (NotFound; raised as such with required=True). A run whose checkpoints
        are all damaged raises NoUsableCheckpoint, and every other failure raises: an error
        is never read as "no checkpoint", which would start the training over."""
        try:
            return json.loads(self._metadata(f"/api/v1/runs/{q(run)}/last-good"))
        except NotFound as e:
            if required or not e.coded:  # not the service's answer (a proxy, a wrong URL): never "none"
                raise
            return None

    def checkpoints(self, run: str, status: str | None = None, limit: int = 100, offset: int = 0) -> dict:
        """One page of the run's checkpoints, newest step first (NotFound: no such run)."""
        query = {"limit": limit, "offset": offset, **({"status": status} if status else {})}
        return self.get_json(f"/api/v1/runs/{q(run)}/checkpoints", query)

    def committed(self, run: str, limit: int = 100) -> list[dict]:
        """The run's newest committed checkpoints; none for a run the service does not know."""
        try:
            return self.checkpoints(run, Status.COMMITTED, limit)["items"]
        except NotFound:
            return []

    def pending(self, run: str, limit: int = 100) -> list[dict]:
        """The run's pending checkpoints; none for a run the service does not know yet."""
        try:
            return self.checkpoints(run, Status.PENDING, limit)["items"]
        except NotFound:
            return []

    def lineage(self, run: str, limit: int = 10000, offset: int = 0) -> dict:
        return self.get_json(f"/api/v1/runs/{q(run)}/lineage", {"limit": limit, "offset": offset})

    def events(self, run: str, limit: int = 100, offset: int = 0) -> dict:
        return self.get_json(f"/api/v1/runs/{q(run)}/events", {"limit": limit, "offset": offset})

    def record_event(self, run: str, kind: str, data: dict) -> dict:
        """Add an event to the run's history (restart, save_given_up, ...)."""
        return self.post_json(f"/api/v1/runs/{q(run)}/events", {"kind": kind, "data": data})

    def register_launch(self, run: str, attempt: str, world_size: int) -> int:
        """Register this launch of the job (idempotent: every rank may call) and send its
        generation from now on; returns it. A newer launch's registration fences this one."""
        self.generation = int(self.post_json(f"/api/v1/runs/{q(run)}/launches",
                                             {"attempt": attempt, "world_size": world_size})["generation"])
        return self.generation

    def set_retention(self, run: str, retention: str | None) -> dict:
        """The run's own retention policy (None: the service default); the service checks it."""
        return self.call("PUT", f"/api/v1/runs/{q(run)}/retention", {"retention": retention})

    def rollback(self, run: str, target_id: int, spike_step: int, data: dict) -> dict:
        """Mark what the run saved after `target_id` suspect, tag the target and record the
        spike and rollback events (SpikeGuard)."""
        return self.post_json(f"/api/v1/runs/{q(run)}/rollback",
                              {"target_id": target_id, "spike_step": spike_step, "data": data})

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, checkpoint_id: int) -> dict:
        """One checkpoint: status, step, tags (and its manifest once committed)."""
        return self.get_json(f"/api/v1/checkpoints/{int(checkpoint_id)}")

    def outcome(self, checkpoint_id: int, wait: float) -> dict:
        """{"status", "missing_ranks"} of a checkpoint as soon as it is not PENDING, or after
        `wait` seconds. The service holds no thread while a rank waits here (a waiting CommitRank
        vote does), so every rank can wait at once; retried like every call, so a
        connection dropped while waiting is asked again (docs/control-plane.md)."""
        return self.get_json(f"/api/v1/checkpoints/{checkpoint_id}/outcome",
                             {"wait": min(wait, self.timeout / 2)})

    def ancestors(self, checkpoint_id: int) -> dict:
        """The checkpoint's ancestors (`items`, newest first) and `fallback_id`, the newest
        usable one (what last-good moves back to when this one turns out CORRUPT)."""
        return self.get_json(f"/api/v1/checkpoints/{int(checkpoint_id)}/ancestors")

    def verify(self, checkpoint_id: int) -> dict:
        return self.post_json(f"/api/v1/checkpoints/{int(checkpoint_id)}/verify")

    def tag(self, checkpoint_id: int, name: str, alias: bool = False) -> dict:
        return self.post_json(f"/api/v1/checkpoints/{int(checkpoint_id)}/tags", {"name": name, "alias": alias})

    def untag(self, checkpoint_id: int, name: str) -> dict:
        return self.call("DELETE", f"/api/v1/checkpoints/{int(checkpoint_id)}/tags/{q(name)}")

    def pin(self, checkpoint_id: int, pinned: bool = True) -> dict:
        return self.call("PUT" if pinned else "DELETE", f"/api/v1/checkpoints/{int(checkpoint_id)}/pin")

    def acquire_lease(self, checkpoint_id: int, holder: str, seconds: float = 3600.0) -> int:
        return self.post_json(f"/api/v1/checkpoints/{int(checkpoint_id)}/leases",
                              {"holder": holder, "seconds": seconds})["lease_id"]

    def release_lease(self, lease_id: int) -> None:
        self.call("DELETE", f"/api/v1/leases/{int(lease_id)}")

    # ---- the memory tier's node agents (agent/service.py; docs/memory-tier.md)
    def register_agent(self, place: dict) -> dict:
        """{"agent_id", "key"} for an agent at `place` ({"host", "rack", "switch", "address"})."""
        return self.post_json("/api/v1/agents", place)

    def agents(self) -> dict:
        return self.get_json("/api/v1/agents")

    def report_copies(self, checkpoint_id: int, body: dict, key: str) -> dict:
        """An agent's report of the memory files it holds and hashed (`body`: agent_id, rank, files)."""
        return self.post_json(f"/api/v1/checkpoints/{int(checkpoint_id)}/copies", body,
                              headers={tiers.AGENT_KEY_HEADER: key})

    def copies(self, checkpoint_id: int) -> dict:
        """The agents holding verified copies of a committed memory checkpoint's files."""
        return self.get_json(f"/api/v1/checkpoints/{int(checkpoint_id)}/copies")

    def agent_live(self, agent_id: int, key: str) -> dict:
        return self.get_json(f"/api/v1/agents/{int(agent_id)}/live", headers={tiers.AGENT_KEY_HEADER: key})

    # ---- data paths: direct uploads and reads (datapath/directs3.py), peer checks (datapath/peer.py)
    def _rank_path(self, checkpoint_id: int, rank: int, what: str) -> str:
        return f"/api/v1/checkpoints/{int(checkpoint_id)}/ranks/{int(rank)}/{what}"

    def upload_grant(self, checkpoint_id: int, rank: int, body: dict) -> dict:
        """Presigned part URLs for one file of a direct upload."""
        return self.post_json(self._rank_path(checkpoint_id, rank, "grants"), body)

    def direct_file(self, checkpoint_id: int, rank: int, body: dict) -> dict:
        """Hand over a file uploaded straight to the store: the service checks it there."""
        return self.post_json(self._rank_path(checkpoint_id, rank, "direct-files"), body)

    def read_grant(self, checkpoint_id: int, rank: int, file_name: str) -> dict:
        """A presigned GET of one committed file."""
        return self.get_json(self._rank_path(checkpoint_id, rank, f"read-grants/{q(file_name)}"))

    def peer_assignment(self, checkpoint_id: int, rank: int) -> dict:
        """What this rank is to check of its peer's files (LASTGOOD_VERIFICATION=peer), asked
        with this process's secret for the rank, whose commitment its vote carried (peerkey)."""
        return self.get_json(self._rank_path(checkpoint_id, rank, "peer-check"),
                             headers={peerkey.HEADER: peerkey.rank_secret(checkpoint_id, rank)})

    def peer_report(self, checkpoint_id: int, rank: int, body: dict) -> dict:
        """The digests this rank read back from its peer's files (with its secret, as above)."""
        return self.post_json(self._rank_path(checkpoint_id, rank, "peer-check"), body,
                              headers={peerkey.HEADER: peerkey.rank_secret(checkpoint_id, rank)})

    def manifest_bytes(self, checkpoint_id: int) -> bytes:
        """The exact manifest bytes the service committed (canonical JSON): a root of
        format 2 (no tensors: see index_bytes), or an old checkpoint's whole manifest."""
        return self._metadata(f"/api/v1/checkpoints/{int(checkpoint_id)}/manifest")

    def manifest(self, checkpoint_id: int) -> Manifest:
        """What a restore reads: every file's name, size and hash (lastgood/wire/manifest.py)."""
        # over REST: a manifest of thousands of ranks outgrows one gRPC message
        return Manifest.from_bytes(self.manifest_bytes(checkpoint_id))

    def index_bytes(self, checkpoint_id: int, rank: int, file_name: str) -> bytes:
        """One file's tensor index object, as stored (checked by the service; check it
        against the root with FileEntry.with_index)."""
        return self._metadata(f"/api/v1/checkpoints/{int(checkpoint_id)}/ranks/{int(rank)}/index/{q(file_name)}")

    def full_manifest(self, checkpoint_id: int, ranks=None) -> Manifest:
        """The manifest with the tensors of `ranks` (default: all), for tools (export):
        the root and one index object per file, each checked against the root's hash
        (a mismatch raises DataLoss, like a damaged file)."""
        m = self.manifest(checkpoint_id)
        try:
            return m.with_indexes(lambda r, f: self.index_bytes(checkpoint_id, r, f.name), ranks)
        except IndexMismatch as e:
            raise errors.DataLoss(f"checkpoint {checkpoint_id}: {e}") from None

    def open_file(self, checkpoint_id: int, rank: int, file_name: str, headers: dict | None = None):
        """One stored file as an open response to read from (not retried: a stream)."""
        return self.open("GET", f"/api/v1/checkpoints/{int(checkpoint_id)}/ranks/{int(rank)}/files/{q(file_name)}",
                         headers=headers)

    # ------------------------------------------------------------------ GC
    def gc_plan(self, full: bool = False) -> dict:
        """What GC would delete now: the runs changed since its last pass; `full`: every run
        and the store's orphans (unscoped tokens only)."""
        return self.get_json("/api/v1/gc/plan", query={"full": "true"} if full else None)

    def gc(self) -> dict:
        """Run GC now, for every run; its plan and result."""
        return self.post_json("/api/v1/gc", query={"dry_run": "false"})
