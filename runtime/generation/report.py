"""What one generation reports (`runtime run --report`, the server's metrics): its phases'
seconds, each step's, the compilations (none), what step caching and sparse attention did, and
where the weights were kept against the memory the build predicted."""

from __future__ import annotations

import dataclasses

from runtime.generation.step_cache import CacheOutcome
from wan import lora


@dataclasses.dataclass
class GenerationReport:
    compile_count: int
    started_at: float  # epoch seconds when generation began
    seconds_to_first_step: float  # from generate(): prompt encoding and KV caches done
    seconds_denoising: float
    seconds_total: float
    steps: int
    steps_per_second: float
    build: str
    # From the OS's start of this process: what a user of a fresh process waits for.
    seconds_from_process_start_to_first_step: float
    seconds_from_process_start_to_video: float  # frames on the host (`runtime run`: files written)
    # Seconds per phase: deserialize, weights (Pipeline.load), text_encode, kv_cache, denoise,
    # vae_decode; `runtime run` adds imports (process start to loading) and write.
    phases: dict[str, float]
    sampler: str  # the sampler and flow shift the step tables were made for
    shift: float
    loras: list[lora.AppliedLora]  # merged into the weights at load
    cache: CacheOutcome  # step caching: what it skipped (`cache` None: off)
    # A --sparse-attention build's settings and the steps that ran dense (the others: its
    # sparse step); None: every step dense.
    sparse_attention: SparseOutcome | None = None
    memory: MemoryOutcome | None = None
    step_seconds: list[float] = dataclasses.field(default_factory=list)  # each step, in order


@dataclasses.dataclass
class MemoryOutcome:
    """Where the weights were kept, the peak the build predicts for that, and what the first
    local device reports (None where it reports nothing: CPU): bytes per device."""

    placement: dict[str, str]
    predicted_peak_bytes: int
    predicted_at: str  # the program where the prediction peaks
    device_peak_bytes: int | None  # the process's peak so far (`memory_stats`)
    device_limit_bytes: int | None


@dataclasses.dataclass
class SparseOutcome:
    settings: str  # wan.sparse_attention's spelling, e.g. radial:0.2:12:1:128
    dense_steps: list[int]
