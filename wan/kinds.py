"""Component kinds: the one registry of what a model's components can be.

A model has three weight components (the transformer, the VAE and the text encoder); each is
of one kind, named by its config's `kind`. `REGISTRY` maps (component, kind) to a
`ComponentKind`: its config class, its module (what `wan.programs.make_module` builds), its
weight import rule (diffusers tensor name -> parameter) and its geometry (the VAE's latent
channels and compression, the transformer's patch). Configs, the build, the runtime and the
weight import ask this registry; adding a kind is one `register` call.

The config, module and rule of today's kinds are named by import path ("module:attribute") and
imported on first use: this module sits below all of them (configs ask it for a kind's config
class), and the runtime reads weights without importing the modules (flax).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

from wan.errors import InputError

COMPONENTS = ("transformer", "vae", "text_encoder", "image_encoder")
# Components a model may lack (Wan 2.1 image-to-video has a CLIP image encoder; the others none).
OPTIONAL_COMPONENTS = ("image_encoder",)
# Weight folders, named as in a diffusers WanPipeline folder, and the component each holds
# (the second expert of a two-expert model is a transformer; `vae_encoder` is the encode half
# of the VAE, its own folder in a checkpoint of this project).
FOLDERS = {
    "transformer": "transformer",
    "transformer_2": "transformer",
    "vae": "vae",
    "vae_encoder": "vae",
    "text_encoder": "text_encoder",
    "image_encoder": "image_encoder",
}
# The encode halves: weight folder -> the diffusers folder whose tensors it takes.
ENCODE_HALVES = {"vae_encoder": "vae"}


class KindError(InputError):
    """A kind the registry does not have (a config naming it, or a second registration)."""


@dataclasses.dataclass(frozen=True)
class LatentGeometry:
    """How a VAE kind maps pixels to latents: `channels` per latent pixel, each latent frame
    after the first stands for `temporal` frames, each latent pixel for `spatial` x `spatial`
    pixels."""

    channels: int
    temporal: int
    spatial: int


Ref = str | Any  # an object, or its import path "package.module:attribute"


@functools.cache
def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def resolve(ref: Ref) -> Any:
    """The object `ref` names (imported on first use when it is a path)."""
    return _import(ref) if isinstance(ref, str) else ref


@dataclasses.dataclass(frozen=True)
class ComponentKind:
    """One kind of one component.

    `module` is called as module(config_part, dtype=, param_dtype=, rngs=, **options) with the
    build options it names in `module_options` ("attention", "context_parallel"); its weights
    are `param_dtype` (None: the model's dtype). `latent` (VAE kinds) and `patch` (transformer
    kinds) give the geometry of a config of this kind.
    """

    component: str
    name: str
    config: Ref  # the config class; its ClassVar `kind` is `name`
    module: Ref
    rule: Ref  # wan.weights.Rule: diffusers tensor name -> Target
    param_dtype: str | None = None
    module_options: tuple[str, ...] = ()
    latent: Callable[[Any], LatentGeometry] | None = None
    patch: Callable[[Any], tuple[int, int, int]] | None = None
    # A diffusers config of this kind, told by its keys (a diffusers config names no `kind`);
    # None: only the component's default kind reads a config that no kind claims.
    claims: Callable[[dict[str, Any]], bool] | None = None
    # VAE kinds: the encode half's module and weight rule (image to video's condition latents).
    encoder: Ref | None = None
    encoder_rule: Ref | None = None

    @property
    def config_class(self) -> type:
        return resolve(self.config)

    @property
    def module_factory(self) -> Callable[..., Any]:
        return resolve(self.module)

    @property
    def weight_rule(self) -> Callable[[str], Any]:
        return resolve(self.rule)

    def half(self, folder: str) -> tuple[Callable[..., Any], Callable[[str], Any]]:
        """(module factory, weight rule) of weight folder `folder` of a component of this kind:
        an encode half's (`ENCODE_HALVES`) or the component's own."""
        if folder not in ENCODE_HALVES:
            return self.module_factory, self.weight_rule
        if self.encoder is None:
            raise KindError(f"the {self.component} kind {self.name!r} has no encoder")
        return resolve(self.encoder), resolve(self.encoder_rule)


REGISTRY: dict[tuple[str, str], ComponentKind] = {}


def register(kind: ComponentKind) -> ComponentKind:
    """Add `kind`; its component's first kind is the default (a config that names none)."""
    if kind.component not in COMPONENTS:
        raise KindError(f"component {kind.component!r} is not one of {', '.join(COMPONENTS)}")
    if (kind.component, kind.name) in REGISTRY:
        raise KindError(f"{kind.component} kind {kind.name!r} is already registered")
    if (kind.latent is None) == (kind.component == "vae"):
        raise KindError(f"{kind.component} kind {kind.name!r}: latent geometry is for VAE kinds")
    if (kind.patch is None) == (kind.component == "transformer"):
        raise KindError(f"{kind.component} kind {kind.name!r}: a patch is for transformer kinds")
    REGISTRY[kind.component, kind.name] = kind
    return kind


