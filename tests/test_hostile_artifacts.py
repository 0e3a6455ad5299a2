"""A crafted or damaged artifacts folder: pickles that would run a command or corrupt memory if
unpickled, executable headers that lie about their executable,
manifests mutated at random, paths and symlinks leading outside the build, a gzip bomb, a
sparse 8 GB manifest, and one broken build among good ones. Each is refused with one line
(exit 2 from the CLIs), nothing runs, nothing outside the build is read, and the good builds
still list, check and run."""

from __future__ import annotations

import contextlib
import copy
import gzip
import json
import os
import pickle
import shutil
import struct
import sys
import tracemalloc
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_SHAPE, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from aot.reports import check, report
from runtime.builds import executables
from runtime.builds.artifact import (
    MANIFEST,
    SCHEMA_VERSION,
    ArtifactError,
    FileEntry,
    Manifest,
    read_hlo_text,
    read_manifest,
    sha256_file,
    verify_file,
    verify_files,
)
from runtime.builds.executables import load_executable
from runtime.builds.loader import Present, Request, match_build, open_build, passed_over
from wan.configs import VideoShape

RUN = ["--prompt", "a cat", "--steps", "1"]


# ---------------------------------------------------------------------------- helpers


@pytest.fixture
def build_copy(tiny_build, tmp_path) -> Path:
    """A private copy of the tiny build to damage, in a folder of builds."""
    folder = tmp_path / "artifacts" / tiny_build.name
    shutil.copytree(tiny_build, folder)
    return folder


def edit_manifest(folder: Path, edit) -> None:
    path = folder / MANIFEST
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def replace_file(folder: Path, program: str, kind: str, data: bytes) -> None:
    """Put `data` in a program's executable or HLO file and make the manifest agree, so that
    the integrity check passes and only what comes after it can refuse the file."""
    path = folder / f"{program}.{'exec' if kind == 'executable' else 'hlo.txt.gz'}"
    path.write_bytes(data)
    edit_manifest(
        folder,
        lambda m: m["programs"][program][kind].update(sha256=sha256_file(path), size=len(data)),
    )


def one_line_refusal(result, canary: Path | None = None) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    assert canary is None or not canary.exists()
    return lines[0]


def run_args(artifacts: Path, weights: Path, tmp_path: Path) -> list[str]:
    return [
        "run", "--artifacts", str(artifacts), "--weights", str(weights), *TINY_SHAPE, *RUN,
        "--out", str(tmp_path / "v.mp4"),
    ]  # fmt: skip


# ---------------------------------------------------------------------------- gadgets
# Pickles built opcode by opcode, as an attacker would write them (pickle.dumps refuses to
# name a global by a path it cannot verify).


def data(value) -> bytes:
    """Plain data (no globals) as pickle opcodes, without PROTO and STOP."""
    return pickle.dumps(value, protocol=2)[2:-1]


def global_(module: str, name: str) -> bytes:
    """Classic GLOBAL (protocol 0 onwards)."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def stack_global(module: str, name: str) -> bytes:
    """Protocol 4's STACK_GLOBAL, which lets the name be a dotted attribute path."""
    return data(module) + data(name) + b"\x93"


def call(function: bytes, *args: bytes) -> bytes:
    return function + b"(" + b"".join(args) + b"tR"


