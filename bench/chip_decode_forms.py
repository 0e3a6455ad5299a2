"""The VAE decode in other formulations, compiled on the accelerator attached: does writing the
decoder's norm or its causal cache another way change what XLA makes of it? Each form replaces
one function of `wan.models.vae` while the decode program is traced (the program, its mesh of
one device and its random weights are otherwise the build's), then the decode is timed and one
traced call's device ops are summed by kind (bench/chip_profile.py's kinds), with the heaviest
ops of each kind named.

    python bench/chip_decode_forms.py --model wan2.1-t2v-1.3b --res 832x480 --frames 81 \
        --forms written fp32_apply_norm pallas_norm --runs 3 --out DIR

An exploration, not a build: it compiles here (a runtime never does). What it found on the v5e
is in docs/benchmarks.md ("The VAE decode"). `--markdown DIR/decode_forms.json` prints the table.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import chip_profile  # bench/chip_profile.py, beside this script
import jax
import jax.numpy as jnp
import numpy as np
import record
from jax.experimental import pallas as pl

import wan.models.vae as vae
from aot.building.lower import lower_program
from wan import programs, sharding
from wan.configs import VideoShape
from wan.presets import PRESETS
from wan.random_weights import random_params

# One device: videos whole, kernels replicated.
RULES = (("vae_batch", "redundant"), ("vae_width", "vae_spatial"), ("vae_conv_out", None))
NORM_ROWS = 4096  # pixels per block of the Pallas norm


def cache_from_input(conv, x, cache, first=None):
    """The causal conv with its next cache sliced from the chunk, not from the window it
    convolves (the window then has one consumer, the conv)."""
    if cache is None:
        cache = jnp.zeros((x.shape[0], vae.CACHE_T, *x.shape[2:]), x.dtype)
    x = vae.real_frames(x, first)
    window = jnp.concatenate([cache, x], axis=1)
    tail = x[:, -vae.CACHE_T :] if x.shape[1] >= vae.CACHE_T else window[:, -vae.CACHE_T :]
    return conv(window), vae.pin(tail)


def rsqrt_norm(self, x):
    """As fp32_apply_norm, one multiply by rsqrt of the sum of squares, the gain folded in."""
    x32 = x.astype(jnp.float32)
    squares = jnp.sum(x32 * x32, axis=-1, keepdims=True)
    gain = self.gamma[...].astype(jnp.float32) * self.scale
    return (x32 * jax.lax.rsqrt(jnp.maximum(squares, vae.RMS_EPS**2)) * gain).astype(self.dtype)


def fp32_apply_norm(self, x):
    """The norm as written until sitting 10: x upcast, divided by its norm in fp32, then cast."""
    x32 = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True))
    normalized = (x32 / jnp.maximum(norm, vae.RMS_EPS)).astype(self.dtype)
    return normalized * self.scale * self.gamma[...].astype(self.dtype)


def bf16_squares_norm(self, x):
    """As written, the squares in x's dtype summed in fp32 (no fp32 copy of x at all)."""
    squares = jnp.sum(x * x, axis=-1, keepdims=True, dtype=jnp.float32)
    inverse = jax.lax.rsqrt(jnp.maximum(squares, vae.RMS_EPS**2))
    gain = (self.gamma[...].astype(jnp.float32) * self.scale).astype(x.dtype)
    return x * inverse.astype(x.dtype) * gain


def _norm_kernel(x_ref, gain_ref, out_ref):
    x = x_ref[...].astype(jnp.float32)
    squares = jnp.sum(x * x, axis=-1, keepdims=True)
    inverse = jax.lax.rsqrt(jnp.maximum(squares, vae.RMS_EPS**2))
    out_ref[...] = (x * inverse * gain_ref[...]).astype(out_ref.dtype)


