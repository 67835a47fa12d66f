"""REST API (FastAPI): runs, checkpoints, manifests, downloads with HTTP Range, health, info.

Handlers hold no SQL and no storage logic; they call the domain and map its errors through
api/errors.py. Every error body is JSON: {"error": {"code": ..., "message": ...}}.
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from lastgood import names
from lastgood.fencing import GENERATION_HEADER

from .. import __version__
from ..domain.commit import CommitService
from ..domain.curation import MAX_LEASE_SECONDS, Curator
from ..domain.gc import GarbageCollector
from ..domain.health import Health
from ..domain.errors import DomainError, InvalidArgument, OutOfRange
from ..domain.faults import as_domain_error
from ..domain.queries import MAX_PAGE, Queries
from ..domain.queries import gc_policy_view
from ..domain.spool import Spool
from ..domain.tokens import TokenStore
from ..metrics import Metrics
from .auth import make_authorizer
from .contract import StrictJSONRoute, answers, problem
from .errors import bounded, lookup
from .health import router as health_router

log = logging.getLogger("lastgood.rest")


@dataclass
class AppContext:
    commits: CommitService
    queries: Queries
    grpc_target: str
    curator: Curator
    gc: GarbageCollector
    tokens: TokenStore
    metrics: Metrics | None = None
    spool: Spool | None = None
    health: Health | None = None


class TagBody(BaseModel):
    name: str = Field(description="free text, 1-128 characters")
    alias: bool = Field(False, description="an alias names one checkpoint per run and moves when set again")


class RollbackBody(BaseModel):
    target_id: int = Field(ge=1, le=names.MAX_ID, description="the checkpoint training returns to")
    spike_step: int = Field(ge=0, le=names.MAX_ID, description="the step at which the spike was seen")
    data: dict = Field(default_factory=dict, description="the guard's numbers: loss, median, mad, threshold, ... "
                                                         "(strict JSON: a non-finite number is sent as \"nan\", "
                                                         "\"inf\" or \"-inf\")")


class EventBody(BaseModel):
    kind: str = Field(description="spike, restart or note")
    checkpoint_id: int | None = Field(None, ge=1, le=names.MAX_ID)
    data: dict = Field(default_factory=dict, description="strict JSON, at most 32 levels deep")


class LaunchBody(BaseModel):
    attempt: str = Field(description="the launch's attempt id; every rank of one launch sends the same")
    world_size: int = Field(1, ge=1, le=names.MAX_RANK)


class TokenBody(BaseModel):
    name: str = Field(description="who or what holds it, e.g. 'trainer gpt-small'")
    role: str = Field(description="reader, writer or admin")
    run_prefix: str | None = Field(None, description="limit the token to runs whose names start with this")


class LeaseBody(BaseModel):
    holder: str = Field("client", max_length=128)
    seconds: float = Field(600.0, ge=1, le=MAX_LEASE_SECONDS, description="how long the lease lasts, 1 s to 24 h")


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": bounded(message)}}, status_code=status,
                        headers=headers)


_RANGE = re.compile(r"^bytes=(\d{0,19})-(\d{0,19})$", re.ASCII)  # 19 digits: any int64 offset


def parse_range(header: str, size: int) -> tuple[int, int]:
    """One `bytes=a-b`, `bytes=a-` or `bytes=-n` range -> [start, end) within size."""
    m = _RANGE.match(header.strip())
    if not m or (m.group(1) == "" and m.group(2) == ""):
        raise InvalidArgument(f"unsupported Range header {header!r}: use one range, bytes=START-END")
    a, b = m.group(1), m.group(2)
    if a == "":
        n = int(b)
        if n == 0 or size == 0:
            raise OutOfRange(f"suffix range of {n} bytes of a {size}-byte file is empty")
        return max(0, size - n), size
    start = int(a)
    end = size if b == "" else int(b) + 1
    if b != "" and int(b) < start:
        raise InvalidArgument(f"Range end {b} is before start {a}")
    if start >= size:
        raise OutOfRange(f"range starts at byte {start} but the file has {size} bytes")
    return start, min(end, size)


Limit = Annotated[int, Query(ge=1, le=MAX_PAGE)]
Offset = Annotated[int, Query(ge=0, le=names.MAX_ID)]
Id = Annotated[int, Path(ge=1, le=names.MAX_ID)]  # checkpoint, lease and token ids
CkptId = Id
# the caller's launch generation on the curation routes: an older one than the run's newest is refused
Generation = Annotated[int | None, Header(alias=GENERATION_HEADER, ge=0, le=names.MAX_ID)]

# The web page (static/: plain files, no build step, no CDN). Scripts and styles come from
# our own files only, so user strings that slip into markup could never run.
STATIC_DIR = pathlib.Path(__file__).resolve().parent.parent / "static"
UI_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class UIFiles(StaticFiles):
    """/static with UI_HEADERS on every file."""

    async def get_response(self, path: str, scope):
        response = await super().get_response(path, scope)
        response.headers.update(UI_HEADERS)
        return response


def create_app(ctx: AppContext) -> FastAPI:
    authorize = make_authorizer(ctx.tokens, ctx.queries.run_of_checkpoint, ctx.queries.run_of_lease)
    # No /docs or /redoc: they load Swagger UI and ReDoc from a CDN, which the page's CSP
    # and offline deployments rule out. /openapi.json stays public (docs/security.md).
    app = FastAPI(title="lastgood", version=__version__, dependencies=[Depends(authorize)],
                  docs_url=None, redoc_url=None,
                  description="Checkpoint store for PyTorch training: runs, checkpoints, last-good, downloads.")
    app.router.route_class = StrictJSONRoute

    @app.exception_handler(DomainError)
    async def _domain(_req: Request, exc: DomainError):
        status, _code, name = lookup(exc)
        return _error(status, name, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        return _error(422, "invalid_request", "; ".join(map(problem, exc.errors())) or "invalid request")

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception):  # a full disk by its name; never a plain-text 500
        mapped = as_domain_error(exc)
        if mapped is not None:
            status, _code, name = lookup(mapped)
            return _error(status, name, str(mapped))
        log.error("request failed", exc_info=exc)
        return _error(500, "internal", "the request failed inside the service; see its log")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, "http_error", str(exc.detail), exc.headers)  # 405 keeps its Allow

    @app.get("/healthz", tags=["ops"])
    def healthz():
        ctx.queries.list_runs(limit=1)  # proves the catalog answers
        return {"status": "ok"}

    @app.get("/api/v1/info", tags=["ops"])
    def info():
        s = ctx.commits.settings
        return {"service": "lastgood", "version": __version__, "grpc_target": ctx.grpc_target,
                "max_chunk_bytes": s.max_chunk_bytes, "max_shard_bytes": s.max_shard_bytes,
                "lease_seconds": s.lease_seconds, "spool": ctx.spool.info() if ctx.spool else None}

    @app.get("/api/v1/runs", tags=["runs"], responses=answers(400))
    def list_runs(request: Request, limit: Limit = 100, offset: Offset = 0):
        principal = getattr(request.state, "principal", None)
        return ctx.queries.list_runs(limit, offset, principal.run_prefix if principal else None)

    @app.get("/api/v1/tokens", tags=["tokens"], responses=answers(params=False))
    def list_tokens():
        return {"items": ctx.tokens.list()}

    @app.post("/api/v1/tokens", tags=["tokens"], responses=answers(400, 413))
    def create_token(body: TokenBody):
        """The token is in the answer, once: only its hash is stored."""
        return ctx.tokens.create(body.name, body.role, body.run_prefix)

    @app.delete("/api/v1/tokens/{token_id}", tags=["tokens"], responses=answers(404))
    def revoke_token(token_id: Id):
        return ctx.tokens.revoke(token_id)

    @app.get("/metrics", tags=["ops"], include_in_schema=False)
    def metrics():
        if ctx.metrics is None:
            return Response("", media_type="text/plain")
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/api/v1/runs/{run}", tags=["runs"], responses=answers(400, 404))
    def get_run(run: str):
        return ctx.queries.get_run(run)

    @app.get("/api/v1/runs/{run}/checkpoints", tags=["runs"], responses=answers(400, 404))
    def list_checkpoints(run: str, status: str | None = None, limit: Limit = 100, offset: Offset = 0):
        return ctx.queries.list_checkpoints(run, status, limit, offset)

    @app.get("/api/v1/runs/{run}/last-good", tags=["runs"], responses=answers(400, 404, 409))
    def last_good(run: str):
        """The run's last-good with its manifest, checked; 404 `not_found`: no such run; 404
        `no_checkpoint`: the run never committed one; 409 `no_usable_checkpoint`: it did,
        but all are damaged (a refusal, not "start from scratch")."""
        view, body = ctx.queries.readable_last_good(run, ctx.commits.manifest_bytes)
        view["manifest"] = json.loads(body)
        return view

    @app.get("/api/v1/runs/{run}/events", tags=["runs"], responses=answers(400, 404))
    def events(run: str, limit: Limit = 100, offset: Offset = 0,
               kind: Annotated[str | None, Query(max_length=400, description="comma list of kinds")] = None):
        return ctx.queries.events(run, limit, offset, kind.split(",") if kind is not None else None)

    def _manifest_json(cid: int):
        return json.loads(ctx.commits.manifest_bytes(cid))

    @app.get("/api/v1/runs/{run}/lineage", tags=["lineage"], responses=answers(400, 404))
    def run_lineage(run: str, limit: Annotated[int, Query(ge=1, le=10000)] = 10000, offset: Offset = 0):
        """The run's checkpoint tree: nodes (step, status, branch, tags, bytes, durations) and parent edges."""
        return ctx.queries.lineage(run, limit, offset)

    @app.get("/api/v1/checkpoints/{checkpoint_id}/ancestors", tags=["lineage"], responses=answers(404))
    def ancestors(checkpoint_id: CkptId):
        return ctx.queries.ancestors(checkpoint_id)

    @app.post("/api/v1/checkpoints/{checkpoint_id}/tags", tags=["tags"], responses=answers(400, 404, 409, 413))
    def set_tag(checkpoint_id: CkptId, body: TagBody, generation: Generation = None):
        return ctx.curator.set_tag(checkpoint_id, body.name, body.alias, generation)

    @app.delete("/api/v1/checkpoints/{checkpoint_id}/tags/{name:path}", tags=["tags"],  # tags may hold '/'
                responses=answers(400, 404, 409))
    def remove_tag(checkpoint_id: CkptId, name: str, generation: Generation = None):
        return ctx.curator.remove_tag(checkpoint_id, name, generation)

    @app.put("/api/v1/checkpoints/{checkpoint_id}/pin", tags=["tags"], responses=answers(404, 409))
    def pin(checkpoint_id: CkptId, generation: Generation = None):
        return ctx.curator.pin(checkpoint_id, True, generation)

    @app.delete("/api/v1/checkpoints/{checkpoint_id}/pin", tags=["tags"], responses=answers(404, 409))
    def unpin(checkpoint_id: CkptId, generation: Generation = None):
        return ctx.curator.pin(checkpoint_id, False, generation)

    @app.post("/api/v1/runs/{run}/rollback", tags=["lineage"], responses=answers(400, 404, 409, 413))
    def rollback(run: str, body: RollbackBody, generation: Generation = None):
        """Mark what followed the target suspect, tag the target rollback-target, move last-good back."""
        return ctx.curator.rollback(run, body.target_id, body.spike_step, body.data, generation)

    @app.post("/api/v1/runs/{run}/launches", tags=["runs"], responses=answers(400, 404, 409, 413))
    def register_launch(run: str, body: LaunchBody):
        """Register a launch of the job; its generation fences every older launch's writes
        and abandons their pending checkpoints (docs/fencing.md). Idempotent on (run, attempt)."""
        return ctx.commits.launches.register(run, body.attempt, body.world_size)

    @app.get("/api/v1/runs/{run}/launches/current", tags=["runs"], responses=answers(400, 404))
    def current_launch(run: str):
        """The run's newest launch: the one whose writes the service accepts."""
        return ctx.commits.launches.current(run)

    @app.post("/api/v1/runs/{run}/events", tags=["runs"], responses=answers(400, 404, 413))
    def record_event(run: str, body: EventBody):
        return ctx.curator.record_event(run, body.kind, body.checkpoint_id, body.data)

    @app.post("/api/v1/checkpoints/{checkpoint_id}/leases", tags=["checkpoints"], responses=answers(400, 404, 409, 413))
    def acquire_lease(checkpoint_id: CkptId, body: LeaseBody):
        """Keep the checkpoint's blobs from GC while a restore or download reads them."""
        return ctx.curator.acquire_lease(checkpoint_id, body.holder, body.seconds)

    @app.delete("/api/v1/leases/{lease_id}", tags=["checkpoints"], responses=answers(404))
    def release_lease(lease_id: Id):
        return ctx.curator.release_lease(lease_id)

    @app.get("/api/v1/gc/plan", tags=["gc"], responses=answers(params=False))
    def gc_plan():
        """A dry run: what GC would delete now, and the bytes it would free."""
        return ctx.gc.plan().to_dict()

    @app.post("/api/v1/gc", tags=["gc"], responses=answers())
    def gc_run(dry_run: bool = False):
        plan = ctx.gc.plan()
        out = {"plan": plan.to_dict(), "dry_run": dry_run}
        if not dry_run:
            out["result"] = ctx.gc.execute(plan)
        return out

    @app.get("/api/v1/checkpoints/{checkpoint_id}", tags=["checkpoints"], responses=answers(404, 409))
    def get_checkpoint(checkpoint_id: CkptId):
        view = ctx.queries.get_checkpoint(checkpoint_id)
        view["manifest"] = _manifest_json(checkpoint_id) if view["status"] == "COMMITTED" else None
        return view

    @app.get("/api/v1/checkpoints/{checkpoint_id}/manifest", tags=["checkpoints"], responses=answers(404, 409))
    def get_manifest(checkpoint_id: CkptId):
        return Response(ctx.commits.manifest_bytes(checkpoint_id), media_type="application/json")

    @app.post("/api/v1/checkpoints/{checkpoint_id}/verify", tags=["checkpoints"], responses=answers(404, 409))
    def verify(checkpoint_id: CkptId):
        """Re-hash every shard; a mismatch marks the checkpoint CORRUPT and moves last-good back."""
        return ctx.commits.verify(checkpoint_id)

    @app.get("/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/files/{file_name}", tags=["checkpoints"],
             responses=answers(400, 404, 409, 416))
    def download(request: Request, checkpoint_id: CkptId, rank: Annotated[int, Path(ge=0, le=names.MAX_RANK)],
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

    # ---------------------------------------------------------------- the web page and its read-only views
    @app.get("/api/v1/overview", tags=["runs"], responses=answers(400))
    def overview(request: Request, limit: Limit = 100, offset: Offset = 0):
        """Runs with bytes stored, last activity, pending saves and recent failures (the page's runs list)."""
        principal = getattr(request.state, "principal", None)
        return ctx.queries.overview(limit, offset, getattr(principal, "run_prefix", None))

    @app.get("/api/v1/gc/policy", tags=["gc"], responses=answers(params=False))
    def gc_policy():
        """The retention policy in force, the grace period and the GC interval."""
        return gc_policy_view(ctx.gc.retention, ctx.gc.grace.total_seconds(), ctx.commits.settings.gc_interval)

    @app.get("/api/v1/checkpoints/{checkpoint_id}/shards", tags=["checkpoints"], responses=answers(404))
    def shards(checkpoint_id: CkptId):
        """Per rank, the files the catalog holds (size, xxh3-128, state), whatever the checkpoint's status."""
        return ctx.queries.shards(checkpoint_id)

    if ctx.health is not None:
        app.include_router(health_router(ctx.health))  # api/health.py

    @app.get("/", include_in_schema=False)
    def web_page():
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=UI_HEADERS)

    app.mount("/static", UIFiles(directory=STATIC_DIR), name="static")
    return app
