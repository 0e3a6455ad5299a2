"""Every attention kernel equals plain softmax attention, at any length and on any layout;
blockwise memory is linear."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import deviceless_tpu_devices

from wan import sharding
from wan.models import tpu_flash
from wan.models.attention import (
    TPU_KERNELS,
    TpuBlocks,
    attention,
    balanced_block,
    blockwise_attention,
    call_blocks,
    dot_product_attention,
    flash_attention,
    padded_length,
    resolve,
    splash_attention,
)
from wan.models.radial_mask import RadialSpec, block_mask, kernel_blocks_kept, radial_keep


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


@pytest.mark.parametrize("kernel", TPU_KERNELS)
@pytest.mark.parametrize(
    "q_len, kv_len, heads",
    [
        (300, 300, 3),  # self-attention, no length a block multiple
        (200, 77, 5),  # cross-attention: one padded key block
        (128, 256, 1),  # exact blocks
    ],
)
def test_tpu_kernels_equal_reference(kernel, q_len, kv_len, heads):
    """The Pallas TPU kernels in interpret mode, fp32; padded keys never contribute."""
    q, k, v = _qkv(q_len, kv_len, heads, dim=16)
    got = resolve(f"{kernel}:128:256:128", interpret=True)(q, k, v)
    np.testing.assert_allclose(got, _reference(q, k, v), atol=1e-5, rtol=0)


def test_flash_in_bfloat16_is_within_its_rounding():
    """bf16 q, k, v as on the chip (P V then in bf16): the float64 reference of the same
    inputs within a few bf16 ulps (2e-2 + 1%); at WAN's head dim."""
    q, k, v = ((t / 2).astype(jnp.bfloat16) for t in _qkv(300, 300, 3, dim=128))  # scores ~1
    got = tpu_flash.flash_attention(q, k, v, blocks=(128, 256, 128), interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), _reference(q, k, v), atol=2e-2, rtol=1e-2)


def test_flash_visits_only_the_blocks_it_computes():
    """A Radial mask at the kernel's blocks: dropped blocks are no visit, kept ones whole (no
    mask) but the key column holding padding; a query block the mask would empty gets one
    visit (its zero output); the dense plan masks only the padded column."""
    spec = RadialSpec(frames=8, tokens_per_frame=100, block=128, decay=0.5)  # 800: 7 blocks
    plan = tpu_flash.visits(spec, spec.tokens, 7, 7, 128, 128)
    kept = kernel_blocks_kept(spec, 128, 128)
    assert len(plan.kinds) == kept.sum() < kept.size
    assert (plan.kinds[plan.kv_blocks < 6] == tpu_flash.WHOLE).all()
    assert (plan.kinds[plan.kv_blocks == 6] == tpu_flash.PAD_KEYS).all()
    assert set(plan.q_blocks.tolist()) == set(range(7))
    dense = tpu_flash.visits(None, 900, 4, 8, 256, 128)
    assert dense.kinds.reshape(4, 8)[:, -1].tolist() == [tpu_flash.PAD_KEYS] * 4
    assert (dense.kinds.reshape(4, 8)[:, :-1] == tpu_flash.WHOLE).all()
    assert tpu_flash.visits(None, 700, 4, 8, 256, 128).kv_blocks.max() == 5  # 768+: no visit


