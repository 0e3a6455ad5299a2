"""Compile targets: which devices a build is for, found without needing that hardware.

`cpu-N` is N host devices of this process, `cpu-PxN` P processes of N host devices each (a
multi-host job emulated on this machine, see aot.building.local_job), `current` whatever this machine has
(GPU included), TPU slices come from libtpu's topology description and NVIDIA GPUs
(`gpu-h100[xN]`, `gpu:FILE.txtpb[xN]`: N GPUs of one host) from the CUDA plugin's compile-only
devices for a target config (aot.targets.gpu), so a CPU host compiles for them. A TPU target names its
host layout too (chips per host, hence the processes of the job that runs it): an executable is
compiled for one layout and a process holds its host's chips. `prepare_environment` must run
before jax is imported: host device counts and libtpu's deviceless mode are process-wide
settings.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Callable
from typing import Any

from aot.targets import gpu
from runtime.builds import processes
from wan.errors import InputError

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation's facts. Rates and HBM are per chip, as sold; a chip may hold several
    JAX devices (TensorCores that libtpu does not fuse into one), and every per-device figure
    (the HBM budget `aot check` applies, the roofline's peak) divides by `devices_per_chip`,
    which `devices` checks against libtpu's topology."""

    name: str  # topology-name prefix: "v6e" in "v6e:2x4"
    alias: str  # target name of the single-host VM
    vm_chips: str  # chips of that VM, "AxB[xC]": its topology and the hosts a slice is made of
    hbm_bytes_per_chip: int
    peak_bf16_per_chip: float  # dense FLOP/s
    peak_8bit_per_chip: float  # dense OP/s of `eight_bit`; for a later quantized step
    eight_bit: str  # the 8-bit format of that rate
    devices_per_chip: int  # JAX devices per chip in the layout the real VMs run
    # Largest blocks of the TPU attention kernels (queries, keys, keys per matmul), balanced to
    # each sequence at trace time (wan.models.attention.balanced_block); the kernels' scratch must
    # fit the generation's scoped VMEM (tests/test_attention.py compiles each).
    attention_blocks: tuple[int, int, int]
    chip_config: str | None = None  # libtpu chip config the VMs run (default: libtpu's)

    @property
    def vm_topology(self) -> str:
        return f"{self.name}:{self.vm_chips}"

    @property
    def host_bounds(self) -> tuple[int, int, int]:
        return _dims(self.vm_chips)

    @property
    def hbm_bytes(self) -> int:
        """HBM of one device."""
        return self.hbm_bytes_per_chip // self.devices_per_chip

    @property
    def peak_bf16(self) -> float:
        """Peak dense bf16 FLOP/s of one device."""
        return self.peak_bf16_per_chip / self.devices_per_chip

    @property
    def peak_8bit(self) -> float:
        """Peak dense 8-bit OP/s of one device."""
        return self.peak_8bit_per_chip / self.devices_per_chip


# Attention blocks: on v5e, flash at 2048/1024/256 took 78.2 ms a call at 832x480x81, 84.6 at
# 2048/1024/512, 126.0 at 2048/1024/128; 2048/2048/256 took 75.6 given 64 MiB of scoped VMEM
# (2048/2048/512 overflowed the 16 MiB a kernel gets by default on v4, v5e and v5p):
# docs/benchmarks.md, "On a TPU v5e chip". v6e and tpu7x take larger blocks, unmeasured there;
# 6400/2048/2048 overflowed tpu7x's 64 MiB in splash (81.8 MiB at 14B 720p), hence its smaller
# query blocks. VMs: v5e and v6e up to 8 chips (2x4) a host, v4, v5p
# and tpu7x 4 (2x2x1); libtpu's own default is 4 for every generation. Devices a chip: as libtpu
# lays out `vm_topology` with `chip_config` (tests/test_targets.py).
GENERATIONS = {
    g.name: g
    for g in [
        # name, VM alias, VM chips, HBM a chip, bf16 FLOP/s a chip, 8-bit OP/s a chip, 8-bit
        # format, devices a chip, attention blocks.
        # A v4 VM runs megacore: a chip's two TensorCores are one device (libtpu's default
        # chip config has 2 devices a chip, which that VM does not have). v4 has no int8 path
        # faster than bf16: its 8-bit rate is its bf16 rate.
        Generation("v4", "tpu-v4-8", "2x2x1", 32 * GiB, 275e12, 275e12, "int8", 1,
                   (2048, 1024, 256), chip_config="megacore"),
        Generation("v5e", "tpu-v5e-8", "2x4", 16 * GiB, 197e12, 394e12, "int8", 1,
                   (2048, 1024, 256)),
        # v5p: megacore is libtpu's default chip config.
        Generation("v5p", "tpu-v5p-8", "2x2x1", 95 * GiB, 459e12, 918e12, "int8", 1,
                   (2048, 1024, 256)),
        Generation("v6e", "tpu-v6e-8", "2x4", 32 * GiB, 918e12, 1836e12, "int8", 1,
                   (3072, 2048, 512)),
        # Two TensorCores a chip, each its own device (libtpu has no megacore config for it).
        Generation("tpu7x", "tpu7x-8", "2x2x1", 192 * GiB, 2307e12, 4614e12, "fp8", 2,
                   (2048, 2048, 512)),
    ]
}  # fmt: skip
# Views of the table by generation, per device, for the callers that need one fact.
TPU_HBM = {g.name: g.hbm_bytes for g in GENERATIONS.values()}
ATTENTION_BLOCKS = {g.name: g.attention_blocks for g in GENERATIONS.values()}
# Short names for the common single-host VMs: one process with all of the host's chips.
TPU_ALIASES = {g.alias: g.vm_topology for g in GENERATIONS.values()}
# Peak dense bf16 FLOP/s of a GPU `current` target's device, by device kind (deviceless GPU
# targets read theirs from the target config, aot.targets.gpu).
GPU_PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}
MAX_GPUS = 64  # GPUs of one host: 8 today (HGX), NVL72 trays expose fewer
_GPU_COUNT = r"(?:x(\d{1,3}))?"

