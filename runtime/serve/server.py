"""`runtime serve`: a resident video-generation service over HTTP that speaks OpenAI's Videos API
(runtime.serve.openai_dialect), so the official `openai` SDK works against it unchanged. The builds are
loaded once (runtime.cli.serve chooses them), the requests are queued in a job store (SQLite, or
PostgreSQL shared by a fleet: runtime.serve.job_store) and run by the worker (runtime.serve.service.Service);
the bounds and the API keys wrap the app (runtime.serve.http_guards). This module is the routes, their OpenAPI schema, and the
server's start and drain on SIGTERM."""

from __future__ import annotations

import functools
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import Scope

from runtime.serve.http_guards import (
    API_KEYS_ENV,
    ApiKeys,
    BoundedBody,
    HeaderDeadline,
    HttpLimits,
    JsonErrors,
)
from runtime.serve.job_store import Job, StoreError
from runtime.serve.openai_dialect import (
    CFG_ABOVE,
    ERRORS,
    IMAGE_FIELD,
    MEDIA_TYPES,
    UNSUPPORTED,
    ApiError,
    ErrorBody,
    VideoRequest,
    error_response,
    form_schema,
    list_page,
    model_object,
    read_video_request,
    seconds_text,
    served_sizes,
    validation_message,
)
from runtime.serve.pages import add_playground
from runtime.serve.service import Service

T = TypeVar("T")


def _responses(*statuses: int, ok: dict[str, Any] | None = None) -> dict[int | str, Any]:
    """An operation's documented answers: its errors, those every operation may answer (a body
    too large or too slow, a bug), and `ok`, its 200 when that is not JSON."""
    answers: dict[int | str, Any] = {
        s: {"model": ErrorBody, "description": ERRORS[s]} for s in (*statuses, 408, 413, 500)
    }
    return answers | ({200: ok} if ok else {})