def test_flash_visits_a_key_block_one_half_keeps_with_that_half():
    """Query blocks twice the mask's (256 over 128-token mask blocks): a key block only one
    half of a query block keeps is visited by that half alone (no mask but the padded keys'),
    as many query rows computed as at 128-token blocks, and the output the masked softmax."""
    spec = RadialSpec(frames=8, tokens_per_frame=100, block=128, decay=0.5)  # 800: 4 x 256
    plan = tpu_flash.visits(spec, spec.tokens, 4, 7, 256, 128)
    rows, masks = plan.kinds // tpu_flash.ROWS, plan.kinds % tpu_flash.ROWS
    assert {tpu_flash.TOP_HALF, tpu_flash.BOTTOM_HALF} <= set(rows.tolist())
    assert set(masks.tolist()) == {tpu_flash.WHOLE, tpu_flash.PAD_KEYS}
    computed = np.where(rows == tpu_flash.ALL_ROWS, 2, 1).sum()  # in 128-row halves
    assert computed == kernel_blocks_kept(spec, 128, 128).sum()
    q, k, v = _qkv(spec.tokens, spec.tokens, heads=2)
    got = jax.jit(
        lambda q, k, v: tpu_flash.flash_attention(
            q, k, v, blocks=(256, 128, 128), interpret=True, sparse=spec
        )
    )(q, k, v)
    np.testing.assert_allclose(got, _masked_reference(q, k, v, spec), atol=2e-5, rtol=0)


def _padded(x: jax.Array, length: int) -> jax.Array:
    """x with garbage tokens appended up to `length` (what padding must never let through)."""
    junk = jnp.full((x.shape[0], length - x.shape[1], *x.shape[2:]), 1e3, x.dtype)
    return jnp.concatenate([x, junk], axis=1)


@pytest.mark.parametrize("kernel", TPU_KERNELS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "radial"])
def test_tpu_kernels_on_tokens_padded_to_their_length(kernel, sparse):
    """Self-attention over tokens a transformer padded to `padded_length` (its pads hold
    anything): the real tokens' rows equal attention over the real tokens alone."""
    impl, n = f"{kernel}:128:128:128", RADIAL.tokens  # 260 tokens -> 384
    length = padded_length(impl, n)
    assert length == 384 and padded_length("dot", n) == n
    assert padded_length(impl, n, quant="int8") == n  # the 8-bit kernel pads by itself
    q, k, v = (_padded(t, length) for t in _qkv(n, n, heads=2))
    spec = RADIAL if sparse else None
    got = jax.jit(lambda q, k, v: attention(q, k, v, impl, sparse=spec, kv_len=n))(q, k, v)
    real = [t[:, :n] for t in (q, k, v)]
    want = _masked_reference(*real, RADIAL) if sparse else _reference(*real)
    np.testing.assert_allclose(got[:, :n], want, atol=2e-5, rtol=0)


def test_padded_keys_a_kernel_cannot_take_are_refused():
    q, k, v = (_padded(t, 300) for t in _qkv(260, 260, heads=2))
    with pytest.raises(ValueError, match="attention 'dot' takes keys padded to 260"):
        attention(q, k, v, "dot", kv_len=260)


def test_balanced_blocks():
    assert balanced_block(75600, 3072, 128) == 3072  # 25 blocks, 1.6% padding
    assert balanced_block(9450, 3072, 128) == 2432  # 4 blocks of 2363 -> 2432, not 4 x 3072
    assert balanced_block(512, 2048, 128) == 512
    assert balanced_block(77, 2048, 128) == 128


def test_tpu_block_sizes_checked():
    for bad in ("splash:100:256:128", "flash:128:384:256", "flash:128"):
        with pytest.raises(ValueError):
            resolve(bad)


def _pallas_calls(jaxpr: jax.extend.core.Jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)  # ClosedJaxpr or Jaxpr
            if isinstance(inner, jax.extend.core.Jaxpr):
                yield from _pallas_calls(inner)