def names(component: str) -> tuple[str, ...]:
    return tuple(name for c, name in REGISTRY if c == component)


def default(component: str) -> str:
    """The kind of a config that names none: every config written before kinds existed."""
    return names(component)[0]


def lookup(component: str, name: Any) -> ComponentKind:
    """The kind `name` of `component`; another is a one-line KindError naming the known ones."""
    kind = REGISTRY.get((component, name)) if isinstance(name, str) else None
    if kind is None:
        known = ", ".join(names(component)) or "none"
        raise KindError(f"{component} kind {name!r} is not one this project has (it has: {known})")
    return kind


def of_raw(component: str, raw: dict[str, Any]) -> ComponentKind:
    """The kind of a config dict that names none (a diffusers config.json): the kind that
    claims it (`ComponentKind.claims`), else the component's default kind."""
    claimed = [
        kind
        for (c, _), kind in REGISTRY.items()
        if c == component and kind.claims is not None and kind.claims(raw)
    ]
    return claimed[0] if claimed else lookup(component, default(component))


def part(config: Any, folder: str) -> Any:
    """The config of weight folder `folder` of model `config` (transformer_2: the transformer's)."""
    if folder not in FOLDERS:
        raise KindError(f"unknown component {folder!r}; expected one of {', '.join(FOLDERS)}")
    return getattr(config, FOLDERS[folder])


def of(part: Any) -> ComponentKind:
    """The kind of a component's config (`wan.component_configs.ComponentConfig`)."""
    return lookup(part.component, part.kind)


def _wan21_latent(vae: Any) -> LatentGeometry:
    """Each level after the first halves the height and width; `temperal_downsample` says which
    levels also halve the frames."""
    return LatentGeometry(
        channels=vae.z_dim,
        temporal=2 ** sum(vae.temperal_downsample),
        spatial=2 ** (len(vae.dim_mult) - 1),
    )


register(
    ComponentKind(
        component="transformer",
        name="per_video",  # one timestep per video (Wan 2.1, Wan 2.2 A14B)
        config="wan.component_configs:TransformerConfig",
        module="wan.models.transformer:WanTransformer",
        rule="wan.weights.transformer:rule",
        module_options=("attention", "context_parallel", "quant", "attention_quant"),
        patch=lambda config: tuple(config.patch_size),
    )
)
register(
    ComponentKind(
        component="vae",
        name="wan2.1",  # 16 channels, 4x time, 8x space (also Wan 2.2 A14B's)
        config="wan.component_configs:VAEConfig",
        module="wan.models.vae:WanVAE",
        rule="wan.weights.vae:rule",
        param_dtype="float32",  # the decoder's weights stay float32 (its activations do not)
        latent=_wan21_latent,
        encoder="wan.models.vae_encoder:WanVAEEncoder",
        encoder_rule="wan.weights.vae:encoder_rule",
    )
)


def _wan22_latent(vae: Any) -> LatentGeometry:
    """Wan 2.1's levels, and each latent pixel a patch_size x patch_size patch of pixels."""
    levels = _wan21_latent(vae)
    return dataclasses.replace(levels, spatial=levels.spatial * (vae.patch_size or 1))


register(
    ComponentKind(
        component="vae",
        name="wan2.2",  # TI2V-5B's: 48 channels, 4x time, 16x space (2x of it a pixel patch)
        config="wan.component_configs:VAE22Config",
        module="wan.models.vae22:WanVAE22",
        rule="wan.weights.vae:rule",  # the same module names: the same tensor mapping
        param_dtype="float32",
        latent=_wan22_latent,
        claims=lambda raw: raw.get("is_residual") is True,
        encoder="wan.models.vae22_encoder:WanVAE22Encoder",
        encoder_rule="wan.weights.vae:encoder_rule",
    )
)
register(
    ComponentKind(
        component="text_encoder",
        name="umt5",
        config="wan.component_configs:TextEncoderConfig",
        module="wan.models.text_encoder:UMT5Encoder",
        rule="wan.weights.text_encoder:rule",
    )
)
register(
    ComponentKind(
        component="image_encoder",
        name="clip_vision",  # Wan 2.1 image-to-video's CLIP ViT-H/14
        config="wan.component_configs:ImageEncoderConfig",
        module="wan.models.image_encoder:CLIPVisionEncoder",
        rule="wan.weights.image_encoder:rule",
    )
)