# Longer than most: the API's routes, read top to bottom as the API.
def make_app(service: Service, limits: HttpLimits, keys: tuple[str, ...] = ()) -> FastAPI:
    """The app; with `keys`, every /v1/ route takes `Authorization: Bearer KEY` of one of them."""
    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN (nothing on an offline
    # host); the playground at / is the page, /openapi.json the schema.
    app = FastAPI(title="wan-aot runtime serve", docs_url=None, redoc_url=None)
    store = service.store

    @app.exception_handler(ApiError)
    def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.code, e.message, param=e.param)

    @app.exception_handler(RequestValidationError)
    def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        return error_response(400, "invalid_request", message, param=param)

    @app.exception_handler(HTTPException)
    def _http(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 405:  # Allow: every route's methods at this path, not the first's
            allowed = ", ".join(sorted(_methods_at(app, request.scope)))
            message = f"{request.method} is not served at {request.url.path}: use {allowed}"
            return error_response(405, "method_not_allowed", message, {"Allow": allowed})
        code = "not_found" if e.status_code == 404 else "http_error"
        return error_response(e.status_code, code, e.detail, e.headers)

    @app.exception_handler(StoreError)
    def _store_error(request: Request, e: StoreError) -> JSONResponse:
        service.store_problem = str(e)
        service.metrics.store_errors += 1
        return error_response(503, "store_unavailable", f"{e}; retry later")

    def get(path: str, **kwargs: Any) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """A GET route, and HEAD at the same path (the same answer without its body)."""

        def register(endpoint: Callable[..., T]) -> Callable[..., T]:
            app.head(path, include_in_schema=False, **kwargs)(endpoint)
            return app.get(path, **kwargs)(endpoint)

        return register

    def found(video_id: str, param: str | None = None) -> Job:
        job = store.get(video_id)
        if job is None:
            raise ApiError(404, "not_found", f"no video {video_id}", param)
        return job

    @app.post("/v1/videos", status_code=202, responses=_responses(400, 429, 503))
    async def create(request: Request) -> dict[str, Any]:
        """A video to make, as JSON or multipart/form-data (the SDK's; image to video: its
        `input_reference` file): queued, answered at once; its `status` and `progress` say the
        rest."""
        body, image = await read_video_request(
            request, limits.max_prompt_chars, limits.max_body_bytes
        )
        return service.video_object(await run_in_threadpool(service.submit, body, image))

    @get("/v1/videos", responses=_responses(400, 404, 503))
    def list_videos(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        """Newest first (`order=asc`: oldest first), after the video `after`; a page holds at
        most `limit` videos and about a MiB of them, `has_more` says whether more follow."""
        if after is not None:
            found(after, "after")
        jobs, more = store.page(limit, after, ascending=order == "asc")
        return list_page([service.video_object(j) for j in jobs], more)

    @get("/v1/videos/{video_id}", responses=_responses(404, 503))
    def get_video(video_id: str) -> dict[str, Any]:
        return service.video_object(found(video_id))

    binary = {"schema": {"type": "string", "format": "binary"}}
    files = {"content": {media: binary for media in MEDIA_TYPES.values()}}

    @get(
        "/v1/videos/{video_id}/content",
        response_class=FileResponse,
        responses=_responses(400, 404, 409, 410, 503, ok=files),
    )
    def content(
        video_id: str, variant: Literal["video", "thumbnail", "spritesheet", "frames"] = "video"
    ) -> FileResponse:
        """The MP4; its first frame (`variant=thumbnail`, WebP); a grid of its frames
        (`spritesheet`, JPEG); or (`frames`, a server run with --save-frames) the uint8 frames
        (F, H, W, 3) as .npy."""
        job = found(video_id)
        if job.damage:  # its files are never named after a row that does not read
            raise ApiError(409, "not_ready", f"video {video_id}: {job.unreadable}")
        if job.status != "completed":
            raise ApiError(409, "not_ready", f"video {video_id} is {job.status}, not completed")
        video, path = store.video_path(job.id), store.content_path(job.id, variant)
        if not video.is_file() and store.shared:  # the folder may not be this replica's
            raise ApiError(
                404, "content_missing", f"{video.name} is not in {store.videos} on replica "
                f"{store.replica}: every replica must mount the same --out-dir (README: Scaling "
                "out), or the video was deleted there: submit it again",
            )  # fmt: skip
        if not video.is_file():  # one server's own folder: the file was deleted
            raise ApiError(
                410, "gone", f"{video.name} is no longer in {store.videos}: submit the video again"
            )
        if not path.is_file():
            why = "start the server with --save-frames" if variant == "frames" else (
                "it was made before this server wrote them")  # fmt: skip
            raise ApiError(404, "not_found", f"no {variant} kept of video {video_id}: {why}")
        return FileResponse(path, media_type=MEDIA_TYPES[variant])

    @app.delete("/v1/videos/{video_id}", responses=_responses(404, 409, 503))
    def delete(video_id: str) -> dict[str, Any]:
        """A queued video is cancelled; a completed or failed one deleted with its files."""
        job = found(video_id)
        if not store.delete(video_id):
            raise ApiError(
                409, "in_progress", f"video {video_id} is {job.status}: wait until it finishes"
            )
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @get("/v1/models", responses=_responses(503))
    def models() -> dict[str, Any]:
        """The served models (the `model` of POST /v1/videos)."""
        data = [model_object(m, service.started, service.builds.values()) for m in service.models()]
        return {"object": "list", "data": data}

    @get("/v1/models/{model}", responses=_responses(404, 503))
    def get_model(model: str) -> dict[str, Any]:
        if model not in service.models():
            raise ApiError(404, "model_not_found", f"model {model} is not served")
        return model_object(model, service.started, service.builds.values())

    def unsupported(call: str) -> Callable[[], dict[str, Any]]:
        def refuse() -> dict[str, Any]:
            raise ApiError(
                400, "unsupported_operation",
                f"{call} is not supported by this server: it makes videos from a prompt (and an "
                "image) only, POST /v1/videos",
            )  # fmt: skip

        return refuse

    for (method, path), call in UNSUPPORTED.items():
        app.add_api_route(path, unsupported(call), methods=[method], include_in_schema=False)

    @get("/healthz", responses=_responses(503))
    def healthz() -> dict[str, Any]:
        """200 while serving; 503 while draining, while the generation worker is stopped or
        failing, or while the job store is unusable (runtime.serve.service.Service.health). Open
        without a key, for probes."""
        problem = service.health()
        if problem:
            raise ApiError(503, *problem)
        return {"status": "ok", "builds": sorted(service.pipelines)}

    text = {"content": {"text/plain": {"schema": {"type": "string"}}}}

    @get("/metrics", response_class=PlainTextResponse, responses=_responses(503, ok=text))
    def metrics() -> PlainTextResponse:
        """Prometheus' text format. Open without a key, for scrapers."""
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _document(FastAPI.openapi(app), service, limits, bool(keys))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    add_playground(app)
    app.add_middleware(BoundedBody, limit=limits.max_body_bytes, timeout=limits.body_timeout)
    app.add_middleware(ApiKeys, keys=keys)  # outside the body's read: no key, nothing read
    app.add_middleware(JsonErrors)  # the outermost: whatever raises below
    return app


def _methods_at(app: FastAPI, scope: Scope) -> set[str]:
    """The methods some route serves at the request's path (a 405's Allow)."""
    return {
        method
        for route in app.router.routes
        if route.matches(scope)[0] is not Match.NONE
        for method in getattr(route, "methods", None) or ()
    }


def _document(schema: dict[str, Any], service: Service, limits: HttpLimits, keyed: bool) -> None:
    """What FastAPI's schema leaves out of what the server does: no 422 (a request that does
    not validate is 400, documented per operation), POST /v1/videos' body as JSON and as a form
    (read by hand: runtime.serve.openai_dialect.read_video_request), the prompts' limit, the models,
    sizes, lengths and guidance the loaded builds serve, and with `keyed` the key every /v1/
    operation takes (401 without it). An image-to-video build's sizes require the form's
    `input_reference` file (a JSON body carries none)."""
    components = schema["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    request = VideoRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    for name in ("prompt", "negative_prompt"):
        request["properties"][name]["maxLength"] = limits.max_prompt_chars
    images = any(b.image for b in service.builds.values())
    components["VideoRequest"] = request
    components["VideoRequestForm"] = form_schema(request, images)
    several = len(service.models()) > 1
    routes = []
    for build in sorted(service.builds.values(), key=lambda b: b.route):
        width, height, frames, cfg, image = build.route
        guidance = {"exclusiveMinimum": CFG_ABOVE} if cfg else {"maximum": CFG_ABOVE}
        seconds = seconds_text(frames, build.fps)
        lengths = {"frames": [frames], "seconds": [seconds, float(seconds)]}
        properties = {"size": {"const": f"{width}x{height}"}, "guidance": guidance,
                      "model": {"const": build.model}}  # fmt: skip
        properties |= {name: {"enum": [*values, None]} for name, values in lengths.items()}
        required = ([] if cfg else ["guidance"]) + (["model"] if several else [])
        own = [b for b in service.builds.values() if b.model == build.model]
        required += ["size"] if len(served_sizes(own, frames)) > 1 else []  # else it is implied
        required += [IMAGE_FIELD] if image else []
        # Either length given (not null); both given, they agree.
        length = [{"required": [name], "properties": {name: {"enum": values}}}
                  for name, values in lengths.items()]  # fmt: skip
        routes.append({"properties": properties, "required": required, "anyOf": length})
    bodies = {"application/json": "VideoRequest", "multipart/form-data": "VideoRequestForm"}
    if all(b.image for b in service.builds.values()):  # every build takes a file: forms only
        del bodies["application/json"]
    content: dict[str, Any] = {
        media: {"schema": {"allOf": [{"$ref": f"#/components/schemas/{name}"}, {"anyOf": routes}]}}
        for media, name in bodies.items()
    }
    if images:  # the file part's types (it needs a filename, else it is a text field, refused)
        content["multipart/form-data"]["encoding"] = {
            IMAGE_FIELD: {"contentType": "image/png, image/jpeg, image/webp"}
        }
    schema["paths"]["/v1/videos"]["post"]["requestBody"] = {"required": True, "content": content}
    unauthorized = {"description": ERRORS[401], "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorBody"}}}}  # fmt: skip
    if keyed:
        schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            if keyed and path.startswith("/v1/"):
                operation["responses"]["401"] = unauthorized
                operation["security"] = [{"apiKey": []}]


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains: new requests get 503 while the batch in flight
    finishes (at most `drain_timeout` seconds), then the server stops."""

    def __init__(self, config: uvicorn.Config, service: Service, drain_timeout: float):
        super().__init__(config)
        self.service, self.drain_timeout = service, drain_timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        elif not self.service.draining:
            self.service.drain()
            threading.Thread(target=self._stop_when_idle, daemon=True).start()

    def _stop_when_idle(self) -> None:
        self.service.idle.wait(self.drain_timeout)
        self.should_exit = True


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything loads: a taken port is one line, early."""
    try:
        return socket.create_server((host, port), family=_family(host), reuse_port=False)
    except OSError as e:
        raise OSError(e.errno, f"cannot listen on {host}:{port} ({e.strerror})") from None


