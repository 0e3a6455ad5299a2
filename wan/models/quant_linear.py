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


def quantized_matmul(
    x: jax.Array, kernel: jax.Array, scale: jax.Array, s: Scheme, contract: int = 1
) -> jax.Array:
    """x's last `contract` axes against the kernel's first as many, with the dequantized kernel,
    in float32: on 8-bit operands for w8a8. `scale` has the kernel's remaining (output) axes."""
    x_axes = tuple(range(x.ndim - contract, x.ndim))
    dims = ((x_axes, tuple(range(contract))), ((), ()))
    if not s.activations:
        w = kernel.astype(x.dtype) * scale.astype(x.dtype)
        return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    x32 = x.astype(jnp.float32)
    # One scale per token: the largest |x| over the features it contracts.
    x_scale = quant.nonzero_scale(jnp.abs(x32).max(axis=x_axes) / s.qmax, jnp)
    xq = quant.to_8bit(x32 / x_scale.reshape(*x_scale.shape, *[1] * contract), s.weight_dtype, jnp)
    accumulate = jnp.int32 if s.weight_dtype == "int8" else jnp.float32
    acc = jax.lax.dot_general(xq, kernel, dims, preferred_element_type=accumulate)
    out_axes = kernel.ndim - contract
    return acc.astype(jnp.float32) * x_scale.reshape(*x_scale.shape, *[1] * out_axes) * scale


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

    def __call__(
        self, x: jax.Array, contract: int = 1, out: tuple[int, ...] | None = None
    ) -> jax.Array:
        """x's last `contract` axes (the layer's input features) -> the output features, split
        into the axes `out` if given (transformer.linear)."""
        kernel = self.kernel[...]
        out = out or kernel.shape[1:]
        kernel = kernel.reshape(*x.shape[x.ndim - contract :], *out)
        scale, bias = (p[...].reshape(out) for p in (self.scale, self.bias))
        y = quantized_matmul(x.astype(self.dtype), kernel, scale, self.scheme, contract)
        return y.astype(self.dtype) + bias.astype(self.dtype)
