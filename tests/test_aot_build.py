"""`aot build`: the program matrix, artifacts and manifest, skip/force, atomicity, errors, FLOPs."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import math
import shlex
import shutil
import signal
import subprocess

import jax
import numpy as np
import pytest
from conftest import (
    BIN,
    TINY_SHAPE,
    compile_program,
    run_cli,
    save_tiny_diffusers_pipeline,
    with_its_store,
)

from aot import hlo
from aot.building import store
from aot.building.entries import replicated_param_bytes
from aot.building.lower import lower_plan
from aot.building.plan import BuildError, compiler_options, plan_build
from aot.hlo import cost as hlo_cost
from aot.targets import FAST_COMPILE_VAE_VMEM_MIB, parse_target
from runtime.builds.artifact import (
    SCHEMA_VERSION,
    BuildKey,
    read_manifest,
    sha256_file,
    verify_files,
)
from runtime.builds.loader import open_build
from wan import interface, programs, sharding
from wan.configs import VideoShape
from wan.presets import PRESETS

PROGRAMS = interface.PIPELINES[interface.DEFAULT_PIPELINE]  # what a default build holds


def _statuses(stdout: str) -> dict[str, list[str]]:
    """Program name -> its status in each build of an `aot build --json` report."""
    out: dict[str, list[str]] = {}
    for build in json.loads(stdout):
        for name, status in build["programs"].items():
            out.setdefault(name, []).append(status)
    return {name: sorted(s) for name, s in out.items()}


def _progress_statuses(stderr: str) -> dict[str, list[int]]:
    """Program name -> [its compiles ("done in"), builds that report it compiled by a worker,
    builds that report it reused], from `aot build --jobs`'s progress lines on stderr."""
    return {
        name: [
            stderr.count(f" {name} {how}") for how in ("done in", "compiled by a worker", "reused")
        ]
        for name in PROGRAMS
    }


def test_matrix_compiles_each_program_once_in_workers_then_skips(tmp_path):
    """A 2 x 2 matrix with --jobs 2: its 16 distinct programs (text_encode and kv_cache depend
    on the batch only) compiled once each, by two worker processes, each reported compiled by
    one build and reused by the others; a second run compiles nothing; --force recompiles each
    program once per call, not once per build that has it; a two-expert model of the same
    shapes into the same folder reuses every program (its experts share the tiny architecture).
    One matrix for all of it (the workers' first compile is the cold one, --force the one
    after); --force on its batch-1 half, whose two builds share text_encode and kv_cache."""
    shapes = ["--res", "64x128", "--res", "128x64", "--frames", "9", "--batch", "1"]
    target = ["--target", "cpu-8", "--out", str(tmp_path)]
    matrix = [*shapes, "--batch", "2", *target]
    first = run_cli("aot", "build", "--model", "tiny", *matrix, "--jobs", "2")
    builds = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert len(builds) == 4, builds
    assert {b.split("_")[1] for b in builds} == {"64x128", "128x64"}
    assert "4 built" in first.stdout
    # Live progress lines per program, n/N and the elapsed time.
    assert (
        f"[{len(PROGRAMS)}/{len(PROGRAMS)}]" in first.stderr
        and "vae_decode done in" in first.stderr
    )
    shared = {"text_encode": [2, 2, 2], "kv_cache": [2, 2, 2]}  # one per batch, both resolutions
    assert _progress_statuses(first.stderr) == {name: [4, 4, 0] for name in PROGRAMS} | shared
    assert len(list((tmp_path / ".programs").glob("[!.]*"))) == 16
    for build in builds:
        verify_files(tmp_path / build, read_manifest(tmp_path / build))
    second = run_cli("aot", "build", "--model", "tiny", *matrix)
    assert "nothing to compile: all 4 builds are up to date" in second.stdout
    assert "compiling" not in second.stderr
    listing = run_cli("aot", "list", str(tmp_path)).stdout
    assert all(b in listing for b in builds)
    # Every build folder holds each of its files, a hard link to the store's.
    assert all((tmp_path / b / "text_encode.exec").stat().st_nlink >= 2 for b in builds)
    manifests = [read_manifest(tmp_path / b) for b in builds]
    encoders = {m.programs["text_encode"].executable.sha256 for m in manifests}
    assert len(encoders) == 2
    forced = run_cli("aot", "build", "--model", "tiny", *shapes, *target, "--force", "--json")
    assert _statuses(forced.stdout) == {
        "text_encode": ["compiled", "reused"],
        "kv_cache": ["compiled", "reused"],
        "denoise_step": ["compiled", "compiled"],
        "latents_handoff": ["compiled", "compiled"],
        "vae_decode": ["compiled", "compiled"],
    }
    two_experts = tmp_path / "pipeline-a"
    save_tiny_diffusers_pipeline(two_experts, two_experts=True)
    other = run_cli("aot", "build", "--model", str(two_experts), *matrix, "--json")
    assert _statuses(other.stdout) == {name: ["reused"] * 4 for name in PROGRAMS}
    for build in json.loads(other.stdout):
        assert set(read_manifest(build["folder"]).programs) == set(PROGRAMS)
    assert "removed 0 unreferenced" in run_cli("aot", "gc", str(tmp_path)).stdout


