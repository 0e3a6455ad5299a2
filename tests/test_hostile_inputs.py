"""Outside data that is not an artifact, crafted to lie: weights configs, safetensors headers,
LoRA files, tokenizer folders, the coordinator's peers, and a killed `aot build --jobs`. Every
case ends in the source's one-line error (an InputError), never another exception; parsers are
fuzzed with hypothesis on random mutations of real files."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import BIN, TINY_SHAPE, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from runtime.builds.processes import JobError, _rendezvous
from wan import checkpoint, lora, programs, weights
from wan.configs import CHECKPOINT_MARKER, MAX_CONFIG_BYTES, ModelConfig, WeightError
from wan.presets import PRESETS
from wan.random_weights import write_random_checkpoint
from wan.tokenizer import TokenizerError, build_word_tokenizer, load_tokenizer, tokenize

TINY = PRESETS["tiny"]
FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Any JSON value, small: what a lying file puts where a number, list or object belongs.
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def one_line(result: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit 2, a single `Error:` line on stderr naming `needles`, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


# ----------------------------------------------------------------------------------------------
# safetensors files: written here, their header rewritten to lie.


def split_file(path: Path) -> tuple[dict, bytes]:
    """(header, data) of a safetensors file."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join_file(path: Path, header: dict | bytes, data: bytes) -> None:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def write_real_file(path: Path) -> Path:
    tensors = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.ones(4, ml_dtypes.bfloat16),
        "c": np.array(7, np.int32),
    }
    save_file(tensors, path, metadata={"format": "pt"})
    return path


@pytest.fixture
def real_file(tmp_path) -> Path:
    return write_real_file(tmp_path / "real.safetensors")


@st.composite
def mutated(draw, header: dict, data: bytes) -> bytes:
    """The bytes of a safetensors file whose header (or bytes) one to three mutations changed."""
    header = json.loads(json.dumps(header))
    names = sorted(header)
    raw_edits = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["replace", "delete", "offset", "shape", "bytes", "length"]))
        name = draw(st.sampled_from(names))
        entry = header.get(name)
        fields = sorted(entry) if isinstance(entry, dict) else []
        if op == "replace":
            if fields and draw(st.booleans()):
                entry[draw(st.sampled_from(fields))] = draw(JSON_VALUES)
            else:
                header[name] = draw(JSON_VALUES)
        elif op == "delete":
            if fields and draw(st.booleans()):
                del entry[draw(st.sampled_from(fields))]
            else:
                header.pop(name, None)
        elif op in ("offset", "shape") and isinstance(entry, dict):
            key = "data_offsets" if op == "offset" else "shape"
            values = entry.get(key)
            if isinstance(values, list) and values:
                i = draw(st.integers(0, len(values) - 1))
                if isinstance(values[i], int):
                    values[i] += draw(st.integers(-9, 9) | st.just(2**63))
        else:
            raw_edits.append(op)
    blob = json.dumps(header).encode()
    out = bytearray(struct.pack("<Q", len(blob)) + blob + data)
    for op in raw_edits:
        if op == "bytes":
            if not out:  # an earlier edit truncated the file to nothing: no byte to flip
                continue
            for _ in range(draw(st.integers(1, 4))):
                out[draw(st.integers(0, len(out) - 1))] ^= draw(st.integers(1, 255))
        else:
            length = draw(st.integers(0, 2**64 - 1) | st.integers(0, len(out)))
            out[:8] = struct.pack("<Q", length)
            out = out[: draw(st.integers(0, len(out)))] if draw(st.booleans()) else out
    return bytes(out)


def read_all(path: Path) -> None:
    """Parse and read every tensor (only WeightError may escape); what reads back holds the
    shape and dtype its header promised."""
    header, _ = weights.safetensors_header(path)
    for name, array in weights.read_safetensors(path):
        assert list(array.shape) == header[name]["shape"]
        np.asarray(array).sum()  # touches every byte of the memory map


