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
    """Liveness and readiness: ok once the catalog answers (public, no token)."""
    queries.list_runs(limit=1)  # proves the catalog answers
    return {"status": "ok"}


@router.get("/api/v1/info")
def info(ctx: Ctx):
    """The service's version, its gRPC address, its limits (chunk, shard and request sizes, the
    lease) and the data paths it offers (spool, direct-FS, direct S3): what a client reads first."""
    s = ctx.commits.settings
    return Info(grpc_target=ctx.grpc_target, version=__version__, max_chunk_bytes=s.max_chunk_bytes,
                max_shard_bytes=s.max_shard_bytes, lease_seconds=s.lease_seconds,
                verification=Verification(s.verification), range_block_bytes=s.range_block_bytes,
                max_request_bytes=s.max_request_bytes,  # api/limits.py: a hand-over that would not fit drops them
                spool=ctx.spool.info() if ctx.spool else None,
                direct_fs=ctx.direct_fs.info() if ctx.direct_fs else None,
                direct_s3=DirectUploads(ctx.commits).info()).to_dict()  # direct S3 uploads (domain/dataplane/grants.py)


@router.get("/metrics", include_in_schema=False)
def metrics(ctx: Ctx):
    if ctx.metrics is None:
        return Response("", media_type="text/plain")
    body, content_type = ctx.metrics.render()
    return Response(body, media_type=content_type)
