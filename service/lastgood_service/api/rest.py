"""REST API (FastAPI): `create_app` assembles the routers of api/routes/ on one context.

Handlers hold no SQL and no storage logic; they call the domain and map its errors through
api/errors.py. Every error body is JSON: {"error": {"code": ..., "message": ...}}.
"""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from lastgood.wire import codes as c

from .. import __version__
from ..domain.errors import DomainError
from ..domain.faults import as_domain_error
from .answers import document
from .auth import make_authorizer
from .contract import StrictJSONRoute, error_response, problem
from .deps import AppContext
from .errors import lookup, travels
from .routes import (agents, checkpoints, gc, grants, health, launches, leases, lineage, ops, outcomes, page,
                     peer_checks, retention, runs, tags, tokens)

log = logging.getLogger("lastgood.rest")

__all__ = ["AppContext", "create_app"]

# The routes every rank calls, outcome waits and heartbeats, come first: a request is matched
# against each router in turn, and at 1,024 ranks asking at once matching through eleven
# routers before the outcome's would be most of the event loop's work per request
# (docs/control-plane.md). Their paths overlap no other router's, so the order changes nothing else.
ROUTERS = (outcomes, health, ops, runs, tokens, lineage, tags, launches, leases, gc, retention, checkpoints, page,
           grants, peer_checks, agents)


def allowed_methods(routes, scope, allow: str = "") -> str:
    """A 405's Allow: every method of every route whose path matches the request's, with
    the methods Starlette named (those of the first such route only)."""
    methods = {m.strip() for m in allow.split(",") if m.strip()}
    for route in routes:
        if route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))


def create_app(ctx: AppContext) -> FastAPI:
    authorize = make_authorizer(ctx.tokens, ctx.queries.run_of_checkpoint, ctx.queries.run_of_lease)
    # No /docs or /redoc: they load Swagger UI and ReDoc from a CDN, which the page's CSP
    # and offline deployments rule out. /openapi.json stays public (docs/security.md).
    app = FastAPI(title="lastgood", version=__version__, dependencies=[Depends(authorize)],
                  docs_url=None, redoc_url=None,
                  description="Checkpoint store for PyTorch training: runs, checkpoints, last-good, downloads.")
    app.router.route_class = StrictJSONRoute
    app.state.ctx = ctx  # what api/deps.py hands the handlers

    @app.exception_handler(DomainError)
    async def _domain(_req: Request, exc: DomainError):
        status, _code, name = lookup(exc)
        return error_response(status, name, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        status, _code, name = travels(c.INVALID_REQUEST)
        return error_response(status, name, "; ".join(map(problem, exc.errors())) or "invalid request")

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception):  # a full disk by its name; never a plain-text 500
        mapped = as_domain_error(exc)
        if mapped is not None:
            status, _code, name = lookup(mapped)
            return error_response(status, name, str(mapped))
        log.error("request failed", exc_info=exc)
        status, _code, name = travels(c.INTERNAL)
        return error_response(status, name, "the request failed inside the service; see its log")

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, exc: StarletteHTTPException):
        headers = exc.headers
        if exc.status_code == 405:  # Starlette's Allow names the first route of the path only
            allow = allowed_methods(routes, req.scope, (headers or {}).get("Allow", ""))
            headers = {**(headers or {}), "Allow": allow}
        return error_response(exc.status_code, c.HTTP_ERROR, str(exc.detail), headers)

    for module in ROUTERS:
        app.include_router(module.router)
    routes = [r for module in ROUTERS for r in module.router.routes if getattr(r, "methods", None)]
    page.mount_static(app)
    document(app)  # each route's success answer in /openapi.json (api/answers.py)
    return app
