"""`aot check`: the policy on real builds, a flipped-sharding program, an over-budget build,
the --json schema, bad input, the check at the end of `aot build`, and the CI portrait case."""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from click.testing import CliRunner
from conftest import TINY_SHAPE, run_cli

from aot import hlo
from aot.building.entries import memory_stats
from aot.cli import cli
from aot.reports.check import KINDS
from aot.targets import TPU_HBM
from runtime.builds.artifact import file_entry, read_manifest
from wan import sharding
from wan.interface import DEFAULT_PIPELINE, PIPELINES

GiB = 1 << 30


def aot_check(*args: str | Path):
    """`aot check` in this process (it needs no devices); stdout and stderr kept apart."""
    return CliRunner().invoke(cli, ["check", *map(str, args)])


def copy_build(build: Path, dest: Path) -> Path:
    shutil.copytree(build, dest)
    return dest


def rewrite_manifest(folder: Path, edit) -> None:
    manifest = read_manifest(folder)
    edit(manifest)
    manifest.write(folder)


def flipped_vae_hlo() -> tuple[str, dict[str, int]]:
    """An activation sharded on width, then on height (an axis chosen per layer),
    compiled on the (1, 8) VAE mesh: the optimized HLO and its memory stats."""
    mesh = sharding.make_mesh(jax.devices()[:8], (("redundant", 1), ("vae_spatial", 8)))

    def decode(x):
        with sharding.axis_rules(sharding.VaeLayout("width").rules()):
            x = sharding.constrain(jnp.tanh(x), sharding.VIDEO)
        with sharding.axis_rules(sharding.VaeLayout("height").rules()):
            return sharding.constrain(2.0 * x, sharding.VIDEO)

    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(decode).lower(jax.ShapeDtypeStruct((1, 2, 16, 16, 4), "float32")).compile()
        )
    return compiled.as_text(), memory_stats(compiled)


@pytest.fixture(scope="module")
def flipped_build(tiny_build, tmp_path_factory) -> Path:
    """The tiny build with its vae_decode HLO replaced by the flipped program (manifest kept
    consistent: file hash, collectives, memory)."""
    folder = copy_build(tiny_build, tmp_path_factory.mktemp("flipped") / "flipped_vae")
    text, memory = flipped_vae_hlo()
    entry_path = folder / "vae_decode.hlo.txt.gz"
    with gzip.open(entry_path, "wt") as f:
        f.write(text)

    def edit(m):
        p = m.programs["vae_decode"]
        p.hlo = file_entry(folder, entry_path.name)
        p.memory = memory
        p.collectives = hlo.collective_summary(hlo.parse(text))

    rewrite_manifest(folder, edit)
    return folder


@pytest.fixture(scope="module")
def over_budget_build(tiny_build, tmp_path_factory) -> Path:
    """The tiny build as if it were for tpu-v6e-8 with a denoise step of 31 GiB per device."""
    folder = copy_build(tiny_build, tmp_path_factory.mktemp("over") / "over_budget")

    def edit(m):
        m.key = dataclasses.replace(m.key, target="tpu-v6e-8")
        m.hbm_bytes = TPU_HBM["v6e"]
        m.programs["denoise_step"].memory["peak"] = 31 * GiB

    rewrite_manifest(folder, edit)
    return folder


def test_own_build_passes(tiny_build, tmp_path):
    result = aot_check(tiny_build)
    assert result.exit_code == 0, result.output
    assert tiny_build.name in result.stdout and "1 build(s) pass (policy: default)" in result.stdout
    # A folder of builds works too; hidden entries (locks, temporaries) are skipped.
    root = tmp_path / "artifacts"
    copy_build(tiny_build, root / tiny_build.name)
    (root / ".locks").mkdir()
    assert aot_check(root).exit_code == 0


def test_flipped_activation_fails_naming_the_all_to_all(flipped_build, tiny_build):
    (a2a,) = [c for c in hlo.collectives(hlo.parse(flipped_vae_hlo()[0])) if c.kind == "all-to-all"]
    result = aot_check(tiny_build, flipped_build)
    assert result.exit_code == 1, result.output
    out = result.stdout
    assert "1 violation(s) in 1 of 2 build(s)" in out
    (row,) = [line for line in out.splitlines() if "forbidden" in line]
    assert row.startswith("flipped_vae ") and "vae_decode" in row and "all-to-all forbidden" in row
    assert f"{a2a.name} (all-to-all)" in row
    assert f"test_check.py:{a2a.source_line}" in row  # where the sharding flips
    assert a2a.op_name in row


