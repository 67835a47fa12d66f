"""Operations: liveness, where the gRPC endpoint and the spool are, and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response

from lastgood.wire.info import Info
from lastgood.wire.vocab import Verification

from ... import __version__
from ..contract import StrictJSONRoute
from ...domain.dataplane.grants import DirectUploads
from ..deps import Ctx, QueriesDep

router = APIRouter(route_class=StrictJSONRoute, tags=["ops"])


@router.get("/healthz")
def healthz(queries: QueriesDep):
    """Liveness: 200 `ok` while the service answers and its catalog does (public)."""
    queries.list_runs(limit=1)  # proves the catalog answers
    return {"status": "ok"}


@router.get("/api/v1/info")
def info(ctx: Ctx):
    """Where the gRPC endpoint is, the chunk and shard limits, the data paths on offer (public)."""
    s = ctx.commits.settings
    return Info(grpc_target=ctx.grpc_target, version=__version__, max_chunk_bytes=s.max_chunk_bytes,
                max_shard_bytes=s.max_shard_bytes, lease_seconds=s.lease_seconds,
                verification=Verification(s.verification), range_block_bytes=s.range_block_bytes,
                max_request_bytes=s.max_request_bytes,  # api/limits.py: a hand-over that would not fit drops them
                inline_bytes=s.inline_bytes,  # a small state's files travel with its vote (CommitRank.inline_files)
                spool=ctx.spool.info() if ctx.spool else None,
                direct_fs=ctx.direct_fs.info() if ctx.direct_fs else None,
                direct_s3=DirectUploads(ctx.commits).info()).to_dict()  # direct S3 uploads (domain/dataplane/grants.py)


@router.get("/metrics", include_in_schema=False)
def metrics(ctx: Ctx):
    if ctx.metrics is None:
        return Response("", media_type="text/plain")
    body, content_type = ctx.metrics.render()
    return Response(body, media_type=content_type)
