"""Model configurations: one frozen dataclass per model, mirroring diffusers' config.json.

Flax-free on purpose: the runtime reads configs and presets without importing model code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Self

from wan import bounded_read, kinds
from wan.component_configs import (
    ComponentConfig,
    ImageEncoderConfig,
    TextEncoderConfig,
    TransformerConfig,
    VAEKindConfig,
)
from wan.strict_config import (
    NO_OP_KEYS,
    ConfigKeyError,
    StrictConfig,
    WeightError,
    check_value,
    excerpt,
    is_number,
    require,
    unknown_key,
)

# Fields of a component's config left out of the model's dict (and so of its hash) while None:
# added after models were hashed without them.
UNSET_OMITTED = frozenset({"image_dim", "added_kv_proj_dim", "pos_embed_seq_len"})
CHECKPOINT_MARKER = "wan_checkpoint.json"  # a project checkpoint's metadata (wan.checkpoint)
DTYPES = ("float32", "bfloat16", "float16")  # what a model's weights and activations may use
MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KiB; a bigger one is not a config


# The samplers (wan.schedulers): 'unipc' is diffusers' UniPCMultistepScheduler, 'euler' its
# FlowMatchEulerDiscreteScheduler. Here, jax-free, for the runtime's options and requests.
SAMPLERS = ("unipc", "euler")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig(StrictConfig):
    """Sampler settings. `kind` is one of SAMPLERS."""

    kind: str = SAMPLERS[0]
    num_train_timesteps: int = 1000
    flow_shift: float = 5.0
    solver_order: int = 2

    # diffusers scheduler class -> (our kind, the key of its shift, the keys it has that this
    # project implements one value of: the flow-matching sampler WanPipeline configures).
    DIFFUSERS: ClassVar[dict[str, tuple[str, str, dict[str, tuple[Any, ...]]]]] = {
        "UniPCMultistepScheduler": (
            "unipc",
            "flow_shift",
            {
                "use_flow_sigmas": (True,), "prediction_type": ("flow_prediction",),
                "predict_x0": (True,), "solver_type": ("bh2",), "lower_order_final": (True,),
                "final_sigmas_type": ("zero",), "disable_corrector": ([],), "solver_p": (None,),
                "thresholding": (False,), "use_dynamic_shifting": (False,),
                "shift_terminal": (None,), "use_karras_sigmas": (False,),
                "use_exponential_sigmas": (False,), "use_beta_sigmas": (False,),
            },
        ),
        "FlowMatchEulerDiscreteScheduler": (
            "euler",
            "shift",
            {
                "use_dynamic_shifting": (False,), "invert_sigmas": (False,),
                "shift_terminal": (None,), "stochastic_sampling": (False,),
                "use_karras_sigmas": (False,), "use_exponential_sigmas": (False,),
                "use_beta_sigmas": (False,),
            },
        ),
    }  # fmt: skip

    def validate(self) -> None:
        require(
            self.kind in SAMPLERS,
            f"kind is {excerpt(self.kind)}, expected one of {', '.join(SAMPLERS)}",
        )

    @classmethod
    def from_diffusers(cls, raw: Any) -> Self:
        """A diffusers scheduler_config.json (none: {}), strictly: its class names the sampler,
        every key is understood, implemented as configured, or in NO_OP_KEYS."""
        if not isinstance(raw, dict):
            raise WeightError(f"the config is {excerpt(raw)}, expected a JSON object")
        class_name = raw.get("_class_name", "UniPCMultistepScheduler")
        require(
            class_name in cls.DIFFUSERS,
            f"_class_name is {excerpt(class_name)}, expected one of {', '.join(cls.DIFFUSERS)}",
        )
        kind, shift_key, fixed = cls.DIFFUSERS[class_name]
        shift = raw.get(shift_key, 5.0)
        require(
            is_number(shift) or shift is None,
            f"{shift_key} is {excerpt(shift)}, expected a positive number",
        )
        understood = {"_class_name", shift_key, "num_train_timesteps", "solver_order"}
        for name, value in raw.items():
            if name in understood or name in NO_OP_KEYS:
                continue
            if name not in fixed:
                raise ConfigKeyError(unknown_key(name))
            check_value(name, value, fixed[name])
        return cls.from_dict(
            {
                "kind": kind,
                "num_train_timesteps": raw.get("num_train_timesteps", 1000),
                "flow_shift": float(shift if shift is not None else 1.0),
                "solver_order": raw.get("solver_order", 2),
            }
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A whole text-to-video model. `boundary_ratio` set means two experts (Wan 2.2 A14B):
    the first transformer serves timesteps >= boundary_ratio * num_train_timesteps."""

    name: str
    transformer: TransformerConfig
    vae: VAEKindConfig
    text_encoder: TextEncoderConfig
    scheduler: SchedulerConfig
    boundary_ratio: float | None = None
    dtype: str = "bfloat16"  # weights and activations of the transformer and text encoder
    image_encoder: ImageEncoderConfig | None = None  # Wan 2.1 image to video's CLIP

    def validate(self) -> Self:
        """This config, when its parts fit together: the transformer denoises the VAE's latents
        (two mismatched parts, as a config read from outside may hold, would fail deep in a
        compile), and takes image features exactly when the model has an image encoder."""
        geometry = self.vae.geometry
        channels = geometry.channels
        # Image to video's input: the latents, the mask (one channel per frame a latent frame
        # stands for) and the image's latents.
        image_channels = 2 * channels + geometry.temporal
        tc = self.transformer
        require(
            tc.out_channels == channels and tc.in_channels in (channels, image_channels),
            f"transformer: in_channels {tc.in_channels} and out_channels {tc.out_channels}, but "
            f"the {self.vae.kind} VAE's latents have {channels} channels (in_channels "
            f"{image_channels} for image to video): a transformer and a VAE of two different "
            "models",
        )
        encoder = self.image_encoder
        require(
            (tc.image_dim is None) == (encoder is None),
            "the transformer takes image features but the model has no image_encoder"
            if encoder is None
            else "the model has an image_encoder but the transformer takes no image features",
        )
        require(
            encoder is None or tc.image_dim == encoder.hidden_size,
            f"transformer: image_dim is {tc.image_dim}, the image encoder's features are "
            f"{encoder and encoder.hidden_size} wide",
        )
        require(
            tc.pos_embed_seq_len is None
            or (encoder is not None and tc.pos_embed_seq_len == 2 * encoder.tokens),
            f"transformer: pos_embed_seq_len is {tc.pos_embed_seq_len}, expected two images' "
            f"features ({2 * encoder.tokens if encoder else 'image_dim and an image encoder'}): "
            "the first-last-frame model's table",
        )
        require(
            encoder is None or tc.in_channels == image_channels,
            f"transformer: image features with in_channels {tc.in_channels}: image to video "
            f"takes {image_channels}",
        )
        return self

    @property
    def pipelines(self) -> tuple[str, ...]:
        """The pipeline variants the model runs (`wan.interface.PIPELINES`), its default first:
        t2v; i2v, the image conditioning the step through its VAE latents; i2v-clip, and its
        CLIP features. TI2V-5B (the model of the Wan 2.2 VAE) runs both t2v and i2v."""
        if self.image_condition == "channels":
            return ("i2v" if self.image_encoder is None else "i2v-clip",)
        return ("t2v", "i2v") if self.image_condition == "first_frame" else ("t2v",)

    @property
    def clip_images(self) -> int:
        """Images per video through the image encoder: 2 for Wan 2.1 FLF2V (the first and the
        last frame's features, behind one position table), else 1."""
        return 1 if self.transformer.pos_embed_seq_len is None else 2

    @property
    def image_tokens(self) -> int:
        """Image-feature tokens per video the transformer's cross-attention takes."""
        assert self.image_encoder is not None, "a model without an image encoder"
        return self.clip_images * self.image_encoder.tokens

    @property
    def takes_last_image(self) -> bool:
        """Whether a last frame can be given beside the first (first-last-frame): Wan 2.2
        I2V-A14B's, as diffusers runs it, and Wan 2.1 FLF2V's, which needs it
        (`needs_last_image`). Wan 2.1 I2V's CLIP features are the first image's alone, and
        TI2V-5B's image mode takes the first only."""
        return self.image_condition == "channels" and (
            self.image_encoder is None or self.needs_last_image
        )

    @property
    def needs_last_image(self) -> bool:
        """Whether every video needs its last frame: Wan 2.1 FLF2V's image embedder takes both
        images' features."""
        return self.clip_images == 2

    @property
    def image_condition(self) -> str | None:
        """How an image conditions the model: `channels`, its latents and a mask beside the
        noise's as the transformer's input (Wan 2.1 I2V, Wan 2.2 I2V-A14B); `first_frame`, its
        latents as the first latent frame, whose tokens are at timestep 0 (TI2V-5B, diffusers'
        expand_timesteps; its VAE is the Wan 2.2 one); None: no image."""
        if self.transformer.in_channels != self.vae.geometry.channels:
            return "channels"
        return "first_frame" if self.vae.kind == "wan2.2" else None

    @property
    def num_experts(self) -> int:
        return 1 if self.boundary_ratio is None else 2

    @property
    def fps(self) -> int:
        """Frames per second of the model's videos (its VAE kind's, `VAEKindConfig.fps`)."""
        return self.vae.fps

    def to_dict(self) -> dict[str, Any]:
        """The fields, and each component's kind unless it is the component's first: a config
        written before kinds existed reads the same, and hashes the same."""
        raw = dataclasses.asdict(self)
        for component in kinds.COMPONENTS:
            if raw[component] is None:  # a component the model lacks (OPTIONAL_COMPONENTS)
                del raw[component]
                continue
            raw[component] = {
                k: v for k, v in raw[component].items() if not (k in UNSET_OMITTED and v is None)
            }
            kind = getattr(self, component).kind
            if kind != kinds.default(component):
                raw[component] = {"kind": kind, **raw[component]}
        return raw

    def hash(self) -> str:
        """Identifies the architecture and numerics (not the name): builds and weights match on it."""
        blob = json.dumps({**self.to_dict(), "name": None}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Self:
        """Inverse of `to_dict`, strictly: a value of the wrong type or range, or a key it does
        not understand, is a WeightError naming its key."""
        if not isinstance(raw, dict):
            raise WeightError(f"the model is {excerpt(raw)}, expected a JSON object")
        required = [c for c in kinds.COMPONENTS if c not in kinds.OPTIONAL_COMPONENTS]
        for key in ("name", *required, "scheduler"):
            require(key in raw, f"{key} is missing")
        fields = {f.name for f in dataclasses.fields(cls)}
        for key in raw:
            if key not in fields and key not in NO_OP_KEYS:
                raise ConfigKeyError(unknown_key(key))
        require(isinstance(raw["name"], str), f"name is {excerpt(raw['name'])}, expected a string")
        parts = {}
        for key in kinds.COMPONENTS:
            if key in raw:
                with _key_prefix(key):
                    parts[key] = _component(key, raw[key])
        with _key_prefix("scheduler"):
            scheduler = SchedulerConfig.from_dict(raw["scheduler"])
        return cls(
            name=raw["name"],
            **parts,
            scheduler=scheduler,
            boundary_ratio=_boundary_ratio(raw.get("boundary_ratio")),
            dtype=_dtype(raw.get("dtype", "bfloat16")),
        ).validate()

    @classmethod
    def from_folder(cls, folder: str | Path) -> Self:
        """The config of a project checkpoint or of a diffusers-format folder (JSON only)."""
        marker = Path(folder) / CHECKPOINT_MARKER
        if marker.is_file():
            meta = read_json(marker)
            with _in_file(marker):
                require(isinstance(meta, dict) and "model" in meta, "has no model")
                return cls.from_dict(meta["model"])
        return cls.from_diffusers(folder)

    @classmethod
    def from_diffusers(cls, folder: str | Path, dtype: str | None = None) -> Self:
        """Read the config.json files of a diffusers-format model folder. `dtype` defaults to
        the dtype the transformer's weights are stored in."""
        from wan.weights import stored_dtype

        root = Path(folder)
        index = root / "model_index.json"
        with _in_file(index):
            boundary_ratio = _pipeline_index(read_json(index) if index.is_file() else {})
        sched_path = root / "scheduler" / "scheduler_config.json"
        with _in_file(sched_path), _key_prefix("scheduler"):
            scheduler = SchedulerConfig.from_diffusers(
                read_json(sched_path) if sched_path.is_file() else {}
            )
        parts = {
            component: diffusers_component(root, component)
            for component in kinds.COMPONENTS
            if component not in kinds.OPTIONAL_COMPONENTS or (root / component).is_dir()
        }
        if boundary_ratio is not None:  # two experts of one architecture
            second = root / "transformer_2" / "config.json"
            with _in_file(second):
                require(
                    diffusers_component(root, "transformer_2") == parts["transformer"],
                    "transformer_2 differs from transformer: experts of two architectures",
                )
        return cls(
            name=root.name,
            **parts,
            scheduler=scheduler,
            boundary_ratio=boundary_ratio,
            dtype=dtype or stored_dtype(root / "transformer"),
        ).validate()


def diffusers_component(root: str | Path, folder: str) -> ComponentConfig:
    """The config of weight folder `folder` ("transformer_2": the second expert) of a
    diffusers-format model folder, read strictly."""
    path = Path(root) / kinds.ENCODE_HALVES.get(folder, folder) / "config.json"
    if not path.is_file():
        raise WeightError(f"{path} is missing: not a diffusers-format WAN folder")
    with _in_file(path), _key_prefix(folder):
        return _component(kinds.FOLDERS[folder], read_json(path))


def _component(component: str, raw: Any) -> ComponentConfig:
    """A component's config, of the kind it names (none: the component's first kind)."""
    if not isinstance(raw, dict):
        raise WeightError(f"the config is {excerpt(raw)}, expected a JSON object")
    raw = dict(raw)
    try:
        kind = (
            kinds.lookup(component, raw.pop("kind"))
            if "kind" in raw
            else kinds.of_raw(component, raw)
        )
    except kinds.KindError as e:
        raise ConfigKeyError(str(e)) from None
    return kind.config_class.from_dict(raw)


# model_index.json: the class this project reads each component folder as (transformer_2:
# none in a one-expert model). The tokenizer is read from its files, whatever its class.
PIPELINE_CLASSES: dict[str, tuple[str | None, ...]] = {
    "transformer": ("WanTransformer3DModel",),
    "transformer_2": ("WanTransformer3DModel", None),
    "vae": ("AutoencoderKLWan",),
    "text_encoder": ("UMT5EncoderModel",),
    "image_encoder": ("CLIPVisionModel", "CLIPVisionModelWithProjection", None),
    "image_processor": ("CLIPImageProcessor", "CLIPImageProcessorPil", None),
    "scheduler": tuple(SchedulerConfig.DIFFUSERS),
}


def _pipeline_index(raw: Any) -> float | None:
    """The boundary ratio of a diffusers model_index.json, read strictly: the component classes
    this project reads, no other key that is not in NO_OP_KEYS.

    `expand_timesteps` (Wan 2.2 TI2V-5B) gives every latent token its own timestep, the step's
    times a mask that is zero only on the frames of a conditioning image. Text-to-video has no
    image: the mask is all ones, every token gets the step's timestep, and the per-token
    modulation equals the per-video one the transformer computes (tests/test_ti2v_5b.py checks
    the step against diffusers' expand_timesteps path), so either value builds the same model."""
    require(isinstance(raw, dict), f"is {excerpt(raw)}, expected a JSON object")
    for name, value in raw.items():
        if name in ("boundary_ratio", "tokenizer") or name in NO_OP_KEYS:
            continue
        if name == "expand_timesteps":
            check_value(name, value, (False, True))
        elif name in PIPELINE_CLASSES:
            library_class = value if isinstance(value, list) and len(value) == 2 else [None, "?"]
            if library_class[1] not in PIPELINE_CLASSES[name]:
                raise ConfigKeyError(
                    f"{name} is {excerpt(value)}, this project reads a "
                    f"{' or '.join(str(c) for c in PIPELINE_CLASSES[name])} only"
                )
        else:
            raise ConfigKeyError(unknown_key(name))
    return _boundary_ratio(raw.get("boundary_ratio"))


def read_json(path: Path) -> Any:
    """A config file's JSON (bounded in size); anything else is a WeightError naming it. A NaN
    passes, for the strict config to name the key that holds it; symlinks too (the Hugging Face
    cache's files are)."""
    return bounded_read.read_json(
        path,
        MAX_CONFIG_BYTES,
        lambda reason: WeightError(f"{path} {reason}: restore the model's original file"),
        allow_nan=True,
    )


@contextlib.contextmanager
def _in_file(path: Path) -> Iterator[None]:
    """A WeightError raised inside names `path` and says what to do."""
    try:
        yield
    except WeightError as e:
        if str(e).startswith(str(path)):
            raise
        if isinstance(e, ConfigKeyError):  # says what it is; restoring the file would not help
            raise ConfigKeyError(f"{path}: {e}") from None
        raise WeightError(f"{path}: {e}: restore the model's original file") from None


@contextlib.contextmanager
def _key_prefix(key: str) -> Iterator[None]:
    """A WeightError raised inside says it is about the part `key`."""
    try:
        yield
    except WeightError as e:
        raise type(e)(f"{key}: {e}") from None


def _boundary_ratio(value: Any) -> float | None:
    require(
        value is None or (is_number(value) and 0 < value < 1),
        f"boundary_ratio is {excerpt(value)}, expected a number between 0 and 1 (or none)",
    )
    return value


def _dtype(value: Any) -> str:
    require(value in DTYPES, f"dtype is {excerpt(value)}, expected one of {', '.join(DTYPES)}")
    return value


@dataclasses.dataclass(frozen=True)
class VideoShape:
    """What one call of the pipeline makes: batch videos of width x height pixels (frames = 4k + 1),
    with or without classifier-free guidance."""

    width: int
    height: int
    frames: int
    batch: int
    cfg: bool = True

    @property
    def step_batch(self) -> int:
        return 2 * self.batch if self.cfg else self.batch

    def tokens(self, config: ModelConfig) -> int:
        """Video tokens the transformer attends over: the latent grid over its patch."""
        return math.prod(config.transformer.patch_grid(self.latent_shape(config)[1:4]))

    def latent_shape(self, config: ModelConfig) -> tuple[int, int, int, int, int]:
        """Channels-last latents (B, T, H/s, W/s, C) of the VAE kind's geometry."""
        geometry = config.vae.geometry
        frames = (self.frames - 1) // geometry.temporal + 1
        s = geometry.spatial
        return (self.batch, frames, self.height // s, self.width // s, geometry.channels)
