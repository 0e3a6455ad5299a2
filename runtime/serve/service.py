"""`runtime serve`'s worker: the loaded pipelines, the job store, and the one thread that takes
the next batch from the store, runs it through the same `Pipeline` as `runtime run`
(runtime.generation.batching.generate_batch) and writes each video with its previews before marking it
completed. A job store that fails is retried, never the end of the loop. No HTTP here
(runtime.serve.server)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from runtime.builds.loader import route, serving_routes
from runtime.generation import (
    Group,
    Video,
    Waiting,
    generate_batch,
    next_batch,
    previews,
    write_npy,
    write_videos,
)
from runtime.serve.job_store import Job, JobStore, QueueFull, StoreError
from runtime.serve.metrics import ServiceMetrics
from runtime.serve.openai_dialect import (
    ApiError,
    ServedBuild,
    VideoRequest,
    check_image,
    describe_kinds,
    resolve,
    video_object,
)
from runtime.serve.peers import JobChannel, batch_message, exit_now
from wan.component_configs import VAEKindConfig

if TYPE_CHECKING:  # jax: imported by runtime.cli.serve once the port is bound
    import numpy as np

    from runtime.generation import CacheRequest, Pipeline, SlotBatch

IDLE_POLL_S = 1.0  # the worker looks at the queue at least this often
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 2.0  # the worker's backoff while the job store fails
T = TypeVar("T")
_LOG = logging.getLogger("uvicorn.error")  # beside uvicorn's own lines, on stderr


def _one_line(e: Exception) -> str:
    """An exception as one short line: its type and message."""
    return " ".join(f"{type(e).__name__}: {e}".split())[:500]


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
    requeued: int = 0  # jobs whose lease ran out, queued again by this replica
    claims_lost: int = 0  # videos finished here after the lease ran out (another claim's now)
    store_errors: int = 0  # job-store operations that failed (retried, or answered 503)


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
        self.exported = ServiceMetrics(self)  # /metrics: these counts and the latencies
        self.wake = threading.Event()  # a request arrived, or the drain began
        self.idle = threading.Event()  # no batch in flight
        self.idle.set()
        self.draining = False
        # Why the job store is unusable, while it is (the last attempt failed): /healthz 503.
        self.store_problem: str | None = None
        # Why the worker's last turn failed (a bug), while it does; and the worker's thread.
        self.worker_problem: str | None = None
        self.worker: threading.Thread | None = None
        self._probe_lock, self._probe_due = threading.Lock(), 0.0  # health's store probe
        # A multi-process build's other processes (runtime.serve.peers), which run each batch too.
        self.peers: JobChannel | None = None
        self._progress_due = 0.0  # while the store fails, progress is tried again from then
        self._lock = threading.Lock()  # draining vs. the start of a batch
        # The rule runtime.cli.serve loaded the builds by, which gives each route one build.
        self.shapes = serving_routes({name: pipe.key for name, pipe in pipelines.items()})
        self.builds = {
            name: ServedBuild(name, p.key.model, p.config.fps, route(p.key), p.key.batch)
            for name, p in pipelines.items()
        }
        self.started = int(time.time())  # the served models' `created`
        # The continuous builds' slots, which the worker steps between other batches (jax, as
        # the pipelines: runtime.cli.serve makes the service once the port is bound).
        from runtime.generation import SlotBatch

        self.slot_batches = {
            name: SlotBatch(pipe)
            for name, pipe in pipelines.items()
            if pipe.key.option("continuous")
        }

    def served(self) -> str:
        return describe_kinds(self.builds.values())

    def models(self) -> list[str]:
        """The served models (the builds' BuildKey.model), the API's `model`."""
        return sorted({b.model for b in self.builds.values()})

    def submit(self, body: VideoRequest, image: bytes | None = None) -> Job:
        """A new queued job for `body` (and `image`, its input_reference file: image to video),
        placed on the build that serves it."""
        if self.draining:
            raise ApiError(503, "shutting_down", "the server is shutting down: retry later")
        if self.store_problem:  # answered now, not after a lock wait: the worker retries it
            raise ApiError(503, "store_unavailable", f"{self.store_problem}; retry later")
        placed = resolve(body, self.builds, self.shapes, image is not None)
        if image is not None:
            check_image(image, placed.size)
        request = body.model_dump(exclude={"seconds"})
        request |= {"model": placed.model, "frames": placed.frames, "size": placed.size}
        if request["seed"] is None:
            request["seed"] = secrets.randbelow(2**31)
        # A build makes videos with an image or without (its route says which): jobs with and
        # without one never share a batch, whose group names the build.
        group = Group(placed.build, body.settings())
        try:
            job = self.store.add(group, request, self.max_queue, image)
        except QueueFull as e:
            raise ApiError(429, "queue_full", str(e)) from None
        self.wake.set()
        return job

    def video_object(self, job: Job) -> dict[str, Any]:
        """The job as the API's video object, at its build's frame rate; a job of a build this
        start does not load (an earlier start's) is timed at Wan 2.1's rate, VAEKindConfig's."""
        build = self.builds.get(job.group.build) if job.group else None
        return video_object(job, build.fps if build else VAEKindConfig.fps,
                            build.model if build else None)  # fmt: skip

    def runnable(self) -> list[Waiting]:
        """The queued jobs as the scheduler sees them, once a shared store's jobs whose lease ran
        out are queued again. A shared store's jobs of builds this replica does not load wait for one
        that does; otherwise a job this start cannot run fails instead of waiting forever: one
        of a build not loaded (queued by an earlier start), or one whose row does not read
        (runtime.serve.job_store.Job.damage)."""
        if self.store.shared:  # a lapsed lease: its replica is gone (one server renews its own)
            self.metrics.requeued += self.store.expire()
        waiting = []
        served = sorted(self.pipelines) if self.store.shared else None
        for job in self.store.queued(served):
            if job.damage:  # a row that does not read: that job fails, reported in its error
                self.store.fail_unreadable(job)
            elif job.group.build not in self.pipelines:
                self.store.fail(
                    [job.id], "unsupported_shape", f"build {job.group.build} is not served"
                )
            else:
                waiting.append(Waiting(job.id, job.group, job.created_at))
        return waiting

    def start_worker(self) -> threading.Thread:
        """The worker (`run`) in its thread, which /healthz watches."""
        self.worker = threading.Thread(target=self.run, name="generation", daemon=True)
        self.worker.start()
        return self.worker

    def run(self) -> None:
        """The worker loop: the next batch (runtime.generation.batching.next_batch), until the drain. A job
        store that fails is retried, an exception of a batch fails that batch's videos, and any
        other exception (a bug) is logged and its turn tried again with backoff, /healthz 503
        meanwhile: none is the end of the loop."""
        delay = RETRY_FIRST_S
        while True:
            try:
                if self._turn():
                    return
            except Exception as e:
                self.worker_problem = f"the generation worker failed ({_one_line(e)}): retrying"
                _LOG.error("%s", self.worker_problem)
                time.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
            else:
                self.worker_problem, delay = None, RETRY_FIRST_S

    def _turn(self) -> bool:
        """One look at the queue: a batch run, slots stepped or a wait; True once drained."""
        self._stored(self.store.check)  # idle too: /healthz says when another holds its lock
        waiting = self._stored(self.runnable)
        if self._advance_slots(waiting):
            return False
        batch, wait = next_batch(
            [w for w in waiting if w.group.build not in self.slot_batches],
            lambda g: self.pipelines[g.build].key.batch,
            time.time(),
            self.batch_window,
        )
        with self._lock:
            if self.draining:
                if self.peers:  # the other processes end with this one
                    self.peers.publish({"stop": "drained"})
                return True
            if batch:
                self.idle.clear()
        if not batch:
            self.wake.wait(min(wait, IDLE_POLL_S))
            self.wake.clear()
            return False
        ids = [w.id for w in batch]
        try:
            self._run_batch(ids, batch[0].group)
        except Exception as e:  # a bug in one batch fails its videos, not the worker
            _LOG.error("a batch failed: %s", _one_line(e))
            self._fail(ids, "internal_error", f"the server failed: {_one_line(e)}")
        finally:
            self.idle.set()
        return False

    def health(self) -> tuple[str, str] | None:
        """Why the server cannot take videos now, as an error code and a line, or None:
        draining; the worker stopped or failing; the job store unusable (the last operation on
        it failed, or a probe of it now does: at most one a second, each bounded by
        --store-timeout, so a store that hangs while a batch runs shows too)."""
        if self.draining:
            return "shutting_down", "the server is shutting down"
        if self.worker is not None and not self.worker.is_alive():
            return "worker_stopped", "the generation worker stopped: restart the server"
        if self.worker_problem:
            return "worker_failing", self.worker_problem
        if self.store_problem is None:
            self._probe()
        if self.store_problem:
            return "store_unavailable", self.store_problem
        return None

    def _probe(self) -> None:
        now = time.monotonic()
        with self._probe_lock:
            if now < self._probe_due:
                return
            self._probe_due = now + IDLE_POLL_S
        try:
            self.store.check()
        except StoreError as e:  # cleared by the worker's next operation that succeeds
            self.store_problem = str(e)

    def renew_leases(self, stop: threading.Event) -> None:
        """Until `stop`: the leases of the jobs this replica runs renewed every third of the
        lease, so that a replica that dies loses them within one lease."""
        while not stop.wait(self.store.lease / 3):
            try:
                self.store.renew()
            except StoreError as e:
                self.store_problem = str(e)
                self.metrics.store_errors += 1

    def lose_job(self, why: str) -> None:
        """A process of this multi-process job is lost (runtime.serve.peers): the batch in flight can
        never end, so the jobs this server holds go back to the queue and the process ends with
        the line (a restart of every process on the same store runs them)."""
        try:
            self.store.requeue_in_progress()
            kept = "the videos in progress are queued again"
        except StoreError:
            kept = "the videos in progress are queued again at the next start"
        exit_now(f"{why}: {kept}; restart every process of the job")

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
                self.metrics.store_errors += 1
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
            self.metrics.store_errors += 1
            self._progress_due = time.monotonic() + RETRY_MAX_S
        else:
            self.store_problem = None

    def _start(self, ids: list[str]) -> list[Job]:
        """The jobs `ids` started (those not cancelled since), a job whose row does not read
        (damaged since it was queued) failed instead."""
        started = self._stored(functools.partial(self.store.start, ids))
        for job in started:
            if job.damage:
                fail = functools.partial(self.store.fail, [job.id], "unreadable_job")
                self._stored(functools.partial(fail, job.unreadable))
        return [j for j in started if not j.damage]

    def _fail(self, ids: list[str], code: str, why: str) -> None:
        self._stored(functools.partial(self.store.fail, ids, code, why))
        self.metrics.failed += len(ids)

    def _run_batch(self, ids: list[str], group: Group) -> None:
        pipe = self.pipelines[group.build]
        jobs = self._start(ids)
        if not jobs:
            return
        ids = [j.id for j in jobs]
        videos = [Video(j.request["prompt"], j.request["negative_prompt"], j.request["seed"],
                        self.store.image_of(j)) for j in jobs]  # fmt: skip

        step_seconds = self.exported.step_seconds.labels(group.build)
        step_started = time.perf_counter()

        def on_step(done: int, total: int) -> None:
            nonlocal step_started
            if done > 1:  # the first step's time holds the prompts' encoding
                step_seconds.observe(time.perf_counter() - step_started)
            self._progress(ids, 100 * done // total)
            step_started = time.perf_counter()  # the store's write is not the step's

        if self.peers:  # the other processes run the same batch with this one
            self.peers.publish(batch_message(group.build, videos, group.settings))
        try:
            frames, report = generate_batch(pipe, videos, group.settings, on_step, self.cache)
        except Exception as e:  # any failure fails this batch's videos, not the server
            if self.peers:  # unless a lost process caused it: that ends the job (lose_job)
                self.peers.wait_out()
            self._fail(ids, "generation_failed", str(e) or type(e).__name__)
            return
        m = self.metrics
        m.batches += 1
        m.slots_filled, m.slots = m.slots_filled + len(ids), m.slots + pipe.key.batch
        m.step_seconds, m.steps = m.step_seconds + report.seconds_denoising, m.steps + report.steps
        for job_id, video in zip(ids, frames, strict=True):
            self._write(job_id, video, group.build)

    def _advance_slots(self, waiting: list[Waiting]) -> bool:
        """The continuous builds' turn (runtime.generation.continuous): the queued videos of each join its
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
        seconds = time.perf_counter() - start
        self.exported.step_seconds.labels(name).observe(seconds)
        m.step_seconds, m.steps = m.step_seconds + seconds, m.steps + 1
        m.slot_steps += occupied
        m.empty_slot_steps += pipe.key.batch - occupied
        for job_id, (done, steps) in slots.progress().items():
            self._progress([job_id], 100 * done // steps)
        for video in left:
            if video.frames is None:
                self._fail([video.id], "generation_failed", video.error)
            else:
                self._write(video.id, video.frames, name)

    def _write(self, job_id: str, video: np.ndarray, build: str) -> None:
        """A video of `build` written, its MP4 with its previews (and frames, with
        --save-frames), then its job completed."""
        path = functools.partial(self.store.content_path, job_id)
        extra = previews(video, path("thumbnail"), path("spritesheet"))
        if self.save_frames:
            extra[path("frames")] = functools.partial(write_npy, array=video)
        try:
            write_videos([video], [path("video")], self.pipelines[build].config.fps, extra)
        except OSError as e:  # a WriteError naming the file
            self._fail([job_id], "write_failed", str(e))
            return
        if self._stored(functools.partial(self.store.complete, job_id)):
            self.metrics.completed += 1
            done = self._stored(functools.partial(self.store.get, job_id))
            if done is not None and done.completed_at is not None:
                self.exported.video_seconds.labels(build).observe(
                    done.completed_at - done.created_at
                )
        else:  # the files are the same video as the other claim's: same request, same seed
            self.metrics.claims_lost += 1

    def metrics_text(self) -> str:
        """The metrics in Prometheus' text format (runtime.serve.metrics)."""
        return self.exported.text()
