"""Multi-head attention on (batch, length, heads, head_dim) tensors, and how it is sharded.

Kernels: `dot` materialises the full score matrix; `blockwise` is the flash-attention recurrence
in pure JAX (online softmax over key blocks, linear memory: at 720p x 81 frames, 75,600 tokens
and 40 heads, the full score matrix alone would be ~0.9 TB in fp32); `flash` is this project's
Pallas TPU flash kernel (wan.models.tpu_flash), `splash` JAX's (slower on v5e:
docs/benchmarks.md, "On a TPU v5e chip"); `triton` a Pallas Triton flash kernel for NVIDIA
GPUs, which compiles without the GPU (deviceless builds); `cudnn` is cuDNN's fused flash
attention on NVIDIA GPUs (its graph is built only with the GPU attached).

Context parallelism (the video tokens sharded over devices): `gather` keeps queries sharded on
length and gives every device all keys and values; `ulysses` all-to-alls q, k and v from
length-sharded to head-sharded, attends the whole sequence for the local heads, and all-to-alls
the result back. Pallas kernels and Ulysses run inside `shard_map`; `dot` and `blockwise` with
`gather` are left to XLA's partitioner.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel,
)
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from wan import axes, sharding
from wan.models import attention_quant, tpu_flash
from wan.models.radial_mask import RadialSpec, RadialSplashMask, density, radial_keep
from wan.models.tpu_flash import LANES, heads_major

Attention = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """Scaled q.k^T in fp32: (B, Sq, H, D) x (B, Sk, H, D) -> (B, H, Sq, Sk)."""
    scale = q.shape[-1] ** -0.5
    return jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, sparse: RadialSpec | None = None
) -> jax.Array:
    """softmax(q k^T / sqrt(D)) v with an fp32 softmax; (B, Sq, H, D) -> (B, Sq, H, D);
    with `sparse`, over the entries its Radial mask keeps."""
    scores = _scores(q, k)
    if sparse is not None:
        _check_sparse(sparse, q.shape[1], k.shape[1])
        ids = jnp.arange(sparse.tokens)
        keep = radial_keep(sparse, ids[:, None], ids[None, :])
        scores = jnp.where(keep, scores, jnp.finfo(scores.dtype).min)  # a row it empties: 0
        probs = jnp.where(keep, jax.nn.softmax(scores, axis=-1), 0.0)
    else:
        probs = jax.nn.softmax(scores, axis=-1)
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


# Longer than most: one online softmax with its sparse and 8-bit variants (the kernels' reference).
def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_block: int = 1024,
    kv_block: int = 1024,
    sparse: RadialSpec | None = None,
    quant: str | None = None,
) -> jax.Array:
    """Same result as `dot_product_attention`, computed flash-style for any lengths; with
    `sparse`, over the entries its Radial mask keeps (self-attention of its video tokens); with
    `quant` ("int8" or "fp8"), in 8 bits (wan.models.attention_quant: one scale per video, head
    and block of this kernel).

    Keys/values are zero-padded to a multiple of `kv_block` and the padded keys masked out;
    queries are padded to a multiple of `q_block` and the padded rows sliced off. The largest
    temporary is one (B, H, q_block, kv_block) fp32 score block. The mask is applied entry by
    entry (this kernel computes every block: it is the reference, not the fast path).
    """
    _check_sparse(sparse, q.shape[1], k.shape[1])
    b, q_len, h, d = q.shape
    kv_len = k.shape[1]
    q_block, kv_block = min(q_block, q_len), min(kv_block, kv_len)
    fmt = None if quant is None else attention_quant.FORMATS[quant]
    v_scale = None
    if fmt is not None:
        k = attention_quant.smooth_keys(k, kv_len)
        v, v_scale = attention_quant.quantize_values(v, fmt)
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
    # Sparse, each block also needs the indices of its queries and keys (for the mask); in 8
    # bits, each block its scales.
    q_xs = q_blocks if sparse is None else (q_blocks, jnp.arange(n))
    key_ids = jnp.arange(k_blocks.shape[0] * kv_block).reshape(-1, kv_block)
    kv_xs = (k_blocks, v_blocks, key_valid) + (() if sparse is None else (key_ids,))
    if fmt is not None:
        q8, q_scales = attention_quant.quantize_blocked(q_blocks, fmt)
        k8, k_scales = attention_quant.quantize_blocked(k_blocks, fmt)
        q_xs = (q8, jnp.arange(n), q_scales)
        kv_xs = (k8, v_blocks, key_valid, key_ids, k_scales)

    def scores(q_blk: jax.Array, k_blk: jax.Array, q_scale=None, k_scale=None) -> jax.Array:
        if fmt is None:
            return _scores(q_blk, k_blk)
        s = attention_quant.qk_scores(q_blk, k_blk, fmt, "bqhd,bkhd->bhqk")
        return s * (q_scale * k_scale * d**-0.5)[..., None, None]

    def one_query_block(x: jax.Array | tuple[jax.Array, ...]) -> jax.Array:
        q_blk, j, *q_scale = (x, None) if sparse is None and fmt is None else x
        init = (
            jnp.full((b, h, q_block), -jnp.inf, jnp.float32),  # running max of the scores
            jnp.zeros((b, h, q_block), jnp.float32),  # running softmax denominator
            jnp.zeros((b, h, q_block, d), jnp.float32),  # running unnormalised output
        )

        def step(carry, kv):
            m, denom, acc = carry
            k_blk, v_blk, valid, *ids = kv
            if sparse is not None:
                query_ids = j + n * jnp.arange(q_block)
                valid = valid & radial_keep(sparse, query_ids[:, None], ids[0][None, :])
            s = jnp.where(valid, scores(q_blk, k_blk, *q_scale, *ids[1:]), -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            if sparse is not None:  # a row whose keys so far were all dropped: 0, not NaN
                m_new = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            denom = denom * correction + p.sum(axis=-1)
            if fmt is None:
                pv = jnp.einsum(
                    "bhqk,bkhd->bhqd",
                    p.astype(v_blk.dtype),
                    v_blk,
                    preferred_element_type=jnp.float32,
                )
            else:
                pv = attention_quant.pv_product(p, v_blk, fmt, "bhqk,bkhd->bhqd")
            return (m_new, denom, acc * correction[..., None] + pv), None

        (_, denom, acc), _ = jax.lax.scan(step, init, kv_xs)
        out = acc / denom[..., None]
        if fmt is not None:
            out = out * (attention_quant.pv_rescale(fmt) * v_scale[:, :, None, :])
        return out.transpose(0, 2, 1, 3).astype(q.dtype)

    out = jax.lax.map(one_query_block, q_xs)  # (n, B, q_block, H, D)
    return out.transpose(1, 2, 0, 3, 4).reshape(b, -1, h, d)[:, :q_len]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def balanced_block(length: int, largest: int, multiple: int) -> int:
    """The block of at most `largest` (a multiple of `multiple`) that splits `length` into the
    fewest blocks with the least padding: 75,600 tokens and 3072 give 25 blocks of 3072."""
    largest = max(multiple, largest // multiple * multiple)
    count = -(-length // largest)
    return min(largest, _round_up(-(-length // count), multiple))


@dataclasses.dataclass(frozen=True)
class TpuBlocks:
    """Largest block sizes of the TPU flash kernels (queries, keys, keys per matmul); each call
    balances them to its lengths. Multiples of the TPU lane width (128)."""

    q: int
    kv: int
    kv_compute: int

    def balanced(self, q_len: int, kv_len: int) -> tuple[int, int]:
        """The query and key blocks a call on these lengths runs."""
        return balanced_block(q_len, self.q, LANES), balanced_block(kv_len, self.kv, LANES)

    def fitted(self, q_len: int, kv_len: int) -> tuple[int, int, int]:
        """The query and key blocks and keys per matmul a call on these lengths runs."""
        bq, bkv = self.balanced(q_len, kv_len)
        bkv_compute = balanced_block(bkv, min(self.kv_compute, bkv), LANES)
        return bq, bkv, bkv_compute if bkv % bkv_compute == 0 else bkv

    def within(self, block: int, halves: bool = False) -> TpuBlocks:
        """These blocks, none larger than `block` (`halves`: query blocks up to twice it): those
        a Radial mask of `block`-token blocks runs at, so that every block it keeps is kept
        whole (a partly kept one is masked entry by entry; wan.models.tpu_flash visits a key
        block one half of its query block keeps with that half alone). The dense calls of the
        same build keep the larger blocks."""
        q = min(self.q, 2 * block if halves else block)
        return TpuBlocks(q, min(self.kv, block), min(self.kv_compute, block))


TPU_KERNELS = ("flash", "splash")


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    blocks: TpuBlocks,
    interpret: bool,
    sparse: RadialSpec | None = None,
    kv_len: int | None = None,
) -> jax.Array:
    """wan.models.tpu_flash's kernel at `blocks` fitted to the lengths (queries and keys are
    zero-padded to their blocks; `kv_len`: the keys past it are padding already)."""
    kv_len = k.shape[1] if kv_len is None else kv_len
    _check_sparse(sparse, q.shape[1], kv_len, k.shape[1])
    return tpu_flash.flash_attention(
        q, k, v, blocks=blocks.fitted(q.shape[1], kv_len), interpret=interpret, sparse=sparse,
        kv_len=kv_len,
    )  # fmt: skip


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    blocks: TpuBlocks,
    interpret: bool,
    sparse: RadialSpec | None = None,
    kv_len: int | None = None,
) -> jax.Array:
    """JAX's Pallas splash attention (TPU; `interpret` runs the same kernel in plain JAX
    elsewhere); with `sparse`, its Radial mask as splash's block-sparse mask: blocks it drops
    whole are skipped, blocks it keeps in part are masked inside the kernel.

    Lengths need not be block multiples: queries and keys are zero-padded to their blocks,
    padded keys never contribute and the padded query rows are sliced off. `kv_len`: the keys
    past it are padding already (a transformer's tokens padded to `padded_length`)."""
    b, q_len, heads, d = q.shape
    kv_len = k.shape[1] if kv_len is None else kv_len
    _check_sparse(sparse, q_len, kv_len, k.shape[1])
    bq, bkv, bkv_compute = blocks.fitted(q_len, kv_len)
    q_pad, kv_pad = _round_up(q_len, bq), _round_up(k.shape[1], bkv)
    # Dense: padded keys get another segment id than every query. Sparse: the stored mask
    # drops them (its partly kept blocks are masked anyway; ids would be a second mask). On
    # v5e, a stored mask of the pad keys in place of the ids made the dense call 5% slower:
    # with any partly kept block, splash applies its stored mask in every block.
    one = (
        splash_mask.FullMask((q_pad, kv_pad))
        if sparse is None
        else RadialSplashMask(sparse, (q_pad, kv_pad))
    )
    mask = splash_mask.MultiHeadMask([one] * (b * heads))
    # Keys sequence-minor: the layout XLA gives their projection, norm and rope on TPU
    # (transformer.linear), so they reach the kernel without a copy. Values come out
    # head-dim-minor. Queries too are taken head-dim-minor (a copy): sequence-minor, the kernel
    # would transpose them in every key step (docs/benchmarks.md, "Where a dense step goes").
    kernel = splash_kernel.make_splash_mha(
        mask,
        block_sizes=splash_kernel.BlockSizes(
            block_q=bq, block_kv=bkv, block_kv_compute=bkv_compute,
            k_layout=splash_kernel.QKVLayout.SEQ_MINOR,
        ),
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )  # fmt: skip

    scaled = (q.astype(jnp.float32) * d**-0.5).astype(q.dtype)
    segments = None
    if sparse is None:
        kv_ids = (jnp.arange(kv_pad) >= kv_len).astype(jnp.int32)
        segments = splash_kernel.SegmentIds(q=jnp.zeros((q_pad,), jnp.int32), kv=kv_ids)
    out = kernel(
        heads_major(scaled, q_pad), heads_major(k, kv_pad), heads_major(v, kv_pad), segments
    )
    return out.reshape(b, heads, q_pad, d).transpose(0, 2, 1, 3)[:, :q_len].astype(q.dtype)


def padded_length(impl: str, length: int, quant: str | None = None) -> int:
    """The length self-attention over `length` tokens is computed at: a TPU kernel's padded
    length where its query block is a multiple of its key block (both then divide it), else
    (and for the other kernels) `length`. A transformer pads its tokens to it once a pass."""
    if kernel_name(impl) not in TPU_KERNELS or quant is not None:
        return length
    bq, bkv = tpu_blocks(impl).balanced(length, length)
    return _round_up(length, bq) if bq % bkv == 0 else length


@dataclasses.dataclass(frozen=True)
class TritonBlocks:
    """Flash blocks of the Triton kernel: queries a program instance, keys a loop step."""

    q: int = 128
    kv: int = 64

    def fitted(self, q_len: int, kv_len: int) -> tuple[int, int]:
        """The query and key blocks a call on these lengths runs."""
        return (
            min(self.q, max(TRITON_MIN_BLOCK, _power_of_two(q_len))),
            min(self.kv, max(TRITON_MIN_BLOCK, _power_of_two(kv_len))),
        )

    def skips(self, sparse: RadialSpec, q_len: int, kv_len: int) -> bool:
        """Whether the kernel skips the key blocks `sparse` drops (its blocks fit the mask's)."""
        return all(sparse.block % n == 0 for n in self.fitted(q_len, kv_len))


TRITON_MIN_BLOCK = 16  # Triton's dot needs every side of a tile >= 16


def _triton_kernel(
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    *,
    kv_len: int,
    block_kv: int,
    scale: float,
    sparse: RadialSpec | None,
    skips: bool,
):
    """One query block of one (video, head) against every key block: the online softmax of
    `blockwise_attention`, in base 2 (exp2), keys past `kv_len` (padding) masked out. With
    `sparse`, a Radial mask: entries it drops masked, and with `skips` (the kernel's blocks fit
    in the mask's: a (query, key) block is kept or dropped whole) a key block it drops skipped."""
    block_q, d = q_ref.shape
    q = q_ref[...]
    q_start = None if sparse is None else pl.program_id(0) * block_q

    def attend(start, carry):
        acc, m, denom = carry
        k = k_ref[pl.ds(start, block_kv), :]
        v = v_ref[pl.ds(start, block_kv), :]
        s = pl_triton.dot(q, k, trans_b=True) * (scale * math.log2(math.e))  # fp32 accumulation
        key_ids = start + jnp.arange(block_kv)
        if kv_len % block_kv:  # static: only a padded sequence needs the mask
            s = jnp.where((key_ids < kv_len)[None, :], s, -jnp.inf)
        if sparse is not None:
            query_ids = q_start + jnp.arange(block_q)
            s = jnp.where(radial_keep(sparse, query_ids[:, None], key_ids[None, :]), s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        if sparse is not None:  # a row whose keys so far were all dropped: 0, not NaN
            m_new = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - m_new[:, None])
        correction = jnp.exp2(m - m_new)
        acc = acc * correction[:, None] + pl_triton.dot(p.astype(v.dtype), v)
        return acc, m_new, denom * correction + p.sum(axis=-1)

    def step(i, carry):
        start = i * block_kv
        if not skips:
            return attend(start, carry)
        kept = radial_keep(sparse, q_start, start)  # the whole block's verdict
        return jax.lax.cond(kept, lambda c: attend(start, c), lambda c: c, carry)

    init = (
        jnp.zeros((block_q, d), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, _, denom = jax.lax.fori_loop(0, k_ref.shape[0] // block_kv, step, init)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)


def _power_of_two(n: int) -> int:
    """The least power of two >= n."""
    return 1 << (n - 1).bit_length()


def triton_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    blocks: TritonBlocks,
    interpret: bool,
    sparse: RadialSpec | None = None,
) -> jax.Array:
    """Pallas Triton flash attention (NVIDIA GPUs; `interpret` runs it in plain JAX elsewhere).

    Any lengths: queries and keys are zero-padded to their blocks, padded keys masked in the
    kernel and padded query rows sliced off; the head dim is zero-padded to a power of two
    (zero columns add nothing to q.k and give zero output columns, sliced off)."""
    b, q_len, heads, d = q.shape
    kv_len = k.shape[1]
    bq, bkv = blocks.fitted(q_len, kv_len)
    q_pad, kv_pad, d_pad = _round_up(q_len, bq), _round_up(kv_len, bkv), _power_of_two(d)

    def padded(x: jax.Array, length: int) -> jax.Array:
        return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, d_pad - d)))

    _check_sparse(sparse, q_len, kv_len)
    kernel = functools.partial(
        _triton_kernel, kv_len=kv_len, block_kv=bkv, scale=d**-0.5, sparse=sparse,
        skips=sparse is not None and blocks.skips(sparse, q_len, kv_len),
    )  # fmt: skip
    kv_spec = pl.BlockSpec((None, kv_pad, None, d_pad), lambda i, j, h: (j, 0, h, 0))
    q_spec = pl.BlockSpec((None, bq, None, d_pad), lambda i, j, h: (j, i, h, 0))
    out = pl.pallas_call(
        kernel,
        grid=(q_pad // bq, b, heads),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((b, q_pad, heads, d_pad), q.dtype),
        compiler_params=pl_triton.CompilerParams(num_warps=4 if d_pad <= 64 else 8, num_stages=2),
        interpret=interpret,
        name="wan_triton_flash_attention",
    )(padded(q, q_pad), padded(k, kv_pad), padded(v, kv_pad))
    return out[:, :q_len, :, :d]


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """cuDNN's fused flash attention (NVIDIA GPUs), any lengths."""
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def _check_sparse(
    sparse: RadialSpec | None, q_len: int, kv_len: int, padded: int | None = None
) -> None:
    """A Radial mask is over one video's tokens: self-attention of exactly that length, or of
    its tokens `padded` (queries and keys alike) with `kv_len` of them real."""
    if sparse is not None and not (q_len == (padded or kv_len) and kv_len == sparse.tokens):
        raise ValueError(
            f"radial attention is self-attention over the {sparse.tokens} video tokens of its "
            f"spec, not {q_len} queries and {kv_len} keys"
        )


def _quant_tpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    blocks: TpuBlocks,
    fmt: str,
    interpret: bool,
    sparse: RadialSpec | None,
) -> jax.Array:
    """The 8-bit TPU kernel at the blocks the bf16 kernels would run these lengths with."""
    _check_sparse(sparse, q.shape[1], k.shape[1])
    return attention_quant.quant_splash_attention(
        q, k, v, blocks=blocks.balanced(q.shape[1], k.shape[1]), fmt=fmt, interpret=interpret,
        sparse=sparse,
    )  # fmt: skip


