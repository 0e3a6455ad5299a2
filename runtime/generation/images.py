"""Image-to-video input, host side: an outside image file read safely (`read_image`), and the
arrays the device programs take from it: the VAE condition (`condition_pixels`, as diffusers'
`WanImageToVideoPipeline` preprocesses `image` and `last_image`) and the CLIP image encoder's
input (`clip_pixels`, as transformers' `CLIPImageProcessor` that pipeline loads). No jax here:
a request's image is checked, and refused with one line, before jax starts."""

from __future__ import annotations

import dataclasses
import io
import threading
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from wan import bounded_read
from wan.errors import InputError
from wan.strict_config import ConfigKeyError, WeightError, check_value, excerpt, is_int, is_number

# An image file is a few MiB and a video frame under a megapixel: far larger input is a mistake
# or an attack, refused from its header before it costs memory. A decode costs about 15 bytes a
# pixel of the canvas at its peak (WebP: libwebp's canvases and Pillow's image): 16.8 MP (a
# 12 MP photo fits) is about 250 MiB, and at most MAX_DECODES run at once in a process (the
# server's requests and its batches together), the others waiting their turn.
MAX_IMAGE_BYTES = 64 << 20
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGE_SIDE = 8192
MAX_DECODES = 2
_DECODES = threading.BoundedSemaphore(MAX_DECODES)
# The most of an image `condition_pixels` crops away to fit the build's aspect ratio: a 4:3 or
# square photo fits a 16:9 build (23%, 42% cropped); a portrait photo (57%) is refused.
MAX_CROP = 0.5

_FORMATS = ("PNG", "JPEG", "WEBP")
_REMEDY = f"give a PNG, JPEG or WebP image of at most {MAX_IMAGE_BYTES >> 20} MiB"
# Modes whose convert("RGB") is what diffusers' load_image gives and a faithful 8-bit picture.
_RGB_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA", "CMYK"})


def read_image(source: str | Path | bytes, *, what: str = "the image") -> Image.Image:
    """The image in the file `source` (a path, or the file's bytes) as an 8-bit RGB image, as
    diffusers' `load_image` gives it: EXIF orientation applied, then `convert("RGB")`.

    Refused, with one line naming `what` (and the path): a file over MAX_IMAGE_BYTES or that is
    no regular file; anything but PNG, JPEG or WebP; a canvas over MAX_IMAGE_SIDE a side or
    MAX_IMAGE_PIXELS (from the header, before any pixel is decoded; Pillow and libwebp refuse
    an animation's frame outside its canvas); anything Pillow cannot read (truncated or
    corrupt data, the first frame fully decoded; a palette's transparency longer than the
    palette). At most MAX_DECODES decode at once in a process.

    Policies:
    - alpha (RGBA, LA, a palette's transparency) is dropped, not composited: the colours stored
      under transparent pixels stay, as load_image's convert("RGB") leaves them. A colour key (a
      PNG's tRNS in an RGB, L or one-index palette image) stays in `info["transparency"]`, as it
      does there, so that `clip_pixels` composites it onto white as transformers does.
    - 16-bit grayscale PNG keeps each sample's high byte, as Pillow reads 16-bit colour PNGs;
      load_image differs here (convert("RGB") clips every sample above 255 to white).
    - an animated image (APNG, animated WebP) or a camera's multi-picture JPEG gives its first
      frame, as load_image does: the still that viewers without animation show.
    """
    if isinstance(source, bytes):
        name = what
        if len(source) > MAX_IMAGE_BYTES:
            raise InputError(f"{name} is over {MAX_IMAGE_BYTES >> 20} MiB: {_REMEDY}")
        data = source
    else:
        name = f"{what} {source}"
        data = bounded_read.read_bytes(
            Path(source), MAX_IMAGE_BYTES, lambda reason: InputError(f"{name} {reason}: {_REMEDY}")
        )
    with _DECODES:
        try:
            return _decode(data, name)
        except InputError:
            raise
        except Image.UnidentifiedImageError:
            raise InputError(f"{name} is not a PNG, JPEG or WebP image: {_REMEDY}") from None
        except Image.DecompressionBombError:  # Pillow's own bound, far above ours
            raise InputError(
                f"{name} has over {MAX_IMAGE_PIXELS} pixels: give a smaller image"
            ) from None
        except Exception as e:  # whatever else Pillow raises on data it cannot read
            raise _corrupt(name, e) from None