def test_default_jobs_follow_cores_and_memory(monkeypatch):
    from aot.building import jobs

    for cores, free_gib, expected in [(2, 24, 1), (16, 128, 8), (16, 20, 3), (64, 4, 1), (1, 1, 1)]:
        monkeypatch.setattr(jobs.os, "sched_getaffinity", lambda _, n=cores: set(range(n)))
        monkeypatch.setattr(jobs, "_available_memory", lambda g=free_gib: g << 30)
        assert jobs.default_jobs() == expected, (cores, free_gib)


def test_gc_removes_programs_no_build_references(tiny_build, tmp_path):
    build = with_its_store(tiny_build, tmp_path)  # the session's build: not compiled again
    stored = sorted((tmp_path / ".programs").iterdir())
    assert len(stored) == len(PROGRAMS)
    shutil.rmtree(build)
    dry = run_cli("aot", "gc", str(tmp_path), "--dry-run").stdout
    assert f"would remove {len(PROGRAMS)} unreferenced" in dry
    assert all(p.exists() for p in stored)
    assert f"removed {len(PROGRAMS)} unreferenced" in run_cli("aot", "gc", str(tmp_path)).stdout
    assert list((tmp_path / ".programs").iterdir()) == []


def test_manifest_and_files(tiny_build):
    m = read_manifest(tiny_build)
    raw = json.loads((tiny_build / "manifest.json").read_text())
    assert raw["schema_version"] == SCHEMA_VERSION
    assert m.key.folder_name() == tiny_build.name
    assert m.model_hash == PRESETS["tiny"].hash()
    assert m.versions["jax"] == jax.__version__ and "jaxlib" in m.versions
    assert m.platform == "cpu" and sorted(m.device_ids) == list(range(8))
    assert (
        m.mesh_axes["data"] * m.mesh_axes["fsdp"] * m.mesh_axes["context"] * m.mesh_axes["tensor"]
        == 8
    )
    assert set(m.programs) == set(PROGRAMS)
    for p in m.programs.values():
        for entry in (p.executable, p.hlo):
            path = tiny_build / entry.path
            assert path.stat().st_size == entry.size and sha256_file(path) == entry.sha256
        with gzip.open(tiny_build / p.hlo.path, "rt") as f:
            assert f.read().startswith("HloModule")
        assert p.memory["peak"] > 0 and p.flops > 0 and p.compile_seconds > 0
        assert p.inputs and p.outputs and all(a.dtype and a.sharding for a in p.inputs)
        assert p.peak_rss_bytes > 0
    # Inputs and outputs by name, each array under its input's name; the denoise step's
    # scheduler row and state are inputs, not constants.
    for name, p in m.programs.items():
        assert (tuple(p.input_names), tuple(p.output_names)) == (
            interface.SIGNATURES[name].inputs,
            interface.SIGNATURES[name].outputs,
        )
        assert {a.path.split("/")[0] for a in p.inputs} == set(p.input_names)
        assert {a.path.split("/")[0] for a in p.outputs} == set(p.output_names)
    paths = [a.path for a in m.programs["denoise_step"].inputs]
    assert "row/timestep" in paths and "state/x0_history" in paths and "guidance" in paths
    report = run_cli("aot", "inspect", str(tiny_build)).stdout
    assert "denoise_step" in report and "peak GiB" in report