@FUZZ
@given(data=st.data())
def test_fuzzed_safetensors_headers_are_weight_errors(real_file, data):
    header, payload = split_file(write_real_file(real_file))
    real_file.write_bytes(data.draw(mutated(header, payload)))
    try:
        read_all(real_file)
    except WeightError as e:
        assert "\n" not in str(e)


def _lying_headers(header: dict, data: bytes) -> dict[str, tuple[bytes, str]]:
    """Named cases: (file bytes, a phrase the error must hold)."""

    def edited(name: str, key: str, value) -> bytes:
        changed = json.loads(json.dumps(header))
        changed[name][key] = value
        blob = json.dumps(changed).encode()
        return struct.pack("<Q", len(blob)) + blob + data

    def raw(blob: bytes) -> bytes:
        return struct.pack("<Q", len(blob)) + blob + data

    a_end = header["a"]["data_offsets"][1]
    return {
        "float offsets": (edited("a", "data_offsets", [0.0, 24.0]), "tensor a has data_offsets"),
        "string offsets": (edited("a", "data_offsets", ["0", "24"]), "tensor a has data_offsets"),
        "negative offset": (edited("a", "data_offsets", [-8, 16]), "tensor a has data_offsets"),
        "float shape": (edited("a", "shape", [2.0, 3]), "tensor a has shape"),
        "string shape": (edited("a", "shape", "2x3"), "tensor a has shape"),
        "negative shape": (edited("a", "shape", [-2, -3]), "tensor a has shape"),
        "past the end": (edited("a", "data_offsets", [0, 10**6]), "is truncated: tensor a"),
        "overlap": (edited("b", "data_offsets", [a_end - 8, a_end]), "tensors overlap"),
        "unknown dtype": (edited("a", "dtype", "F128"), "unsupported dtype"),
        "size not shape": (edited("a", "shape", [2, 2]), "its shape needs 16"),
        "metadata list": (
            raw(json.dumps({**header, "__metadata__": [1]}).encode()),
            "__metadata__",
        ),
        "metadata numbers": (
            raw(json.dumps({**header, "__metadata__": {"a": 1}}).encode()),
            "__metadata__",
        ),
        "deep nesting": (raw(b"[" * 100_000 + b"]" * 100_000), "not a safetensors file"),
        "not utf-8": (raw(b'{"\xff\xfe": 1}'), "not a safetensors file"),
        "not json": (raw(b"{not json}"), "not a safetensors file"),
        "a list": (raw(b"[1, 2]"), "not a safetensors file"),
        "length past the end": (struct.pack("<Q", 2**40) + b"{}", "cut short in its header"),
    }


CASES = list(_lying_headers({"a": {"data_offsets": [0, 0]}, "b": {}}, b""))


@pytest.mark.parametrize("case", CASES)
def test_lying_safetensors_headers(real_file, case):
    header, payload = split_file(real_file)
    blob, phrase = _lying_headers(header, payload)[case]
    real_file.write_bytes(blob)
    with pytest.raises(WeightError, match=phrase) as error:
        read_all(real_file)
    assert str(real_file) in str(error.value) and "\n" not in str(error.value)


# ----------------------------------------------------------------------------------------------
# Checkpoints: a config that lies, a missing params file, a float tensor labelled I32.


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return write_random_checkpoint(TINY, tmp_path_factory.mktemp("ckpt") / "tiny", seed=3)


def _abstract(component: str) -> dict:
    return programs.split_abstract(programs.abstract_module(TINY, component))[1]


def _marker_with(folder: Path, edit) -> None:
    meta = json.loads((folder / CHECKPOINT_MARKER).read_text())
    edit(meta["model"])
    (folder / CHECKPOINT_MARKER).write_text(json.dumps(meta))


