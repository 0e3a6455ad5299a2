"""Radial Attention's static block-sparse self-attention mask (arXiv 2506.19852), for splash.

Ported from `gen_log_mask_shrinked` and its helpers (`get_window_width`,
`get_diagonal_split_mask`, `shrinkMaskStrict`) in radial_attn/attn_mask.py of
github.com/mit-han-lab/radial-attention at commit 72788d4f0a6d202f1ec5f1c98a6e4c8b2e34fdbc,
`model_type="wan"`; rewritten, not copied. The official mask, per pair of latent frames
(i, j) at distance d = |i - j|:
  - j == 0: all of frame 0 (the attention sink every frame sees);
  - d <= 1: the whole frame (d == 1: tokens_per_frame // 2 wide before that commit);
  - otherwise a band |r - c| <= w on the frames' own (raster-order) token indices,
    w = max(2**bit_length(tokens_per_frame) / 2**bit_length(d) * decay, block);
  - but (j > 0) the pair is dropped unless d is a multiple of block / (2**bit_length(tpf) /
    2**bit_length(d)) once that width (without decay) is under a block;
each pair's token mask is then shrunk to blocks (a block is kept when more than 60% of its
columns with any entry hold entries in more than a third of the block's rows; the pair only
sees the ceil(tpf / block) blocks from the one its first token is in), and the pairs' blocks
are OR-ed. The kernel then computes kept blocks whole: the mask *is* the block mask. Where
frames straddle blocks that shrink can drop a neighbouring frame's blocks for the few rows a
frame has in a block it shares (at 720p, 0.08% of neighbouring-frame token pairs): kept so.

Here a band's entries per column are counted in closed form instead of materialising each
tpf x tpf pair, so one elementwise function gives `block_mask` (numpy), splash's stored block
mask, and the mask the Triton and XLA kernels evaluate (jnp).

Padding: at that commit the video tokens must be a multiple of the block (1280x720, 81
frames: 21 x 3600 = 75,600 tokens, fails). Its first version (3f66894) zero-padded the tokens
up to the block and kept the blocks from tokens // block on dense, rows and columns: so here.
Unlike it, `RadialSplashMask` never attends the pad keys themselves (zero keys would dilute
the softmax); pad query rows are dense.

Generalisation: the official split threshold is a literal 128, "equal to block-size"; here
it is `block` (the same at the official block of 128).
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from wan.sparse_attention import WAN_BLOCK, WAN_DECAY, Radial


@dataclasses.dataclass(frozen=True)
class RadialSpec:
    """Build-time settings: latent frames x tokens per latent frame, mask block, decay."""

    frames: int
    tokens_per_frame: int
    block: int = WAN_BLOCK
    decay: float = WAN_DECAY

    def __post_init__(self) -> None:
        if min(self.frames, self.tokens_per_frame, self.block) < 1 or self.decay <= 0:
            raise ValueError(f"invalid {self}")

    @classmethod
    def of(cls, settings: Radial, grid: tuple[int, int, int]) -> RadialSpec:
        """The mask of a build's settings over a (frames, rows, cols) token grid."""
        return cls(grid[0], grid[1] * grid[2], settings.block, settings.decay)

    @property
    def tokens(self) -> int:
        return self.frames * self.tokens_per_frame

    @property
    def padded_tokens(self) -> int:
        return -(-self.tokens // self.block) * self.block

    @property
    def n_blocks(self) -> int:
        return self.padded_tokens // self.block


def _module(*arrays) -> types.ModuleType:
    """jnp inside the kernel (tracers), numpy otherwise."""
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def _div(xp, a, b: int):
    """a // b where a >= 0 wherever the result counts. Inside kernels a truncating division:
    Pallas Triton mislowers jnp's floor division of integers (an i1 in its subtraction)."""
    if xp is np:
        return a // b
    a = jnp.asarray(a)
    return jax.lax.div(a, jnp.asarray(b, a.dtype))


def _rem(xp, a, b: int):
    """a % b for a >= 0, as `_div`."""
    if xp is np:
        return a % b
    a = jnp.asarray(a)
    return jax.lax.rem(a, jnp.asarray(b, a.dtype))


def _window(spec: RadialSpec, group: int) -> int:
    """Band half-width (inclusive) for frame distances of bit length `group`."""
    t = spec.tokens_per_frame
    if group <= 1:  # the same or an adjacent frame: whole
        return t
    width = max(2.0 ** (t.bit_length() - group) * spec.decay, spec.block)
    return int(np.floor(np.float32(width)))  # the official compares in float32


def _split_period(spec: RadialSpec, group: int) -> int:
    """Distances kept: multiples of this (a band under a block would waste a whole block)."""
    width = 2.0 ** (spec.tokens_per_frame.bit_length() - group)
    return 1 if width >= spec.block else int(spec.block / width)


def _typed(xp, value):
    """A Python constant inside kernels as an array of its own type: Pallas Triton mislowers a
    select between two weak-typed integer constants (an i1 reaches the next subtraction)."""
    if xp is np or not isinstance(value, (bool, int)):
        return value
    return jnp.asarray(value, jnp.bool_ if isinstance(value, bool) else jnp.int32)


def _by_group(xp, d, values: list):
    """values[d.bit_length()], elementwise, from comparisons alone (kernel-friendly)."""
    values = [_typed(xp, v) for v in values]
    out = values[0]
    for group in range(1, len(values)):
        out = xp.where(d >= 1 << (group - 1), values[group], out)
    return out


def _columns_reaching(xp, m: int, r0, r1, c0, c1, width):
    """Columns c in [c0, c1) whose band |r - c| <= width holds >= m of the rows [r0, r1)."""
    lo = xp.maximum(r0 - width - 1 + m, c0)
    hi = xp.minimum(r1 + width - m, c1 - 1)
    possible = (r1 - r0 >= m) & (2 * width + 1 >= m)
    return xp.where(possible, xp.maximum(hi - lo + 1, 0), 0)


def _pair_keeps(spec: RadialSpec, xp, i, j, r0, r1, c0, c1):
    """shrinkMaskStrict's verdict on one block for frame pair (i, j), whose frame-local rows
    [r0, r1) and columns [c0, c1) fall in it."""
    d = xp.abs(i - j)
    groups = range(max(spec.frames - 1, 1).bit_length() + 1)
    sink = j == 0
    width = xp.where(
        sink,
        _typed(xp, spec.tokens_per_frame),
        _by_group(xp, d, [_window(spec, g) for g in groups]),
    )
    periods = [_split_period(spec, g) for g in groups]
    # As integers: Mosaic cannot lay out a select between a boolean constant and a vector.
    split = (
        _by_group(xp, d, [1 if p == 1 else (_rem(xp, d, p) == 0).astype(xp.int32) for p in periods])
        == 1
    )
    dense_cols = spec.block // 3 + 1  # column density > 1/3
    nonzero = _columns_reaching(xp, 1, r0, r1, c0, c1, width)
    dense = _columns_reaching(xp, dense_cols, r0, r1, c0, c1, width)
    return (r1 > r0) & (sink | split) & (5 * dense > 3 * nonzero)  # > 60% of non-empty columns


def _frames_of(spec: RadialSpec, xp, blk, step: int):
    """The step-th latest frame whose pair blocks can cover block `blk`, its frame-local token
    range inside the block, and whether it does cover it."""
    t, b = spec.tokens_per_frame, spec.block
    span = -(-t // b)  # blocks a pair sees, from its first token's block
    f = xp.minimum(spec.frames - 1, _div(xp, (blk + 1) * b - 1, t)) - step
    covers = (f >= 0) & (blk - _div(xp, f * t, b) < span)  # f < 0: not covered, whatever the rest
    lo = xp.maximum(blk * b, f * t) - f * t
    hi = xp.minimum((blk + 1) * b, (f + 1) * t) - f * t
    return f, lo, hi, covers


def _blocks_kept(spec: RadialSpec, xp, q_blk, kv_blk):
    """The official block mask at (query block, key block), elementwise, broadcasting."""
    t, b = spec.tokens_per_frame, spec.block
    border = spec.tokens // b  # this block on holds the padding: dense
    keep = (q_blk >= border) | (kv_blk >= border)
    candidates = (-(-t // b) * b - 1) // t + 1  # frames whose pairs can reach one block
    for si in range(candidates):
        i, r0, r1, i_ok = _frames_of(spec, xp, q_blk, si)
        for sj in range(candidates):
            j, c0, c1, j_ok = _frames_of(spec, xp, kv_blk, sj)
            keep = keep | (i_ok & j_ok & _pair_keeps(spec, xp, i, j, r0, r1, c0, c1))
    return keep


def block_mask(spec: RadialSpec) -> np.ndarray:
    """(n_blocks, n_blocks) bool over the tokens padded to the block; padded block dense."""
    blocks = np.arange(spec.n_blocks)
    return _blocks_kept(spec, np, blocks[:, None], blocks[None, :])


def radial_keep(spec: RadialSpec, q_ids, kv_ids):
    """Token-level mask (block_mask expanded), broadcasting numpy or jax int arrays."""
    b = spec.block
    xp = _module(q_ids, kv_ids)
    return _blocks_kept(spec, xp, _div(xp, q_ids, b), _div(xp, kv_ids, b))


class RadialSplashMask(splash_mask.Mask):
    """Splash mask of shape (q_len, kv_len) >= (tokens, tokens): radial, keys past the video
    (padding) never kept. Splash reads it a kernel block at a time from the block table: a
    block kept whole runs unmasked, one dropped is skipped, and one kept in part (a Radial
    block smaller than the kernel's) loads its mask, stored once per distinct pattern. Not a
    computed mask: evaluating the closed form per entry inside the kernel made the 1.3B's
    480p step 8x slower on v5e (docs/benchmarks.md)."""

    def __init__(self, spec: RadialSpec, shape: tuple[int, int] | None = None):
        shape = shape or (spec.tokens, spec.tokens)
        if min(shape) < spec.tokens:
            raise ValueError(f"mask shape {shape} shorter than the {spec.tokens} video tokens")
        self.spec = spec
        self._shape = tuple(shape)
        q_blocks, kv_blocks = (np.arange(-(-s // spec.block)) for s in shape)
        self._table = _blocks_kept(spec, np, q_blocks[:, None], kv_blocks[None, :])

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    def __getitem__(self, idx) -> np.ndarray:
        q_slice, kv_slice = idx
        rows = np.arange(*q_slice.indices(self.shape[0]))
        cols = np.arange(*kv_slice.indices(self.shape[1]))
        b = self.spec.block
        return self._table[np.ix_(rows // b, cols // b)] & (cols < self.spec.tokens)[None, :]

    def __eq__(self, other: object):
        if not isinstance(other, type(self)):
            return NotImplemented
        return self.shape == other.shape and self.spec == other.spec

    def __hash__(self):
        return hash((type(self), self.shape, self.spec))


def kernel_blocks(spec: RadialSpec, q_block: int, kv_block: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, whole): (query blocks, key blocks) bool over the tokens padded to each kernel
    block. kept: the block holds an entry `RadialSplashMask` keeps (pad keys never kept, pad
    queries dense), i.e. a block-sparse kernel computes it; whole: the mask keeps every entry of
    the block whose key is real (the kernel computes it unmasked but for its pad keys)."""
    qb, kb, b, n = q_block, kv_block, spec.block, spec.tokens
    q_count, kv_count = -(-n // qb), -(-n // kb)
    table = RadialSplashMask(spec, (q_count * qb, kv_count * kb))._table.astype(np.int64)
    sums = np.pad(table.cumsum(0).cumsum(1), ((1, 0), (1, 0)))  # 2-D prefix sums
    q_starts, kv_starts = np.arange(q_count) * qb, np.arange(kv_count) * kb
    r0, r1 = q_starts // b, (q_starts + qb - 1) // b + 1
    c0, c1 = kv_starts // b, (np.minimum(kv_starts + kb, n) - 1) // b + 1  # real keys only
    kept = (
        sums[r1[:, None], c1[None, :]]
        - sums[r0[:, None], c1[None, :]]
        - sums[r1[:, None], c0[None, :]]
        + sums[r0[:, None], c0[None, :]]
    )
    return kept > 0, kept == (r1 - r0)[:, None] * (c1 - c0)[None, :]


def kernel_blocks_kept(spec: RadialSpec, q_block: int, kv_block: int) -> np.ndarray:
    """`kernel_blocks`' kept blocks: those a block-sparse kernel computes."""
    return kernel_blocks(spec, q_block, kv_block)[0]


def density(spec: RadialSpec, kernel_block: int, kv_block: int | None = None) -> float:
    """Fraction of (kernel_block x kv_block) blocks (kv_block: kernel_block unless given) a
    block-sparse kernel computes (`kernel_blocks_kept`): the splash mask info's non-empty
    blocks."""
    return float(kernel_blocks_kept(spec, kernel_block, kv_block or kernel_block).mean())