def build_killed_when(args: list[str], line_ends: str) -> list[str]:
    """Run `aot build ARGS`, read its progress lines on stderr as they come and SIGKILL it when
    one ends with `line_ends`; the lines read until then."""
    cmd = [str(BIN / "aot"), *args]
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as p:
        seen = []
        for line in p.stderr:
            seen.append(line.rstrip("\n"))
            if seen[-1].endswith(line_ends):
                p.kill()
                break
        assert p.wait(timeout=600) == -signal.SIGKILL, seen
    return seen


def test_killed_build_leaves_nothing_complete_and_is_redone(tmp_path):
    """A build SIGKILLed when its denoise step starts compiling (the first line after the
    programs before it are stored: text_encode and kv_cache) leaves no build folder, only
    hidden entries; the store keeps the finished programs, which the build run again reuses."""
    args = ["build", "--model", "tiny", *TINY_SHAPE, "--target", "cpu-8", "--out", str(tmp_path)]
    plan = plan_build("tiny", PRESETS["tiny"], VideoShape(64, 128, 9, 1), parse_target("cpu-8"), 8)
    folder = plan.key.folder_name()
    seen = build_killed_when(args, f"] {folder} denoise_step compiling")
    done = {line.split()[2] for line in seen if line.split()[3:5] == ["done", "in"]}
    assert {"text_encode", "kv_cache"} <= done and "denoise_step" not in done, seen
    assert not any((p / "manifest.json").exists() for p in tmp_path.iterdir())
    assert all(p.name.startswith(".") for p in tmp_path.iterdir())
    stored = [e for e in (tmp_path / ".programs").iterdir() if (e / "entry.json").exists()]
    assert {f.stem for e in stored for f in e.glob("*.exec")} == done
    statuses = _statuses(run_cli("aot", *args, "--json").stdout)
    assert statuses == {n: ["reused" if n in done else "compiled"] for n in statuses}
    assert statuses["denoise_step"] == ["compiled"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []
    (build,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert set(read_manifest(build).programs) == set(PROGRAMS)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--res", "200x320"], "multiples of 16"),
        (["--frames", "10"], "4k+1"),
        (["--mesh", "data=8"], "not divisible by data = 8"),
        (["--mesh", "data=2,context=2"], "has 4 devices but target cpu-8 has 8"),
        (["--target", "tpu-v9-8"], "unknown target"),
        (["--model", "wan3"], "unknown model"),
        (["--vae-spatial", "3"], "must divide the device count"),
        (["--vae-spatial", "x"], "use auto or a positive integer"),
        (["--vae-vmem", "8"], "scoped VMEM is a TPU compiler setting"),
        (["--vae-vmem", "x"], "use auto, default or a number of MiB"),
        (["--jobs", "0"], "--jobs 0: use a positive number"),
        (["--jobs", "2", "--target", "cpu-2x4"], "compiles in one multi-process job"),
        (["--res", "200x320", "--target", "cpu-2x4"], "multiples of 16"),  # error in a job
    ],
)
def test_bad_requests_are_one_line_errors(tmp_path, args, message):
    base = {
        "--model": "tiny",
        "--res": "64x128",
        "--frames": "9",
        "--batch": "1",
        "--target": "cpu-8",
    }
    flags = dict(zip(args[::2], args[1::2], strict=True))
    cmd = [x for k, v in {**base, **flags}.items() for x in (k, v)]
    result = run_cli("aot", "build", *cmd, "--out", str(tmp_path), check=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_program_the_target_cannot_fit_is_a_one_line_error(tmp_path):
    """Splash blocks over v5e's 16 MiB of scoped VMEM: XLA's refusal is one line that names
    the program, what overflowed and what to change; no build folder appears. Compiled here
    (--jobs 1), then by a worker process (--jobs 2) into the same folder: its store keeps the
    programs the first compiled before the step (text_encode, kv_cache), so the workers compile
    only the step and what follows it."""
    # 13 frames (4 latent: 9216 tokens) overflow it (21 MiB); 9 frames would not. Fewer frames
    # than 17 make the workers' VAE decode, compiled beside the failing step, cheaper.
    for jobs in ("1", "2"):
        result = run_cli("aot", "build", "--model", "tiny", "--res", "768x768", "--frames", "13",
                         "--batch", "1", "--target", "tpu-v5e-8", "--attention",
                         "splash:3072:2048:1024", "--out", str(tmp_path), "--json", "--jobs", jobs,
                         check=False)  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "denoise_step does not compile for this target" in result.stderr
        assert "Scoped allocation with size" in result.stderr and "--attention" in result.stderr
        assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]


