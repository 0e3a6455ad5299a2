"""One self-attention call of a step, timed on the accelerator attached, per kernel variant: JAX's
splash ("dense ...", "radial...") at several block sizes, Radial Attention's mask (splash's stored
block mask; the computed mask it replaced, as the control), 8-bit attention, and this project's
flash kernel ("flash ...", wan.models.tpu_flash; its output compared with splash's under the same
mask). Compiled there (jit): a bench, not a build.

The call is one transformer block's video self-attention at the step's shape: with CFG two
videos, the 1.3B's 12 heads of 128, 832x480x81's 32,760 tokens (21 latent frames of 30 x 52).

    python bench/chip_attention.py --out DIR [--only NAME ...]

Writes DIR/chip_attention.json: per variant the milliseconds per call (median and range of
--runs), the fraction of key blocks the kernel computes, the compile seconds, or the error.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import record  # bench/record.py, beside this script
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel,
)
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from wan.models import attention, radial_mask, tpu_flash
from wan.models.radial_mask import RadialSpec, density, radial_keep

FRAMES, TOKENS_PER_FRAME, HEADS, DIM = 21, 30 * 52, 12, 128


class ComputedRadialMask(splash_mask._ComputableMask):
    """The control: the Radial mask as splash's computed mask (the closed form evaluated per
    entry inside the kernel on partly kept blocks), as builds ran it before the stored mask."""

    def __init__(self, spec: RadialSpec, shape: tuple[int, int]):
        stored = radial_mask.RadialSplashMask(spec, shape)
        n = spec.tokens
        super().__init__(shape=shape, mask_function=lambda q, k: radial_keep(spec, q, k) & (k < n))
        self.spec, self._stored = spec, stored

    def __getitem__(self, idx) -> np.ndarray:
        return self._stored[idx]

    def __eq__(self, other: object):
        return isinstance(other, type(self)) and self._stored == other._stored

    def __hash__(self):
        return hash((type(self), self._stored))


def with_segment_ids(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The control for the dense default: splash as builds ran it before the key mask, every
    key block compared by segment ids (the pad keys' id differs from the queries')."""
    b, length, heads, d = q.shape
    blocks = attention.TpuBlocks(2048, 1024, 512)
    bq, bkv = blocks.balanced(length, length)
    pad = -(-length // bkv) * bkv
    kernel = splash_kernel.make_splash_mha(
        splash_mask.MultiHeadMask([splash_mask.FullMask((pad, pad))] * (b * heads)),
        block_sizes=splash_kernel.BlockSizes(bq, bkv, block_kv_compute=min(512, bkv)),
        head_shards=1,
        q_seq_shards=1,
    )
    ids = splash_kernel.SegmentIds(
        q=jnp.zeros((pad,), jnp.int32), kv=(jnp.arange(pad) >= length).astype(jnp.int32)
    )

    def heads_major(x: jax.Array) -> jax.Array:
        x = jnp.pad(x, ((0, 0), (0, pad - length), (0, 0), (0, 0)))
        return x.transpose(0, 2, 1, 3).reshape(b * heads, pad, d)

    scaled = (q.astype(jnp.float32) * d**-0.5).astype(q.dtype)
    out = kernel(heads_major(scaled), heads_major(k), heads_major(v), ids)
    return out.reshape(b, heads, pad, d).transpose(0, 2, 1, 3)[:, :length]


def flash_kernel(
    blocks: tuple[int, int, int], spec: RadialSpec | None, pv_dtype: jnp.dtype, vmem_mib: int
) -> Callable:
    """wan.models.tpu_flash's kernel at `blocks` (they divide the padded step length)."""
    return lambda q, k, v: tpu_flash.flash_attention(
        q, k, v, blocks=blocks, interpret=False, sparse=spec, pv_dtype=pv_dtype,
        vmem_limit_bytes=vmem_mib << 20 if vmem_mib else None,
    )  # fmt: skip


# Each flash variant's output is compared with splash's under the same mask.
REFERENCE = {"flash dense": "dense 2048/1024/512", "flash radial1024": "radial1024 1024/1024/512"}


def variants() -> dict[str, tuple[Callable, float]]:
    """name -> (attention(q, k, v), fraction of key blocks computed), the most telling first
    (the run stops at --budget): the dense default, the Radial mask stored and computed at the
    sparse builds' 512 blocks, other blocks for the mask, 8-bit, other dense blocks."""
    n = FRAMES * TOKENS_PER_FRAME
    out: dict[str, tuple[Callable, float]] = {}

    def dense(q: int, kv: int, kvc: int, quant: str | None = None) -> None:
        name = f"{quant or 'dense'} {q}/{kv}/{kvc}"
        out[name] = (attention.resolve(f"splash:{q}:{kv}:{kvc}", quant=quant), 1.0)

    def radial(
        block: int, q: int, kv: int, how: str = "", quant: str | None = None, kvc: int = 0
    ) -> None:
        spec = RadialSpec(FRAMES, TOKENS_PER_FRAME, block=block)
        kvc = kvc or kv
        kept = density(spec, *attention.TpuBlocks(q, kv, kvc).balanced(n, n))
        name = " ".join(filter(None, [quant, f"radial{block} {q}/{kv}/{kvc}", how]))
        impl = f"splash:{q}:{kv}:{kvc}"
        out[name] = (attention.resolve(impl, sparse=spec, quant=quant), kept)

    def flash(
        q: int, kv: int, kvc: int, block: int = 0, pv: str = "bf16", vmem_mib: int = 0
    ) -> None:
        spec = RadialSpec(FRAMES, TOKENS_PER_FRAME, block=block) if block else None
        kept = tpu_flash.computed_fraction(spec, q, kv) if spec else 1.0
        name = f"flash {f'radial{block}' if block else 'dense'} {q}/{kv}/{kvc}"
        name += " f32 pv" if pv == "f32" else ""
        name += f" vmem{vmem_mib}" if vmem_mib else ""
        out[name] = (
            flash_kernel(
                (q, kv, kvc), spec, {"bf16": jnp.bfloat16, "f32": jnp.float32}[pv], vmem_mib
            ),
            kept,
        )

    dense(2048, 1024, 512)
    radial(1024, 1024, 1024, kvc=512)
    flash(2048, 1024, 512)
    flash(2048, 1024, 512, pv="f32")
    flash(1024, 1024, 512, block=1024)
    flash(2048, 1024, 256)
    flash(1024, 1024, 256, block=1024)
    flash(2048, 1024, 256, block=1024)  # query blocks of two mask blocks: half visits
    flash(2048, 1024, 128)
    flash(1024, 1024, 128, block=1024)
    flash(2048, 2048, 256, vmem_mib=64)
    flash(4096, 1024, 256, vmem_mib=64)
    flash(2048, 2048, 256, block=2048, vmem_mib=64)
    flash(2048, 2048, 512, vmem_mib=64)
    flash(4096, 1024, 512, vmem_mib=64)
    out["dense 2048/1024/512 segment ids"] = (with_segment_ids, 1.0)
    radial(1024, 1024, 1024)
    radial(128, 512, 512)
    radial(128, 512, 512, "computed")
    radial(512, 512, 512)
    dense(512, 512, 512)
    for q, kv in [(256, 256), (512, 256), (256, 128), (512, 128), (1024, 512), (1024, 1024)]:
        radial(128, q, kv)
    radial(256, 512, 256)
    radial(256, 256, 256)
    radial(512, 1024, 512)
    dense(2048, 1024, 512, "int8")
    radial(128, 512, 512, quant="int8")
    for q, kv, kvc in [(1024, 1024, 512), (1024, 512, 512), (2048, 1024, 1024), (4096, 1024, 512),
                       (1024, 1024, 1024), (2048, 2048, 512)]:  # fmt: skip
        dense(q, kv, kvc)
    return out


def time_variant(name: str, fn: Callable, inputs: tuple[jax.Array, ...], runs: int) -> dict:
    computed = name.endswith("computed")
    saved = radial_mask.RadialSplashMask
    if computed:  # only for the control: splash_attention builds the mask it is given
        attention.RadialSplashMask = ComputedRadialMask
    try:
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*inputs).compile()
        compile_s = time.perf_counter() - start
    finally:
        attention.RadialSplashMask = saved
    result = jax.block_until_ready(compiled(*inputs))
    seconds = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        seconds.append(1000 * (time.perf_counter() - start))
    return {"compile_s": round(compile_s, 1), "ms": record.spread(seconds, 2)}, result


