"""The options of a build that its key records, each declared once, in `OPTIONS`: the
`aot build` / `aot plan` flag (its help and default), its part of the build folder's name, and
the flag that asks for exactly a key's value (`aot plan`'s commands, the runtime's "make it
with" hints). No jax and no aot here: the runtime names builds with it and `aot.cli` makes its
click options from it.

Two kinds: a *plain* option (it has a `check`) is whole here: its flag's text parsed by `parse`
is its value, kept in `BuildKey.options`, checked in a manifest by `check`, given to the
programs and modules (`wan.programs.ProgramOptions.build`), and, with `programs`, it decides
which programs the build holds (`held_programs`); an option that the build resolves against the
target (the mesh, attention, ...) is a field of `BuildKey` and has its resolver, by the same
name, in `aot.building.plan.RESOLVERS`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from runtime.trust import json_checks
from wan import sparse_attention
from wan.interface import (
    CONTINUOUS_PROGRAMS,
    DEFAULT_PIPELINE,
    PIPELINES,
    SPARSE_PROGRAMS,
    replaced,
    with_step_cache,
)
from wan.quant import MODES as QUANT_MODES


@dataclasses.dataclass(frozen=True)
class BuildOption:
    name: str  # the plan_build parameter it sets, and its resolver in aot.building.plan.RESOLVERS
    flag: str
    help: str  # may name {fast_vae_vmem_mib} (aot.targets.FAST_COMPILE_VAE_VMEM_MIB), filled in by aot.cli
    token: Callable[[Any], str]  # build key -> its part of the folder name ("": left out)
    argv: Callable[[Any], list[str]]  # build key -> the flag and value asking for exactly it
    default: str | bool = "auto"
    choices: tuple[str, ...] | None = None
    is_flag: bool = False  # a switch: its value is True when given
    # A plain option: its value's check in a manifest (runtime.trust.json_checks), and the flag's text
    # -> its value. None: a BuildKey field resolved by aot.building.plan.RESOLVERS.
    check: Callable[[Any, str], Any] | None = None
    parse: Callable[[Any], Any] = str
    # A plain option that decides which programs a build holds: (the programs the options
    # before it chose, its value) -> the programs.
    programs: Callable[[tuple[str, ...], Any], tuple[str, ...]] | None = None
    # The flag's default when it is not `default` (what a manifest without the option means):
    # "auto", resolved against the model by aot.building.plan.
    flag_default: str | None = None

    @property
    def default_value(self) -> Any:
        """A plain option's value when its flag is not given (and in older manifests)."""
        return self.parse(self.default)


def switch(
    name: str, flag: str, help: str, programs: Callable[[tuple[str, ...]], tuple[str, ...]]
) -> BuildOption:
    """A plain on/off option that, on, changes the programs a build holds (`programs`: the
    programs before it -> with it); its folder-name token is its name without underscores."""
    return BuildOption(
        name, flag, help,
        token=lambda k: f"_{name.replace('_', '')}" if k.option(name) else "",
        argv=lambda k: [flag] if k.option(name) else [],
        default=False,
        is_flag=True,
        check=json_checks.boolean,
        parse=bool,
        programs=lambda names, on: programs(names) if on else names,
    )  # fmt: skip


def choice(
    name: str, flag: str, help: str, modes: tuple[str, ...], token_prefix: str = "_"
) -> BuildOption:
    """A plain option that is one of `modes`, "none" (the default) among them; its folder-name
    token is `token_prefix` and the value, none left out."""
    return BuildOption(
        name, flag, help,
        token=lambda k: "" if k.option(name) == "none" else f"{token_prefix}{k.option(name)}",
        argv=lambda k: [flag, k.option(name)],
        default="none",
        choices=modes,
        check=json_checks.one_of(*modes),
    )  # fmt: skip


def _mesh_text(key: Any, separator: str) -> str:
    return separator.join(f"{axis}={size}" for axis, size in key.mesh)


ATTENTION_QUANT_MODES = ("none", "int8", "fp8")  # wan.models.attention_quant.FORMATS, or none


def _sparse_token(key: Any) -> str:
    value = key.option("sparse_attention")
    if value == sparse_attention.NONE:
        return ""
    settings = sparse_attention.parse(value)
    default = dataclasses.replace(settings, block=None) == sparse_attention.DEFAULT_RADIAL
    return f"_radial{settings.block}" if default else "_" + value.replace(":", "-")


def _sparse_check(value: Any, where: str) -> str:
    """A recorded --sparse-attention value: its canonical spelling."""
    text = json_checks.string(value, where)
    try:
        if sparse_attention.canonical(text) == text:
            return text
    except sparse_attention.SparseAttentionError:
        pass
    raise json_checks.malformed(where, "must be none or radial:<decay>:<steps>:<layers>[:<block>]")