def pickled(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


def gadgets(canary: Path) -> dict[str, bytes]:
    """Each pickle would create `canary` (or fail trying) if the unpickler let it run."""
    touch = f"touch {canary}"
    popen = call(stack_global("jax._src.environment_info", "subprocess.Popen"), data(["touch", str(canary)]))  # fmt: skip
    return {
        # jax._src.environment_info imports subprocess: the attribute path reaches Popen.
        "dotted_popen": pickled(popen),
        "dotted_os_system": pickled(call(stack_global("jax", "_src.api.os.system"), data(touch))),
        "os_system": pickled(call(global_("os", "system"), data(touch))),
        "posix_system": pickled(call(global_("posix", "system"), data(touch))),
        "builtins_eval": pickled(
            call(global_("builtins", "eval"), data(f"__import__('os').system({touch!r})"))
        ),
        "builtins_getattr": pickled(
            call(
                call(
                    global_("builtins", "getattr"),
                    call(global_("builtins", "__import__"), data("os")),
                    data("system"),
                ),
                data(touch),
            )
        ),
        # An allowed class whose argument is made by a callable that is not allowed.
        "allowed_class_reducing_os_system": pickled(
            call(stack_global("jax._src.mesh", "Mesh"), call(global_("os", "system"), data(touch)))
        ),
        # Popen through a dotted name under an allowed module.
        "allowed_module_dotted_name": pickled(
            call(
                stack_global("jax", "_src.environment_info.subprocess.Popen"),
                data(["touch", str(canary)]),
            )
        ),
    }


def forged_dtype_payload() -> bytes:
    """The second probe's memory corruption, as an executable of the old (pickled) format: only
    allowed globals, but numpy.dtype('O8', False, True) with its flags cleared by BUILD and an
    object array made from raw bytes, whose 'objects' are addresses the payload chose."""
    dtype = call(global_("numpy", "dtype"), data("O8"), data(False), data(True))
    forged = dtype + data((3, "|", None, None, None, -1, -1, 0)) + b"b"  # BUILD: flags 0
    array = (
        call(
            global_("numpy._core.multiarray", "_reconstruct"),
            global_("numpy", "ndarray"),
            data((0,)),
            data(b"b"),
        )
        + b"("
        + data(1)
        + data((1,))
        + forged
        + data(False)
        + data(b"\xef\xbe\xad\xde" * 2)
        + b"tb"
    )
    payload = pickled(array)
    return pickle.dumps((payload, None, None, [0]), protocol=5)


def with_header(real_exec: bytes, xla: bytes) -> bytes:
    """A real executable's header in front of other bytes where XLA's executable goes."""
    header, old = executables.read_header(real_exec)
    return real_exec[: len(real_exec) - len(old)] + xla


def all_gadgets(canary: Path, real_exec: bytes) -> dict[str, bytes]:
    """Each gadget as a whole executable file, and behind a real header in XLA's place."""
    whole = {**gadgets(canary), "forged_dtype": forged_dtype_payload()}
    return {
        **whole,
        **{f"xla_{name}": with_header(real_exec, blob) for name, blob in whole.items()},
    }


@pytest.fixture
def pickle_audit():
    """The globals any unpickling looks up while the test runs (the `pickle.find_class` audit
    event: every global a pickle names passes through it)."""
    seen: list[tuple[str, str]] = []
    _AUDIT.append(seen)
    yield seen
    _AUDIT.remove(seen)


_AUDIT: list[list[tuple[str, str]]] = []
sys.addaudithook(
    lambda event, args: [s.append(args) for s in _AUDIT] if event == "pickle.find_class" else None
)


def test_gadgets_run_when_not_restricted(tmp_path, pickle_audit):
    """Control: each gadget does create the canary under a plain unpickler (and the audit sees
    its globals), so the refusals below are the loader's doing."""
    for name, blob in gadgets(tmp_path / "pwned").items():
        canary = tmp_path / "pwned"
        try:
            made = pickle.loads(blob)
            if hasattr(made, "wait"):
                made.wait()
        except Exception:  # jax's Mesh refuses os.system's exit status, after the command ran
            pass
        assert canary.exists(), name
        canary.unlink()
    assert pickle_audit


def test_gadgets_refused_without_unpickling(tiny_build, tmp_path, pickle_audit):
    """Every gadget, as a whole file or in XLA's place behind a real header, is one
    ArtifactError line from load_executable: nothing is unpickled, the command never ran, and
    the real executables still load (without unpickling either)."""
    canary = tmp_path / "pwned"
    real = (tiny_build / "text_encode.exec").read_bytes()
    devices = jax.devices()[:8]
    for name, blob in all_gadgets(canary, real).items():
        with pytest.raises(ArtifactError) as refused:
            load_executable(blob, devices)
        assert "\n" not in str(refused.value), name
        assert not canary.exists(), name
    for path in sorted(tiny_build.glob("*.exec")):
        assert load_executable(path.read_bytes(), devices) is not None
    assert pickle_audit == []


# Whole files (an older build's format is refused before anything else) and one in XLA's place.
CLI_GADGETS = ["dotted_popen", "os_system", "builtins_getattr", "forged_dtype", "xla_forged_dtype"]


@pytest.mark.parametrize("gadget", CLI_GADGETS)
def test_gadget_in_a_build_is_refused_by_runtime_run(build_copy, tiny_weights, tmp_path, gadget):
    canary = tmp_path / "pwned"
    real = (build_copy / "kv_cache.exec").read_bytes()
    replace_file(build_copy, "kv_cache", "executable", all_gadgets(canary, real)[gadget])
    result = run_cli("runtime", *run_args(build_copy.parent, tiny_weights, tmp_path), check=False)
    line = one_line_refusal(result, canary)
    assert "kv_cache" in line and "aot build --force" in line
    assert not (tmp_path / "v.mp4").exists()


def test_an_older_builds_pickle_fails_aot_check(build_copy):
    """A pickled executable planted with its manifest entry recomputed: `aot check` names the
    build unreadable (it passed before the pickle-free format)."""
    replace_file(build_copy, "vae_decode", "executable", forged_dtype_payload())
    result = run_cli("aot", "check", str(build_copy.parent), check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "vae_decode" in result.stdout and "not in this runtime's format" in result.stdout


# ---------------------------------------------------------------------------- executable headers


def header_of(blob: bytes) -> dict:
    start = len(executables.MAGIC) + 8
    (length,) = struct.unpack_from("<Q", blob, len(executables.MAGIC))
    return json.loads(blob[start : start + length])


def with_header_json(blob: bytes, raw, length: int | None = None) -> bytes:
    _, xla = executables.read_header(blob)
    text = json.dumps(raw).encode()
    size = len(text) if length is None else length
    return executables.MAGIC + struct.pack("<Q", size) + text + xla


def _with_value(raw: dict, path: tuple, value) -> dict:
    raw = copy.deepcopy(raw)
    target = raw
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return raw


@pytest.fixture(scope="module")
def handoff(tiny_build) -> bytes:
    """The smallest real executable: it reads on the transformer's mesh, writes on the VAE's."""
    return (tiny_build / "latents_handoff.exec").read_bytes()


# Lies a header could tell about its executable; each is refused before any call.
LIES = {
    "an input's shape": (("inputs", 0, "shape", 1), 6),
    "an input's dtype": (("inputs", 0, "dtype"), "bfloat16"),
    "an object dtype": (("inputs", 0, "dtype"), "object"),
    "an output's shape": (("outputs", 0, "shape", 1), 30),
    "an output's sharding, same shard shape": (("outputs", 0, "placement", "spec"), [None, None, None, None, "vae_spatial"]),
    "an axis XLA did not split": (("inputs", 0, "placement", "spec"), [None, None, None, None, "context"]),
    "an axis of another mesh": (("inputs", 0, "placement", "spec"), ["vae_spatial"]),
    "a mesh's device order": (("meshes", 0, "device_ids"), [7, 6, 5, 4, 3, 2, 1, 0]),
    "a missing mesh": (("inputs", 0, "placement", "mesh"), 5),
    "a tree with another leaf count": (("in_tree",), {"tuple": [{"tuple": [0, 0]}, {"dict": []}]}),
    "a tree of another type": (("out_tree",), {"set": [0]}),
    "an unknown field": (("extra",), 1),
    "another format": (("format",), 3),
    "more code than stored": (("xla_bytes",), 10**9),
    "less code than stored": (("xla_bytes",), 1),
    "a rank over the bound": (("inputs", 0, "shape"), [1] * 17),
}  # fmt: skip


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_lying_header_is_refused(handoff, lie):
    path, value = LIES[lie]
    devices = jax.devices()[:8]
    blob = with_header_json(handoff, _with_value(header_of(handoff), path, value))
    with pytest.raises(ArtifactError) as refused:
        load_executable(blob, devices)
    assert "\n" not in str(refused.value) and "aot build --force" in str(refused.value)
    assert load_executable(handoff, devices) is not None  # control: the truth loads


@pytest.mark.parametrize(
    "damage",
    ["truncated before the length", "a length past the end", "a length over the bound", "not JSON",
     "nested 100000 deep", "not UTF-8"],
)  # fmt: skip
def test_a_damaged_header_is_refused(handoff, damage):
    magic, raw = executables.MAGIC, header_of(handoff)
    blob = {
        "truncated before the length": magic + b"\x01",
        "a length past the end": with_header_json(handoff, raw, length=len(handoff)),
        "a length over the bound": with_header_json(
            handoff, raw, length=executables.MAX_HEADER_BYTES + 1
        ),
        "not JSON": magic + struct.pack("<Q", 3) + b"{{{",
        "nested 100000 deep": magic + struct.pack("<Q", 200000) + b"[" * 100000 + b"]" * 100000,
        "not UTF-8": magic + struct.pack("<Q", 2) + b"\xff\xfe",
    }[damage]
    with pytest.raises(ArtifactError):
        executables.read_header(blob)


def test_an_older_uncompressed_executable_says_rebuild(handoff):
    raw = {**header_of(handoff), "format": 1}
    del raw["xla_bytes"]
    with pytest.raises(ArtifactError, match="uncompressed format of older builds.*--force"):
        load_executable(with_header_json(handoff, raw), jax.devices()[:8])


def test_a_decompression_bomb_is_refused_before_it_is_expanded(handoff):
    """A frame that claims (and holds) 512 MiB behind a header declaring the real size: one
    line, and the process never holds them (zstd's own content size is not trusted)."""
    import resource

    import zstandard

    header, _ = executables.read_header(handoff)
    size = 512 << 20
    writer = zstandard.ZstdCompressor().compressobj(size=size)
    bomb = b"".join(writer.compress(bytes(1 << 20)) for _ in range(512)) + writer.flush()
    assert zstandard.frame_content_size(bomb) == size and len(bomb) < 1 << 20
    blob = handoff[: len(handoff) - len(executables.read_header(handoff)[1])] + bomb
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ArtifactError, match="header says") as refused:
        load_executable(blob, jax.devices()[:8])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
    assert "\n" not in str(refused.value) and grown < (128 << 10)
    assert header.xla_bytes < size


def declared_matches(declared: executables.DeclaredCall, executable) -> bool:
    """Whether `declared` is what `executable` takes: its arguments' tree, shapes, dtypes and
    weak types, and its input shardings (None for a dropped input)."""
    flat = lambda tree: jax.tree.leaves(tree, is_leaf=lambda s: s is None)  # noqa: E731
    args = lambda tree: [(a.shape, a.dtype, a.weak_type) for a in flat(tree)]  # noqa: E731
    return (
        jax.tree.structure(declared.args_info) == jax.tree.structure(executable.args_info)
        and args(declared.args_info) == [(i.shape, i.dtype, i._aval.weak_type) for i in flat(executable.args_info)]
        and flat(declared.input_shardings) == flat(executable.input_shardings)
    )  # fmt: skip


def test_a_build_s_headers_declare_what_its_executables_take(tiny_build):
    """`runtime run` places the weights in the shardings the headers declare while XLA loads
    the executables (runtime.generation.pipeline): for each program they are the loaded one's."""
    opened = open_build(tiny_build, read_manifest(tiny_build), jax.devices())
    loaded = opened.load()
    assert set(loaded) == set(opened.declared) == set(read_manifest(tiny_build).key.programs)
    for name, executable in loaded.items():
        assert declared_matches(opened.declared[name], executable), name


def test_stored_executables_are_compressed(tiny_build):
    """Each executable file holds XLA's bytes as one zstd frame: the file is smaller than what
    its header declares, and the whole build loads (the other tests)."""
    for path in tiny_build.glob("*.exec"):
        header, stored = executables.read_header(path.read_bytes())
        assert len(stored) < header.xla_bytes, path.name
        assert len(executables.decompressed(header, stored)) == header.xla_bytes


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_mutated_header_loads_or_refuses(handoff, data):
    """Any one field of a real header changed (type, value or removal): a sound executable or one
    ArtifactError line, never another exception."""
    raw = header_of(handoff)
    path = data.draw(st.sampled_from(list(json_paths(raw))[1:]))
    how = data.draw(st.sampled_from(["delete", "replace"]))
    value = data.draw(JSON_VALUES)
    mutated = mutate(copy.deepcopy(raw), path, how, value)
    try:
        load_executable(with_header_json(handoff, mutated), jax.devices()[:8])
    except ArtifactError as e:
        assert "\n" not in str(e)


def test_a_stored_executable_round_trips():
    """What the loader rebuilds from a header is what jax compiled: trees (tuple, list, dicts
    with string and integer keys, None), a weak-typed scalar, a donated input, an input XLA
    drops, two meshes over the same devices; and the loaded executable computes the same."""
    devices = jax.devices()[:8]
    grid = Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    line = Mesh(np.array(devices).reshape(1, 8), ("one", "all"))
    on = lambda mesh, *spec: NamedSharding(mesh, P(*spec))  # noqa: E731

    def fn(params, x, scale, unused):
        y = x * scale + params["w"][0] + params["layers"][1]["b"]
        return {"y": y, "pair": [y.sum(), None]}

    params = {"w": (jnp.ones((8, 16)),), "layers": {1: {"b": jnp.ones((8, 16))}}}
    shapes = (params, jnp.ones((8, 16)), 2.0, jnp.ones((3,)))
    in_shardings = ({"w": (on(grid, "data"),), "layers": {1: {"b": on(grid, None, "model")}}},
                    on(grid, "data", "model"), on(grid), on(grid))  # fmt: skip
    compiled = (
        jax.jit(fn, in_shardings=in_shardings, out_shardings={"y": on(line, None, "all"), "pair": [on(line), None]},
                donate_argnums=(1,))
        .lower(*jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a), weak_type=isinstance(a, float)), shapes))
        .compile()
    )  # fmt: skip
    blob = executables.dump_executable(
        compiled, [d.id for d in devices], ["params", "x", "scale", "unused"]
    )
    loaded = load_executable(blob, devices)
    assert loaded.in_tree == compiled.in_tree and loaded.out_tree == compiled.out_tree
    assert loaded.args_info == compiled.args_info  # avals (weak types too) and donation
    flat = lambda tree: jax.tree.leaves(tree, is_leaf=lambda s: s is None)  # noqa: E731
    assert flat(loaded.input_shardings) == flat(compiled.input_shardings)  # the dropped input: None
    assert flat(loaded.output_shardings) == flat(compiled.output_shardings)
    header, _ = executables.read_header(blob)
    assert [a.path for a in header.inputs] == [
        "params/layers/1/b",
        "params/w/0",
        "x",
        "scale",
        "unused",
    ]
    assert [a.placement is None for a in header.inputs] == [False, False, False, False, True]
    assert len(header.meshes) == 2
    declared = executables.declared_call(header, devices)  # what the header alone says
    assert declared_matches(declared, compiled)

    def run(executable):
        args = jax.device_put(
            (params, jnp.arange(128.0).reshape(8, 16), 2.0, jnp.ones((3,))), in_shardings
        )
        return jax.tree.map(np.asarray, executable(*args))

    expected, got = run(compiled), run(loaded)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_program_that_cannot_be_stored_is_refused_at_build():
    """Only what the header can state is written: a host callback is refused by name."""
    devices = jax.devices()[:1]
    compiled = jax.jit(lambda x: jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((2,), jnp.float32), x)).lower(
        jax.ShapeDtypeStruct((2,), jnp.float32)
    ).compile()  # fmt: skip
    with pytest.raises(ValueError, match="host callbacks"):
        executables.dump_executable(compiled, [d.id for d in devices], ["x"])


