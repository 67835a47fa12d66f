"""REST API (FastAPI): runs, checkpoints, manifests, downloads with HTTP Range, health, info.

Handlers hold no SQL and no storage logic; they call the domain and map its errors through
api/errors.py. Every error body is JSON: {"error": {"code": ..., "message": ...}}.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated

from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lastgood import names

from .. import __version__
from ..domain.commit import CommitService
from ..domain.errors import DomainError, InvalidArgument, OutOfRange
from ..domain.queries import MAX_PAGE, Queries
from .errors import lookup


@dataclass
class AppContext:
    commits: CommitService
    queries: Queries
    grpc_target: str


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


_RANGE = re.compile(r"^bytes=(\d{0,19})-(\d{0,19})$", re.ASCII)  # 19 digits: any int64 offset


def parse_range(header: str, size: int) -> tuple[int, int]:
    """One `bytes=a-b`, `bytes=a-` or `bytes=-n` range -> [start, end) within size."""
    m = _RANGE.match(header.strip())
    if not m or (m.group(1) == "" and m.group(2) == ""):
        raise InvalidArgument(f"unsupported Range header {header!r}: use one range, bytes=START-END")
    a, b = m.group(1), m.group(2)
    if a == "":
        n = int(b)
        if n == 0:
            raise OutOfRange("suffix range of 0 bytes")
        return max(0, size - n), size
    start = int(a)
    end = size if b == "" else int(b) + 1
    if b != "" and int(b) < start:
        raise InvalidArgument(f"Range end {b} is before start {a}")
    if start >= size:
        raise OutOfRange(f"range starts at byte {start} but the file has {size} bytes")
    return start, min(end, size)


Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]
Offset = Annotated[int, Query(ge=0)]
CkptId = Annotated[int, Path(ge=1, le=2**62)]


def create_app(ctx: AppContext) -> FastAPI:
    app = FastAPI(title="lastgood", version=__version__,
                  description="Checkpoint store for PyTorch training: runs, checkpoints, last-good, downloads.")

    @app.exception_handler(DomainError)
    async def _domain(_req: Request, exc: DomainError):
        status, _code, name = lookup(exc)
        return _error(status, name, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        parts = [f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in exc.errors()]
        return _error(422, "invalid_request", "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, "http_error", str(exc.detail))

    @app.get("/healthz", tags=["ops"])
    def healthz():
        ctx.queries.list_runs(limit=1)  # proves the catalog answers
        return {"status": "ok"}

    @app.get("/api/v1/info", tags=["ops"])
    def info():
        s = ctx.commits.settings
        return {"service": "lastgood", "version": __version__, "grpc_target": ctx.grpc_target,
                "max_chunk_bytes": s.max_chunk_bytes, "max_shard_bytes": s.max_shard_bytes,
                "lease_seconds": s.lease_seconds}

    @app.get("/api/v1/runs", tags=["runs"])
    def list_runs(limit: Limit = 100, offset: Offset = 0):
        return ctx.queries.list_runs(limit, offset)

    @app.get("/api/v1/runs/{run}", tags=["runs"])
    def get_run(run: str):
        return ctx.queries.get_run(run)

    @app.get("/api/v1/runs/{run}/checkpoints", tags=["runs"])
    def list_checkpoints(run: str, status: str | None = None, limit: Limit = 100, offset: Offset = 0):
        return ctx.queries.list_checkpoints(run, status, limit, offset)

    @app.get("/api/v1/runs/{run}/last-good", tags=["runs"])
    def last_good(run: str):
        view = ctx.queries.last_good(run)
        view["manifest"] = _manifest_json(view["id"])
        return view

    @app.get("/api/v1/runs/{run}/events", tags=["runs"])
    def events(run: str, limit: Limit = 100, offset: Offset = 0):
        return ctx.queries.events(run, limit, offset)

    def _manifest_json(cid: int):
        return json.loads(ctx.commits.manifest_bytes(cid))

    @app.get("/api/v1/checkpoints/{checkpoint_id}", tags=["checkpoints"])
    def get_checkpoint(checkpoint_id: CkptId):
        view = ctx.queries.get_checkpoint(checkpoint_id)
        view["manifest"] = _manifest_json(checkpoint_id) if view["status"] == "COMMITTED" else None
        return view

    @app.get("/api/v1/checkpoints/{checkpoint_id}/manifest", tags=["checkpoints"])
    def get_manifest(checkpoint_id: CkptId):
        return Response(ctx.commits.manifest_bytes(checkpoint_id), media_type="application/json")

    @app.post("/api/v1/checkpoints/{checkpoint_id}/verify", tags=["checkpoints"])
    def verify(checkpoint_id: CkptId):
        """Re-hash every shard; a mismatch marks the checkpoint CORRUPT and moves last-good back."""
        return ctx.commits.verify(checkpoint_id)

    @app.get("/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/files/{file_name}", tags=["checkpoints"])
    def download(request: Request, checkpoint_id: CkptId, rank: Annotated[int, Path(ge=0, le=2**31)],
                 file_name: str):
        try:
            names.check_file_name(file_name)
        except names.InvalidName as exc:
            raise InvalidArgument(str(exc)) from None
        sh = ctx.commits.shard_for_read(checkpoint_id, rank, file_name)
        headers = {"Accept-Ranges": "bytes", "ETag": f'"{sh.xxh3_128}"', "X-Lastgood-Xxh3-128": sh.xxh3_128,
                   "Content-Disposition": f'attachment; filename="{file_name}"'}
        rng = request.headers.get("range")
        if rng is None:
            body = ctx.commits.read_range(sh, 0, None)
            return StreamingResponse(body, media_type="application/octet-stream",
                                     headers={**headers, "Content-Length": str(sh.size)})
        try:
            start, end = parse_range(rng, sh.size)
        except OutOfRange as exc:
            return _error(416, "out_of_range", str(exc), {"Content-Range": f"bytes */{sh.size}"})
        body = ctx.commits.read_range(sh, start, end - start)
        return StreamingResponse(body, status_code=206, media_type="application/octet-stream",
                                 headers={**headers, "Content-Length": str(end - start),
                                          "Content-Range": f"bytes {start}-{end - 1}/{sh.size}"})

    return app
