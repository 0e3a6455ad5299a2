"""The 8-bit Linear layer of wan.quant's scheme, in Flax NNX: the transformer blocks' Linear
layers under `aot build --quant`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from wan import quant
from wan.models.partitioned import logical_init
from wan.quant import Scheme


def quantized_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array, s: Scheme) -> jax.Array:
    """x (..., in) @ the dequantized kernel, in float32: on 8-bit operands for w8a8."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    if not s.activations:
        w = kernel.astype(x.dtype) * scale.astype(x.dtype)
        return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    x32 = x.astype(jnp.float32)
    x_scale = quant.nonzero_scale(jnp.abs(x32).max(axis=-1, keepdims=True) / s.qmax, jnp)
    xq = quant.to_8bit(x32 / x_scale, s.weight_dtype, jnp)
    accumulate = jnp.int32 if s.weight_dtype == "int8" else jnp.float32
    acc = jax.lax.dot_general(xq, kernel, dims, preferred_element_type=accumulate)
    return acc.astype(jnp.float32) * x_scale * scale


def _param(value: jax.Array, logical: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(logical_init(lambda *_: value, logical)(None, value.shape, value.dtype))


class QuantLinear(nnx.Module):
    """nnx.Linear with an 8-bit kernel and per-output-channel scales (`Scheme`); its parameters
    carry the logical axes `logical` = (in, out) as nnx.Linear's would."""

    def __init__(
        self,
        din: int,
        dout: int,
        logical: tuple[str | None, str | None],
        s: Scheme,
        *,
        dtype: DTypeLike,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ):
        # Random init (tests, abstract shapes): a quantized lecun-normal kernel.
        w = nnx.initializers.lecun_normal()(rngs.params(), (din, dout), jnp.float32)
        scale = jnp.abs(w).max(axis=0) / s.qmax
        q = quant.to_8bit(w / scale, s.weight_dtype, jnp)
        self.kernel = _param(q, logical)
        self.scale = _param(scale, logical[1:])
        self.bias = _param(jnp.zeros((dout,), param_dtype), logical[1:])
        self.scheme = s
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = quantized_matmul(x.astype(self.dtype), self.kernel[...], self.scale[...], self.scheme)
        return y.astype(self.dtype) + self.bias[...].astype(self.dtype)