# ---------------------------------------------------------------------------- manifests


@pytest.fixture(scope="module")
def manifest_json(tiny_build) -> dict:
    return json.loads((tiny_build / MANIFEST).read_text())


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """One folder whose manifest.json each example overwrites (no other files needed:
    read_manifest reads only the manifest)."""
    return tmp_path_factory.mktemp("mutated")


def json_paths(value, prefix=()):
    yield prefix
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()  # fmt: skip
    for key, item in items:
        yield from json_paths(item, (*prefix, key))


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


def mutate(raw, path, how: str, value):
    """`raw` with the value at `path` (not the root) deleted, replaced by `value`, or
    re-typed."""
    parent = raw
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if how == "delete":
        del parent[key]
    elif how == "replace":
        parent[key] = value
    elif how == "wrap":
        parent[key] = [parent[key]]
    else:  # stringify
        parent[key] = json.dumps(parent[key])
    return raw


def reads_or_refuses(folder: Path) -> Manifest | None:
    """read_manifest gives a Manifest that every reader can use, or one ArtifactError line."""
    try:
        manifest = read_manifest(folder)
    except ArtifactError as e:
        assert "\n" not in str(e) and str(folder) in str(e)
        return None
    report.inspect_text(manifest)
    report._peak_text(manifest)
    json.dumps(manifest.to_json())
    passed_over(manifest, Request(VideoShape(64, 128, 9, 1)), Present.host_cpu())
    check.BuildFacts.of(manifest)
    return manifest


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_mutated_manifest_reads_or_refuses(manifest_json, scratch, data):
    paths = list(json_paths(manifest_json))[1:]  # not the root: test_junk_manifest_is_refused
    shallow = [p for p in paths if len(p) <= 3 and "inputs" not in p and "outputs" not in p]
    raw = json.loads(json.dumps(manifest_json))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(shallow) | st.sampled_from(paths))
        how = data.draw(st.sampled_from(["delete", "replace", "wrap", "stringify"]))
        value = data.draw(JSON_VALUES)
        # An earlier mutation may have removed or re-typed this path.
        with contextlib.suppress(KeyError, IndexError, TypeError):
            raw = mutate(raw, path, how, value)
    (scratch / MANIFEST).write_text(json.dumps(raw, allow_nan=True))
    reads_or_refuses(scratch)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_junk_manifest_is_refused(scratch, junk):
    (scratch / MANIFEST).write_bytes(junk)
    with pytest.raises(ArtifactError):
        read_manifest(scratch)


