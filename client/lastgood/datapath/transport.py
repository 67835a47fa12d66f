"""The client's wire: gRPC for the data path, REST (rest.py) for the catalog. torch-free.

The only thing configured is the REST base URL; the gRPC endpoint is learned from
GET /api/v1/info. Every call goes through one RetryPolicy (retry.py): transient failures
(the service restarting, a dropped connection, a 5xx, a PutShard refused because the
service has too many streams open) are retried with backoff until its deadline;
everything the service refuses surfaces at once as the error class its code names
(errors.py), with the service's message.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from collections.abc import Iterator

# DataLoader workers fork the trainer process while the upload thread may be inside gRPC.
# The children never use gRPC, so its fork handlers would only log warnings and stall the
# fork; keep them off unless the user asked for them (read when grpc is first imported).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402

from lastgood import errors
from lastgood.common import durable
from lastgood.datapath import choose, handover
from lastgood.wire import framing, names, peerkey
from lastgood.errors import (CorruptCheckpoint, FollowRefused, GaveUp, ServiceError, SpoolNotShared,
                     SpoolRefused)
from lastgood.wire.info import DEFAULT_CHUNK_BYTES
from lastgood.wire.hashing import StreamHasher, hash_bytes
from lastgood.remote.config import ClientConfig
from lastgood.remote.rest import RestClient
from lastgood.remote.retry import RetryPolicy
from lastgood.wire.v1 import lastgood_pb2 as pb
from lastgood.wire.v1 import lastgood_pb2_grpc as pb_grpc

CHUNK = DEFAULT_CHUNK_BYTES
log = logging.getLogger("lastgood")
# reconnect soon after a restarted service listens again (gRPC's own default backs off to 120 s)
_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
              ("grpc.max_reconnect_backoff_ms", 1000)]


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


def _service_error(e: grpc.RpcError, what: str) -> ServiceError:
    code = e.code() if hasattr(e, "code") else None
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    return errors.from_grpc(what, code.name if code is not None else "UNKNOWN",
                            e.details() if hasattr(e, "details") else str(e), trailing)


class Transport(RestClient):
    def __init__(self, base_url: str, timeout: float = 30.0, token: str | None = None,
                 retry: RetryPolicy | None = None, *, spool: bool | None = None,
                 config: ClientConfig | None = None) -> None:
        """`config`: the caller's settings, resolved once (the Checkpointer's, DCP's); without
        one they are resolved here from the environment. `retry` and `spool` (hand shards
        over through the service's spool when this host sees it), where given, win over it;
        `config.direct_fs_mount` is where this host mounts the service's local store
        (directfs.py)."""
        cfg = config or ClientConfig.resolve(retry=retry, spool=spool)
        retry = retry or cfg.retry
        spool = cfg.spool if spool is None else spool
        self.direct_fs_mount = cfg.direct_fs_mount  # directfs.of() looks there, once
        # a service that is starting (or restarting) is waited for, up to the policy's deadline
        super().__init__(base_url, timeout, token, retry)
        # the same bearer token on every gRPC call, as call metadata
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        self.info = info = self.service_info()
        self.grpc_target = info.grpc_target
        self.chunk = min(CHUNK, info.max_chunk_bytes)
        limit = self.chunk + 64 * 1024
        self._channel = grpc.insecure_channel(self.grpc_target, options=[
            ("grpc.max_receive_message_length", max(limit, 256 * 1024 * 1024)),
            ("grpc.max_send_message_length", limit), *_RECONNECT])
        self._stub = pb_grpc.CheckpointsStub(self._channel)
        self.spool = handover.find_dir(info.spool) if spool else None
        # shard bytes received (whole files and ranges), ranged requests and those of them
        # answered with a link in the spool: what a restore read, and how
        self.shard_bytes = self.range_requests = self.lent_ranges = 0
        self._counts = threading.Lock()  # a restore reads a rank's files and ranges on several threads
        _open.add(self)
        # the shard streams carry hand-framed chunks (see wire/framing.py): raw bytes at this end
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
                raise _service_error(e, what) from None
        return self._retrying(once, what)

    def begin(self, run: str, step: int, world_size: int, parent_id: int | None, attempt: str,
              rank: int, expected_bytes: int = 0, tier: str = "", replicas: int = 0) -> pb.BeginCheckpointResponse:
        """`tier`, `replicas`: a memory checkpoint's (lastgood.wire.tiers; "" is durable)."""
        return self._unary("BeginCheckpoint", self._stub.BeginCheckpoint, pb.BeginCheckpointRequest(
            run=run, step=step, world_size=world_size, parent_id=parent_id or 0, attempt=attempt, rank=rank,
            generation=self.generation or 0, expected_bytes=expected_bytes, tier=tier, replicas=replicas))

    def spool_write(self, data, hasher: StreamHasher | None = None, spool: dict | None = None,
                    fsync: bool = False) -> str | None:
        """Write a shard into the service's spool (same host, see the service's
        domain/dataplane/spool.py) - or into another hand-over directory `spool` (direct-FS's staging
        directory, directfs.py) - and return the file's name for put_shard(spooled=...);
        None when there is no such directory here or writing failed (the shard is then
        streamed). `hasher` is fed each piece just before it is written, while it is in the
        CPU's cache (one pass over the shard instead of two: 0.215 against 0.246 s for 1 GiB
        here). `fsync`: make the file durable before handing it over (a shared file system,
        where the writer's host holds the dirty pages; the spool's service fsyncs itself)."""
        spool = spool or self.spool
        if spool is None:
            return None
        view = memoryview(data).cast("B")
        name = names.new_spool_name()
        path = os.path.join(spool["dir"], name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            writeback = durable.Writeback(fd)
            try:
                off = 0
                while off < view.nbytes:
                    off = handover.write_piece(fd, view, off, hasher, writeback)
                if fsync:
                    os.fsync(fd)
            finally:
                writeback.close()
                os.close(fd)
        except OSError as e:
            log.warning("lastgood: writing to %s failed (%s); streaming instead", spool["dir"], e)
            self.spool_discard(name, spool)
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
                  xxh3: str, spooled: str | None = None, spool: dict | None = None,
                  range_digests: str = "") -> pb.PutShardResponse:
        """Stream the shard, or hand over the file `spooled` holding the same bytes, in the
        spool (or the hand-over directory `spool`: direct-FS's staging directory).
        Whatever goes wrong with a hand-over, the bytes are streamed next, and that answer
        is final: a service that declines the spool (another host's, none configured) or
        no longer finds the file (a retry after a lost reply, a restart, a sweep) gets the
        stream, which is a no-op when the shard was stored already."""
        data = memoryview(data).cast("B")
        header = pb.ShardHeader(checkpoint_id=checkpoint_id, rank=rank, file_name=file_name, size=data.nbytes,
                                xxh3_128=xxh3)
        spool = spool or self.spool
        if spooled and spool is not None:
            spooled_header = pb.ShardHeader()
            spooled_header.CopyFrom(header)
            spooled_header.spool_file, spooled_header.spool_id = spooled, spool["id"]
            spooled_header.range_digests = range_digests  # declared with a name only (directfs.py)
            try:
                return self._put(lambda: iter((pb.PutShardRequest(header=spooled_header).SerializeToString(),)))
            except GaveUp:
                raise
            except ServiceError as e:
                log.warning("lastgood: the spooled hand-over of %s failed (%s); streaming it", file_name, e)
                if isinstance(e, SpoolNotShared):  # this service does not read that directory: stream from now on
                    spool["refused"] = True  # a hand-over directory other than the spool: its owner looks here
                    if spool is self.spool:
                        self.spool = None
            finally:
                self.spool_discard(spooled, spool)

        def messages() -> Iterator[bytes]:
            yield pb.PutShardRequest(header=header).SerializeToString()
            for off in range(0, data.nbytes, self.chunk):
                yield framing.frame(framing.PUT_CHUNK, data[off:off + self.chunk])

        return self._put(messages)

    def put_followed(self, checkpoint_id: int, rank: int, file_name: str, data) -> str:
        """Write the shard into the service's spool while the service reads it behind the
        writer (a followed hand-over, ShardHeader.follow; the service's domain/dataplane/spool.Followed):
        each 8 MiB piece is hashed, written, its writeback started, and reported written;
        the last report carries the hash. The service has then hashed nearly every byte
        already, and the disk has written most of them. Returns the file's xxh3-128.

        This one call is not retried: its file is the service's once taken. When the spool
        declines it (SpoolRefused), the service is away or busy, or writing fails, the bytes
        are streamed with put_shard's retries (a stream renews the checkpoint's lease as it
        goes; a whole file written into the spool after begin would not). A refusal of the
        file or of the checkpoint itself (fenced, not pending, store full, another hash) is
        raised as it is: the same bytes sent again would change nothing. A service whose
        store cannot adopt followed files (FollowRefused) is not asked to follow again."""
        view = memoryview(data).cast("B")
        spool, hasher, name = self.spool, StreamHasher(), names.new_spool_name()
        fd, writeback = -1, None

        def close_file() -> None:
            nonlocal fd
            closing, fd = fd, -1  # never closed twice, even when close() fails
            if closing >= 0:
                writeback.close()
                os.close(closing)

        try:
            if spool is None or not spool.get("follow"):
                raise FollowRefused("spool: this service takes spooled files once written")
            fd = os.open(os.path.join(spool["dir"], name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            writeback = durable.Writeback(fd)
            header = pb.ShardHeader(checkpoint_id=checkpoint_id, rank=rank, file_name=file_name, size=view.nbytes,
                                    spool_file=name, spool_id=spool["id"], follow=True)
            reports: queue.SimpleQueue = queue.SimpleQueue()

            def messages() -> Iterator[bytes]:  # gRPC's own thread sends them as they come
                yield pb.PutShardRequest(header=header).SerializeToString()
                while (message := reports.get()) is not None:
                    yield message

            def report(written: int, digest: str = "") -> None:
                reports.put(pb.PutShardRequest(progress=pb.SpoolProgress(written=written, xxh3_128=digest))
                            .SerializeToString())

            call = self._put_shard.future(messages(), timeout=max(self.timeout, 3600.0), metadata=self._md)
            try:
                off = 0
                while off < view.nbytes and not call.done():  # done early: refused, read below
                    off = handover.write_piece(fd, view, off, hasher, writeback)
                    report(off)
                if off == view.nbytes:
                    close_file()  # before the last report: nothing is written after it
                    report(off, hasher.hexdigest())
            finally:
                reports.put(None)  # the stream ends here; without the last report the service refuses it
            try:
                res = call.result()
            except grpc.RpcError as e:
                raise _service_error(e, "PutShard") from None
            if (res.size, res.xxh3_128) != (view.nbytes, hasher.hexdigest()):
                raise ServiceError(f"PutShard of {file_name}: the service recorded {res.size} bytes with xxh3 "
                                   f"{res.xxh3_128} for a file of {view.nbytes} with {hasher.hexdigest()}")
            return hasher.hexdigest()
        except (ServiceError, OSError) as e:
            if isinstance(e, ServiceError) and not (isinstance(e, SpoolRefused) or e.retryable):
                raise
            if isinstance(e, FollowRefused) and spool is not None:
                spool["follow"] = False
            elif spool is not None:
                log.warning("lastgood: handing %s over while writing it failed (%s); streaming it", file_name, e)
            if isinstance(e, SpoolNotShared) and spool is self.spool:
                self.spool = None
        finally:
            close_file()
            self.spool_discard(name, spool)  # gone already when the service took it
        digest = hasher.hexdigest() if hasher.size == view.nbytes else hash_bytes(view)
        self.put_shard(checkpoint_id, rank, file_name, view, digest)  # a no-op when the first try had landed
        return digest

    def _put(self, messages) -> pb.PutShardResponse:
        """One PutShard call; `messages()` makes the stream anew for each try."""
        return self._unary("PutShard", lambda _r, timeout, metadata: self._put_shard(messages(), timeout=timeout,
                                                                                    metadata=metadata),
                           None, timeout=max(self.timeout, 3600.0))

    def commit_rank(self, checkpoint_id: int, rank: int, files: list[str], wait: float,
                    memory_files: list[tuple[str, int, str]] = (),
                    inline: list[tuple[str, str, memoryview]] = ()) -> pb.CommitRankResponse:
        """`memory_files`: a memory checkpoint's vote, (name, size, xxh3-128) of each file.
        `inline`: (name, xxh3-128, bytes) of small files the vote carries (Info.inline_bytes
        in all), recorded by the service before the vote; a retried call sends them again
        and finds them present."""
        # the commitment of this process's secret for the rank: only this rank can then ask for and
        # report its peer checks (lastgood/wire/peerkey.py); sent whatever the mode, it costs nothing
        key = peerkey.commitment(peerkey.rank_secret(checkpoint_id, rank))
        return self._unary("CommitRank", self._stub.CommitRank, pb.CommitRankRequest(
            checkpoint_id=checkpoint_id, rank=rank, files=files, wait_seconds=wait, peer_key=key,
            memory_files=[pb.MemoryFile(name=n, size=z, xxh3_128=d) for n, z, d in memory_files],
            inline_files=[pb.InlineFile(name=n, xxh3_128=d, data=bytes(b)) for n, d, b in inline]),
            timeout=wait + self.timeout)

    def abort(self, checkpoint_id: int, reason: str, rank: int) -> None:
        self._unary("AbortCheckpoint", self._stub.AbortCheckpoint,
                    pb.AbortCheckpointRequest(checkpoint_id=checkpoint_id, reason=reason, rank=rank))

    def count(self, nbytes: int, lent: int = 0, requests: int = 0) -> None:
        """Bytes received (whole files and ranges), ranged requests, and ranges lent as links."""
        with self._counts:
            self.shard_bytes += nbytes
            self.lent_ranges += lent
            self.range_requests += requests

    def read_file(self, checkpoint_id: int, rank: int, file_name: str, size: int,
                  into=None) -> tuple[memoryview, str]:
        """The whole file, and the xxh3-128 of what arrived (hashed while receiving), written
        into `into` (a writable buffer of at least `size` bytes; by default a new one), by
        the data path the service's terms choose (choose.py)."""
        return choose.default_path(self).read_file(checkpoint_id, rank, file_name, size, into)

    def read_range(self, checkpoint_id: int, rank: int, file_name: str, offset: int, into) -> None:
        """Bytes [offset, offset + len(into)) of a stored file into `into` (the caller
        verifies them: readplan.py), by the data path the service's terms choose."""
        choose.default_path(self).read_range(checkpoint_id, rank, file_name, offset, into)

    def stream_file(self, checkpoint_id: int, rank: int, file_name: str, size: int,
                    into=None) -> tuple[memoryview, str]:
        """read_file through the service (GetShard): on the service's host the file may come
        as a link in the spool instead of a stream."""
        view = memoryview(durable.new_buffer(size) if into is None else into).cast("B")
        if view.nbytes < size:
            raise ValueError(f"read_file: a buffer of {view.nbytes} bytes cannot hold {size}")
        view = view[:size]

        def once() -> str:  # a retry after a broken stream starts over
            hasher = StreamHasher()
            pos = 0
            spool = self.spool
            try:
                for lent, chunk in self._shard_messages(pb.GetShardRequest(
                        checkpoint_id=checkpoint_id, rank=rank, file_name=file_name,
                        spool_id=spool["id"] if spool else ""), spool, pos):
                    if lent:
                        pos = handover.read_lent(spool["dir"], lent, view, hasher)
                        continue
                    n = len(chunk)
                    if pos + n > size:
                        raise CorruptCheckpoint(f"checkpoint {checkpoint_id} rank {rank} {file_name}: the stored file is "
                                                f"longer than the committed {size} bytes")
                    view[pos:pos + n] = chunk
                    hasher.update(chunk)
                    pos += n
            except grpc.RpcError as e:
                raise _service_error(e, "GetShard") from None
            self.count(pos)
            if pos != size:  # the whole stored file came, without an error: it is shorter
                raise CorruptCheckpoint(f"checkpoint {checkpoint_id} rank {rank} {file_name}: the stored file ends "
                                        f"after {pos} of the committed {size} bytes")
            return hasher.hexdigest()

        return view, self._retrying(once, f"GetShard {checkpoint_id}/{rank}/{file_name}")

    def _shard_messages(self, request, spool: dict | None, pos: int):
        """The messages of one GetShard answer, as (lent, chunk): a chunk of bytes, or the
        name of a link the service lent in its spool instead (only as the first message,
        and only to a client that named its spool; `pos`: bytes received before it)."""
        started = pos > 0
        for raw in self._get_shard(request, timeout=max(self.timeout, 3600.0), metadata=self._md):
            chunk = framing.unframe(raw, framing.GET_CHUNK)
            if chunk is None:
                msg = pb.GetShardResponse.FromString(raw)
                if msg.spool_file:
                    if started or spool is None:
                        raise ServiceError(f"GetShard answered with a spool file mid-stream for {request.file_name}")
                    started = True
                    yield msg.spool_file, None
                    continue
                chunk = msg.chunk
            started = started or len(chunk) > 0
            yield None, chunk

    def stream_range(self, checkpoint_id: int, rank: int, file_name: str, offset: int, into) -> None:
        """read_range through the service: streamed, or on the service's host read (pread)
        from a link the service makes in its spool. Every byte received is counted in
        `shard_bytes`."""
        view = memoryview(into).cast("B")
        length = view.nbytes

        def once() -> None:  # a retry after a broken stream starts over
            pos = 0
            spool = self.spool
            try:
                for lent, chunk in self._shard_messages(pb.GetShardRequest(
                        checkpoint_id=checkpoint_id, rank=rank, file_name=file_name, offset=offset, length=length,
                        spool_id=spool["id"] if spool else ""), spool, pos):
                    if lent:
                        pos = handover.pread_lent(spool["dir"], lent, view, offset)
                        self.count(pos, lent=1)
                        continue
                    n = len(chunk)
                    self.count(n)
                    if pos + n > length:
                        raise CorruptCheckpoint(f"checkpoint {checkpoint_id} rank {rank} {file_name}: more than the "
                                                f"{length} bytes asked for at offset {offset}")
                    view[pos:pos + n] = chunk
                    pos += n
            except grpc.RpcError as e:
                raise _service_error(e, "GetShard") from None
            if pos != length:
                raise CorruptCheckpoint(f"checkpoint {checkpoint_id} rank {rank} {file_name}: the stored file ends "
                                        f"{pos} bytes after offset {offset}, {length} were committed")

        self.count(0, requests=1)
        self._retrying(once, f"GetShard {checkpoint_id}/{rank}/{file_name} [{offset}, +{length})")


