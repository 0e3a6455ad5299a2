"""Where placing a component's weights goes on the accelerator attached: starting the devices,
`wan.checkpoint.load_component` as the runtime calls it, host-to-device copies straight from the
checkpoint's memory map (one at a time, or from every core at once), and reading the file into
fresh host memory.

    python bench/chip_transfer.py --weights W [--component text_encoder] [--repeat 2] --out FILE

`load_component` places one parameter at a time, each copy finished before the next starts;
"put from the map, N threads" queues every parameter's copy from N threads and waits at the
end (`jax.device_put` returns before its copy is done, so even from 1 thread the copies are in
flight together). Every figure is seconds and GB/s of the component's stored bytes; the results
go to FILE (bench/record.py rows).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import sys
import time
from pathlib import Path

import record  # bench/record.py, beside this script

started = time.perf_counter()
import jax  # noqa: E402
import numpy as np  # noqa: E402

from wan import checkpoint, weights  # noqa: E402

imported = time.perf_counter()

CHUNK = 64 << 20


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def read_parallel(stored: dict[str, np.ndarray], threads: int) -> int:
    """Each tensor copied from its memory map into fresh host memory in CHUNK-sized pieces by
    `threads` threads (the copies are dropped): the file's read rate, page faults included."""

    def copy(piece: tuple[np.ndarray, int]) -> int:
        flat, start = piece
        return np.array(flat[start : start + CHUNK]).nbytes

    pieces = [
        (flat, start)
        for flat in (a.reshape(-1).view(np.uint8) for a in stored.values())
        for start in range(0, flat.size, CHUNK)
    ]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(copy, pieces))


def put_all(host: dict[str, np.ndarray], threads: int) -> dict[str, jax.Array]:
    device = jax.devices()[0]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        placed = dict(
            zip(host, pool.map(lambda a: jax.device_put(a, device), host.values()), strict=True)
        )
    return jax.block_until_ready(placed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--component", default="text_encoder")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    file = args.weights / args.component / checkpoint.PARAMS
    devices_s, devices = timed(jax.devices)
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    stored = dict(weights.read_safetensors(file))
    total = sum(a.nbytes for a in stored.values())
    gb = total / 1e9
    abstract = weights.unflatten({
        tuple(n.split("/")): jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
        for n, a in stored.items()
    })  # fmt: skip
    cores = os.cpu_count() or 1
    runs: dict[str, list[float]] = {}

    def measure(name: str, fn) -> object:
        seconds, out = timed(fn)
        runs.setdefault(name, []).append(round(seconds, 3))
        print(f"{name}: {seconds:.2f} s, {gb / seconds:.2f} GB/s", flush=True)
        return out

    for _ in range(args.repeat):
        measure("load_component", lambda: jax.block_until_ready(
            checkpoint.load_component(args.weights, args.component, abstract)))  # fmt: skip
        measure("put from the map, 1 thread", lambda: put_all(stored, 1))
        measure(f"put from the map, {cores} threads", lambda: put_all(stored, cores))
        measure(f"read, {cores} threads", lambda: read_parallel(stored, cores))
    record.save(args.out, {
        "command": shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d"), "commit": record.commit(),
        "device": str(devices[0].device_kind), "component": args.component, "gb": round(gb, 3), "bytes": total,
        "tensors": len(stored), "largest_gb": round(max(a.nbytes for a in stored.values()) / 1e9, 3),
        "import_s": round(imported - started, 3), "devices_s": round(devices_s, 3),
        "seconds": runs, "gb_per_s": {k: [round(gb / max(s, 1e-3), 2) for s in v] for k, v in runs.items()},
    })  # fmt: skip


if __name__ == "__main__":
    main()
