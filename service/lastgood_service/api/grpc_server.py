"""The gRPC servicer: the data path (begin, put, vote, abort, manifest, shard reads)."""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError

from lastgood.wire import framing
from lastgood.wire.codes import ERROR_METADATA
from lastgood.wire.v1 import lastgood_pb2 as pb
from lastgood.wire.v1 import lastgood_pb2_grpc as pb_grpc

from ..domain.commit import CommitService
from ..domain.commit.types import ShardHeader
from ..domain.errors import DomainError, FollowRefused, InvalidArgument, SpoolNotShared
from ..domain.faults import as_domain_error
from ..domain.peer import verification_modes
from ..domain.dataplane.spool import Followed, Spool
from ..domain.tokens import READER, WRITER, Principal, TokenStore
from ..domain.queries import Queries
from .errors import bounded, lookup
from .streams import IdleWatch, StreamSlots

log = logging.getLogger("lastgood.grpc")


def _abort(context, exc: DomainError):
    """The status code, and the error's code name (as REST's error.code) in the trailing
    metadata, so that a client can tell a fenced launch from other refusals."""
    _status, code, name = lookup(exc)
    context.set_trailing_metadata(((ERROR_METADATA, name),))
    context.abort(code, bounded(str(exc)))


def _abort_unexpected(context, name: str, exc: Exception) -> None:
    """A storage fault (full disk, I/O error) by its name; anything else INTERNAL, logged."""
    mapped = as_domain_error(exc)
    if mapped is not None:
        log.error("%s: %s", name, mapped)
        _abort(context, mapped)
    log.exception("%s failed", name)
    context.abort(grpc.StatusCode.INTERNAL, f"{name} failed inside the service; see its log")


def _declared(raw: str):
    """The range digests a direct-FS hand-over declares (JSON; domain/commit/declared_ranges.py)."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise InvalidArgument(f"declared range digests refused: not JSON: {e}") from None


class _Malformed:
    """A request that did not parse. gRPC answers INTERNAL when a deserializer raises, so the
    deserializer returns this instead, and the method answers INVALID_ARGUMENT."""

    def __init__(self, cls) -> None:
        self.what = cls.__name__


def _lenient(cls):
    def parse(raw: bytes):
        try:
            return cls.FromString(raw)
        except Exception:  # DecodeError; whatever else a parser may raise on hostile bytes
            return _Malformed(cls)

    return parse


def _check_parsed(request) -> None:
    if isinstance(request, _Malformed):
        raise InvalidArgument(f"the request is not a valid {request.what} message")


def _mapped(fn):
    """Turn domain errors into gRPC status codes; anything else is an INTERNAL error, logged."""

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            _check_parsed(request)
            return fn(self, request, context)
        except DomainError as exc:
            _abort(context, exc)
        except grpc.RpcError:
            raise
        except Exception as exc:
            _abort_unexpected(context, fn.__name__, exc)

    return wrapper


def _mapped_stream(fn):
    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            _check_parsed(request)
            yield from fn(self, request, context)
        except DomainError as exc:
            _abort(context, exc)
        except Exception as exc:
            _abort_unexpected(context, fn.__name__, exc)

    return wrapper


def _put_message(raw: bytes) -> pb.PutShardRequest:
    try:
        return pb.PutShardRequest.FromString(raw)
    except DecodeError:
        raise InvalidArgument("a PutShard message is not a valid PutShardRequest") from None


def _chunks(raw_messages):
    """The chunks of a PutShard stream after its header, as memoryviews into the received
    messages (wire/framing.py: no copy); a message framed any other way goes through protobuf."""
    for raw in raw_messages:
        chunk = framing.unframe(raw, framing.PUT_CHUNK)
        if chunk is None:
            msg = _put_message(raw)
            if msg.WhichOneof("body") != "chunk":
                raise InvalidArgument("only the first PutShard message may carry a header")
            chunk = msg.chunk
        yield chunk


def _progress(raw_messages):
    """A followed hand-over's messages after its header, as (written, xxh3_128) pairs."""
    for raw in raw_messages:
        msg = _put_message(raw)
        if msg.WhichOneof("body") != "progress":
            raise InvalidArgument("a PutShard that follows a spooled file carries progress messages only")
        yield msg.progress.written, msg.progress.xxh3_128


