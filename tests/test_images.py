"""runtime.generation.images on real files written with Pillow: hostile images refused with one line,
every accepted mode read as diffusers' load_image reads it, the VAE condition equal to
diffusers' VideoProcessor.preprocess and the CLIP input to transformers' CLIPImageProcessor."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import transformers
from diffusers.utils import load_image
from diffusers.video_processor import VideoProcessor
from PIL import Image

from runtime.generation.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    ClipProcessor,
    clip_pixels,
    condition_pixels,
    read_image,
)
from wan.errors import InputError
from wan.strict_config import ConfigKeyError, WeightError

RNG = np.random.default_rng(0)


def _noise(width: int, height: int, channels: int = 3) -> np.ndarray:
    return RNG.integers(0, 256, (height, width, channels), dtype=np.uint8)


def _rgb(width: int, height: int) -> Image.Image:
    return Image.fromarray(_noise(width, height))


def _saved(image: Image.Image, path: Path, format: str = "PNG", **options) -> Path:
    image.save(path, format, **options)
    return path


def _png_bytes(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG", **options)
    return out.getvalue()


def _refused(source, match: str) -> str:
    with pytest.raises(InputError, match=match) as e:
        read_image(source)
    message = str(e.value)
    assert "\n" not in message and message.startswith("the image")
    return message


def _diffusers(path: Path) -> Image.Image:
    with warnings.catch_warnings():  # its convert("RGB") warns on a palette with alpha
        warnings.simplefilter("ignore")
        return load_image(str(path))


def _as_diffusers(path: Path) -> Image.Image:
    """read_image(path), checked to be diffusers' load_image(path), pixel for pixel."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read_image itself warns about nothing
        ours = read_image(path)
    theirs = _diffusers(path)
    assert ours.mode == "RGB" and ours.size == theirs.size
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert ours.info.get("transparency") == theirs.info.get("transparency")
    return ours


# --- refused ---------------------------------------------------------------------------------


def _with_size(png: bytes, width: int, height: int) -> bytes:
    """`png` whose IHDR claims width x height (with a valid CRC): no pixel data to match."""
    ihdr = b"IHDR" + struct.pack(">II", width, height) + png[24:29]
    return png[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]


@pytest.mark.parametrize("side", [100_000, 9000])
def test_a_decompression_bomb_is_refused_from_its_header(tmp_path, side):
    """100000x100000 passes Pillow's own bound (an error); 9000x9000 (81 MP) is under it."""
    path = tmp_path / "bomb.png"
    path.write_bytes(_with_size(_png_bytes(_rgb(4, 4)), side, side))
    message = _refused(path, "pixels: give a smaller image")
    assert side == 100_000 or f"is {side}x{side}, over {MAX_IMAGE_PIXELS} pixels" in message


def test_a_file_over_the_limit_is_refused_unread(tmp_path):
    path = tmp_path / "huge.png"
    with path.open("wb") as f:
        f.truncate(MAX_IMAGE_BYTES + 1)  # sparse: nothing written
    _refused(path, "is over 64 MiB")
    _refused(bytes(MAX_IMAGE_BYTES + 1), "is over 64 MiB")


def test_no_regular_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo.png")  # opening it to read would wait for a writer
    _refused(tmp_path / "fifo.png", "is not a regular file")
    _refused(tmp_path, "is not a regular file")
    _refused(tmp_path / "missing.png", "is missing")


@pytest.mark.parametrize("format", ["GIF", "TIFF", "BMP"])
def test_other_formats_are_refused(tmp_path, format):
    path = _saved(_rgb(8, 8), tmp_path / "image.png", format)
    _refused(path, "is not a PNG, JPEG or WebP image")


def test_text_named_png_is_refused(tmp_path):
    path = tmp_path / "notes.png"
    path.write_text("not an image\n")
    message = _refused(path, "is not a PNG, JPEG or WebP image")
    assert str(path) in message
    _refused(b"", "is not a PNG, JPEG or WebP image")


@pytest.mark.parametrize("format", ["JPEG", "PNG", "WEBP"])
def test_truncated_data_is_refused(tmp_path, format):
    data = (_saved(_rgb(64, 64), tmp_path / "whole", format)).read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) * 2 // 3])
    _refused(tmp_path / "cut", "is truncated or corrupt")


def test_corrupt_data_is_refused(tmp_path):
    data = bytearray(_saved(_rgb(64, 64), tmp_path / "whole", "PNG").read_bytes())
    data[60:80] = bytes(20)  # inside the compressed pixels
    _refused(bytes(data), "is truncated or corrupt")


# Third round (issue 53): what a decode costs, and Pillow's errors the first rounds missed.

