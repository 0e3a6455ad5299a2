"""WanTransformer against diffusers' WanTransformer3DModel (random weights, fp32)."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from flax import nnx

from wan.component_configs import TransformerConfig
from wan.models.transformer import WanTransformer
from wan.presets import PRESETS
from wan.sharding import TRANSFORMER_RULES, axis_rules, make_mesh
from wan.weights import WeightError, flatten, import_folder, import_tensors, unflatten
from wan.weights.transformer import rule

# Two tiny configs: Wan's patching, and a temporal patch of 2 without the cross-attention norm.
CONFIGS = {
    "wan": TransformerConfig(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=6,
        text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2,
    ),
    "t2-no-cross-norm": TransformerConfig(
        patch_size=(2, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=3,
        out_channels=3, text_dim=16, freq_dim=16, ffn_dim=40, num_layers=3, cross_attn_norm=False,
    ),
}  # fmt: skip
TEXT_LEN = 20


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(diffusers reference, our graphdef, our imported state) for one config."""
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**dataclasses.asdict(CONFIGS[request.param])).eval()
    with torch.no_grad():  # norms start at 1/0: perturb them so a wrong mapping shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(folder)

    cfg = TransformerConfig.from_dict(ref.config)
    assert cfg == CONFIGS[request.param]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: WanTransformer(cfg, rngs=nnx.Rngs(0))))
    expected = {p: (v.shape, v.dtype) for p, v in flatten(nnx.to_pure_dict(state)).items()}
    nnx.replace_by_pure_dict(state, unflatten(import_folder(folder, expected, rule)))
    return ref, graphdef, state