def pallas_norm(self, x):
    """The norm as a Pallas kernel over (pixels, channels) blocks: x read once, written once."""
    channels = x.shape[-1]
    rows = x.reshape(-1, channels)
    gain = (self.gamma[...].astype(jnp.float32) * self.scale).reshape(1, channels)
    out = pl.pallas_call(
        _norm_kernel,
        grid=(pl.cdiv(rows.shape[0], NORM_ROWS),),
        in_specs=[
            pl.BlockSpec((NORM_ROWS, channels), lambda i: (i, 0)),
            pl.BlockSpec((1, channels), lambda i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((NORM_ROWS, channels), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(rows.shape, x.dtype),
        interpret=jax.devices()[0].platform != "tpu",
    )(rows, gain)
    return out.reshape(x.shape)


# Each form: the functions of wan.models.vae it replaces while tracing (none: as written).
FORMS: dict[str, dict[tuple[object, str], Callable]] = {
    "written": {},
    "cache_from_input": {(vae, "causal"): cache_from_input},
    "rsqrt_norm": {(vae.RMSNorm, "__call__"): rsqrt_norm},
    "fp32_apply_norm": {(vae.RMSNorm, "__call__"): fp32_apply_norm},
    "bf16_squares_norm": {(vae.RMSNorm, "__call__"): bf16_squares_norm},
    "pallas_norm": {(vae.RMSNorm, "__call__"): pallas_norm},
}


def traced_program(args: argparse.Namespace, form: str) -> programs.Program:
    """The decode program with `form`'s functions in place while it is traced and lowered."""
    replaced = FORMS[form]
    kept = {key: getattr(*key) for key in replaced}
    for (owner, name), fn in replaced.items():
        setattr(owner, name, fn)
    try:
        width, height = map(int, args.res.split("x"))
        shape = VideoShape(width=width, height=height, frames=args.frames, batch=1)
        program = programs.vae_decode_program(PRESETS[args.model], shape, programs.ProgramOptions())
        mesh = sharding.make_mesh(jax.devices()[:1], tuple((a, 1) for a in sharding.VAE_AXES))
        start = time.perf_counter()
        compiled = lower_program(program, mesh, RULES).compile()
        return program, compiled, time.perf_counter() - start
    finally:
        for (owner, name), fn in kept.items():
            setattr(owner, name, fn)


def ops_by_kind(xspace: Path, top: int) -> tuple[dict[str, float], dict[str, list]]:
    """Device ms per kind of one traced call, and each kind's heaviest ops."""
    _, ops = chip_profile.device_ops(xspace)
    totals: dict[str, float] = collections.defaultdict(float)
    heaviest: dict[str, list] = collections.defaultdict(list)
    for name, op in sorted(ops.items(), key=lambda kv: -kv[1]["ns"]):
        kind = chip_profile.kind_of(name)
        totals[kind] += op["ns"] / 1e6
        if len(heaviest[kind]) < top:
            entry = {"ms": round(op["ns"] / 1e6, 1), "count": op["count"], "op": name[:240]}
            heaviest[kind].append(entry)
    return {k: round(v, 1) for k, v in totals.items()}, dict(heaviest)


def run_form(args: argparse.Namespace, form: str, params_host: dict) -> dict:
    program, compiled, compile_s = traced_program(args, form)
    params_sharding, latents_sharding = compiled.input_shardings[0]
    params = jax.device_put(params_host, params_sharding)
    latents_shape = program.args["latents"].shape
    latents = np.random.default_rng(0).standard_normal(latents_shape).astype(np.float32)
    latents = jax.device_put(latents, latents_sharding)

    def decode() -> float:
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, latents))
        return time.perf_counter() - start

    first = decode()
    seconds = [decode() for _ in range(args.runs)]
    trace = Path(tempfile.mkdtemp())
    jax.profiler.start_trace(str(trace))
    frames = np.asarray(compiled(params, latents)["frames"])
    jax.profiler.stop_trace()
    totals, heaviest = ops_by_kind(next(trace.rglob("*.xplane.pb")), args.top)
    return {
        "form": form,
        "compile_s": round(compile_s, 1),
        "first_call_s": round(first, 3),
        "decode_s": record.spread(seconds),
        "ms_by_kind": totals,
        "heaviest": heaviest,
        "frames_mean": round(float(frames.astype(np.float32).mean()), 4),
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| form | compile s | decode s | device ms by kind | frames mean |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        by_kind = sorted(r["ms_by_kind"].items(), key=lambda kv: -kv[1])
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in by_kind)
        lines.append(
            f"| {r['form']} | {r['compile_s']:.1f} | {record.cell(r['decode_s'], 3)} | "
            f"{kinds} | {r['frames_mean']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = record.sitting_parser(__doc__)
    parser.add_argument("--model", default="wan2.1-t2v-1.3b", choices=sorted(PRESETS))
    parser.add_argument("--res", default="832x480")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--top", type=int, default=6, help="heaviest ops kept per kind")
    args = parser.parse_args()
    if record.printed_kept(args, markdown):
        return
    params_host = random_params(PRESETS[args.model], "vae", 0)
    rows = (run_form(args, form, params_host) for form in args.forms)
    record.run_sitting(args.out / "decode_forms.json", rows, markdown)


if __name__ == "__main__":
    main()