def test_compile_failures_read_as_one_line():
    from aot.building.lower import compile_failure

    shape, options = VideoShape(64, 96, 9, 1), programs.ProgramOptions()
    decode = programs.vae_decode_program(PRESETS["tiny"], shape, options)
    text_encode = programs.text_encode_program(PRESETS["tiny"], shape, options)

    v4 = (
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
        "vmem. Used 36.69M of 16.00M vmem. Exceeded vmem capacity by 20.69M.\n\nProgram vmem..."
    )
    hint = (
        "; try another --vae-vmem: larger where one allocation is over its limit, smaller where "
        "the VMEM as a whole is"
    )
    assert compile_failure(decode, v4) == (
        "vae_decode does not compile for this target (RESOURCE_EXHAUSTED: Used 36.69M of 16.00M "
        "vmem)" + hint
    )
    # TI2V-5B's decode at 1280x704 on v5e at the default 4 MiB: one allocation over the limit.
    v5e = "RESOURCE_EXHAUSTED: Scoped allocation with size 4.71M and limit 4.00M exceeded."
    assert compile_failure(decode, v5e) == (
        "vae_decode does not compile for this target (RESOURCE_EXHAUSTED: Scoped allocation with "
        "size 4.71M and limit 4.00M)" + hint
    )
    other = compile_failure(text_encode, "INTERNAL: something else\nmore")
    assert other == "text_encode does not compile for this target (INTERNAL: something else)"


def test_unreadable_model_folder(tmp_path):
    (tmp_path / "model").mkdir()
    result = run_cli("aot", "build", "--model", str(tmp_path / "model"), *TINY_SHAPE,
                     "--target", "cpu-8", "--out", str(tmp_path / "out"), check=False)  # fmt: skip
    assert result.returncode == 2 and "config.json is missing" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_tpu_extra_is_reported(monkeypatch):
    from aot import targets

    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(targets.TargetError, match=r"install the tpu extra"):
        targets.devices(parse_target("tpu-v6e-8"))


def test_scanned_flops_equal_unrolled(monkeypatch):
    """XLA counts a scan body once; the report applies trip counts: the scanned denoise step's
    FLOPs equal XLA's count for the same program with every scan unrolled (within 1%)."""
    config = PRESETS["tiny"]
    plan = plan_build("tiny", config, VideoShape(64, 96, 9, 1), parse_target("cpu-8"), 8)
    mesh = sharding.make_mesh(jax.devices()[:8], plan.mesh.items())
    step = programs.denoise_step_program(config, plan.shape, programs.ProgramOptions())
    scanned = compile_program(step, mesh, sharding.TRANSFORMER_RULES)
    monkeypatch.setattr(jax.lax, "scan", functools.partial(jax.lax.scan, unroll=True))
    step = programs.denoise_step_program(config, plan.shape, programs.ProgramOptions())
    unrolled = compile_program(step, mesh, sharding.TRANSFORMER_RULES)
    assert "while" not in unrolled.as_text()
    ours = hlo_cost.flops(hlo.parse(scanned.as_text()))
    xla_unrolled = unrolled.cost_analysis()["flops"]
    xla_scanned = scanned.cost_analysis()["flops"]
    assert abs(ours - xla_unrolled) <= 0.01 * xla_unrolled, (ours, xla_unrolled)
    assert xla_scanned < 0.8 * xla_unrolled  # the correction matters


@pytest.mark.parametrize(
    "target, requested, chosen",
    [
        ("cpu-8", None, "blockwise"),  # 720p tokens on CPU
        ("tpu-v6e-8", None, "flash:3072:2048:512"),
        ("tpu7x-8", None, "flash:2048:2048:512"),
        ("tpu-v5e-8", "splash", "splash:2048:1024:256"),
        ("tpu-v6e-8", "splash:1024:1024:512", "splash:1024:1024:512"),
    ],
)
def test_attention_auto_choice(target, requested, chosen):
    from aot.building.plan import choose_attention

    assert choose_attention(requested, parse_target(target), tokens=75600) == chosen
    assert choose_attention(None, parse_target(target), tokens=4096) == "dot"


