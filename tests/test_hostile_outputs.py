"""What `runtime run` writes, and the numbers it runs on, under hostile input: outputs appear
whole or not at all (a full disk, SIGINT/SIGTERM, a FIFO or /dev/null as --out, two options
naming one file), and a NaN or Inf anywhere (guidance, shift, --init-noise, the latents mid-run)
is one line and exit 2, never a black video."""

from __future__ import annotations

import errno
import functools
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import imageio_ffmpeg
import numpy as np
import pytest
from conftest import BIN, TINY_SHAPE, run_cli
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from runtime.generation.outputs import OutputError, WriteError, check_outputs, staged, write_videos
from runtime.generation.pipeline import NonFiniteError
from runtime.generation.request import (
    RequestError,
    check_settings,
    checked_noise,
    read_init_noise,
)

LATENTS = (1, 3, 16, 8, 16)  # the tiny build's, channels-last (B, T, h, w, C)
NOISE = (1, 16, 3, 16, 8)  # the same in the diffusers layout (B, C, T, h, w)
RUN = ["--prompt", "a cat", "--steps", "3", "--guidance", "5"]


def _runtime(artifacts, weights, out, *extra):
    return run_cli(
        "runtime", "run", "--artifacts", str(artifacts), "--weights", str(weights), *TINY_SHAPE,
        *RUN, "--out", str(out), *extra, check=False,
    )  # fmt: skip


