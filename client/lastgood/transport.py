"""The client's wire: gRPC for the data path, REST for catalog reads. torch-free.

RestClient is the REST half alone (urllib, no gRPC channel): the command line uses it.
Transport adds the gRPC data path on top.

The only thing configured is the REST base URL; the gRPC endpoint is learned from
GET /api/v1/info. Every call goes through one RetryPolicy (retry.py): transient failures
(the service restarting, a dropped connection, a 5xx, a PutShard refused because the
service has too many streams open) are retried with backoff until its deadline;
everything the service refuses surfaces at once as ServiceError with its message.
RestClient alone (the command line) tries once unless given a policy.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Iterator

# DataLoader workers fork the trainer process while the upload thread may be inside gRPC.
# The children never use gRPC, so its fork handlers would only log warnings and stall the
# fork; keep them off unless the user asked for them (read when grpc is first imported).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402

from . import names, wire
from .errors import CorruptCheckpoint, NoUsableCheckpoint, ServiceError
from .fencing import ERROR_METADATA, GENERATION_HEADER
from .hashing import StreamHasher
from .manifest import Manifest
from .retry import NO_RETRY, GaveUp, RetryPolicy
from .v1 import lastgood_pb2 as pb
from .v1 import lastgood_pb2_grpc as pb_grpc

CHUNK = 4 * 1024 * 1024
log = logging.getLogger("lastgood")
# reconnect soon after a restarted service listens again (gRPC's own default backs off to 120 s)
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
              ("grpc.max_reconnect_backoff_ms", 1000)]
_SPOOL_WRITE = 8 * 1024 * 1024
# the service's answers to GET /runs/{run}/last-good that mean "nothing to restore"
NO_CHECKPOINT = ("not_found", "no_checkpoint")


# Channels still open when the interpreter finalizes are torn down in no set order with
# the modules grpc needs (grpc/grpc#11804, #17004). DCP's StorageWriter/Reader have no
# close(), and a trainer may forget Checkpointer.close(): close what is left at exit.
_open: "weakref.WeakSet[Transport]" = weakref.WeakSet()


@atexit.register
def _close_open_channels() -> None:
    for t in list(_open):
        try:
            t.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def _find_spool(spec: dict | None) -> dict | None:
    """The service's spool, if this process sees the same directory (its id file matches)
    and may write there; LASTGOOD_SPOOL=0 turns the hand-over off."""
    if not spec or os.environ.get("LASTGOOD_SPOOL", "1") == "0":
        return None
    try:
        with open(os.path.join(spec["dir"], names.SPOOL_ID_FILE)) as f:
            same = f.read().strip() == spec["id"]
    except (OSError, KeyError, TypeError):
        return None
    return spec if same and os.access(spec["dir"], os.W_OK | os.X_OK) else None


def _service_error(e: grpc.RpcError, what: str) -> ServiceError:
    code = e.code() if hasattr(e, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    trailing = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
    return ServiceError(f"{what}: {name}: {e.details() if hasattr(e, 'details') else e}", name,
                        trailing.get(ERROR_METADATA))


class HttpError(ServiceError):
    """The service answered with an HTTP error. `code` is the HTTP status (as on every
    ServiceError from REST), `reason` the service's error code name (`not_found`,
    `hash_mismatch`, ...) and `detail` its message, without the method and path."""

    def __init__(self, message: str, status: int, reason: str | None, detail: str) -> None:
        super().__init__(message, status, reason)
        self.status = status
        self.detail = detail


class ServiceUnreachable(ServiceError):
    """No answer from the service: refused, unresolvable, reset, or timed out."""


class RestClient:
    """The REST half of the wire, on urllib alone: no gRPC channel is opened, so the
    command line (lastgood.cli) uses it directly and Transport builds on it."""

    def __init__(self, base_url: str, timeout: float = 30.0, token: str | None = None,
                 retry: RetryPolicy | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retry = retry or NO_RETRY
        self._local = threading.local()  # this thread's stop() for retries, see stoppable()
        # a service with auth required wants `Authorization: Bearer <token>` on every call
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        # this launch's generation once registered (register_launch): sent with every call,
        # so that the service refuses a fenced launch's tags, pins and rollbacks
        self.generation: int | None = None

    def open(self, method: str, path: str, query: dict | None = None, body: dict | None = None,
             headers: dict | None = None):
        """Send one request; the open response (a context manager with read(n)) on 2xx.
        Raises HttpError with the service's JSON error message, or ServiceUnreachable."""
        url = self.base_url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method in ("POST", "PUT") else None)
        hdrs = {"Content-Type": "application/json"} if body is not None else {}
        if self.generation:
            hdrs[GENERATION_HEADER] = str(self.generation)
        req = urllib.request.Request(url, method=method, data=data, headers={**hdrs, **self._auth, **(headers or {})})
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raw = e.read()
            reason = None
            try:
                err = json.loads(raw)["error"]
                msg, reason = err["message"], err.get("code")
            except Exception:
                msg = raw[:500].decode(errors="replace")
            raise HttpError(f"{method} {path}: HTTP {e.code}: {msg}", e.code, reason, msg) from None
        except urllib.error.URLError as e:
            raise ServiceUnreachable(f"cannot reach the lastgood service at {self.base_url}: {e.reason}") from None
        except OSError as e:  # timeouts and resets before the answer's head
            raise ServiceUnreachable(f"{method} {path}: no answer from the lastgood service: {e}") from None

    @contextlib.contextmanager
    def stoppable(self, stop):
        """Calls made by this thread inside `with transport.stoppable(stop):` stop retrying
        (GaveUp) as soon as stop() says so."""
        self._local.stop = stop
        try:
            yield
        finally:
            self._local.stop = None

    def _retrying(self, fn, what: str):
        return self.retry.call(fn, what, stop=getattr(self._local, "stop", None))

    def _request(self, method: str, path: str, query: dict | None = None, body: dict | None = None) -> bytes:
        def once() -> bytes:
            resp = self.open(method, path, query, body)
            try:
                with resp:
                    return resp.read()
            except OSError as e:  # timeouts and resets while reading the answer
                raise ServiceUnreachable(f"{method} {path}: no answer from the lastgood service: {e}") from None
        return self._retrying(once, f"{method} {path}")

    def get_json(self, path: str, query: dict | None = None):
        return json.loads(self._request("GET", path, query))

    def post_json(self, path: str, body: dict | None = None, query: dict | None = None):
        return json.loads(self._request("POST", path, query, body))

    def call(self, method: str, path: str, body: dict | None = None):
        return json.loads(self._request(method, path, None, body))

    def last_good(self, run: str) -> dict | None:
        """The run's last-good (with its manifest, read and checked by the service), or None
        when the service says the run has none: the run is unknown (`not_found`) or never
        committed a checkpoint (`no_checkpoint`). A run whose checkpoints are all damaged
        raises NoUsableCheckpoint, and every other failure raises: an error is never read
        as "no checkpoint", which would start the training over."""
        try:
            return self.get_json(f"/api/v1/runs/{run}/last-good")
        except HttpError as e:
            if e.status == 404 and e.reason in NO_CHECKPOINT:
                return None
            if e.reason == "no_usable_checkpoint":
                raise NoUsableCheckpoint(e.detail) from None
            raise

    def register_launch(self, run: str, attempt: str, world_size: int) -> int:
        """Register this launch of the job (idempotent: every rank may call) and send its
        generation from now on; returns it. A newer launch's registration fences this one."""
        self.generation = int(self.post_json(f"/api/v1/runs/{run}/launches",
                                             {"attempt": attempt, "world_size": world_size})["generation"])
        return self.generation

    def committed(self, run: str, limit: int = 100) -> list[dict]:
        try:
            return self.get_json(f"/api/v1/runs/{run}/checkpoints",
                                 {"status": "COMMITTED", "limit": limit})["items"]
        except ServiceError as e:
            if e.code == 404:
                return []
            raise

    def verify(self, checkpoint_id: int) -> dict:
        return self.post_json(f"/api/v1/checkpoints/{checkpoint_id}/verify")

    def acquire_lease(self, checkpoint_id: int, holder: str, seconds: float = 3600.0) -> int:
        return self.post_json(f"/api/v1/checkpoints/{checkpoint_id}/leases",
                              {"holder": holder, "seconds": seconds})["lease_id"]

    def release_lease(self, lease_id: int) -> None:
        self.call("DELETE", f"/api/v1/leases/{lease_id}")

    def manifest_bytes(self, checkpoint_id: int) -> bytes:
        """The exact manifest bytes the service committed (canonical JSON)."""
        return self._request("GET", f"/api/v1/checkpoints/{checkpoint_id}/manifest")

    def manifest(self, checkpoint_id: int) -> Manifest:
        # over REST: a manifest of thousands of ranks outgrows one gRPC message
        return Manifest.from_bytes(self.manifest_bytes(checkpoint_id))