# What a fresh process's memory grows by at its peak while `grown()` runs, in MiB: its peak
# reset first (Linux's clear_refs), the imports' own peak not counted.
_GROWTH = """
import re, sys, threading
from runtime.generation.images import read_image
from wan.errors import InputError

def status(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read())[1]) >> 10

def grown(call):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    call()
    return status("VmHWM") - before
"""
# A fresh process reads the file argv[1] as bytes: the line (or "accepted") and the growth.
_PEAK = (
    _GROWTH
    + """
data = open(sys.argv[1], "rb").read()
def read():
    try:
        read_image(data)
        print("accepted")
    except InputError as e:
        print(e)
print(grown(read))
"""
)


def _animated_webp(canvas: int) -> bytes:
    """A two-frame animated WebP of 16x16 frames whose header (VP8X) declares a canvas of
    canvas x canvas: a few hundred bytes."""
    out = io.BytesIO()
    first, second = Image.new("RGB", (16, 16), "red"), Image.new("RGB", (16, 16), "blue")
    first.save(out, "WEBP", save_all=True, append_images=[second])
    data = bytearray(out.getvalue())
    assert data[12:16] == b"VP8X"
    data[24:30] = (canvas - 1).to_bytes(3, "little") * 2  # its width - 1, height - 1
    return bytes(data)


@pytest.mark.parametrize(
    "image",
    [
        _with_size(_png_bytes(_rgb(4, 4)), 1, 67_108_864),  # was 514 MiB before its 400
        _animated_webp(8000),  # was 980 MiB, and accepted
    ],
    ids=["a 1 x 67,108,864 PNG", "an animated WebP on an 8000 x 8000 canvas"],
)
def test_a_canvas_past_the_bound_costs_nothing(tmp_path, image):
    """A few hundred bytes declaring a huge canvas: refused from the header, in a process whose
    memory grows by less than 32 MiB."""
    assert len(image) < 400
    (tmp_path / "image").write_bytes(image)
    result = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path / "image")],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    line, grown = result.stdout.splitlines()
    assert f"over {MAX_IMAGE_PIXELS} pixels: give a smaller image" in line, line
    assert int(grown) < 32, grown


def test_decodes_at_once_are_bounded(tmp_path):
    """Eight threads read a 16 MP PNG (under the bound) at once: the process's memory grows by
    at most as many decodes as MAX_DECODES (and one returning), not eight."""
    from runtime.generation.images import (
        MAX_DECODES,  # new with the bound: the file runs on older trees
    )

    path = _saved(Image.new("RGB", (4000, 4000), (10, 200, 30)), tmp_path / "large.png")
    probe = (
        _GROWTH
        + """
def eight():
    threads = [threading.Thread(target=read_image, args=(sys.argv[1],)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print(grown(lambda: read_image(sys.argv[1])), grown(eight))
"""
    )
    result = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True,
                            text=True, check=True, timeout=120)  # fmt: skip
    one, eight = map(int, result.stdout.split())
    assert one > 30 and eight <= (MAX_DECODES + 1) * one, (one, eight)


def _palette_png(colours: int, transparent: int) -> bytes:
    """A palette PNG of `colours` colours with `transparent` tRNS entries, by hand (Pillow
    writes no more entries than colours)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    rows = b"".join(b"\0" + bytes(range(8)) for _ in range(8))
    return b"".join([
        b"\x89PNG\r\n\x1a\n",
        chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 3, 0, 0, 0)),
        chunk(b"PLTE", bytes(range(3 * colours))),
        chunk(b"tRNS", b"\x80" * transparent),
        chunk(b"IDAT", zlib.compress(rows)),
        chunk(b"IEND", b""),
    ])  # fmt: skip


def test_a_palette_with_more_transparency_than_colours_is_one_line(tiny_weights, tmp_path):
    """300 transparency entries for an 8-colour palette (Pillow's ValueError escaped): one line
    from read_image, a 400 from the server's check of an input_reference, exit 2 from
    `runtime run --image`."""
    from click.testing import CliRunner

    from runtime.cli import cli
    from runtime.serve.openai_dialect import ApiError, check_image

    data = _palette_png(8, 300)
    _refused(data, "is truncated or corrupt")
    with pytest.raises(ApiError) as refused:
        check_image(data, "64x96")
    assert refused.value.status == 400 and refused.value.param == "input_reference"
    path = tmp_path / "palette.png"
    path.write_bytes(data)
    result = CliRunner().invoke(cli, [
        "run", "--weights", str(tiny_weights), "--res", "64x96", "--frames", "5", "--prompt",
        "a", "--image", str(path), "--out", str(tmp_path / "v.mp4")])  # fmt: skip
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: --image") and str(path) in line, line


# --- read as diffusers reads them ------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, format",
    [
        ("RGB", "PNG"),
        ("RGBA", "PNG"),
        ("LA", "PNG"),
        ("L", "PNG"),
        ("1", "PNG"),
        ("RGB", "JPEG"),
        ("L", "JPEG"),
        ("CMYK", "JPEG"),
        ("RGB", "WEBP"),
        ("RGBA", "WEBP"),
    ],
)
def test_modes_read_as_diffusers_load_image(tmp_path, mode, format):
    """Alpha is dropped (the colours under it stay), grey and CMYK converted as Pillow does."""
    channels = len(Image.new(mode, (1, 1)).getbands())
    pixels = _noise(24, 16, channels)
    image = (
        Image.fromarray(pixels[..., 0] > 127)
        if mode == "1"
        else Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)
    )
    path = _saved(image, tmp_path / f"image.{format.lower()}", format, lossless=True)
    with Image.open(path) as opened:
        assert opened.mode == mode
    ours = _as_diffusers(path)
    if mode == "RGBA" and format == "PNG":
        np.testing.assert_array_equal(np.asarray(ours), pixels[..., :3])


@pytest.mark.parametrize("transparency", [1, bytes([0, 128, 255, 64])])
def test_a_palette_with_transparency_reads_as_diffusers(tmp_path, transparency):
    """One transparent index is a colour key load_image keeps (CLIP composites it onto white);
    alpha per index is dropped, without Pillow's warning."""
    image = Image.fromarray(RNG.integers(0, 4, (16, 24), dtype=np.uint8), "P")
    image.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9])
    path = _saved(image, tmp_path / "palette.png", transparency=transparency)
    with Image.open(path) as opened:
        assert opened.mode == "P" and opened.info["transparency"] == transparency
    _as_diffusers(path)


