"""`runtime serve` under load, side by side: one Poisson arrival trace of N requests (the same
draws, scaled to each `--rates` rate) sent to three servers of one shape, alternating within each
round and rate (machine noise hits them alike): a batch-1 build, a batch-B build that waits
`--batch-window` to fill its batches, and the continuous batch-B build (`aot build --continuous`),
whose videos join at the next step. Per server and rate: videos per minute (N over the span from
the first request to the last video), p50/p95 latency (request to completed, polled every
0.1 s), p50 time to first step (request to progress > 0), slot fill (/metrics: videos per batch
slot; continuous: occupied slots per slot-step), and seconds from the server's process start to
its first video; medians and ranges over `--rounds`, with the host's 1-minute load at each
run. Beside them, N `runtime run` processes of the same requests one after another on the
batch-1 build.

    python bench/serve_load.py --model small --res 64x96 --frames 5 --steps 8 --n 12 \
        --batch 4 --rates 0.1,0.25,0.5 --rounds 3

With `--replicas 1 2 3`, a fleet instead: for each count, that many servers of the batch-B build
on one PostgreSQL job store (a scratch server, tests/postgres_server.py) and one shared folder,
the trace at `--rate` spread over them (request i to replica i mod k, polled through the next),
the counts alternating within each round; per count videos/min, p50/p95 latency and the most
claims of any job (1: none ran twice); and the store's own cost per job, SQLite against
PostgreSQL, over `--store-jobs` jobs a round (bench/results/serve_fleet.json).

    python bench/serve_load.py --model small --res 64x96 --frames 5 --steps 8 --n 12 \
        --batch 4 --replicas 1 2 3 --rate 0.4 --rounds 3

`--weights` serves weights already written (default: random ones), `--artifacts` builds into a
folder that may already hold the builds (up to date, they are not compiled again):
tests/test_bench.py passes its session's tiny weights and builds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import fixtures  # bench/fixtures.py, beside this script
import numpy as np
from record import host_load, rows, save, spread

ROOT = Path(__file__).resolve().parents[1]
BIN = fixtures.BIN
POLL_S = fixtures.POLL_S


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


def trace(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival seconds of n requests, Poisson at `rate` a second, the first at 0: the same draws
    for every rate, scaled."""
    gaps = np.random.default_rng(seed).exponential(1.0, n - 1) / rate
    return [0.0, *np.cumsum(gaps).round(3).tolist()]


def body(i: int, args: argparse.Namespace) -> dict:
    return {"prompt": f"a red fox number {i} running in the snow", "size": args.res,
            "frames": args.frames, "steps": args.steps, "seed": i}  # fmt: skip


def start_servers(artifacts: Path, weights: Path, outs: list[Path], *extra: str) -> list:
    """`runtime serve` processes, one per folder of `outs` (a fleet: one folder, shared), each
    once healthy: (process, url) each."""
    return [fixtures.serve(artifacts, weights, out, *extra) for out in outs]


def stop_servers(servers: list) -> None:
    for process, _ in servers:
        process.send_signal(signal.SIGTERM)
    for process, _ in servers:
        process.wait(timeout=600)


def send_trace(urls: list[str], arrivals: list[float], args) -> tuple[float, list]:
    """Request i sent to urls[i % len] at its arrival and polled (every POLL_S) through the next
    url (in a fleet: a replica other than the one it was created on) until done. Returns the
    trace's start and, per request: sent, first step, done (seconds since the epoch)."""
    t0 = time.time()

    def one(i: int) -> tuple[float, float, float]:
        time.sleep(max(t0 + arrivals[i] - time.time(), 0))
        sent = time.time()
        video = call(f"{urls[i % len(urls)]}/v1/videos", body(i, args))
        poll = urls[(i + 1) % len(urls)]
        first_step = None
        while video["status"] not in ("completed", "failed"):
            time.sleep(POLL_S)
            video = call(f"{poll}/v1/videos/{video['id']}")
            if first_step is None and (video["progress"] or video["status"] == "completed"):
                first_step = time.time()
        if video["status"] == "failed":
            raise SystemExit(f"a video failed: {video['error']}")
        return sent, first_step or time.time(), time.time()

    with concurrent.futures.ThreadPoolExecutor(len(arrivals)) as pool:
        return t0, list(pool.map(one, range(len(arrivals))))