def _family(host: str) -> socket.AddressFamily:
    return (
        socket.AF_INET6 if re.fullmatch(r"[0-9a-fA-F:]+", host) and ":" in host else socket.AF_INET
    )


def serve(
    service: Service,
    sock: socket.socket,
    drain_timeout: float,
    limits: HttpLimits,
    log: Callable[[str], None],
    keys: tuple[str, ...] = (),
) -> None:
    """Serve until SIGTERM (drained) or SIGINT; the jobs of an unfinished batch stay queued.
    With `keys`, /v1/ takes one of them; without, the start says the server is open."""
    service.start_worker()
    stop_renewing = threading.Event()
    if service.store.shared:  # leases matter where other replicas may take the jobs
        threading.Thread(
            target=service.renew_leases, args=(stop_renewing,), name="leases", daemon=True
        ).start()
    config = uvicorn.Config(
        make_app(service, limits, keys),
        log_level="warning",
        timeout_graceful_shutdown=5,
        lifespan="off",
        http=functools.partial(HeaderDeadline, header_timeout=limits.header_timeout),
    )
    server = _DrainingServer(config, service, drain_timeout)
    host, port = sock.getsockname()[:2]
    log(f"serving {len(service.pipelines)} build(s) on http://{host}:{port}: {service.served()}")
    log(f"job store {service.store.where}, replica {service.store.replica}")
    log(f"the playground: http://{host}:{port}/")
    if not keys:
        log(f"open: no API key (--api-key-file, ${API_KEYS_ENV}, --api-key): anyone who reaches "
            f"{host}:{port} can queue videos")  # fmt: skip
    server.run(sockets=[sock])
    service.drain()
    finished = service.idle.wait(0)
    stop_renewing.set()
    try:
        service.store.requeue_in_progress()
    except StoreError as e:  # recover() queues them at the next start all the same
        log(f"{e} (the videos in progress are queued again at the next start)")
    service.store.close()
    log("stopped" + ("" if finished else ": the batch in flight was not finished, it stays queued"))
    if not finished:  # the worker is inside a device call: leave without waiting for it
        sys.stderr.flush()
        os._exit(0)