def test_memory_rule(over_budget_build, tiny_build, tmp_path):
    result = aot_check(over_budget_build)
    assert result.exit_code == 1
    assert "denoise_step" in result.stdout and "peak 31.00 GiB per device > budget 28.80 GiB" in (
        result.stdout
    )
    # A target's own table replaces the "*" keys.
    relaxed = tmp_path / "relaxed.toml"
    relaxed.write_text(
        '[targets."*"]\nhbm_fraction = 0.9\n[targets."tpu-v6e-8"]\nhbm_fraction = 1.0\n'
    )
    assert aot_check(over_budget_build, "--policy", relaxed).exit_code == 0
    # cpu targets have no HBM: skipped unless an absolute budget is given.
    tight = tmp_path / "tight.toml"
    tight.write_text('[targets."cpu-8"]\nbudget_bytes = 1024\n')
    result = aot_check(tiny_build, "--policy", tight)
    assert result.exit_code == 1
    assert result.stdout.count("> budget 0.00 GiB") == len(PIPELINES[DEFAULT_PIPELINE])


# The --json schema of docs/check.md: a dict names its keys, [x] is a list of x, Map(x) a dict
# of str -> x, a tuple is one of its members, a type is isinstance (bool is not an int).
class Map:
    def __init__(self, value):
        self.value = value


INSTRUCTION = {
    "name": str, "opcode": str, "computation": str, "count": int, "bytes": int, "shape": str,
    "replica_groups": (str, None), "op_name": (str, None), "source_file": (str, None),
    "source_line": (int, None),
}  # fmt: skip
SUMMARY = {"count": int, "bytes": int, "static_count": int, "static_bytes": int}
SCHEMA = {
    "schema_version": (2,),
    "policy": str,
    "ok": bool,
    "builds": [
        {
            "build": str,
            "path": str,
            "target": str,
            "hbm_bytes": (int, None),
            "memory_budget_bytes": (int, None),
            "resident_peak_bytes": int,
            "resident_peak_program": (str, None),
            "placement": (Map(("resident", "transient")), None),
            "ok": bool,
            "programs": Map({"peak_bytes": int, "collectives": Map(SUMMARY)}),
        }  # fmt: skip
    ],
    "violations": [
        {
            "build": str,
            "path": str,
            "program": str,
            "rule": ("forbid", "max_count", "max_bytes", "memory"),
            "kind": (str, None),
            "limit": int,
            "actual": int,
            "message": str,
            "instructions": [INSTRUCTION],
        }  # fmt: skip
    ],
}