def test_a_16_bit_png_keeps_its_high_bytes(tmp_path):
    """load_image clips 16-bit grey to 0-255 (white above 255); read_image scales it."""
    grey = (np.arange(16 * 24, dtype=np.uint32).reshape(16, 24) * 170).astype(np.uint16)
    path = _saved(Image.fromarray(grey), tmp_path / "deep.png")
    with Image.open(path) as opened:
        assert opened.mode == "I;16"
    ours = np.asarray(read_image(path))
    np.testing.assert_array_equal(ours, np.repeat((grey >> 8).astype(np.uint8)[..., None], 3, -1))
    assert np.asarray(_diffusers(path))[-1, -1].tolist() == [255, 255, 255]


def test_exif_orientation_is_applied(tmp_path):
    """Orientation 6 (turn 90 degrees clockwise): the 40x20 file reads as 20x40."""
    exif = Image.Exif()
    exif[0x0112] = 6
    path = _saved(_rgb(40, 20), tmp_path / "turned.jpg", "JPEG", exif=exif, quality=95)
    ours = _as_diffusers(path)
    assert ours.size == (20, 40)
    with Image.open(path) as opened:
        np.testing.assert_array_equal(
            np.asarray(ours), np.asarray(opened.transpose(Image.Transpose.ROTATE_270))
        )


def test_an_animation_gives_its_first_frame(tmp_path):
    first, second = _rgb(24, 16), _rgb(24, 16)
    path = _saved(first, tmp_path / "animated.png", save_all=True, append_images=[second])
    with Image.open(path) as opened:
        assert opened.n_frames == 2
    np.testing.assert_array_equal(np.asarray(_as_diffusers(path)), np.asarray(first))


def test_bytes_read_as_the_file(tmp_path):
    path = _saved(_rgb(24, 16), tmp_path / "image.png")
    named = np.asarray(read_image(str(path)))
    np.testing.assert_array_equal(np.asarray(read_image(path.read_bytes())), named)


# --- the VAE condition -----------------------------------------------------------------------


def _preprocess(image: Image.Image, width: int, height: int, **options) -> np.ndarray:
    """WanImageToVideoPipeline's video_processor.preprocess, channels-last."""
    tensor = VideoProcessor(vae_scale_factor=8).preprocess(
        image, height=height, width=width, **options
    )
    return tensor[0].permute(1, 2, 0).numpy()


@pytest.mark.parametrize(
    "image_size, build",
    [
        ((150, 100), (96, 64)),
        ((100, 150), (64, 96)),
        ((48, 32), (96, 64)),
        ((832, 480), (832, 480)),
    ],
)
def test_condition_pixels_equal_diffusers_preprocess(image_size, build):
    """Landscape and portrait builds, images of the build's aspect larger, smaller, equal."""
    image = _rgb(*image_size)
    ours = condition_pixels(image, *build)
    assert ours.dtype == np.float32 and ours.shape == (build[1], build[0], 3)
    np.testing.assert_allclose(ours, _preprocess(image, *build), rtol=0, atol=1e-6)
    assert ours.min() >= -1 and ours.max() <= 1