def _set(*path_and_value):
    *path, value = path_and_value

    def edit(m):
        for key in path[:-1]:
            m = m[key]
        m[path[-1]] = value

    return edit


def _drop(*path):
    def edit(m):
        for key in path[:-1]:
            m = m[key]
        del m[path[-1]]

    return edit


def _nested_config(m):
    deep: list = []
    for _ in range(50):
        deep = [deep]
    m["model_config"]["deep"] = deep


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("programs", []), "`programs` must be a JSON object"),
        (_set("programs", {}), "`programs` must be those of its build (pipeline t2v"),
        (_drop("programs", "vae_decode"), "`programs` must be those of its build (pipeline t2v"),
        (_set("programs", "evil", {}), "`programs` names unknown programs evil"),
        (_set("key", "pipeline", "evil"), "`key.pipeline` must be one of"),
        (_set("process_count", 0), "`process_count` must be an integer in [1, 4096]"),
        (
            _set("local_device_count", 100000),
            "`local_device_count` must be an integer in [1, 1024]",
        ),
        (_set("device_ids", [-1, 1, 2, 3, 4, 5, 6, 7]), "`device_ids[0]` must be an integer"),
        (_set("device_ids", [0, 0, 2, 3, 4, 5, 6, 7]), "`device_ids` must be distinct"),
        (
            _set("device_ids", [0, 1]),
            "`device_ids` has 2 ids, process_count x local_device_count is 8",
        ),
        (
            _set("programs", "kv_cache", "inputs", 0, "shape", [2, "512"]),
            "`programs.kv_cache.inputs[0].shape[1]` must be an integer",
        ),
        (
            _set("programs", "kv_cache", "inputs", 0, "shape", [2.5]),
            "`programs.kv_cache.inputs[0].shape[0]` must be an integer",
        ),
        (
            _set("programs", "kv_cache", "memory", "peak", "1 GiB"),
            "`programs.kv_cache.memory.peak` must be an integer",
        ),
        (
            _drop("programs", "kv_cache", "memory", "peak"),
            "`programs.kv_cache.memory.peak` is missing",
        ),
        (
            _set("programs", "kv_cache", "flops", "NaN"),
            "`programs.kv_cache.flops` must be a finite",
        ),
        (_set("programs", "kv_cache", "executable", "path", "../../x.exec"), "plain file name"),
        (_set("programs", "kv_cache", "hlo", "path", "/etc/passwd"), "plain file name"),
        (_set("programs", "kv_cache", "executable", "sha256", "xyz"), "64 lowercase hex digits"),
        (
            _set("programs", "kv_cache", "name", "vae_decode"),
            "`programs.kv_cache.name` must be kv_cache",
        ),
        (_set("key", "width", True), "`key.width` must be an integer"),
        (_set("key", "mesh", ["data", 2]), "`key.mesh` must be a JSON object"),
        (_set("key", "vae_mesh", [1, 2, 3]), "`key.vae_mesh` must have 2 items"),
        (_set("device_kind", "cpu\nError: forged"), "`device_kind` must be a one-line string"),
        (_set("schema_version", "3"), f"manifest schema '3' is not {SCHEMA_VERSION}"),
        (_set("surprise", 1), "`surprise` is not a field"),
        (_set("lowering_digest", 5), "`lowering_digest` must be 64 lowercase hex digits"),
        (_set("lowering_digest", "../" * 20), "`lowering_digest` must be 64 lowercase hex"),
        (_nested_config, "`model_config` is nested deeper than 16 levels"),
    ],
)
def test_malformed_manifest_names_the_field(build_copy, edit, message):
    edit_manifest(build_copy, edit)
    with pytest.raises(ArtifactError) as refused:
        read_manifest(build_copy)
    text = str(refused.value)
    assert message in text and str(build_copy / MANIFEST) in text and "\n" not in text, text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\xff\xfe binary", "is not valid JSON"),
        ('{"schema_version": 3, "notes": ["caf\xe9"]}'.encode("latin-1"), "is not valid JSON"),
        (b"[1, 2, 3]", "the manifest must be a JSON object"),
        (b'{"schema_version": 3, "hbm_bytes": NaN}', "NaN is not a number JSON allows"),
        (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON"),
        (b'{"schema_version": 3, "process_count": ' + b"9" * 5000 + b"}", "is not valid JSON"),
    ],
)
def test_unparsable_manifest_is_one_line(tmp_path, content, message):
    (tmp_path / MANIFEST).write_bytes(content)
    with pytest.raises(ArtifactError, match=message) as refused:
        read_manifest(tmp_path)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "field", ["local_device_count", "default_mesh", "peak_flops", "ulysses_all_to_alls"]
)
def test_a_schema_3_manifest_holds_every_field(build_copy, field):
    """Schema 3 writes every manifest field: one missing is refused, naming it (manifests of
    schema 2, which could lack some, are refused by their schema)."""
    edit_manifest(build_copy, lambda m: m.pop(field))
    with pytest.raises(ArtifactError, match=f"`{field}` is missing"):
        read_manifest(build_copy)