# The kernels 8-bit attention runs in: the TPU kernels' 8-bit variant, blockwise (the reference).
QUANT_KERNELS = (*TPU_KERNELS, "blockwise")
# The kernels a Radial mask runs in: the TPU and GPU kernels skip the blocks it drops, the
# XLA kernels (CPU, short sequences) mask entry by entry.
SPARSE_KERNELS = (*TPU_KERNELS, "triton", "blockwise", "dot")
CONTEXT_PARALLEL = ("gather", "ulysses")
# Kernels XLA's SPMD partitioner can split by itself; the others run inside shard_map.
PARTITIONABLE = ("dot", "blockwise")
# The platform each hardware kernel runs on (elsewhere only interpreted); the rest run anywhere.
KERNEL_PLATFORM = {"flash": "tpu", "splash": "tpu", "triton": "gpu", "cudnn": "gpu"}
Q_AXES = (axes.BATCH, axes.LENGTH, axes.HEADS, None)
KV_AXES = (axes.BATCH, axes.KV_LENGTH, axes.HEADS, None)  # gathered: every query sees every key

_SIZES = r"(?::([1-9]\d*))"


def kernel_name(impl: str) -> str:
    """'splash:3072:2048:1024' -> 'splash'."""
    return impl.partition(":")[0]