def test_attention_the_target_cannot_run_is_refused():
    shape = VideoShape(64, 96, 9, 1)
    cpu8 = parse_target("cpu-8")
    for impl, message in [("splash", "splash runs on tpu targets"), ("cudnn", "runs on gpu")]:
        with pytest.raises(BuildError, match=message):
            plan_build("tiny", PRESETS["tiny"], shape, cpu8, 8, attention=impl)
    with pytest.raises(BuildError, match="multiples of 128"):
        plan_build(
            "tiny",
            PRESETS["tiny"],
            shape,
            parse_target("tpu-v6e-8"),
            8,
            attention="splash:100:128:128",
        )
    # 2 heads over context=4: Ulysses cannot split them; auto gathers.
    mesh = sharding.MeshShape(data=2, context=4)
    plan = plan_build("tiny", PRESETS["tiny"], shape, cpu8, 8, mesh=mesh)
    assert plan.key.context_parallel == "gather"
    with pytest.raises(BuildError, match="2 heads per device do not divide over 4 sequence shards"):
        plan_build("tiny", PRESETS["tiny"], shape, cpu8, 8, mesh=mesh, context_parallel="ulysses")


def test_vae_vmem_is_part_of_the_build_and_the_program():
    """On TPU the VAE decode compiles for the compiler's scoped VMEM unless told otherwise (it
    runs fastest there); a given size names the build folder and is an option of that program
    only."""
    shape, v6e = VideoShape(64, 96, 9, 1), parse_target("tpu-v6e-8")
    made = {
        p.name: p
        for p in programs.programs(PRESETS["tiny"], shape, programs.ProgramOptions(), PROGRAMS)
    }
    for auto in (None, 0):  # auto, default
        plan = plan_build("tiny", PRESETS["tiny"], shape, v6e, 8, vae_vmem_mib=auto)
        assert plan.key.vae_vmem_mib is None and "vmem" not in plan.key.folder_name()
        assert all(compiler_options(plan, made[n]) == {} for n in PROGRAMS)
    fast = FAST_COMPILE_VAE_VMEM_MIB
    plan = plan_build("tiny", PRESETS["tiny"], shape, v6e, 8, vae_vmem_mib=fast)
    assert plan.key.folder_name().endswith(f"_vmem{fast}")
    assert compiler_options(plan, made["vae_decode"]) == {
        "xla_tpu_scoped_vmem_limit_kib": fast * 1024
    }
    assert all(compiler_options(plan, made[n]) == {} for n in PROGRAMS if n != "vae_decode")
    with pytest.raises(BuildError, match="use 1-128 MiB"):
        plan_build("tiny", PRESETS["tiny"], shape, v6e, 8, vae_vmem_mib=512)
    cpu = plan_build("tiny", PRESETS["tiny"], shape, parse_target("cpu-8"), 8)
    assert cpu.key.vae_vmem_mib is None and compiler_options(cpu, made["vae_decode"]) == {}


def test_compiler_options_are_part_of_a_programs_identity():
    """The store tells programs apart by their compile options too: the same lowered module
    compiled with another scoped VMEM is another program."""
    plan = plan_build("tiny", PRESETS["tiny"], VideoShape(64, 96, 9, 1), parse_target("cpu-8"), 8)
    (lowered,) = lower_plan(plan, only={"vae_decode"})
    smaller = dataclasses.replace(lowered, options={"xla_tpu_scoped_vmem_limit_kib": 4096})
    ids = {store.program_id(p, "fingerprint") for p in (lowered, smaller)}
    assert len(ids) == 2
    assert store.program_id(dataclasses.replace(smaller), "fingerprint") in ids