_DECLARED = (
    BuildOption(
        "mesh", "--mesh",
        "data=..,fsdp=..,context=..,tensor=.. (auto: per target and batch).",
        token=lambda k: "_" + "-".join(f"{axis[0]}{size}" for axis, size in k.mesh),
        argv=lambda k: ["--mesh", _mesh_text(k, ",")],
    ),
    BuildOption(
        "vae_spatial", "--vae-spatial", "auto or N (must divide the device count).",
        token=lambda k: f"_vae{k.vae_mesh[0]}x{k.vae_mesh[1]}{k.vae_axis[0]}",
        argv=lambda k: ["--vae-spatial", str(k.vae_mesh[1])],
    ),
    BuildOption(
        "attention", "--attention",
        "auto, dot, blockwise[:<q>:<kv>], flash[:<q>:<kv>:<kv_compute>] (TPU), "
        "splash[:<q>:<kv>:<kv_compute>] (TPU; JAX's kernel, slower on v5e), triton (GPU) or "
        "cudnn (a GPU present). auto: dot up to 8192 tokens, else flash on TPU, triton for a "
        "deviceless GPU target, cudnn on a GPU present (--target current), blockwise on CPU.",
        token=lambda k: "_" + k.attention.replace(":", "-"),
        argv=lambda k: ["--attention", k.attention],
    ),
    BuildOption(
        "context_parallel", "--context-parallel",
        "How sequence-sharded self-attention meets its keys: gather them, or all-to-all to head "
        "sharding (ulysses). auto: ulysses when the heads divide over the sequence shards.",
        token=lambda k: "_ulysses" if k.context_parallel == "ulysses" else "",
        argv=lambda k: ["--context-parallel", k.context_parallel],
        choices=("auto", "gather", "ulysses"),
    ),
    BuildOption(
        "vae_vmem_mib", "--vae-vmem",
        "MiB of scoped VMEM the VAE decode is compiled for (TPU): auto or default (the "
        "compiler's own: the decode runs fastest), or N ({fast_vae_vmem_mib}: compiles several "
        "times faster, the decode 1.25x slower on v5e).",
        token=lambda k: f"_vmem{k.vae_vmem_mib}" if k.vae_vmem_mib else "",
        argv=lambda k: (
            ["--vae-vmem", str(k.vae_vmem_mib or "default")] if k.target.startswith("tpu") else []
        ),
    ),
    BuildOption(
        "pipeline", "--pipeline",
        "The programs the build holds (wan.interface.PIPELINES): t2v, text to video; i2v, "
        "image to video through the image's VAE latents (Wan 2.2 I2V-A14B); i2v-clip, and its "
        "CLIP features (Wan 2.1 I2V). auto: the model's own.",
        token=lambda k: "" if k.option("pipeline") == DEFAULT_PIPELINE else f"_{k.option('pipeline')}",
        argv=lambda k: ["--pipeline", k.option("pipeline")],
        default=DEFAULT_PIPELINE,
        flag_default="auto",
        choices=("auto", *PIPELINES),
        check=json_checks.key_of(PIPELINES),
        programs=lambda _, pipeline: PIPELINES[pipeline],
    ),
    switch(
        "step_cache", "--step-cache",
        "Also build step caching's programs (wan.interface.STEP_CACHE_PROGRAMS), which "
        "`runtime run --cache magcache|fbcache` runs: a step that keeps the transformer "
        "blocks' residual on the devices, and one that reuses it instead of running the blocks.",
        programs=with_step_cache,
    ),
    switch(
        "continuous", "--continuous",
        "Step-level continuous batching for `runtime serve` (wan.interface.CONTINUOUS_PROGRAMS): "
        "the batch's B slots each hold a video at its own step, with its own step count, "
        "guidance, sampler, shift and seed; a request joins at the next step and a finished "
        "video is decoded alone while the others go on. Not with --step-cache.",
        programs=lambda names: replaced(names, CONTINUOUS_PROGRAMS),
    ),
    choice(
        "quant", "--quant",
        "The transformer blocks' Linear layers in 8 bits (wan.quant): w8a8-int8 / w8a8-fp8 "
        "(8-bit weights and per-token 8-bit activations, the matmul on the 8-bit path), w8-int8 "
        "/ w8-fp8 (8-bit weights dequantized in the matmul: memory only), or none.",
        QUANT_MODES,
    ),
    choice(
        "attention_quant", "--attention-quant",
        "The video self-attention in 8 bits (wan.models.attention_quant, SageAttention's "
        "scheme: K smoothed, Q and K quantized per block): int8 (Q K^T on the int8 unit, P V in "
        "bf16: v4, v5e, v5p, v6e) or fp8 (both on fp8: tpu7x), in flash or splash on TPU and blockwise "
        "(the reference) on CPU; or none.",
        ATTENTION_QUANT_MODES,
        token_prefix="_attn",
    ),
    BuildOption(
        "sparse_attention", "--sparse-attention", sparse_attention.FLAG_HELP,
        token=_sparse_token,
        argv=lambda k: ["--sparse-attention", k.option("sparse_attention")],
        default=sparse_attention.NONE,
        check=_sparse_check,
        parse=sparse_attention.canonical,
        programs=lambda names, value: (
            names if value == sparse_attention.NONE else replaced(names, SPARSE_PROGRAMS)
        ),
    ),
)  # fmt: skip
# The registry: a new option is one entry (tests add theirs with monkeypatch.setitem).
OPTIONS: dict[str, BuildOption] = {option.name: option for option in _DECLARED}


def plain_options() -> list[BuildOption]:
    """The options kept in BuildKey.options, in declaration order."""
    return [option for option in OPTIONS.values() if option.check is not None]


def held_programs(values: Mapping[str, Any]) -> tuple[str, ...]:
    """The programs a build holds, in the order a generation runs them, given the plain
    options' values by name: each option that decides them, in declaration order."""
    names: tuple[str, ...] = ()
    for option in plain_options():
        if option.programs is not None:
            names = option.programs(names, values[option.name])
    return names
