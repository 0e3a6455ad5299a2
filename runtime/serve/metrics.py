"""`runtime serve`'s /metrics in Prometheus' text format, through prometheus_client: one registry
per service (no process-wide state), the latency histograms observed by the worker, and a
collector that reads the rest from the service and its job store at each scrape (the queue and
the videos by status are the whole store's, a fleet's shared queue). No HTTP here
(runtime.serve.server) and no worker (runtime.serve.service)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from runtime.serve.service import Service

# A step takes milliseconds (a tiny build on a CPU) to tens of seconds (a 14B step at 720p on
# a small slice); a video, from its request to its MP4, a second to an hour in a long queue.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
VIDEO_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)


class ServiceMetrics:
    """What /metrics exports of `service`: its histograms, observed as the worker runs, and its
    counts and gauges, read at each scrape (`text`)."""

    def __init__(self, service: Service):
        self.registry = CollectorRegistry(auto_describe=False)
        self.step_seconds = Histogram(
            "wan_step_seconds",
            "Seconds of one denoising step of a batch (every video of it), or of a continuous "
            "build's slots, by build.",
            ["build"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.video_seconds = Histogram(
            "wan_video_seconds",
            "Seconds from a video's request to its completion (queue, steps, decode, files), by "
            "build.",
            ["build"],
            buckets=VIDEO_BUCKETS,
            registry=self.registry,
        )
        for build in service.pipelines:  # every build's series from the start, at 0
            self.step_seconds.labels(build)
            self.video_seconds.labels(build)
        self.registry.register(_Counts(service))

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class _Counts(Collector):
    """The service's counts since this process started and the store's at the scrape."""

    def __init__(self, service: Service):
        self.service = service

    # Longer than most: every family /metrics gives, in the order it lists them.
    def collect(self) -> Iterator[Metric]:
        s = self.service
        m, counts = s.metrics, s.store.counts()
        info = GaugeMetricFamily(
            "wan_replica_info",
            "This server: its --replica name and its job store.",
            labels=["replica", "store"],
        )
        info.add_metric([s.store.replica, s.store.where], 1)
        yield info
        yield GaugeMetricFamily(
            "wan_queue_depth",
            "Videos queued, not started, in the whole store (a fleet's shared queue).",
            counts["queued"],
        )
        yield GaugeMetricFamily(
            "wan_videos_in_progress",
            "Videos in progress in the whole store (every replica's batches).",
            counts["in_progress"],
        )
        videos = GaugeMetricFamily(
            "wan_videos", "Videos in the whole store by status.", labels=["status"]
        )
        for status, n in counts.items():
            videos.add_metric([status], n)
        yield videos
        counters = {
            "videos_completed": ("Videos completed here.", m.completed),
            "videos_failed": ("Videos failed here.", m.failed),
            "batches": ("Batches run.", m.batches),
            "slot_steps": ("Continuous builds: slots that held a video at a step.", m.slot_steps),
            "empty_slot_steps": (
                "Continuous builds: slots computed empty at a step (masked, discarded).",
                m.empty_slot_steps,
            ),
            "leases_expired": (
                "Jobs whose lease ran out, queued again by this replica.",
                m.requeued,
            ),
            "claims_lost": (
                "Videos this replica finished after its lease ran out (completed by another "
                "claim).",
                m.claims_lost,
            ),
            "store_errors": (
                "Job-store operations that failed (each retried or answered 503).",
                m.store_errors,
            ),
        }
        for name, (help_text, value) in counters.items():
            yield CounterMetricFamily(f"wan_{name}", help_text, value)
        yield GaugeMetricFamily(
            "wan_batch_fill_ratio",
            "Videos per batch slot, all batches.",
            m.slots_filled / m.slots if m.slots else 0.0,
        )
        yield GaugeMetricFamily(
            "wan_seconds_per_step",
            "Mean seconds per denoising step (wan_step_seconds: their histogram).",
            m.step_seconds / m.steps if m.steps else 0.0,
        )
        # A gauge by its old name: the compiles jax counted since the builds loaded (0 while
        # serving, which is the point).
        yield GaugeMetricFamily(
            "wan_compile_count", "Compilations since the builds loaded.", s.compile_count()
        )
        occupied = GaugeMetricFamily(
            "wan_slots_occupied", "Continuous builds: slots holding a video.", labels=["build"]
        )
        slots = GaugeMetricFamily("wan_slots", "Continuous builds: their slots.", labels=["build"])
        for name, batch in s.slot_batches.items():
            occupied.add_metric([name], batch.occupied)
            slots.add_metric([name], s.pipelines[name].key.batch)
        yield occupied
        yield slots