def _timed(messages, watched):
    """The client's messages, with the idle clock running only while we wait for one."""
    while True:
        watched.waiting()
        try:
            message = next(messages)
        except StopIteration:
            return
        finally:
            watched.busy()
        yield message


class Servicer(pb_grpc.CheckpointsServicer):
    """Each method authenticates the caller (metadata `authorization: Bearer <token>`),
    then checks its role (writer for the commit protocol, reader for reads) and its scope
    against the run the call touches."""

    def __init__(self, commits: CommitService, queries: Queries, tokens: TokenStore,
                 spool: Spool | None = None, direct_fs=None) -> None:
        self.commits = commits
        self.spool = spool
        self.direct_fs = direct_fs  # domain/dataplane/directfs.py: its staging directory is a spool of its own
        self.queries = queries
        self.tokens = tokens
        settings = commits.settings
        self.streams = StreamSlots(settings.grpc_max_streams, settings.max_streams_per_client)
        self.idle = IdleWatch(settings.grpc_idle_timeout)
        self._waiters = threading.BoundedSemaphore(max(1, commits.settings.grpc_workers // 4))

    def _caller(self, context) -> tuple[Principal, str]:
        """Who calls, from the metadata alone (before any message is read), and the key its
        streams are counted under: its token, or with tokens off its connection."""
        header = dict(context.invocation_metadata()).get("authorization")
        principal = self.tokens.authenticate(header)
        return principal, f"token {header}" if header else f"peer {context.peer()}"

    def _allow(self, context, role: str, *, run: str | None = None, checkpoint_id: int | None = None,
               principal: Principal | None = None) -> None:
        if principal is None:
            principal, _key = self._caller(context)
        self.tokens.require(principal, role)
        if checkpoint_id is not None and principal.run_prefix is not None:  # only a token scoped to
            run = self.queries.run_of_checkpoint(checkpoint_id)  # runs needs it: no read per vote else
        if run is not None:
            self.tokens.require(principal, role, run)

    @_mapped
    def BeginCheckpoint(self, request, context):
        self._allow(context, WRITER, run=request.run)
        ck = self.commits.begin(request.run, request.step, request.world_size, request.parent_id or None,
                                request.attempt, request.rank, request.generation, request.expected_bytes,
                                request.tier, request.replicas)
        return pb.BeginCheckpointResponse(checkpoint_id=ck.id, status=ck.status,
                                          lease_seconds=self.commits.settings.lease_seconds)

    @_mapped
    def PutShard(self, request_iterator, context):
        # who calls and whether it has a slot, before a message is read: a caller that
        # sends nothing holds at most a slot, and only until the idle timeout
        principal, key = self._caller(context)
        self.tokens.require(principal, WRITER)
        with self.streams.hold(key), self.idle.watch(context, "PutShard") as watched:
            messages = _timed(request_iterator, watched)  # raw bytes: see handlers()
            first = next(messages, None)
            first = None if first is None else _put_message(first)
            if first is None or first.WhichOneof("body") != "header":
                raise InvalidArgument("the first PutShard message must carry the shard header")
            h = first.header
            self._allow(context, WRITER, checkpoint_id=h.checkpoint_id, principal=principal)
            header = ShardHeader(h.checkpoint_id, h.rank, h.file_name, h.size, h.xxh3_128)
            if h.follow and not h.spool_file:
                raise InvalidArgument("follow names a spooled file (spool_file) that is being written")
            if h.spool_file or h.spool_id:
                res = self._put_spooled(h, header, messages)
            else:
                res = self.commits.put_shard(header, _chunks(messages))
        return pb.PutShardResponse(already_present=res.already_present, size=res.size, xxh3_128=res.xxh3_128)

    def _put_spooled(self, h, header: ShardHeader, request_iterator):
        """The same-host hand-over (domain/dataplane/spool.py): the bytes are in a file, not in chunks."""
        spool, hashed = self.spool, True
        if self.direct_fs is not None and h.spool_id == self.direct_fs.id:  # direct-FS: hashed per the mode
            spool, hashed = self.direct_fs.staging, verification_modes.service_hashes(self.commits.settings.verification)
        if spool is None:
            raise SpoolNotShared("spool: this service takes no spooled files; stream the shard")
        if h.follow:
            if spool is not self.spool:  # direct-FS hands over finished files (domain/dataplane/directfs.py)
                raise InvalidArgument("only a file in the spool can be handed over while it is written")
            if not spool.follow:
                raise FollowRefused("spool: this service takes spooled files once written; stream the shard")
            taken = spool.take(h.spool_file, h.spool_id, h.size, growing=True)
            try:
                followed = Followed(taken, _progress(request_iterator), h.file_name,
                                    self.commits.settings.spool_cache_bytes)
                return self.commits.put_shard(header, followed.chunks(self.commits.settings.max_chunk_bytes),
                                              adopt=taken, follow=followed)
            finally:
                taken.close()
        if next(request_iterator, None) is not None:
            raise InvalidArgument("a spooled PutShard carries its header only, no chunks")
        taken = spool.take(h.spool_file, h.spool_id, h.size)
        try:
            return self.commits.put_shard(header, taken.chunks(self.commits.settings.max_chunk_bytes), adopt=taken,
                                          hashed=hashed, declared=None if hashed else _declared(h.range_digests))
        finally:
            taken.close()  # the file is gone if it was published (renamed into the store)

    @_mapped
    def CommitRank(self, request, context):
        self._allow(context, WRITER, checkpoint_id=request.checkpoint_id)
        # A vote that waits for the other ranks holds a worker thread. Only a quarter of
        # the pool may wait at once; other votes are recorded and answered at once (the
        # client polls), so a thousand ranks voting together cannot starve the votes that
        # would complete the checkpoint.
        wait = request.wait_seconds
        waiting = math.isfinite(wait) and wait > 0 and self._waiters.acquire(blocking=False)
        try:
            res = self.commits.vote(request.checkpoint_id, request.rank, list(request.files),
                                    wait if waiting or not math.isfinite(wait) else 0.0,  # NaN: refused there
                                    request.peer_key, list(request.memory_files), list(request.inline_files))
        finally:
            if waiting:
                self._waiters.release()
        return pb.CommitRankResponse(checkpoint_id=res.checkpoint_id, status=res.status,
                                     missing_ranks=res.missing_ranks)

    @_mapped
    def AbortCheckpoint(self, request, context):
        self._allow(context, WRITER, checkpoint_id=request.checkpoint_id)
        return pb.AbortCheckpointResponse(status=self.commits.abort(request.checkpoint_id, request.reason,
                                                                    request.rank))

    @_mapped
    def GetManifest(self, request, context):
        if request.checkpoint_id:
            self._allow(context, READER, checkpoint_id=request.checkpoint_id)
            cid = request.checkpoint_id
        elif request.run:
            self._allow(context, READER, run=request.run)
            view, body = self.queries.readable_last_good(request.run, self.commits.manifest_bytes)
            return pb.GetManifestResponse(checkpoint_id=view["id"], step=view["step"], manifest=body)
        else:
            self._allow(context, READER)
            raise InvalidArgument("name a checkpoint_id or a run")
        body = self.commits.manifest_bytes(cid)
        return pb.GetManifestResponse(checkpoint_id=cid, step=self.queries.get_checkpoint(cid)["step"],
                                      manifest=body)

    @_mapped_stream
    def GetShard(self, request, context):
        principal, key = self._caller(context)
        self._allow(context, READER, checkpoint_id=request.checkpoint_id, principal=principal)
        sh = self.commits.shard_for_read(request.checkpoint_id, request.rank, request.file_name)
        if request.spool_id and self.spool is not None and request.spool_id == self.spool.id:
            # the read direction of the same-host hand-over: a link instead of a stream (for a
            # range too: the reader preads it, docs/resharding.md)
            self.commits.read_range(sh, request.offset, request.length or None, check_only=True)
            name = self.commits.lend_shard(sh, self.spool, (request.length or sh.size - request.offset))
            if name is not None:
                yield pb.GetShardResponse(spool_file=name).SerializeToString()
                return
        step = self.commits.settings.max_chunk_bytes
        with self.streams.hold(key), self.idle.watch(context, "GetShard") as watched:
            for chunk in self.commits.read_range(sh, request.offset, request.length or None):
                view = memoryview(chunk).cast("B")
                for i in range(0, view.nbytes, step):  # the store's read size need not be ours
                    watched.waiting()  # until the client has taken the message
                    yield framing.frame(framing.GET_CHUNK, view[i:i + step])  # raw bytes: see handlers()
                    watched.busy()


SERVICE = "lastgood.v1.Checkpoints"
PENDING_CALLS = 65536  # calls gRPC may queue for a worker: every rank of a 16,384-GPU job, several times


def handlers(servicer: Servicer) -> dict[str, grpc.RpcMethodHandler]:
    """The generated registration, except for the two shard streams: PutShard receives and
    GetShard sends raw message bytes, framed and parsed by hand (wire/framing.py), and for requests
    that do not parse: INVALID_ARGUMENT (_lenient), not gRPC's INTERNAL. Every method of
    the service in the .proto must be here (a test checks it)."""
    unary = grpc.unary_unary_rpc_method_handler
    return {
        "BeginCheckpoint": unary(servicer.BeginCheckpoint, _lenient(pb.BeginCheckpointRequest),
                                 pb.BeginCheckpointResponse.SerializeToString),
        "PutShard": grpc.stream_unary_rpc_method_handler(servicer.PutShard, None,
                                                         pb.PutShardResponse.SerializeToString),
        "CommitRank": unary(servicer.CommitRank, _lenient(pb.CommitRankRequest),
                            pb.CommitRankResponse.SerializeToString),
        "AbortCheckpoint": unary(servicer.AbortCheckpoint, _lenient(pb.AbortCheckpointRequest),
                                 pb.AbortCheckpointResponse.SerializeToString),
        "GetManifest": unary(servicer.GetManifest, _lenient(pb.GetManifestRequest),
                             pb.GetManifestResponse.SerializeToString),
        "GetShard": grpc.unary_stream_rpc_method_handler(servicer.GetShard, _lenient(pb.GetShardRequest), None),
    }


def start_grpc_server(servicer: Servicer, host: str, port: int, workers: int, max_message: int,
                      stream_window: int = 0) -> tuple[grpc.Server, int]:
    # receive: one chunk plus framing, so oversized input is refused before it is buffered;
    # send: manifests of thousands of ranks outgrow a chunk
    options = [("grpc.max_receive_message_length", max_message + 64 * 1024),
               ("grpc.max_send_message_length", max(max_message + 64 * 1024, 256 * 1024 * 1024)),
               # calls that arrived while every worker is busy wait in gRPC's queue; beyond its
               # default 1,000 (soft) / 3,000 (hard) it CANCELs them: 947 of 4,096 ranks
               # beginning at once (bench/control_plane.py). A queued call costs no thread.
               ("grpc.server.max_pending_requests", PENDING_CALLS),
               ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS)]
    if stream_window:
        # A fixed HTTP/2 window: with BDP probing, gRPC grows it while a disk write stalls
        # the receiving thread and buffers the client's stream ahead of it (bench.alloc:
        # 307-382 MiB RSS ingesting 4 GiB; with an 8 MiB window 157-189 MiB, ~5% slower
        # to a memory blob store)
        options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", stream_window)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
                         options=options)
    methods = handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    server.add_registered_method_handlers(SERVICE, methods)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC to {host}:{port}")
    server.start()
    return server, bound
