"""GPU target configs: what XLA needs to compile for an NVIDIA GPU without one attached.

A target config is XLA's `GpuTargetConfigProto` as text: the device's limits, core count,
clocks, memory and per-type rates. The project ships XLA's published specs for the GPUs it
names (`KINDS`, files in `aot/targets/gpu_specs/`); `aot gpu-target capture` writes one for the GPU
of the host it runs on, for `--target gpu:FILE.txtpb`. Everything per device that a build
records (HBM, peak bf16 rate, device kind) is read from the config, so a captured one needs no
table row. No jax here: the CLI reads configs before jax starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any

from runtime.trust.json_checks import CONTROL
from wan.bounded_read import read_text
from wan.errors import InputError

MAX_CONFIG_BYTES = 1 << 20  # a spec is ~5 KB
# Every field is checked before XLA sees it (it divides by threads_per_warp: 0 is SIGFPE) and
# before a build records it (the manifest's reader takes what its checks allow, no more).
MAX_STRING = 256  # characters of a name or version (XLA's specs: under 120)
MAX_DEPTH = 8  # nesting of messages (XLA's specs: 4)
MAX_NUMBER = (1 << 63) - 1  # a proto int64
# Messages whose numbers are all counts, sizes, limits or rates: 0 or less describes no device.
# Elsewhere (versions, a compute capability's minor, a rate table's key) 0 is a value.
POSITIVE_MESSAGES = ("gpu_device_info", "value")
# Fields of newer XLA specs that this jax's GpuTargetConfigProto lacks (it rejects the whole
# config otherwise); they describe collectives and memory granularity, nothing a single
# program's code depends on.
UNKNOWN_FIELDS = ("collective_memory_granularity",)
BF16 = 16  # xla.PrimitiveType.BF16: the key of the bf16 rate in `matrix_unit_description`


class GpuConfigError(InputError):
    """A GPU target config that cannot be used; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class GpuKind:
    """A GPU the project ships a target config for: target `gpu-<name>[xN]`."""

    name: str
    config_file: str  # in aot/targets/gpu_specs/, from openxla/xla's target_config/specs


KINDS = {k.name: k for k in [GpuKind("h100", "h100.txtpb"), GpuKind("h200", "h200.txtpb"),
                             GpuKind("b200", "b200.txtpb")]}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    """A target config as the compiler gets it, and the facts a build records from it."""

    text: str
    device_kind: str  # as jax names the device: "NVIDIA H100 80GB HBM3"
    hbm_bytes: int
    peak_bf16: float  # dense FLOP/s
    compute_capability: str  # "9.0"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def shipped_config(kind: str) -> GpuConfig:
    """The config the project ships for `kind` (a key of KINDS)."""
    text = (resources.files("aot.targets") / "gpu_specs" / KINDS[kind].config_file).read_text()
    return parse_config(text, f"the shipped {kind} config")


def read_config(path: str | Path) -> GpuConfig:
    """A config from a file (`aot gpu-target capture` writes them)."""
    text = read_text(
        Path(path),
        MAX_CONFIG_BYTES,
        lambda reason: GpuConfigError(
            f"GPU target config {path} {reason}: write one with "
            "`aot gpu-target capture FILE.txtpb` on the GPU host"
        ),
    )
    return parse_config(text, str(path))


def parse_config(text: str, source: str) -> GpuConfig:
    """The config with the fields this jax lacks removed, and its facts."""
    kept = "\n".join(
        line for line in text.splitlines() if line.strip().partition(":")[0] not in UNKNOWN_FIELDS
    )
    try:
        proto = parse_text_proto(kept)
    except ValueError as e:
        raise _unreadable(source, e) from None
    _check_fields(proto, source)
    try:
        info = _one(proto, "gpu_device_info")
        cc = _one(info, "cuda_compute_capability")
        rates = {_one(r, "key"): _one(r, "value") for r in
                 _one(info, "matrix_unit_description").get("rate_infos", [])}  # fmt: skip
        bf16 = rates[BF16]
        # A matrix unit does ops_per_clock multiply-adds a clock: 2 FLOPs each.
        peak = 2 * (_one(info, "core_count") * _one(bf16, "units_per_core")
                    * _one(bf16, "ops_per_clock") * _one(bf16, "clock_rate_ghz") * 1e9)  # fmt: skip
        return GpuConfig(
            text=kept + "\n",
            device_kind=_one(proto, "device_description_str"),
            hbm_bytes=int(_one(info, "device_memory_size")),
            peak_bf16=float(peak),
            compute_capability=f"{cc.get('major', [0])[0]}.{cc.get('minor', [0])[0]}",
        )
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise _unreadable(source, e) from None


