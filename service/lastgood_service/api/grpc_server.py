"""The gRPC servicer: the data path (begin, put, vote, abort, manifest, shard reads)."""

from __future__ import annotations

import functools
import logging
from concurrent import futures

import grpc

from lastgood.v1 import lastgood_pb2 as pb
from lastgood.v1 import lastgood_pb2_grpc as pb_grpc

from ..domain.commit import CommitService, ShardHeader
from ..domain.errors import DomainError, InvalidArgument
from ..domain.queries import Queries
from .errors import lookup

log = logging.getLogger("lastgood.grpc")


def _mapped(fn):
    """Turn domain errors into gRPC status codes; anything else is an INTERNAL error, logged."""

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except DomainError as exc:
            context.abort(lookup(exc)[1], str(exc))
        except grpc.RpcError:
            raise
        except Exception:
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__} failed inside the service; see its log")

    return wrapper


def _mapped_stream(fn):
    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            yield from fn(self, request, context)
        except DomainError as exc:
            context.abort(lookup(exc)[1], str(exc))
        except Exception:
            log.exception("%s failed", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__} failed inside the service; see its log")

    return wrapper


def _chunks(request_iterator):
    for msg in request_iterator:
        if msg.WhichOneof("body") != "chunk":
            raise InvalidArgument("only the first PutShard message may carry a header")
        yield msg.chunk


class Servicer(pb_grpc.CheckpointsServicer):
    def __init__(self, commits: CommitService, queries: Queries) -> None:
        self.commits = commits
        self.queries = queries

    @_mapped
    def BeginCheckpoint(self, request, context):
        ck = self.commits.begin(request.run, request.step, request.world_size, request.parent_id or None,
                                request.attempt, request.rank)
        return pb.BeginCheckpointResponse(checkpoint_id=ck.id, status=ck.status,
                                          lease_seconds=self.commits.settings.lease_seconds)

    @_mapped
    def PutShard(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("body") != "header":
            raise InvalidArgument("the first PutShard message must carry the shard header")
        h = first.header
        res = self.commits.put_shard(ShardHeader(h.checkpoint_id, h.rank, h.file_name, h.size, h.xxh3_128),
                                     _chunks(request_iterator))
        return pb.PutShardResponse(already_present=res.already_present, size=res.size, xxh3_128=res.xxh3_128)

    @_mapped
    def CommitRank(self, request, context):
        res = self.commits.vote(request.checkpoint_id, request.rank, list(request.files), request.wait_seconds)
        return pb.CommitRankResponse(checkpoint_id=res.checkpoint_id, status=res.status,
                                     missing_ranks=res.missing_ranks)

    @_mapped
    def AbortCheckpoint(self, request, context):
        return pb.AbortCheckpointResponse(status=self.commits.abort(request.checkpoint_id, request.reason,
                                                                    request.rank))

    @_mapped
    def GetManifest(self, request, context):
        if request.checkpoint_id:
            cid = request.checkpoint_id
        elif request.run:
            cid = self.queries.last_good(request.run)["id"]
        else:
            raise InvalidArgument("name a checkpoint_id or a run")
        body = self.commits.manifest_bytes(cid)
        return pb.GetManifestResponse(checkpoint_id=cid, step=self.queries.get_checkpoint(cid)["step"],
                                      manifest=body)

    @_mapped_stream
    def GetShard(self, request, context):
        sh = self.commits.shard_for_read(request.checkpoint_id, request.rank, request.file_name)
        step = self.commits.settings.max_chunk_bytes
        for chunk in self.commits.read_range(sh, request.offset, request.length or None):
            for i in range(0, len(chunk), step):  # the store's read size need not be ours
                yield pb.GetShardResponse(chunk=chunk[i:i + step])


def start_grpc_server(servicer: Servicer, host: str, port: int, workers: int, max_message: int) -> tuple[grpc.Server, int]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
        # receive: one chunk plus framing, so oversized input is refused before it is buffered;
        # send: manifests of thousands of ranks outgrow a chunk
        options=[("grpc.max_receive_message_length", max_message + 64 * 1024),
                 ("grpc.max_send_message_length", max(max_message + 64 * 1024, 256 * 1024 * 1024))],
    )
    pb_grpc.add_CheckpointsServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC to {host}:{port}")
    server.start()
    return server, bound
