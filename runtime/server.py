"""`runtime serve`: a resident video-generation service over HTTP, in the shape of OpenAI's Videos
API. The builds are loaded once (runtime.cli_serve chooses them), the requests are queued in a
SQLite job store (runtime.job_store) and run in the compiled batches (runtime.batching) by one
worker thread that calls the same `Pipeline` as `runtime run`; this module is only the HTTP layer,
the worker loop and the drain on SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import h11
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.batching import Group, Settings, Video, Waiting, generate_batch, next_batch
from runtime.job_store import REQUEST_FIELDS, Job, JobStore, QueueFull, StoreError
from runtime.loader import Route, describe_route, serving_routes
from runtime.outputs import write_npy, write_videos
from runtime.request import MAX_SCALE, MAX_SEED, check_text
from wan.configs import SAMPLERS, VAEKindConfig

if TYPE_CHECKING:  # jax: imported by runtime.cli_serve once the port is bound
    import numpy as np

    from runtime.continuous import SlotBatch
    from runtime.pipeline import Pipeline
    from runtime.step_cache import CacheRequest

MAX_STEPS = 1000
CFG_ABOVE = 1.0  # a guidance above it runs a CFG build (the route's `cfg`)
IDLE_POLL_S = 1.0  # the worker looks at the queue at least this often
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 2.0  # the worker's backoff while the job store fails
T = TypeVar("T")


class VideoRequest(BaseModel):
    """The body of POST /v1/videos: strict types, no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1)
    negative_prompt: str = ""
    size: str = Field(pattern=r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$", description="WxH")
    frames: int = Field(ge=1, le=10_000)
    steps: int = Field(50, ge=1, le=MAX_STEPS)
    guidance: float = Field(5.0, ge=-MAX_SCALE, le=MAX_SCALE)
    guidance_2: float | None = Field(None, ge=-MAX_SCALE, le=MAX_SCALE)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # None: a random one, recorded
    sampler: Literal[SAMPLERS] | None = None
    shift: float | None = Field(None, gt=0, le=MAX_SCALE)

    @field_validator("frames", "steps", "seed", mode="before")
    @classmethod
    def _whole(cls, value: Any) -> Any:
        """A JSON integer may be written 5.0 (JSON Schema's, so the API's); strict mode would
        refuse it."""
        return int(value) if isinstance(value, float) and value.is_integer() else value

    @field_validator("prompt", "negative_prompt")
    @classmethod
    def _utf8(cls, text: str) -> str:
        check_text("the text", text)  # a JSON string may hold a lone surrogate
        return text

    @field_validator("guidance", "guidance_2", "shift")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("give a finite number")
        return value

    def shape(self) -> Route:
        """What picks the build (runtime.loader.serving_routes)."""
        width, height = map(int, self.size.split("x"))
        return width, height, self.frames, self.guidance > CFG_ABOVE

    def settings(self) -> Settings:
        return Settings(self.steps, self.guidance, self.guidance_2, self.sampler, self.shift)


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What one request may take of the server (the flags of `runtime serve`)."""

    max_body_bytes: int  # a larger body is 413, refused by its Content-Length before it is read
    max_prompt_chars: int  # each of prompt and negative_prompt; longer is 400
    header_timeout: float  # seconds to send a request's head, else the connection is closed
    body_timeout: float  # seconds to send its body, else 408


class _ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error answer: {"error": {"code", "message"}}."""

    error: _ErrorDetail


# Why the server answers each error status (the OpenAPI schema's descriptions).
ERRORS = {
    400: "The request does not hold what the operation takes.",
    404: "No such video (or, for frames, none kept).",
    408: "The request body did not arrive within --body-timeout.",
    409: "The video is not in a state that allows this.",
    410: "The video's file is no longer in --out-dir.",
    413: "The request body is over --max-body-bytes.",
    429: "The queue holds --max-queue videos.",
    500: "A bug in the server (one line in its log).",
    503: "The server is shutting down, or its job store is unusable for now.",
}


class ApiError(Exception):
    """An HTTP error answered as {"error": {"code", "message"}}."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclasses.dataclass
class Metrics:
    """What /metrics exports, counted since this process started."""

    completed: int = 0
    failed: int = 0
    batches: int = 0
    slots_filled: int = 0
    slots: int = 0
    step_seconds: float = 0.0
    steps: int = 0
    slot_steps: int = 0  # continuous builds: slots that held a video at a step
    empty_slot_steps: int = 0  # and slots that did not (computed, masked, discarded)


class Service:
    """The loaded pipelines, the job store and the worker that runs their batches."""

    def __init__(
        self,
        pipelines: dict[str, Pipeline],
        store: JobStore,
        max_queue: int,
        batch_window: float,
        compile_count: Callable[[], int],
        save_frames: bool = False,
        cache: CacheRequest | None = None,
    ):
        """`cache`: the step caching every batch runs with."""
        self.pipelines, self.store, self.save_frames = pipelines, store, save_frames
        self.cache = cache
        self.max_queue, self.batch_window, self.compile_count = (
            max_queue,
            batch_window,
            compile_count,
        )
        self.metrics = Metrics()
        self.wake = threading.Event()  # a request arrived, or the drain began
        self.idle = threading.Event()  # no batch in flight
        self.idle.set()
        self.draining = False
        # Why the job store is unusable, while it is (the last attempt failed): /healthz 503.
        self.store_problem: str | None = None
        self._progress_due = 0.0  # while the store fails, progress is tried again from then
        self._lock = threading.Lock()  # draining vs. the start of a batch
        # The rule runtime.cli_serve loaded the builds by, which gives each route one build.
        self.shapes = serving_routes({name: pipe.key for name, pipe in pipelines.items()})
        # The continuous builds' slots, which the worker steps between other batches (jax, as
        # the pipelines: runtime.cli_serve makes the service once the port is bound).
        from runtime.continuous import SlotBatch

        self.slot_batches = {
            name: SlotBatch(pipe)
            for name, pipe in pipelines.items()
            if pipe.key.option("continuous")
        }

    def served(self) -> str:
        return ", ".join(
            f"{describe_route(r)} (batch {self.pipelines[name].key.batch})"
            for r, name in sorted(self.shapes.items())
        )

    def submit(self, body: VideoRequest) -> Job:
        if self.draining:
            raise ApiError(503, "shutting_down", "the server is shutting down: retry later")
        if self.store_problem:  # answered now, not after a lock wait: the worker retries it
            raise ApiError(503, "store_unavailable", f"{self.store_problem}; retry later")
        build = self.shapes.get(body.shape())
        if build is None:
            raise ApiError(
                400,
                "unsupported_shape",
                f"no loaded build makes size {body.size} with {body.frames} frames "
                f"{'with' if body.shape()[3] else 'without'} CFG; served: {self.served()}",
            )
        request = body.model_dump()
        if request["seed"] is None:
            request["seed"] = secrets.randbelow(2**31)
        try:
            job = self.store.add(Group(build, body.settings()), request, self.max_queue)
        except QueueFull as e:
            raise ApiError(429, "queue_full", str(e)) from None
        self.wake.set()
        return job

    def video_object(self, job: Job) -> dict[str, Any]:
        """The job as the API's video object, at its build's frame rate; a job of a build this
        start does not load (an earlier start's) is timed at Wan 2.1's rate, VAEKindConfig's."""
        pipe = self.pipelines.get(job.group.build) if job.group else None
        return video_object(job, pipe.config.fps if pipe else VAEKindConfig.fps)

    def runnable(self) -> list[Waiting]:
        """The queued jobs as the scheduler sees them. A job this start cannot run fails instead
        of waiting forever: one of a build not loaded (queued by an earlier start), or one whose
        stored group does not read."""
        waiting = []
        for job in self.store.queued():
            if job.group is None:
                self.store.fail(
                    [job.id],
                    "unreadable_job",
                    "its stored batch group does not read: submit the video again",
                )
            elif job.group.build not in self.pipelines:
                self.store.fail(
                    [job.id], "unsupported_shape", f"build {job.group.build} is not served"
                )
            else:
                waiting.append(Waiting(job.id, job.group, job.created_at))
        return waiting

    def run(self) -> None:
        """The worker loop: the next batch (runtime.batching.next_batch), until the drain. A job
        store that fails is retried, never the end of the loop."""
        while True:
            self._stored(self.store.check)  # idle too: /healthz says when another holds its lock
            waiting = self._stored(self.runnable)
            if self._advance_slots(waiting):
                continue
            batch, wait = next_batch(
                [w for w in waiting if w.group.build not in self.slot_batches],
                lambda g: self.pipelines[g.build].key.batch,
                time.time(),
                self.batch_window,
            )
            with self._lock:
                if self.draining:
                    return
                if batch:
                    self.idle.clear()
            if not batch:
                self.wake.wait(min(wait, IDLE_POLL_S))
                self.wake.clear()
                continue
            try:
                self._run_batch([w.id for w in batch], batch[0].group)
            finally:
                self.idle.set()

    def drain(self) -> None:
        """Stop taking requests and batches; the batch in flight goes on (`idle` when done)."""
        with self._lock:
            self.draining = True
        self.wake.set()

    def _stored(self, call: Callable[[], T]) -> T:
        """`call`, a job-store operation the worker cannot skip, once the store takes it:
        retried with backoff while it fails, the server unhealthy meanwhile."""
        delay = RETRY_FIRST_S
        while True:
            try:
                result = call()
            except StoreError as e:
                self.store_problem = str(e)
            else:
                self.store_problem = None
                return result
            time.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)

    def _progress(self, ids: list[str], percent: int) -> None:
        """Progress is kept where the store takes it: while it fails, tried every RETRY_MAX_S
        (not each step: a lock wait would slow the batch down)."""
        if self.store_problem and time.monotonic() < self._progress_due:
            return
        try:
            self.store.progress(ids, percent)
        except StoreError as e:
            self.store_problem = str(e)
            self._progress_due = time.monotonic() + RETRY_MAX_S
        else:
            self.store_problem = None

    def _start(self, ids: list[str]) -> list[Job]:
        """The jobs `ids` started (those not cancelled since), a job whose request does not
        read failed instead."""
        started = self._stored(functools.partial(self.store.start, ids))
        damaged = [j.id for j in started if j.request is None]
        if damaged:
            why = "its stored request does not read: submit the video again"
            self._stored(functools.partial(self.store.fail, damaged, "unreadable_job", why))
        return [j for j in started if j.request is not None]

    def _fail(self, ids: list[str], code: str, why: str) -> None:
        self._stored(functools.partial(self.store.fail, ids, code, why))
        self.metrics.failed += len(ids)

    def _advance_slots(self, waiting: list[Waiting]) -> bool:
        """The continuous builds' turn (runtime.continuous): the queued videos of each join its
        free slots, oldest first (none while draining), then every occupied slot takes one
        step. Whether any slot held a video; the server is idle once none does."""
        with self._lock:
            joins = not self.draining
            if any(s.occupied for s in self.slot_batches.values()) or (
                joins and any(w.group.build in self.slot_batches for w in waiting)
            ):
                self.idle.clear()
        stepped = False
        for name, slots in self.slot_batches.items():
            queued = sorted(
                (w for w in waiting if w.group.build == name), key=lambda w: w.created_at
            )
            if joins and slots.free and queued:
                self._join(slots, self._start([w.id for w in queued[: len(slots.free)]]))
            if slots.occupied:
                self._step_slots(name, slots)
                stepped = True
        if not stepped:
            self.idle.set()
        return stepped

    def _join(self, slots: SlotBatch, jobs: list[Job]) -> None:
        videos = [(j.id, Video(j.request["prompt"], j.request["negative_prompt"], j.request["seed"]),
                   j.group.settings) for j in jobs]  # fmt: skip
        try:
            slots.join(videos)
        except Exception as e:  # any failure fails the joining videos, not the others
            self._fail([j.id for j in jobs], "generation_failed", str(e) or type(e).__name__)

    def _step_slots(self, name: str, slots: SlotBatch) -> None:
        pipe, m = self.pipelines[name], self.metrics
        start = time.perf_counter()
        occupied = slots.occupied
        try:
            left = slots.step()
        except Exception as e:  # the slots' arrays may be gone: every video in them fails
            self._fail(list(slots.progress()), "generation_failed", str(e) or type(e).__name__)
            self.slot_batches[name] = type(slots)(pipe)  # empty slots
            return
        m.step_seconds, m.steps = m.step_seconds + time.perf_counter() - start, m.steps + 1
        m.slot_steps += occupied
        m.empty_slot_steps += pipe.key.batch - occupied
        for job_id, (done, steps) in slots.progress().items():
            self._progress([job_id], 100 * done // steps)
        for video in left:
            if video.frames is None:
                self._fail([video.id], "generation_failed", video.error)
            else:
                self._write(video.id, video.frames, pipe.config.fps)

    def _write(self, job_id: str, video: np.ndarray, fps: int) -> None:
        """A video's MP4 (and frames, with --save-frames) written, its job completed."""
        npy = {self.store.frames_path(job_id): functools.partial(write_npy, array=video)}
        try:
            write_videos(
                [video], [self.store.video_path(job_id)], fps, npy if self.save_frames else None
            )
        except OSError as e:  # a WriteError naming the file
            self._fail([job_id], "write_failed", str(e))
            return
        self._stored(functools.partial(self.store.complete, job_id))
        self.metrics.completed += 1

    def _run_batch(self, ids: list[str], group: Group) -> None:
        pipe = self.pipelines[group.build]
        jobs = self._start(ids)
        if not jobs:
            return
        ids = [j.id for j in jobs]
        videos = [Video(j.request["prompt"], j.request["negative_prompt"], j.request["seed"])
                  for j in jobs]  # fmt: skip

        def on_step(done: int, total: int) -> None:
            self._progress(ids, 100 * done // total)

        try:
            frames, report = generate_batch(pipe, videos, group.settings, on_step, self.cache)
        except Exception as e:  # any failure fails this batch's videos, not the server
            self._fail(ids, "generation_failed", str(e) or type(e).__name__)
            return
        m = self.metrics
        m.batches += 1
        m.slots_filled, m.slots = m.slots_filled + len(ids), m.slots + pipe.key.batch
        m.step_seconds, m.steps = m.step_seconds + report.seconds_denoising, m.steps + report.steps
        for job_id, video in zip(ids, frames, strict=True):
            self._write(job_id, video, pipe.config.fps)

    def metrics_text(self) -> str:
        """The metrics in Prometheus' text format."""
        m, counts = self.metrics, self.store.counts()
        rows = [
            ("queue_depth", "gauge", "Videos queued, not started.", counts["queued"]),
            ("videos_in_progress", "gauge", "Videos in the batch in flight.", counts["in_progress"]),
            ("videos_completed_total", "counter", "Videos completed.", m.completed),
            ("videos_failed_total", "counter", "Videos failed.", m.failed),
            ("batches_total", "counter", "Batches run.", m.batches),
            ("batch_fill_ratio", "gauge", "Videos per batch slot, all batches.",
             m.slots_filled / m.slots if m.slots else 0.0),
            ("seconds_per_step", "gauge", "Mean seconds per denoising step.",
             m.step_seconds / m.steps if m.steps else 0.0),
            ("slot_steps_total", "counter", "Continuous builds: slots that held a video at a step.",
             m.slot_steps),
            ("empty_slot_steps_total", "counter",
             "Continuous builds: slots computed empty at a step (masked, discarded).",
             m.empty_slot_steps),
            ("compile_count", "counter", "Compilations since the builds loaded.",
             self.compile_count()),
        ]  # fmt: skip
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP wan_{name} {help_text}", f"# TYPE wan_{name} {kind}"]
            lines.append(
                f"wan_{name} {value:g}" if isinstance(value, float) else f"wan_{name} {value}"
            )
        return "\n".join(lines) + "\n"


def video_object(job: Job, fps: int) -> dict[str, Any]:
    """A job as the API's video object (`fps`: its model's frame rate); a request that does
    not read (the row damaged while serving) shows as nulls."""
    r = job.request or dict.fromkeys(REQUEST_FIELDS)
    return {
        "id": job.id,
        "object": "video",
        "model": job.group.build if job.group else None,
        "status": job.status,
        "progress": job.progress,
        "created_at": int(job.created_at),
        "completed_at": None if job.completed_at is None else int(job.completed_at),
        "size": r["size"],
        "frames": r["frames"],
        "seconds": None if r["frames"] is None else f"{r['frames'] / fps:g}",
        "prompt": r["prompt"],
        "seed": r["seed"],
        "steps": r["steps"],
        "error": job.error,
    }


def _error(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = ErrorBody(error=_ErrorDetail(code=code, message=message))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_message(e: RequestValidationError) -> str:
    """Pydantic's errors as one line: field: problem; ..."""
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"] if p != "body") or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _responses(*statuses: int, ok: dict[str, Any] | None = None) -> dict[int | str, Any]:
    """An operation's documented answers: its errors, those every operation may answer (a body
    too large or too slow, a bug), and `ok`, its 200 when that is not JSON."""
    answers: dict[int | str, Any] = {
        s: {"model": ErrorBody, "description": ERRORS[s]} for s in (*statuses, 408, 413, 500)
    }
    return answers | ({200: ok} if ok else {})


# Longer than most: the API's routes, read top to bottom as the API.
def make_app(service: Service, limits: HttpLimits) -> FastAPI:
    app = FastAPI(title="wan-aot runtime serve")
    store = service.store

    @app.exception_handler(ApiError)
    def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.code, e.message)

    @app.exception_handler(RequestValidationError)
    def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, "invalid_request", _validation_message(e))

    @app.exception_handler(HTTPException)
    def _http(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 405:  # Allow: every route's methods at this path, not the first's
            allowed = ", ".join(sorted(_methods_at(app, request.scope)))
            message = f"{request.method} is not served at {request.url.path}: use {allowed}"
            return _error(405, "method_not_allowed", message, {"Allow": allowed})
        code = "not_found" if e.status_code == 404 else "http_error"
        return _error(e.status_code, code, e.detail, e.headers)

    @app.exception_handler(StoreError)
    def _store_error(request: Request, e: StoreError) -> JSONResponse:
        service.store_problem = str(e)
        return _error(503, "store_unavailable", f"{e}; retry later")

    def get(path: str, **kwargs: Any) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """A GET route, and HEAD at the same path (the same answer without its body)."""

        def register(endpoint: Callable[..., T]) -> Callable[..., T]:
            app.head(path, include_in_schema=False, **kwargs)(endpoint)
            return app.get(path, **kwargs)(endpoint)

        return register

    def found(video_id: str) -> Job:
        job = store.get(video_id)
        if job is None:
            raise ApiError(404, "not_found", f"no video {video_id}")
        return job

    @app.post("/v1/videos", status_code=202, responses=_responses(400, 429, 503))
    def create(body: VideoRequest) -> dict[str, Any]:
        for name in ("prompt", "negative_prompt"):
            if len(getattr(body, name)) > limits.max_prompt_chars:
                raise ApiError(
                    400,
                    "invalid_request",
                    f"{name}: {len(getattr(body, name))} characters, over the server's "
                    f"{limits.max_prompt_chars} (--max-prompt-chars): shorten it",
                )
        return service.video_object(service.submit(body))

    @get("/v1/videos", responses=_responses(400, 503))
    def list_videos(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100, after: str | None = None
    ) -> dict[str, Any]:
        """Newest first; a page holds at most `limit` videos and about a MiB of them."""
        jobs, more = store.page(limit, after)
        data = [service.video_object(j) for j in jobs]
        return {"object": "list", "data": data, "has_more": more}

    @get("/v1/videos/{video_id}", responses=_responses(404, 503))
    def get_video(video_id: str) -> dict[str, Any]:
        return service.video_object(found(video_id))

    binary = {"schema": {"type": "string", "format": "binary"}}
    files = {"content": {"video/mp4": binary, "application/octet-stream": binary}}

    @get(
        "/v1/videos/{video_id}/content",
        response_class=FileResponse,
        responses=_responses(400, 404, 409, 410, 503, ok=files),
    )
    def content(video_id: str, variant: Literal["video", "frames"] = "video") -> FileResponse:
        """The MP4, or (`variant=frames`, a server run with --save-frames) the uint8 frames
        (F, H, W, 3) as .npy."""
        job = found(video_id)
        if job.status != "completed":
            raise ApiError(409, "not_ready", f"video {video_id} is {job.status}, not completed")
        if variant == "frames" and not store.frames_path(job.id).exists():
            raise ApiError(404, "not_found", "no frames kept: start the server with --save-frames")
        path = store.video_path(job.id) if variant == "video" else store.frames_path(job.id)
        if not path.is_file():
            raise ApiError(
                410, "gone", f"{path.name} is no longer in {store.videos}: submit the video again"
            )
        media = "video/mp4" if variant == "video" else "application/octet-stream"
        return FileResponse(path, media_type=media)

    @app.delete("/v1/videos/{video_id}", responses=_responses(404, 409, 503))
    def delete(video_id: str) -> dict[str, Any]:
        job = found(video_id)
        if not store.delete_queued(video_id):
            raise ApiError(
                409,
                "not_queued",
                f"video {video_id} is {job.status}: only a queued one is cancelled",
            )
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @get("/healthz", responses=_responses(503))
    def healthz() -> dict[str, Any]:
        """200 while serving; 503 while draining or while the job store is unusable."""
        if service.draining:
            raise ApiError(503, "shutting_down", "the server is shutting down")
        if service.store_problem:
            raise ApiError(503, "store_unavailable", service.store_problem)
        return {"status": "ok", "builds": sorted(service.pipelines)}

    text = {"content": {"text/plain": {"schema": {"type": "string"}}}}

    @get("/metrics", response_class=PlainTextResponse, responses=_responses(503, ok=text))
    def metrics() -> PlainTextResponse:
        """Prometheus' text format."""
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _document(FastAPI.openapi(app), service, limits)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(_BoundedBody, limit=limits.max_body_bytes, timeout=limits.body_timeout)
    app.add_middleware(_JsonErrors)  # the outermost: whatever raises below
    return app


def _methods_at(app: FastAPI, scope: Scope) -> set[str]:
    """The methods some route serves at the request's path (a 405's Allow)."""
    return {
        method
        for route in app.router.routes
        if route.matches(scope)[0] is not Match.NONE
        for method in getattr(route, "methods", None) or ()
    }


def _document(schema: dict[str, Any], service: Service, limits: HttpLimits) -> None:
    """What FastAPI's schema leaves out of what the server does: no 422 (a request that does
    not validate is 400, documented per operation), the prompts' limit, and the shapes the loaded
    builds make (a size, frames and CFG no build makes is 400)."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    components = schema["components"]["schemas"]
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for name in ("prompt", "negative_prompt"):
        components["VideoRequest"]["properties"][name]["maxLength"] = limits.max_prompt_chars
    routes = []
    for width, height, frames, cfg in sorted(service.shapes):
        guidance = {"exclusiveMinimum": CFG_ABOVE} if cfg else {"maximum": CFG_ABOVE}
        properties = {"size": {"const": f"{width}x{height}"}, "frames": {"const": frames},
                      "guidance": guidance}  # fmt: skip
        routes.append({"properties": properties} | ({} if cfg else {"required": ["guidance"]}))
    body = schema["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]
    body["schema"] = {"allOf": [body["schema"], {"anyOf": routes}]}


class _BoundedBody:
    """ASGI middleware: a request's body is read whole before the app sees it, at most `limit`
    bytes (413; a larger Content-Length is refused before a byte is read) within `timeout`
    seconds (408). Either answer closes the connection, whose unread body is dropped."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        close = {"Connection": "close"}
        too_large = _error(
            413,
            "body_too_large",
            f"the request body is over {self.limit} bytes (--max-body-bytes)",
            close,
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.limit:  # h11 checked its digits
            await too_large(scope, receive, send)
            return
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > self.limit:
                        await too_large(scope, receive, send)
                        return
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout:g} s (--body-timeout)"
            await _error(408, "body_timeout", message, close)(scope, receive, send)
            return
        whole: list[Message] = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)


class _JsonErrors:
    """ASGI middleware: an exception nothing else answered (a bug) is a JSON 500 and one line in
    the log, never a traceback."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:
            what = f"{type(e).__name__}: {e}"
            where = f"{scope.get('method', '')} {scope.get('path', '')}"
            logging.getLogger("uvicorn.error").error("internal error in %s: %s", where, what)
            if not started and scope["type"] == "http":
                await _error(500, "internal_error", what)(scope, receive, send)


class _HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on a request's head: a connection that has
    not sent one whole within `header_timeout` seconds of opening, or of its last answer, is
    closed (uvicorn alone waits forever; the body's deadline is _BoundedBody's)."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """A deadline runs while the next request's head is awaited (h11: they are IDLE)."""
        if self.conn.their_state is not h11.IDLE:
            self._stop()
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout, self.transport.close)

    def _stop(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


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
) -> None:
    """Serve until SIGTERM (drained) or SIGINT; the jobs of an unfinished batch stay queued."""
    worker = threading.Thread(target=service.run, name="generation", daemon=True)
    worker.start()
    config = uvicorn.Config(
        make_app(service, limits),
        log_level="warning",
        timeout_graceful_shutdown=5,
        lifespan="off",
        http=functools.partial(_HeaderDeadline, header_timeout=limits.header_timeout),
    )
    server = _DrainingServer(config, service, drain_timeout)
    host, port = sock.getsockname()[:2]
    log(f"serving {len(service.pipelines)} build(s) on http://{host}:{port}: {service.served()}")
    server.run(sockets=[sock])
    service.drain()
    finished = service.idle.wait(0)
    try:
        service.store.requeue_in_progress()
    except StoreError as e:  # recover() queues them at the next start all the same
        log(f"{e} (the videos in progress are queued again at the next start)")
    service.store.close()
    log("stopped" + ("" if finished else ": the batch in flight was not finished, it stays queued"))
    if not finished:  # the worker is inside a device call: leave without waiting for it
        sys.stderr.flush()
        os._exit(0)