def test_a_manifest_made_before_the_lowering_digest_reads(build_copy):
    """A schema 5 manifest an older aot wrote, without `lowering_digest`, reads as recording
    none (`aot build` finds it up to date by lowering: tests/test_program_identity.py)."""
    edit_manifest(build_copy, lambda m: m.pop("lowering_digest"))
    assert read_manifest(build_copy).lowering_digest is None


def test_sparse_8gb_manifest_is_refused_quickly(tmp_path):
    with (tmp_path / MANIFEST).open("wb") as f:
        f.truncate(8 << 30)  # sparse: no disk used
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactError, match="is over 16 MiB"):
            read_manifest(tmp_path)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


def test_fifo_manifest_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / MANIFEST)
    with pytest.raises(ArtifactError, match="not a regular file"):
        read_manifest(tmp_path)


# ---------------------------------------------------------------------------- paths


@pytest.mark.parametrize(("kind", "name"), [("hlo", "x.hlo.txt.gz"), ("executable", "x.exec")])
def test_path_outside_the_build_is_refused(build_copy, tiny_weights, tmp_path, kind, name):
    """A manifest path `../../x` to a file with the right sha256 and size (the build's own
    file, or an HLO with a secret): refused by the runtime and by `aot check`, whose output
    never shows the outside file."""
    secret = "SECRET-OUTSIDE-TEXT"
    outside = tmp_path / name
    if kind == "hlo":
        outside.write_bytes(gzip.compress(f"HloModule {secret}\n".encode()))
    else:
        shutil.copyfile(build_copy / "kv_cache.exec", outside)
    entry = FileEntry(f"../../{name}", sha256_file(outside), outside.stat().st_size)
    edit_manifest(build_copy, lambda m: m["programs"]["kv_cache"][kind].update(vars(entry)))
    with pytest.raises(ArtifactError, match="must be a plain file name"):
        read_manifest(build_copy)
    with pytest.raises(ArtifactError, match="must be a plain file name"):
        verify_file(build_copy, entry)
    checked = run_cli("aot", "check", str(build_copy), check=False)
    one_line_refusal(checked)
    assert secret not in checked.stdout + checked.stderr
    ran = run_cli("runtime", *run_args(build_copy, tiny_weights, tmp_path), check=False)
    assert "must be a plain file name" in one_line_refusal(ran)