def validate(value, schema, where: str = "$") -> None:
    if isinstance(schema, dict):
        assert isinstance(value, dict) and set(value) == set(schema), f"{where}: keys {value}"
        for key, sub in schema.items():
            validate(value[key], sub, f"{where}.{key}")
    elif isinstance(schema, Map):
        assert isinstance(value, dict), where
        for key, sub in value.items():
            assert isinstance(key, str), where
            validate(sub, schema.value, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(value, list), where
        for i, item in enumerate(value):
            validate(item, schema[0], f"{where}[{i}]")
    elif isinstance(schema, tuple):
        for option in schema:
            try:
                validate(value, option, where)
                return
            except AssertionError:
                pass
        raise AssertionError(f"{where}: {value!r} is none of {schema}")
    elif isinstance(schema, type):
        ok = isinstance(value, schema) and (schema is bool or not isinstance(value, bool))
        assert ok, f"{where}: {value!r} is not {schema.__name__}"
    else:
        assert value == schema, f"{where}: {value!r} != {schema!r}"


def test_json_matches_its_schema(tiny_build, flipped_build, over_budget_build):
    result = aot_check(tiny_build, flipped_build, over_budget_build, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    validate(report, SCHEMA)
    assert report["ok"] is False and [b["ok"] for b in report["builds"]] == [True, False, False]
    assert [b["memory_budget_bytes"] for b in report["builds"]] == [
        None, None, int(0.9 * TPU_HBM["v6e"])
    ]  # fmt: skip
    forbid, memory = report["violations"]
    assert (forbid["build"], forbid["rule"], forbid["kind"]) == (
        "flipped_vae",
        "forbid",
        "all-to-all",
    )
    assert forbid["instructions"][0]["source_file"].endswith("test_check.py")
    assert (memory["program"], memory["rule"], memory["actual"]) == (
        "denoise_step",
        "memory",
        31 * GiB,
    )
    for kinds in (p["collectives"] for b in report["builds"] for p in b["programs"].values()):
        assert set(kinds) <= KINDS
    # The validator itself rejects what the schema does not allow.
    broken = json.loads(result.stdout)
    del broken["violations"][0]["instructions"][0]["opcode"]
    with pytest.raises(AssertionError):
        validate(broken, SCHEMA)
    broken = json.loads(result.stdout)
    broken["builds"][0]["ok"] = 1
    with pytest.raises(AssertionError):
        validate(broken, SCHEMA)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("[programs.vae_decode\nforbid = 1", "is not valid TOML"),
        ('[programs.vae_decode]\nforbid = ["all_to_all"]', "unknown collective kind 'all_to_all'"),
        ("[programs.vae]\nforbid = []", "unknown program"),
        ('[programs.kv_cache]\nmax_count = {all-gather = "3"}', "must be a non-negative integer"),
        ('[targets."*"]\nhbm_fraction = 90', "must be a number in (0, 1]"),
        ('[targets."tpu-v9"]\nhbm_fraction = 0.5', "unknown target"),
        ("[memory]\nhbm_fraction = 0.5", "unknown key 'memory'"),
    ],
)
def test_bad_policy_is_one_line_exit_2(tiny_build, tmp_path, policy, message):
    path = tmp_path / "policy.toml"
    path.write_text(policy)
    result = aot_check(tiny_build, "--policy", path)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_bad_input_is_one_line_exit_2(tiny_build, tmp_path):
    result = run_cli("aot", "check", str(tiny_build), "--policy", str(tmp_path / "no.toml"), check=False)  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "no.toml is missing" in result.stderr and "Traceback" not in result.stderr
    (tmp_path / "empty").mkdir()
    for path, message in [
        (tmp_path / "empty", "neither a build folder"),
        (tmp_path / "missing", "does not exist"),
    ]:
        result = aot_check(path)
        assert result.exit_code == 2 and message in result.stderr, result.stderr
    truncated = copy_build(tiny_build, tmp_path / "truncated")
    hlo_file = truncated / "kv_cache.hlo.txt.gz"
    hlo_file.write_bytes(hlo_file.read_bytes()[:100])
    result = aot_check(truncated)
    assert result.exit_code == 2 and "kv_cache.hlo.txt.gz" in result.stderr, result.stderr


def test_build_runs_the_check(tiny_build, tmp_path):
    """The tiny build is up to date, so these only plan, skip and check."""
    args = ["build", "--model", "tiny", *TINY_SHAPE, "--target", "cpu-8", "--out", str(tiny_build.parent)]  # fmt: skip
    clean = run_cli("aot", *args, "--strict")
    assert "warning" not in clean.stderr and "error" not in clean.stderr
    policy = tmp_path / "policy.toml"
    policy.write_text('[programs.vae_decode]\nforbid = ["collective-permute"]\n')
    warned = run_cli("aot", *args, "--policy", str(policy))
    assert f"warning: {tiny_build.name} vae_decode: collective-permute forbidden" in warned.stderr
    strict = run_cli("aot", *args, "--policy", str(policy), "--strict", check=False)
    assert strict.returncode == 1
    assert f"error: {tiny_build.name} vae_decode: collective-permute forbidden" in strict.stderr
    bad = run_cli("aot", *args, "--policy", str(tmp_path / "no.toml"), check=False)
    assert bad.returncode == 2 and "is missing" in bad.stderr and "compiling" not in bad.stderr