LYING_CONFIGS = [
    ("transformer", "patch_size", 5, "patch_size is 5"),
    ("transformer", "num_layers", "2", 'num_layers is "2"'),
    ("transformer", "ffn_dim", -64, "ffn_dim is -64"),
    ("transformer", "attention_head_dim", 0, "attention_head_dim is 0"),
    ("transformer", "num_layers", 10**12, "num_layers is 1000000000000"),
    ("transformer", "eps", float("nan"), "eps is NaN"),
    ("transformer", "patch_size", [1, 2], "patch_size is [1, 2]"),
    ("vae", "dim_mult", [1, 2], "temperal_downsample has 3 entries"),
    ("vae", "latents_std", [1.0], "latents_std has 1 values"),
    ("text_encoder", "vocab_size", 2**40, "vocab_size is"),
    ("scheduler", "flow_shift", "abc", 'flow_shift is "abc"'),
    ("scheduler", "kind", "ddim", 'kind is "ddim"'),
]


@pytest.mark.parametrize(("part", "key", "value", "phrase"), LYING_CONFIGS)
def test_lying_checkpoint_configs(tiny_checkpoint, tmp_path, part, key, value, phrase):
    folder = tmp_path / "lying"
    folder.mkdir()
    (folder / CHECKPOINT_MARKER).write_text((tiny_checkpoint / CHECKPOINT_MARKER).read_text())
    _marker_with(folder, lambda model: model[part].__setitem__(key, value))
    with pytest.raises(WeightError, match=re.escape(phrase)) as error:
        ModelConfig.from_folder(folder)
    assert CHECKPOINT_MARKER in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        (b"[1, 2, 3]", "has no model"),
        (b"\x00\x01\xff binary", r"is not valid JSON \(not UTF-8"),
        (b'{"model": [1]}', "expected a JSON object"),
        (b'{"model": {"name": "x"}}', "transformer is missing"),
        (b"[" * 50_000, r"nested too deeply|is not valid JSON \("),
    ],
)
def test_checkpoint_marker_that_is_not_a_config(tmp_path, content, phrase):
    (tmp_path / CHECKPOINT_MARKER).write_bytes(content)
    with pytest.raises(WeightError, match=phrase) as error:
        ModelConfig.from_folder(tmp_path)
    assert "\n" not in str(error.value)


def test_valid_configs_keep_their_hash(tiny_checkpoint):
    for config in PRESETS.values():
        again = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
        assert again == config and again.hash() == config.hash()
    assert ModelConfig.from_folder(tiny_checkpoint).hash() == TINY.hash()


@st.composite
def mutated_config(draw) -> object:
    raw = json.loads(json.dumps(TINY.to_dict()))
    for _ in range(draw(st.integers(1, 3))):
        part = draw(st.sampled_from([None, "transformer", "vae", "text_encoder", "scheduler"]))
        node = raw if part is None or not isinstance(raw.get(part), dict) else raw[part]
        if not node:
            continue
        key = draw(st.sampled_from(sorted(node)))
        if draw(st.integers(0, 4)) == 0:
            del node[key]
        else:
            node[key] = draw(JSON_VALUES)
    return draw(st.just(raw) | JSON_VALUES) if draw(st.integers(0, 9)) == 0 else raw


@FUZZ
@given(raw=mutated_config())
def test_fuzzed_configs_are_weight_errors(raw):
    try:
        config = ModelConfig.from_dict(raw)
    except WeightError as e:
        assert "\n" not in str(e)
        return
    config.hash()
    assert config.transformer.inner_dim > 0 and config.vae.spatial_factor >= 1