def flops(q_shape: tuple[int, ...], kv_length: int) -> int:
    """Multiply-adds x 2 of q k^T and p v for queries of `q_shape` (B, S, H, D)."""
    b, s, h, d = q_shape
    return 4 * b * s * h * kv_length * d


@functools.cache  # a build asks once per analysis of each step program
def kernel_density(impl: str, sparse: RadialSpec) -> float:
    """The fraction of query/key blocks the kernel `impl` computes in self-attention under the
    mask `sparse` (radial_mask.density at its blocks): the TPU kernels skip every block the mask
    drops, Triton those it drops whole where its blocks fit in the mask's, the XLA kernels
    none."""
    name, n = kernel_name(impl), sparse.tokens
    if name in TPU_KERNELS:
        bq, bkv = call_blocks(impl, sparse.block).balanced(n, n)
        if name == "flash":
            return tpu_flash.computed_fraction(sparse, bq, bkv)
        return density(sparse, bq, bkv)
    if name == "triton" and (blocks := _triton_blocks(impl)).skips(sparse, n, n):
        return density(sparse, *blocks.fitted(n, n))
    return 1.0


def resolve(
    impl: str,
    *,
    interpret: bool = False,
    sparse: RadialSpec | None = None,
    quant: str | None = None,
) -> Attention:
    """The attention function an implementation name selects: 'dot', 'blockwise' (default
    blocks), 'blockwise:<q_block>:<kv_block>', 'flash:<q>:<kv>:<kv_compute>' or
    'splash:<q>:<kv>:<kv_compute>' (largest block sizes), 'triton[:<q>:<kv>]' or 'cudnn'.
    `interpret`: run Pallas kernels in interpret mode (not on their hardware); `sparse`: a Radial mask (SPARSE_KERNELS only; a TPU kernel runs it at `call_blocks`); `quant`: 8-bit
    attention, "int8" or "fp8" (QUANT_KERNELS only; on TPU wan.models.attention_quant's
    kernel)."""
    if quant is not None:
        if kernel_name(impl) not in QUANT_KERNELS:
            raise ValueError(
                f"attention {impl!r} has no 8-bit variant: 8-bit attention runs in "
                f"{' or '.join(QUANT_KERNELS)}"
            )
        if quant not in attention_quant.FORMATS:
            raise ValueError(
                f"8-bit attention {quant!r}: use {' or '.join(attention_quant.FORMATS)}"
            )
        if kernel_name(impl) in TPU_KERNELS:  # its kernel visits whole blocks only
            blocks = tpu_blocks(impl) if sparse is None else tpu_blocks(impl).within(sparse.block)
            return functools.partial(
                _quant_tpu, blocks=blocks, fmt=quant, interpret=interpret, sparse=sparse
            )
        return functools.partial(resolve(impl, sparse=sparse), quant=quant)
    if sparse is not None:
        if kernel_name(impl) not in SPARSE_KERNELS:
            raise ValueError(
                f"attention {impl!r} has no sparse mask: radial attention runs in "
                f"{' or '.join(SPARSE_KERNELS)}"
            )
        if kernel_name(impl) not in TPU_KERNELS:
            return functools.partial(resolve(impl, interpret=interpret), sparse=sparse)
    if impl == "dot":
        return dot_product_attention
    if impl == "cudnn":
        return cudnn_attention
    if impl == "blockwise":
        return blockwise_attention
    if sizes := re.fullmatch(f"blockwise{_SIZES}{_SIZES}", impl):
        return functools.partial(blockwise_attention, q_block=int(sizes[1]), kv_block=int(sizes[2]))
    if kernel_name(impl) == "triton":
        return functools.partial(triton_attention, blocks=_triton_blocks(impl), interpret=interpret)
    if kernel_name(impl) in TPU_KERNELS:
        kernel = flash_attention if kernel_name(impl) == "flash" else splash_attention
        return functools.partial(
            kernel,
            blocks=call_blocks(impl, sparse and sparse.block),
            interpret=interpret,
            sparse=sparse,
        )
    raise _unknown(impl)


