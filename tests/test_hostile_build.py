"""Hostile input to `aot build` and `aot gc`: what they write and delete, and the program store.

Each case asserts the exit status, one `Error:` line without a traceback where it must fail,
and what must not have happened (a user's file removed, a damaged entry reused, a temporary
folder left behind)."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BIN, SMALL, TINY_SHAPE, run_cli, with_its_store
from hypothesis import given, settings
from hypothesis import strategies as st

from aot.building import store
from aot.building.plan import BuildError, check_model_name
from aot.targets import MAX_CPU_DEVICES, Target, TargetError, parse_target
from runtime.builds.artifact import read_manifest, sha256_file, verify_files
from wan.interface import DEFAULT_PIPELINE, PIPELINES

TINY = ["--model", "tiny", *TINY_SHAPE, "--target", "cpu-8"]
OTHER_RES = ["--model", "tiny", "--res", "320x192", "--frames", "9", "--batch", "1",
             "--target", "cpu-8"]  # fmt: skip


def aot(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "aot"), *args], capture_output=True, text=True, timeout=timeout
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *phrases: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def files_under(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else b""
        for p in sorted(root.rglob("*"))
    }


def temporaries_under(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if p.name.startswith((".tmp-", ".old-"))]


@pytest.fixture(scope="module")
def template(tiny_build, tmp_path_factory) -> Path:
    """An artifacts folder with the tiny build (copied by each test that changes it): the
    session's (TINY), with its store entries, not compiled again."""
    out = tmp_path_factory.mktemp("hostile-build") / "artifacts"
    with_its_store(tiny_build, out)
    return out


@pytest.fixture
def artifacts(template, tmp_path) -> Path:
    out = tmp_path / "artifacts"
    shutil.copytree(template, out)
    return out


def the_build(out: Path) -> Path:
    (build,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    return build


# ---------------------------------------------------------------------------------------------
# Never delete what the tool did not make.


def test_a_users_file_in_a_build_folder_is_never_removed(artifacts):
    build = the_build(artifacts)
    (build / "notes.txt").write_text("mine")
    # Up to date: nothing to do, nothing touched.
    result = aot("build", *TINY, "--out", str(artifacts))
    assert result.returncode == 0 and "up to date" in result.stdout
    before = files_under(artifacts)
    forced = aot("build", *TINY, "--out", str(artifacts), "--force")
    assert_one_line_error(forced, "notes.txt", "move it")
    assert (build / "notes.txt").read_text() == "mine"
    assert {k: v for k, v in files_under(artifacts).items() if not k.startswith(".locks")} == {
        k: v for k, v in before.items() if not k.startswith(".locks")
    }
    assert temporaries_under(artifacts) == []


def test_a_build_an_older_aot_made_is_replaced_but_not_a_users_file(artifacts):
    """A build folder whose manifest an older aot wrote (another schema) is still aot's: it is
    rebuilt in place; with a user's file in it, it is refused like any other."""
    build = the_build(artifacts)
    manifest = json.loads((build / "manifest.json").read_text())
    (build / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 2}))
    (build / "notes.txt").write_text("mine")
    assert_one_line_error(aot("build", *TINY, "--out", str(artifacts)), "notes.txt", "move it")
    (build / "notes.txt").unlink()
    result = aot("build", *TINY, "--out", str(artifacts))
    assert result.returncode == 0 and "1 built" in result.stdout, result.stderr
    assert read_manifest(build).schema_version != 2


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_folder_without_a_manifest_is_not_replaced(tmp_path, template, force):
    """A folder with a build's name that aot did not write (no manifest) is refused before
    anything compiles."""
    out = tmp_path / "artifacts"
    mine = out / the_build(template).name
    mine.mkdir(parents=True)
    (mine / "data.bin").write_bytes(b"\0" * 10)
    result = aot("build", *TINY, "--out", str(out), *force)
    assert_one_line_error(result, "not a build", "move it away")
    assert [p.name for p in mine.iterdir()] == ["data.bin"]
    assert not (out / store.STORE).exists()  # refused before anything was compiled


