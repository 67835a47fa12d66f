"""The web page (static/: plain files, no build step, no CDN). Scripts and styles come from
our own files only, so user strings that slip into markup could never run."""

from __future__ import annotations

import pathlib

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from ..contract import StrictJSONRoute

STATIC_DIR = pathlib.Path(__file__).resolve().parents[2] / "static"
# nosniff too, on every answer: api/contract.Nosniff
UI_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(route_class=StrictJSONRoute)


class UIFiles(StaticFiles):
    """/static with UI_HEADERS on every file."""

    async def get_response(self, path: str, scope):
        response = await super().get_response(path, scope)
        response.headers.update(UI_HEADERS)
        return response


@router.get("/", include_in_schema=False)
def web_page():
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=UI_HEADERS)


def mount_static(app: FastAPI) -> None:
    """/static/*: mounted last, after every route."""
    app.mount("/static", UIFiles(directory=STATIC_DIR), name="static")