@pytest.mark.parametrize("kernel", [flash_attention, splash_attention])
def test_tpu_kernels_fold_videos_into_heads(kernel):
    """A batch of videos runs as one kernel over batch x heads, not vmapped per video: Pallas'
    vmap batches the kernel's VMEM scratch too (x2 with CFG took the 14B at 832x480 on v6e to
    32.7 MiB, over the 32 MiB its blocks were sized for)."""
    spec = jax.ShapeDtypeStruct((2, 512, 3, 128), jnp.bfloat16)
    blocks = TpuBlocks(256, 256, 128)
    jaxpr = jax.make_jaxpr(lambda q, k, v: kernel(q, k, v, blocks=blocks, interpret=False))(
        spec, spec, spec
    )
    calls = list(_pallas_calls(jaxpr.jaxpr))
    assert calls
    operands = {v.aval.shape for call in calls for v in call.invars if v.aval.shape[-1:] == (128,)}
    assert (6, 512, 128) in operands and not any(len(shape) > 3 for shape in operands)


def _generation_targets() -> dict[str, str]:
    from aot import targets

    return {targets.parse_target(a).generation: a for a in targets.TPU_ALIASES}


@pytest.mark.parametrize("generation", sorted(_generation_targets()))
def test_flash_blocks_fit_each_generations_vmem(generation, monkeypatch):
    """The flash kernel at its generation's largest blocks (sequences long enough that no
    block is shrunk, WAN's head dim 128) compiles for a deviceless chip of that generation:
    the kernel's scratch fits its scoped VMEM."""
    from aot import targets

    target = targets.parse_target(_generation_targets()[generation])
    device = deviceless_tpu_devices(monkeypatch, target)[0]
    blocks = TpuBlocks(*targets.ATTENTION_BLOCKS[generation])
    on_chip = jax.sharding.SingleDeviceSharding(device)
    q = jax.ShapeDtypeStruct((2, 2 * blocks.q, 2, 128), jnp.bfloat16, sharding=on_chip)
    kv = jax.ShapeDtypeStruct((2, 2 * blocks.kv, 2, 128), jnp.bfloat16, sharding=on_chip)
    kernel = jax.jit(lambda q, k, v: flash_attention(q, k, v, blocks=blocks, interpret=False))
    with jax.default_matmul_precision("default"):  # as built: conftest asks for "highest"
        kernel.lower(q, kv, kv).compile()


def _compile_sparse_flash(device, blocks: TpuBlocks, spec: RadialSpec) -> None:
    """Compile flash's Radial self-attention over `spec`'s tokens (2 heads of 128, bf16) for
    the deviceless TPU `device` (Mosaic's refusal, a VMEM overflow, raises)."""
    on_chip = jax.sharding.SingleDeviceSharding(device)
    q = jax.ShapeDtypeStruct((1, spec.tokens, 2, 128), jnp.bfloat16, sharding=on_chip)
    kernel = jax.jit(
        lambda q, k, v: flash_attention(q, k, v, blocks=blocks, interpret=False, sparse=spec)
    )
    with jax.default_matmul_precision("default"):  # as built: conftest asks for "highest"
        kernel.lower(q, q, q).compile()