def latency_figures(t0: float, times: list) -> dict:
    latencies = [done - sent for sent, _, done in times]
    span = max(done for *_, done in times) - t0
    return {
        "videos_per_minute": round(60 * len(times) / span, 2),
        "latency_p50_s": round(float(np.percentile(latencies, 50)), 2),
        "latency_p95_s": round(float(np.percentile(latencies, 95)), 2),
        "first_step_p50_s": round(float(np.median([f - s for s, f, _ in times])), 2),
    }


def serve_trace(artifacts: Path, weights: Path, build: str, out: Path, arrivals, args) -> dict:
    """Start a server of `build`, send the trace, wait for every video; its figures."""
    started = time.time()
    servers = start_servers(artifacts, weights, [out], "--build", build, "--batch-window",
                            str(args.batch_window))  # fmt: skip
    try:
        t0, times = send_trace([url for _, url in servers], arrivals, args)
        m = metrics(servers[0][1])
    finally:
        stop_servers(servers)
    slot_steps = m["wan_slot_steps_total"] + m["wan_empty_slot_steps_total"]
    return {
        **latency_figures(t0, times),
        "slot_fill": round(
            m["wan_slot_steps_total"] / slot_steps if slot_steps else m["wan_batch_fill_ratio"], 3
        ),
        "compile_count": int(m["wan_compile_count"]),
        "start_to_first_video_s": round(min(done for *_, done in times) - started, 2),
    }


def fleet_trace(artifacts: Path, weights: Path, build: str, replicas: int, store: str,
                shared: Path, arrivals, args) -> dict:  # fmt: skip
    """`replicas` servers of `build` on the PostgreSQL database `store` and the folder `shared`:
    the trace spread over them; its figures, and how often each job was claimed."""
    import psycopg

    servers = start_servers(artifacts, weights, [shared] * replicas, "--build", build,
                            "--batch-window", str(args.batch_window), "--job-store", store)  # fmt: skip
    try:
        t0, times = send_trace([url for _, url in servers], arrivals, args)
        compiles = sum(metrics(url)["wan_compile_count"] for _, url in servers)
    finally:
        stop_servers(servers)
    with psycopg.connect(store) as db:
        claims = [n for (n,) in db.execute("SELECT attempts FROM jobs")]
    return {**latency_figures(t0, times), "compile_count": int(compiles),
            "claims_per_job_max": max(claims)}  # fmt: skip


