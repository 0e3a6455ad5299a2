"""`runtime serve`: a resident video-generation service over HTTP, in the shape of OpenAI's Videos
API. The builds are loaded once (runtime.cli_serve chooses them), the requests are queued in a
SQLite job store (runtime.job_store) and run in the compiled batches (runtime.batching) by one
worker thread that calls the same `Pipeline` as `runtime run`; this module is only the HTTP layer,
the worker loop and the drain on SIGTERM."""

from __future__ import annotations

import dataclasses
import functools
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
from typing import TYPE_CHECKING, Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from runtime.batching import Group, Settings, Video, Waiting, generate_batch, next_batch
from runtime.job_store import Job, JobStore, QueueFull
from runtime.loader import Route, describe_route, serving_routes
from runtime.outputs import write_npy, write_videos
from runtime.request import MAX_SCALE, check_text
from wan.configs import SAMPLERS, VAEKindConfig

if TYPE_CHECKING:  # jax: imported by runtime.cli_serve once the port is bound
    from runtime.pipeline import Pipeline
    from runtime.step_cache import CacheRequest

MAX_STEPS = 1000
MAX_SEED = 2**63 - 1
IDLE_POLL_S = 1.0  # the worker looks at the queue at least this often


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
        return width, height, self.frames, self.guidance > 1.0

    def settings(self) -> Settings:
        return Settings(self.steps, self.guidance, self.guidance_2, self.sampler, self.shift)


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
        self._lock = threading.Lock()  # draining vs. the start of a batch
        # The rule runtime.cli_serve loaded the builds by, which gives each route one build.
        self.shapes = serving_routes({name: pipe.key for name, pipe in pipelines.items()})

    def served(self) -> str:
        return ", ".join(
            f"{describe_route(r)} (batch {self.pipelines[name].key.batch})"
            for r, name in sorted(self.shapes.items())
        )

    def submit(self, body: VideoRequest) -> Job:
        if self.draining:
            raise ApiError(503, "shutting_down", "the server is shutting down: retry later")
        build = self.shapes.get(body.shape())
        if build is None:
            raise ApiError(
                400,
                "unsupported_shape",
                f"no loaded build makes size {body.size} with {body.frames} frames "
                f"{'with' if body.guidance > 1 else 'without'} CFG; served: {self.served()}",
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
        """The worker loop: the next batch (runtime.batching.next_batch), until the drain."""
        while True:
            batch, wait = next_batch(
                self.runnable(),
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

    def _run_batch(self, ids: list[str], group: Group) -> None:
        pipe = self.pipelines[group.build]
        requests = [self.store.get(i).request for i in ids]
        self.store.start(ids)
        videos = [Video(r["prompt"], r["negative_prompt"], r["seed"]) for r in requests]

        def on_step(done: int, total: int) -> None:
            self.store.progress(ids, 100 * done // total)

        try:
            frames, report = generate_batch(pipe, videos, group.settings, on_step, self.cache)
        except Exception as e:  # any failure fails this batch's videos, not the server
            self.store.fail(ids, "generation_failed", str(e) or type(e).__name__)
            self.metrics.failed += len(ids)
            return
        m = self.metrics
        m.batches += 1
        m.slots_filled, m.slots = m.slots_filled + len(ids), m.slots + pipe.key.batch
        m.step_seconds, m.steps = m.step_seconds + report.seconds_denoising, m.steps + report.steps
        for job_id, video in zip(ids, frames, strict=True):
            paths = [self.store.video_path(job_id)]
            npy = {self.store.frames_path(job_id): functools.partial(write_npy, array=video)}
            try:
                write_videos([video], paths, pipe.config.fps, npy if self.save_frames else None)
            except OSError as e:  # a WriteError naming the file
                self.store.fail([job_id], "write_failed", str(e))
                m.failed += 1
                continue
            self.store.complete(job_id)
            m.completed += 1

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
    """A job as the API's video object (`fps`: its model's frame rate)."""
    r = job.request
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
        "seconds": f"{r['frames'] / fps:g}",
        "prompt": r["prompt"],
        "seed": r["seed"],
        "steps": r["steps"],
        "error": job.error,
    }


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def _validation_message(e: RequestValidationError) -> str:
    """Pydantic's errors as one line: field: problem; ..."""
    parts = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"] if p != "body") or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


# Longer than most: the API's routes, read top to bottom as the API.
def make_app(service: Service) -> FastAPI:
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
        return _error(
            e.status_code, "not_found" if e.status_code == 404 else "http_error", e.detail
        )

    def found(video_id: str) -> Job:
        job = store.get(video_id)
        if job is None:
            raise ApiError(404, "not_found", f"no video {video_id}")
        return job

    @app.post("/v1/videos", status_code=202)
    def create(body: VideoRequest) -> dict[str, Any]:
        return service.video_object(service.submit(body))

    @app.get("/v1/videos")
    def list_videos(limit: int = 100, after: str | None = None) -> dict[str, Any]:
        limit = min(max(limit, 1), 1000)
        jobs = store.jobs(limit + 1, after)
        data = [service.video_object(j) for j in jobs[:limit]]
        return {"object": "list", "data": data, "has_more": len(jobs) > limit}

    @app.get("/v1/videos/{video_id}")
    def get_video(video_id: str) -> dict[str, Any]:
        return service.video_object(found(video_id))

    @app.get("/v1/videos/{video_id}/content")
    def content(video_id: str, variant: Literal["video", "frames"] = "video") -> FileResponse:
        """The MP4, or (`variant=frames`, a server run with --save-frames) the uint8 frames
        (F, H, W, 3) as .npy."""
        job = found(video_id)
        if job.status != "completed":
            raise ApiError(409, "not_ready", f"video {video_id} is {job.status}, not completed")
        if variant == "video":
            return FileResponse(store.video_path(job.id), media_type="video/mp4")
        if not store.frames_path(job.id).exists():
            raise ApiError(404, "not_found", "no frames kept: start the server with --save-frames")
        return FileResponse(store.frames_path(job.id), media_type="application/octet-stream")

    @app.delete("/v1/videos/{video_id}")
    def delete(video_id: str) -> dict[str, Any]:
        job = found(video_id)
        if not store.delete_queued(video_id):
            raise ApiError(
                409,
                "not_queued",
                f"video {video_id} is {job.status}: only a queued one is cancelled",
            )
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        if service.draining:
            raise ApiError(503, "shutting_down", "the server is shutting down")
        return {"status": "ok", "builds": sorted(service.pipelines)}

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4")

    return app


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
    service: Service, sock: socket.socket, drain_timeout: float, log: Callable[[str], None]
) -> None:
    """Serve until SIGTERM (drained) or SIGINT; the jobs of an unfinished batch stay queued."""
    worker = threading.Thread(target=service.run, name="generation", daemon=True)
    worker.start()
    config = uvicorn.Config(
        make_app(service), log_level="warning", timeout_graceful_shutdown=5, lifespan="off"
    )
    server = _DrainingServer(config, service, drain_timeout)
    host, port = sock.getsockname()[:2]
    log(f"serving {len(service.pipelines)} build(s) on http://{host}:{port}: {service.served()}")
    server.run(sockets=[sock])
    service.drain()
    finished = service.idle.wait(0)
    service.store.requeue_in_progress()
    service.store.close()
    log("stopped" + ("" if finished else ": the batch in flight was not finished, it stays queued"))
    if not finished:  # the worker is inside a device call: leave without waiting for it
        sys.stderr.flush()
        os._exit(0)