@pytest.mark.parametrize("image_size", [(120, 100), (100, 100), (150, 80)])
def test_another_aspect_is_cropped_not_stretched(image_size):
    """A 6:5, square or wider image for a 3:2 build: diffusers' preprocess in its crop mode."""
    image = _rgb(*image_size)
    ours = condition_pixels(image, 96, 64)
    np.testing.assert_allclose(ours, _preprocess(image, 96, 64, resize_mode="crop"), atol=1e-6)
    assert not np.allclose(ours, _preprocess(image, 96, 64), atol=1e-2)  # the stretched one


@pytest.mark.parametrize("image_size, build", [((100, 150), (96, 64)), ((300, 100), (64, 96))])
def test_a_far_aspect_is_refused(image_size, build):
    with pytest.raises(InputError, match="crop") as e:
        condition_pixels(_rgb(*image_size), *build, what="--last-image x.png")
    message = str(e.value)
    assert "\n" not in message and message.startswith("--last-image x.png is ")
    assert f"{image_size[0]}x{image_size[1]}" in message and f"{build[0]}x{build[1]}" in message


# --- the CLIP input --------------------------------------------------------------------------


@pytest.fixture
def saved_clip(tmp_path) -> tuple[Path, object]:
    """A Wan I2V folder's image_processor, saved by transformers and loaded back with the class
    diffusers' pipeline loads it with (`transformers.CLIPImageProcessor`)."""
    transformers.CLIPImageProcessor().save_pretrained(tmp_path / "image_processor")
    return tmp_path, transformers.CLIPImageProcessor.from_pretrained(tmp_path / "image_processor")


def test_the_clip_processor_is_read_from_the_folder(saved_clip):
    folder, _ = saved_clip
    assert ClipProcessor.read(folder) == ClipProcessor()


@pytest.mark.parametrize("image_size", [(640, 480), (300, 500), (224, 224), (97, 131)])
def test_clip_pixels_equal_transformers(saved_clip, image_size):
    folder, theirs = saved_clip
    image = _rgb(*image_size)
    ours = clip_pixels(image, ClipProcessor.read(folder))
    expected = theirs(images=image, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    assert ours.dtype == np.float32 and ours.shape == (224, 224, 3)
    # Where torchvision is installed transformers picks its torchvision backend: one or two
    # uint8 levels away from PIL's bicubic at a few pixels (see clip_pixels).
    np.testing.assert_allclose(ours, expected, atol=1e-5 if theirs.backend == "pil" else 0.03)


def test_clip_pixels_composite_a_colour_key_onto_white(saved_clip, tmp_path):
    folder, theirs = saved_clip
    image = Image.fromarray(RNG.integers(0, 4, (300, 400), dtype=np.uint8), "P")
    image.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9])
    read = _as_diffusers(_saved(image, tmp_path / "keyed.png", transparency=3))
    ours = clip_pixels(read, ClipProcessor.read(folder))
    expected = theirs(images=read, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
    np.testing.assert_allclose(ours, expected, atol=1e-5 if theirs.backend == "pil" else 0.03)
    unkeyed = Image.fromarray(np.asarray(read))  # the same pixels, no colour key
    assert not np.allclose(ours, clip_pixels(unkeyed, ClipProcessor()), atol=0.1)


def _config(folder: Path, **changes) -> Path:
    path = folder / "image_processor" / "preprocessor_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return path


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"crop_pct": 0.9}, ConfigKeyError, "crop_pct is a key this project does not understand"),
        ({"image_processor_type": "SiglipImageProcessor"}, ConfigKeyError, "image_processor_type"),
        ({"do_center_crop": False}, ConfigKeyError, "do_center_crop is false"),
        ({"image_std": [0.2, 0, 0.3]}, WeightError, "image_std is"),
        ({"image_mean": [0.5, 0.5]}, WeightError, "image_mean is"),
        ({"size": {"height": 224, "width": 224}}, WeightError, "size is"),
        ({"crop_size": {"height": 256, "width": 256}}, WeightError, "crop_size is"),
        ({"resample": 9}, WeightError, "resample is 9"),
        ({"rescale_factor": "1/255"}, WeightError, "rescale_factor is"),
    ],
)
def test_a_clip_config_it_does_not_implement_is_refused(saved_clip, changes, error, match):
    folder, _ = saved_clip
    path = _config(folder, **changes)
    with pytest.raises(error, match=match) as e:
        ClipProcessor.read(folder)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: ")


def test_a_clip_config_that_is_no_json_object_is_refused(tmp_path):
    with pytest.raises(WeightError, match="is missing: restore the model's original file"):
        ClipProcessor.read(tmp_path)
    (tmp_path / "image_processor").mkdir()
    (tmp_path / "image_processor" / "preprocessor_config.json").write_text("[]")
    with pytest.raises(WeightError, match="expected a JSON object"):
        ClipProcessor.read(tmp_path)