# Scoped VMEM (MiB) for a VAE decode that compiles fast (`aot build --vae-vmem 4`). libtpu tiles
# each conv fusion as large as the scoped VMEM allows and its emit time follows the tile's code
# size: the 14B decode at 720x1280, batch 8, compiled in 31 s at 4 MiB and 246 s at the default.
# Not the default: the decode runs for every video, and on a TPU v5e the 1.3B's 832x480 decode
# took 6.95 s at 4 MiB against 5.56 s at the compiler's default (docs/benchmarks.md).
FAST_COMPILE_VAE_VMEM_MIB = 4
# cpu-N and cpu-PxN run here: every device is a thread pool of this machine, every process a
# Python with jax. Far above what a test or a benchmark uses (cpu-8, cpu-2x4).
MAX_CPU_DEVICES = 512
MAX_CPU_PROCESSES = 16
MAX_TPU_CHIPS = 16384  # above the largest slice of any generation (tpu7x: 9216 chips)
_DIMS = r"\d{1,5}(?:x\d{1,5}){1,2}"
_TOPOLOGY = re.compile(rf"^({'|'.join(GENERATIONS)}):({_DIMS})(?:/({_DIMS}))?$")


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
    gpu_config: gpu.GpuConfig | None = None  # deviceless GPU targets: what XLA compiles for

    @property
    def generation(self) -> str | None:
        """TPU generation (v6e, tpu7x, ...); None for other targets."""
        return self.topology.split(":")[0] if self.topology else None

    @property
    def chip(self) -> Generation | None:
        """The TPU generation's facts; None for other targets."""
        return GENERATIONS[self.generation] if self.generation else None

    @property
    def hbm_bytes(self) -> int | None:
        """HBM of one device (None when unknown: CPUs, `current`)."""
        if self.gpu_config:
            return self.gpu_config.hbm_bytes
        return self.chip.hbm_bytes if self.chip else None

    @property
    def deviceless_gpu(self) -> bool:
        """Compiled for GPUs this process does not have (no autotuning, no cuDNN graphs)."""
        return self.gpu_config is not None

    @property
    def config_digest(self) -> str | None:
        """sha256 of a deviceless GPU target's config: part of the compiler fingerprint."""
        return self.gpu_config.sha256 if self.gpu_config else None


