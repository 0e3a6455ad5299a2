"""A random LoRA of the original release's layout for a transformer preset: lora_down/lora_up/
alpha on every block Linear, .diff_b on their biases, .diff on the norms (bf16), numpy only (the
TPU machine has no torch). For timing real sizes, e.g. a step-distilled LoRA's load and merge:

    python bench/random_lora.py --model wan2.1-t2v-1.3b --rank 32 --out lora.safetensors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors.numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wan.presets import resolve_model  # noqa: E402

BLOCK_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q",
                 "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")  # fmt: skip
BLOCK_NORMS = ("norm3", "self_attn.norm_q", "self_attn.norm_k", "cross_attn.norm_q",
               "cross_attn.norm_k")  # fmt: skip


def write_lora(config, rank: int, path: Path, seed: int = 1) -> Path:
    """The LoRA file at `path` (kept when already there)."""
    if path.is_file():
        return path
    tc, rng = config.transformer, np.random.default_rng(seed)
    dims = {"ffn.0": (tc.ffn_dim, tc.inner_dim), "ffn.2": (tc.inner_dim, tc.ffn_dim)}

    def normal(*shape: int, scale: float) -> np.ndarray:
        return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)

    tensors = {}
    for i in range(tc.num_layers):
        for name in BLOCK_LINEARS:
            out, inp = dims.get(name, (tc.inner_dim, tc.inner_dim))
            key = f"diffusion_model.blocks.{i}.{name}"
            tensors[f"{key}.lora_down.weight"] = normal(rank, inp, scale=inp**-0.5)
            tensors[f"{key}.lora_up.weight"] = normal(out, rank, scale=0.01)
            tensors[f"{key}.alpha"] = np.array(rank, ml_dtypes.bfloat16)
            tensors[f"{key}.diff_b"] = normal(out, scale=0.01)
        for name in BLOCK_NORMS:
            tensors[f"diffusion_model.blocks.{i}.{name}.diff"] = normal(tc.inner_dim, scale=0.01)
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="wan2.1-t2v-1.3b")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    print(write_lora(resolve_model(args.model), args.rank, args.out))


if __name__ == "__main__":
    main()
