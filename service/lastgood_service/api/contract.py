"""What the REST API promises every caller: strict JSON request bodies, one error body,
and the error statuses each route declares in the OpenAPI document (docs/security.md)."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field

from lastgood.wire import jsonvalues

from .errors import bounded


class ErrorDetail(BaseModel):
    code: str = Field(description="not_found, invalid_argument, invalid_request, conflict, ...")
    message: str


class ErrorBody(BaseModel):
    """Every error answer's body."""
    error: ErrorDetail


_MEANING = {
    400: "invalid argument (a name, a status, a Range header, ...)",
    401: "no valid token (only when tokens are required)",
    403: "the token's role or run scope does not allow this",
    404: "no such run, checkpoint, lease, token, tag or file",
    409: "the checkpoint is not in a state that allows this, or it conflicts with what is recorded",
    413: "request body over the service's limit",
    416: "the Range is outside the file",
    422: "the request does not validate (types, bounds, strict JSON), or a stored hash does not match",
    429: "too many of these requests lately (a run's launch registrations; docs/security.md): retry later",
    503: "the service cannot do this now: an I/O error on its storage, its catalog database unavailable, or a "
         "catalog behind the blob store (run `lastgood-service rebuild`; docs/storage.md)",
    507: "the store is full (the message says how much room is left)",
}


NOSNIFF = (b"x-content-type-options", b"nosniff")


class Nosniff:
    """ASGI middleware, outermost: every HTTP answer (API, errors, downloads, the page) says
    `X-Content-Type-Options: nosniff`, so a browser never reads a download or a JSON answer
    as another type (a page, a script) than the one it is sent as. The one place it is set."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def nosniff(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), NOSNIFF]}
            await send(message)

        return await self.app(scope, receive, nosniff)


def error_response(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    """The one error body, with its message bounded (api/errors.py)."""
    return JSONResponse({"error": {"code": code, "message": bounded(message)}}, status_code=status,
                        headers=headers)


def answers(*codes: int, params: bool = True) -> dict:
    """The error statuses a route declares in the OpenAPI document, with the shared body:
    `codes`, plus 422 for a route with parameters or a body, 401/403 (every route that
    does not declare its own `responses` is public), and the storage faults 503/507 that any
    route may meet (domain/faults.py)."""
    codes = set(codes) | {401, 403, 503, 507} | ({422} if params else set())
    return {c: {"model": ErrorBody, "description": _MEANING[c]} for c in sorted(codes)}


class StrictJSONRequest(Request):
    """A request whose JSON body is strict (lastgood.wire.jsonvalues): non-finite numbers, text
    that is not UTF-8 and deep nesting are refused with 422 before any handler sees them."""

    async def json(self):
        if not hasattr(self, "_json"):
            try:
                self._json = jsonvalues.loads(await self.body())
            except jsonvalues.InvalidJSON as e:
                raise json.JSONDecodeError(str(e), "", 0) from None  # FastAPI answers it with 422
        return self._json


class StrictJSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict


def problem(err: dict) -> str:
    """One validation error as `where: what`; a body that is not strict JSON says why."""
    if err.get("type") == "json_invalid":
        return f"body: {(err.get('ctx') or {}).get('error') or err.get('msg')}"
    return f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}"