def _inputs(cfg: TransformerConfig, batch: int, t: int, h: int, w: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((batch, t, h, w, cfg.in_channels)).astype(np.float32)
    timestep = np.array([999.0, 137.5][:batch], np.float32)
    text = rng.standard_normal((batch, TEXT_LEN, cfg.text_dim)).astype(np.float32)
    return latents, timestep, text


def _reference(ref, latents, timestep, text) -> np.ndarray:
    with torch.no_grad():
        out = ref(
            torch.from_numpy(latents).permute(0, 4, 1, 2, 3),
            torch.from_numpy(timestep),
            torch.from_numpy(text),
            return_dict=False,
        )[0]
    return out.permute(0, 2, 3, 4, 1).numpy()


def _graphdef(cfg: TransformerConfig, attention: str = "dot"):
    return nnx.graphdef(
        nnx.eval_shape(lambda: WanTransformer(cfg, attention=attention, rngs=nnx.Rngs(0)))
    )


_forward = jax.jit(
    lambda graphdef, params, *args: nnx.merge(graphdef, params)(*args), static_argnums=0
)
_kv_cache = jax.jit(
    lambda graphdef, params, text: nnx.merge(graphdef, params).compute_kv_cache(text),
    static_argnums=0,
)
_cached = jax.jit(
    lambda graphdef, params, latents, t, kv: nnx.merge(graphdef, params)(latents, t, kv_cache=kv),
    static_argnums=0,
)


# (batch, T, H, W): portrait (H > W) with several frames and two timesteps; a single-frame square.
SHAPES = [(2, 4, 10, 6), (1, 2, 4, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_diffusers(pair, shape):
    ref, graphdef, state = pair
    cfg = nnx.merge(graphdef, state).config
    latents, timestep, text = _inputs(cfg, *shape)
    got = np.asarray(_forward(graphdef, state, latents, timestep, text))
    want = _reference(ref, latents, timestep, text)
    assert got.shape == want.shape == (*shape, cfg.out_channels)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_kv_cache_path_equals_text_path(pair):
    _, graphdef, state = pair
    cfg = nnx.merge(graphdef, state).config
    latents, timestep, text = _inputs(cfg, *SHAPES[0])
    k, v = _kv_cache(graphdef, state, text)
    assert k.shape == v.shape == (cfg.num_layers, SHAPES[0][0], TEXT_LEN, cfg.inner_dim)
    np.testing.assert_allclose(
        _cached(graphdef, state, latents, timestep, (k, v)),
        _forward(graphdef, state, latents, timestep, text),
        atol=1e-5,
        rtol=0,
    )


def test_blockwise_attention_equals_dot(pair):
    _, graphdef, state = pair
    cfg = nnx.merge(graphdef, state).config
    latents, timestep, text = _inputs(cfg, *SHAPES[0])
    # Block sizes that divide neither the video tokens nor the 20 text tokens.
    blockwise = _graphdef(cfg, "blockwise:8:16")
    np.testing.assert_allclose(
        _forward(blockwise, state, latents, timestep, text),
        _forward(graphdef, state, latents, timestep, text),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("kernel", ["flash", "splash"])
def test_tpu_kernels_on_padded_tokens_equal_dot(pair, kernel):
    """With a TPU kernel, the blocks run on tokens padded to its blocks (60 -> 128 here) and
    the output is the unpadded model's: no token attends to the pads."""
    _, graphdef, state = pair
    cfg = nnx.merge(graphdef, state).config
    latents, timestep, text = _inputs(cfg, *SHAPES[0])
    np.testing.assert_allclose(
        _forward(_graphdef(cfg, f"{kernel}:128:128:128"), state, latents, timestep, text),
        _forward(graphdef, state, latents, timestep, text),
        atol=2e-5,
        rtol=0,
    )


def test_sharding_constraints_under_a_mesh(pair):
    """Under a mesh with the transformer rules every `constrain` applies (so its logical axes
    must fit the array ranks) and the result does not change."""
    _, graphdef, state = pair
    cfg = nnx.merge(graphdef, state).config
    latents, timestep, text = _inputs(cfg, *SHAPES[0])
    mesh = make_mesh(jax.devices()[:8], (("data", 2), ("fsdp", 1), ("context", 2), ("tensor", 2)))
    with jax.set_mesh(mesh), axis_rules(TRANSFORMER_RULES):
        lowered = _forward.lower(graphdef, state, latents, timestep, text)
        sharded = lowered.compile()(state, latents, timestep, text)
    assert "sharding_constraint" in lowered.as_text()
    np.testing.assert_allclose(
        sharded, _forward(graphdef, state, latents, timestep, text), atol=1e-5, rtol=0
    )


def test_bfloat16_model(pair):
    """bf16 weights and activations, except what diffusers keeps in fp32; close to fp32."""
    _, graphdef, state = pair
    cfg = nnx.merge(graphdef, state).config
    model = nnx.eval_shape(
        lambda: WanTransformer(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )
    bf16_graphdef, bf16_state = nnx.split(model)
    dtypes = {".".join(p): v.dtype for p, v in flatten(nnx.to_pure_dict(bf16_state)).items()}
    assert dtypes["blocks.attn1.to_q.kernel"] == jnp.bfloat16
    fp32 = {"blocks.scale_shift_table", "condition_embedder.time_embedder.linear_1.kernel"}
    assert all(dtypes[name] == jnp.float32 for name in fp32)
    params = jax.tree.map(lambda a, v: a.astype(v.dtype), state, bf16_state)
    latents, timestep, text = _inputs(cfg, *SHAPES[0])
    got = _forward(bf16_graphdef, params, latents, timestep, text)
    want = _forward(graphdef, state, latents, timestep, text)
    assert got.dtype == jnp.bfloat16
    # Within 2% of the output range: bf16 rounding passes it, a 5% error does not.
    np.testing.assert_allclose(got.astype(np.float32), want, atol=0.02 * np.abs(want).max())


def test_scalar_timestep_broadcasts(pair):
    _, graphdef, state = pair
    cfg = nnx.merge(graphdef, state).config
    latents, timestep, text = _inputs(cfg, *SHAPES[0])
    same = np.full_like(timestep, timestep[0])
    np.testing.assert_array_equal(
        _forward(graphdef, state, latents, np.float32(timestep[0]), text),
        _forward(graphdef, state, latents, same, text),
    )


def test_rule_rejects_foreign_weights(pair, tmp_path):
    """An image-to-video tensor has no home in the text-to-video model: import fails loudly."""
    _, graphdef, state = pair
    expected = {p: (v.shape, v.dtype) for p, v in flatten(nnx.to_pure_dict(state)).items()}
    tensors = [("blocks.0.attn2.add_k_proj.weight", np.zeros((4, 4), np.float32))]
    with pytest.raises(WeightError, match="does not have"):
        import_tensors(iter(tensors), expected, rule)
    assert rule("blocks.0.attn2.norm_added_q.weight") is None


def _count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("preset", ["wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-t2v-a14b"])
def test_presets_abstract_and_param_count(preset):
    cfg = PRESETS[preset].transformer
    live = len(jax.live_arrays())
    start = time.perf_counter()
    model = nnx.eval_shape(
        lambda: WanTransformer(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )
    assert time.perf_counter() - start < 10
    state = nnx.state(model)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    assert len(jax.live_arrays()) == live
    with torch.device("meta"):
        ref = WanTransformer3DModel(**dataclasses.asdict(cfg))
    assert _count(state) == sum(p.numel() for p in ref.parameters())
    # Logical axis names for the mesh rules; stacked block params lead with "layers".
    kernel = state["blocks"]["attn1"]["to_q"]["kernel"]
    assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "heads")