def test_replicated_weights_are_reported(tiny_build):
    """cpu-8 has no HBM figure, so the default mesh leaves every weight whole on each device
    (fsdp 1): each program's replicated bytes are all its weights (none for the handoff, which
    takes none). A mesh with fsdp 8 shards
    the transformer's matrices and leaves only what does not divide (biases, norms, tables)."""
    for name, p in read_manifest(tiny_build).programs.items():
        weights = [a for a in p.inputs if a.path.split("/")[0] == "params"]
        total = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in weights)
        assert p.replicated_param_bytes == total and (total > 0) == (name != "latents_handoff")
    shape, cpu8 = VideoShape(64, 96, 9, 1), parse_target("cpu-8")
    plan = plan_build("tiny", PRESETS["tiny"], shape, cpu8, 8, mesh=sharding.MeshShape(fsdp=8))
    (lowered,) = lower_plan(plan, only={"denoise_step"})
    compiled = lowered.compile()
    replicated = replicated_param_bytes("denoise_step", compiled)
    weights = interface.named("denoise_step", compiled.args_info[0])["params"]
    total = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(weights))
    assert 0 < replicated < 0.5 * total, (replicated, total)


@pytest.fixture(scope="module")
def xla_memory(tiny_build) -> dict:
    """XLA's own memory analysis of the tiny build's programs: of its executables themselves,
    loaded in this process as the runtime loads them (the very programs the manifest describes,
    not compiled again)."""
    opened = open_build(tiny_build, read_manifest(tiny_build), jax.devices())
    return {name: c.memory_analysis() for name, c in opened.load().items()}


def test_peak_bounds_xlas_own_peak(tiny_build, xla_memory):
    """The manifest's peak per device (what `aot check` holds against the HBM budget) is an
    upper bound of XLA's own peak from its buffer assignment (`peak_memory_in_bytes`, which
    the build does not read), above it by at most the temporaries: when a program ends, its
    arguments and outputs (less the donated ones, counted once) are all live."""
    for name, p in read_manifest(tiny_build).programs.items():
        xla = xla_memory[name]
        assert p.memory["argument"] == xla.argument_size_in_bytes, name
        live_at_end = xla.argument_size_in_bytes + xla.output_size_in_bytes
        live_at_end -= xla.alias_size_in_bytes
        assert live_at_end <= xla.peak_memory_in_bytes <= p.memory["peak"], name
        assert p.memory["peak"] - p.memory["temp"] <= xla.peak_memory_in_bytes, name


def test_denoise_step_holds_one_copy_of_latents_and_state(tiny_build, xla_memory):
    """Latents and sampler state are donated: their outputs reuse the inputs' buffers (the
    aliased bytes are their sizes), so XLA's own peak counts them once: below the arguments
    and outputs held apart."""
    step = read_manifest(tiny_build).programs["denoise_step"]
    donated = sum(
        math.prod(a.shape) * np.dtype(a.dtype).itemsize
        for a in step.inputs
        if a.path.split("/")[0] in ("latents", "state")
    )  # batch 1: latents and state whole on every device
    xla = xla_memory["denoise_step"]
    assert step.memory["alias"] == xla.alias_size_in_bytes == donated > 0
    held_apart = xla.argument_size_in_bytes + xla.output_size_in_bytes + xla.temp_size_in_bytes
    assert xla.peak_memory_in_bytes <= held_apart - donated


def test_plan_fans_out_and_concurrent_builds_compile_each_program_once(tmp_path):
    """`aot plan --json` names each build of a matrix and the command that makes just it. That
    command and the whole matrix, run at the same time into one folder, both succeed, every
    build is complete, and no program is compiled twice."""
    matrix = ["--model", "tiny", "--res", "64x128", "--res", "128x64", "--frames", "9",
              "--batch", "1", "--target", "cpu-8", "--out", str(tmp_path)]  # fmt: skip
    plan = json.loads(run_cli("aot", "plan", *matrix, "--json").stdout)
    assert [e["folder"] for e in plan] == [BuildKey.from_json(e["key"]).folder_name() for e in plan]
    assert len({e["folder"] for e in plan}) == 2 and not any(tmp_path.iterdir())
    one = shlex.split(plan[1]["command"])
    assert one[:2] == ["aot", "build"]
    procs = [
        subprocess.Popen(
            [str(BIN / "aot"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )  # fmt: skip
        for args in (["build", *matrix], one[1:])
    ]
    outputs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    compiled = sum(err.count(" done in ") for _, err in outputs)
    # text_encode and kv_cache once (one batch), the others per resolution
    assert compiled == 8, outputs
    builds = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert builds == sorted(e["folder"] for e in plan)
    for build in builds:
        manifest = read_manifest(tmp_path / build)
        verify_files(tmp_path / build, manifest)