@settings(max_examples=60, deadline=None)
@given(content=st.binary(max_size=200) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_fuzzed_checkpoint_markers(tmp_path_factory, content):
    folder = tmp_path_factory.mktemp("marker")
    (folder / CHECKPOINT_MARKER).write_bytes(content)
    with pytest.raises(WeightError):
        ModelConfig.from_folder(folder)


def test_missing_params_file_is_named(tiny_checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "transformer").mkdir(parents=True)
    (folder / CHECKPOINT_MARKER).write_text((tiny_checkpoint / CHECKPOINT_MARKER).read_text())
    with pytest.raises(WeightError, match=r"transformer/params\.safetensors is missing"):
        checkpoint.load_component(folder, "transformer", _abstract("transformer"))


def test_float_tensor_labelled_int32_is_refused(tiny_checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "transformer").mkdir(parents=True)
    (folder / CHECKPOINT_MARKER).write_text((tiny_checkpoint / CHECKPOINT_MARKER).read_text())
    header, data = split_file(tiny_checkpoint / "transformer" / checkpoint.PARAMS)
    name = "proj_out/kernel"
    assert header[name]["dtype"] == "F32"
    header[name]["dtype"] = "I32"  # same size: only the label lies
    join_file(folder / "transformer" / checkpoint.PARAMS, header, data)
    with pytest.raises(
        WeightError, match=f"{name} is stored as int32, the model's parameter is float32"
    ):
        checkpoint.load_component(folder, "transformer", _abstract("transformer"))


def test_float_file_into_bf16_parameter_still_casts():
    weights.check_dtype("x", np.float32, ml_dtypes.bfloat16)
    with pytest.raises(WeightError, match="x is stored as float32"):
        weights.check_dtype("x", np.float32, np.int32)


def _diffusers_folder(root: Path) -> Path:
    """A diffusers-format folder's configs (and one transformer weight, for its dtype)."""
    tc, vae, te = TINY.transformer, TINY.vae, TINY.text_encoder
    for part, config in (("transformer", tc), ("vae", vae), ("text_encoder", te)):
        (root / part).mkdir(parents=True)
        raw = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(config).items()}
        (root / part / "config.json").write_text(json.dumps(raw))
    save_file({"proj_out.weight": np.zeros((2, 2), np.float32)},
              root / "transformer" / "diffusion_pytorch_model.safetensors")  # fmt: skip
    return root


def test_diffusers_configs_that_lie(tmp_path):
    folder = _diffusers_folder(tmp_path / "model")
    assert ModelConfig.from_folder(folder).transformer == TINY.transformer
    config = folder / "transformer" / "config.json"
    for content, phrase in (
        ("[1]", "the config is [1], expected a JSON object"),
        ('{"patch_size": 5}', "patch_size is 5"),
        ('{"num_attention_heads": 1e400}', "num_attention_heads is Infinity"),
    ):
        config.write_text(content)
        with pytest.raises(WeightError, match=re.escape(phrase)) as error:
            ModelConfig.from_folder(folder)
        assert str(config) in str(error.value)
    config.unlink()
    with pytest.raises(WeightError, match="config.json is missing"):
        ModelConfig.from_folder(folder)


def test_cli_refuses_lying_weights_folders(tiny_checkpoint, tmp_path):
    """`runtime run` with a checkpoint whose config lies, and `aot build --model` with a
    diffusers folder whose config lies: one line each, nothing built."""
    weights_folder = tmp_path / "weights"
    weights_folder.mkdir()
    (weights_folder / CHECKPOINT_MARKER).write_text(
        (tiny_checkpoint / CHECKPOINT_MARKER).read_text()
    )
    _marker_with(weights_folder, lambda model: model["transformer"].__setitem__("patch_size", 5))
    (tmp_path / "art").mkdir()
    run = run_cli("runtime", "run", "--artifacts", str(tmp_path / "art"), "--weights",
                  str(weights_folder), *TINY_SHAPE, "--prompt", "a cat", "--steps", "2",
                  "--out", str(tmp_path / "v.mp4"), check=False)  # fmt: skip
    one_line(run, CHECKPOINT_MARKER, "patch_size is 5")
    assert not (tmp_path / "v.mp4").exists()
    model = _diffusers_folder(tmp_path / "model")
    (model / "vae" / "config.json").write_text('{"z_dim": "sixteen"}')
    build = run_cli("aot", "build", "--model", str(model), *TINY_SHAPE, "--target", "cpu-8",
                    "--out", str(tmp_path / "out"), check=False)  # fmt: skip
    one_line(build, "vae/config.json", 'z_dim is "sixteen"')
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ----------------------------------------------------------------------------------------------
# LoRA files.

