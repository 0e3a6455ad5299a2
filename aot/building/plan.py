"""What one build is made from: a request checked against the bounds of what a build can serve,
and its defaults resolved (mesh, VAE mesh and axis, attention kernel, context parallelism, the
VAE decode's scoped VMEM) into a `BuildPlan` whose `BuildKey` names its folder."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax

from aot.building.request import BuildError, check_model_name, check_shape
from aot.targets import ATTENTION_BLOCKS, Target, devices
from runtime.builds.artifact import BuildKey, plain_values
from runtime.builds.build_options import OPTIONS
from runtime.trust.json_checks import ArtifactError
from wan import programs as wan_programs
from wan import quant, sharding, sparse_attention
from wan.configs import ModelConfig, VideoShape
from wan.interface import IMAGE_PROGRAMS, PIPELINES
from wan.models import attention as attention_lib
from wan.models.radial_mask import RadialSpec

DEVICELESS_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
# The Radial block of a TPU build where not given. Its sparse calls run the kernel within it
# (attention.call_blocks: every block the mask keeps is kept whole), its dense ones at the
# generation's blocks. On v5e at 832x480x81 one flash call at 2048/1024/256 took 44.7 ms here
# (46.8 at 1024/1024/256) against 78.3 dense at 2048/1024/256, 69.7 with keys 128 a matmul;
# splash took 53.5 at 1024/1024/512 (bench/chip_attention.py; docs/benchmarks.md, "On a TPU
# v5e chip").
SPARSE_TPU_BLOCK = 1024
# Build options the chip showed slower than the plain path, by TPU generation: refused there,
# with the measurement (docs/benchmarks.md, "On a TPU v5e chip").
SLOWER_ON_CHIP = {
    ("attention_quant", "v5e"): (
        "int8 attention took 102.9 ms a call against bf16 flash's 78.2 (0.76x) on a v5e chip "
        "at 832x480x81 (bench/chip_attention.py)"
    ),
}
BLOCKWISE_MIN_TOKENS = 8192  # above this, naive attention's temporaries dominate memory


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """Everything one build is made from; `key` names its folder."""

    config: ModelConfig
    shape: VideoShape
    target: Target
    sharding_plan: sharding.ShardingPlan
    attention: str
    key: BuildKey
    default_mesh: bool  # the mesh is the one chosen without --mesh (the runtime prefers it)

    @property
    def mesh(self) -> sharding.MeshShape:
        """The transformer mesh."""
        return self.sharding_plan.transformer


# Longer than most: each default resolved in the order the next one needs it.
def plan_build(
    model_name: str,
    config: ModelConfig,
    shape: VideoShape,
    target: Target,
    num_devices: int,
    *,
    mesh: sharding.MeshShape | None = None,
    vae_spatial: int | None = None,
    attention: str | None = None,
    context_parallel: str | None = None,
    vae_vmem_mib: int | None = None,
    **plain: Any,
) -> BuildPlan:
    """Validate a request and resolve its defaults (mesh, VAE mesh and axis, attention, context
    parallelism, the VAE decode's scoped VMEM); `plain`: the plain build options' values by
    name (runtime.builds.build_options: `pipeline`, the programs it holds, `step_cache`, ...), their
    defaults where not given."""
    check_model_name(model_name)
    check_shape(config, shape)
    plain["pipeline"] = choose_pipeline(plain.get("pipeline"), config, model_name)
    options = plain_option_values(plain)
    quant_mode = dict(options)["quant"]
    check_quant(quant_mode, target)
    radial = check_combinations(dict(options), config)
    default = sharding.default_mesh(
        num_devices, shape.step_batch, transformer_bytes(config, quant_mode), target.hbm_bytes
    )
    mesh = mesh or default
    if mesh.size != num_devices:
        raise BuildError(
            f"mesh {_mesh_text(mesh)} has {mesh.size} devices but target {target.name} has {num_devices}"
        )
    if shape.step_batch % mesh.data:
        raise BuildError(
            f"step batch {shape.step_batch} ({'2 x ' if shape.cfg else ''}--batch {shape.batch}) is not "
            f"divisible by data = {mesh.data}: change --batch or --mesh"
        )
    try:
        layout = sharding.ShardingPlan.choose(mesh, shape.latent_shape(config), vae_spatial)
    except ValueError as e:
        raise BuildError(str(e)) from None
    attention = choose_attention(attention, target, shape.tokens(config))
    context_parallel = choose_context_parallel(context_parallel, config, shape, mesh)
    if radial is not None:
        radial = choose_radial(radial, attention)
        options = tuple(
            (name, radial.text() if name == "sparse_attention" else value)
            for name, value in options
        )
        check_kernel_takes(
            "--sparse-attention", attention_lib.SPARSE_KERNELS, attention, context_parallel,
            config, shape, mesh,
        )  # fmt: skip
    if (attention_8bit := dict(options)["attention_quant"]) != "none":
        check_attention_quant(attention_8bit, target)
        check_kernel_takes(
            "--attention-quant", attention_lib.QUANT_KERNELS, attention, context_parallel,
            config, shape, mesh,
        )  # fmt: skip
    key = BuildKey(
        model=model_name,
        width=shape.width,
        height=shape.height,
        frames=shape.frames,
        batch=shape.batch,
        cfg=shape.cfg,
        target=target.name,
        mesh=mesh.items(),
        vae_mesh=layout.vae_mesh,
        vae_axis=layout.vae_layout.axis,
        attention=attention,
        context_parallel=context_parallel,
        vae_vmem_mib=choose_vae_vmem(vae_vmem_mib, target),
        options=options,
    )
    return BuildPlan(config, shape, target, layout, attention, key, mesh == default)


def check_combinations(
    options: dict[str, Any], config: ModelConfig
) -> sparse_attention.Radial | None:
    """The plain options that do not go together refused; the Radial settings, if any."""
    if options["continuous"] and options["pipeline"] != "t2v":
        raise BuildError(
            "--continuous builds text to video only: build image to video without --continuous"
        )
    if options["continuous"] and options["step_cache"]:
        raise BuildError(
            "--continuous with --step-cache: a continuous batch's videos are at different steps, "
            "and step caching decides for a whole batch whether its blocks run; build one or "
            "the other"
        )
    radial = sparse_attention.parse(options["sparse_attention"])
    if radial is not None:
        check_radial(radial, config, options)
    return radial


def check_radial(radial: sparse_attention.Radial, config: ModelConfig, options: dict) -> None:
    """Radial attention with the other options of a build."""
    if options["continuous"]:
        raise BuildError(
            "--sparse-attention with --continuous: its steps have no sparse variant; build one "
            "or the other"
        )
    if radial.dense_layers > config.transformer.num_layers:
        raise BuildError(
            f"--sparse-attention {radial.text()}: {radial.dense_layers} dense layers, the model "
            f"has {config.transformer.num_layers}: give at most that many"
        )


def choose_radial(radial: sparse_attention.Radial, attention: str) -> sparse_attention.Radial:
    """The Radial settings with their block: SPARSE_TPU_BLOCK in a TPU kernel, else the official
    one, where not given. A TPU kernel runs the mask within its block (attention.call_blocks);
    a block that would make them smaller than the kernel's and than SPARSE_TPU_BLOCK is refused:
    the chip ran small kernel blocks slower than the dense step (v5e: the official block 128 in
    512-token blocks, 0.67x)."""
    tpu = attention_lib.kernel_name(attention) in attention_lib.TPU_KERNELS
    if radial.block is None:
        block = SPARSE_TPU_BLOCK if tpu else sparse_attention.WAN_BLOCK
        return dataclasses.replace(radial, block=block)
    blocks = attention_lib.tpu_blocks(attention) if tpu else None
    if blocks is not None and radial.block < min(max(blocks.q, blocks.kv), SPARSE_TPU_BLOCK):
        raise BuildError(
            f"--sparse-attention {radial.text()} in {attention}: the kernel runs a Radial mask "
            f"within its block, and blocks under {SPARSE_TPU_BLOCK} are slower than dense "
            "attention (v5e: block 128 in 512-token blocks, 0.67x; docs/benchmarks.md): leave "
            f"the block out ({SPARSE_TPU_BLOCK}) or give at least that"
        )
    return radial


def check_kernel_takes(
    flag: str,
    kernels: tuple[str, ...],
    attention: str,
    context_parallel: str,
    config: ModelConfig,
    shape: VideoShape,
    mesh: Any,
) -> None:
    """A kernel among `kernels` (those `flag` runs in), laid out so each device attends whole
    sequences where the kernel cannot be partitioned by XLA (the mask is by position, the
    keys' smoothing needs them all)."""
    kernel = attention_lib.kernel_name(attention)
    if kernel not in kernels:
        raise BuildError(
            f"{flag} with --attention {attention}: it runs in {', '.join(kernels)}: choose one "
            "of them"
        )
    shards, _ = _query_layout(config, shape, mesh)
    if kernel not in attention_lib.PARTITIONABLE and context_parallel == "gather" and shards > 1:
        raise BuildError(
            f"{flag} in {kernel} with the tokens over {shards} devices needs "
            "--context-parallel ulysses (each device then attends whole sequences) or a mesh "
            "without context sharding"
        )


def check_attention_quant(fmt: str, target: Target) -> None:
    """8-bit attention on the target's 8-bit matrix unit: int8 on v4-v6e, fp8 on tpu7x; CPU
    runs either (the reference); GPU targets have no 8-bit kernel here."""
    platform = target_platform(target)
    if platform == "gpu":
        raise BuildError(
            f"--attention-quant {fmt}: {target.name} has no 8-bit attention kernel here (it runs "
            "in flash or splash on TPU and blockwise on CPU): leave it out"
        )
    chip = target.chip
    if chip is not None and chip.eight_bit != fmt:
        raise BuildError(
            f"--attention-quant {fmt}: {target.name} has no {fmt} matrix unit (its 8-bit format "
            f"is {chip.eight_bit}): use --attention-quant {chip.eight_bit} or none"
        )
    if chip is not None and (slower := SLOWER_ON_CHIP.get(("attention_quant", chip.name))):
        raise BuildError(f"--attention-quant {fmt} is not offered for {chip.name}: {slower}")


def choose_pipeline(requested: str | None, config: ModelConfig, model_name: str) -> str:
    """The pipeline variant of a build: `auto` (None) is the model's default; one the model does
    not run is refused (a text-to-video model has no image path, an image-to-video model needs
    its image)."""
    runs = config.pipelines
    if requested in (None, "auto"):
        return runs[0]
    if not any(_image_programs(requested) == _image_programs(own) for own in runs):
        raise BuildError(
            f"--pipeline {requested}: {model_name} runs {' or '.join(runs)}: use --pipeline "
            f"{runs[0]} (or leave it out)"
        )
    return requested


def _image_programs(pipeline: str) -> set[str]:
    """The programs of a pipeline variant that take the image: a variant runs on a model when
    these are the ones of a variant the model runs (other programs, e.g. a toy one, aside)."""
    return set(PIPELINES[pipeline]) & set(IMAGE_PROGRAMS)


def choose_attention(requested: str | None, target: Target, tokens: int) -> str:
    """The attention kernel of a build, with its block sizes: `auto` (None) is dot for short
    sequences, else the target's flash kernel (wan's flash on TPU, cuDNN on a GPU present, the
    Pallas Triton kernel for a deviceless GPU target, blockwise on CPU). A TPU kernel named
    without blocks takes the generation's ATTENTION_BLOCKS (a sparse build's Radial calls run
    within its Radial block: `choose_radial`)."""
    platform = target_platform(target)
    if requested is None:
        flash = {"tpu": "flash", "gpu": "cudnn"}.get(platform, "blockwise")
        flash = "triton" if target.deviceless_gpu else flash
        requested = "dot" if tokens <= BLOCKWISE_MIN_TOKENS else flash
    kernel = attention_lib.kernel_name(requested)
    runs_on = attention_lib.KERNEL_PLATFORM.get(kernel, platform)
    if runs_on != platform:
        raise BuildError(
            f"--attention {requested}: {kernel} runs on {runs_on} targets, {target.name} is "
            f"{platform}: use blockwise or dot"
        )
    if kernel == "cudnn" and target.deviceless_gpu:
        raise BuildError(
            f"--attention cudnn: cuDNN builds its attention graph only with the GPU attached, so "
            f"a deviceless {target.name} build would not run: use triton (the default), "
            "blockwise or dot, or build on the GPU host with --target current"
        )
    if requested in attention_lib.TPU_KERNELS:
        blocks = ATTENTION_BLOCKS[target.generation]
        requested = f"{requested}:" + ":".join(map(str, blocks))
    try:
        attention_lib.resolve(requested)
    except ValueError as e:
        raise BuildError(str(e)) from None
    return requested


def choose_context_parallel(
    requested: str | None,
    config: ModelConfig,
    shape: VideoShape,
    mesh: sharding.MeshShape,
) -> str:
    """`ulysses` where the heads per device divide over the sequence shards, else `gather`."""
    shards, local_heads = _query_layout(config, shape, mesh)
    if requested is None:
        return "ulysses" if shards > 1 and local_heads % shards == 0 else "gather"
    if requested not in attention_lib.CONTEXT_PARALLEL:
        raise BuildError(f"--context-parallel {requested}: use gather or ulysses")
    if requested == "ulysses" and local_heads % shards:
        raise BuildError(
            f"--context-parallel ulysses: {local_heads} heads per device do not divide over "
            f"{shards} sequence shards (mesh {_mesh_text(mesh)}): use gather or another --mesh"
        )
    return requested


def parse_vae_vmem(text: str) -> int | None:
    """`--vae-vmem` as choose_vae_vmem takes it: auto -> None, default -> 0, N -> N."""
    if text == "auto":
        return None
    if text == "default":
        return 0
    if not (text.isdigit() and len(text) <= 6):
        raise BuildError(f"--vae-vmem {text}: use auto, default or a number of MiB")
    return int(text)


def parse_vae_spatial(text: str) -> int | None:
    """`--vae-spatial` as plan_build takes it: auto -> None, N -> N."""
    if text == "auto":
        return None
    if not (text.isdigit() and len(text) <= 6):
        raise BuildError(f"--vae-spatial {text}: use auto or a positive integer")
    return int(text)


def _auto_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda text: None if text == "auto" else parse(text)


# How each build option's flag text (runtime.builds.build_options.OPTIONS, by name) becomes the
# plan_build argument of that name: None (auto) leaves the choice to plan_build.
RESOLVERS: dict[str, Callable[[str], Any]] = {
    "mesh": _auto_or(sharding.MeshShape.parse),
    "vae_spatial": parse_vae_spatial,
    "attention": _auto_or(str),
    "context_parallel": _auto_or(str),
    "vae_vmem_mib": parse_vae_vmem,
}


def resolve_options(texts: dict[str, str]) -> dict[str, Any]:
    """plan_build's keyword arguments from the build options' flag texts, by name: a plain
    option's text parsed by its own `parse`, the others by RESOLVERS."""
    return {
        name: (RESOLVERS[name] if name in RESOLVERS else OPTIONS[name].parse)(text)
        for name, text in texts.items()
    }


def plain_option_values(values: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """BuildKey.options from the plain options' values by name, each checked."""
    for name, value in values.items():
        option = OPTIONS.get(name)
        if option is None or option.check is None:
            raise BuildError(f"{name!r} is not a build option: use {', '.join(OPTIONS)}")
        try:
            option.check(value, option.flag)
        except ArtifactError as e:
            raise BuildError(str(e)) from None
    return plain_values(values)


def choose_vae_vmem(requested: int | None, target: Target) -> int | None:
    """MiB of scoped VMEM the VAE decode is compiled for (TPU only); None: the compiler's
    default, which auto (None) and 0 ask for (aot.targets.FAST_COMPILE_VAE_VMEM_MIB says why)."""
    platform = target_platform(target)
    if platform != "tpu":
        if requested:
            raise BuildError(
                f"--vae-vmem {requested}: scoped VMEM is a TPU compiler setting, {target.name} is "
                f"{platform}: leave it out"
            )
        return None
    if requested is not None and not 0 <= requested <= 128:
        raise BuildError(f"--vae-vmem {requested}: use 1-128 MiB, or 0 for the compiler's default")
    return requested or None


def compiler_options(plan: BuildPlan, program: wan_programs.Program) -> dict[str, Any]:
    """The XLA options one program of `plan` compiles with (part of its identity in the store):
    the build's scoped VMEM for the programs that declare it (at least their floor); for a deviceless GPU target,
    matmuls left to cuBLAS, which picks its algorithm at run time (without the GPU nothing is
    autotuned, and XLA's Triton GEMMs would all get its smallest default tiles)."""
    if plan.target.deviceless_gpu:
        return dict(DEVICELESS_GPU_OPTIONS)
    if program.scoped_vmem and plan.key.vae_vmem_mib:
        mib = max(plan.key.vae_vmem_mib, program.vmem_floor_mib)
        return {"xla_tpu_scoped_vmem_limit_kib": mib * 1024}
    return {}


def ulysses_all_to_alls(plan: BuildPlan) -> int:
    """All-to-alls per denoise step the Ulysses design puts there: q, k, v in and the output
    back, in each layer's self-attention (none when the sequence is not sharded)."""
    shards, _ = _query_layout(plan.config, plan.shape, plan.mesh)
    ulysses = plan.key.context_parallel == "ulysses" and shards > 1
    return 4 * plan.config.transformer.num_layers if ulysses else 0


def kernel_flops(plan: BuildPlan, radial: bool = False) -> float:
    """FLOPs per device per denoise step of the attention kernels that the HLO counts as opaque
    custom calls (flash, splash, Triton, cuDNN): self- and cross-attention of every layer (the
    image tokens' too, in a build whose steps attend to CLIP features), self-attention as built
    (`radial`: radial_step's); 0 for XLA kernels."""
    if attention_lib.kernel_name(plan.attention) in attention_lib.PARTITIONABLE:
        return 0.0
    keys = [plan.config.text_encoder.max_length]
    if plan.config.image_encoder is not None and plan.key.option("pipeline") == "i2v-clip":
        keys.append(plan.config.image_tokens)
    cross = sum(_layer_flops(plan, length) for length in keys) * plan.config.transformer.num_layers
    return cross + self_attention(plan, radial).flops


@dataclasses.dataclass(frozen=True)
class SelfAttention:
    """A step's video self-attention per device: the fraction of query/key blocks its sparse
    layers' kernel computes, its FLOPs with every layer dense and as built, and the part of
    those on 8-bit operands (--attention-quant: Q K^T, and P V in fp8)."""

    density: float
    dense_flops: float
    flops: float
    eight_bit_flops: float = 0.0


def self_attention(plan: BuildPlan, radial: bool) -> SelfAttention:
    """The self-attention of `plan`'s dense step, or (`radial`) of its radial_step: the first
    dense layers at full cost, the others at the kernel's density under the mask."""
    layers = plan.config.transformer.num_layers
    dense = _layer_flops(plan, plan.shape.tokens(plan.config)) * layers
    settings = sparse_attention.parse(plan.key.option("sparse_attention")) if radial else None
    density, built = 1.0, dense
    if settings is not None:
        grid = plan.config.transformer.patch_grid(plan.shape.latent_shape(plan.config)[1:4])
        density = attention_lib.kernel_density(plan.attention, RadialSpec.of(settings, grid))
        dense_layers = min(settings.dense_layers, layers)
        built = dense * (dense_layers + (layers - dense_layers) * density) / layers
    fmt = plan.key.option("attention_quant")
    # Q K^T is half the FLOPs, P V the other half (attention_lib.flops).
    eight_bit = {"none": 0.0, "int8": built / 2, "fp8": built}[fmt]
    return SelfAttention(density, dense, built, eight_bit)


def eight_bit_kernel_flops(plan: BuildPlan, radial: bool = False) -> float:
    """The part of `kernel_flops` on 8-bit operands (the HLO counts an XLA kernel's itself)."""
    if attention_lib.kernel_name(plan.attention) in attention_lib.PARTITIONABLE:
        return 0.0
    return self_attention(plan, radial).eight_bit_flops


def _layer_flops(plan: BuildPlan, kv_length: int) -> float:
    """One layer's attention FLOPs per device for the step's queries against `kv_length` keys."""
    spec, mesh_shape = _query_spec(plan.config, plan.shape, plan.mesh)
    q_shape = _query_shape(plan.config, plan.shape)
    split = math.prod(mesh_shape[a] for entry in spec for a in attention_lib.spec_axes(entry))
    return attention_lib.flops(q_shape, kv_length) / split


def _query_shape(config: ModelConfig, shape: VideoShape) -> tuple[int, ...]:
    tc = config.transformer
    return (shape.step_batch, shape.tokens(config), tc.num_attention_heads, tc.attention_head_dim)


def _query_spec(
    config: ModelConfig, shape: VideoShape, mesh: sharding.MeshShape
) -> tuple[jax.sharding.PartitionSpec, dict[str, int]]:
    """How a denoise step lays out its self-attention queries, and the mesh's sizes."""
    mesh_shape = dict(mesh.items())
    spec = sharding.logical_to_spec(
        attention_lib.Q_AXES, _query_shape(config, shape), mesh_shape, sharding.TRANSFORMER_RULES
    )
    return spec, mesh_shape


def _query_layout(
    config: ModelConfig, shape: VideoShape, mesh: sharding.MeshShape
) -> tuple[int, int]:
    """(sequence shards, heads per device) of the self-attention queries of a denoise step."""
    spec, mesh_shape = _query_spec(config, shape, mesh)
    return attention_lib.sequence_layout(spec, mesh_shape, config.transformer.num_attention_heads)


def target_platform(target: Target) -> str:
    """cpu, tpu or gpu: what the target's devices are (`current`: this machine's)."""
    return devices(target)[0].platform if target.platform == "current" else target.platform


def _mesh_text(mesh: sharding.MeshShape) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.items())


def check_quant(mode: str, target: Target) -> None:
    """A w8a8 mode runs its matmuls on the target's 8-bit MXU format: refused on a TPU without
    it (fp8 on v5e, v5p, v6e; int8 on tpu7x). Weight-only modes dequantize: any target."""
    s = quant.scheme(mode)
    chip = target.chip
    if s is None or not s.activations or chip is None or chip.eight_bit == s.eight_bit:
        return
    others = [
        m for m, o in quant.SCHEMES.items() if not o.activations or o.eight_bit == chip.eight_bit
    ]
    raise BuildError(
        f"--quant {mode}: {target.name} has no {s.eight_bit} matrix unit (its 8-bit format is "
        f"{chip.eight_bit}); use --quant {' or '.join(others)} or none"
    )


@functools.cache
def transformer_bytes(config: ModelConfig, quant_mode: str = "none") -> int:
    """Bytes of one transformer's weights (one expert's), from its abstract state."""
    _, params, _ = wan_programs.split_abstract(
        wan_programs.abstract_module(
            config, "transformer", wan_programs.ProgramOptions(build={"quant": quant_mode})
        )
    )
    return sum(math.prod(p.shape) * p.dtype.itemsize for p in jax.tree.leaves(params))