# CI: portrait 720x1280's case (latent width 90). Latent width not divisible by the VAE's 8 spatial shards,
# height divisible: the VAE shards height at every level and must never reshard.
def build_and_check(out: Path, res: str, target: str) -> None:
    run_cli("aot", "build", "--model", "tiny", "--res", res, "--frames", "9", "--batch", "1",
            "--target", target, "--vae-spatial", "8", "--out", str(out))  # fmt: skip
    (build,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    assert "_vae1x8h_" in build.name  # the height layout
    result = run_cli("aot", "check", str(out), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_portrait_cpu8(tmp_path):
    build_and_check(tmp_path, "720x1280", "cpu-8")  # latent 90 x 160


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs the tpu extra")
def test_ci_portrait_tpu_v6e_8(tmp_path):
    # 720x1280 takes ~9 min to compile for TPU here; 48x64 (latent 6 x 8) has the same layout
    # and the same VAE program structure (9 frames: temporal upsampling included) in ~25 s.
    build_and_check(tmp_path, "48x64", "tpu-v6e-8")


def test_ulysses_limit_is_the_builds_own(tiny_build, tmp_path):
    """`max_count = {all-to-all = "ulysses"}` reads the manifest: a gather build allows none."""
    strict = tmp_path / "strict.toml"
    strict.write_text('[programs.denoise_step]\nmax_count = {all-to-all = "ulysses"}\n')
    assert aot_check(tiny_build, "--policy", strict).exit_code == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('[programs.denoise_step]\nmax_bytes = {all-to-all = "ulysses"}\n')
    result = aot_check(tiny_build, "--policy", bad)
    assert result.exit_code == 2 and "must be a non-negative integer" in result.output


@pytest.fixture(scope="module")
def ulysses_build(tmp_path_factory) -> Path:
    """A tiny Ulysses build: batch 2 (4 rows with CFG) on data=4, the 2 heads over context=2."""
    out = tmp_path_factory.mktemp("ulysses")
    run_cli("aot", "build", "--model", "tiny", "--res", "64x128", "--frames", "9", "--batch",
            "2", "--target", "cpu-8", "--mesh", "data=4,context=2", "--context-parallel",
            "ulysses", "--out", str(out))  # fmt: skip
    (folder,) = [p for p in out.iterdir() if p.name.endswith("_ulysses")]
    return folder


def with_one_more_all_to_all(build: Path, dest: Path) -> Path:
    """A copy of `build` whose denoise-step HLO has one more all-to-all: the first one
    duplicated under another name beside it, in the layer scan (so once per layer); the
    manifest's size and sha256 of the HLO file rewritten to match."""
    folder = copy_build(build, dest)
    path = folder / "denoise_step.hlo.txt.gz"
    with gzip.open(path, "rt") as f:
        lines = f.read().splitlines(keepends=True)
    (i, line) = next((i, s) for i, s in enumerate(lines) if " all-to-all(" in s)
    lines.insert(i + 1, line.replace("%all-to-all", "%all-to-all.extra", 1))
    with gzip.open(path, "wt") as f:
        f.write("".join(lines))

    def edit(m):
        m.programs["denoise_step"].hlo = file_entry(folder, path.name)

    rewrite_manifest(folder, edit)
    return folder


def test_ulysses_build_passes_with_its_all_to_alls_and_fails_with_one_more(ulysses_build, tmp_path):
    """The default policy allows the denoise step exactly the all-to-alls its Ulysses attention
    needs (q, k, v in and the output back: 4 per layer, 8 for the tiny model's 2 layers). The
    build passes with 8; the same build with one more all-to-all in its layer (2 more runs) and
    the build under a policy allowing 7 both fail."""
    m = read_manifest(ulysses_build)
    assert m.ulysses_all_to_alls == 4 * m.model_config["transformer"]["num_layers"] == 8
    with gzip.open(ulysses_build / "denoise_step.hlo.txt.gz", "rt") as f:
        text = f.read()
    runs = sum(c.count for c in hlo.collectives(hlo.parse(text)) if c.kind == "all-to-all")
    assert runs == 8
    result = aot_check(ulysses_build)
    assert result.exit_code == 0, result.output

    extra = with_one_more_all_to_all(ulysses_build, tmp_path / "extra")
    result = aot_check(extra)
    assert result.exit_code == 1, result.output
    assert "all-to-all: 10 executions per run > max_count 8 (the build's ulysses" in result.stdout

    seven = tmp_path / "seven.toml"
    seven.write_text("[programs.denoise_step]\nmax_count = {all-to-all = 7}\n")
    result = aot_check(ulysses_build, "--policy", seven)
    assert result.exit_code == 1, result.output
    assert "all-to-all: 8 executions per run > max_count 7" in result.stdout