def test_gc_removes_only_program_entries_it_can_identify(artifacts):
    programs = artifacts / store.STORE
    entries = sorted(p for p in programs.iterdir())
    foreign = programs / "my-notes"
    foreign.mkdir()
    (foreign / "x.txt").write_text("mine")
    crafted = programs / ("ab" * 32)  # a program id's name, with a file aot does not write
    crafted.mkdir()
    (crafted / "entry.json").write_text("{}")
    (crafted / "photo.jpg").write_text("mine")
    stray = programs / entries[0].name / "extra.txt"  # a user's file in a real entry
    stray.write_text("mine")
    ours = artifacts / f".tmp-{the_build(artifacts).name}-4242"  # a killed build's leftover
    ours.mkdir()
    (ours / "text_encode.exec").write_bytes(b"partial")
    theirs = artifacts / ".tmp-cache-99"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    shutil.rmtree(the_build(artifacts))

    dry = aot("gc", str(artifacts), "--dry-run")
    assert dry.returncode == 0 and "would remove 4 unreferenced program(s)" in dry.stdout
    result = aot("gc", str(artifacts))
    assert result.returncode == 0, result.stderr
    assert "removed 4 unreferenced program(s)" in result.stdout
    for entry in entries[1:]:
        assert f"removed program {entry.name}" in result.stdout and not entry.exists()
    assert f"removed leftover of a killed build {ours.name}" in result.stdout
    assert not ours.exists()
    for kept in (foreign, crafted, entries[0], theirs):
        assert f"left alone: {kept} (not a program entry)" in result.stdout
    assert (foreign / "x.txt").read_text() == "mine"
    assert (crafted / "photo.jpg").read_text() == "mine"
    assert stray.read_text() == "mine" and (theirs / "keep.txt").read_text() == "mine"


def test_gc_waits_for_a_build_holding_the_store(artifacts):
    """A build holds the store's lock shared from its first store access until its manifest is
    in place; gc takes it exclusive, so it cannot remove what the build is about to link."""
    shutil.rmtree(the_build(artifacts))  # every entry unreferenced now
    entries = sorted((artifacts / store.STORE).iterdir())
    stderr = artifacts.parent / "gc.err"
    with store.building(artifacts), stderr.open("w") as err:
        gc = subprocess.Popen(
            [str(BIN / "aot"), "gc", str(artifacts)], stdout=subprocess.PIPE, stderr=err, text=True
        )
        deadline = time.monotonic() + 60
        while "waiting for the builds in progress" not in stderr.read_text():
            assert gc.poll() is None and time.monotonic() < deadline, stderr.read_text()
            time.sleep(0.1)
        time.sleep(1)
        assert gc.poll() is None
        assert all(entry.exists() for entry in entries)
    out, _ = gc.communicate(timeout=60)
    assert gc.returncode == 0, stderr.read_text()
    assert f"removed {len(entries)} unreferenced" in out
    assert not any(entry.exists() for entry in entries)


