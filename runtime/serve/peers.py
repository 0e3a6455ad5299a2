"""A multi-process build served (one `runtime serve` per host of a slice, `cpu-PxN` here): process
0 answers HTTP and owns the job store; each batch it starts goes to the other processes through
the jax.distributed job's key-value store (the coordination service process 0 already runs: no
socket protocol of ours), and every process runs it SPMD; process 0 writes the files.

Every process beats a counter in the same store; each watches the others'. A process that stops
beating (killed, its host lost) ends process 0 within PEER_TIMEOUT_S with one line, before jax's
own heartbeat check (100 s) would abort it: process 0 first puts the jobs it holds back in the
queue, so a restart of the whole job on the same store runs them. When process 0 goes, the
store goes with it: jax's coordination client ends the other processes at once, with its own
line ("the JAX distributed service detected fatal errors"), or this module's watch does if it
notices first; they have nothing to keep."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from runtime.generation import Settings, Video, generate_batch

if TYPE_CHECKING:
    from runtime.generation import CacheRequest, Pipeline

BEAT_S = 1.0  # each process's heartbeat
PEER_TIMEOUT_S = 10.0  # a peer silent this long is lost (jax's own check: 100 s, then abort)
RECEIVE_POLL_MS = 1000  # a follower's wait for the next batch before it looks at its peers
EXIT_PEER_LOST = 3  # the exit status of a process whose job lost a process
_PREFIX = "wan_serve"


def _client() -> Any:
    """The jax.distributed job's coordination client (its key-value store), which
    runtime.builds.processes.join started."""
    from jax._src import distributed  # jax exposes no public handle to the job's store

    return distributed.global_state.client


class JobChannel:
    """Batches from process 0 to the others, and every process's heartbeat, over the job's
    key-value store. `on_lost(line)` is called once, from the watch thread, when a peer is lost;
    it must end the process."""

    def __init__(self, process_id: int, num_processes: int, on_lost: Callable[[str], None]):
        self.process_id, self.num_processes = process_id, num_processes
        self._client = _client()
        self._on_lost = on_lost
        self._sent = self._received = 0  # batches published / taken
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (its last beat, when it changed)
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="peers", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        """Stop beating and watching, before the process exits: a daemon thread still inside
        the store's C++ client when Python finalizes aborts the process ("terminate called",
        SIGABRT) instead of letting it exit 0."""
        self._closed.set()
        self._watcher.join(timeout=5 * BEAT_S)

    def publish(self, message: dict[str, Any]) -> None:
        """Process 0: the next message for every other process (they take them in order)."""
        self._client.key_value_set(f"{_PREFIX}/batch/{self._sent}", json.dumps(message))
        if self._sent >= 2:  # every peer ran batch n-2 before batch n-1 could end
            self._client.key_value_delete(f"{_PREFIX}/batch/{self._sent - 2}")
        self._sent += 1

    def receive(self) -> dict[str, Any]:
        """Another process: process 0's next message, waited for as long as it takes."""
        key = f"{_PREFIX}/batch/{self._received}"
        while True:
            try:
                text = self._client.blocking_key_value_get(key, RECEIVE_POLL_MS)
            except Exception as e:  # noqa: BLE001 - jax raises its runtime's error types
                if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                    continue  # nothing yet: the watch thread tells a lost job from an idle one
                exit_now(f"process 0 (the job's coordinator) stopped answering ({_first_line(e)})")
            self._received += 1
            return json.loads(text)

    def wait_out(self) -> None:
        """After a batch failed: one peer timeout, so that a failure caused by a lost process
        (a collective whose peer is gone) ends the job through `on_lost`, with the jobs queued
        again, rather than failing its videos. Returns if every peer kept beating."""
        time.sleep(PEER_TIMEOUT_S + 2 * BEAT_S)

    def _watch(self) -> None:
        beat = 0
        while not self._closed.is_set():
            try:
                self._client.key_value_set(
                    f"{_PREFIX}/alive/{self.process_id}", str(beat), allow_overwrite=True
                )
                lost = self._silent_peers()
            except Exception as e:  # noqa: BLE001 - the store itself is gone: process 0 is
                lost = f"process 0 (the job's coordinator) stopped answering ({_first_line(e)})"
            if lost and not self._closed.is_set():
                self._on_lost(lost)
                return
            beat += 1
            self._closed.wait(BEAT_S)

    def _silent_peers(self) -> str | None:
        now = time.monotonic()
        silent = []
        for peer in range(self.num_processes):
            if peer == self.process_id:
                continue
            try:
                value = self._client.key_value_try_get(f"{_PREFIX}/alive/{peer}")
            except Exception as e:  # noqa: BLE001 - not yet written: counted from now
                if "NOT_FOUND" not in str(e):
                    raise
                value = ""
            last, since = self._seen.get(peer, (None, now))
            if value != last:
                self._seen[peer] = (value, now)
            elif now - since > PEER_TIMEOUT_S:
                silent.append(peer)
        if not silent:
            return None
        return (
            f"process(es) {silent} of the {self.num_processes}-process job stopped beating for "
            f"{PEER_TIMEOUT_S:g} s (killed, or its host lost)"
        )


def batch_message(build: str, videos: list[Video], settings: Settings) -> dict[str, Any]:
    """What the other processes need to run a batch as process 0 does: its build, the videos'
    prompts, seeds and images (the files' bytes), and the settings."""
    return {
        "build": build,
        "settings": dataclasses.asdict(settings),
        "videos": [
            {"prompt": v.prompt, "negative_prompt": v.negative_prompt, "seed": v.seed,
             "image": None if v.image is None else base64.b64encode(v.image.read_bytes()).decode()}
            for v in videos
        ],
    }  # fmt: skip


def follow(channel: JobChannel, pipelines: dict[str, Pipeline], cache: CacheRequest | None) -> None:
    """Another process's loop: run each batch process 0 publishes, SPMD, until it says stop. Its
    frames are process 0's to write: this process keeps nothing."""
    with tempfile.TemporaryDirectory(prefix="wan-peer-") as scratch:
        while True:
            message = channel.receive()
            if "stop" in message:
                channel.close()
                return
            videos = []
            for i, v in enumerate(message["videos"]):
                image = None
                if v["image"] is not None:
                    image = Path(scratch) / f"image_{i}"
                    image.write_bytes(base64.b64decode(v["image"]))
                videos.append(Video(v["prompt"], v["negative_prompt"], v["seed"], image))
            settings = Settings(**message["settings"])
            try:
                generate_batch(pipelines[message["build"]], videos, settings, None, cache)
            except Exception as e:  # noqa: BLE001 - process 0 fails the batch's videos alike
                print(f"process {channel.process_id}: the batch failed: {e}", file=sys.stderr)


def exit_now(line: str) -> NoReturn:
    """The line, then the process ends at once: a thread may be inside a collective whose peer
    is gone, which nothing can interrupt."""
    print(f"Error: {line}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


def _first_line(e: Exception) -> str:
    return " ".join(str(e).split("\n")[0].split())[:200]
