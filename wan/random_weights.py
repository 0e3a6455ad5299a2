"""Random weights in the project's checkpoint format: `python -m wan.random_weights --model
tiny --out DIR`. For the demo and tests (and for timing real sizes without downloads): every
component initialised by its module, plus an offline tokenizer of the model's vocabulary size."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from wan import checkpoint, programs
from wan.configs import ModelConfig
from wan.presets import resolve_model
from wan.tokenizer import build_word_tokenizer


def random_params(config: ModelConfig, component: str, seed: int) -> dict:
    module = programs.make_module(config, component, rngs=nnx.Rngs(seed))
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.split(module)[1]))


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
        config = resolve_model(args.model)
    except ValueError as e:
        parser.error(str(e))
    print(write_random_checkpoint(config, args.out, args.seed))


if __name__ == "__main__":
    main()
