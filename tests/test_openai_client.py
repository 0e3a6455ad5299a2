"""`runtime serve` driven by the official `openai` SDK, unchanged: a real server in its own
process (the tiny serving builds of tests/test_server.py) with API keys, the SDK's own calls and
helpers (multipart create, create_and_poll, poll, retrieve, download_content of the MP4 and its
previews, auto-paging list, delete) and its typed exceptions; one JSON request with curl."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess

import httpx
import numpy as np
import openai
import pytest
from click.testing import CliRunner
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from test_server import decode, serving

# The SDK marks its video calls deprecated (the hosted service's end), not their shape.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KEY_FILE, KEY_ENV = "file-key-0123456789abcdef", "env-key-0123456789abcdef"
SECONDS = "0.25"  # the serving builds' 5 frames at the tiny model's 16 fps: 4 / 16 s
SIZE = "64x96"
SETTINGS = {"steps": 2, "negative_prompt": "blur"}
# What a server with keys serves without one: the probes, the schema and the playground.
OPEN = ("/healthz", "/metrics", "/openapi.json", "/", "/playground/playground.js")


@pytest.fixture(scope="module")
def server(small_builds, tiny_weights, tmp_path_factory):
    """One keyed server for the module: a key in --api-key-file, another in $WAN_API_KEYS."""
    root = tmp_path_factory.mktemp("openai")
    (root / "keys").write_text(f"# the test's key\n\n{KEY_FILE}\n")
    env = os.environ | {"WAN_API_KEYS": f" {KEY_ENV}, "}
    with serving(small_builds, tiny_weights, root / "out", "--batch-window", "0",
                 "--api-key-file", str(root / "keys"), env=env, key=KEY_FILE) as s:  # fmt: skip
        yield s
    assert "Traceback" not in s.log.read_text()


def sdk(server, key: str = KEY_FILE) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def test_the_sdk_makes_and_fetches_videos(server):
    """create (multipart) and poll, create_and_poll, retrieve; the MP4 equals the JSON path's
    for the same request; the thumbnail is its first frame, the spritesheet its frames."""
    client = sdk(server)
    created = client.videos.create(
        prompt="a red cat", model="tiny", size=SIZE, seconds=SECONDS,
        extra_body={**SETTINGS, "seed": 7, "guidance_2": None},
    )  # fmt: skip
    assert (created.object, created.status, created.model) == ("video", "queued", "tiny")
    assert (created.seconds, created.size, created.progress) == (SECONDS, SIZE, 0)
    assert created.remixed_from_video_id is None and created.error is None
    done = client.videos.poll(created.id, poll_interval_ms=100)
    assert done.status == "completed" and done.progress == 100 and done.completed_at
    assert client.videos.retrieve(created.id) == done
    # The same request as JSON with `frames`, the extension, gives the same video.
    body = {"prompt": "a red cat", "size": SIZE, "frames": 5, "seed": 7, **SETTINGS}
    as_json = server.post(body).json()
    assert as_json["seconds"] == SECONDS and as_json["model"] == "tiny"
    other = client.videos.create_and_poll(
        prompt="a blue dog", size=SIZE, seconds=SECONDS, poll_interval_ms=100,
        extra_body=SETTINGS,
    )  # fmt: skip
    assert other.status == "completed" and other.model == "tiny"
    # No seed: a random one, recorded; asking for it again makes the same video.
    seed = other.model_extra["seed"]
    assert isinstance(seed, int)
    again = client.videos.create_and_poll(
        prompt="a blue dog", size=SIZE, seconds=SECONDS, poll_interval_ms=100,
        extra_body={**SETTINGS, "seed": seed},
    )  # fmt: skip
    json_done = client.videos.poll(as_json["id"], poll_interval_ms=100)
    assert json_done.status == "completed"

    mp4 = client.videos.download_content(created.id).content
    (server.log.parent / "sdk.mp4").write_bytes(mp4)
    frames = decode(server.log.parent / "sdk.mp4")
    assert frames.shape == (5, 96, 64, 3)
    assert client.videos.download_content(as_json["id"]).content == mp4
    assert client.videos.download_content(other.id).content != mp4
    assert (
        client.videos.download_content(again.id).content
        == client.videos.download_content(other.id).content
    )

    thumbnail = Image.open(io.BytesIO(client.videos.download_content(created.id,
                                                                     variant="thumbnail").content))  # fmt: skip
    assert thumbnail.format == "WEBP" and thumbnail.size == (64, 96)
    # The thumbnail is the first frame (both lossy: H.264's 4:2:0 chroma and WebP, on the tiny
    # model's noise-like frames: about 7 of 255 on average, against about 48 to another frame).
    error = np.abs(np.asarray(thumbnail.convert("RGB"), int) - frames.astype(int))
    assert error[0].mean() < 10 and error[0].mean() < min(e.mean() for e in error[1:]) / 4, [
        e.mean() for e in error
    ]
    sheet = Image.open(io.BytesIO(client.videos.download_content(created.id,
                                                                 variant="spritesheet").content))  # fmt: skip
    assert sheet.format == "JPEG" and sheet.size == (3 * 64, 2 * 96)  # 5 frames, 3 a row
    tiles = np.asarray(sheet, int)
    for i in range(5):  # each tile is its frame (JPEG: about 10 of 255 off), not another
        row, column = divmod(i, 3)
        tile = tiles[row * 96 : (row + 1) * 96, column * 64 : (column + 1) * 64]
        off = [np.abs(tile - frame.astype(int)).mean() for frame in frames]
        assert np.argmin(off) == i and off[i] < 20, (i, off)


def test_list_pages_and_delete(server):
    """list auto-pages over every video once, newest or oldest first, with OpenAI's cursor
    page; delete removes a finished video and its files."""
    client = sdk(server)
    ids = [
        client.videos.create(
            prompt=f"a fish {i}", size=SIZE, seconds=SECONDS, extra_body={**SETTINGS, "seed": i}
        ).id  # fmt: skip
        for i in range(5)
    ]
    for video_id in ids:
        assert client.videos.poll(video_id, poll_interval_ms=100).status == "completed"
    newest = [v.id for v in client.videos.list(limit=2)]  # 2 a page: the SDK asks for the rest
    assert len(newest) == len(set(newest)) and newest[:5] == ids[::-1]
    oldest = [v.id for v in client.videos.list(limit=3, order="asc")]
    assert oldest == newest[::-1]
    page = server.client.get("/v1/videos", params={"limit": 2}).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (ids[4], ids[3])
    last = server.client.get("/v1/videos", params={"after": ids[1], "limit": 1000}).json()
    assert ids[0] in [v["id"] for v in last["data"]] and last["has_more"] is False

    deleted = client.videos.delete(ids[0])
    assert (deleted.id, deleted.deleted, deleted.object) == (ids[0], True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(ids[0], variant="thumbnail")
    assert not list((server.log.parent / "out" / "videos").glob(f"{ids[0]}.*"))
    assert ids[0] not in [v.id for v in client.videos.list()]
    with pytest.raises(openai.NotFoundError):  # a cursor that is no video
        client.videos.list(after=ids[0])


def test_keys_and_errors(server):
    """Each key works; a wrong key or none is AuthenticationError on every /v1/ route, while
    /healthz and /metrics stay open; unserved sizes, lengths and models and a bad form field
    are BadRequestError naming what is served or the field."""
    assert [m.id for m in sdk(server, KEY_ENV).models.list()] == ["tiny"]
    wrong = sdk(server, "wrong-key-0123456789abcdef")
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.videos.create(prompt="x", size=SIZE, seconds=SECONDS)
    assert refused.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.videos.list()
    with pytest.raises(openai.AuthenticationError):  # no Authorization header at all
        sdk(server).models.list(extra_headers={"Authorization": openai.Omit()})
    plain = httpx.Client(base_url=server.url)
    for path in OPEN:
        assert plain.get(path).status_code == 200, path
    for path in ("/docs", "/redoc"):  # FastAPI's pages, off: they load from a CDN
        assert plain.get(path).status_code == 404, path
    answer = plain.get("/v1/videos")
    assert answer.status_code == 401 and set(answer.json()["error"]) == {
        "message", "type", "param", "code"
    }  # fmt: skip

    client = sdk(server)
    refusals = {  # what is wrong -> (the param at fault, what the message names)
        "size": ({"size": "720x1280", "seconds": SECONDS}, "size", "64x96 frames=5"),
        "seconds": ({"size": SIZE, "seconds": "4"}, "seconds", "served: 0.25 s (5 frames)"),
        "model": ({"size": SIZE, "seconds": SECONDS, "model": "sora-2"}, "model", "served: tiny"),
        "a bad number": ({"size": SIZE, "seconds": SECONDS, "extra_body": {"steps": "many"}},
                         "steps", "steps: 'many' is not a number"),
        "an unknown field": ({"size": SIZE, "seconds": SECONDS, "extra_body": {"colour": "red"}},
                             "colour", "colour"),
        "frames against seconds": ({"size": SIZE, "seconds": SECONDS, "extra_body": {"frames": 9}},
                                   "frames", "disagree"),
        "frames against unserved seconds": ({"seconds": "4", "extra_body": {"frames": 5}},
                                            "frames", "(65 frames at 16 fps) disagree"),
        "frames none serves, no size": ({"extra_body": {"frames": 9}}, "frames",
                                        "makes 9 frames; served: 0.25 s (5 frames)"),
    }  # fmt: skip
    for what, (kwargs, param, named) in refusals.items():
        with pytest.raises(openai.BadRequestError) as refused:
            client.videos.create(prompt="a cat", **kwargs)
        assert refused.value.param == param and named in refused.value.message, (what, refused)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_nope")
    running = client.videos.create(prompt="slow", size=SIZE, seconds=SECONDS,
                                   extra_body={"steps": 40})  # fmt: skip
    with pytest.raises(openai.ConflictError):  # not completed yet
        client.videos.download_content(running.id)
    assert client.videos.poll(running.id, poll_interval_ms=100).status == "completed"


def test_an_image_to_a_text_to_video_server(server):
    """input_reference (a real PNG, as the SDK uploads it) to a server of text-to-video builds
    is BadRequestError naming what the server makes; nothing is queued."""
    png = io.BytesIO()
    Image.new("RGB", (64, 96), (200, 30, 30)).save(png, format="PNG")
    client = sdk(server)
    before = [v.id for v in client.videos.list()]
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt="a cat", size=SIZE, seconds=SECONDS,
                             input_reference=("cat.png", png.getvalue(), "image/png"))  # fmt: skip
    assert refused.value.param == "input_reference", refused.value
    message = refused.value.body["message"]
    assert "from text only: leave input_reference out" in message, message
    assert "served: text-to-video 64x96 frames=5 guidance>1 (batch 2)" in message, message
    assert [v.id for v in client.videos.list()] == before


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl binary on this host")
def test_a_json_request_with_curl(server):
    """curl with a JSON body and a key, as the README shows it."""
    body = {"prompt": "a red cat", "size": SIZE, "seconds": 0.25, "steps": 2, "seed": 3}
    result = subprocess.run(
        ["curl", "-s", f"{server.url}/v1/videos", "-H", "content-type: application/json",
         "-H", f"Authorization: Bearer {KEY_ENV}", "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    video = json.loads(result.stdout)
    assert video["status"] == "queued" and video["seconds"] == SECONDS and video["frames"] == 5
    assert sdk(server).videos.poll(video["id"], poll_interval_ms=100).status == "completed"
    no_key = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                             f"{server.url}/v1/videos/{video['id']}"],
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    assert no_key.stdout == "401"


def test_size_is_optional_and_remix_is_refused(server):
    """Without `size`, the one size served for the length; remix, which this server does not
    do, is BadRequestError saying so."""
    client = sdk(server)
    video = client.videos.create_and_poll(prompt="a red cat", seconds=SECONDS,
                                          poll_interval_ms=100, extra_body=SETTINGS)  # fmt: skip
    assert (video.status, video.size) == ("completed", SIZE)
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.remix(video.id, prompt="a blue cat")
    assert refused.value.code == "unsupported_operation"
    assert refused.value.body["message"].startswith("videos.remix is not supported by this")


def test_the_metrics_read_with_prometheus_clients_parser(server):
    """/metrics in Prometheus' text format as prometheus_client reads it: the types, the videos
    by status, and latency histograms whose counts are the videos and steps run."""
    client = sdk(server)
    client.videos.create_and_poll(prompt="a red cat", size=SIZE, seconds=SECONDS,
                                  poll_interval_ms=100, extra_body=SETTINGS)  # fmt: skip
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    kinds = {name: f.type for name, f in families.items()}
    assert kinds | {
        "wan_queue_depth": "gauge", "wan_videos": "gauge", "wan_videos_completed": "counter",
        "wan_videos_failed": "counter", "wan_store_errors": "counter",
        "wan_compile_count": "gauge", "wan_slots_occupied": "gauge",
        "wan_step_seconds": "histogram", "wan_video_seconds": "histogram",
    } == kinds  # fmt: skip

    def value(family: str, sample: str, **labels: str) -> float:
        (found,) = [s.value for s in families[family].samples
                    if s.name == sample and labels.items() <= s.labels.items()]  # fmt: skip
        return found

    completed = value("wan_videos_completed", "wan_videos_completed_total")
    assert value("wan_videos", "wan_videos", status="completed") >= 1 and completed >= 1
    queued = value("wan_videos", "wan_videos", status="queued")
    assert queued == value("wan_queue_depth", "wan_queue_depth")
    assert value("wan_compile_count", "wan_compile_count") == 0
    assert value("wan_store_errors", "wan_store_errors_total") == 0
    (build,) = {s.labels["build"] for s in families["wan_video_seconds"].samples}
    videos = value("wan_video_seconds", "wan_video_seconds_count", build=build)
    assert videos == completed == value("wan_video_seconds", "wan_video_seconds_bucket", le="+Inf")
    assert value("wan_video_seconds", "wan_video_seconds_sum") > 0
    # Every step of a batch but its first (which holds the prompts' encoding) is timed.
    batches = value("wan_batches", "wan_batches_total")
    assert value("wan_step_seconds", "wan_step_seconds_count", build=build) >= batches >= 1


def test_keys_are_checked_at_the_start(tmp_path):
    """A key too short (or of characters no header carries), from any source, is one line
    before anything loads; so is a key file that is missing."""
    from runtime.cli import cli
    from runtime.serve.http_guards import load_api_keys

    (tmp_path / "keys").write_text("# comment\n\n  a-key-0123456789abcdef  \n")
    assert load_api_keys(("b-key-0123456789abcdef",), tmp_path / "keys", "c-key-0123456789ab,,") \
        == ("b-key-0123456789abcdef", "a-key-0123456789abcdef", "c-key-0123456789ab")  # fmt: skip
    base = ["serve", "--weights", str(tmp_path), "--out-dir", str(tmp_path / "out")]
    for args, env, expected in [
        (["--api-key", "short"], {}, "API key 1 (of --api-key"),
        ([], {"WAN_API_KEYS": "0123456789abcdef0123, with space 0123456789"}, "API key 2"),
        (["--api-key-file", str(tmp_path / "none")], {}, "is missing"),
    ]:
        result = CliRunner().invoke(cli, [*base, *args], env=env)
        assert result.exit_code == 2 and expected in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize(
    ("file", "env", "expected"),
    [
        ("", None, "holds no key"),
        ("# the keys go here\n\n   \n", None, "holds no key"),
        (None, " , ,", "$WAN_API_KEYS is set but holds no key"),
        (None, "", "$WAN_API_KEYS is set but holds no key"),
    ],
)
def test_a_key_source_without_a_key_is_refused(tmp_path, file, env, expected):
    """A key file with no key (empty, or comments only) or a $WAN_API_KEYS of no key: one line
    at the start, not a server open to all (issue 53)."""
    from runtime.cli import cli

    args = ["serve", "--weights", str(tmp_path), "--out-dir", str(tmp_path / "out")]
    if file is not None:
        (tmp_path / "keys").write_text(file)
        args += ["--api-key-file", str(tmp_path / "keys")]
    result = CliRunner().invoke(cli, args, env={"WAN_API_KEYS": env})
    assert result.exit_code == 2 and expected in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_server_without_keys_serves_only_loopback(tiny_weights, tmp_path):
    """No key and --host 0.0.0.0: one line at the start; with a key, or on 127.0.0.1, the start
    goes on (here to the empty artifacts folder's refusal)."""
    from runtime.cli import cli

    (tmp_path / "empty").mkdir()
    args = ["serve", "--artifacts", str(tmp_path / "empty"), "--weights", str(tiny_weights),
            "--port", "0"]  # fmt: skip
    for i, (host, env, refusal) in enumerate([
        ("0.0.0.0", None, "--host 0.0.0.0 (0.0.0.0) without an API key would serve /v1/"),
        ("0.0.0.0", KEY_ENV, "no build in"),
        ("127.0.0.1", None, "no build in"),
    ]):  # fmt: skip
        out = ["--out-dir", str(tmp_path / f"out{i}")]  # each its own: the store stays open here
        result = CliRunner().invoke(cli, [*args, *out, "--host", host], env={"WAN_API_KEYS": env})
        assert result.exit_code == 2 and refusal in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_numbers_of_thousands_of_digits_in_a_form_are_400(server):
    """A form's seed, steps, frames or guidance of 5,000 digits: BadRequestError naming the
    field (Python's int() refuses 4,300 digits: it was a 500)."""
    client = sdk(server)
    for name in ("seed", "steps", "frames", "guidance"):
        with pytest.raises(openai.BadRequestError) as refused:
            client.videos.create(prompt="a cat", size=SIZE, seconds=SECONDS,
                                 extra_body={name: "9" * 5000})  # fmt: skip
        assert refused.value.param == name, refused.value
        assert "a number of 5000 characters: give at most 64" in refused.value.message
