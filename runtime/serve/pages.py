"""The playground: `runtime serve`'s page at `/`, plain HTML, CSS and one script shipped in the
package (runtime/serve/playground/), nothing from a CDN, so it works offline. The page is a client of
the API like any other (GET /v1/models, POST /v1/videos, ...) with the key the person gives it,
kept for the tab only (sessionStorage); its files are open, as the page must load to ask for
the key. No routes of the API here (runtime.serve.server)."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from runtime.serve.openai_dialect import ApiError

FOLDER = "playground"  # package data of `runtime.serve`
FILES = {
    "index.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}
# The page runs its own script only, and shows the videos and previews it fetched with the key
# as blob: URLs (a <video src> cannot send an Authorization header).
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob:; media-src 'self' blob:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def page_file(name: str) -> Response:
    """One of the page's FILES, read from the package at each request."""
    source = resources.files("runtime.serve") / FOLDER / name
    if name not in FILES or not source.is_file():
        raise ApiError(404, "not_found", f"the playground has no file {name}")
    return Response(source.read_bytes(), media_type=FILES[name], headers=HEADERS)


def add_playground(app: FastAPI) -> None:
    """The page at `/` and its files at /playground/NAME (GET and HEAD; not in the schema)."""

    def index() -> Response:
        return page_file("index.html")

    def asset(name: str) -> Response:
        return page_file(name)

    for path, endpoint in (("/", index), (f"/{FOLDER}/{{name}}", asset)):
        app.add_api_route(path, endpoint, methods=["GET", "HEAD"], include_in_schema=False)
