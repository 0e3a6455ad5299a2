"""Random weights in the project's checkpoint format: `python -m wan.random_weights --model
tiny --out DIR`. For the demo and tests (and for timing real sizes without downloads): every
parameter of every component drawn on the host with numpy, plus an offline tokenizer of the
model's vocabulary size.

Host numpy rather than the modules' jax initialisers: those compile one small program per
parameter shape (tens of seconds for the VAE alone on a CPU host) for values nobody needs.
Scales keep activations O(1): kernels ~ N(0, 1/fan_in), norm scales ~ 1, biases small.
"""

from __future__ import annotations

import os

# A host-side tool: never let jax probe for accelerators (libtpu may be installed).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import concurrent.futures
import tempfile
from pathlib import Path

import jax
import numpy as np

from wan import checkpoint, programs
from wan.configs import ModelConfig
from wan.errors import InputError
from wan.presets import resolve_model
from wan.tokenizer import build_word_tokenizer

NORM_NAMES = ("scale", "weight", "gamma")  # RMS/layer norm gains


def random_params(config: ModelConfig, component: str, seed: int) -> dict:
    """Every parameter of `component`, each from its own stream of `seed` (so the values do not
    depend on how many threads draw them), drawn in float32 in threads: a 14 GB model in tens of
    seconds rather than minutes."""
    _, abstract, _ = programs.split_abstract(programs.abstract_module(config, component))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    streams = np.random.SeedSequence(seed).spawn(len(leaves))

    def draw(index: int) -> np.ndarray:
        path, leaf = leaves[index]
        name, shape = str(path[-1].key), leaf.shape
        value = np.random.default_rng(streams[index]).standard_normal(shape, dtype=np.float32)
        if name in NORM_NAMES:
            value *= 0.1
            value += 1.0
        elif name == "bias" or len(shape) < 2:
            value *= 0.02
        else:  # kernels (.., in, out), embeddings, modulation tables
            fan_in = shape[-2] * (int(np.prod(shape[-5:-2])) if len(shape) >= 5 else 1)
            value *= 1 / np.sqrt(fan_in if name == "kernel" else shape[-1])
        return value.astype(leaf.dtype)

    # numpy's generators and casts release the GIL; the largest leaves first.
    order = sorted(range(len(leaves)), key=lambda i: -leaves[i][1].size)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        drawn = dict(zip(order, pool.map(draw, order), strict=True))
    return jax.tree_util.tree_unflatten(treedef, [drawn[i] for i in range(len(leaves))])


def write_random_checkpoint(config: ModelConfig, folder: str | Path, seed: int = 0) -> Path:
    params = {
        c: random_params(config, c, seed + i) for i, c in enumerate(programs.components(config))
    }
    with tempfile.TemporaryDirectory() as tmp:
        build_word_tokenizer(Path(tmp) / "tokenizer", vocab_size=config.text_encoder.vocab_size)
        return checkpoint.save_checkpoint(folder, config, params, Path(tmp) / "tokenizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny", help="preset name or diffusers-format folder")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        print(write_random_checkpoint(resolve_model(args.model), args.out, args.seed))
    except (InputError, OSError) as e:
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main()