def _assert_one_line_error(result, *messages):
    """Exit 2, one `Error:` line (after any progress bar) naming `messages`, nothing written."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "wrote" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if not line.startswith("denoising")]
    lines = [line for line in lines if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.stderr
    for message in messages:
        assert message in lines[0], lines[0]


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


# Refused at argument time: the missing --artifacts folder shows nothing else was looked at.


def _same_as_out(tmp_path):
    return ["--report", str(tmp_path / "v.mp4")], "are the same file"


def _hard_link_to_report(tmp_path):
    (tmp_path / "v.mp4").write_text("old")
    os.link(tmp_path / "v.mp4", tmp_path / "r.json")
    return ["--report", str(tmp_path / "r.json")], "are the same file"


def _npy_appended_is_a_folder(tmp_path):
    (tmp_path / "frames.npy").mkdir()
    return ["--save-frames", str(tmp_path / "frames")], "is a folder"


def _frames_equal_to_report(tmp_path):
    return ["--save-frames", str(tmp_path / "x"), "--report", str(tmp_path / "x.npy")], "same file"


def _batch_video_is_the_report(tmp_path):
    return ["--batch", "2", "--report", str(tmp_path / "v_1.mp4")], "are the same file"


def _guidance_nan(tmp_path):
    return ["--guidance", "nan"], "--guidance nan: give a finite number"


def _guidance_inf(tmp_path):
    return ["--guidance", "inf"], "--guidance inf: give a finite number"


def _guidance_2_nan(tmp_path):
    return ["--guidance-2", "nan"], "--guidance-2 nan: give a finite number"


def _shift_nan(tmp_path):
    return ["--shift", "nan"], "--shift nan: give a finite number"


def _shift_inf(tmp_path):
    return ["--shift", "inf"], "--shift inf: give a finite number"


def _guidance_overflows_float32(tmp_path):
    return ["--guidance", "1e308"], "--guidance 1e+308: give a finite number within +-10000"


def _prompt_not_utf8(tmp_path):
    return ["--prompt", "a \udcff cat"], "--prompt is not valid UTF-8 (byte 0xff at character 3)"


def _negative_prompt_not_utf8(tmp_path):
    return ["--negative-prompt", "\udcc3"], "--negative-prompt is not valid UTF-8 (byte 0xc3"


@pytest.mark.parametrize(
    "bad",
    [_same_as_out, _hard_link_to_report, _npy_appended_is_a_folder, _frames_equal_to_report,
     _batch_video_is_the_report, _guidance_nan, _guidance_inf, _guidance_2_nan, _shift_nan,
     _shift_inf, _guidance_overflows_float32, _prompt_not_utf8, _negative_prompt_not_utf8],
)  # fmt: skip
def test_refused_before_anything_loads(tiny_weights, tmp_path, bad):
    extra, message = bad(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    result = _runtime(tmp_path / "no-artifacts", tiny_weights, tmp_path / "v.mp4", *extra)
    _assert_one_line_error(result, message)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    return tmp_path / "fifo", "is not a regular file"


def _socket(tmp_path):
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
    return tmp_path / "sock", "is not a regular file"


def _link_to_dev_null(tmp_path):
    (tmp_path / "link.mp4").symlink_to("/dev/null")
    return tmp_path / "link.mp4", "is not a regular file"


def _link_to_a_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.mp4").symlink_to(tmp_path / "sub")
    return tmp_path / "link.mp4", "is a folder"


def _under_proc(tmp_path):
    """Not writable for any user, root included (which os.access would wave through)."""
    return Path("/proc/v.mp4"), "/proc is not writable"


@pytest.mark.parametrize("option", ["--out", "--report", "--save-frames"])
@pytest.mark.parametrize("bad", [_fifo, _socket, _link_to_dev_null, _link_to_a_folder, _under_proc])
def test_only_regular_files_are_written(tmp_path, option, bad):
    """In process (the CLI calls the same check first): nothing but a regular file or a new path
    is ever replaced, whoever runs it."""
    path, message = bad(tmp_path)
    with pytest.raises(OutputError, match=message):
        check_outputs([(tmp_path / "ok.mp4", "--out"), (path, option)])


def test_dev_null_as_out_is_refused(tiny_weights, tmp_path):
    result = _runtime(tmp_path / "no-artifacts", tiny_weights, "/dev/null")
    _assert_one_line_error(result, "--out /dev/null is not a regular file")
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_staged_outputs_appear_together_or_not_at_all(tmp_path):
    old = tmp_path / "old.mp4"
    old.write_text("the user's video")
    paths = [old, tmp_path / "new" / "deeper" / "r.json"]
    with pytest.raises(OSError, match="disk full"), staged(paths) as temporaries:
        for temporary in temporaries:
            temporary.write_text("half")
        raise OSError("disk full")
    assert _files(tmp_path) == ["old.mp4"] and old.read_text() == "the user's video"
    with staged(paths) as temporaries:
        for temporary in temporaries:
            temporary.write_text("whole")
    assert old.read_text() == "whole" and paths[1].read_text() == "whole"
    assert _files(tmp_path) == ["new", "old.mp4"] and _files(paths[1].parent) == ["r.json"]


def test_write_videos_names_a_failed_file_and_leaves_nothing(tmp_path):
    """write_videos: an extra file's OSError (a full disk) is one WriteError naming it, no file
    is left; written, the MP4s play at the frame rate given."""
    videos = np.zeros((2, 5, 16, 16, 3), np.uint8)
    paths, report = [tmp_path / "a.mp4", tmp_path / "b.mp4"], tmp_path / "r.json"

    def full_disk(path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    with pytest.raises(WriteError, match=f"^cannot write {re.escape(str(report))}: No space left"):
        write_videos(videos, paths, 24, {report: full_disk})
    assert _files(tmp_path) == []
    write_videos(videos, paths, 24, {report: lambda path: path.write_text("{}")})
    assert _files(tmp_path) == ["a.mp4", "b.mp4", "r.json"]
    for path in paths:
        reader = imageio_ffmpeg.read_frames(str(path))
        assert next(reader)["fps"] == 24
        reader.close()


# --init-noise: checked from its header once the build is matched, before the weights load.


def _noise_with_a_nan(path):
    noise = np.zeros(NOISE, np.float32)
    noise[0, 3, 1, 7, 5] = np.nan
    np.save(path, noise)
    return "holds NaN or Inf"


def _noise_of_another_shape(path):
    np.save(path, np.zeros((1, 16, 3, 8, 16), np.float32))
    return "this build needs float (1, 16, 3, 16, 8)"


def _pickled_object_array(path):
    np.save(path, np.array([{"x": 1}, None], dtype=object), allow_pickle=True)
    return "holds object"


def _not_npy(path):
    path.write_bytes(b"\x93NUMPY\x01\x00garbage")
    return "is not a valid .npy array"


def _truncated(path):
    np.save(path, np.zeros(NOISE, np.float32))
    path.write_bytes(path.read_bytes()[:-4])
    return "its length does not match its header"


def _integers(path):
    np.save(path, np.zeros(NOISE, np.int32))
    return "holds int32"


@pytest.mark.parametrize(
    "bad", [_noise_with_a_nan, _noise_of_another_shape, _pickled_object_array, _not_npy, _truncated,
            _integers],
)  # fmt: skip
def test_bad_init_noise_file(bad, tmp_path):
    message = bad(tmp_path / "noise.npy")
    with pytest.raises(RequestError, match=re.escape(message)):
        read_init_noise(tmp_path / "noise.npy", LATENTS)


@pytest.mark.parametrize("bad", [_noise_with_a_nan, _pickled_object_array])
def test_bad_init_noise_run(tiny_build, tiny_weights, tmp_path, bad):
    message = bad(tmp_path / "noise.npy")
    out = tmp_path / "out" / "v.mp4"
    result = _runtime(
        tiny_build.parent, tiny_weights, out, "--init-noise", str(tmp_path / "noise.npy")
    )
    _assert_one_line_error(result, message)
    assert not out.parent.exists()


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mutated_init_noise_is_read_or_refused(tmp_path_factory, data):
    """Random byte edits of a valid noise file: finite float32 noise, or a RequestError."""
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(NOISE, np.float32))
    raw = bytearray(buffer.getvalue()[:200])  # the header and the first values
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("noise") / "n.npy"
    path.write_bytes(bytes(raw[: data.draw(st.integers(0, len(raw)))]) + buffer.getvalue()[200:])
    try:
        noise = read_init_noise(path, LATENTS)
    except RequestError:
        return
    assert noise.dtype == np.float32 and noise.shape == NOISE and np.isfinite(noise).all()


@pytest.mark.parametrize(
    ("settings_", "message"),
    [((math.nan, None, None), "guidance nan: give a finite"), ((5.0, math.inf, None), "guidance_2 inf: give a finite"),
     ((5.0, None, -math.inf), "shift -inf: give a finite"), ((5.0, None, 0.0), "give a number > 0")],
)  # fmt: skip
def test_api_settings_are_checked(settings_, message):
    with pytest.raises(RequestError, match=message):
        check_settings(*settings_)
    with pytest.raises(RequestError, match="holds NaN or Inf"):
        checked_noise(np.full(NOISE, np.inf, np.float32), LATENTS)
    assert issubclass(RequestError, ValueError) and issubclass(NonFiniteError, ValueError)


def test_latents_that_overflow_name_the_step(tiny_build, tiny_weights, tmp_path):
    """Finite weights (one transformer output layer at float32's limit) whose first denoise step
    overflows: exit 2 naming the step, no black video."""
    weights = tmp_path / "weights"
    shutil.copytree(tiny_weights, weights)
    params = weights / "transformer" / "params.safetensors"
    tensors = load_file(params)
    tensors["proj_out/kernel"] = np.full_like(tensors["proj_out/kernel"], 3e38)
    save_file(tensors, params)
    out = tmp_path / "out" / "v.mp4"
    result = _runtime(tiny_build.parent, weights, out, "--report", str(tmp_path / "r.json"))
    _assert_one_line_error(result, "the latents became NaN or Inf at step 1 of 3")
    assert not out.parent.exists() and not (tmp_path / "r.json").exists()


# A full disk: a small tmpfs (root only; skipped where mounting is not permitted).


@pytest.fixture
def small_disk(tmp_path):
    def mount(size):
        folder = tmp_path / f"disk-{size}"
        folder.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    mounted = []
    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize(
    ("size", "fails"),
    [("32k", "v.mp4: ffmpeg exited with"), ("160k", "f.npy: No space left on device")],
    ids=["video-does-not-fit", "frames-do-not-fit"],
)
def test_full_disk(tiny_build, tiny_weights, small_disk, size, fails):
    """The video (~60 kB) or the frames (221 kB) do not fit: one line naming the disk space,
    nothing left on the disk but the user's previous video, unchanged."""
    disk = small_disk(size)
    (disk / "v.mp4").write_text("the previous video")
    result = _runtime(tiny_build.parent, tiny_weights, disk / "v.mp4", "--report",
                      str(disk / "r.json"), "--save-frames", str(disk / "f.npy"))  # fmt: skip
    _assert_one_line_error(result, fails, "No space left on device")
    assert _files(disk) == ["v.mp4"] and (disk / "v.mp4").read_text() == "the previous video"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_writing_leaves_nothing(tiny_build, tiny_weights, tmp_path, sig):
    """Interrupted as soon as the staged outputs appear (while ffmpeg runs): no file left. The
    tiny video's writing takes milliseconds: a signal that lands after it finished finds the
    outputs whole (checked), and the run is tried again until one lands during the writing.
    The run starts with the signal's default disposition and unblocked, as from a shell: in
    the full suite (not alone) its SIGINT runs went on to exit 0, five times of five, and what
    the worker's earlier tests leave to its children is not this test's subject."""
    dispositions = []
    for attempt in range(5):
        out = tmp_path / f"out{attempt}"
        out.mkdir()
        run = subprocess.Popen(
            [str(BIN / "runtime"), "run", "--artifacts", str(tiny_build.parent), "--weights",
             str(tiny_weights), *TINY_SHAPE, *RUN, "--out", str(out / "v.mp4"), "--report",
             str(out / "r.json")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=functools.partial(_as_from_a_shell, sig),
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not any(out.iterdir()) and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert run.poll() is None, "the run ended before its outputs were staged"
        status = Path(f"/proc/{run.pid}/status").read_text()
        dispositions.append(re.findall(r"Sig(?:Blk|Ign|Cgt):\s*\w+", status))
        run.send_signal(sig)
        stdout, stderr = run.communicate(timeout=60)
        if run.returncode == 0:  # too late: the outputs were complete
            assert _files(out) == ["r.json", "v.mp4"] and "wrote" in stdout, stdout
            continue
        assert run.returncode == 1 and "Aborted!" in stderr, stderr  # click's end on Ctrl-C
        assert "wrote" not in stdout and "Traceback" not in stderr
        assert _files(out) == []
        return
    pytest.fail(f"every signal landed after the outputs were written: {dispositions}")


def _as_from_a_shell(sig: int) -> None:
    """In the child before it runs: `sig` at its default disposition and not blocked."""
    signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})


def test_outputs_are_written_whole_into_new_folders(tiny_build, tiny_weights, tmp_path):
    """A valid run: --report and --save-frames under missing folders are made, `X` gets `.npy`,
    an existing --out is replaced, no temporary file remains."""
    (tmp_path / "v.mp4").write_text("the previous video")
    result = _runtime(tiny_build.parent, tiny_weights, tmp_path / "v.mp4", "--report",
                      str(tmp_path / "a" / "r.json"), "--save-frames", str(tmp_path / "b" / "c" / "f"),
                      "--steps", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _files(tmp_path) == ["a", "b", "v.mp4"] and _files(tmp_path / "b" / "c") == ["f.npy"]
    assert (tmp_path / "v.mp4").read_bytes()[4:8] == b"ftyp"
    assert json.loads((tmp_path / "a" / "r.json").read_text())["compile_count"] == 0
    assert np.load(tmp_path / "b" / "c" / "f.npy").shape == (1, 9, 128, 64, 3)
