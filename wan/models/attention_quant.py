"""8-bit self-attention (`aot build --attention-quant int8|fp8`), SageAttention's scheme.

K is smoothed first: each (video, head) loses its mean key over the real tokens. That is exact:
q.(k - mean) = q.k - q.mean, a constant per query row, and the softmax over the keys does not
see it. It removes the large per-channel key offsets that DiT activations carry, which would
otherwise take the whole 8-bit range. Q and the smoothed K are then quantized symmetrically, one
scale per (video, head, kernel block): int8 rounds half to even and clips to [-127, 127], fp8
(float8_e4m3fn) casts after scaling into [-448, 448]. Q K^T runs on 8-bit operands (int32
accumulation for int8, float32 for fp8) and is rescaled by the two blocks' scales and
1/sqrt(D). P V runs in bf16 with int8 (the TPUs with an int8 unit have no fp8 one), in fp8 with
fp8 (tpu7x): P in [0, 1] times 448, V with one scale per (video, head, channel).

Two kernels run it: `quant_splash_attention`, a Pallas TPU flash kernel (online softmax over
key blocks, the blocks a Radial mask drops skipped, partly kept ones masked) that runs in
interpret mode elsewhere; and `blockwise_attention(..., quant=...)`, the same arithmetic in XLA,
the CPU reference. Cross-attention stays in the build's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from wan.models.radial_mask import RadialSpec, kernel_blocks_kept, radial_keep
from wan.models.tpu_flash import heads_major, softmax_scratch

P_SCALE = 448.0  # fp8 P V: P in [0, 1] scaled to e4m3's largest normal


@dataclasses.dataclass(frozen=True)
class Format:
    dtype: jnp.dtype
    qmax: float
    accumulate: jnp.dtype  # of the 8-bit Q K^T
    pv_in_8bit: bool  # P V on 8-bit operands too


FORMATS = {
    "int8": Format(jnp.dtype(jnp.int8), 127.0, jnp.dtype(jnp.int32), pv_in_8bit=False),
    "fp8": Format(jnp.dtype(jnp.float8_e4m3fn), 448.0, jnp.dtype(jnp.float32), pv_in_8bit=True),
}


def smooth_keys(k: jax.Array, length: int) -> jax.Array:
    """k (B, S, H, D) less each (video, head)'s mean key over its first `length` tokens (the
    real ones); padded keys stay zero."""
    real = k[:, :length].astype(jnp.float32)
    smoothed = real - real.mean(axis=1, keepdims=True)
    return jnp.pad(smoothed, ((0, 0), (0, k.shape[1] - length), (0, 0), (0, 0))).astype(k.dtype)


def quantize_blocked(blocks: jax.Array, fmt: Format) -> tuple[jax.Array, jax.Array]:
    """Blocked tokens (n, B, block, H, D) -> (8-bit blocks, scales (n, B, H)): one symmetric
    scale per block, video and head (an all-zero block gets scale 1); int8 rounds half to even
    and clips, fp8 casts."""
    amax = jnp.abs(blocks.astype(jnp.float32)).max(axis=(2, 4))
    scale = jnp.where(amax > 0, amax / fmt.qmax, 1.0)
    scaled = blocks.astype(jnp.float32) / scale[:, :, None, :, None]
    if fmt.dtype == jnp.int8:
        scaled = jnp.clip(jnp.round(scaled), -fmt.qmax, fmt.qmax)
    return scaled.astype(fmt.dtype), scale


def quantize_blocks(x: jax.Array, block: int, fmt: Format) -> tuple[jax.Array, jax.Array]:
    """x (B, S, H, D), S a multiple of `block` -> (8-bit x, scales (B, H, S // block)): the
    blocks are consecutive tokens."""
    b, s, h, d = x.shape
    x8, scale = quantize_blocked(x.reshape(b, s // block, block, h, d).swapaxes(0, 1), fmt)
    return x8.swapaxes(0, 1).reshape(x.shape), scale.transpose(1, 2, 0)


def quantize_values(v: jax.Array, fmt: Format) -> tuple[jax.Array, jax.Array]:
    """V (B, S, H, D) -> (V on P V's operands, per-channel scales (B, H, D); ones in bf16)."""
    b, _, h, d = v.shape
    if not fmt.pv_in_8bit:
        return v.astype(jnp.bfloat16), jnp.ones((b, h, d), jnp.float32)
    amax = jnp.abs(v.astype(jnp.float32)).max(axis=1)  # (B, H, D)
    scale = jnp.where(amax > 0, amax / fmt.qmax, 1.0)
    return (v.astype(jnp.float32) / scale[:, None]).astype(fmt.dtype), scale


def qk_scores(q8: jax.Array, k8: jax.Array, fmt: Format, spec: str) -> jax.Array:
    """The 8-bit Q K^T (einsum `spec`), accumulated in the format's type, as float32 (at the
    8-bit operands' own precision, whatever the caller's default matmul precision)."""
    return jnp.einsum(
        spec, q8, k8, preferred_element_type=fmt.accumulate, precision=jax.lax.Precision.DEFAULT
    ).astype(jnp.float32)


def pv_product(p: jax.Array, v8: jax.Array, fmt: Format, spec: str) -> jax.Array:
    """P (float32, in [0, 1]) V on P V's operands (einsum `spec`), float32; in fp8, P is scaled
    by P_SCALE (the caller divides it out with V's scales)."""
    p = (p * P_SCALE).astype(fmt.dtype) if fmt.pv_in_8bit else p.astype(jnp.bfloat16)
    return jnp.einsum(
        spec, p, v8, preferred_element_type=jnp.float32, precision=jax.lax.Precision.DEFAULT
    )


def pv_rescale(fmt: Format) -> float:
    return 1.0 / P_SCALE if fmt.pv_in_8bit else 1.0


# ----------------------------------------------------------------------------------------------
# The Pallas TPU kernel.


def _kernel(
    table_ref, q_scale_ref, k_scale_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref,
    *, fmt: Format, kv_len: int, sm_scale: float, sparse: RadialSpec | None,
):  # fmt: skip
    """One (video x head, query block, key block) step of the online softmax; the key blocks
    the table marks 0 (the mask keeps none of their entries) do nothing."""
    h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bkv = q_ref.shape[0], k_ref.shape[0]

    @pl.when(j == 0)
    def _start():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(table_ref[i, j] != 0)
    def _attend():
        s = qk_scores(q_ref[...], k_ref[...], fmt, "qd,kd->qk")
        s = s * (q_scale_ref[h, i] * k_scale_ref[h, j] * sm_scale)
        key_ids = j * bkv + jax.lax.broadcasted_iota(jnp.int32, (bq, bkv), 1)
        keep = key_ids < kv_len
        if sparse is not None:
            query_ids = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bkv), 0)
            keep = keep & radial_keep(sparse, query_ids, key_ids)
        s = jnp.where(keep, s, -jnp.inf)
        m_prev, l_prev = m_ref[...][:, :1], l_ref[...][:, :1]
        m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with no key kept yet
        p = jnp.exp(s - m_safe)
        correction = jnp.exp(m_prev - m_safe)
        l_ref[...] = jnp.broadcast_to(l_prev * correction + p.sum(-1, keepdims=True), l_ref.shape)
        m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
        pv = pv_product(p, v_ref[...], fmt, "qk,kd->qd")
        acc_ref[...] = acc_ref[...] * correction + pv

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        denom = l_ref[...][:, :1]
        out = acc_ref[...] / jnp.where(denom == 0, 1.0, denom)  # an emptied row: 0
        o_ref[...] = out.astype(o_ref.dtype)


def block_table(sparse: RadialSpec | None, q_pad: int, kv_pad: int, bq: int, bkv: int):
    """(q blocks, key blocks) int32: 1 where the kernel computes the block."""
    if sparse is None:
        return np.ones((q_pad // bq, kv_pad // bkv), np.int32)
    return kernel_blocks_kept(sparse, bq, bkv).astype(np.int32)


def quant_splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    blocks: tuple[int, int],
    fmt: str,
    interpret: bool,
    sparse: RadialSpec | None = None,
) -> jax.Array:
    """8-bit flash attention on TPU (module docstring) with query and key blocks `blocks`
    (multiples of 128, balanced to the lengths by the caller); lengths need not be multiples:
    both are zero-padded, padded keys masked, padded query rows sliced off."""
    f = FORMATS[fmt]
    b, q_len, heads, d = q.shape
    kv_len = k.shape[1]
    bq, bkv = blocks
    q_pad, kv_pad = -(-q_len // bq) * bq, -(-kv_len // bkv) * bkv
    q8, q_scale = quantize_blocks(_pad_length(q, q_pad), bq, f)
    k8, k_scale = quantize_blocks(_pad_length(smooth_keys(k, kv_len), kv_pad), bkv, f)
    v8, v_scale = quantize_values(_pad_length(v, kv_pad), f)

    table = block_table(sparse, q_pad, kv_pad, bq, bkv)
    kernel = functools.partial(_kernel, fmt=f, kv_len=kv_len, sm_scale=d**-0.5, sparse=sparse)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,  # the block table, Q's and K's scales: (B*H, blocks)
            grid=(b * heads, q_pad // bq, kv_pad // bkv),
            in_specs=[
                pl.BlockSpec((None, bq, d), lambda h, i, j, *_: (h, i, 0)),
                pl.BlockSpec((None, bkv, d), lambda h, i, j, *_: (h, j, 0)),
                pl.BlockSpec((None, bkv, d), lambda h, i, j, *_: (h, j, 0)),
            ],
            out_specs=pl.BlockSpec((None, bq, d), lambda h, i, j, *_: (h, i, 0)),
            scratch_shapes=softmax_scratch(bq, d),
        ),
        out_shape=jax.ShapeDtypeStruct((b * heads, q_pad, d), jnp.float32),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="quant_splash_attention",
    )(
        jnp.asarray(table),
        q_scale.reshape(b * heads, -1),
        k_scale.reshape(b * heads, -1),
        heads_major(q8, q_pad),
        heads_major(k8, kv_pad),
        heads_major(v8, kv_pad),
    )
    out = out.reshape(b, heads, q_pad, d) * (pv_rescale(f) * v_scale[:, :, None, :])
    return out.transpose(0, 2, 1, 3)[:, :q_len].astype(q.dtype)


def _pad_length(x: jax.Array, length: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