def _unknown(impl: str) -> ValueError:
    return ValueError(
        f"unknown attention implementation {impl!r}: use 'dot', 'blockwise[:<q>:<kv>]', "
        "'flash:<q>:<kv>:<kv_compute>', 'splash:<q>:<kv>:<kv_compute>', 'triton[:<q>:<kv>]' "
        "or 'cudnn'"
    )


def _triton_blocks(impl: str) -> TritonBlocks:
    if not (sizes := re.fullmatch(f"triton(?:{_SIZES}{_SIZES})?", impl)):
        raise _unknown(impl)
    blocks = TritonBlocks(*(int(n) for n in sizes.groups() if n))
    if any(n & (n - 1) or n < TRITON_MIN_BLOCK for n in (blocks.q, blocks.kv)):
        raise ValueError(
            f"attention {impl!r}: triton block sizes must be powers of two >= {TRITON_MIN_BLOCK}"
        )
    return blocks


def tpu_blocks(impl: str) -> TpuBlocks:
    """The blocks of 'flash:<q>:<kv>:<kv_compute>' or 'splash:...'."""
    if not (sizes := re.fullmatch(f"(?:{'|'.join(TPU_KERNELS)}){_SIZES}{_SIZES}{_SIZES}", impl)):
        raise _unknown(impl)
    blocks = TpuBlocks(*(int(s) for s in sizes.groups()))
    if any(n % LANES for n in (blocks.q, blocks.kv_compute)) or blocks.kv % blocks.kv_compute:
        raise ValueError(
            f"attention {impl!r}: {kernel_name(impl)} block sizes q and kv_compute must be "
            f"multiples of {LANES}, and kv a multiple of kv_compute"
        )
    return blocks