def test_gc_racing_a_build_never_breaks_it(artifacts):
    """gc run again and again while a build compiles into the same store: the build completes
    whole, and `aot check` passes it."""
    build = subprocess.Popen(
        [str(BIN / "aot"), "build", *OTHER_RES, "--out", str(artifacts)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    runs = 0
    while build.poll() is None:
        result = aot("gc", str(artifacts))
        assert result.returncode == 0, result.stderr
        runs += 1
    out, err = build.communicate()
    assert build.returncode == 0, err
    assert runs >= 1
    for folder in (p for p in artifacts.iterdir() if not p.name.startswith(".")):
        verify_files(folder, read_manifest(folder))
    check = aot("check", str(artifacts))
    assert check.returncode in (0, 1) and "Traceback" not in check.stderr, check.stderr
    assert temporaries_under(artifacts) == []


# ---------------------------------------------------------------------------------------------
# Store entries are checked every time they are reused.


def _replace(path: Path, data: bytes) -> None:
    """New content in a new file (the build folder's hard link keeps the old one)."""
    path.unlink()
    path.write_bytes(data)


def _damage(entry: Path, how: str) -> None:
    name = next(p.name for p in entry.iterdir() if p.suffix == ".exec")
    exe = entry / name
    data = exe.read_bytes()
    raw = json.loads((entry / store.ENTRY).read_text())
    if how == "sha256":
        _replace(exe, bytes([data[0] ^ 1]) + data[1:])
    elif how == "truncated":
        _replace(exe, data[: len(data) // 2])
    elif how == "symlink":
        (entry.parent / "elsewhere.exec").write_bytes(data)
        exe.unlink()
        exe.symlink_to(entry.parent / "elsewhere.exec")
    elif how == "malformed entry.json":
        (entry / store.ENTRY).write_text('{"name": ')
    elif how == "entry.json a list":
        (entry / store.ENTRY).write_text("[]")
    elif how == "a pickle, entry.json recomputed":  # an older build's format, or a crafted one
        _replace(exe, pickle.dumps(("payload", None, None, [0])))
        raw["executable"].update(sha256=sha256_file(exe), size=exe.stat().st_size)
        (entry / store.ENTRY).write_text(json.dumps(raw))
    elif how == "entry.json naming ../x":
        (entry.parent / "x").write_bytes(data)
        raw["executable"]["path"] = "../x"
        (entry / store.ENTRY).write_text(json.dumps(raw))


def _entry_of(artifacts: Path, program: str) -> Path:
    (entry,) = [p for p in (artifacts / store.STORE).iterdir() if (p / f"{program}.exec").exists()]
    return entry


@pytest.mark.parametrize(
    "damage",
    [
        {
            "text_encode": "sha256",
            "kv_cache": "truncated",
            "latents_handoff": "malformed entry.json",
            "denoise_step": "entry.json naming ../x",
        },
        {
            "text_encode": "symlink",
            "kv_cache": "entry.json a list",
            "latents_handoff": "a pickle, entry.json recomputed",
        },
    ],
)
def test_a_damaged_store_entry_is_compiled_again(artifacts, damage):
    """Each damaged entry is compiled again and replaced, never reported reused; the sound ones
    are reused. (The damages are the programs' quickest to compile: which program holds one is
    not what is tested; the template's build is up to date: the sound ones are reused.)"""
    build = the_build(artifacts)
    entries = {program: _entry_of(artifacts, program) for program in damage}
    for program, how in damage.items():
        _damage(entries[program], how)
        assert not store.has(artifacts, entries[program].name)
    shutil.rmtree(build)
    result = aot("build", *TINY, "--out", str(artifacts))
    assert result.returncode == 0, result.stderr
    for program in PIPELINES[DEFAULT_PIPELINE]:
        if program in damage:
            assert f"{program} stored entry damaged, recompiling" in result.stderr
            assert f"{program} done in" in result.stderr
            assert f"{program} reused" not in result.stderr
            assert store.has(artifacts, entries[program].name)  # replaced by a sound entry
        else:
            assert f"{program} reused" in result.stderr
    verify_files(build, read_manifest(build))
    assert temporaries_under(artifacts) == []


def test_a_store_entry_holding_a_users_file_is_not_replaced(artifacts):
    build = the_build(artifacts)
    entry = _entry_of(artifacts, "kv_cache")
    _replace(entry / "kv_cache.exec", b"damaged")
    (entry / "notes.txt").write_text("mine")
    shutil.rmtree(build)
    result = aot("build", *TINY, "--out", str(artifacts), "--json")
    assert_one_line_error(result, "notes.txt", "move it")
    assert (entry / "notes.txt").read_text() == "mine"
    assert temporaries_under(artifacts) == []


# ---------------------------------------------------------------------------------------------
# Model names, --out, request sizes.


@pytest.mark.parametrize("name", [".hw", "-hw"])
def test_a_model_folder_name_that_cannot_name_a_visible_build_is_refused(tmp_path, name):
    model = tmp_path / name
    model.mkdir()
    out = tmp_path / "out"
    result = aot("build", "--model", str(model), *TINY[2:], "--out", str(out))
    assert_one_line_error(result, "must not start with '.'", "rename the model's folder")
    assert not out.exists()


@pytest.mark.parametrize("name", [".hw", "..", "-x", "", "a\nb", "a/b", "a\\b", "a\0b", "x" * 101])
def test_model_names_refused(name):
    with pytest.raises(BuildError, match="rename the model's folder"):
        check_model_name(name)


def test_model_names_accepted():
    for name in ("tiny", "Wan2.1-T2V-1.3B", "my model", "модель"):
        check_model_name(name)


@pytest.mark.parametrize("under", [False, True])
def test_out_on_or_under_a_file(tmp_path, under):
    file = tmp_path / "file"
    file.write_text("mine")
    out = file / "sub" if under else file
    result = aot("build", *TINY, "--out", str(out))
    assert_one_line_error(result, "is not a folder", "choose another --out")
    assert file.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["file"]


@contextlib.contextmanager
def tmpfs(folder: Path, size: str):
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_read_only_out(tmp_path, template):
    with tmpfs(tmp_path / "ro", "64m") as out:
        shutil.copytree(template, out, dirs_exist_ok=True)
        subprocess.run(["mount", "-o", "remount,ro", str(out)], check=True)
        with pytest.raises(OSError):  # as root os.access says yes: only a real write tells
            (out / "probe").write_text("x")
        before = files_under(out)
        up_to_date = aot("build", *TINY, "--out", str(out))
        assert up_to_date.returncode == 0, up_to_date.stderr
        assert "up to date" in up_to_date.stdout
        other = aot("build", *OTHER_RES, "--out", str(out), "--json")
        assert_one_line_error(other, "Read-only file system")
        assert files_under(out) == before


def test_a_full_disk_leaves_nothing_behind(tmp_path):
    with tmpfs(tmp_path / "full", "300k") as out:
        result = aot("build", *TINY, "--out", str(out), "--json")
        assert_one_line_error(result, "No space left on device")
        assert temporaries_under(out) == []
        assert [p.name for p in out.iterdir() if not p.name.startswith(".")] == []
        # What was compiled before the disk filled stays as whole store entries, reused later.
        for entry in (out / store.STORE).iterdir():
            assert store.has(out, entry.name), entry


@pytest.mark.parametrize(
    ("args", "bound"),
    [
        (["--batch", "1000000"], "batch must be 1-1024"),
        (["--frames", "100001"], "frames must be 1-1025"),
        (["--res", "100000x100000"], "must be 1-8192 pixels"),
        (["--res", "8192x8192", "--frames", "1025"], "over the bound of 16777216"),
        (["--target", "cpu-100000"], f"{MAX_CPU_DEVICES} devices"),
        (["--target", "cpu-1000x1000"], "at most 16 processes"),
        (["--target", "cpu-" + "9" * 5000], "unknown target"),
        (["--mesh", "data=100000000"], "has 100000000 devices but target cpu-8 has 8"),
        (["--vae-vmem", "9" * 5000], "use auto, default or a number of MiB"),
        (["--vae-spatial", "9" * 5000], "use auto or a positive integer"),
    ],
)
def test_request_sizes_are_bounded(tmp_path, args, bound):
    base = dict(zip(TINY[::2], TINY[1::2], strict=True))
    flags = {**base, **dict(zip(args[::2], args[1::2], strict=True))}
    cmd = [x for kv in flags.items() for x in kv]
    start = time.monotonic()
    result = aot("build", *cmd, "--out", str(tmp_path / "out"), timeout=120)
    assert_one_line_error(result, bound)
    assert time.monotonic() - start < 60
    assert not (tmp_path / "out").exists()


@settings(max_examples=150, deadline=None)
@given(st.from_regex(r"cpu-(\d{1,12}x)?\d{1,12}|tpu-v6e:\d{1,7}x\d{1,7}(/\d{1,3}x\d{1,3})?"))
def test_parsed_targets_stay_within_bounds(name):
    try:
        target = parse_target(name)
    except TargetError:
        return
    assert isinstance(target, Target)
    if target.platform == "cpu":
        assert 1 <= target.num_devices <= MAX_CPU_DEVICES


def test_a_jax_compilation_cache_in_the_environment_does_not_break_a_build(tmp_path, tiny_weights):
    """JAX_COMPILATION_CACHE_DIR set (as many users have it): two builds of one request in two
    folders, so the second's compiles would come from the cache; an executable the cache hands
    back serializes without its code, so `aot build` compiles afresh and both builds run."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
    for out in ("a", "b"):
        run_cli("aot", "build", "--model", "tiny", *SMALL, "--batch", "1", "--target", "cpu-8",
                "--out", str(tmp_path / out), env=env)  # fmt: skip
        run_cli("runtime", "run", "--artifacts", str(tmp_path / out), "--weights",
                str(tiny_weights), *SMALL, "--batch", "1",
                "--steps", "1", "--prompt", "x", "--out", str(tmp_path / f"{out}.mp4"), env=env)  # fmt: skip
    assert (tmp_path / "b.mp4").stat().st_size > 0