def markdown(results: list[dict]) -> str:
    """One row per variant of the files' runs (later files' rows replace earlier ones')."""
    rows = {r["variant"]: r for result in results for r in result["rows"]}
    lines = [
        "| variant | ms per call | kernel blocks computed | dense-equivalent TFLOP/s |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "ms" not in r:
            lines.append(f"| {name} | {r.get('error') or r.get('skipped')} | | |")
            continue
        ms = r["ms"]
        lines.append(
            f"| {name} | {ms['median']:.1f} [{ms['min']:.1f}-{ms['max']:.1f}] | "
            f"{r['density']:.3f} | {r['dense_tflops']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--markdown", type=Path, nargs="+", help="print the table of these files")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="variant names (default: all)")
    parser.add_argument("--budget", type=float, default=400, help="seconds; later variants skipped")
    args = parser.parse_args()
    if args.markdown:
        print(markdown([json.loads(path.read_text()) for path in args.markdown]))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    shape = (2, FRAMES * TOKENS_PER_FRAME, HEADS, DIM)
    keys = jax.random.split(jax.random.key(0), 3)
    inputs = tuple(jax.random.normal(k, shape, jnp.bfloat16) for k in keys)
    flops = attention.flops(shape, shape[1])
    began, rows, outputs = time.perf_counter(), [], {}
    for name, (fn, kept) in variants().items():
        if args.only and name not in args.only:
            continue
        if time.perf_counter() - began > args.budget:
            rows.append({"variant": name, "skipped": "over --budget"})
            continue
        try:
            timing, outputs[name] = time_variant(name, fn, inputs, args.runs)
            row = {"variant": name, "density": round(kept, 4), **timing}
            row["dense_tflops"] = round(flops / row["ms"]["median"] / 1e9, 1)
            reference = next((r for p, r in REFERENCE.items() if name.startswith(p + " ")), None)
            if reference in outputs:
                diff = jnp.abs(outputs[name].astype(jnp.float32) - outputs[reference])
                row[f"vs {reference}"] = {
                    "max_abs": float(diff.max()),
                    "mean_abs": float(diff.mean()),
                }
        except Exception as e:  # a variant the chip cannot compile (VMEM) is a row, not the end
            row = {"variant": name, "error": (str(e).splitlines() or [type(e).__name__])[0][:300]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        record.save_sitting(
            args.out / "chip_attention.json", rows, device=jax.devices()[0].device_kind, shape=shape
        )


if __name__ == "__main__":
    main()