def call_blocks(impl: str, radial_block: int | None) -> TpuBlocks:
    """The blocks the TPU kernel `impl` runs a call at: its own, within the Radial mask's block
    when it attends through one of `radial_block`-token blocks (`TpuBlocks.within`; flash's
    query blocks within two: on v5e at 832x480x81 a call at 2048/1024/256 took 44.7 ms against
    46.8 at 1024/1024/256, bench/chip_attention.py)."""
    blocks = tpu_blocks(impl)
    if radial_block is None:
        return blocks
    return blocks.within(radial_block, halves=kernel_name(impl) == "flash")


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    impl: str = "dot",
    context_parallel: str = "gather",
    sparse: RadialSpec | None = None,
    quant: str | None = None,
    kv_len: int | None = None,
) -> jax.Array:
    """Multi-head attention by the kernel `impl` names (see `resolve`), laid out on the current
    mesh by `context_parallel` ('gather' or 'ulysses'; k and v must then be as long as q);
    `sparse`: a Radial mask over the whole sequence; `quant`: in 8 bits (int8 or fp8);
    `kv_len`: the real keys, those after them padding (tokens padded to `padded_length`)."""
    if context_parallel not in CONTEXT_PARALLEL:
        raise ValueError(f"context parallelism {context_parallel!r}: use gather or ulysses")
    mesh = jax.sharding.get_abstract_mesh()
    platform = jax.default_backend() if mesh.empty else mesh.abstract_device.platform
    runs_on = KERNEL_PLATFORM.get(kernel_name(impl))
    interpret = runs_on is not None and platform != runs_on
    kernel = resolve(impl, interpret=interpret, sparse=sparse, quant=quant)
    if kv_len is not None and kv_len != k.shape[1]:
        if (takes := padded_length(impl, kv_len, quant)) != k.shape[1]:
            raise ValueError(
                f"{k.shape[1]} keys of which {kv_len} real: attention {impl!r} takes keys "
                f"padded to {takes}"
            )
        kernel = functools.partial(kernel, kv_len=kv_len)
    kv_axes = Q_AXES if context_parallel == "ulysses" else KV_AXES
    q_spec = sharding.current_spec(Q_AXES, q.shape)
    kv_spec = sharding.current_spec(kv_axes, k.shape)
    if q_spec is None:  # one device: nothing to lay out
        return kernel(q, k, v)
    if kernel_name(impl) in PARTITIONABLE and context_parallel == "gather":
        q, k, v = sharding.constrain(q, Q_AXES), *(sharding.constrain(t, kv_axes) for t in (k, v))
        return kernel(q, k, v)
    if (sparse or quant) and context_parallel == "gather" and spec_axes(q_spec[1]):
        # Each device would hold a slice of the queries: the mask is by position, and the
        # keys' smoothing needs them all.
        raise ValueError(
            f"{'radial' if sparse else '8-bit'} attention in {kernel_name(impl)} with the "
            "tokens sharded needs ulysses context parallelism (each device then attends whole "
            "sequences)"
        )
    body = kernel if context_parallel == "gather" else _ulysses(kernel, q_spec, q.shape[2])
    return jax.shard_map(
        body, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec, check_vma=False
    )(q, k, v)


