"""8-bit attention's accuracy (wan.models.attention_quant): per head, the cosine similarity and
the relative L1 distance of int8 and fp8 attention from bf16 attention, in both kernels (the
Pallas TPU kernel in interpret mode, blockwise), on inputs shaped like DiT activations
(`dit_like`) and on plain N(0, 1) inputs, with the keys smoothed and (the control) not; then
whole tiny pipelines, each 8-bit build's frames against the full-precision build's (PSNR).

    python bench/attention_8bit.py --out bench/results/attention_8bit.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import fixtures  # bench/fixtures.py, beside this script
import jax
import jax.numpy as jnp
import numpy as np
import record  # bench/record.py, beside this script

from wan.models.attention import dot_product_attention, resolve
from wan.models.attention_quant import FORMATS, quantize_blocks

ROOT = Path(__file__).resolve().parents[1]
TOKENS, HEADS, DIM = 1200, 2, 128
BIN = Path(sys.executable).parent


def dit_like(seed: int = 0, tokens: int = TOKENS) -> tuple[np.ndarray, ...]:
    """1 video, `tokens` tokens, 2 heads of 128. Queries and keys share a random walk along the
    sequence (nearby tokens alike: attention that favours neighbours, as video DiTs' does);
    every key channel carries a large offset (N(0, 8^2) per channel, the same for all tokens:
    DiT keys' per-channel bias); 4 of the 128 query channels are 3x the others. Values
    N(0, 1). float32 arrays (B, S, H, D)."""
    rng = np.random.default_rng(seed)
    shape = (1, tokens, HEADS, DIM)
    steps = np.sqrt(np.arange(1, tokens + 1))[None, :, None, None]
    walk = np.cumsum(rng.normal(size=shape), axis=1) / steps
    q = 0.5 * rng.normal(size=shape) + walk
    k = 0.5 * rng.normal(size=shape) + walk + 8 * rng.normal(size=(1, 1, HEADS, DIM))
    q[..., :4] *= 3
    return tuple(x.astype(np.float32) for x in (q, k, rng.normal(size=shape)))


def gaussian(seed: int = 5, tokens: int = TOKENS) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=(1, tokens, HEADS, DIM)).astype(np.float32) for _ in range(3))


def per_head(out, ref) -> list[dict]:
    """Each head's cosine similarity and relative L1 distance."""
    found = []
    for h in range(out.shape[2]):
        a = np.asarray(out[0, :, h], np.float64).ravel()
        b = np.asarray(ref[0, :, h], np.float64).ravel()
        cos = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
        found.append(
            {"cos": round(cos, 5), "rel_l1": round(np.abs(a - b).sum() / np.abs(b).sum(), 4)}
        )
    return found


def unsmoothed(q, k, v, fmt: str):
    """The control: the kernels' blocks of 128 and quantizer, the keys as they come (not
    smoothed), in dot attention over the dequantized Q and K."""
    f = FORMATS[fmt]
    tokens, pad = q.shape[1], -q.shape[1] % 128

    def dequantized(x):
        x8, scale = quantize_blocks(jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))), 128, f)
        blocks = x8.astype(jnp.float32).reshape(1, -1, 128, *x.shape[2:])
        deq = blocks * scale.transpose(0, 2, 1)[:, :, None, :, None]
        return deq.reshape(1, -1, *x.shape[2:])[:, :tokens]

    return dot_product_attention(dequantized(q), dequantized(k), v.astype(jnp.float32))


def accuracy(tokens: int) -> dict:
    # Jitted once: both inputs have one shape, so each kernel compiles once, not once an input.
    kernels = {
        fmt: {
            "splash (interpret)": jax.jit(resolve("splash:128:128:128", quant=fmt, interpret=True)),
            "blockwise": jax.jit(resolve("blockwise:128:128", quant=fmt)),
        }
        for fmt in FORMATS
    }
    found = {}
    for inputs_name, make in (("dit_like", dit_like), ("gaussian", gaussian)):
        q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in make(tokens=tokens))
        ref = dot_product_attention(q, k, v)
        for fmt, by_name in kernels.items():
            for name, kernel in by_name.items():
                found[f"{inputs_name} {fmt} {name}"] = per_head(kernel(q, k, v), ref)
            found[f"{inputs_name} {fmt} without smoothing"] = per_head(
                unsmoothed(q, k, v, fmt), ref
            )
    return found


def pipelines(steps: int, frames: int, given: Path | None, artifacts: Path | None = None) -> dict:
    """Tiny builds (blockwise, cpu-8) in full precision, int8 and fp8, one request each; PSNR
    of each 8-bit build's frames against the full-precision build's, and of another seed's.
    `given`: the tiny weights to use (else random ones are written); `artifacts`: the folder
    to build into, one artifacts folder a format (else the scratch folder)."""
    shape = ["--res", "64x128", "--frames", str(frames), "--batch", "1"]
    with tempfile.TemporaryDirectory(prefix="attention_8bit-") as scratch:
        root = Path(scratch)
        weights = fixtures.random_weights("tiny", root / "w", given)
        for fmt in ("none", *FORMATS):  # each once: an up-to-date build is not compiled again
            fixtures.tool("aot", "build", "--model", "tiny", *shape, "--target", "cpu-8",
                    "--attention", "blockwise", "--attention-quant", fmt,
                    "--out", str((artifacts or root) / fmt))  # fmt: skip
        frames = {}
        for name, fmt, seed in [("none", "none", 3), ("int8", "int8", 3), ("fp8", "fp8", 3),
                                ("another seed", "none", 4)]:  # fmt: skip
            out = (artifacts or root) / fmt
            fixtures.tool("runtime", "run", "--artifacts", str(out), "--weights", str(weights),
                    *shape, "--prompt", "a fox in the snow", "--steps", str(steps), "--seed",
                    str(seed), "--out", str(root / f"{name}.mp4"), "--save-frames",
                    str(root / f"{name}.npy"))  # fmt: skip
            frames[name] = np.load(root / f"{name}.npy").astype(np.float64)
    base = frames.pop("none")
    return {
        name: round(10 * np.log10(255**2 / np.mean((f - base) ** 2)), 2)
        for name, f in frames.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="the pipelines' steps")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="the attention inputs' tokens")
    parser.add_argument("--frames", type=int, default=17, help="the pipelines' frames")
    parser.add_argument("--weights", type=Path, help="tiny weights (default: random, written)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/attention_8bit.json")
    parser.add_argument(
        "--artifacts", type=Path, help="build into this folder (default: a scratch folder)"
    )
    args = parser.parse_args()
    row = {
        "command": shlex.join(["python", "bench/attention_8bit.py", *sys.argv[1:]]),
        "accuracy_against_bf16": accuracy(args.tokens),
        "pipeline_psnr_db_against_full_precision": pipelines(
            args.steps, args.frames, args.weights, args.artifacts
        ),
    }
    record.save(args.out, row)
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
