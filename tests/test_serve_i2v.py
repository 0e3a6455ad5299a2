"""`runtime serve` of an image-to-video build, driven by the official `openai` SDK: the image goes
as `input_reference`, a file part of the SDK's form. One build of the tiny Wan 2.1 I2V model
(tests/conftest.save_tiny_i2v_pipeline: its CLIP image encoder and image cross-attention), one
small shape; a real server in its own process, real files, kill -9 and a restart.

The served video equals `runtime run --image` of the same request (the same build, image, seed
and steps); another image gives another video. Bad images, a missing one and a body over the
bound are refused in one line; an image sent to a text-to-video server is refused in
tests/test_openai_client.py."""

from __future__ import annotations

import io
import os
import signal
import time

import numpy as np
import openai
import pytest
from conftest import run_cli, save_tiny_i2v_pipeline
from PIL import Image
from test_server import decode, serving

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK's video calls

WIDTH, HEIGHT, FRAMES = 48, 32, 9
SIZE, SECONDS = f"{WIDTH}x{HEIGHT}", "0.5"  # 9 frames at the tiny model's 16 fps: 8 / 16 s
SHAPE = ["--res", SIZE, "--frames", str(FRAMES), "--batch", "1"]
PROMPT = "a red cat running in the rain"
# Steps enough for the video to be seen in progress before its kill (about 5 ms each here, the
# progress polled every 50 ms: 150 steps are over 10 polls), each video of the test runs them.
STEPS, SEED = 150, 3


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    """The tiny I2V model, its one build, and two pictures of the build's aspect ratio (3:2):
    a smooth small PNG, and a large noisy JPEG over the old 1 MiB body bound."""
    root = tmp_path_factory.mktemp("serve-i2v")
    save_tiny_i2v_pipeline(root / "pipe", clip=True)
    run_cli("aot", "build", "--model", str(root / "pipe"), *SHAPE, "--target", "cpu-8",
            "--out", str(root / "artifacts"))  # fmt: skip
    rng = np.random.default_rng(0)
    coarse = Image.fromarray(rng.integers(0, 256, (4, 6, 3), dtype=np.uint8))
    coarse.resize((96, 64), Image.Resampling.BILINEAR).save(root / "smooth.png")
    noise = Image.fromarray(rng.integers(0, 256, (1200, 1800, 3), dtype=np.uint8))
    noise.save(root / "noise.jpg", quality=95)
    assert (root / "noise.jpg").stat().st_size > 1 << 20
    return root


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def frames_of(client: openai.OpenAI, video_id: str) -> np.ndarray:
    """A served video's uint8 frames (F, H, W, 3), as a server run with --save-frames keeps them."""
    return np.load(io.BytesIO(client.videos.download_content(video_id, variant="frames").content))


def test_an_image_to_video_survives_kill_9_and_equals_runtime_run(i2v, tmp_path):
    """The SDK's create with input_reference, kill -9 while the video is made, a restart: the
    stored image is read again and the video equals `runtime run --image` of its request;
    another image gives another video; deleting a video removes its image."""
    out = tmp_path / "out"
    args = (i2v / "artifacts", i2v / "pipe", out, "--batch-window", "0", "--save-frames")
    with serving(*args) as server:
        client = sdk(server)
        with (i2v / "smooth.png").open("rb") as image:
            video = client.videos.create(
                prompt=PROMPT, size=SIZE, seconds=SECONDS, input_reference=image,
                extra_body={"steps": STEPS, "seed": SEED},
            )  # fmt: skip
        assert (video.status, video.size, video.seconds) == ("queued", SIZE, SECONDS)
        deadline = time.monotonic() + 120
        while (seen := client.videos.retrieve(video.id)).progress == 0:
            assert seen.status != "completed", "raise STEPS: it finished before its kill"
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        assert seen.status == "in_progress"
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
    stored = out / "inputs" / f"{video.id}.image"
    assert stored.read_bytes() == (i2v / "smooth.png").read_bytes()

    with serving(*args) as server:
        client = sdk(server)
        assert client.videos.poll(video.id, poll_interval_ms=100).status == "completed"
        frames = frames_of(client, video.id)
        mp4 = tmp_path / "served.mp4"
        mp4.write_bytes(client.videos.download_content(video.id).content)
        assert decode(mp4).shape == frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
        other = client.videos.create_and_poll(
            prompt=PROMPT, size=SIZE, seconds=SECONDS, input_reference=i2v / "noise.jpg",
            extra_body={"steps": STEPS, "seed": SEED}, poll_interval_ms=100,
        )  # fmt: skip
        assert other.status == "completed", other.error
        other_frames = frames_of(client, other.id)
        assert client.videos.delete(video.id).deleted
        assert not stored.exists() and not list((out / "videos").glob(f"{video.id}.*"))
        assert (out / "inputs" / f"{other.id}.image").is_file()
    assert "Traceback" not in server.log.read_text()

    run_cli("runtime", "run", "--artifacts", str(i2v / "artifacts"), "--weights",
            str(i2v / "pipe"), *SHAPE, "--prompt", PROMPT, "--image", str(i2v / "smooth.png"),
            "--steps", str(STEPS), "--seed", str(SEED), "--out", str(tmp_path / "run.mp4"),
            "--save-frames", str(tmp_path / "run.npy"))  # fmt: skip
    np.testing.assert_array_equal(frames, np.load(tmp_path / "run.npy")[0])
    # The control: the other image moves the frames far past the 0 levels above.
    assert np.abs(frames.astype(int) - other_frames.astype(int)).max() > 3