def spec_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def sequence_layout(
    spec: jax.sharding.PartitionSpec, mesh_shape: dict[str, int], heads: int
) -> tuple[int, int]:
    """(sequence shards, heads per device) of queries laid out by `spec` (Q_AXES)."""
    shards = math.prod(mesh_shape[a] for a in spec_axes(spec[1]))
    return shards, heads // math.prod(mesh_shape[a] for a in spec_axes(spec[2]))


def _ulysses(kernel: Attention, spec: jax.sharding.PartitionSpec, heads: int) -> Attention:
    """`kernel` over the whole sequence for this device's heads: q, k, v arrive and the output
    leaves sharded on length as `spec` (Q_AXES) lays them out."""
    axes = spec_axes(spec[1])
    if not axes:
        return kernel
    mesh_shape = dict(jax.sharding.get_abstract_mesh().shape)
    shards, local_heads = sequence_layout(spec, mesh_shape, heads)
    if local_heads % shards:
        raise ValueError(
            f"ulysses context parallelism needs the {local_heads} heads per device divisible by "
            f"the {shards} sequence shards ({'x'.join(axes)}): use context parallelism 'gather'"
        )

    def body(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        to_heads = functools.partial(
            jax.lax.all_to_all, axis_name=axes, split_axis=2, concat_axis=1, tiled=True
        )
        out = kernel(to_heads(q), to_heads(k), to_heads(v))
        return jax.lax.all_to_all(out, axes, split_axis=1, concat_axis=2, tiled=True)

    return body
