"""`runtime serve` under load, side by side: one fixed Poisson arrival trace of N requests sent to
a server of a batch-1 build and to one of a batch-4 build of the same shape, alternating
(b1, b4, b1, b4, ...: machine noise hits both alike). Per server: videos per minute (N over the
span from the first request to the last video), p50/p95 latency (request to completed, polled
every 0.1 s), batch fill (/metrics), and seconds from the server's process start to its first
video; beside them, N `runtime run` processes of the same requests one after another on the
batch-1 build (seconds to the first video and to all N).

    python bench/serve_load.py --model small --res 64x96 --frames 5 --steps 4 --n 8 --rate 0.5
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from record import save

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POLL_S = 0.1


def call(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as answer:
        text = answer.read().decode()
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trace(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival seconds of n requests, Poisson at `rate` a second, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1 / rate, n - 1)
    return [0.0, *np.cumsum(gaps).round(3).tolist()]


def body(i: int, args: argparse.Namespace) -> dict:
    return {"prompt": f"a red fox number {i} running in the snow", "size": args.res,
            "frames": args.frames, "steps": args.steps, "seed": i}  # fmt: skip


def serve_trace(artifacts: Path, weights: Path, build: str, out: Path, arrivals, args) -> dict:
    """Start a server of `build`, send the trace, wait for every video; its figures."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.time()
    server = subprocess.Popen(
        [str(BIN / "runtime"), "serve", "--artifacts", str(artifacts), "--weights", str(weights),
         "--build", build, "--port", str(port), "--out-dir", str(out),
         "--batch-window", str(args.batch_window)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while True:
            with contextlib.suppress(OSError):
                if call(f"{url}/healthz")["status"] == "ok":
                    break
            if server.poll() is not None:
                raise SystemExit(f"runtime serve exited with {server.returncode}")
            time.sleep(POLL_S)
        t0 = time.time()

        def one(i: int) -> tuple[float, float]:
            time.sleep(max(t0 + arrivals[i] - time.time(), 0))
            sent = time.time()
            video = call(f"{url}/v1/videos", body(i, args))
            while video["status"] not in ("completed", "failed"):
                time.sleep(POLL_S)
                video = call(f"{url}/v1/videos/{video['id']}")
            if video["status"] == "failed":
                raise SystemExit(f"a video failed: {video['error']}")
            return sent, time.time()

        with concurrent.futures.ThreadPoolExecutor(len(arrivals)) as pool:
            times = list(pool.map(one, range(len(arrivals))))
        m = metrics(url)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=600)
    latencies = sorted(done - sent for sent, done in times)
    span = max(done for _, done in times) - t0
    return {
        "videos_per_minute": round(60 * len(times) / span, 2),
        "latency_p50_s": round(float(np.percentile(latencies, 50)), 2),
        "latency_p95_s": round(float(np.percentile(latencies, 95)), 2),
        "batch_fill": round(m["wan_batch_fill_ratio"], 3),
        "batches": int(m["wan_batches_total"]),
        "compile_count": int(m["wan_compile_count"]),
        "start_to_first_video_s": round(min(done for _, done in times) - started, 2),
    }


def run_processes(artifacts: Path, weights: Path, work: Path, n: int, args) -> dict:
    """n `runtime run` processes, one after another, on the batch-1 build."""
    start, ends = time.time(), []
    for i in range(n):
        b = body(i, args)
        subprocess.run(
            [str(BIN / "runtime"), "run", "--artifacts", str(artifacts), "--weights", str(weights),
             "--res", args.res, "--frames", str(args.frames), "--batch", "1", "--steps",
             str(args.steps), "--prompt", b["prompt"], "--seed", str(i),
             "--out", str(work / f"run_{i}.mp4")],
            check=True, capture_output=True,
        )  # fmt: skip
        ends.append(time.time() - start)
    return {"first_video_s": round(ends[0], 2), "all_videos_s": round(ends[-1], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--res", default="64x96")
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="requests in the trace")
    parser.add_argument("--rate", type=float, default=0.5, help="arrivals per second")
    parser.add_argument("--rounds", type=int, default=1, help="b1, b4 pairs")
    parser.add_argument("--batch-window", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serve_load.json")
    args = parser.parse_args()
    command = "python bench/serve_load.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        artifacts, weights = work / "artifacts", work / "weights"
        subprocess.run([sys.executable, "-m", "wan.random_weights", "--model", args.model,
                        "--out", str(weights)], check=True, capture_output=True)  # fmt: skip
        subprocess.run([str(BIN / "aot"), "build", "--model", args.model, "--res", args.res,
                        "--frames", str(args.frames), "--batch", "1", "--batch", "4",
                        "--target", "cpu-8", "--out", str(artifacts)],
                       check=True, capture_output=True)  # fmt: skip
        builds = {b: next(artifacts.glob(f"*_b{b}_*")).name for b in (1, 4)}
        arrivals = trace(args.n, args.rate)
        runs: dict[int, list[dict]] = {1: [], 4: []}
        for r in range(args.rounds):
            for b in (1, 4):
                out = work / f"out_b{b}_{r}"
                runs[b].append(serve_trace(artifacts, weights, builds[b], out, arrivals, args))
                print(f"batch {b} round {r}: {runs[b][-1]}", file=sys.stderr)
        processes = run_processes(artifacts, weights, work, args.n, args)
    medians = {
        f"serve_b{b}": {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        for b, rows in runs.items()
    }
    row = {"command": command, "model": args.model, "res": args.res, "frames": args.frames,
           "steps": args.steps, "n": args.n, "rate_per_s": args.rate, "arrivals_s": arrivals,
           **medians, "runs": runs, f"runtime_run_x{args.n}": processes}  # fmt: skip
    save(args.out, row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("runs", "arrivals_s")}, indent=1))


if __name__ == "__main__":
    main()