def _unreadable(source: str, e: Exception) -> GpuConfigError:
    return GpuConfigError(
        f"{source} is not a GPU target config this project reads ({type(e).__name__}: {e}): "
        "it needs gpu_device_info (core_count, device_memory_size, cuda_compute_capability, "
        "matrix_unit_description with a bf16 rate) and device_description_str"
    )


def _check_fields(message: dict[str, list[Any]], source: str, where: str = "") -> None:
    """Every number of `message` finite, within an int64 and positive in POSITIVE_MESSAGES
    (else at least 0); every string one line of at most MAX_STRING characters."""
    positive = where.rpartition(".")[2] in POSITIVE_MESSAGES
    for name, values in message.items():
        path = f"{where}.{name}" if where else name
        for value in values:
            if isinstance(value, dict):
                _check_fields(value, source, path)
            elif isinstance(value, str):
                if len(value) > MAX_STRING or CONTROL.search(value):
                    raise _bad_field(
                        source, path, f"is not a one-line string of at most {MAX_STRING} characters"
                    )
            elif not (math.isfinite(value) and (value > 0 if positive else value >= 0)
                      and value <= MAX_NUMBER):  # fmt: skip
                shown = str(value) if len(str(value)) <= 40 else f"{str(value)[:20]}..."
                sign = "positive" if positive else "non-negative"
                raise _bad_field(source, path, f"is {shown}, not a {sign} finite number")


def _bad_field(source: str, path: str, problem: str) -> GpuConfigError:
    return GpuConfigError(
        f"{source}: {path} {problem}: fix it, or capture the config with "
        "`aot gpu-target capture FILE.txtpb` on the GPU host"
    )


_TOKEN = re.compile(r'\s*(?:(#[^\n]*)|([A-Za-z_][\w]*)\s*:?\s*(\{)|([A-Za-z_][\w]*)\s*:\s*'
                    r'("(?:[^"\\]|\\.)*"|[^\s{}]+)|(\}))')  # fmt: skip


def parse_text_proto(text: str) -> dict[str, list[Any]]:
    """A protobuf text message as {field: [values]}: a nested message is a dict, a string a
    str, a number an int or float, an enum name a str. Enough of the format for target
    configs (no lists in brackets, no extensions)."""
    stack: list[dict[str, list[Any]]] = [{}]
    pos = 0
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"unreadable text at character {pos}: {text[pos : pos + 30]!r}")
        pos = m.end()
        _, open_name, _, field, value, close = m.groups()
        if open_name:
            if len(stack) > MAX_DEPTH:
                raise ValueError(f"messages nested deeper than {MAX_DEPTH} levels")
            child: dict[str, list[Any]] = {}
            stack[-1].setdefault(open_name, []).append(child)
            stack.append(child)
        elif field:
            stack[-1].setdefault(field, []).append(_scalar(value))
        elif close:
            if len(stack) == 1:
                raise ValueError("unbalanced '}'")
            stack.pop()
    if len(stack) != 1:
        raise ValueError("unclosed '{'")
    return stack[0]


def _scalar(text: str) -> Any:
    if text.startswith('"'):
        return text[1:-1].encode().decode("unicode_escape")
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _one(message: dict[str, list[Any]], field: str) -> Any:
    return message[field][0]