def store_overhead(store: str, scratch: Path, jobs: int) -> dict[str, float]:
    """Milliseconds of job-store work per job, in this process, SQLite in `scratch` against the
    PostgreSQL database `store`: what a server does for one video (add, claim, a progress
    report per step, complete, one poll per 0.5 s of a 10 s video), the video's own time left
    out."""
    from runtime.generation.batching import Group, Settings
    from runtime.serve.job_store import JobStore

    request = {"prompt": "a fox", "negative_prompt": "", "size": "64x96", "frames": 5,
               "seed": 0, "steps": 8}  # fmt: skip
    group = Group("bench", Settings(steps=8))
    seconds = {}
    for name, url in (("sqlite", None), ("postgresql", store)):
        job_store = JobStore(scratch / name, url=url, replica="bench")
        begin = time.perf_counter()
        for _ in range(jobs):
            job = job_store.add(group, request, jobs + 1)
            [job] = job_store.start([job.id])
            for step in range(8):
                job_store.progress([job.id], 100 * step // 8)
                job_store.renew()
            job_store.complete(job.id)
            for _ in range(20):
                job_store.get(job.id)
        seconds[name] = time.perf_counter() - begin
        job_store.close()
    return {f"{name}_ms_per_job": round(1000 * s / jobs, 2) for name, s in seconds.items()}


def fleet(artifacts: Path, weights: Path, build: str, work: Path, args) -> dict:
    """--replicas: each count of replicas on one PostgreSQL store, the counts alternating within
    each round; the store's overhead per job against SQLite."""
    sys.path.insert(0, str(ROOT / "tests"))
    from postgres_server import postgres_server  # a real server in a scratch folder

    arrivals = trace(args.n, args.rate)
    runs: dict[str, list[dict]] = {str(k): [] for k in args.replicas}
    overhead = []
    with postgres_server() as server:
        for r in range(args.rounds):
            for k in args.replicas if r % 2 == 0 else args.replicas[::-1]:
                store = server.new_database(f"fleet_{k}_{r}")
                row = {"host_load": host_load()} | fleet_trace(
                    artifacts, weights, build, k, store, work / f"fleet_{k}_{r}", arrivals, args
                )
                runs[str(k)].append(row)
                print(f"round {r} replicas {k}: {row}", file=sys.stderr)
            store = server.new_database(f"overhead_{r}")
            overhead.append(store_overhead(store, work / f"overhead_{r}", args.store_jobs))
    return {"build": build, "rate_per_s": args.rate, "medians": medians(runs),
            "spread": spreads(runs), "runs": runs,
            "store_overhead": {f: spread([o[f] for o in overhead], 2) for f in overhead[0]}}  # fmt: skip


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    return {
        k: {f: statistics.median(x[f] for x in rows) for f in rows[0]} for k, rows in runs.items()
    }


def spreads(runs: dict[str, list[dict]]) -> dict[str, dict[str, dict]]:
    """Each figure's median and range over the rounds, the host's load at each among them."""
    return {k: {f: spread([x[f] for x in rows], 2) for f in rows[0]} for k, rows in runs.items()}


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


FIGURES = {"videos_per_minute": ("videos/min", ""), "latency_p50_s": ("p50 latency", " s"),
           "latency_p95_s": ("p95 latency", " s"), "first_step_p50_s": ("first step p50", " s")}  # fmt: skip
SERVERS = {
    "serve_b1": "batch-1",
    "window": "batch-{b}, window",
    "continuous": "batch-{b}, continuous",
}


def markdown(row: dict) -> str:
    """The results row as docs/benchmarks.md's table: each figure's median [range] over the
    rounds, and the host's 1-minute load over them (where the run recorded it)."""
    fleet = "rates_per_s" not in row
    figures = FIGURES if fleet else {**FIGURES, "slot_fill": ("slot fill", "")}

    def cells(rows: list[dict], extra: tuple[str, ...]) -> list[str]:
        out = []
        for key, (_, unit) in figures.items():
            s = spread([r[key] for r in rows], 2)
            out.append(f"{s['median']:.2f}{unit} [{s['min']:.2f}-{s['max']:.2f}]")
        out += [f"{max(r[k] for r in rows):g}" for k in extra]
        loads = [r["host_load"] for r in rows if "host_load" in r]
        return [*out, f"{min(loads):.1f}-{max(loads):.1f}" if loads else "not recorded"]

    names = [name for name, _ in figures.values()]
    if fleet:
        extra = ("claims_per_job_max", "compile_count")
        head = ["replicas", *names, "most claims of a job", "compiles", "load"]
        body = [[k, *cells(rs, extra)] for k, rs in row["runs"].items()]
    else:
        extra = ("compile_count",)
        head = ["rate", "server", *names, "compiles", "load"]
        body = [
            [f"{rate}/s" if i == 0 else "",
             next(v for k, v in SERVERS.items() if k in server).format(b=row["batch"]),
             *cells(rs, extra)]
            for rate, by_server in row["runs"].items()
            for i, (server, rs) in enumerate(by_server.items())
        ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(map(str, b)) + " |" for b in body)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--res", default="64x96")
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--n", type=int, default=12, help="requests in the trace")
    parser.add_argument("--batch", type=int, default=4, help="the batched builds' batch")
    parser.add_argument(
        "--rates", default="0.1,0.25,0.5", help="arrivals per second, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=1, help="passes over every rate and server")
    parser.add_argument("--batch-window", type=float, default=1.0)
    parser.add_argument("--weights", type=Path, help="weights of --model (default: random ones)")
    parser.add_argument(
        "--artifacts", type=Path, help="the folder to build into (default: a scratch folder)"
    )
    parser.add_argument(
        "--replicas", type=int, nargs="+",
        help="a fleet instead: these counts of replicas of the batch build on one PostgreSQL "
        "store (a scratch server) and one folder, the trace at --rate",
    )  # fmt: skip
    parser.add_argument("--rate", type=float, default=0.25, help="--replicas: arrivals a second")
    parser.add_argument(
        "--store-jobs", type=int, default=200, help="--replicas: jobs of the store's overhead"
    )
    parser.add_argument("--out", type=Path, help="default: bench/results/serve_load.json, or "
                        "serve_fleet.json with --replicas")  # fmt: skip
    parser.add_argument(
        "--markdown", action="store_true", help="print the last row of --out as a table and exit"
    )
    args = parser.parse_args()
    default = "serve_fleet.json" if args.replicas else "serve_load.json"
    args.out = args.out or ROOT / "bench" / "results" / default
    if args.markdown:
        print(markdown(rows(args.out)[-1]))
        return
    rates = [float(r) for r in args.rates.split(",")]
    command = "python bench/serve_load.py " + " ".join(sys.argv[1:])
    shape = ["--model", args.model, "--res", args.res, "--frames", str(args.frames),
             "--target", "cpu-8"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        artifacts = args.artifacts or work / "artifacts"
        weights = fixtures.random_weights(args.model, work / "weights", args.weights)
        names = []  # the build folders, in the order built: batch 1, batch B, continuous
        commands = (["--batch", "1", "--batch", str(args.batch)],
                    ["--batch", str(args.batch), "--continuous"])  # fmt: skip
        for extra in commands[: 1 if args.replicas else 2]:  # a fleet serves the batch build
            built = fixtures.build(*shape, *extra, "--out", artifacts)
            names += [Path(report["folder"]).name for report in built]
        b = args.batch
        if args.replicas:
            row = {"command": command, "model": args.model, "res": args.res,
                   "frames": args.frames, "steps": args.steps, "n": args.n, "batch": b,
                   **fleet(artifacts, weights, names[1], work, args)}  # fmt: skip
            save(args.out, row)
            print(json.dumps(row["medians"], indent=1), json.dumps(row["store_overhead"]))
            return
        builds = dict(
            zip(("serve_b1", f"serve_b{b}_window", f"serve_b{b}_continuous"), names, strict=True)
        )
        runs: dict[str, dict[str, list[dict]]] = {f"{r:g}": {s: [] for s in builds} for r in rates}
        for r in range(args.rounds):
            for rate in rates:
                arrivals = trace(args.n, rate)
                for server, build in builds.items():
                    out = work / f"out_{server}_{rate:g}_{r}"
                    row = {"host_load": host_load()} | serve_trace(
                        artifacts, weights, build, out, arrivals, args
                    )
                    runs[f"{rate:g}"][server].append(row)
                    print(f"round {r} rate {rate:g} {server}: {row}", file=sys.stderr)
        processes = run_processes(artifacts, weights, work, args.n, args)
    row = {"command": command, "model": args.model, "res": args.res, "frames": args.frames,
           "steps": args.steps, "n": args.n, "batch": args.batch, "rates_per_s": rates,
           "builds": builds, "medians": {rate: medians(by) for rate, by in runs.items()},
           "spread": {rate: spreads(by) for rate, by in runs.items()}, "runs": runs,
           f"runtime_run_x{args.n}": processes}  # fmt: skip
    save(args.out, row)
    print(json.dumps(row["medians"], indent=1))


if __name__ == "__main__":
    main()