def peak_flops(target: Target, device_kind: str) -> float | None:
    """Peak bf16 FLOP/s of one device of `target` (None when unknown: CPUs, other GPUs)."""
    if target.chip:
        return target.chip.peak_bf16
    if target.gpu_config:
        return target.gpu_config.peak_bf16
    return next((v for k, v in GPU_PEAK_BF16_FLOPS.items() if k in device_kind), None)


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
    if name.startswith("gpu"):
        return parse_gpu_target(name)
    spec = TPU_ALIASES.get(name) or (name[4:] if name.startswith("tpu-") else "")
    if not (m := _TOPOLOGY.match(spec)):
        known = ", ".join(
            [
                "cpu-N",
                "cpu-PxN",
                "current",
                *TPU_ALIASES,
                "tpu-<gen>:<AxB[xC]>[/<host AxB[xC]>]",
                *(f"gpu-{k}[xN]" for k in gpu.KINDS),
                "gpu:FILE.txtpb[xN]",
            ]
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


def parse_gpu_target(name: str) -> Target:
    """`gpu-<kind>[xN]` (a config the project ships, aot.targets.gpu.KINDS) or `gpu:FILE.txtpb[xN]` (one
    captured with `aot gpu-target capture`): N GPUs of one host, 1 by default."""
    if m := re.fullmatch(rf"gpu-({'|'.join(gpu.KINDS)}){_GPU_COUNT}", name):
        config, count = gpu.shipped_config(m.group(1)), m.group(2)
    elif m := re.fullmatch(rf"gpu:(.+\.txtpb){_GPU_COUNT}", name):
        try:
            config, count = gpu.read_config(m.group(1)), m.group(2)
        except gpu.GpuConfigError as e:
            raise TargetError(str(e)) from None
    else:
        raise TargetError(
            f"unknown GPU target {name!r}: use {', '.join(f'gpu-{k}[xN]' for k in gpu.KINDS)}, "
            "gpu:FILE.txtpb[xN] (a config from `aot gpu-target capture FILE.txtpb`) or current"
        )
    gpus = int(count or 1)
    if not 1 <= gpus <= MAX_GPUS:
        raise TargetError(f"{name}: 1 to {MAX_GPUS} GPUs of one host")
    return Target(name, "gpu", num_devices=gpus, gpu_config=config)


def _dims(text: str) -> tuple[int, int, int]:
    dims = tuple(int(n) for n in text.split("x"))
    return (*dims, 1) if len(dims) == 2 else dims  # type: ignore[return-value]


def host_bounds(
    generation: str, chips: tuple[int, int, int], host: tuple[int, int, int] | None = None
) -> tuple[int, int, int]:
    """Chips per host for a slice of `chips`: `host` as given, else the generation's VM size
    capped by the slice (a slice smaller than a VM is one host)."""
    bounds = host or tuple(map(min, GENERATIONS[generation].host_bounds, chips))
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


def describe_hosts() -> str:
    """Chips a VM and devices a chip of each generation (for --help)."""
    return f"{_grouped(lambda g: math.prod(g.host_bounds), ' chips')}; devices a chip: " + (
        _grouped(lambda g: g.devices_per_chip, "")
    )


def _grouped(fact: Callable[[Generation], int], unit: str) -> str:
    groups: dict[int, list[str]] = {}
    for g in GENERATIONS.values():
        groups.setdefault(fact(g), []).append(g.name)
    return ", ".join(f"{'/'.join(names)} {value}{unit}" for value, names in groups.items())


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
    elif target.deviceless_gpu:
        # The CUDA plugin makes compile-only devices only while jax computes on the CPU (with
        # JAX_PLATFORMS unset it tries the GPU and fails to load where there is none).
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
    if target.deviceless_gpu:
        return gpu_devices(target)
    if importlib.util.find_spec("libtpu") is None:
        raise TargetError(
            f"target {target.name} needs libtpu: install the tpu extra (pip install -e '.[tpu]')"
        )
    from jax.experimental import topologies

    chip_config = {"chip_config_name": target.chip.chip_config} if target.chip.chip_config else {}
    try:
        found = list(
            topologies.get_topology_desc(
                platform="tpu",
                topology_name=target.topology,
                chips_per_host_bounds=target.chips_per_host,
                **chip_config,
            ).devices
        )
    except Exception as e:  # libtpu raises plain RuntimeErrors for unknown shapes
        raise TargetError(f"libtpu does not know topology {target.topology!r}: {e}") from None
    # The per-device HBM and peak divide the chip's by the table's count: they must agree.
    if (per_chip := devices_per_chip(found)) != target.chip.devices_per_chip:
        raise TargetError(
            f"libtpu lays out {target.topology} with {per_chip} device(s) a chip, "
            f"aot.targets.GENERATIONS says {target.chip.devices_per_chip}: this libtpu is not "
            "one the project knows; install the tpu extra's version (pip install -e '.[tpu]')"
        )
    return found


def gpu_devices(target: Target) -> list[Any]:
    """Compile-only devices of a deviceless GPU target: its GPUs as one host's (1x1xN)."""
    if importlib.util.find_spec("jax_plugins.xla_cuda13") is None:
        raise TargetError(
            f"target {target.name} needs the CUDA plugin and ptxas: install the gpu extra "
            "(pip install -e '.[gpu]')"
        )
    from jax.experimental import topologies

    try:
        found = topologies.get_topology_desc(
            platform="cuda",
            target_config=target.gpu_config.text,
            topology=f"1x1x{target.num_devices}",
        ).devices
    except Exception as e:  # the plugin raises plain runtime errors for configs it rejects
        raise TargetError(
            f"the CUDA plugin rejects the target config of {target.name}: {str(e).splitlines()[0]}"
        ) from None
    return list(found)


def devices_per_chip(tpu_devices: list[Any]) -> int:
    """JAX devices per chip of a TPU topology: devices over distinct chip coordinates."""
    return len(tpu_devices) // len({tuple(d.coords) for d in tpu_devices})