# CUdevice_attribute values of the CUDA driver API (cuda.h) that the config's fields read.
_DRIVER_ATTRIBUTES = {
    "threads_per_block_limit": 1,
    "shared_memory_per_block": 8,
    "threads_per_warp": 10,
    "registers_per_block_limit": 12,
    "core_count": 16,
    "l2_cache_size": 38,
    "threads_per_core_limit": 39,
    "shared_memory_per_core": 81,
    "registers_per_core_limit": 82,
    "shared_memory_per_block_optin": 97,
}
_CLOCK_KHZ, _MEMORY_CLOCK_KHZ, _BUS_WIDTH_BITS, _CC_MAJOR, _CC_MINOR = 13, 36, 37, 75, 76


def capture(ordinal: int = 0) -> str:
    """The target config of this host's GPU `ordinal`: its facts read from the CUDA driver
    (as XLA reads them), its per-type rate tables from the shipped spec of the same compute
    capability (the driver does not report them). Needs a GPU and libcuda."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise GpuConfigError(
            "no CUDA driver (libcuda.so.1) on this host: capture on the GPU host"
        ) from None

    def call(name: str, *args: Any) -> None:
        if status := getattr(cuda, name)(*args):
            raise GpuConfigError(f"CUDA driver {name} failed with status {status}: is a GPU here?")

    call("cuInit", 0)
    device = ctypes.c_int()
    call("cuDeviceGet", ctypes.byref(device), ordinal)

    def attribute(number: int) -> int:
        value = ctypes.c_int()
        call("cuDeviceGetAttribute", ctypes.byref(value), number, device)
        return value.value

    name = ctypes.create_string_buffer(256)
    call("cuDeviceGetName", name, 256, device)
    memory = ctypes.c_size_t()
    call("cuDeviceTotalMem_v2", ctypes.byref(memory), device)
    major, minor = attribute(_CC_MAJOR), attribute(_CC_MINOR)
    measured = {field: attribute(number) for field, number in _DRIVER_ATTRIBUTES.items()}
    measured |= {
        "device_memory_size": memory.value,
        "clock_rate_ghz": attribute(_CLOCK_KHZ) / 1e6,
        # DDR: two transfers a memory clock, bus width in bits.
        "memory_bandwidth": 2
        * attribute(_MEMORY_CLOCK_KHZ)
        * 1000
        * attribute(_BUS_WIDTH_BITS)
        // 8,
    }
    return captured_text(name.value.decode(), (major, minor), measured)


def captured_text(device_name: str, capability: tuple[int, int], measured: dict[str, Any]) -> str:
    """A config for a device of `device_name` and compute `capability`: the shipped spec of
    that capability with the `measured` fields and the names replaced."""
    base = next(
        (
            c
            for c in map(shipped_config, KINDS)
            if c.compute_capability.split(".")[0] == str(capability[0])
        ),
        None,
    )
    if base is None:
        raise GpuConfigError(
            f"{device_name} has compute capability {capability[0]}.{capability[1]}; the project "
            f"ships rate tables for {', '.join(sorted({shipped_config(k).compute_capability for k in KINDS}))}"
        )
    text = base.text
    for field, value in measured.items():
        text = re.sub(rf"(?m)^(  {field}: ).*$", lambda m, v=value: f"{m.group(1)}{v}", text)
    quoted = device_name.replace("\\", "\\\\").replace('"', '\\"')
    text = re.sub(
        r'(?m)^(  name: |device_description_str: )".*"$', lambda m: f'{m.group(1)}"{quoted}"', text
    )
    return (
        f"# Captured by `aot gpu-target capture` from {device_name} (compute capability "
        f"{capability[0]}.{capability[1]}); rate tables from the shipped {base.device_kind} spec.\n"
        + "\n".join(line for line in text.splitlines() if not line.startswith("#"))
        + "\n"
    )


def diff_configs(a: GpuConfig, b: GpuConfig) -> list[str]:
    """The scalar fields of gpu_device_info that differ: 'field: a -> b'."""
    info_a = _one(parse_text_proto(a.text), "gpu_device_info")
    info_b = _one(parse_text_proto(b.text), "gpu_device_info")

    def shown(values: list[Any] | None) -> Any:
        return values[0] if values and len(values) == 1 else values

    return [
        f"{field}: {shown(info_a.get(field))} -> {shown(info_b.get(field))}"
        for field in sorted(set(info_a) | set(info_b))
        if info_a.get(field) != info_b.get(field)
    ]
