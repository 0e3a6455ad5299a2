"""8-bit transformer Linear layers (`aot build --quant`): the one place the scheme is defined
(the layer that runs it: wan.models.quant_linear). No jax: the checkpoint loader quantizes with it.

Weights: symmetric, one scale per output channel, `scale = max |w[:, j]| / QMAX` (a zero
column gets scale 1); int8 rounds `w / scale` half to even and clips to [-127, 127]; fp8
(float8_e4m3fn) casts `w / scale` (round to nearest even; |w / scale| <= 448 by construction).
They are quantized on the host, at load, a layer of a stacked tensor at a time
(`quantize_kernel`), from the weights the full-precision build would run with (after any LoRA
merge), so a checkpoint in full precision serves every mode.

Activations (`w8a8-*`): symmetric, one scale per token (row), computed in the program the same
way; the matmul then runs on 8-bit operands (`lax.dot_general`, int32 accumulation for int8,
float32 for fp8) and is rescaled by both scales. `w8-*` keeps the activations and dequantizes
the weights inside the matmul: memory only.

What is quantized: the blocks' Linear layers (self- and cross-attention projections, the
cross-attention keys and values that `kv_cache` computes, the feed-forward), where the
weights and the matmul FLOPs are. Not: the patch embedding, the time and text embedders, the
modulation projection and tables, norms, the output head (small, and where errors reach every
token), attention itself, the text encoder and the VAE.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Scheme:
    name: str
    weight_dtype: str  # "int8" or "float8_e4m3fn"
    activations: bool  # w8a8: activations quantized per token, the matmul on 8-bit operands

    @property
    def qmax(self) -> float:
        return QMAX[self.weight_dtype]

    @property
    def eight_bit(self) -> str:
        """The 8-bit MXU format a w8a8 matmul needs ("int8" or "fp8")."""
        return "int8" if self.weight_dtype == "int8" else "fp8"


QMAX = {"int8": 127.0, "float8_e4m3fn": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)}
NONE = "none"
SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("w8a8-int8", "int8", activations=True),
        Scheme("w8a8-fp8", "float8_e4m3fn", activations=True),
        Scheme("w8-int8", "int8", activations=False),
        Scheme("w8-fp8", "float8_e4m3fn", activations=False),
    )
}
MODES = (NONE, *SCHEMES)


def scheme(mode: str) -> Scheme | None:
    """The scheme of a `--quant` mode; None for "none"."""
    return None if mode == NONE else SCHEMES[mode]


def is_quantized_dtype(dtype: Any) -> bool:
    return np.dtype(dtype) in (np.dtype(np.int8), np.dtype(ml_dtypes.float8_e4m3fn))


def nonzero_scale(scale: Any, xp: Any = np) -> Any:
    """A zero scale (an all-zero column or token) as 1: its values quantize to 0 either way."""
    return xp.where(scale == 0, 1.0, scale)


def to_8bit(x: Any, dtype: str, xp: Any = np) -> Any:
    """x (already divided by its scale) as `dtype`: int8 rounds half to even and clips."""
    if dtype == "int8":
        return xp.clip(xp.round(x), -QMAX["int8"], QMAX["int8"]).astype(np.int8)
    return x.astype(ml_dtypes.float8_e4m3fn)


def quantize_kernel(w: np.ndarray, weight_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """A kernel (..., in, out) -> (its `weight_dtype` form, float32 scales (..., out)), on the
    host, in float32."""
    w = np.asarray(w, np.float32)
    scale = nonzero_scale(np.abs(w).max(axis=-2) / np.float32(QMAX[weight_dtype]))
    scale = scale.astype(np.float32)
    return to_8bit(w / scale[..., None, :], weight_dtype), scale
