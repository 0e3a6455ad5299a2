"""Every sharding decision made once, from the whole shape.

Tables for the VAE mesh and its spatial axis; HLO proofs that a portrait VAE decode needs no
all-to-all and no padding (and that choosing the axis per layer instead does need all-to-alls); the KV cache pinned to the batch; upsampling that never gathers the
activation; and sharded programs that equal their single-device runs.

"No padding from uneven sharding" is checked on the optimized HLO's per-device shapes: every
video activation (a rank-5 array whose leading dim is the per-device batch) has the full
pyramid width (the unsharded axis is never split, so never padded) and a height that is an
exact quotient of a pyramid height by vae_spatial, plus at most the 2 halo rows of a 3x3 conv
(or a halo row alone). An unevenly sharded axis shows up as ceil(n / k) extents instead (the
padded-width control shows it). On TPU only the arrays whose layout XLA keeps logical are
checked: the program's inputs and output and the chunk scan's carry (every feature cache).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compile_program, deviceless_tpu_devices

from aot import hlo, targets
from aot.building.lower import lower_program
from aot.hlo import vae_gathers
from wan import axes, interface, programs, schedulers, sharding
from wan.component_configs import VAEConfig
from wan.configs import VideoShape
from wan.presets import PRESETS
from wan.random_weights import random_params

TINY = PRESETS["tiny"]
CPU8 = jax.devices("cpu")[:8]


def load_bench():
    """bench/vae_allgather.py: the VAE decode's HLO accounting (its chunk scan, gathered bytes),
    which measures the 720p figure on tpu-v6e-8 (minutes per compile)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "vae_allgather.py"
    spec = importlib.util.spec_from_file_location("vae_allgather", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


BENCH = load_bench()


def vae_mesh(devices, shape: tuple[int, int]) -> jax.sharding.Mesh:
    return sharding.make_mesh(devices, tuple(zip(sharding.VAE_AXES, shape, strict=True)))


def transformer_mesh(devices, mesh: sharding.MeshShape) -> jax.sharding.Mesh:
    return sharding.make_mesh(devices, mesh.items())


def pyramid(latent: int, config: VAEConfig) -> list[int]:
    """The sizes of one spatial axis at every decoder level, latent first."""
    return [latent * 2**i for i in range(int(math.log2(config.spatial_factor)) + 1)]


@pytest.fixture(scope="module")
def tpu_devices():
    """The 8 devices of a deviceless v6e:2x4 slice (libtpu's topology description)."""
    with pytest.MonkeyPatch.context() as mp:
        return deviceless_tpu_devices(mp, targets.parse_target("tpu-v6e-8"))


# ----------------------------------------------------------------------------------------------
# Tables.


@pytest.mark.parametrize(
    "batch, expected",
    [
        (0, (1, 8)),
        (1, (1, 8)),
        (2, (1, 8)),
        (3, (1, 8)),
        (4, (1, 8)),
        (8, (8, 1)),
        (12, (1, 8)),
        (16, (8, 1)),
    ],
)
def test_vae_mesh_auto(batch, expected):
    assert sharding.vae_mesh_shape(8, batch) == expected


@pytest.mark.parametrize(
    "vae_spatial, expected", [(1, (8, 1)), (2, (4, 2)), (4, (2, 4)), (8, (1, 8))]
)
def test_vae_mesh_explicit_overrides_batch(vae_spatial, expected):
    for batch in (1, 8, 16):
        assert sharding.vae_mesh_shape(8, batch, vae_spatial) == expected


@pytest.mark.parametrize("vae_spatial", [0, -1, 3, 5, 16])
def test_vae_mesh_explicit_must_divide(vae_spatial):
    with pytest.raises(ValueError, match="must divide the device count 8"):
        sharding.vae_mesh_shape(8, 8, vae_spatial)


# (width, height) in pixels -> the axis for vae_spatial 1, 2, 4, 8. Latent = (H/8, W/8).
LAYOUTS = {
    (1280, 720): ("width", "width", "width", "width"),  # latent 90 x 160
    (720, 1280): ("width", "width", "height", "height"),  # latent 160 x 90
    (832, 480): ("width", "width", "width", "width"),  # latent 60 x 104
    (480, 832): ("width", "width", "width", "height"),  # latent 104 x 60
}


@pytest.mark.parametrize("resolution", list(LAYOUTS))
def test_vae_axis_table(resolution):
    width, height = resolution
    config = VAEConfig()
    lat_h, lat_w = height // config.spatial_factor, width // config.spatial_factor
    for vae_spatial, axis in zip((1, 2, 4, 8), LAYOUTS[resolution], strict=True):
        layout = sharding.choose_vae_layout(lat_h, lat_w, vae_spatial)
        assert layout == sharding.VaeLayout(axis), (resolution, vae_spatial)
        assert not layout.uneven
        # One choice holds at every pyramid level: no level ever needs the other axis.
        latent = lat_w if axis == "width" else lat_h
        assert all(n % vae_spatial == 0 for n in pyramid(latent, config))
        assert dict(layout.rules())[f"vae_{axis}"] == "vae_spatial"


def test_vae_axis_pads_width_when_neither_divides():
    layout = sharding.choose_vae_layout(90, 90, 4)  # 720x720
    assert layout == sharding.VaeLayout("width", padded=True)
    assert layout.uneven == {"vae_width"}


def test_unknown_logical_axis_is_an_error():
    """A typo in a logical name must not silently replicate the dimension."""
    with pytest.raises(ValueError, match=r"unknown logical axis \['lenght'\]"):
        sharding.logical_to_spec(
            ("batch", "lenght"), (8, 64), {"data": 8}, sharding.TRANSFORMER_RULES
        )
    # Every name the rules know is a wan.axes name.
    names = {name for name, _ in sharding.TRANSFORMER_RULES}
    names |= {name for name, _ in sharding.VaeLayout("width").rules()}
    assert names <= axes.ALL


# The VAE's rules written out: videos on `redundant`, one spatial axis on `vae_spatial`, conv
# kernels replicated.
WIDTH_RULES = (("vae_batch", "redundant"), ("vae_width", "vae_spatial"), ("vae_conv_out", None))
HEIGHT_RULES = (("vae_batch", "redundant"), ("vae_height", "vae_spatial"), ("vae_conv_out", None))


def test_latents_handoff_joins_the_step_and_the_decode():
    """latents_handoff takes the latents as the denoise step leaves them (transformer mesh) and
    leaves them as the decode takes them (VAE mesh), so the decode's program depends on the VAE
    mesh alone."""
    from aot.building.lower import lower_plan
    from aot.building.plan import plan_build

    shape = VideoShape(64, 96, 9, 2, cfg=False)
    plan = plan_build("tiny", TINY, shape, targets.parse_target("cpu-8"), 8)
    compiled = {
        lowered.program.name: lowered.compile()
        for lowered in lower_plan(plan, only={"denoise_step", "latents_handoff", "vae_decode"})
    }
    step_out = compiled["denoise_step"].output_shardings["latents"]
    (handoff_in,) = compiled["latents_handoff"].input_shardings[0]
    handoff_out = compiled["latents_handoff"].output_shardings["latents"]
    decode_in = interface.named("vae_decode", compiled["vae_decode"].input_shardings[0])["latents"]
    assert handoff_in.is_equivalent_to(step_out, 5) and handoff_out.is_equivalent_to(decode_in, 5)
    assert handoff_in.mesh.axis_names == tuple(name for name, _ in plan.mesh.items())
    assert decode_in.mesh.axis_names == sharding.VAE_AXES


@pytest.mark.parametrize(
    "transformer, batch, latent_hw, gather, vae_mesh, vae_rules",
    [
        # batch 8 on data: the decode takes batch-sharded latents and decodes batch-parallel.
        (sharding.MeshShape(data=8), 8, (90, 160), False, (8, 1), WIDTH_RULES),
        # batch 2 over data: the latents arrive batch-sharded, the decode is spatial: gathered.
        (sharding.MeshShape(data=2, context=4), 2, (90, 160), True, (1, 8), WIDTH_RULES),
        # batch 1: nothing on data, the latents arrive whole.
        (sharding.MeshShape(context=8), 1, (90, 160), False, (1, 8), WIDTH_RULES),
        # portrait: 8 does not divide the latent width 90, it divides the height 160.
        (sharding.MeshShape(context=8), 1, (160, 90), False, (1, 8), HEIGHT_RULES),
    ],
)
def test_sharding_plan_handoff(transformer, batch, latent_hw, gather, vae_mesh, vae_rules):
    """The plan of a build: the VAE mesh and rules, and whether the latents are gathered whole
    on their way from the denoise step's layout to the decode's."""
    plan = sharding.ShardingPlan.choose(transformer, (batch, 3, *latent_hw, 16))
    assert plan.vae_mesh == vae_mesh and plan.gather_latents == gather
    assert (plan.latents_spec()[0] is not None) == (transformer.data > 1)
    assert plan.rules("vae") == (vae_rules, frozenset())
    assert plan.rules("transformer") == (sharding.TRANSFORMER_RULES, frozenset())


# ----------------------------------------------------------------------------------------------
# HLO proofs: a portrait decode with no all-to-all and no padding; the per-layer choice fails.

# Latent 12 x 10 (H x W), vae_spatial 4: 10 % 4 != 0 but 12 % 4 == 0, while the widths above
# the latent (20, 40, 80) divide: a per-layer choice flips axis, the once-chosen one does not.
# 3 latent frames: the chunk scan keeps 2 trips (XLA unrolls a 1-trip loop, doubling the work).
PORTRAIT = VideoShape(width=80, height=96, frames=9, batch=4)
PORTRAIT_MESH = (2, 4)  # vae_spatial=4: 2 videos per device group, so per-device batch 2


def video_extents(module: hlo.Module, batch: int, everywhere: bool) -> set[tuple[int, int]]:
    """(height, width) of the rank-5 arrays whose leading dim is `batch` (video activations;
    conv kernels lead with 1 or 3): of every instruction, or only where every platform keeps
    the logical layout: the entry's parameters and result and the chunk scan's carried state
    (XLA TPU folds spatial dims into tiles inside its fusions)."""
    if everywhere:
        instructions = module.instructions.values()
    else:
        entry = module.computations[module.entry]
        scan = module.instructions[vae_gathers.chunk_scan(module).name]
        params = [i for i in entry.instructions if i.opcode == "parameter"]
        instructions = [*params, entry.root, scan]
    found = set()
    for ins in instructions:
        for s in ins.shape.tuple_shapes if ins.shape.is_tuple else (ins.shape,):
            if len(s.dims) == 5 and s.dims[0] == batch:
                found.add((s.dims[2], s.dims[3]))
    return found


def portrait_violations(module: hlo.Module, everywhere: bool = True) -> list[str]:
    """What breaks 'height sharded evenly at every level, width never split, no all-to-all'."""
    vae_spatial = PORTRAIT_MESH[1]
    _, _, lat_h, lat_w, _ = PORTRAIT.latent_shape(TINY)
    widths = set(pyramid(lat_w, TINY.vae))
    quotients = [n // vae_spatial for n in pyramid(lat_h, TINY.vae)]
    heights = {q + halo for q in quotients for halo in (0, 1, 2)} | {1, 2}
    problems = [
        f"{c.count} x all-to-all {c.shape} from {c.op_name}"
        for c in hlo.collectives(module)
        if c.kind == "all-to-all"
    ]
    extents = video_extents(module, PORTRAIT.batch // PORTRAIT_MESH[0], everywhere)
    for h, w in sorted(extents):
        if w not in widths:
            problems.append(f"width {w} is not a whole pyramid width {sorted(widths)}")
        if h not in heights:
            problems.append(f"height {h} is not an exact quotient (+halo) of {quotients}")
    # The height really is sharded (a replicated decode would pass the checks trivially).
    if not problems and (quotients[0], lat_w) not in extents:
        problems.append(f"no latent-level array of per-device height {quotients[0]}")
    return problems


def compile_portrait(
    devices, layout: sharding.VaeLayout, compiler_options: dict | None = None
) -> hlo.Module:
    # A fresh program each time: jit caches traces per function, and the rules are read while
    # tracing.
    program = programs.vae_decode_program(TINY, PORTRAIT, programs.ProgramOptions())
    lowered = lower_program(
        program, vae_mesh(devices, PORTRAIT_MESH), layout.rules(), layout.uneven
    )
    return hlo.parse(lowered.compile(compiler_options).as_text())


def portrait_layout() -> sharding.VaeLayout:
    _, _, lat_h, lat_w, _ = PORTRAIT.latent_shape(TINY)
    assert (lat_h, lat_w) == (12, 10)
    assert sharding.vae_mesh_shape(8, PORTRAIT.batch, 4) == PORTRAIT_MESH
    layout = sharding.choose_vae_layout(lat_h, lat_w, PORTRAIT_MESH[1])
    assert layout == sharding.VaeLayout("height")
    return layout


def test_portrait_decode_has_no_all_to_all_and_no_padding_cpu():
    assert portrait_violations(compile_portrait(CPU8, portrait_layout())) == []


def test_portrait_decode_has_no_all_to_all_and_no_padding_tpu(tpu_devices):
    """Compiled as `aot build --vae-vmem 4` compiles the decode (FAST_COMPILE_VAE_VMEM_MIB): the
    scoped VMEM sizes libtpu's conv tiles, after the partitioner has laid the arrays out and
    placed the collectives this test reads; at the compiler's default the compile takes twice
    as long for the same layouts."""
    # Layouts do not depend on precision; the tests' "highest" triples the TPU compile time.
    with jax.default_matmul_precision("default"):
        module = compile_portrait(
            tpu_devices,
            portrait_layout(),
            {"xla_tpu_scoped_vmem_limit_kib": 1024 * targets.FAST_COMPILE_VAE_VMEM_MIB},
        )
    assert portrait_violations(module, everywhere=False) == []


def test_per_layer_axis_choice_is_caught(monkeypatch):
    monkeypatch.setattr(
        "wan.models.vae.constrain", BENCH.per_activation_constrain(PORTRAIT_MESH[1])
    )
    problems = portrait_violations(compile_portrait(CPU8, portrait_layout()))
    assert any("all-to-all" in p for p in problems), problems


def test_padded_width_is_caught():
    """The fallback for sizes neither axis divides pads width: the same check sees it."""
    padded = sharding.VaeLayout("width", padded=True)
    problems = portrait_violations(compile_portrait(CPU8, padded))
    assert "width 3 is not a whole pyramid width [10, 20, 40, 80]" in problems, problems


# ----------------------------------------------------------------------------------------------
# The KV cache: batch on ('data', 'fsdp') when it divides, replicated otherwise.

KV_MESH = sharding.MeshShape(data=2, fsdp=2, tensor=2)
RULES = sharding.TRANSFORMER_RULES


def place(compiled, *args):
    """Put host arrays where the executable expects them."""
    return jax.device_put(args, compiled.input_shardings[0])


def inputs(program: programs.Program, values) -> dict:
    """An executable's inputs in call order (input shardings, say), by name."""
    return interface.named(program.name, values)


def reference_kv(params: dict, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Layer by layer, from the parameters themselves: context = text MLP(embeddings),
    k = RMSNorm(context @ Wk + bk) * gain, v = context @ Wv + bv."""
    cfg = TINY.transformer
    mlp = params["condition_embedder"]["text_embedder"]
    hidden = embeddings @ mlp["linear_1"]["kernel"] + mlp["linear_1"]["bias"]
    hidden = jax.nn.gelu(hidden, approximate=True)
    context = hidden @ mlp["linear_2"]["kernel"] + mlp["linear_2"]["bias"]
    attn = params["blocks"]["attn2"]
    ks, vs = [], []
    for i in range(cfg.num_layers):
        k = context @ attn["to_k"]["kernel"][i] + attn["to_k"]["bias"][i]
        k = k * jax.lax.rsqrt(jnp.mean(k * k, axis=-1, keepdims=True) + cfg.eps)
        ks.append(k * attn["norm_k"]["scale"][i])
        vs.append(context @ attn["to_v"]["kernel"][i] + attn["to_v"]["bias"][i])
    return np.stack(ks), np.stack(vs)


@pytest.mark.parametrize("batch, sharded", [(2, True), (4, True), (1, False)])
def test_kv_cache_batch_sharded_or_replicated(batch, sharded):
    """Step batch 2B (CFG) over data x fsdp = 4: 4 and 8 divide, 2 does not (no error)."""
    shape = VideoShape(width=64, height=64, frames=5, batch=batch)
    program = programs.kv_cache_program(TINY, shape, programs.ProgramOptions())
    compiled = compile_program(program, transformer_mesh(CPU8, KV_MESH), RULES)
    batch_axes = ("data", "fsdp") if sharded else None
    emb_sharding = inputs(program, compiled.input_shardings[0])["embeddings"]
    assert emb_sharding.spec[0] == batch_axes
    for out in compiled.output_shardings["kv"]:
        assert tuple(out.spec)[:2] == (None, batch_axes)
        assert out.spec[3] == "tensor"  # heads

    params = random_params(TINY, "transformer", seed=1)
    rng = np.random.default_rng(0)
    embeddings = rng.standard_normal(program.args["embeddings"].shape).astype(np.float32)
    k, v = compiled(*place(compiled, params, embeddings))["kv"]
    local = k.addressable_shards[0].data.shape[1]
    assert local == (shape.step_batch // 4 if sharded else shape.step_batch)
    ref_k, ref_v = reference_kv(params, embeddings)
    np.testing.assert_allclose(np.asarray(k), ref_k, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(v), ref_v, atol=1e-5, rtol=0)


def test_denoise_step_consumes_the_kv_cache_as_laid_out():
    """The kv input of denoise_step has exactly the kv_cache output's sharding: no reshard."""
    shape = VideoShape(width=64, height=64, frames=5, batch=2)
    mesh = transformer_mesh(CPU8, KV_MESH)
    produced = compile_program(
        programs.kv_cache_program(TINY, shape, programs.ProgramOptions()), mesh, RULES
    )
    step = programs.denoise_step_program(TINY, shape, programs.ProgramOptions())
    kv_in = inputs(step, compile_program(step, mesh, RULES).input_shardings[0])["kv"]
    kv_out = produced.output_shardings["kv"]
    assert kv_in == tuple(kv_out)
    kv_ndim = len(programs.kv_shape(TINY, shape).shape)
    for a, b in zip(kv_in, kv_out, strict=True):
        assert a.is_equivalent_to(b, kv_ndim) and a.spec[1] == ("data", "fsdp")


# ----------------------------------------------------------------------------------------------
# Sharded == single device, fp32.


def single_device(program: programs.Program, *args):
    """The same function jitted on one device, outside any mesh (constrain is the identity)."""
    return jax.jit(program.fn)(*jax.device_put(args, CPU8[0]))


# The tiny transformer with 4 heads of 8 channels (same width): heads that divide over 4
# sequence shards, so Ulysses attention applies on context=4.
FOUR_HEADS = dataclasses.replace(
    TINY,
    transformer=dataclasses.replace(TINY.transformer, num_attention_heads=4, attention_head_dim=8),
)


@pytest.mark.parametrize(
    "config, attention, context_parallel, atol",
    [
        (TINY, "dot", "gather", 1e-5),
        (FOUR_HEADS, "blockwise:16:16", "ulysses", 1e-5),
        # The Pallas kernels in interpret mode inside shard_map, q/k/v all-to-all'd to heads.
        (FOUR_HEADS, "flash:128:128:128", "ulysses", 1e-4),
        (TINY, "splash:128:128:128", "gather", 1e-4),
    ],
    ids=["dot-gather", "blockwise-ulysses", "flash-ulysses", "splash-gather"],
)
def test_denoise_step_sharded_equals_single_device(config, attention, context_parallel, atol):
    """data=2 x context=4 on 8 host devices == the single-device dot step."""
    shape = VideoShape(width=64, height=64, frames=5, batch=1)
    mesh = transformer_mesh(CPU8, sharding.MeshShape(data=2, context=4))
    sharded = programs.denoise_step_program(
        config, shape, programs.ProgramOptions(attention, context_parallel)
    )
    compiled = compile_program(sharded, mesh, RULES)

    program = programs.denoise_step_program(config, shape, programs.ProgramOptions())
    rng = np.random.default_rng(0)

    def draw(s: jax.ShapeDtypeStruct) -> np.ndarray:
        return rng.standard_normal(s.shape).astype(s.dtype)

    params = random_params(config, "transformer", seed=2)
    row = {k: np.asarray(v) for k, v in schedulers.make_tables(config.scheduler, 4).row(1).items()}
    named = {
        "params": params,
        "latents": draw(program.args["latents"]),
        "kv": jax.tree.map(draw, program.args["kv"]),
        "row": row,
        "state": jax.tree.map(draw, program.args["state"]),
        "guidance": np.float32(5.0),
    }
    args = interface.positional(program.name, named)
    got = jax.device_get(compiled(*place(compiled, *args)))
    want = jax.device_get(single_device(program, *args))
    kv_in = inputs(program, compiled.input_shardings[0])["kv"][0]
    assert (kv_in.spec[1], kv_in.spec[3]) == ("data", None)  # CFG batch 2 over data=2
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, atol=atol, rtol=0)
    module = hlo.parse(compiled.as_text())
    all_to_alls = sum(c.count for c in hlo.collectives(module) if c.kind == "all-to-all")
    ulysses = 4 * config.transformer.num_layers if context_parallel == "ulysses" else 0
    assert all_to_alls == ulysses  # q, k, v and the output of each layer's self-attention


def test_denoise_step_with_fsdp_has_no_all_to_all():
    """Batch 8 (step batch 16) over data=2 x fsdp=4: the time embedding leaves the weights'
    fsdp layout without an all-to-all."""
    shape = VideoShape(width=64, height=64, frames=5, batch=8)
    mesh = transformer_mesh(CPU8, sharding.MeshShape(data=2, fsdp=4))
    compiled = compile_program(
        programs.denoise_step_program(TINY, shape, programs.ProgramOptions()), mesh, RULES
    )
    kinds = {c.kind for c in hlo.collectives(hlo.parse(compiled.as_text()))}
    assert "all-to-all" not in kinds


# 8 heads of 4 channels: they divide over the 8 sequence shards of fsdp=4 x context=2.
EIGHT_HEADS = dataclasses.replace(
    TINY,
    transformer=dataclasses.replace(TINY.transformer, num_attention_heads=8, attention_head_dim=4),
)


def test_ulysses_all_to_alls_are_the_only_ones_at_720p():
    """B=1 at 720x1280/81 frames over fsdp=4 x context=2 (the 14B's tpu-v6e-8 mesh), where
    the 21-frame patch grid does not split into 8 contiguous runs of tokens: the patches are
    embedded where their tokens live, so the step's all-to-alls are the attention's 4 per layer."""
    shape = VideoShape(width=720, height=1280, frames=81, batch=1)
    mesh = transformer_mesh(CPU8, sharding.MeshShape(fsdp=4, context=2))
    program = programs.denoise_step_program(
        EIGHT_HEADS, shape, programs.ProgramOptions("blockwise", "ulysses")
    )
    module = hlo.parse(compile_program(program, mesh, RULES).as_text())
    all_to_alls = [c for c in hlo.collectives(module) if c.kind == "all-to-all"]
    assert sum(c.count for c in all_to_alls) == 4 * EIGHT_HEADS.transformer.num_layers
    assert all(c.source_file.endswith("wan/models/attention.py") for c in all_to_alls)


# Latent 8 x 6 (H x W): (1, 8) and (2, 4) shard height (6 divides by neither), (8, 1) the batch.
DECODE_LATENT = dict(width=48, height=64, frames=5)


@pytest.fixture(scope="module")
def decode_reference():
    """Random VAE weights, 8 videos of latents, and their single-device fp32 frames."""
    params = random_params(TINY, "vae", seed=3)
    shape = VideoShape(**DECODE_LATENT, batch=8)
    program = programs.vae_decode_program(
        TINY, shape, programs.ProgramOptions(frames_dtype="float32")
    )
    rng = np.random.default_rng(1)
    latents = rng.standard_normal(program.args["latents"].shape).astype(np.float32)
    return params, latents, np.asarray(single_device(program, params, latents)["frames"])


@pytest.mark.parametrize(
    "mesh_shape, batch, axis", [((1, 8), 1, "height"), ((8, 1), 8, "width"), ((2, 4), 2, "height")]
)
def test_vae_decode_sharded_equals_single_device(decode_reference, mesh_shape, batch, axis):
    params, latents, want = decode_reference
    shape = VideoShape(**DECODE_LATENT, batch=batch)
    _, _, lat_h, lat_w, _ = shape.latent_shape(TINY)
    layout = sharding.choose_vae_layout(lat_h, lat_w, mesh_shape[1])
    assert layout == sharding.VaeLayout(axis)
    program = programs.vae_decode_program(
        TINY, shape, programs.ProgramOptions(frames_dtype="float32")
    )
    compiled = compile_program(program, vae_mesh(CPU8, mesh_shape), layout.rules(), layout.uneven)
    got = compiled(*place(compiled, params, latents[:batch]))["frames"]
    spec = tuple(compiled.output_shardings["frames"].spec)
    assert spec[0] == ("redundant" if mesh_shape[0] > 1 else None)
    assert spec[2] == ("vae_spatial" if mesh_shape[1] > 1 else None)
    assert np.mean((want > 0) & (want < 1)) > 0.05  # not all clipped
    np.testing.assert_allclose(np.asarray(got), want[:batch], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------
# Upsampling stays local: all-gathered bytes per latent frame of the real VAE config.


# 320x176 and 176x320 are 1280x720 and 720x1280 at a quarter of the size: latents 22 x 40 and
# 40 x 22, whose 22 (like 90) vae_spatial 8 does not divide.
@pytest.mark.parametrize("width, height, axis", [(320, 176, "width"), (176, 320, "height")])
def test_upsampling_gathers_no_activation(width, height, axis):
    """A decoder that gathers each upsampler's input whole receives those inputs' bytes per
    latent frame (bench/vae_allgather.py `upsampler_input_bytes`: 553 MB at 720p in bf16);
    ours gathers only the mid-block attention's keys and values, under 10% of it. At a
    quarter of 720p on cpu-8; the real size on tpu-v6e-8 takes minutes to compile:
    bench/vae_allgather.py (docs/benchmarks.md)."""
    config = PRESETS["wan2.1-t2v-14b"]
    shape = VideoShape(width, height, frames=9, batch=1)  # 3 latent frames
    _, _, lat_h, lat_w, _ = shape.latent_shape(config)
    layout = sharding.choose_vae_layout(lat_h, lat_w, 8)
    assert layout == sharding.VaeLayout(axis)
    program = programs.vae_decode_program(config, shape, programs.ProgramOptions())
    compiled = compile_program(program, vae_mesh(CPU8, (1, 8)), layout.rules(), layout.uneven)
    g = vae_gathers.gathers(hlo.parse(compiled.as_text()))
    budget = 0.1 * BENCH.upsampler_input_bytes(config, width, height)
    assert g.trips == 3 and g.all_to_all == 0  # every latent frame, the first included
    assert g.per_latent_frame <= budget, g.top


def collectives_by_orientation(config, make) -> dict[str, dict[str, int]]:
    """Landscape 128x80 (width sharded) and portrait 80x128 (height sharded) on the VAE mesh
    (1, 8): the collectives by kind and count of `make(config, shape)`, a VAE program."""
    summaries = {}
    for width, height, axis in [(128, 80, "width"), (80, 128, "height")]:
        shape = VideoShape(width, height, frames=9, batch=1)
        _, _, lat_h, lat_w, _ = shape.latent_shape(config)
        layout = sharding.choose_vae_layout(lat_h, lat_w, 8)
        assert layout.axis == axis
        compiled = compile_program(
            make(config, shape), vae_mesh(CPU8, (1, 8)), layout.rules(), layout.uneven
        )
        collectives = hlo.collective_summary(hlo.parse(compiled.as_text()))
        summaries[axis] = {kind: c["count"] for kind, c in collectives.items() if c["count"]}
    return summaries


def test_both_orientations_have_the_same_collectives():
    """Landscape shards width, portrait height (latents 16 x 10 and 10 x 16, like 720p's
    160 x 90): the mid-block attention keeps its queries local in both, so the two decodes
    have the same collectives by kind and count, and no all-to-all."""
    options = programs.ProgramOptions()
    summaries = collectives_by_orientation(
        TINY, lambda c, s: programs.vae_decode_program(c, s, options)
    )
    assert summaries["width"] == summaries["height"]
    assert "all-to-all" not in summaries["width"]


def test_the_image_encode_has_the_decodes_collectives_in_both_orientations():
    """Image to video's VAE encode (81 frames' worth of its image and zero frames, here 9) on
    the decode's mesh and spatial axis: portrait and landscape have the same collectives by
    kind and count, and neither an all-to-all."""
    i2v = dataclasses.replace(
        TINY, transformer=dataclasses.replace(TINY.transformer, in_channels=36)
    )
    options = programs.ProgramOptions(build={"pipeline": "i2v"})
    summaries = collectives_by_orientation(
        i2v, lambda c, s: programs.vae_encode_program(c, s, options)
    )
    assert summaries["width"] == summaries["height"]
    assert "all-to-all" not in summaries["width"]


def test_720p_denoise_step_runs_flash_on_tpu(tpu_devices):
    """`--attention auto` for tpu-v6e-8 at a 720p-length sequence (75,600 tokens) plans the
    Mosaic kernel at the generation's blocks. Compiled at 3 of its 21 latent frames (10,800
    tokens, over BLOCKWISE_MIN_TOKENS: auto plans the same kernel, blocks and mesh): the
    self-attention is the Mosaic kernel, and no blockwise loop is left (the layer scan is the
    only while loop). The program differs only in its lengths, and XLA's TPU compile time
    grows with them: three times as long at 75,600 tokens."""
    from aot.building.plan import BLOCKWISE_MIN_TOKENS, plan_build

    target = targets.parse_target("tpu-v6e-8")
    shape = VideoShape(width=1280, height=720, frames=81, batch=1)
    plan = plan_build("tiny", TINY, shape, target, len(tpu_devices))
    assert shape.tokens(TINY) == 75600
    assert plan.attention == "flash:3072:2048:512"
    assert plan.key.context_parallel == "gather"  # 2 heads do not divide over 4 shards
    compiled_shape = dataclasses.replace(shape, frames=9)
    compiled_plan = plan_build("tiny", TINY, compiled_shape, target, len(tpu_devices))
    assert compiled_shape.tokens(TINY) == 10800 > BLOCKWISE_MIN_TOKENS
    assert (compiled_plan.attention, compiled_plan.mesh, compiled_plan.key.context_parallel) == (
        plan.attention, plan.mesh, plan.key.context_parallel
    )  # fmt: skip
    mesh = transformer_mesh(tpu_devices, plan.mesh)
    program = programs.denoise_step_program(
        TINY, compiled_shape, programs.ProgramOptions(plan.attention)
    )
    with jax.default_matmul_precision("default"):
        text = compile_program(program, mesh, RULES).as_text()
    assert "tpu_custom_call" in text
    module = hlo.parse(text)
    loops = [i for c in module.computations.values() for i in c.instructions if i.opcode == "while"]
    assert len(loops) == 1, [i.name for i in loops]
