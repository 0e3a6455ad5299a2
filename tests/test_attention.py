"""Blockwise (flash-style) attention equals plain softmax attention; its memory is linear."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wan.attention import attention, blockwise_attention, dot_product_attention, resolve


def _qkv(q_len: int, kv_len: int, heads: int = 3, dim: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = [(2, q_len, heads, dim), (2, kv_len, heads, dim), (2, kv_len, heads, dim)]
    return [jnp.asarray(rng.standard_normal(s) * 2, jnp.float32) for s in shapes]


def _reference(q, k, v):
    """Textbook softmax attention in float64 numpy."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def test_dot_matches_reference():
    q, k, v = _qkv(13, 9)
    np.testing.assert_allclose(dot_product_attention(q, k, v), _reference(q, k, v), atol=1e-5)


@pytest.mark.parametrize(
    "q_len,kv_len,q_block,kv_block",
    [
        (64, 64, 16, 16),  # multiples of the blocks
        (37, 37, 8, 16),  # self-attention, neither length a multiple
        (45, 20, 8, 16),  # cross-attention: fewer keys than queries, last key block padded
        (10, 77, 4, 32),  # more keys than queries
        (5, 3, 8, 8),  # shorter than one block
    ],
)
def test_blockwise_equals_dot(q_len, kv_len, q_block, kv_block):
    q, k, v = _qkv(q_len, kv_len)
    got = jax.jit(blockwise_attention, static_argnames=("q_block", "kv_block"))(
        q, k, v, q_block=q_block, kv_block=kv_block
    )
    assert got.shape == q.shape
    np.testing.assert_allclose(got, dot_product_attention(q, k, v), atol=1e-5, rtol=0)


def test_blockwise_keeps_dtype():
    q, k, v = (t.astype(jnp.bfloat16) for t in _qkv(20, 20))
    out = blockwise_attention(q, k, v, q_block=8, kv_block=8)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        out.astype(jnp.float32),
        dot_product_attention(q, k, v).astype(jnp.float32),
        rtol=2e-2,
        atol=2e-2,
    )


def test_selector():
    q, k, v = _qkv(11, 6)
    expected = dot_product_attention(q, k, v)
    for impl in ("dot", "blockwise", "blockwise:4:4"):
        np.testing.assert_allclose(attention(q, k, v, impl), expected, atol=1e-5, rtol=0)
    for bad in ("flash", "blockwise:0:4", "blockwise:4", "dot:4:4"):
        with pytest.raises(ValueError, match="unknown attention"):
            resolve(bad)


def test_blockwise_temporaries_are_linear_in_length():
    """Compiled (not run) at 16k tokens: the full score matrix would be 1 GiB of fp32."""
    seq, heads, dim = 16384, 1, 8
    spec = jax.ShapeDtypeStruct((1, seq, heads, dim), jnp.float32)

    def temp_bytes(fn) -> int:
        return jax.jit(fn).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes

    blockwise = temp_bytes(lambda q, k, v: blockwise_attention(q, k, v, q_block=256, kv_block=256))
    dot = temp_bytes(dot_product_attention)
    assert dot >= seq * seq * 4
    assert blockwise < 64 * seq * heads * dim * 4  # a few copies of q/k/v plus one score block