class Transport(RestClient):
    def __init__(self, base_url: str, timeout: float = 30.0, token: str | None = None,
                 retry: RetryPolicy | None = None) -> None:
        # a service that is starting (or restarting) is waited for, up to the policy's deadline
        super().__init__(base_url, timeout, token, retry or RetryPolicy.from_env())
        # the same bearer token on every gRPC call, as call metadata
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self.info = info = self.get_json("/api/v1/info")
        self.grpc_target = info["grpc_target"]
        self.chunk = min(CHUNK, int(info.get("max_chunk_bytes", CHUNK)))
        limit = self.chunk + 64 * 1024
        self._channel = grpc.insecure_channel(self.grpc_target, options=[
            ("grpc.max_receive_message_length", max(limit, 256 * 1024 * 1024)),
            ("grpc.max_send_message_length", limit), *_RECONNECT])
        self._stub = pb_grpc.CheckpointsStub(self._channel)
        self.spool = _find_spool(info.get("spool"))
        _open.add(self)
        # the shard streams carry hand-framed chunks (see wire.py): raw bytes at this end
        self._put_shard = self._channel.stream_unary(
            "/lastgood.v1.Checkpoints/PutShard", request_serializer=None,
            response_deserializer=pb.PutShardResponse.FromString)
        self._get_shard = self._channel.unary_stream(
            "/lastgood.v1.Checkpoints/GetShard", request_serializer=pb.GetShardRequest.SerializeToString,
            response_deserializer=None)

    def close(self) -> None:
        _open.discard(self)
        self._channel.close()

    # ---------------------------------------------------------------- gRPC
    def _unary(self, what: str, method, request, timeout: float | None = None):
        def once():
            try:
                return method(request, timeout=timeout or self.timeout, metadata=self._md)
            except grpc.RpcError as e:
                err = _service_error(e, what)
                # a refusal for too many open streams read nothing: the ranks take turns
                err.busy = _busy(e)
                raise err from None
        return self._retrying(once, what)

    def begin(self, run: str, step: int, world_size: int, parent_id: int | None, attempt: str,
              rank: int, expected_bytes: int = 0) -> pb.BeginCheckpointResponse:
        return self._unary("BeginCheckpoint", self._stub.BeginCheckpoint, pb.BeginCheckpointRequest(
            run=run, step=step, world_size=world_size, parent_id=parent_id or 0, attempt=attempt, rank=rank,
            generation=self.generation or 0, expected_bytes=expected_bytes))

    def spool_write(self, data, hasher: StreamHasher | None = None) -> str | None:
        """Write a shard into the service's spool (same host, see the service's
        domain/spool.py) and return the file's name for put_shard(spooled=...); None when
        there is no spool here or writing failed (the shard is then streamed). `hasher` is
        fed each piece just before it is written, while it is in the CPU's cache (one pass
        over the shard instead of two: 0.215 against 0.246 s for 1 GiB here)."""
        if self.spool is None:
            return None
        view = memoryview(data).cast("B")
        name = names.new_spool_name()
        path = os.path.join(self.spool["dir"], name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                off = 0
                while off < view.nbytes:  # no fsync: the service fsyncs the file it adopts
                    piece = view[off:off + _SPOOL_WRITE]
                    if hasher is not None:
                        hasher.update(piece)
                    while piece.nbytes:
                        n = os.write(fd, piece)
                        piece, off = piece[n:], off + n
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("lastgood: writing to the spool %s failed (%s); streaming instead", self.spool["dir"], e)
            self.spool_discard(name)
            return None
        return name

    def spool_discard(self, name: str | None, spool: dict | None = None) -> None:
        """Remove a spool file the service did not take (it is gone once the service took it)."""
        spool = spool or self.spool
        if name and spool is not None:
            try:
                os.unlink(os.path.join(spool["dir"], name))
            except OSError:
                pass

    def put_shard(self, checkpoint_id: int, rank: int, file_name: str, data: memoryview,
                  xxh3: str, spooled: str | None = None) -> pb.PutShardResponse:
        """Stream the shard, or hand over the spool file `spooled` holding the same bytes.
        Whatever goes wrong with a hand-over, the bytes are streamed next, and that answer
        is final: a service that declines the spool (another host's, none configured) or
        no longer finds the file (a retry after a lost reply, a restart, a sweep) gets the
        stream, which is a no-op when the shard was stored already."""
        data = memoryview(data).cast("B")
        header = pb.ShardHeader(checkpoint_id=checkpoint_id, rank=rank, file_name=file_name, size=data.nbytes,
                                xxh3_128=xxh3)
        if spooled and self.spool is not None:
            spool = self.spool
            spooled_header = pb.ShardHeader()
            spooled_header.CopyFrom(header)
            spooled_header.spool_file, spooled_header.spool_id = spooled, spool["id"]
            try:
                return self._put(lambda: iter((pb.PutShardRequest(header=spooled_header).SerializeToString(),)))
            except GaveUp:
                raise
            except ServiceError as e:
                log.warning("lastgood: the spooled hand-over of %s failed (%s); streaming it", file_name, e)
                if "spool: the header names another spool" in str(e) or "takes no spooled files" in str(e):
                    self.spool = None  # this service does not read that directory: stream from now on
            finally:
                self.spool_discard(spooled, spool)

        def messages() -> Iterator[bytes]:
            yield pb.PutShardRequest(header=header).SerializeToString()
            for off in range(0, data.nbytes, self.chunk):
                yield wire.frame(wire.PUT_CHUNK, data[off:off + self.chunk])

        return self._put(messages)

    def _put(self, messages) -> pb.PutShardResponse:
        """One PutShard call; `messages()` makes the stream anew for each try."""
        return self._unary("PutShard", lambda _r, timeout, metadata: self._put_shard(messages(), timeout=timeout,
                                                                                    metadata=metadata),
                           None, timeout=max(self.timeout, 3600.0))

    def commit_rank(self, checkpoint_id: int, rank: int, files: list[str], wait: float) -> pb.CommitRankResponse:
        return self._unary("CommitRank", self._stub.CommitRank, pb.CommitRankRequest(
            checkpoint_id=checkpoint_id, rank=rank, files=files, wait_seconds=wait), timeout=wait + self.timeout)

    def outcome(self, checkpoint_id: int, wait: float) -> dict:
        """{"status", "missing_ranks"} of a checkpoint as soon as it is not PENDING, or after
        `wait` seconds. The service holds no thread while a rank waits here (the waiting
        CommitRank vote does), so every rank can wait at once; retried like every call, so a
        connection dropped while waiting is asked again (docs/control-plane.md)."""
        return self.get_json(f"/api/v1/checkpoints/{checkpoint_id}/outcome",
                             {"wait": min(wait, self.timeout / 2)})

    def abort(self, checkpoint_id: int, reason: str, rank: int) -> None:
        self._unary("AbortCheckpoint", self._stub.AbortCheckpoint,
                    pb.AbortCheckpointRequest(checkpoint_id=checkpoint_id, reason=reason, rank=rank))

    def read_file(self, checkpoint_id: int, rank: int, file_name: str, size: int,
                  into=None) -> tuple[memoryview, str]:
        """The whole file, and the xxh3-128 of what arrived (hashed while receiving), written
        into `into` (a writable buffer of at least `size` bytes; by default a new one). On
        the service's host it may come as a link in the spool instead of a stream."""
        view = memoryview(bytearray(size) if into is None else into).cast("B")
        if view.nbytes < size:
            raise ValueError(f"read_file: a buffer of {view.nbytes} bytes cannot hold {size}")
        view = view[:size]

        def once() -> str:  # a retry after a broken stream starts over
            hasher = StreamHasher()
            pos = 0
            spool = self.spool
            try:
                for raw in self._get_shard(pb.GetShardRequest(checkpoint_id=checkpoint_id, rank=rank,
                                                              file_name=file_name, spool_id=spool["id"] if spool else ""),
                                           timeout=max(self.timeout, 3600.0), metadata=self._md):
                    chunk = wire.unframe(raw, wire.GET_CHUNK)
                    if chunk is None:
                        msg = pb.GetShardResponse.FromString(raw)
                        if msg.spool_file:
                            if pos or spool is None:
                                raise ServiceError(f"GetShard answered with a spool file mid-stream for {file_name}")
                            pos = _read_lent(spool["dir"], msg.spool_file, view, hasher)
                            continue
                        chunk = msg.chunk
                    n = len(chunk)
                    if pos + n > size:
                        raise CorruptCheckpoint(f"checkpoint {checkpoint_id} rank {rank} {file_name}: the stored file is "
                                                f"longer than the committed {size} bytes")
                    view[pos:pos + n] = chunk
                    hasher.update(chunk)
                    pos += n
            except grpc.RpcError as e:
                raise _service_error(e, "GetShard") from None
            if pos != size:  # the whole stored file came, without an error: it is shorter
                raise CorruptCheckpoint(f"checkpoint {checkpoint_id} rank {rank} {file_name}: the stored file ends "
                                        f"after {pos} of the committed {size} bytes")
            return hasher.hexdigest()

        return view, self._retrying(once, f"GetShard {checkpoint_id}/{rank}/{file_name}")


def _busy(e: grpc.RpcError) -> bool:
    """The service refused a stream because too many are open; nothing was read (wire.py)."""
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (e.details() or "").startswith(wire.STREAMS_BUSY)


def _read_lent(spool_dir: str, name: str, view: memoryview, hasher: StreamHasher) -> int:
    """Read a link the service made in its spool (the file, up to len(view) bytes and one
    more to notice a longer file) into `view`, hashing each piece; remove the link."""
    if not names.is_lent_name(name):
        raise ServiceError(f"GetShard named a spool file {name[:80]!r} outside the spool's .out/")
    path = os.path.join(spool_dir, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ServiceError(f"GetShard: cannot open the spool file {name}: {e}") from None
    try:
        os.unlink(path)  # ours from here on: the open descriptor keeps the bytes
        pos = 0
        while pos < view.nbytes:
            n = os.readv(fd, [view[pos:pos + _SPOOL_WRITE]])
            if not n:
                break
            hasher.update(view[pos:pos + n])
            pos += n
        if pos == view.nbytes and os.read(fd, 1):
            raise CorruptCheckpoint(f"the stored file lent as {name} is longer than the committed "
                                    f"{view.nbytes} bytes")
        return pos
    finally:
        os.close(fd)