@pytest.mark.parametrize("name", ["kv_cache.hlo.txt.gz", "kv_cache.exec", MANIFEST])
def test_symlink_in_a_build_is_refused(build_copy, tmp_path, name):
    """A build file that is a symlink (here to a byte-identical copy outside, so only the
    link itself can be refused)."""
    outside = tmp_path / f"outside-{name}"
    shutil.move(build_copy / name, outside)
    (build_copy / name).symlink_to(outside)
    with pytest.raises(ArtifactError, match="is a symbolic link"):
        verify_files(build_copy, read_manifest(build_copy))
    if name.endswith(".gz"):
        one_line_refusal(run_cli("aot", "check", str(build_copy), check=False))


# ---------------------------------------------------------------------------- HLO


def gzip_bomb(megabytes: int) -> bytes:
    """A gzip file that expands to `megabytes` MB of zeros, made without holding them."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    return b"".join(compressor.compress(chunk) for _ in range(megabytes)) + compressor.flush()


def test_gzip_bomb_hlo_is_refused_within_bounded_memory(build_copy):
    bomb = gzip_bomb(1024)  # ~1 MB expanding to 1 GiB
    replace_file(build_copy, "kv_cache", "hlo", bomb)
    entry = read_manifest(build_copy).programs["kv_cache"].hlo
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactError, match="expands past"):
            read_hlo_text(build_copy, entry)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 30) // 8, peak  # the cap (64x the file), not the bomb's 1 GiB
    one_line_refusal(run_cli("aot", "check", str(build_copy), check=False))


def test_hlo_sha256_is_checked_before_decompressing(build_copy, monkeypatch):
    """A gzip file that is not the one the manifest recorded is never opened by gzip."""
    path = build_copy / "kv_cache.hlo.txt.gz"
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))
    monkeypatch.setattr(zlib, "decompressobj", None)  # any use would raise TypeError
    entry = read_manifest(build_copy).programs["kv_cache"].hlo
    with pytest.raises(ArtifactError, match="fails its sha256 check"):
        read_hlo_text(build_copy, entry)


# ---------------------------------------------------------------------------- one bad build


@pytest.fixture
def mixed_builds(build_copy) -> Path:
    """The tiny build, a build whose manifest is a JSON list, one whose device count is
    hostile, one with a missing program, and a hidden folder that is never a build."""
    artifacts = build_copy.parent
    for name, edit in [
        ("broken_list", lambda path: path.write_text("[]")),
        ("broken_devices", None),
        ("broken_program", None),
        (".hidden", lambda path: path.write_text("not json")),
    ]:
        shutil.copytree(build_copy, artifacts / name)
        if edit is not None:
            edit(artifacts / name / MANIFEST)
    edit_manifest(artifacts / "broken_devices", _set("local_device_count", 100000))
    edit_manifest(artifacts / "broken_program", _drop("programs", "denoise_step"))
    return artifacts


BROKEN = ("broken_devices", "broken_list", "broken_program")


def test_aot_list_shows_good_and_unreadable_builds(mixed_builds, build_copy):
    result = run_cli("aot", "list", str(mixed_builds))
    assert "Traceback" not in result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[2:]}
    assert set(rows) == {build_copy.name, *BROKEN}
    assert "unreadable:" not in rows[build_copy.name] and "tiny" in rows[build_copy.name]
    for name in BROKEN:
        assert "unreadable:" in rows[name]


def test_aot_check_reports_unreadable_builds_and_checks_the_others(mixed_builds, build_copy):
    result = run_cli("aot", "check", str(mixed_builds), "--json", check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    report_json = json.loads(result.stdout)
    builds = {b["build"]: b for b in report_json["builds"]}
    assert set(builds) == {build_copy.name, *BROKEN}
    assert builds[build_copy.name]["ok"] and builds[build_copy.name]["programs"]
    unreadable = {v["build"]: v for v in report_json["violations"]}
    assert set(unreadable) == set(BROKEN)
    assert all(v["rule"] == "unreadable" and "\n" not in v["message"] for v in unreadable.values())
    assert "local_device_count" in unreadable["broken_devices"]["message"]
    # Named itself, a broken build is bad input: one line, exit 2.
    one_line_refusal(run_cli("aot", "check", str(mixed_builds / "broken_list"), check=False))


def test_runtime_run_skips_broken_builds(mixed_builds, tiny_weights, tmp_path, build_copy):
    result = run_cli("runtime", *run_args(mixed_builds, tiny_weights, tmp_path), check=False)
    assert result.returncode == 0, result.stderr
    assert build_copy.name in result.stdout and (tmp_path / "v.mp4").is_file()
    # A request no build serves: the refusal names every build, the broken ones with why.
    matched = Request(VideoShape(128, 64, 9, 1))
    with pytest.raises(ArtifactError) as refused:
        match_build(mixed_builds, matched, "tiny", Present.host_cpu())
    lines = str(refused.value).splitlines()
    assert len(lines) == 1 + 1 + len(BROKEN)
    for name in BROKEN:
        assert any(line.startswith(f"  {name}: unreadable: ") for line in lines), lines
    # The hostile device count never reaches XLA: the build named alone is one line.
    one_line_refusal(
        run_cli(
            "runtime",
            *run_args(mixed_builds / "broken_devices", tiny_weights, tmp_path),
            check=False,
        )  # fmt: skip
    )
