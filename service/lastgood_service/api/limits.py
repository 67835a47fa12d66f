"""Request limits applied before a byte is buffered."""

from __future__ import annotations

import json

from lastgood.wire import codes as c

from .errors import travels


class BodyLimit:
    """ASGI middleware: refuse a REST body larger than `limit` with 413, from its
    Content-Length before reading, or as soon as a chunked body passes the limit."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._refuse(send)
        seen, refused, started = 0, False, False

        async def guarded_send(message):
            nonlocal started
            if refused:
                return  # we already answered 413
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        async def limited():
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    if not started:
                        await self._refuse(send)
                    refused = True
                    return {"type": "http.disconnect"}  # the app stops reading
            return message

        try:
            return await self.app(scope, limited, guarded_send)
        except Exception:
            if not refused:
                raise

    async def _refuse(self, send):
        status, _grpc, code = travels(c.TOO_LARGE)
        body = json.dumps({"error": {"code": code,
                                     "message": f"request body over the {self.limit}-byte limit"}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
