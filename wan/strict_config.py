"""Config dicts read strictly (`StrictConfig.from_dict`, the base of every config of
`wan.configs`): each field checked against its type and range, and every other key either one
whose value the config implements (`fixed_values`) or in `NO_OP_KEYS`; anything else is a
one-line `ConfigKeyError` naming the key. `wan.configs` adds the file and the component to the
message.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Self

from wan.errors import InputError


class WeightError(InputError):
    """A weights folder does not fit the model: names the file and the key or parameter.
    (Defined here, with no heavy import, so that reading a config stays light.)"""


class ConfigKeyError(WeightError):
    """A config key the project does not understand, or a value of it the project does not
    implement: restoring the file would not help, so the message is whole as it is."""


# The one list of config keys known not to change what is computed: read nowhere, so any value
# passes. Every other key is either understood (a field, or a key with the values the project
# implements, `ComponentConfig.fixed_values`) or refused: compiling a model whose config says
# something the project cannot honour would silently compile another model. Read from the
# configs of diffusers' Wan pipelines (Wan2.1-T2V-1.3B/14B, Wan2.2-T2V-A14B, the tests' tiny one).
NO_OP_KEYS = frozenset(
    {
        # diffusers' and transformers' bookkeeping
        "_class_name", "_diffusers_version", "_name_or_path", "_use_default_values",
        "_commit_hash", "transformers_version", "architectures", "torch_dtype", "dtype",
        "tokenizer_class", "id2label", "label2id", "problem_type", "return_dict",
        "output_attentions", "output_hidden_states", "chunk_size_feed_forward",
        # a UMT5 encoder's config: the decoder, generation and the LM head, not the encoder
        "is_encoder_decoder", "is_decoder", "use_cache", "output_past", "num_decoder_layers",
        "decoder_start_token_id", "eos_token_id", "pad_token_id", "bos_token_id",
        "tie_word_embeddings", "scale_decoder_outputs",
        "scalable_attention",  # a leftover of the T5X export that transformers never reads
        # training only
        "dropout", "dropout_rate", "classifier_dropout", "initializer_factor",
        "gradient_checkpointing", "attention_dropout", "initializer_range",
        # a scheduler's options that only act with the flow sigmas off, thresholding on or
        # dynamic shifting on (each refused: see SchedulerConfig.DIFFUSERS)
        "beta_start", "beta_end", "beta_schedule", "trained_betas", "rescale_betas_zero_snr",
        "timestep_spacing", "steps_offset", "sigma_min", "sigma_max", "time_shift_type",
        "dynamic_thresholding_ratio", "sample_max_value", "base_shift", "max_shift",
        "base_image_seq_len", "max_image_seq_len",
    }
)  # fmt: skip


# Integer fields' (lowest, highest) values: the highest are far above every released model
# (the 14B: 5120 wide, 40 layers, a 256384-token vocabulary) and keep a lying config from
# describing a model no memory can hold.
_WIDTH = (1, 1 << 16)
_INT_RANGES = {
    "patch_size": (1, 64),
    "num_attention_heads": (1, 1024),
    "attention_head_dim": (1, 4096),
    "num_layers": (1, 1024),
    "vocab_size": (1, 1 << 22),
    "rope_max_seq_len": (1, 1 << 16),
    "max_length": (1, 1 << 16),
    "dim_mult": (1, 64),
    "num_res_blocks": (1, 64),
    "in_channels": (1, 1024),
    "out_channels": (1, 1024),
    "z_dim": (1, 1024),
    "relative_attention_num_buckets": (1, 1 << 16),
    "relative_attention_max_distance": (1, 1 << 20),
    "num_train_timesteps": (1, 1 << 20),
    "solver_order": (1, 3),
}
# Float fields that must be positive (all must be finite).
_POSITIVE = {"eps", "layer_norm_epsilon", "latents_std", "flow_shift"}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _problem(name: str, kind: str, value: Any) -> str | None:
    """Why `value` does not fit field `name` of annotation `kind` (None when it fits)."""
    if kind.endswith(" | None"):
        return None if value is None else _problem(name, kind.removesuffix(" | None"), value)
    if kind.startswith("tuple["):
        item, _, rest = kind[len("tuple[") : -1].partition(", ")
        length = None if rest == "..." else kind.count(",") + 1
        fits = isinstance(value, list | tuple) and length in (None, len(value))
        if fits and not any(_problem(name, item, v) for v in value):
            return None
        return f"a list of {f'{length} ' if length else ''}items, each {_problem(name, item, None)}"
    if kind == "int":
        low, high = _INT_RANGES.get(name, _WIDTH)
        return None if is_int(value) and low <= value <= high else f"an integer in [{low}, {high}]"
    if kind == "float":
        if not is_number(value):
            return "a finite number"
        return "a positive number" if name in _POSITIVE and value <= 0 else None
    if kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    if kind == "str":
        return None if isinstance(value, str) else "a string"
    raise AssertionError(f"no check for {kind}")  # a field added without one


def _from_dict(cls, raw: Any):
    """Build `cls` from a config dict, strictly: each field checked against its type and range
    (lists become tuples), the config validated, and every other key either one with a value the
    config implements (`fixed_values`) or in NO_OP_KEYS; anything else is a ConfigKeyError."""
    if not isinstance(raw, dict):
        raise WeightError(f"the config is {excerpt(raw)}, expected a JSON object")
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    for name, value in raw.items():
        if name in fields and (problem := _problem(name, fields[name], value)):
            raise WeightError(f"{name} is {excerpt(value)}, expected {problem}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in fields}
    config = cls(**kwargs)
    config.validate()
    fixed = config.fixed_values()
    for name, value in raw.items():
        if name in fields or name in NO_OP_KEYS:
            continue
        if name not in fixed:
            raise ConfigKeyError(unknown_key(name))
        check_value(name, value, fixed[name])
    return config


def unknown_key(name: str) -> str:
    return (
        f"{name} is a key this project does not understand: it may change the model, so nothing "
        "is built (a model of another kind, or a key to declare in wan.strict_config.NO_OP_KEYS)"
    )


def check_value(name: str, value: Any, accepted: tuple[Any, ...]) -> None:
    """A ConfigKeyError unless `value` is one of `accepted` (of the same JSON type)."""
    if not any(type(value) is type(a) and value == a for a in accepted):
        raise ConfigKeyError(
            f"{name} is {excerpt(value)}, this project implements only "
            f"{' or '.join(excerpt(a) for a in accepted)}: the model is of a kind it does not have"
        )


class StrictConfig:
    """A config read strictly (`_from_dict`), with the keys it implements one value (or a few)
    of."""

    @classmethod
    def from_dict(cls, raw: Any) -> Self:
        return _from_dict(cls, raw)

    def validate(self) -> None:
        """Raise a WeightError when the fields do not make a model (they are each valid)."""

    def fixed_values(self) -> dict[str, tuple[Any, ...]]:
        """Keys of a diffusers config that are no fields here, and the values this kind
        implements: another value is another model."""
        return {}


def excerpt(value: Any) -> str:
    """`value` of a config or header as JSON, cut short: a message stays one line."""
    try:
        text = json.dumps(value, default=repr)
    except RecursionError:  # nested as deep as the parser allowed
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 60 else f"{text[:57]}..."


def require(condition: bool, message: str) -> None:
    if not condition:
        raise WeightError(message)
