"""`runtime run --prompts FILE.jsonl`: offline batches filling the build's batch, one load."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SMALL, run_cli
from test_server import decode

from runtime.builds.loader import Request
from runtime.generation.batching import read_prompts_file
from runtime.generation.outputs import write_videos
from runtime.generation.pipeline import Pipeline
from runtime.generation.request import RequestError
from wan.configs import VideoShape

# Mean |difference| (of 255) of two decoded MP4s whose frames differ by at most 1/255 (H.264
# spreads a level's change over its block): the batch-2 and batch-1 videos of one request.
# Measured: 0.00 to 0.46 for the same request, 48 to 51 between two lines.
MP4_OF_ONE_LEVEL = 2.0


def test_five_lines_on_a_batch_two_build_one_load(small_builds, tiny_weights, tmp_path):
    lines = [{"prompt": f"a fox {i}", "seed": i, "out": f"videos/fox_{i}.mp4"} for i in range(5)]
    lines[2]["negative_prompt"] = "blurry"
    del lines[4]["seed"]  # --seed's
    (tmp_path / "p.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n\n")
    result = run_cli("runtime", "run", "--artifacts", str(small_builds), "--weights",
                     str(tiny_weights), *SMALL, "--batch", "2", "--steps", "2", "--seed", "9",
                     "--prompts", str(tmp_path / "p.jsonl"), "--report", str(tmp_path / "r.json"))  # fmt: skip
    assert "wrote 5 videos in 3 batches of 2 with one load (0 compilations" in result.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["loads"] == 1 and report["videos"] == 5 and len(report["batches"]) == 3
    assert all("_b2_" in b["build"] for b in report["batches"])
    assert not list((tmp_path / "videos").glob(".*"))

    # Each line's MP4 is its own request's video: the MP4 of the batch-1 generation of that
    # line (its prompt, negative prompt and seed, --seed's when it has none), through the same
    # writer, and not another line's (two lines of one batch hold different seeds and prompts).
    batch_one = Pipeline.load(small_builds, tiny_weights, Request(VideoShape(64, 96, 5, 1)))
    written = [decode(tmp_path / "videos" / f"fox_{i}.mp4") for i in range(5)]
    expected = []
    for i, line in enumerate(lines):
        frames, _ = batch_one.generate(line["prompt"], line.get("negative_prompt", ""),
                                       steps=2, seed=line.get("seed", 9))  # fmt: skip
        write_videos(frames, [tmp_path / f"expected_{i}.mp4"], fps=batch_one.config.fps)
        expected.append(decode(tmp_path / f"expected_{i}.mp4"))
    for i, video in enumerate(written):
        assert video.shape == (5, 96, 64, 3)
        off = [np.abs(video.astype(int) - e.astype(int)).mean() for e in expected]
        assert off[i] <= MP4_OF_ONE_LEVEL, (i, off)  # batch 2 and 1 round apart by 1/255
        assert min(o for j, o in enumerate(off) if j != i) > 10 * MP4_OF_ONE_LEVEL, (i, off)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a", "out": "a.mp4"}\nnot json', "line 2 is not valid JSON"),
        ('["a"]', "line 1 is not a JSON object"),
        ('{"prompt": "a"}', "line 1: no out"),
        ('{"prompt": "a", "out": "a.mp4", "steps": 3}', "line 1: unknown steps"),
        ('{"prompt": 3, "out": "a.mp4"}', "line 1: prompt is a int, give a str"),
        ('{"prompt": "a", "out": "a.mp4", "seed": -1}', "seed -1"),
        ('{"prompt": "a", "out": "a.mp4", "seed": true}', "seed is a bool"),
        ("\n\n", "give 1 to"),
    ],
)
def test_bad_lines_name_the_line(tmp_path, text, message):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(RequestError, match=message):
        read_prompts_file(path, default_seed=0)


def test_file_lines_resolve_against_the_file(tmp_path):
    path = tmp_path / "sub" / "p.jsonl"
    path.parent.mkdir()
    path.write_text('{"prompt": "a", "out": "a.mp4"}\n{"prompt": "b", "out": "v/b.mp4", "seed": 4}')
    first, second = read_prompts_file(path, default_seed=3)
    folder = path.parent.resolve()
    assert first.out == folder / "a.mp4" and first.video.seed == 3
    assert second.out == folder / "v" / "b.mp4" and second.video.seed == 4


def test_prompts_options_are_one_line_errors(tiny_weights, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a", "out": "a.mp4"}')
    common = [
        "runtime",
        "run",
        "--weights",
        str(tiny_weights),
        *SMALL,
        "--artifacts",
        str(tmp_path),
    ]
    for extra, message in [
        (
            ["--prompt", "a", "--prompts", str(tmp_path / "p.jsonl"), "--out", "v.mp4"],
            "one of them",
        ),
        (["--prompts", str(tmp_path / "p.jsonl"), "--out", "v.mp4"], "leave out --out"),
        (["--prompt", "a"], "--prompt needs --out"),
        (["--prompts", str(tmp_path / "missing.jsonl")], "missing.jsonl is missing"),
    ]:
        result = run_cli(*common, *extra, check=False)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