TINY_SHAPES = {p: a.shape for p, a in weights.flatten(_abstract("transformer")).items()}
Q = "transformer.blocks.0.attn1.to_q"


def write_lora(path: Path, alpha=None, metadata=None, **tensors) -> Path:
    """A valid rank-2 LoRA of one module unless told otherwise."""
    rng = np.random.default_rng(0)
    values = {
        f"{Q}.lora_A.weight": rng.standard_normal((2, 32), np.float32),
        f"{Q}.lora_B.weight": rng.standard_normal((32, 2), np.float32),
    }
    if alpha is not None:
        values[f"{Q}.alpha"] = alpha
    values.update({f"{Q}.{k}": v for k, v in tensors.items()})
    save_file(values, path, metadata=metadata)
    return path


def check_lora(path: Path) -> None:
    lora.check([(path, 1.0)], TINY_SHAPES)


@FUZZ
@given(data=st.data())
def test_fuzzed_lora_files_are_lora_errors(tmp_path, data):
    meta = {"lora_adapter_metadata": json.dumps({"lora_alpha": 4, "r": 2})}
    path = write_lora(tmp_path / "l.safetensors", alpha=np.array(2.0, np.float32), metadata=meta)
    header, payload = split_file(path)
    if data.draw(st.booleans()):
        header["__metadata__"]["lora_adapter_metadata"] = json.dumps(
            {"lora_alpha": data.draw(JSON_VALUES)}
        )
    path.write_bytes(data.draw(mutated(header, payload)))
    try:
        check_lora(path)
    except lora.LoraError as e:
        assert "\n" not in str(e)


