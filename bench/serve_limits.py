"""`runtime serve`'s HTTP bounds, two source trees side by side: each tree builds the tiny model
and serves it with its default flags; against each server, one POST of a 200 MB body with its
Content-Length declared, one of a 200 MB body sent in chunks (the server's resident memory
before and after, the answer and its seconds), then N connections that send half a request
head (how many the server has closed after `--wait` seconds). The tree before the bounds:
`git worktree add /tmp/before <commit>`.

    python bench/serve_limits.py --before /tmp/before --after . --heads 3000 --rounds 3 \
        --save bench/results/serve_limits.json

The same tree as --before and --after builds once; `--weights` serves weights already written
(tests/test_bench.py: this tree twice, its session's tiny weights, a few heads).
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import fixtures  # bench/fixtures.py, beside this script
import httpx
from record import host_load, save, spread

SHAPE = ["--res", "64x96", "--frames", "5", "--batch", "1"]
BODY_MB = 200


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def post(client: httpx.Client, content: bytes | Iterator[bytes]) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        answer = str(
            client.post(
                "/v1/videos", content=content, headers={"content-type": "application/json"}
            ).status_code
        )
    except httpx.HTTPError as e:
        answer = type(e).__name__
    return answer, round(time.perf_counter() - start, 2)


def is_closed(s: socket.socket) -> bool:
    """Whether the server has closed this connection (and close it here)."""
    s.setblocking(False)
    try:
        return s.recv(16) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        s.close()


def measure(tree: Path, artifacts: Path, weights: Path, out: Path, heads: int, wait: float) -> dict:
    server, url = fixtures.serve(artifacts, weights, out, tree=tree)
    port = int(url.rsplit(":", 1)[1])
    client = httpx.Client(base_url=url, timeout=300)
    try:
        result = {}
        prompt = b"x" * (BODY_MB << 20)
        declared = b'{"prompt": "' + prompt + b'", "size": "64x96", "frames": 5}'
        chunked = (declared[i : i + (1 << 20)] for i in range(0, len(declared), 1 << 20))
        for name, content in (("declared_body", declared), ("chunked_body", chunked)):
            before = rss_mib(server.pid)
            answer, seconds = post(client, content)
            time.sleep(1)
            result[name] = {"answer": answer, "seconds": seconds, "rss_mib_before": before,
                            "rss_mib_growth": rss_mib(server.pid) - before}  # fmt: skip
        sockets = []
        for _ in range(heads):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line: never finished
            sockets.append(s)
        time.sleep(wait)
        closed = sum(is_closed(s) for s in sockets)
        result["half_sent_heads"] = {"sent": heads, "closed_after_s": wait, "closed": closed}
        return result
    finally:
        server.kill()
        server.wait()


def summary(runs: list[dict]) -> dict:
    """One tree's rounds: each body's answers, and the median and range of its seconds and of
    the server's memory growth; the heads closed in each round; the host's load at each."""
    bodies = {
        body: {
            "answers": sorted({run[body]["answer"] for run in runs}),
            "seconds": spread([run[body]["seconds"] for run in runs], 2),
            "rss_mib_growth": spread([run[body]["rss_mib_growth"] for run in runs], 0),
        }
        for body in ("declared_body", "chunked_body")
    }
    heads = runs[0]["half_sent_heads"]
    return {
        **bodies,
        "half_sent_heads": {
            "sent": heads["sent"], "closed_after_s": heads["closed_after_s"],
            "closed": [run["half_sent_heads"]["closed"] for run in runs],
        },
        "host_load": [run["host_load"] for run in runs],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--heads", type=int, default=3000)
    parser.add_argument("--wait", type=float, default=12.0)
    parser.add_argument("--weights", type=Path, help="the tiny model's (default: random ones)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--save", type=Path)
    parser.add_argument(
        "--artifacts",
        type=Path,
        help="build each tree into ARTIFACTS/before and /after, where an up-to-date build is not "
        "compiled again (default: a scratch folder)",
    )
    args = parser.parse_args()
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.heads + 1024,) * 2)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        weights = fixtures.random_weights("tiny", root / "weights", args.weights, args.after)
        built: dict[Path, Path] = {}  # each tree's build: the same tree twice builds once
        for name, tree in (("before", args.before), ("after", args.after)):
            if tree.resolve() not in built:
                built[tree.resolve()] = (args.artifacts or root) / name
                fixtures.build("--model", "tiny", *SHAPE, "--target", "cpu-8", "--out",
                               built[tree.resolve()], tree=tree)  # fmt: skip
        for round_ in range(args.rounds):  # the trees alternate: the host's load hits both
            for name, tree in (("before", args.before), ("after", args.after)):
                load = host_load()
                found = measure(tree, built[tree.resolve()], weights,
                                root / f"{name}-jobs-{round_}", args.heads, args.wait)  # fmt: skip
                runs[name].append({**found, "host_load": load})
    rows = {name: summary(found) for name, found in runs.items()}
    row = {"command": " ".join(["python bench/serve_limits.py", *sys.argv[1:]]), **rows,
           "runs": runs}  # fmt: skip
    print(json.dumps(row, indent=1))
    if args.save:
        save(args.save, row)


if __name__ == "__main__":
    main()
