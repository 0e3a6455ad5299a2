"""What compressing a build's executables costs and saves: per executable file, its size as
stored, XLA's bytes before compression, the seconds to read the stored file and to decompress it
(median and range of --repeats, the page cache warm), and the build folder's size.

    python bench/executable_size.py BUILD_FOLDER [--repeats 5] [--out FILE]

The runtime reads each file whole (sha256 checked) and then decompresses it; the question is
whether decompressing costs more than the bytes it saves reading.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import record  # bench/record.py, beside this script

from runtime.builds import executables


def measure(folder: Path, repeats: int) -> dict:
    rows = []
    for path in sorted(folder.glob("*.exec")):
        reads, decompressions = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            blob = path.read_bytes()
            reads.append(time.perf_counter() - start)
            header, stored = executables.read_header(blob)
            start = time.perf_counter()
            executables.decompressed(header, stored)
            decompressions.append(time.perf_counter() - start)
        rows.append({
            "file": path.name, "stored_bytes": len(blob), "xla_bytes": header.xla_bytes,
            "read_s": record.spread(reads, 4), "decompress_s": record.spread(decompressions, 4),
        })  # fmt: skip
    return {
        "build": folder.name,
        "folder_bytes": sum(p.stat().st_size for p in folder.iterdir() if p.is_file()),
        "stored_bytes": sum(r["stored_bytes"] for r in rows),
        "xla_bytes": sum(r["xla_bytes"] for r in rows),
        "executables": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = measure(args.build, args.repeats)
    for r in result["executables"]:
        print(
            f"{r['file']:24} {r['stored_bytes'] / 1e6:7.2f} MB stored  "
            f"{r['xla_bytes'] / 1e6:7.2f} MB XLA  read {r['read_s']['median'] * 1e3:7.1f} ms  "
            f"decompress {r['decompress_s']['median'] * 1e3:7.1f} ms"
        )
    print(
        f"folder {result['folder_bytes'] / 1e6:.1f} MB; executables {result['stored_bytes'] / 1e6:.1f}"
        f" MB stored, {result['xla_bytes'] / 1e6:.1f} MB before compression"
    )
    if args.out:
        row = {"command": shlex.join(["python", "bench/executable_size.py", *sys.argv[1:]]),
               "load": record.host_load(), **result}  # fmt: skip
        record.save(args.out, row)


if __name__ == "__main__":
    main()
