"""wan.models.radial_mask against the official Radial Attention mask generator, and splash.

The reference below is a near-verbatim torch copy of `get_diagonal_split_mask`,
`get_window_width` (model_type="wan"), `shrinkMaskStrict` and `gen_log_mask_shrinked` from
radial_attn/attn_mask.py of github.com/mit-han-lab/radial-attention at commit
72788d4f0a6d202f1ec5f1c98a6e4c8b2e34fdbc (prints, flashinfer and the `query` device argument
dropped; the split threshold, a literal 128 there, is a parameter defaulting to 128). Called
with `s` = the tokens padded to the block, it is the first version's (3f66894) padded flow.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as smi

from wan.models.radial_mask import (
    RadialSpec,
    RadialSplashMask,
    block_mask,
    density,
    radial_keep,
)
from wan.sparse_attention import WAN_DECAY

# ---- reference: the official generator (torch, near-verbatim) -------------------------------


def get_diagonal_split_mask(i, j, token_per_frame, sparse_type, threshold=128):
    assert sparse_type in ["radial"]
    dist = abs(i - j)
    group = dist.bit_length()
    decay_length = 2 ** token_per_frame.bit_length() / 2**group
    if decay_length >= threshold:
        return torch.ones((token_per_frame, token_per_frame), dtype=torch.bool)
    split_factor = int(threshold / decay_length)
    modular = dist % split_factor
    if modular == 0:
        return torch.ones((token_per_frame, token_per_frame), dtype=torch.bool)
    else:
        return torch.zeros((token_per_frame, token_per_frame), dtype=torch.bool)


def get_window_width(i, j, token_per_frame, sparse_type, num_frame, decay_factor=1, block_size=128):
    assert sparse_type in ["radial"]
    dist = abs(i - j)
    if dist < 1:  # model_type == "wan"
        return token_per_frame
    if dist == 1:
        return token_per_frame
    group = dist.bit_length()
    decay_length = 2 ** token_per_frame.bit_length() / 2**group * decay_factor
    threshold = block_size
    if decay_length >= threshold:
        return decay_length
    else:
        return threshold


def shrinkMaskStrict(mask, block_size=128):
    seqlen = mask.shape[0]
    block_num = seqlen // block_size
    mask = mask[: block_num * block_size, : block_num * block_size].view(
        block_num, block_size, block_num, block_size
    )
    col_densities = mask.sum(dim=1) / block_size
    non_zero_densities = col_densities > 0
    high_density_cols = col_densities > 1 / 3
    frac_high_density_cols = high_density_cols.sum(dim=-1) / (non_zero_densities.sum(dim=-1) + 1e-9)
    block_mask = frac_high_density_cols > 0.6
    block_mask[0:0] = True  # (no-ops, kept as in the official code)
    block_mask[-1:-1] = True
    return block_mask


def gen_log_mask_shrinked(
    s, video_token_num, num_frame, block_size=128, decay_factor=0.5, threshold=128
):
    final_log_mask = torch.zeros((s // block_size, s // block_size), dtype=torch.bool)
    token_per_frame = video_token_num // num_frame
    video_text_border = video_token_num // block_size
    col_indices = torch.arange(0, token_per_frame).view(1, -1)
    row_indices = torch.arange(0, token_per_frame).view(-1, 1)
    final_log_mask[video_text_border:] = True
    final_log_mask[:, video_text_border:] = True
    for i in range(num_frame):
        for j in range(num_frame):
            if j == 0:  # model_type == "wan": attention sink
                local_mask = torch.ones((token_per_frame, token_per_frame), dtype=torch.bool)
            else:
                window_width = get_window_width(
                    i, j, token_per_frame, "radial", num_frame, decay_factor, block_size
                )
                local_mask = torch.abs(col_indices - row_indices) <= window_width
                split_mask = get_diagonal_split_mask(i, j, token_per_frame, "radial", threshold)
                local_mask = torch.logical_and(local_mask, split_mask)
            remainder_row = (i * token_per_frame) % block_size
            remainder_col = (j * token_per_frame) % block_size
            all_length_row = remainder_row + ((token_per_frame - 1) // block_size + 1) * block_size
            all_length_col = remainder_col + ((token_per_frame - 1) // block_size + 1) * block_size
            padded_local_mask = torch.zeros((all_length_row, all_length_col), dtype=torch.bool)
            padded_local_mask[
                remainder_row : remainder_row + token_per_frame,
                remainder_col : remainder_col + token_per_frame,
            ] = local_mask
            block_mask = shrinkMaskStrict(padded_local_mask, block_size=block_size)
            block_row_start = (i * token_per_frame) // block_size
            block_col_start = (j * token_per_frame) // block_size
            block_row_end = block_row_start + block_mask.shape[0]
            block_col_end = block_col_start + block_mask.shape[1]
            final_log_mask[block_row_start:block_row_end, block_col_start:block_col_end] = (
                torch.logical_or(
                    final_log_mask[block_row_start:block_row_end, block_col_start:block_col_end],
                    block_mask,
                )
            )
    return final_log_mask


def official(spec: RadialSpec) -> np.ndarray:
    out = gen_log_mask_shrinked(
        spec.padded_tokens,
        spec.tokens,
        spec.frames,
        block_size=spec.block,
        decay_factor=spec.decay,
        threshold=spec.block,
    )
    return out.numpy()


# ---- the block mask equals the official one -------------------------------------------------

BLOCK_MULTIPLES = [  # tokens a multiple of the block: where the official code works
    RadialSpec(5, 384),
    RadialSpec(6, 256, decay=1.0),
    RadialSpec(17, 128),  # bit lengths up to 5: diagonals split off
    RadialSpec(4, 640, decay=0.5),  # bands narrower than a frame
    RadialSpec(4, 192),  # frames straddle blocks
    RadialSpec(8, 400),  # frames straddling blocks, as Wan's 3600-token frames do
    RadialSpec(8, 160, block=32, decay=0.5),
    RadialSpec(12, 96, block=32, decay=1.0),
]


@pytest.mark.parametrize("spec", BLOCK_MULTIPLES, ids=str)
def test_block_mask_matches_official(spec):
    assert spec.tokens % spec.block == 0
    mask = block_mask(spec)
    np.testing.assert_array_equal(mask, official(spec))
    # token level: block_mask expanded (on a sample of tokens: the full square can be large)
    q, kv = np.random.default_rng(0).integers(0, spec.tokens, (2, 1024))
    want = mask[q[:, None] // spec.block, kv[None, :] // spec.block]
    np.testing.assert_array_equal(radial_keep(spec, q[:, None], kv[None, :]), want)


@pytest.mark.parametrize(
    "spec", [RadialSpec(5, 200), RadialSpec(3, 600), RadialSpec(7, 100, block=32)], ids=str
)
def test_padded_block_is_dense(spec):
    assert spec.tokens % spec.block  # the official code at HEAD fails here
    mask = block_mask(spec)
    np.testing.assert_array_equal(mask, official(spec))  # the first version's padded flow
    border = spec.tokens // spec.block
    assert mask.shape == (border + 1, border + 1)
    assert mask[border:].all() and mask[:, border:].all()
    ids = np.arange(spec.padded_tokens)
    keep = radial_keep(spec, ids[:, None], ids[None, :])
    assert keep[border * spec.block :].all() and keep[:, border * spec.block :].all()
    # the splash mask keeps the padded block's real keys and never the pad keys
    splash = RadialSplashMask(spec, (spec.padded_tokens,) * 2)[:, :]
    np.testing.assert_array_equal(splash[:, : spec.tokens], keep[:, : spec.tokens])
    assert not splash[:, spec.tokens :].any()


# ---- structure ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", [RadialSpec(21, 3600), RadialSpec(17, 128), RadialSpec(7, 100, block=32)], ids=str
)
def test_structure(spec):
    t, b = spec.tokens_per_frame, spec.block
    mask = block_mask(spec)  # == radial_keep by block (above): check blocks, not tokens

    def blocks(first_frame: int, end_frame: int) -> slice:  # blocks holding these frames
        first, end = max(first_frame, 0), min(end_frame, spec.frames)
        return slice(first * t // b, (end * t - 1) // b + 1)

    # frame 0 is a sink every query sees, and every frame sees itself and its neighbours whole,
    # except, where frames straddle blocks, for the rows of a block the frame shares with a
    # neighbour (the official shrink judges each frame pair on its own rows of the block)
    assert mask[:, blocks(0, 1)].all()
    dropped = 0
    for i in range(spec.frames):
        own_blocks = slice(-(-i * t // b), (i + 1) * t // b)  # blocks wholly in frame i
        assert mask[own_blocks, blocks(i - 1, i + 2)].all()
        rows, cols = np.arange(i * t, (i + 1) * t), np.arange(max(i - 1, 0) * t, (i + 2) * t)
        near = mask[np.ix_(rows // b, cols[cols < spec.tokens] // b)]
        assert near.all() or t % b
        dropped += near.size - np.count_nonzero(near)
    print(f"{spec}: {dropped} token pairs of neighbouring frames dropped")
    assert dropped < 1e-3 * 3 * spec.frames * t * t
    assert np.diag(mask).all()
    # the sink makes it asymmetric: frame 0's queries do not see every frame
    assert not (mask == mask.T).all()
    if t % b == 0:  # without the sink column blocks, frame-aligned blocks: symmetric
        core = mask[t // b :, t // b :]
        np.testing.assert_array_equal(core, core.T)


def test_wan_720p_density():
    # Wan 14B, 1280x720 (or 720x1280: the same 45 x 80 = 3600 tokens a latent frame; the mask
    # sees only the raster index), 81 frames -> 21 latent frames
    spec = RadialSpec(21, 45 * 80)
    assert spec.decay == WAN_DECAY == 0.2 and spec.tokens == 75_600
    d128, d512 = density(spec, 128), density(spec, 512)
    print(f"radial density at 720p x 81: {d128:.4f} (128 blocks), {d512:.4f} (512 blocks)")
    assert 0.1 < d128 < d512 < 0.7
    assert d128 == pytest.approx(0.2647, abs=1e-3) and d512 == pytest.approx(0.4553, abs=1e-3)
    assert d128 == pytest.approx(block_mask(spec).mean())  # 128: the radial blocks themselves


# ---- splash -----------------------------------------------------------------------------------


def test_stored_mask_matches_closed_form_and_equality():
    """Splash's stored mask is the closed form (numpy and traced jnp, which the other kernels
    evaluate), pad keys dropped; and not a computed mask, so splash loads its partial blocks
    instead of evaluating the closed form per entry inside the kernel."""
    spec = RadialSpec(5, 100, block=32)
    mask = RadialSplashMask(spec, (512, 512))
    ids = np.arange(512)
    table = mask[:, :]
    want = radial_keep(spec, ids[:, None], ids[None, :]) & (ids < spec.tokens)[None, :]
    np.testing.assert_array_equal(want, table)
    traced = jax.jit(radial_keep, static_argnums=0)(
        spec, jnp.arange(512)[:, None], jnp.arange(512)[None, :]
    )
    np.testing.assert_array_equal(np.asarray(traced) & (ids < spec.tokens)[None, :], table)
    assert not hasattr(mask, "mask_function")
    info, _ = smi.process_mask(sm.MultiHeadMask([mask]), (128, 128))
    assert info.partial_mask_blocks is not None and (info.block_mask[0] == 1).any()
    assert mask == RadialSplashMask(spec, (512, 512))
    assert hash(mask) == hash(RadialSplashMask(spec, (512, 512)))
    assert mask != RadialSplashMask(spec, (640, 640))
    assert mask != RadialSplashMask(RadialSpec(5, 100, block=32, decay=0.5), (512, 512))


SPLASH_CASES = [  # (spec, splash block): several kernel blocks per axis
    (RadialSpec(4, 128, block=32), 128),  # kernel blocks mix radial blocks: in-kernel mask
    (RadialSpec(5, 100, block=32), 128),  # 500 tokens, padded to 512
    (RadialSpec(3, 200), 128),  # the Wan block; 600 tokens, padded to 640
    (RadialSpec(6, 200), 256),  # kernel blocks of 2 x 2 Wan blocks; 1200 tokens, padded to 1280
]


@pytest.mark.parametrize("spec,kb", SPLASH_CASES, ids=str)
def test_splash_exact(spec, kb):
    n = spec.tokens
    length = -(-n // kb) * kb
    heads, dim = 2, 64
    mask = sm.MultiHeadMask([RadialSplashMask(spec, (length, length))] * heads)
    info, _ = smi.process_mask(mask, (kb, kb))
    blocks = (length // kb) ** 2
    assert np.count_nonzero(info.block_mask[0]) == round(density(spec, kb) * blocks)
    assert (info.block_mask[0] == 1).any()  # partial blocks: the kernel loads their mask

    kernel = sk.make_splash_mha(
        mask,
        block_sizes=sk.BlockSizes(block_q=kb, block_kv=kb, block_kv_compute=kb),
        head_shards=1,
        q_seq_shards=1,
        interpret=True,
    )
    q, k, v = jax.random.normal(jax.random.key(0), (3, heads, length, dim), jnp.float32)
    start = time.perf_counter()
    out = np.asarray(kernel(q, k, v))[:, :n]
    print(f"splash interpret {spec} kb={kb}: {time.perf_counter() - start:.1f}s")

    ids = np.arange(n)
    keep = radial_keep(spec, ids[:, None], ids[None, :])
    scores = np.einsum("hqd,hkd->hqk", *(np.asarray(x, np.float64)[:, :n] for x in (q, k)))
    scores = np.where(keep, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("hqk,hkd->hqd", probs, np.asarray(v, np.float64)[:, :n])
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("qb,kvb", [(256, 128), (128, 384)])
def test_density_of_unequal_blocks_is_splash_count(qb, kvb):
    """Query and key blocks of different sizes (splash's block_q and block_kv): the fraction
    of blocks splash's mask info keeps."""
    spec = RadialSpec(6, 200)
    q_len, kv_len = -(-spec.tokens // qb) * qb, -(-spec.tokens // kvb) * kvb
    mask = sm.MultiHeadMask([RadialSplashMask(spec, (q_len, kv_len))])
    info, _ = smi.process_mask(mask, (qb, kvb))
    blocks = (q_len // qb) * (kv_len // kvb)
    assert np.count_nonzero(info.block_mask[0]) == round(density(spec, qb, kvb) * blocks)
