"""Files from outside, second round (issue 36): where `runtime run --prompts` may write, the
lines it reads, GPU target configs, `python -m wan.quantize` over its own input, one build's
broken manifest among good ones, and the files read before any bound (tokenizer, policy,
safetensors). Each case is one line (exit 2 at a command line), never a traceback, a hang, a
C++ abort or a replaced input. In process where the refusal comes before anything loads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import TINY_SHAPE

from aot import targets
from aot.cli import cli as aot_cli
from aot.reports import check, report
from aot.targets import gpu
from runtime.builds.artifact import MANIFEST, ArtifactError
from runtime.builds.loader import Present, Request, match_build, read_builds
from runtime.cli import cli as runtime_cli
from runtime.generation.batching import MAX_PROMPTS_BYTES, read_prompts_file
from runtime.generation.request import MAX_SEED, RequestError
from wan import quantize
from wan.configs import VideoShape
from wan.tokenizer import MAX_TOKENIZER_BYTES, TokenizerError, load_tokenizer
from wan.weights import WeightError, safetensors_header


def one_line(result: Result, *phrases: str) -> str:
    """A command's refusal: exit 2, one `Error:` line holding `phrases`, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error:"), (
        result.output
    )
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def sparse(path: Path, size: int) -> Path:
    """A file of `size` zero bytes that takes no disk."""
    with path.open("wb") as f:
        f.truncate(size)
    return path


def digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def no_hang(call: Callable[[], object], seconds: float = 20) -> object:
    """`call()`'s result or exception, failing the test (not hanging it) if it blocks."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as e:  # the refusal under test
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"blocked for {seconds} s"
    return outcome[0]


# ------------------------------------------------------------------ runtime run --prompts


def prompts(folder: Path, *lines: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "out",
    ["/tmp/x.mp4", "../x.mp4", "videos/../../x.mp4", "escape/x.mp4", "", "."],
)
def test_a_line_writes_only_inside_its_folder(tmp_path, out):
    (tmp_path / "outside").mkdir()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "escape").symlink_to(tmp_path / "outside")
    path = prompts(tmp_path / "in", json.dumps({"prompt": "a", "out": out}))
    with pytest.raises(RequestError, match="line 1: out .* give a file path inside") as e:
        read_prompts_file(path, default_seed=0)
    assert "\n" not in str(e.value)


def test_out_dir_takes_the_place_of_the_file_folder(tmp_path):
    path = prompts(tmp_path / "in", '{"prompt": "a", "out": "v/a.mp4"}')
    (line,) = read_prompts_file(path, default_seed=0, out_dir=tmp_path / "videos")
    assert line.out == (tmp_path / "videos" / "v" / "a.mp4").resolve()
    with pytest.raises(RequestError, match=f"is not in {(tmp_path / 'videos').resolve()}"):
        read_prompts_file(
            prompts(tmp_path / "in", '{"prompt": "a", "out": "../a.mp4"}'),
            default_seed=0,
            out_dir=tmp_path / "videos",
        )


@pytest.mark.parametrize(
    ("line", "phrase"),
    [
        (
            '{"prompt": "a", "out": "a.mp4", "seed": 1' + "0" * 5000 + "}",
            "line 1 is not valid JSON",
        ),
        (f'{{"prompt": "a", "out": "a.mp4", "seed": {MAX_SEED + 1}}}', "line 1: seed"),
        ("[" * 100_000 + "]" * 100_000, "line 1 is not valid JSON (nested too deeply)"),
        ('{"prompt": "a", "out": "a\\u0000.mp4"}', "line 1: out holds a control character"),
        ('{"prompt": "a", "out": "a\\n.mp4"}', "line 1: out holds a control character"),
        ('{"prompt": "a", "out": "a\\ud800.mp4"}', "line 1: out is not valid UTF-8"),
    ],
)
def test_hostile_lines_are_one_line(tmp_path, line, phrase):
    path = prompts(tmp_path, line)
    with pytest.raises(RequestError) as e:
        read_prompts_file(path, default_seed=0)
    message = str(e.value)
    assert phrase in message and "\n" not in message and len(message) < 600, message


def test_an_oversized_prompts_file_is_refused_unread(tmp_path):
    path = sparse(tmp_path / "p.jsonl", MAX_PROMPTS_BYTES + 1)
    with pytest.raises(RequestError, match="p.jsonl is over 64 MiB"):
        read_prompts_file(path, default_seed=0)


@pytest.mark.parametrize(
    ("out", "phrase"),
    [
        ("p.jsonl", "is --prompts"),
        ("weights/transformer/params.safetensors", "is inside --weights"),
        ("artifacts/v.mp4", "is inside --artifacts"),
        ("style.safetensors", "is --lora"),
    ],
)
def test_a_line_never_replaces_an_input_of_the_run(tiny_weights, tmp_path, out, phrase):
    """The prompts file, the weights, a LoRA and the artifacts in the lines' folder: a line
    naming any of them is refused before anything loads."""
    folder = tmp_path / "in"
    path = prompts(folder, json.dumps({"prompt": "a", "out": out}))
    weights = shutil.copytree(tiny_weights, folder / "weights")
    (folder / "artifacts").mkdir()
    (folder / "style.safetensors").write_bytes(b"LoRA bytes")
    before = digests(folder)
    result = CliRunner().invoke(
        runtime_cli,
        ["run", "--artifacts", str(folder / "artifacts"), "--weights", str(weights),
         *TINY_SHAPE, "--prompts", str(path), "--lora", str(folder / "style.safetensors")],
    )  # fmt: skip
    one_line(result, phrase, "an input of this run")
    assert digests(folder) == before


@pytest.mark.parametrize(
    ("lines", "phrase"),
    [
        ([{"image": "cat.png", "out": "cat.png"}], "line 1's image"),
        ([{"image": "cat.png", "out": "a.mp4"}, {"image": "dog.png", "out": "cat.png"}],
         "line 1's image"),
        ([{"image": "cat.png", "out": "a.mp4"},
          {"image": "dog.png", "last_image": "end.png", "out": "end.png"}],
         "line 2's last_image"),
    ],
)  # fmt: skip
def test_a_line_never_writes_over_an_image_a_line_reads(tiny_weights, tmp_path, lines, phrase):
    """A line's `out` that is its own image, or another line's image or last image: refused
    before anything loads, the pictures as they were (issue 53)."""
    from PIL import Image

    folder = tmp_path / "in"
    path = prompts(folder, *(json.dumps({"prompt": "a", **line}) for line in lines))
    for name in ("cat.png", "dog.png", "end.png"):
        Image.new("RGB", (64, 128), (200, 30, 30)).save(folder / name)
    (tmp_path / "artifacts").mkdir()
    before = digests(folder)
    result = CliRunner().invoke(
        runtime_cli,
        ["run", "--artifacts", str(tmp_path / "artifacts"), "--weights", str(tiny_weights),
         *TINY_SHAPE, "--prompts", str(path)],
    )  # fmt: skip
    one_line(result, phrase, "an input of this run")
    assert digests(folder) == before


def test_out_dir_is_for_prompts_files(tiny_weights, tmp_path):
    result = CliRunner().invoke(
        runtime_cli,
        [
            "run",
            "--weights",
            str(tiny_weights),
            *TINY_SHAPE,
            "--prompt",
            "a",
            "--out",
            str(tmp_path / "v.mp4"),
            "--out-dir",
            str(tmp_path),
        ],  # fmt: skip
    )
    assert result.exit_code == 2 and "--out-dir is for --prompts" in result.output


# ------------------------------------------------------------------------ GPU target configs


def gpu_config(tmp_path: Path, edit: Callable[[str], str]) -> Path:
    path = tmp_path / "edited.txtpb"
    path.write_text(edit(gpu.shipped_config("h100").text))
    return path


def field(name: str, value: str) -> Callable[[str], str]:
    """The first `name: ...` line of the config set to `value`."""

    def edit(text: str) -> str:
        head, _, tail = text.partition(f"{name}: ")
        return f"{head}{name}: {value}\n{tail.split(chr(10), 1)[1]}"

    return edit


@pytest.mark.parametrize(
    ("edit", "phrase"),
    [
        (field("threads_per_warp", "0"), "threads_per_warp is 0"),  # SIGFPE in XLA
        (field("device_memory_size", "inf"), "device_memory_size is inf"),
        (field("device_memory_size", "1e400"), "device_memory_size is inf"),
        (field("device_memory_size", "-1"), "device_memory_size is -1"),
        (field("device_memory_size", str(1 << 64)), "device_memory_size is 18446744073709551616"),
        (field("clock_rate_ghz", "inf"), "clock_rate_ghz is inf"),
        (field("clock_rate_ghz", "nan"), "clock_rate_ghz is nan"),
        (field("ops_per_clock", "0"), "ops_per_clock is 0"),
        (field("device_description_str", '"' + "H" * 500_000 + '"'), "device_description_str"),
        (field("name", '"a\\nb"'), "gpu_device_info.name"),
        (lambda text: "a {" * 100_000 + text, "nested deeper than"),
    ],
)
def test_gpu_config_fields_are_checked_before_any_compile(tmp_path, edit, phrase):
    path = gpu_config(tmp_path, edit)
    with pytest.raises(targets.TargetError, match="GPU target config|edited.txtpb") as e:
        targets.parse_target(f"gpu:{path}")
    message = str(e.value)
    assert phrase in message and "\n" not in message and len(message) < 600, message


def test_gpu_target_diff_refuses_a_bad_config(tmp_path):
    path = gpu_config(tmp_path, field("device_memory_size", "inf"))
    one_line(
        CliRunner().invoke(aot_cli, ["gpu-target", "diff", "h100", str(path)]),
        "device_memory_size is inf",
    )


def test_gpu_config_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo.txtpb")
    refused = no_hang(lambda: targets.parse_target(f"gpu:{tmp_path / 'fifo.txtpb'}"))
    assert isinstance(refused, targets.TargetError) and "is not a regular file" in str(refused)


def test_shipped_gpu_configs_pass_the_checks():
    for kind in gpu.KINDS:
        assert gpu.shipped_config(kind).hbm_bytes > 0


# --------------------------------------------------------------------------- wan.quantize


@pytest.mark.parametrize("where", ["same", "out inside", "weights inside"])
def test_quantize_never_writes_over_its_weights(tiny_weights, tmp_path, capsys, where):
    if where == "weights inside":
        weights = shutil.copytree(tiny_weights, tmp_path / "out" / "weights")
        out = tmp_path / "out"
    else:
        weights = shutil.copytree(tiny_weights, tmp_path / "weights")
        out = weights if where == "same" else weights / "int8"
    before = digests(tmp_path)
    with pytest.raises(SystemExit) as exited:
        quantize.main(["--weights", str(weights), "--quant", "w8-int8", "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1 and "--out" in lines[0], lines
    assert digests(tmp_path) == before


# ------------------------------------------------------------------ one broken build's entry


def _directory(path: Path) -> None:
    path.mkdir()


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _symlink(path: Path) -> None:
    path.symlink_to(path.parent.parent / "good" / MANIFEST)


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere.json")


@pytest.mark.parametrize("make", [_directory, _fifo, _symlink, _dangling])
def test_one_broken_manifest_is_its_build_row(tiny_build, tmp_path, make):
    artifacts = tmp_path / "artifacts"
    shutil.copytree(tiny_build, artifacts / "good", copy_function=os.link)
    (artifacts / "broken").mkdir()
    make(artifacts / "broken" / MANIFEST)

    found = dict(no_hang(lambda: read_builds(artifacts)))
    assert not isinstance(found[artifacts / "good"], ArtifactError)
    assert isinstance(found[artifacts / "broken"], ArtifactError)
    rows = report.list_table(artifacts).splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["broken", "good"]
    assert "unreadable: " in rows[0] and "unreadable" not in rows[1]
    checked = {r.folder.name: r for r in check.check_paths([artifacts], check.load_policy())}
    assert [v.rule for v in checked["broken"].violations] == ["unreadable"]
    assert checked["good"].programs
    # runtime run: the good build serves; a request no build serves names the broken one.
    shape = VideoShape(64, 128, 9, 1, True)
    assert match_build(artifacts, Request(shape), "tiny", Present.host_cpu())[0].name == "good"
    with pytest.raises(ArtifactError, match="  broken: unreadable: .*manifest.json"):
        match_build(artifacts, Request(VideoShape(128, 64, 9, 1)), "tiny", Present.host_cpu())


# ------------------------------------------------------------- files read before any bound


def test_an_oversized_tokenizer_json_is_refused_unread(tiny_weights, tmp_path):
    folder = shutil.copytree(tiny_weights / "tokenizer", tmp_path / "tokenizer")
    sparse(folder / "tokenizer.json", MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(TokenizerError, match="tokenizer.json is over 64 MiB") as e:
        load_tokenizer(folder)
    assert "\n" not in str(e.value)


def test_an_oversized_sentencepiece_model_is_refused_unread(tmp_path):
    sparse(tmp_path / "spiece.model", MAX_TOKENIZER_BYTES + 1)
    with pytest.raises(TokenizerError, match="spiece.model is over 64 MiB"):
        load_tokenizer(tmp_path)


def test_a_fifo_policy_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "policy.toml")
    refused = no_hang(lambda: check.load_policy(tmp_path / "policy.toml"))
    assert isinstance(refused, check.CheckInputError) and "not a regular file" in str(refused)


def test_a_deeply_nested_policy_is_one_line(tmp_path):
    (tmp_path / "policy.toml").write_text("a = " + "[" * 100_000)
    with pytest.raises(check.CheckInputError, match="is not valid TOML"):
        check.load_policy(tmp_path / "policy.toml")


def test_a_fifo_safetensors_file_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "params.safetensors")
    refused = no_hang(lambda: safetensors_header(tmp_path / "params.safetensors"))
    assert isinstance(refused, WeightError) and "not a regular file" in str(refused)