def _decode(data: bytes, name: str) -> Image.Image:
    """read_image's decode, once the file is read: Pillow's errors are the caller's to word."""
    image = Image.open(io.BytesIO(data), formats=_FORMATS)
    width, height = image.size  # the canvas, from the header
    if width * height > MAX_IMAGE_PIXELS:
        over = f"{MAX_IMAGE_PIXELS} pixels"
    elif max(width, height) > MAX_IMAGE_SIDE:
        over = f"{MAX_IMAGE_SIDE} pixels a side"
    else:
        over = None
    if over:
        raise InputError(f"{name} is {width}x{height}, over {over}: give a smaller image")
    image.load()
    ImageOps.exif_transpose(image, in_place=True)  # no copy: memory is the bound's
    if image.mode == "I;16":
        return Image.fromarray((np.asarray(image) >> 8).astype(np.uint8)).convert("RGB")
    if image.mode not in _RGB_MODES:
        raise InputError(
            f"{name} has {image.mode} pixels, which this does not read: save it as RGB"
        )
    if image.mode == "P" and isinstance(image.info.get("transparency"), bytes):
        # The same colours, without the warning Pillow gives converting such a palette to RGB.
        image = image.convert("RGBA")
    return image if image.mode == "RGB" else image.convert("RGB")


def _corrupt(name: str, e: Exception) -> InputError:
    reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
    return InputError(f"{name} is truncated or corrupt ({reason}): give the whole file, as saved")


def check_fit(image: Image.Image, width: int, height: int, *, what: str = "the image") -> None:
    """Refuse an image whose crop to a width x height video would discard more than MAX_CROP of
    it (a portrait photo for a landscape build): the video would lose what the picture is of."""
    w, h = image.size
    ratio, src_ratio = width / height, w / h
    discarded = 1 - min(ratio, src_ratio) / max(ratio, src_ratio)
    if discarded > MAX_CROP:
        raise InputError(
            f"{what} is {w}x{h}: fitting it to this build's {width}x{height} video would crop "
            f"{discarded:.0%} of it away (more than {MAX_CROP:.0%}); give an image of a shape "
            f"nearer {width}x{height}, cropped or padded as you want it"
        )


def condition_pixels(
    image: Image.Image, width: int, height: int, *, what: str = "the image"
) -> np.ndarray:
    """The VAE condition frame (height, width, 3) float32 in [-1, 1] from an RGB `image` (as
    `read_image` gives), as diffusers' `VideoProcessor.preprocess(image, height=height,
    width=width, resize_mode="crop")`: Lanczos-resized to cover width x height, centre-cropped,
    scaled to [-1, 1]. For an image of the build's aspect ratio that is exactly the pipeline's
    own preprocess (its default mode, which would stretch any other image out of shape).

    Refused when the crop would discard more than MAX_CROP of the image (`check_fit`)."""
    check_fit(image, width, height, what=what)
    w, h = image.size
    ratio, src_ratio = width / height, w / h
    # diffusers' VaeImageProcessor._resize_and_crop, which pastes the middle into the frame.
    src_w = width if ratio > src_ratio else w * height // h
    src_h = height if ratio <= src_ratio else h * width // w
    resized = np.asarray(image.resize((src_w, src_h), Image.Resampling.LANCZOS))
    top, left = src_h // 2 - height // 2, src_w // 2 - width // 2
    pixels = resized[top : top + height, left : left + width].astype(np.float32) / 255.0
    return 2.0 * pixels - 1.0


OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MAX_CONFIG_BYTES = 1 << 20  # a preprocessor_config.json is under 1 KiB
# Keys that only name the processor, and the names a CLIP image processor goes by.
_NAMES = {
    "image_processor_type": ("CLIPImageProcessor", "CLIPImageProcessorFast"),
    "processor_class": ("CLIPProcessor",),
    "feature_extractor_type": ("CLIPFeatureExtractor",),
}