@pytest.mark.parametrize(
    ("make", "phrase"),
    [
        (
            lambda p: save_file(
                {
                    f"{Q}.lora_A.weight": np.zeros((0, 32), np.float32),
                    f"{Q}.lora_B.weight": np.zeros((32, 0), np.float32),
                },
                p,
            ),
            "has rank 0",
        ),  # fmt: skip
        (
            lambda p: write_lora(p, metadata={"lora_adapter_metadata": '{"lora_alpha": "abc"}'}),
            "lora_alpha is 'abc', not a finite positive number",
        ),  # fmt: skip
        (
            lambda p: write_lora(p, metadata={"lora_adapter_metadata": '{"lora_alpha": NaN}'}),
            "lora_alpha is nan",
        ),  # fmt: skip
        (
            lambda p: write_lora(p, metadata={"lora_adapter_metadata": "[" * 100_000}),
            "lora_adapter_metadata is not a JSON object",
        ),  # fmt: skip
        (lambda p: write_lora(p, alpha=np.array(np.nan, np.float32)), "alpha holds NaN"),
        (lambda p: write_lora(p, alpha=np.zeros(3, np.float32)), "alpha is not a single number"),
        (lambda p: write_lora(p, alpha=np.array(-1.0, np.float32)), "alpha is -1.0"),
        (
            lambda p: write_lora(p, **{"lora_B.weight": np.full((32, 2), np.inf, np.float32)}),
            "lora_B.weight holds NaN or infinite values",
        ),  # fmt: skip
        (
            lambda p: write_lora(p, **{"lora_A.weight": np.ones((2, 32), np.int32)}),
            "lora_A.weight is stored as int32",
        ),  # fmt: skip
        (lambda p: write_lora(p, **{"lora_A.weight": np.array(1, np.float32)}), "does not fit"),
    ],
)
def test_lying_lora_files(tmp_path, make, phrase):
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(lora.LoraError, match=phrase) as error:
        check_lora(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_lora_metadata_that_is_not_strings(tmp_path):
    path = write_lora(tmp_path / "l.safetensors")
    header, data = split_file(path)
    header["__metadata__"] = {"lora_adapter_metadata": {"lora_alpha": 4}}
    join_file(path, header, data)
    with pytest.raises(lora.LoraError, match="__metadata__ is not a map of strings"):
        check_lora(path)


def test_a_valid_lora_still_reads(tmp_path):
    meta = {"lora_adapter_metadata": json.dumps({"lora_alpha": 4})}
    path = write_lora(tmp_path / "l.safetensors", metadata=meta)
    deltas, (applied,) = lora.prepare([(path, 0.5)], TINY_SHAPES)
    assert applied.parameters == 1 and deltas[("blocks", "attn1", "to_q", "kernel")]
    ((_, update),) = deltas[("blocks", "attn1", "to_q", "kernel")].terms
    assert update.scale == 0.5 * 4 / 2


@pytest.mark.parametrize("scale", ["inf", "-inf", "nan", "abc", ""])
def test_lora_scale_must_be_finite(scale):
    with pytest.raises(lora.LoraError, match="is not a finite number"):
        lora.parse_spec(f"f.safetensors:{scale}")


def test_lora_spec_keeps_colons_in_paths():
    assert lora.parse_spec("a:b.safetensors") == (Path("a:b.safetensors"), 1.0)
    assert lora.parse_spec("d:x/f.safetensors:0.5") == (Path("d:x/f.safetensors"), 0.5)


def test_cli_refuses_an_infinite_lora_scale(tmp_path):
    result = run_cli("runtime", "run", "--artifacts", str(tmp_path), "--weights", str(tmp_path),
                     *TINY_SHAPE, "--prompt", "a cat", "--lora", "f.safetensors:inf",
                     "--out", str(tmp_path / "v.mp4"), check=False)  # fmt: skip
    one_line(result, "not a finite number")


# ----------------------------------------------------------------------------------------------
# Tokenizer folders.


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    build_word_tokenizer(folder, vocab_size=256)
    return folder


def _copy(folder: Path, to: Path, *names: str) -> Path:
    to.mkdir()
    for name in names:
        (to / name).write_bytes((folder / name).read_bytes())
    return to


def test_tokenizer_folder_without_tokenizer_json(tokenizer_folder, tmp_path):
    """transformers would build a default tokenizer from the config alone, every word one id."""
    folder = _copy(tokenizer_folder, tmp_path / "t", "tokenizer_config.json")
    with pytest.raises(TokenizerError, match="it has no tokenizer.json"):
        load_tokenizer(folder)


@pytest.mark.parametrize(
    ("file", "content", "phrase"),
    [
        ("tokenizer.json", b"{not json", "cannot load a tokenizer"),
        ("tokenizer.json", b"\xff\xfe\x00", "cannot load a tokenizer"),
        ("tokenizer_config.json", b"[1]", "tokenizer_config.json is not a JSON object"),
        ("tokenizer_config.json", b'{"pad_token": "<nope>"}', "pad_token '<nope>' is not in"),
        ("tokenizer_config.json", b'{"pad_token": {"content": 3}}', "pad_token 3 is not in"),
        ("tokenizer_config.json", b'{"eos_token": "<end>"}', "eos_token '<end>' is not in"),
    ],
)
def test_broken_tokenizer_folders(tokenizer_folder, tmp_path, file, content, phrase):
    folder = _copy(tokenizer_folder, tmp_path / "t", "tokenizer.json", "tokenizer_config.json")
    (folder / file).write_bytes(content)
    with pytest.raises(TokenizerError, match=phrase) as error:
        load_tokenizer(folder)
    assert "\n" not in str(error.value)


def test_oversized_tokenizer_config_is_refused(tokenizer_folder, tmp_path):
    """tokenizer_config.json is bounded as a model's config files are (sparse: no disk used)."""
    folder = _copy(tokenizer_folder, tmp_path / "t", "tokenizer.json")
    with (folder / "tokenizer_config.json").open("wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(TokenizerError, match="tokenizer_config.json is over 16 MiB") as error:
        load_tokenizer(folder)
    assert "\n" not in str(error.value)


def test_prompt_that_is_not_utf8(tokenizer_folder):
    tokenizer = load_tokenizer(tokenizer_folder)
    bad = b"a cat \xff".decode("utf-8", "surrogateescape")
    with pytest.raises(TokenizerError, match="prompt 1 is not valid UTF-8"):
        tokenize(tokenizer, ["fine", bad], max_length=8)
    assert tokenize(tokenizer, ["a cat"], max_length=8)[0].shape == (1, 8)


# ----------------------------------------------------------------------------------------------
# The coordinator.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peer(port: int, send: bytes | None, hold_s: float) -> threading.Thread:
    """A client that connects to process 0, sends `send` (nothing when None) and holds on."""

    def run() -> None:
        for _ in range(50):
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.05)
        with conn:
            if send is not None:
                conn.sendall(send)
            time.sleep(hold_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_silent_peer_does_not_hold_process_0():
    port = free_port()
    _peer(port, None, hold_s=30)
    start = time.monotonic()
    with pytest.raises(JobError, match=r"processes \[1\] of the 2-process job did not reach"):
        _rendezvous(f"127.0.0.1:{port}", 2, 0, 3)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("garbage", [b"hello\n", b"x" * 100_000, b"1\n", b"1 2 3\n", b"\xff\xfe\n"])
def test_garbage_from_a_peer_is_a_job_error(garbage):
    port = free_port()
    _peer(port, garbage, hold_s=5)
    with pytest.raises(JobError, match="a process joined") as error:
        _rendezvous(f"127.0.0.1:{port}", 2, 0, 5)
    assert "\n" not in str(error.value)


def test_a_real_peer_still_joins():
    port = free_port()
    peer = threading.Thread(target=_rendezvous, args=(f"127.0.0.1:{port}", 2, 1, 10))
    peer.start()
    _rendezvous(f"127.0.0.1:{port}", 2, 0, 10)
    peer.join(10)
    assert not peer.is_alive()


@pytest.mark.parametrize(
    ("coordinator", "phrase"),
    [
        ("localhost:0", "with a port in"),
        ("localhost:70000", "with a port in"),
        ("localhost:abc", "with a port in"),
        ("no-such-host.invalid:1234", "cannot be resolved"),
    ],
)
def test_bad_coordinator_addresses(coordinator, phrase):
    for process_id in (0, 1):
        with pytest.raises(JobError, match=phrase):
            _rendezvous(coordinator, 2, process_id, 2)


def test_port_in_use_is_a_job_error():
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(JobError, match=f"cannot listen on port {port}"):
            _rendezvous(f"localhost:{port}", 2, 0, 2)


# ----------------------------------------------------------------------------------------------
# `aot build --jobs`: workers die with their parent.


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _is_worker(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_jobs_workers_die_with_a_killed_parent(tmp_path):
    resolutions = [a for r in ("192x320", "320x192", "256x256", "320x320") for a in ("--res", r)]
    parent = subprocess.Popen(
        [str(BIN / "aot"), "build", "--model", "tiny", *resolutions, "--frames", "9",
         "--batch", "1", "--target", "cpu-8", "--out", str(tmp_path), "--jobs", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        workers: set[int] = set()
        while not workers and time.monotonic() < deadline and parent.poll() is None:
            workers = {p for p in _children(parent.pid) if _is_worker(p)}
            time.sleep(0.1)
        assert workers, "no worker process appeared"
        time.sleep(1.0)  # the workers are importing jax or compiling
        workers |= {p for p in _children(parent.pid) if _is_worker(p)}
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), "workers outlived their killed parent"
    finally:
        parent.kill()
        for pid in workers if "workers" in locals() else ():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
