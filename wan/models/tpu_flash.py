"""Flash attention for TPU in Pallas: the online softmax over key blocks, block-sparse.

Each query block visits only the key blocks its mask keeps, listed ahead of the grid (scalar
prefetch), so a dropped block is neither copied into VMEM nor computed. Each visit is one of
three kinds, chosen per block when the build is traced: kept whole (no mask at all), kept but
for padded keys (one comparison), or kept in part by a Radial mask (its closed form evaluated
per entry). A dense call masks only its last key column; a Radial mask at the kernel's blocks
masks nothing else either. A query block twice the mask's visits a key block that only one of
its halves keeps with that half's rows alone.

Arithmetic per key block, for a (bq, bkv) score block S of one video x head:
  m' = max(m, rowmax S);  P = exp2(S - m');  l' = l exp2(m - m') + rowsum P;
  acc' = acc exp2(m - m') + P V   (P in V's dtype, accumulated in float32)
and out = acc / l after the last block. The queries arrive scaled by log2(e)/sqrt(D), so the
base-2 exponentials equal the softmax's; masked entries get a large finite negative score, so
a row masked so far has finite statistics that its first kept key corrects (every query row
of a video keeps keys; padded query rows are sliced off).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from wan.models.radial_mask import RadialSpec, kernel_blocks, radial_keep

LANES = 128  # row statistics are kept lane-broadcast: (bq, LANES)
MASKED = -0.7 * float(np.finfo(np.float32).max)

# What a visit to a key block does (the tables' codes): its mask, plus ROWS x the query rows it
# computes (a query block twice the Radial block's visits a key block only one half keeps with
# that half alone, a whole block of the mask's).
SKIP, WHOLE, PAD_KEYS, RADIAL = 0, 1, 2, 3
ALL_ROWS, TOP_HALF, BOTTOM_HALF = 0, 1, 2
ROWS = 4


@dataclasses.dataclass(frozen=True)
class Visits:
    """The (query block, key block) pairs the kernel computes, one grid step each, query block
    by query block: `q_blocks`, `kv_blocks` and each one's `kinds` (int32 vectors). A query
    block the mask empties gets one SKIP visit, which writes its zero output."""

    q_blocks: np.ndarray
    kv_blocks: np.ndarray
    kinds: np.ndarray


def visits(
    sparse: RadialSpec | None, kv_len: int, q_blocks: int, kv_blocks: int, bq: int, bkv: int
) -> Visits:
    """The visits of a (q_blocks x bq) x (kv_blocks x bkv) call with `kv_len` real keys."""
    kinds = np.full((q_blocks, kv_blocks), WHOLE, np.int32)
    if sparse is not None:
        kinds = _sparse_kinds(sparse, bq, bkv)
        if kinds.shape != (q_blocks, kv_blocks):
            raise ValueError(
                f"a Radial mask over {kinds.shape} blocks, not {(q_blocks, kv_blocks)}"
            )
    starts = np.arange(kv_blocks) * bkv
    kinds[:, starts >= kv_len] = SKIP
    straddles = (starts < kv_len) & (starts + bkv > kv_len)
    padded = kinds[:, straddles]
    kinds[:, straddles] = np.where(padded % ROWS == WHOLE, padded - WHOLE + PAD_KEYS, padded)
    kinds[~kinds.any(1), 0] = -1  # an emptied query block: one visit, marked for now
    q_idx, kv_idx = np.nonzero(kinds)
    codes = np.maximum(kinds[q_idx, kv_idx], SKIP)
    return Visits(q_idx.astype(np.int32), kv_idx.astype(np.int32), codes.astype(np.int32))


def _sparse_kinds(sparse: RadialSpec, bq: int, bkv: int) -> np.ndarray:
    """The visit kinds of a Radial mask at (bq, bkv) blocks: a kept block whole or masked per
    entry, and where the query block is twice a block the mask keeps whole, a key block only one
    half keeps visited by that half alone."""
    kept, whole = kernel_blocks(sparse, bq, bkv)
    kinds = np.where(kept, np.where(whole, WHOLE, RADIAL), SKIP).astype(np.int32)
    half = bq // 2
    if half % sparse.block or half % LANES:
        return kinds
    halves, halves_whole = (
        np.pad(t, ((0, 2 * len(kinds) - len(t)), (0, 0))) for t in kernel_blocks(sparse, half, bkv)
    )
    top, bottom = halves[0::2], halves[1::2]
    for rows, this, other in ((TOP_HALF, top, bottom), (BOTTOM_HALF, bottom, top)):
        alone = this & ~other & halves_whole[rows - TOP_HALF :: 2]
        kinds[alone] = WHOLE + ROWS * rows
    return kinds


def computed_fraction(sparse: RadialSpec, bq: int, bkv: int) -> float:
    """The fraction of the (query, key) entries of a call at (bq, bkv) blocks that the kernel
    computes under `sparse` (a half visit: half its block)."""
    kinds = _sparse_kinds(sparse, bq, bkv)
    return float(np.where(kinds == SKIP, 0.0, np.where(kinds < ROWS, 1.0, 0.5)).mean())


def _kernel(
    q_blocks_ref, kv_blocks_ref, kinds_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref,
    *, bkv: int, bkv_compute: int, kv_len: int, sparse: RadialSpec | None, pv_dtype,
    kinds: tuple[int, ...],
):  # fmt: skip
    """One (video x head, visit) step; `kinds`: the visit kinds the call has (only their code is
    generated)."""
    t, last = pl.program_id(1), pl.num_programs(1) - 1
    bq, d = q_ref.shape
    i, kv_block, kind = q_blocks_ref[t], kv_blocks_ref[t], kinds_ref[t]
    first_visit = (t == 0) | (q_blocks_ref[jnp.maximum(t - 1, 0)] != i)
    last_visit = (t == last) | (q_blocks_ref[jnp.minimum(t + 1, last)] != i)

    @pl.when(first_visit)
    def _start():
        m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(code: int) -> None:
        mask, half = code % ROWS, code // ROWS
        first_row, count = (0, bq) if half == ALL_ROWS else ((half - TOP_HALF) * bq // 2, bq // 2)
        rows = pl.ds(first_row, count)
        q = q_ref[rows, :]
        for c in range(bkv // bkv_compute):  # unrolled: static slices
            cols = pl.ds(c * bkv_compute, bkv_compute)
            s = jax.lax.dot_general(
                q, k_ref[:, cols], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            if mask != WHOLE:
                key_ids = (
                    kv_block * bkv
                    + c * bkv_compute
                    + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
                )
                keep = key_ids < kv_len
                if mask == RADIAL:
                    q_ids = i * bq + first_row + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
                    keep = keep & radial_keep(sparse, q_ids, key_ids)
                s = jnp.where(keep, s, MASKED)
            m_prev, l_prev = m_ref[rows, :], l_ref[rows, :]
            m_next = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))  # (rows, LANES)
            p = jnp.exp2(s - jnp.tile(m_next, (1, bkv_compute // LANES)))
            alpha = jnp.exp2(m_prev - m_next)
            l_ref[rows, :] = alpha * l_prev + p.sum(axis=-1, keepdims=True)
            m_ref[rows, :] = m_next
            pv = jax.lax.dot_general(
                p.astype(pv_dtype), v_ref[cols, :].astype(pv_dtype), (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )  # fmt: skip
            acc_ref[rows, :] = _lanes(alpha, d) * acc_ref[rows, :] + pv

    for code in kinds:
        pl.when(kind == code)(functools.partial(attend, code))

    @pl.when(last_visit)
    def _finish():
        denom = l_ref[...]
        denom = jnp.where(denom == 0, 1.0, denom)  # an emptied query block: 0
        o_ref[...] = (acc_ref[...] / _lanes(denom, d)).astype(o_ref.dtype)


def _lanes(x: jax.Array, width: int) -> jax.Array:
    """A lane-broadcast (rows, LANES) statistic as (rows, width)."""
    return jnp.tile(x, (1, -(-width // LANES)))[:, :width]


def heads_major(x: jax.Array, length: int) -> jax.Array:
    """(B, S, H, D) zero-padded to `length` tokens -> (B*H, length, D): the TPU kernels fold
    videos into heads (a vmap over the batch would batch their VMEM scratch too)."""
    b, s, h, d = x.shape
    padded = jnp.pad(x, ((0, 0), (0, length - s), (0, 0), (0, 0)))
    return padded.transpose(0, 2, 1, 3).reshape(b * h, length, d)


def softmax_scratch(bq: int, d: int) -> list:
    """The online softmax's VMEM scratch for a query block: running max and sum (lane-broadcast)
    and the unnormalised output."""
    return [
        pltpu.VMEM((bq, LANES), jnp.float32),
        pltpu.VMEM((bq, LANES), jnp.float32),
        pltpu.VMEM((bq, d), jnp.float32),
    ]


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    blocks: tuple[int, int, int],
    interpret: bool,
    sparse: RadialSpec | None = None,
    kv_len: int | None = None,
    pv_dtype: jnp.dtype | None = None,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(D)) v, (B, Sq, H, D) -> (B, Sq, H, D), by the module's kernel with
    (query, key, key-per-matmul) blocks `blocks` (multiples of 128 dividing the padded lengths
    the caller chose); keys past `kv_len` are padding, and with `sparse` only the entries its
    Radial mask keeps count. `interpret` runs the kernel in plain JAX (off TPU); P V runs in
    `pv_dtype` (V's dtype unless given)."""
    b, q_len, heads, d = q.shape
    kv_len = k.shape[1] if kv_len is None else kv_len
    bq, bkv, bkv_compute = blocks
    q_pad, kv_pad = -(-q_len // bq) * bq, -(-k.shape[1] // bkv) * bkv
    plan = visits(sparse, kv_len, q_pad // bq, kv_pad // bkv, bq, bkv)

    scaled = (q.astype(jnp.float32) * (math.log2(math.e) / math.sqrt(d))).astype(q.dtype)
    kernel = functools.partial(
        _kernel, bkv=bkv, bkv_compute=bkv_compute, kv_len=kv_len, sparse=sparse,
        pv_dtype=pv_dtype or v.dtype, kinds=tuple(sorted(set(plan.kinds.tolist()) - {SKIP})),
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,  # the visits: query blocks, key blocks, kinds
            grid=(b * heads, len(plan.kinds)),
            in_specs=[
                pl.BlockSpec((None, bq, d), lambda h, t, qb, kb, _: (h, qb[t], 0)),
                pl.BlockSpec((None, d, bkv), lambda h, t, qb, kb, _: (h, 0, kb[t])),
                pl.BlockSpec((None, bkv, d), lambda h, t, qb, kb, _: (h, kb[t], 0)),
            ],
            out_specs=pl.BlockSpec((None, bq, d), lambda h, t, qb, kb, _: (h, qb[t], 0)),
            scratch_shapes=softmax_scratch(bq, d),
        ),
        out_shape=jax.ShapeDtypeStruct((b * heads, q_pad, d), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        interpret=interpret,
        name="wan_tpu_flash_attention",
    )(
        jnp.asarray(plan.q_blocks),
        jnp.asarray(plan.kv_blocks),
        jnp.asarray(plan.kinds),
        heads_major(scaled, q_pad),
        heads_major(k, kv_pad).swapaxes(1, 2),  # keys sequence-minor: (B*H, D, S)
        heads_major(v, kv_pad),
    )
    return out.reshape(b, heads, q_pad, d).transpose(0, 2, 1, 3)[:, :q_len]
