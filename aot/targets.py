"""Compile targets: which devices a build is for, found without needing that hardware.

`cpu-N` is N host devices of this process, `cpu-PxN` P processes of N host devices each (a
multi-host job emulated on this machine, see aot.local_job), `current` whatever this machine has
(GPU included), and TPU slices come from libtpu's topology description, so a CPU host compiles
for them. A TPU target names its host layout too (chips per host, hence the processes of the job
that runs it): an executable is compiled for one layout and a process holds its host's chips.
`prepare_environment` must run before jax is imported: host device counts and libtpu's
deviceless mode are process-wide settings.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from typing import Any

from runtime import processes
from wan.errors import InputError

GiB = 1 << 30

# Per-chip HBM by TPU generation (topology-name prefix).
TPU_HBM = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB, "tpu7x": 192 * GiB}
# Peak dense bf16 FLOP/s per chip (the roofline's denominator), by TPU generation and GPU kind.
PEAK_BF16_FLOPS = {
    "v4": 275e12,
    "v5e": 197e12,
    "v5p": 459e12,
    "v6e": 918e12,
    "tpu7x": 2307e12,
    "H100": 989e12,
    "H200": 989e12,
}
# Largest splash attention blocks (queries, keys, keys per compute step) by TPU generation,
# balanced to each sequence at trace time (wan.attention.balanced_block). The kernel's scratch
# must fit the generation's scoped VMEM (tests/test_attention.py compiles each): 3072/2048/1024
# takes 25.9 MiB, over the 16 MiB of v4, v5e and v5p (2048/2048/512 takes 19 MiB).
SPLASH_BLOCKS = {
    "v4": (2048, 1024, 512),
    "v5e": (2048, 1024, 512),
    "v5p": (2048, 1024, 512),
    "v6e": (3072, 2048, 1024),
    # 6400/2048/2048 overflows tpu7x's 64 MiB VMEM (81.8 MiB at 14B 720p): smaller query blocks.
    "tpu7x": (2048, 2048, 1024),
}
# Scoped VMEM (MiB) that the VAE decode's kernels are emitted for on TPU. libtpu tiles each conv
# fusion as large as the scoped VMEM allows (32 MiB by default on v6e) and its emit time follows
# the tile's code size, with retries after a tile overflows: most of the decode's compile time.
# Smaller tiles compile several times faster and take no more temporary memory (the 14B decode
# at 720x1280, batch 8, in a full build: 34 s at 4 MiB, 313 s at the default; docs/benchmarks.md);
# the transformer's programs, where run time is spent, keep the compiler's default.
VAE_VMEM_MIB = 4
# Chips per host (x, y, z) of the VMs each generation is sold in: v5e and v6e up to 8 chips
# (2x4) per host, v4, v5p and tpu7x 4 (2x2x1). libtpu's own default is 4 for every generation.
HOST_BOUNDS = {
    "v4": (2, 2, 1),
    "v5e": (2, 4, 1),
    "v5p": (2, 2, 1),
    "v6e": (2, 4, 1),
    "tpu7x": (2, 2, 1),
}
# Short names for the common single-host VMs: one process with all of the host's chips.
TPU_ALIASES = {
    "tpu-v4-8": "v4:2x2x1",
    "tpu-v5e-8": "v5e:2x4",
    "tpu-v6e-8": "v6e:2x4",
    "tpu-v5p-8": "v5p:2x2x1",
    "tpu7x-8": "tpu7x:2x2x1",
}
# cpu-N and cpu-PxN run here: every device is a thread pool of this machine, every process a
# Python with jax. Far above what a test or a benchmark uses (cpu-8, cpu-2x4).
MAX_CPU_DEVICES = 512
MAX_CPU_PROCESSES = 16
MAX_TPU_CHIPS = 16384  # above the largest slice of any generation (tpu7x: 9216 chips)
_TOPOLOGY = re.compile(
    r"^(v4|v5e|v5p|v6e|tpu7x):(\d{1,5}(?:x\d{1,5}){1,2})(?:/(\d{1,5}(?:x\d{1,5}){1,2}))?$"
)


class TargetError(InputError):
    """Unknown or unusable target: the message says which targets exist or what to install."""


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str  # "cpu", "tpu", "gpu"
    topology: str | None = None  # TPU topology name, e.g. "v6e:2x4"
    num_devices: int | None = None  # all processes' (cpu); TPU and current: from the devices
    num_processes: int = 1
    chips_per_host: tuple[int, int, int] | None = None  # TPU host layout (x, y, z)

    @property
    def generation(self) -> str | None:
        """TPU generation (v6e, tpu7x, ...); None for other targets."""
        return self.topology.split(":")[0] if self.topology else None

    @property
    def hbm_bytes(self) -> int | None:
        return TPU_HBM[self.generation] if self.generation else None


def peak_flops(target: Target, device_kind: str) -> float | None:
    """Peak bf16 FLOP/s of one device of `target` (None when unknown: CPUs, other GPUs)."""
    if target.generation:
        return PEAK_BF16_FLOPS[target.generation]
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_kind), None)


def parse_target(name: str) -> Target:
    """`cpu-N`, `cpu-PxN`, `current`, a TPU alias (tpu-v6e-8, ...), `tpu-<topology>`
    (tpu-v6e:4x4: hosts of the generation's VM size) or `tpu-<topology>/<host>` (tpu-v6e:4x4/2x2:
    hosts of 2x2 chips)."""
    if m := re.fullmatch(r"cpu-(?:(\d{1,9})x)?(\d{1,9})", name):
        procs, local = int(m.group(1) or 1), int(m.group(2))
        if not (1 <= procs <= MAX_CPU_PROCESSES and 1 <= procs * local <= MAX_CPU_DEVICES):
            raise TargetError(
                f"{name}: cpu-N and cpu-PxN need P, N >= 1, at most {MAX_CPU_PROCESSES} "
                f"processes (P) and {MAX_CPU_DEVICES} devices (P x N)"
            )
        return Target(name, "cpu", num_devices=procs * local, num_processes=procs)
    if name == "current":
        return Target(name, "current")
    spec = TPU_ALIASES.get(name) or (name[4:] if name.startswith("tpu-") else "")
    if not (m := _TOPOLOGY.match(spec)):
        known = ", ".join(
            ["cpu-N", "cpu-PxN", "current", *TPU_ALIASES, "tpu-<gen>:<AxB[xC]>[/<host AxB[xC]>]"]
        )
        raise TargetError(f"unknown target {name!r}: use one of {known}")
    generation, chips, host = m.groups()
    if math.prod(_dims(chips)) > MAX_TPU_CHIPS:
        raise TargetError(f"{name}: a slice has at most {MAX_TPU_CHIPS} chips")
    return Target(
        name,
        "tpu",
        topology=f"{generation}:{chips}",
        chips_per_host=host_bounds(generation, _dims(chips), _dims(host) if host else None),
    )


def _dims(text: str) -> tuple[int, int, int]:
    dims = tuple(int(n) for n in text.split("x"))
    return (*dims, 1) if len(dims) == 2 else dims  # type: ignore[return-value]


def host_bounds(
    generation: str, chips: tuple[int, int, int], host: tuple[int, int, int] | None = None
) -> tuple[int, int, int]:
    """Chips per host for a slice of `chips`: `host` as given, else the generation's VM size
    capped by the slice (a slice smaller than a VM is one host)."""
    bounds = host or tuple(map(min, HOST_BOUNDS[generation], chips))
    if any(b < 1 or c % b for c, b in zip(chips, bounds, strict=True)):
        raise TargetError(
            f"slice {_text(chips)} is not a whole number of {_text(bounds)} hosts: give a host "
            "layout that divides it, e.g. tpu-v6e:4x4/2x2"
        )
    return bounds  # type: ignore[return-value]


def _text(dims: tuple[int, ...]) -> str:
    return "x".join(map(str, dims))


def describe_aliases() -> str:
    """What each TPU alias means (for --help)."""
    return ", ".join(f"{alias} = {topology}" for alias, topology in TPU_ALIASES.items())


def prepare_environment(target: Target) -> None:
    """Process-wide settings for `target`; call before jax is imported."""
    if target.platform == "cpu":
        processes.use_host_devices(target.num_devices // target.num_processes)
    elif target.platform == "tpu":
        # Deviceless compile: libtpu describes the topology; the host computes on its CPU.
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{target.topology.split(':')[0]}-8")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        # Deviceless: several compiling processes (parallel tests, concurrent builds) may load it.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        os.environ.setdefault("TPU_MIN_LOG_LEVEL", "3")
        os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "3")
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        os.environ.pop("JAX_PLATFORMS", None)


def devices(target: Target) -> list[Any]:
    """The target's devices in their canonical order."""
    import jax

    if target.platform == "cpu":
        found = jax.devices("cpu")  # a multi-process job's: every process's, in process order
        if len(found) < target.num_devices:
            raise TargetError(
                f"{target.name} needs {target.num_devices} host devices but this process has "
                f"{len(found)}: run it in a fresh process (the aot CLI arranges this itself)"
            )
        return found[: target.num_devices]
    if target.platform == "current":
        return jax.devices()
    if importlib.util.find_spec("libtpu") is None:
        raise TargetError(
            f"target {target.name} needs libtpu: install the tpu extra (pip install -e '.[tpu]')"
        )
    from jax.experimental import topologies

    try:
        return list(
            topologies.get_topology_desc(
                platform="tpu",
                topology_name=target.topology,
                chips_per_host_bounds=target.chips_per_host,
            ).devices
        )
    except Exception as e:  # libtpu raises plain RuntimeErrors for unknown shapes
        raise TargetError(f"libtpu does not know topology {target.topology!r}: {e}") from None
