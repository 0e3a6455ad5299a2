"""The playground (runtime/serve/pages.py, runtime/serve/playground/) in a real browser: Debian's chromium,
headless, driven by Playwright against a real `runtime serve` of the tiny TI2V model's two builds
(text to video and image to video: one model, one server, both kinds), its weights made by
`python -m wan.random_weights` as a user would. The key is asked once per tab and a wrong one is
refused in the server's words; a prompt becomes a video whose steps the page follows and whose
<video> plays at the build's size and length; an image shows the crop the server applies and
becomes a video, a portrait one is refused; the gallery pages and deletes. Each state's
screenshot goes to $WAN_SCREENSHOTS when it is set (`WAN_SCREENSHOTS=docs/playground` remakes
the README's; else a scratch folder, so that a run leaves the tree as it was). The control:
against the page without its script, the same checks fail.

Needs /usr/bin/chromium (`make test` installs Debian's package where it is missing)."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli
from PIL import Image
from playwright.sync_api import Browser, Page, sync_playwright
from playwright.sync_api import Error as PlaywrightError
from test_server import serving

from runtime.generation import images

CHROMIUM = Path("/usr/bin/chromium")
# No sandbox (root in CI), no GPU, and nothing that reaches for the network (a closed network
# refuses it, many times a start); Playwright gives every launch a fresh profile.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
WIDTH, HEIGHT, FRAMES, FPS = 64, 32, 9, 24  # the tiny TI2V builds: 9 frames at 24 fps
SHAPE = ["--res", f"{WIDTH}x{HEIGHT}", "--frames", str(FRAMES), "--batch", "1"]
KEY = "playground-key-0123456789abcdef"
STEPS = 1000  # the most a request may ask: the page sees steps in progress (ms each here)
SHOTS = Path(os.environ.get("WAN_SCREENSHOTS") or tempfile.mkdtemp(prefix="playground-"))
WAIT_MS = 120_000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`runtime serve` (with a key) of the tiny TI2V model's text and image builds."""
    root = tmp_path_factory.mktemp("playground")
    subprocess.run(
        [sys.executable, "-m", "wan.random_weights", "--model", "tiny-ti2v", "--out",
         str(root / "weights")], check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    for pipeline in ("t2v", "i2v"):
        run_cli("aot", "build", "--model", "tiny-ti2v", "--pipeline", pipeline, *SHAPE,
                "--target", "cpu-1", "--out", str(root / "artifacts"))  # fmt: skip
    (root / "keys").write_text(f"{KEY}\n")
    with serving(root / "artifacts", root / "weights", root / "out", "--batch-window", "0",
                 "--api-key-file", str(root / "keys"), key=KEY) as server:  # fmt: skip
        server.root = root
        yield server
    assert "Traceback" not in server.log.read_text()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.is_file():
        pytest.fail(f"no {CHROMIUM}: install Debian's chromium (`make test` does: apt-get install "
                    "chromium)")  # fmt: skip
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture(autouse=True)
def script_errors():
    """The errors the page's script raised in the test (none allowed)."""
    errors: list[str] = []
    yield errors
    assert not errors


def new_page(browser: Browser, errors: list[str]) -> Page:
    """A new tab in a new context (its own sessionStorage); its script's errors in `errors`."""
    page = browser.new_context(viewport={"width": 900, "height": 700}).new_page()
    page.set_default_timeout(WAIT_MS)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return page


@pytest.fixture
def page(browser, served, script_errors):
    """The playground open with the key given."""
    page = new_page(browser, script_errors)
    page.goto(served.url)
    page.wait_for_selector("#key-panel:not([hidden])")
    page.fill("#key-input", KEY)
    page.click("#key-form button")
    page.wait_for_selector("#create-panel:not([hidden])")
    yield page
    page.context.close()


def shot(page: Page, name: str) -> None:
    """The whole page as SHOTS/NAME.png, in 64 colours (a few tens of KiB)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    picture = Image.open(io.BytesIO(page.screenshot(full_page=True))).convert("RGB")
    picture.quantize(64).save(SHOTS / f"{name}.png", optimize=True)


def text(page: Page, selector: str) -> str:
    return page.text_content(selector) or ""


def until(page: Page, condition: str, timeout: float) -> None:
    """Wait until the JavaScript `condition` holds; the page showing the server's refusal of
    the request fails at once, with it."""
    refused = "document.getElementById('create-error').textContent !== ''"
    page.wait_for_function(f"() => ({condition}) || {refused}", timeout=timeout)
    assert text(page, "#create-error") == ""


def make_video(page: Page, prompt: str, image: Path | None = None, shoot: str | None = None,
               timeout: float = WAIT_MS) -> tuple[str, list[str]]:  # fmt: skip
    """Submit `prompt` (and `image`) from the page and wait until its video is in the player:
    its id and every progress line the page showed (with `shoot`, a screenshot once the steps
    run)."""
    page.fill("#prompt", prompt, timeout=timeout)
    page.fill("#steps", str(STEPS))
    page.set_input_files("#image", [] if image is None else str(image))
    page.evaluate("""() => {  // every line the progress shows, however brief
        const line = document.getElementById("progress-text");
        window.progressLines = [];
        new MutationObserver(() => window.progressLines.push(line.textContent))
            .observe(line, {childList: true, characterData: true, subtree: true});
    }""")
    page.click("#submit")
    progress = "document.getElementById('progress-text').textContent"
    if shoot:
        until(page, f"/step [1-9][0-9]* of/.test({progress})", timeout)
        shot(page, shoot)
    until(page, f"{progress}.includes(': done')", timeout)
    video_id = text(page, "#progress-text").split(":")[0]
    page.wait_for_function(
        f"() => document.getElementById('player').dataset.id === '{video_id}'", timeout=timeout
    )
    return video_id, page.evaluate("window.progressLines")


def playing(page: Page) -> dict:
    """The player once it has played a while: its duration, size and time."""
    page.evaluate("document.getElementById('player').play()")
    page.wait_for_function("() => document.getElementById('player').currentTime > 0.05")
    return page.evaluate("""() => {
        const v = document.getElementById("player");
        return {duration: v.duration, width: v.videoWidth, height: v.videoHeight,
                time: v.currentTime, error: v.error};
    }""")


def test_the_key_is_asked_once_a_tab_and_a_wrong_one_refused(browser, served, script_errors):
    page = new_page(browser, script_errors)
    page.goto(served.url)
    page.wait_for_selector("#key-panel:not([hidden])")
    assert text(page, "#key-error") == "no API key given: send Authorization: Bearer KEY"
    assert page.is_hidden("#create-panel")
    page.fill("#key-input", "wrong-key-0123456789abcdef")
    page.click("#key-form button")
    page.wait_for_function(
        "() => document.getElementById('key-error').textContent.includes('not one')"
    )
    assert text(page, "#key-error") == (
        "the API key is not one of this server's: send Authorization: Bearer KEY"
    )
    shot(page, "key")
    page.fill("#key-input", KEY)
    page.click("#key-form button")
    page.wait_for_selector("#create-panel:not([hidden])")
    assert text(page, "#served") == "tiny-ti2v: text to video and image to video at 64x32"
    page.reload()  # the tab keeps the key
    page.wait_for_selector("#create-panel:not([hidden])")
    assert page.is_hidden("#key-panel")
    other = page.context.new_page()  # another tab asks again
    other.goto(served.url)
    other.wait_for_selector("#key-panel:not([hidden])")
    page.context.close()


def test_a_prompt_becomes_a_video_that_plays(page, served):
    """Progress with its steps and an estimate, then the player: the build's size and length,
    playing; the download is the server's MP4, the previews its thumbnail and spritesheet."""
    video_id, lines = make_video(page, "a red cat running in the rain", shoot="progress")
    steps = [re.fullmatch(rf"{video_id}: step (\d+) of {STEPS} \((\d+)%\), (.*)", line)
             for line in lines]  # fmt: skip
    done = [int(m[1]) for m in steps if m]
    assert done == sorted(done) and any(0 < d < STEPS for d in done), lines
    assert any(re.fullmatch(r"about [0-9.]+ s left", m[3]) for m in steps if m), lines
    assert re.fullmatch(rf"{video_id}: done, {STEPS} of {STEPS} steps in about \d+ s", lines[-1])
    player = playing(page)
    assert player["error"] is None
    assert (player["width"], player["height"]) == (WIDTH, HEIGHT)
    assert player["duration"] == pytest.approx(FRAMES / FPS, abs=1e-3)
    video = served.client.get(f"/v1/videos/{video_id}").json()
    assert video["status"] == "completed" and video["input_reference"] is False
    assert f"seed {video['seed']}" in text(page, "#player-settings")
    mp4 = served.client.get(f"/v1/videos/{video_id}/content").content
    with page.expect_download() as download:
        page.click("#download")
    assert download.value.suggested_filename == f"{video_id}.mp4"
    assert Path(download.value.path()).read_bytes() == mp4
    for variant in ("thumbnail", "spritesheet"):
        size = page.evaluate(f"[document.getElementById('{variant}').naturalWidth, "
                             f"document.getElementById('{variant}').naturalHeight]")  # fmt: skip
        served_image = served.client.get(f"/v1/videos/{video_id}/content?variant={variant}")
        assert tuple(size) == Image.open(io.BytesIO(served_image.content)).size, variant
    shot(page, "video")


def test_an_image_shows_the_servers_crop_and_becomes_a_video(page, served, tmp_path):
    """A 4:3 picture for the 2:1 build: the page says what the server keeps and its fitted first
    frame is the server's (runtime.generation.images), then it becomes a video from that image; a portrait
    picture is refused, in the server's words."""
    rng = np.random.default_rng(0)
    coarse = Image.fromarray(rng.integers(0, 256, (3, 4, 3), dtype=np.uint8))
    coarse.resize((120, 90), Image.Resampling.BILINEAR).save(tmp_path / "landscape.png")
    page.set_input_files("#image", str(tmp_path / "landscape.png"))
    page.wait_for_function("() => document.getElementById('crop-note').textContent !== ''")
    assert text(page, "#crop-note") == (
        "The server keeps 120x60 of this 120x90 image, about its centre (33% cropped away), and "
        "resizes it to 64x32."
    )
    data_url = page.evaluate("document.getElementById('crop-frame').toDataURL('image/png')")
    shown = np.asarray(Image.open(io.BytesIO(base64.b64decode(data_url.split(",")[1]))))
    picture = images.read_image(tmp_path / "landscape.png")
    server = (images.condition_pixels(picture, WIDTH, HEIGHT) + 1) * 127.5
    stretched = np.asarray(picture.resize((WIDTH, HEIGHT), Image.Resampling.LANCZOS), float)
    off = np.abs(shown[..., :3] - server).mean()
    assert off < 4 and off < np.abs(shown[..., :3] - stretched).mean() / 3, off

    video_id, _ = make_video(page, "the picture comes alive", tmp_path / "landscape.png")
    assert served.client.get(f"/v1/videos/{video_id}").json()["input_reference"] is True
    player = playing(page)
    assert (player["width"], player["height"]) == (WIDTH, HEIGHT)
    page.wait_for_function(f"""() => document.querySelector('#gallery li[data-id="{video_id}"]')
                              ?.textContent.includes('from an image')""")  # fmt: skip
    shot(page, "image")

    coarse.resize((60, 120), Image.Resampling.BILINEAR).save(tmp_path / "portrait.png")
    page.set_input_files("#image", str(tmp_path / "portrait.png"))
    page.wait_for_function(
        "() => document.getElementById('crop-note').textContent.includes('refuse')"
    )
    page.fill("#prompt", "a portrait")
    page.click("#submit")
    page.wait_for_function("() => document.getElementById('create-error').textContent !== ''")
    assert text(page, "#create-error") == (
        "input_reference is 60x120: fitting it to this build's 64x32 video would crop 75% of it "
        "away (more than 50%); give an image of a shape nearer 64x32, cropped or padded as you "
        "want it"
    )
    shot(page, "refused")


def test_the_gallery_pages_and_deletes(page, served):
    """Six videos a page, newest first as the API lists them; older and newer; a deleted video
    is gone from the page, the API and the folder."""
    for i in range(7):
        body = {"prompt": f"a fish {i}", "steps": 2, "seed": i, "frames": FRAMES}
        assert served.post(body).status_code == 202
    listed = served.client.get("/v1/videos", params={"limit": 1000}).json()["data"]
    served.wait([v["id"] for v in listed])
    newest = [v["id"] for v in listed]
    page.reload()
    page.wait_for_selector("#gallery li")

    def shown() -> list[str]:
        return page.eval_on_selector_all("#gallery li", "items => items.map(i => i.dataset.id)")

    assert shown() == newest[:6] and text(page, "#page-number") == "page 1"
    page.click("#older")
    page.wait_for_function("() => document.getElementById('page-number').textContent === 'page 2'")
    assert shown() == newest[6:12]
    shot(page, "gallery")
    page.click("#newer")
    page.wait_for_function("() => document.getElementById('page-number').textContent === 'page 1'")
    assert shown() == newest[:6]

    page.once("dialog", lambda dialog: dialog.accept())
    page.locator(f'#gallery li[data-id="{newest[0]}"]').get_by_role("button", name="Delete").click()
    page.wait_for_function(f"() => !document.querySelector('#gallery li[data-id=\"{newest[0]}\"]')")
    assert shown() == newest[1:7]
    assert served.client.get(f"/v1/videos/{newest[0]}").status_code == 404
    assert not list((served.root / "out" / "videos").glob(f"{newest[0]}.*"))


def test_the_checks_fail_against_a_page_without_its_script(browser, served, script_errors):
    """The control: the same server, but the browser gets a 404 for the page's script (as from a
    package without playground.js); loading the page and making a video fail. The 404 is given
    in the browser rather than by a second server on a copy of the package: what the page gets
    is the same, without loading the builds again."""
    assert served.client.get("/playground/missing.js").status_code == 404  # the server's answer
    page = new_page(browser, script_errors)
    page.route("**/playground/playground.js", lambda route: route.fulfill(status=404))
    page.goto(served.url)
    started = time.monotonic()
    with pytest.raises(PlaywrightError):
        page.wait_for_selector("#key-panel:not([hidden])", timeout=3_000)
    with pytest.raises(PlaywrightError):
        make_video(page, "a red cat running in the rain", timeout=3_000)
    assert time.monotonic() - started < 30
    page.context.close()
