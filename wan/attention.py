"""Multi-head attention kernels on (batch, length, heads, head_dim) tensors, in pure JAX.

`dot_product_attention` materialises the full score matrix; `blockwise_attention` is the
flash-attention recurrence (online softmax over key blocks, queries processed block by block),
so its temporaries are linear in the sequence length: at 720p x 81 frames (75,600 tokens,
40 heads) the full score matrix alone would be ~0.9 TB in fp32.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp

Attention = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """Scaled q.k^T in fp32: (B, Sq, H, D) x (B, Sk, H, D) -> (B, H, Sq, Sk)."""
    scale = q.shape[-1] ** -0.5
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D)) v with an fp32 softmax; (B, Sq, H, D) -> (B, Sq, H, D)."""
    probs = jax.nn.softmax(_scores(q, k), axis=-1)
    out = jnp.einsum(
        "bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.astype(q.dtype)


def _pad_to(x: jax.Array, multiple: int) -> jax.Array:
    """Zero-pad the length axis (1) of x up to a multiple of `multiple`."""
    pad = -x.shape[1] % multiple
    return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """(B, S, H, D) with S a multiple of size -> (S // size, B, size, H, D)."""
    b, s, h, d = x.shape
    return x.reshape(b, s // size, size, h, d).swapaxes(0, 1)


def blockwise_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, q_block: int = 1024, kv_block: int = 1024
) -> jax.Array:
    """Same result as `dot_product_attention`, computed flash-style for any lengths.

    Keys/values are zero-padded to a multiple of `kv_block` and the padded keys masked out;
    queries are padded to a multiple of `q_block` and the padded rows sliced off. The largest
    temporary is one (B, H, q_block, kv_block) fp32 score block.
    """
    b, q_len, h, d = q.shape
    kv_len = k.shape[1]
    q_block, kv_block = min(q_block, q_len), min(kv_block, kv_len)
    k_blocks = _blocks(_pad_to(k, kv_block), kv_block)
    v_blocks = _blocks(_pad_to(v, kv_block), kv_block)
    # Valid-key mask per block; the last block always holds at least one real key, so every
    # running maximum below is finite and exp(-inf - m) = 0 removes padded keys exactly.
    key_valid = (jnp.arange(k_blocks.shape[0] * kv_block) < kv_len).reshape(-1, kv_block)
    # Query block j holds rows j, j + n, j + 2n, ... of the n blocks. Queries are independent,
    # and when the length axis is sharded (context parallelism) every device then keeps its
    # own rows of each block, instead of the loop slicing blocks that live on one device.
    q_padded = _pad_to(q, q_block)
    n = q_padded.shape[1] // q_block
    q_blocks = q_padded.reshape(b, q_block, n, h, d).transpose(2, 0, 1, 3, 4)

    def one_query_block(q_blk: jax.Array) -> jax.Array:
        init = (
            jnp.full((b, h, q_block), -jnp.inf, jnp.float32),  # running max of the scores
            jnp.zeros((b, h, q_block), jnp.float32),  # running softmax denominator
            jnp.zeros((b, h, q_block, d), jnp.float32),  # running unnormalised output
        )

        def step(carry, kv):
            m, denom, acc = carry
            k_blk, v_blk, valid = kv
            s = jnp.where(valid, _scores(q_blk, k_blk), -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            denom = denom * correction + p.sum(axis=-1)
            pv = jnp.einsum(
                "bhqk,bkhd->bhqd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32
            )
            return (m_new, denom, acc * correction[..., None] + pv), None

        (_, denom, acc), _ = jax.lax.scan(step, init, (k_blocks, v_blocks, key_valid))
        return (acc / denom[..., None]).transpose(0, 2, 1, 3).astype(q.dtype)

    out = jax.lax.map(one_query_block, q_blocks)  # (n, B, q_block, H, D)
    return out.transpose(1, 2, 0, 3, 4).reshape(b, -1, h, d)[:, :q_len]


def resolve(impl: str) -> Attention:
    """The attention function an implementation name selects: 'dot', 'blockwise' (default
    blocks) or 'blockwise:<q_block>:<kv_block>'."""
    if impl == "dot":
        return dot_product_attention
    if impl == "blockwise":
        return blockwise_attention
    if sizes := re.fullmatch(r"blockwise:([1-9]\d*):([1-9]\d*)", impl):
        return functools.partial(blockwise_attention, q_block=int(sizes[1]), kv_block=int(sizes[2]))
    raise ValueError(
        f"unknown attention implementation {impl!r}: use 'dot', 'blockwise' or "
        "'blockwise:<q_block>:<kv_block>'"
    )


def attention(q: jax.Array, k: jax.Array, v: jax.Array, impl: str = "dot") -> jax.Array:
    """Multi-head attention computed by the implementation `impl` names (see `resolve`)."""
    return resolve(impl)(q, k, v)