@dataclasses.dataclass(frozen=True)
class ClipProcessor:
    """transformers' `CLIPImageProcessor` settings, as a diffusers Wan I2V folder's
    `image_processor/preprocessor_config.json` holds them; the defaults are OpenAI CLIP's (and
    transformers'). Resizing and centre-cropping are always on (`do_resize`, `do_center_crop`
    must be true): the image encoder takes a crop of one size."""

    shortest_edge: int = 224  # `size`: the short side is resized to this
    resample: int = 3  # a PIL filter: 3 is bicubic
    crop_height: int = 224
    crop_width: int = 224
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    do_convert_rgb: bool = True

    @classmethod
    def read(cls, model_dir: str | Path) -> ClipProcessor:
        """The settings in `model_dir`/image_processor/preprocessor_config.json, read strictly:
        a key this does not implement, or a value out of range, is a one-line WeightError."""
        path = Path(model_dir) / "image_processor" / "preprocessor_config.json"
        raw = bounded_read.read_json(
            path,
            _MAX_CONFIG_BYTES,
            lambda reason: WeightError(f"{path} {reason}: restore the model's original file"),
            allow_nan=True,  # refused below, naming the key
        )
        try:
            return cls._from_dict(raw)
        except ConfigKeyError as e:
            raise ConfigKeyError(f"{path}: {e}") from None
        except WeightError as e:
            raise WeightError(f"{path}: {e}: restore the model's original file") from None

    @classmethod
    def _from_dict(cls, raw: Any) -> ClipProcessor:
        if not isinstance(raw, dict):
            raise WeightError(f"the config is {excerpt(raw)}, expected a JSON object")
        fields: dict[str, Any] = {}
        for key, value in raw.items():
            if key in _NAMES:
                check_value(key, value, _NAMES[key])
            elif key in ("do_resize", "do_center_crop"):
                check_value(key, value, (True,))
            elif key in ("do_rescale", "do_normalize", "do_convert_rgb"):
                _expect(isinstance(value, bool), key, value, "true or false")
                fields[key] = value
            elif key == "size":
                fields["shortest_edge"] = _sides(key, value, ("shortest_edge",))[0]
            elif key == "crop_size":
                fields["crop_height"], fields["crop_width"] = _sides(
                    key, value, ("height", "width")
                )
            elif key == "resample":
                _expect(is_int(value) and 0 <= value <= 5, key, value, "a PIL filter, 0 to 5")
                fields[key] = value
            elif key == "rescale_factor":
                _expect(is_number(value) and value > 0, key, value, "a positive number")
                fields[key] = value
            elif key in ("image_mean", "image_std"):
                _expect(
                    isinstance(value, list)
                    and len(value) == 3
                    and all(is_number(v) and (key == "image_mean" or v > 0) for v in value),
                    key,
                    value,
                    "a list of 3 numbers" + (", each positive" if key == "image_std" else ""),
                )
                fields[key] = tuple(value)
            else:
                raise ConfigKeyError(
                    f"{key} is a key this project does not understand in a CLIP image processor "
                    "config: it may change what the image encoder sees, so nothing runs"
                )
        processor = cls(**fields)
        # Else transformers pads the resized image with black to the crop, which is not done here.
        _expect(
            max(processor.crop_height, processor.crop_width) <= processor.shortest_edge,
            "crop_size",
            raw.get("crop_size"),
            f"a crop within the resized image (size.shortest_edge {processor.shortest_edge})",
        )
        return processor


def _expect(condition: bool, key: str, value: Any, expected: str) -> None:
    if not condition:
        raise WeightError(f"{key} is {excerpt(value)}, expected {expected}")


def _sides(key: str, value: Any, names: tuple[str, ...]) -> tuple[int, ...]:
    """The sides in a `size`-like dict, exactly the keys `names`, each 1-4096 pixels."""
    _expect(
        isinstance(value, dict)
        and sorted(value) == sorted(names)
        and all(is_int(v) and 1 <= v <= 4096 for v in value.values()),
        key,
        value,
        "{" + ", ".join(f'"{n}": 1-4096' for n in names) + "}",
    )
    return tuple(value[n] for n in names)


def clip_pixels(image: Image.Image, processor: ClipProcessor) -> np.ndarray:
    """The CLIP image encoder's input (crop_height, crop_width, 3) float32, channels-last, from
    the RGB `image` as `read_image` gives it (the whole image, not the build's crop: the
    pipeline encodes the image it was given): what transformers' `CLIPImageProcessor` (its PIL
    backend, `CLIPImageProcessorPil`) computes, to float32 rounding. Bicubic resize of the
    short side to `shortest_edge` (the long side truncated), centre crop, rescale in float64
    to float32, then (x - mean) / std in float32.

    transformers 5 picks its torchvision backend for `CLIPImageProcessor` where torchvision is
    installed (else this PIL one, as in this project's environment): that resizes the uint8
    tensor with torch's antialiased bicubic, which puts 0.2-0.7% of the values one uint8 level
    (0.015 after the std) from PIL's, two (0.03) upscaling a small image; the rest agree to
    1e-6 (measured with torchvision 0.28, transformers 5.25)."""
    if processor.do_convert_rgb and image.info.get("transparency") is not None:
        # transformers composites a colour-keyed image onto white (convert_to_rgb).
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    w, h = image.size
    short, crop_h, crop_w = processor.shortest_edge, processor.crop_height, processor.crop_width
    # transformers' get_resize_output_image_size(default_to_square=False).
    size = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
    resized = np.asarray(image.resize(size, processor.resample))
    top, left = (size[1] - crop_h) // 2, (size[0] - crop_w) // 2
    pixels = resized[top : top + crop_h, left : left + crop_w]
    if processor.do_rescale:
        pixels = (pixels.astype(np.float64) * processor.rescale_factor).astype(np.float32)
    pixels = pixels.astype(np.float32, copy=False)
    if processor.do_normalize:
        mean = np.array(processor.image_mean, np.float32)
        pixels = (pixels - mean) / np.array(processor.image_std, np.float32)
    return pixels
