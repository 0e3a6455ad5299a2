"""`aot build --jobs N`: the distinct programs of a matrix compiled by N worker processes.

The parent's lowering of every program of the matrix (the call's `CallLedger` holds it) gives
one task per store id the store lacks; spawned workers, each with a fresh jax, lower just their
program again (a lowered module does not cross processes) and compile it into the program
store (`aot.building.store`, locked and atomic as for concurrent builds). The builds then run as without
--jobs and find every program in the store; the ledger reports each worker-compiled program
`compiled` in the first build that has it.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from aot import targets
from aot.building import build, store
from aot.building.lower import lower_plan
from aot.building.plan import BuildError, BuildPlan
from runtime.trust import signing
from wan.errors import InputError

# One XLA compile keeps about two cores busy (libtpu's backend passes run in parallel: 182-191%
# CPU on a 2-core host over the 14B 720p builds) and takes up to ~5 GiB (the 14B 720p build's
# peak RSS at --vae-vmem default was 3.8 GB and 5.2 GB with the older decoder; 1.5 GB at 4 MiB;
# docs/benchmarks.md).
CORES_PER_COMPILE = 2
BYTES_PER_COMPILE = 6 << 30


class JobsError(InputError):
    """--jobs cannot be used as asked."""


def default_jobs() -> int:
    """What this host's cores and free memory allow at once (at least 1)."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores // CORES_PER_COMPILE, _available_memory() // BYTES_PER_COMPILE))


def _available_memory() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def check_jobs(jobs: int, target: targets.Target) -> None:
    if jobs < 1:
        raise JobsError(f"--jobs {jobs}: use a positive number, or leave it out for the default")
    if jobs > 1 and target.platform == "cpu" and target.num_processes > 1:
        raise JobsError(
            f"--jobs {jobs}: {target.name} compiles in one multi-process job; leave --jobs out"
        )


def compile_distinct(
    plans: Sequence[BuildPlan],
    out_root: Path,
    jobs: int,
    ledger: build.CallLedger,
    show_progress: bool = True,
) -> None:
    """Compile each distinct program of `plans` (the builds not up to date) that the store of
    `out_root` lacks (all with --force) in `jobs` processes, recording them in `ledger`.
    Workers print their progress lines on stderr when `show_progress`."""
    tasks: dict[str, tuple[BuildPlan, str]] = {}
    for plan in plans:
        for lowered, pid in ledger.lowered(plan):
            if ledger.force or not store.has(out_root, pid, ledger.signer):
                tasks.setdefault(pid, (plan, lowered.program.name))
    if not tasks:
        return
    out_root.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")  # a fresh jax per worker
    with concurrent.futures.ProcessPoolExecutor(
        min(jobs, len(tasks)), mp_context=context, initializer=_die_with, initargs=(os.getpid(),)
    ) as pool:
        futures = [
            pool.submit(
                _compile_one,
                plan,
                name,
                out_root,
                ledger.replace(pid),
                f"[{i}/{len(tasks)}]",
                show_progress,
                ledger.signer.path if ledger.signer else None,
            )  # fmt: skip
            for i, (pid, (plan, name)) in enumerate(tasks.items(), 1)
        ]
        try:
            for future in concurrent.futures.as_completed(futures):
                pid, compiled = future.result()
                if compiled:
                    ledger.compiled.add(pid)
        except BaseException as e:
            # One failure ends the call: compile no more, and stop the compiles under way (a
            # 14B program would otherwise run on for minutes before the error is shown).
            # ProcessPoolExecutor has no public kill before Python 3.14's kill_workers().
            for process in list(pool._processes.values()):
                process.kill()
            pool.shutdown(cancel_futures=True)
            if isinstance(e, concurrent.futures.process.BrokenProcessPool):
                raise BuildError(
                    "a compile worker died (out of memory?): run again with fewer --jobs"
                ) from None
            raise


def _die_with(parent: int) -> None:
    """In a worker, first: be killed when the parent dies (Linux's parent-death signal), so a
    killed `aot build` leaves no compile running; exit now if it died before this ran."""
    PR_SET_PDEATHSIG = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _compile_one(
    plan: BuildPlan,
    name: str,
    out_root: Path,
    replace: bool,
    count: str,
    show: bool,
    sign_key: Path | None,
) -> tuple[str, bool]:
    """In a worker: lower and compile program `name` of `plan` into the store, signed with the
    key at `sign_key` (a key object does not cross processes): (its store id, whether it was
    compiled here)."""
    targets.prepare_environment(plan.target)
    (lowered,) = lower_plan(plan, only={name})
    pid = store.program_id(lowered, build.compiler_fingerprint(plan.target))
    label = f"{count} {plan.key.folder_name()} {name}"
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if show else None
    signer = signing.load_signing_key(sign_key) if sign_key else None
    _, _, reused = build.store_program(
        plan, lowered, out_root, pid, replace, label, progress, signer
    )
    return pid, not reused