def test_bad_images_and_no_image_are_one_line_400s(i2v, tmp_path):
    """Not an image, a truncated JPEG, an image of another aspect ratio, no image (the SDK's
    form, or JSON, which carries none), an image by URL or as text: each a 400 in one line
    naming the field and what to give; an image over --max-body-bytes is 413. Nothing is
    queued."""
    jpeg = io.BytesIO()
    Image.open(i2v / "smooth.png").save(jpeg, format="JPEG")
    portrait = io.BytesIO()
    Image.new("RGB", (32, 96), (200, 30, 30)).save(portrait, format="PNG")
    refusals = {  # what is wrong -> (input_reference, what the message says)
        "text named .png": (("notes.png", b"not a picture", "image/png"),
                            "input_reference is not a PNG, JPEG or WebP image"),
        "a truncated JPEG": (("cut.jpg", jpeg.getvalue()[: len(jpeg.getvalue()) // 2],
                              "image/jpeg"), "input_reference is truncated or corrupt"),
        "another aspect ratio": (("tall.png", portrait.getvalue(), "image/png"),
                                 "would crop 78% of it away"),
        "no image": (openai.omit, "from an image: give input_reference"),
    }  # fmt: skip
    with serving(i2v / "artifacts", i2v / "pipe", tmp_path / "out",
                 "--max-body-bytes", "65536") as server:  # fmt: skip
        client = sdk(server)
        for what, (image, says) in refusals.items():
            with pytest.raises(openai.BadRequestError) as refused:
                client.videos.create(prompt=PROMPT, size=SIZE, seconds=SECONDS,
                                     input_reference=image)  # fmt: skip
            message = refused.value.body["message"]
            assert refused.value.param == "input_reference" and says in message, (what, message)
            assert "\n" not in message, (what, message)
        # No image: the message names what the server makes.
        assert "served: image-to-video 48x32 frames=9 guidance>1 (batch 1)" in message
        body = {"prompt": PROMPT, "size": SIZE, "frames": FRAMES}
        for answer, says in [
            (server.post(body), "give input_reference"),
            (server.post({**body, "input_reference": {"image_url": "https://example.com/a.png"}}),
             "a file_id, an image_url or text is not taken"),
            (server.client.post("/v1/videos", data={**body, "input_reference": "cat.png"}),
             "send the image file as a multipart/form-data file part, with a filename"),
        ]:  # fmt: skip
            assert answer.status_code == 400, answer.text
            assert says in answer.json()["error"]["message"], answer.text
        with pytest.raises(openai.APIStatusError) as refused:  # over the bound: 413
            client.videos.create(prompt=PROMPT, size=SIZE, seconds=SECONDS,
                                 input_reference=i2v / "noise.jpg")  # fmt: skip
        assert refused.value.status_code == 413 and refused.value.code == "body_too_large"
        assert client.videos.list().data == []
    assert not list((tmp_path / "out" / "inputs").iterdir())
    assert "Traceback" not in server.log.read_text()