@pytest.mark.parametrize("generation", ["v6e", "tpu7x"])
def test_sparse_flash_blocks_fit_each_generations_vmem(generation, monkeypatch):
    """A sparse build's Radial call (its generation's blocks within the default Radial block,
    query blocks of two mask blocks with half visits) compiles for a deviceless chip of that
    generation (v4, v5e and v5p share v5e's blocks, which the v5e chip ran)."""
    from aot import targets
    from aot.building.plan import SPARSE_TPU_BLOCK

    target = targets.parse_target(_generation_targets()[generation])
    device = deviceless_tpu_devices(monkeypatch, target)[0]
    impl = "flash:" + ":".join(map(str, targets.ATTENTION_BLOCKS[generation]))
    spec = RadialSpec(frames=21, tokens_per_frame=30 * 52, block=SPARSE_TPU_BLOCK)  # 832x480x81
    blocks = call_blocks(impl, spec.block)
    assert blocks.q == 2 * SPARSE_TPU_BLOCK and blocks.kv == SPARSE_TPU_BLOCK
    plan = tpu_flash.visits(spec, spec.tokens, 16, 32, blocks.q, blocks.kv)
    assert (plan.kinds // tpu_flash.ROWS != tpu_flash.ALL_ROWS).any()  # half visits
    _compile_sparse_flash(device, blocks, spec)


MESH = sharding.MeshShape(data=2, context=4)


def _on_mesh(fn, *args):
    mesh = sharding.make_mesh(jax.devices("cpu")[:8], MESH.items())
    with jax.set_mesh(mesh), sharding.axis_rules(sharding.TRANSFORMER_RULES):
        return jax.jit(fn)(*args)


@pytest.mark.parametrize("impl", ["dot", "blockwise:32:32", "flash:128:128:128"])
def test_gather_with_heads_that_do_not_divide_the_context_axis(impl):
    """3 heads, 40 tokens over context=4: every device's queries see all keys."""
    q, k, v = _qkv(40, 40, heads=3)
    got = _on_mesh(lambda q, k, v: attention(q, k, v, impl, "gather"), q, k, v)
    np.testing.assert_allclose(got, _reference(q, k, v), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["dot", "flash:128:128:128", "splash:128:128:128"])
def test_ulysses_equals_reference(impl):
    """8 heads, 2 per sequence shard after the all-to-all; 36 tokens, 9 per device."""
    q, k, v = _qkv(36, 36, heads=8)
    got = _on_mesh(lambda q, k, v: attention(q, k, v, impl, "ulysses"), q, k, v)
    np.testing.assert_allclose(got, _reference(q, k, v), atol=1e-5, rtol=0)


def test_ulysses_refuses_heads_that_do_not_divide():
    q, k, v = _qkv(40, 40, heads=3)
    with pytest.raises(ValueError, match="use context parallelism 'gather'"):
        _on_mesh(lambda q, k, v: attention(q, k, v, "dot", "ulysses"), q, k, v)


# Radial attention: 5 latent frames of 52 tokens (260, not a multiple of the 32-token mask
# block: the padded block is dense), mask blocks of 32, decay 0.5 so that the band and the
# frame-distance split both drop blocks at this small size.
RADIAL = RadialSpec(frames=5, tokens_per_frame=52, block=32, decay=0.5)


def _masked_reference(q, k, v, spec):
    """Softmax over the entries the Radial mask keeps, float64."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    ids = np.arange(q.shape[1])
    keep = radial_keep(spec, ids[:, None], ids[None, :])
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(keep, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def test_the_radial_spec_drops_blocks_at_this_size():
    kept = block_mask(RADIAL)[: RADIAL.tokens // RADIAL.block]
    assert (~kept).sum() > 0 and kept[:, 0].all()  # sparse, and frame 0 seen by every block


@pytest.mark.parametrize("q_block,kv_block", [(32, 32), (48, 40), (128, 128)])
def test_sparse_blockwise_is_masked_attention(q_block, kv_block):
    """Kernel blocks aligned with the mask's or not: the kept entries' softmax, exactly; the
    control: dense attention differs."""
    q, k, v = _qkv(RADIAL.tokens, RADIAL.tokens)
    got = jax.jit(lambda q, k, v: blockwise_attention(
        q, k, v, q_block=q_block, kv_block=kv_block, sparse=RADIAL))(q, k, v)  # fmt: skip
    want = _masked_reference(q, k, v, RADIAL)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    assert np.abs(want - _reference(q, k, v)).max() > 0.1


@pytest.mark.parametrize(
    "impl, spec",
    [
        ("splash:128:128:128", RADIAL),
        ("flash:128:128:128", RADIAL),  # kernel blocks over 4 mask blocks: masked per entry
        # the mask's blocks: kept whole, but for the padded key column
        ("flash:128:128:128", RadialSpec(frames=8, tokens_per_frame=100, block=128, decay=0.5)),
    ],
)
def test_sparse_tpu_kernels_are_masked_attention(impl, spec):
    """The TPU kernels (interpret mode) with the Radial mask, length padded to their blocks."""
    q, k, v = _qkv(spec.tokens, spec.tokens, heads=2)
    kernel = resolve(impl, interpret=True, sparse=spec)
    got = jax.jit(kernel)(q, k, v)
    np.testing.assert_allclose(got, _masked_reference(q, k, v, spec), atol=2e-5, rtol=0)


@pytest.mark.parametrize("blocks", ["triton", "triton:32:16", "triton:64:64"])
def test_sparse_triton_is_masked_attention(blocks):
    """The Triton kernel (interpret mode) with the Radial mask: key blocks the mask drops
    skipped where its blocks fit in the mask's (32, 16: within the 32-token mask blocks),
    masked entry by entry otherwise (128 x 64, 64 x 64: larger)."""
    q, k, v = _qkv(RADIAL.tokens, RADIAL.tokens, heads=2)
    got = jax.jit(resolve(blocks, interpret=True, sparse=RADIAL))(q, k, v)
    np.testing.assert_allclose(got, _masked_reference(q, k, v, RADIAL), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "impl,context_parallel", [("flash:128:128:128", "ulysses"), ("blockwise:64:64", "gather")]
)
def test_sparse_attention_on_a_mesh(impl, context_parallel):
    """Tokens sharded over context=4: flash under Ulysses (whole sequences per device), the
    blockwise kernel left to XLA's partitioner; both the masked softmax."""
    q, k, v = _qkv(RADIAL.tokens, RADIAL.tokens, heads=8)
    got = _on_mesh(lambda q, k, v: attention(q, k, v, impl, context_parallel, RADIAL), q, k, v)
    np.testing.assert_allclose(got, _masked_reference(q, k, v, RADIAL), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "blocks, spec",
    [
        (TpuBlocks(512, 512, 512), RadialSpec(frames=5, tokens_per_frame=600)),
        (TpuBlocks(128, 128, 128), RadialSpec(frames=5, tokens_per_frame=600)),
        # 240 tokens a frame: the distances of 2-3 frames are kept every other one (a split
        # period), a select Mosaic once could not lay out
        (TpuBlocks(128, 128, 128), RadialSpec(frames=5, tokens_per_frame=240)),
    ],
)
def test_sparse_flash_compiles_for_a_deviceless_tpu(blocks, spec, monkeypatch):
    """The Radial mask inside the flash kernel (its partly kept blocks evaluated in the
    kernel) compiles for a v6e chip without one: Mosaic takes the mask's integer arithmetic."""
    from aot import targets

    device = deviceless_tpu_devices(monkeypatch, targets.parse_target("tpu-v6e-8"))[0]
    _compile_sparse_flash(device, blocks, spec)


def test_sparse_triton_lowers_for_cuda():
    """The Triton kernel with the Radial mask (its block skip and entry mask) lowers to Triton
    for NVIDIA GPUs on this host (a select between two integer constants once did not)."""
    spec = RadialSpec(frames=5, tokens_per_frame=256, decay=0.5)
    q = jax.ShapeDtypeStruct((1, spec.tokens, 2, 64), jnp.bfloat16)
    kernel = jax.jit(resolve("triton", sparse=spec))
    assert (
        "wan_triton_flash_attention"
        in kernel.trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    )


def test_sparse_attention_refusals():
    q, k, v = _qkv(RADIAL.tokens, RADIAL.tokens, heads=8)
    with pytest.raises(ValueError, match="needs ulysses context parallelism"):
        _on_mesh(lambda q, k, v: attention(q, k, v, "flash:128:128:128", "gather", RADIAL),
                 q, k, v)  # fmt: skip
    with pytest.raises(ValueError, match="radial attention runs in flash or splash or triton"):
        resolve("cudnn", sparse=RADIAL)
    with pytest.raises(ValueError, match="self-attention over the 260 video tokens"):
        blockwise_attention(*_qkv(RADIAL.tokens, 7), sparse=RADIAL)
