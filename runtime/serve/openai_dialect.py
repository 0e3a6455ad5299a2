"""OpenAI's Videos API as `runtime serve` speaks it, so that the official `openai` SDK works
unchanged: the request of `POST /v1/videos` read from JSON or from a form (the SDK always sends
multipart/form-data), `seconds` counted into frames as Wan counts them, the served `model`, the
video object, the list page, the model list and the error object the SDK turns into its typed
exceptions, and `input_reference`, image to video's first frame (a file part of the form, read
and checked by runtime.generation.images). No HTTP routes here (runtime.serve.server) and no worker
(runtime.serve.service)."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from runtime.builds.loader import Route, describe_route
from runtime.generation import MAX_SCALE, MAX_SEED, Settings, check_text, images
from runtime.serve.job_store import Job
from wan.bounded_read import parse_json
from wan.configs import SAMPLERS
from wan.errors import InputError

MAX_STEPS = 1000
CFG_ABOVE = 1.0  # a guidance above it runs a CFG build (the route's `cfg`)
# A form may hold each field of VideoRequest once, and one file: IMAGE_FIELD.
MAX_FORM_FIELDS = 32
MAX_FORM_FILES = 1
# A form's number field, in characters: a seed (2^53 - 1) is 16 digits, a float's repr 24.
MAX_NUMBER_CHARS = 64
# OpenAI's field for a reference image, which the SDK uploads as a file part of its form: the
# first frame of an image-to-video video (not taken as a `file_id` or an `image_url`).
IMAGE_FIELD = "input_reference"
# `seconds` as a string: a plain decimal ("5", "0.25"), what the SDK sends.
DECIMAL = r"^[0-9]{1,6}(\.[0-9]{1,6})?$"
# `seconds` may miss a whole number of frames by this much (a printed 1/3 s is 0.333333 s).
FRAME_SLACK = 0.01
# The media type of each `variant` of GET /v1/videos/{id}/content (runtime.serve.job_store.CONTENT).
MEDIA_TYPES = {"video": "video/mp4", "thumbnail": "image/webp", "spritesheet": "image/jpeg",
               "frames": "application/octet-stream"}  # fmt: skip

# OpenAI's video operations this server does not do (the SDK's call at each method and path):
# answered with the error object saying so (400), not a bare 404 or 405.
UNSUPPORTED = {
    ("POST", "/v1/videos/{video_id}/remix"): "videos.remix",
    ("POST", "/v1/videos/edits"): "videos.edit",
    ("POST", "/v1/videos/extensions"): "videos.extend",
    ("POST", "/v1/videos/characters"): "videos.create_character",
    ("GET", "/v1/videos/characters/{character_id}"): "videos.get_character",
}

# Why the server answers each error status (the OpenAPI schema's descriptions).
ERRORS = {
    400: "The request does not hold what the operation takes.",
    401: "No API key, or not one of the server's (a server run with keys).",
    404: "No such video or model (or no such variant of it kept).",
    408: "The request body did not arrive within --body-timeout.",
    409: "The video is not in a state that allows this.",
    410: "The video's file is no longer in --out-dir.",
    413: "The request body is over --max-body-bytes.",
    429: "The queue holds --max-queue videos.",
    500: "A bug in the server (one line in its log).",
    503: "The server is shutting down, or its job store is unusable for now.",
}


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(BaseModel):
    """Every error answer, OpenAI's error object: {"error": {"message", "type", "param",
    "code"}}; the SDK raises its exception of the status (BadRequestError for 400, ...)."""

    error: _ErrorDetail


class ApiError(Exception):
    """An HTTP error answered as OpenAI's error object; `param`: the request field at fault."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


def error_response(
    status: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"  # OpenAI's types
    detail = _ErrorDetail(message=message, type=kind, param=param, code=code)
    return JSONResponse(ErrorBody(error=detail).model_dump(), status_code=status, headers=headers)


class VideoRequest(BaseModel):
    """The body of POST /v1/videos, as JSON or as form fields: strict types, no unknown fields.
    `model`, `seconds` and `size` are OpenAI's; the others this server's extensions (the SDK's
    `extra_body`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1)
    negative_prompt: str = ""
    model: str | None = Field(None, description="A served model (GET /v1/models).")
    size: Annotated[str, Field(pattern=r"^[1-9][0-9]{0,4}x[1-9][0-9]{0,4}$")] | None = Field(
        None, description="WxH; omitted: the one size the model is served at for the length."
    )
    seconds: (
        Annotated[str, Field(pattern=DECIMAL)] | Annotated[float, Field(ge=0, le=1e6)] | None
    ) = Field(None, description="The length: seconds x fps + 1 frames (81: 5 s at 16 fps).")
    frames: int | None = Field(None, ge=1, le=10_000, description="The length in frames.")
    steps: int = Field(50, ge=1, le=MAX_STEPS)
    guidance: float = Field(5.0, ge=-MAX_SCALE, le=MAX_SCALE)
    guidance_2: float | None = Field(None, ge=-MAX_SCALE, le=MAX_SCALE)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # None: a random one, recorded
    sampler: Literal[SAMPLERS] | None = None
    shift: float | None = Field(None, gt=0, le=MAX_SCALE)

    @field_validator("frames", "steps", "seed", mode="before")
    @classmethod
    def _whole(cls, value: Any) -> Any:
        """A JSON integer may be written 5.0 (JSON Schema's, so the API's); strict mode would
        refuse it."""
        return int(value) if isinstance(value, float) and value.is_integer() else value

    @field_validator("prompt", "negative_prompt")
    @classmethod
    def _utf8(cls, text: str) -> str:
        check_text("the text", text)  # a JSON string may hold a lone surrogate
        return text

    @field_validator("guidance", "guidance_2", "shift")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("give a finite number")
        return value

    def settings(self) -> Settings:
        """What every video of its batch shares."""
        return Settings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Settings)})


@dataclasses.dataclass(frozen=True)
class ServedBuild:
    """A loaded build as the API names it."""

    name: str
    model: str  # its BuildKey.model, the API's `model`
    fps: int  # its model's frame rate (ModelConfig.fps)
    route: Route  # what picks it (runtime.builds.loader.serving_routes)
    batch: int

    @property
    def image(self) -> bool:
        """Image to video: a request gives IMAGE_FIELD."""
        return self.route[4]


def seconds_text(frames: int, fps: int) -> str:
    """A length in frames as the API's `seconds` (a string): Wan's count, frames = s x fps + 1."""
    return f"{(frames - 1) / fps:g}"


def describe_builds(builds: Iterable[ServedBuild]) -> str:
    """What `builds` serve: '64x96 frames=5 guidance>1 (batch 2), ...'."""
    return ", ".join(
        f"{describe_route(b.route)} (batch {b.batch})" for b in sorted(builds, key=_by_route)
    )


def _by_route(build: ServedBuild) -> Route:
    return build.route


def describe_kinds(builds: Iterable[ServedBuild]) -> str:
    """What `builds` serve, by pipeline: 'text-to-video 64x96 frames=5 guidance>1 (batch 2)'."""
    builds = list(builds)
    return "; ".join(
        f"{kind} {describe_builds(of)}"
        for image, kind in ((False, "text-to-video"), (True, "image-to-video"))
        if (of := [b for b in builds if b.image == image])
    )


def lengths(builds: list[ServedBuild]) -> str:
    """The lengths `builds` make: '0.25 s (5 frames), 0.5 s (9 frames)'."""
    served = sorted({(b.route[2], b.fps) for b in builds})
    return ", ".join(f"{seconds_text(f, fps)} s ({f} frames)" for f, fps in served)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A request placed: the build that serves it, its model, frames and size ("WxH")."""

    build: str
    model: str
    frames: int
    size: str


def resolve(
    body: VideoRequest,
    builds: Mapping[str, ServedBuild],
    routes: Mapping[Route, str],
    image: bool = False,
) -> Resolved:
    """The model, length and build of a request among the served `builds` (`routes`: the one
    rule of which build serves a route), an image-to-video one exactly when it gives an image
    (`image`: IMAGE_FIELD given); a request none serves is a 400 naming what is served."""
    models = sorted({b.model for b in builds.values()})
    if body.model is None and len(models) != 1:
        raise ApiError(400, "invalid_request", f"give model: one of {', '.join(models)}", "model")
    model = body.model if body.model is not None else models[0]
    if model not in models:
        raise ApiError(
            400, "model_not_found", f"model {model} is not served; served: {', '.join(models)}",
            "model",
        )  # fmt: skip
    own = [b for b in builds.values() if b.model == model]
    frames = _frames(body, own, model)
    size = body.size or _only_size(own, model, frames)
    width, height = map(int, size.split("x"))
    cfg = body.guidance > CFG_ABOVE

    def serving(kind: bool) -> str | None:
        name = routes.get((width, height, frames, cfg, kind))
        return name if name is not None and builds[name].model == model else None

    name = serving(image)
    if name is None and serving(not image) is not None:
        made = f"this server makes {model} {size} videos of {frames} frames"
        why = (
            f"{made} from text only: leave {IMAGE_FIELD} out (an image needs an image-to-video "
            "build)"
            if image
            else f"{made} from an image: give {IMAGE_FIELD}, the first frame (a PNG, JPEG or WebP "
            "file)"
        )
        raise ApiError(400, "invalid_request", f"{why}; served: {describe_kinds(own)}", IMAGE_FIELD)
    if name is None:
        raise ApiError(
            400,
            "unsupported_shape",
            f"no loaded build of {model} makes size {size} with {frames} frames "
            f"{'with' if cfg else 'without'} CFG; served: {describe_kinds(own)}",
            "size",
        )
    return Resolved(name, model, frames, size)


def served_sizes(builds: Iterable[ServedBuild], frames: int) -> list[str]:
    """The sizes ("WxH") `builds` make videos of `frames` frames at."""
    return sorted({f"{b.route[0]}x{b.route[1]}" for b in builds if b.route[2] == frames})


def _only_size(own: list[ServedBuild], model: str, frames: int) -> str:
    """A request without `size`: the one size the model is served at for its length."""
    sizes = served_sizes(own, frames)
    if not sizes:
        raise ApiError(
            400, "unsupported_length",
            f"no loaded build of {model} makes {frames} frames; served: {lengths(own)}", "frames",
        )  # fmt: skip
    if len(sizes) > 1:
        raise ApiError(
            400, "invalid_request",
            f"give size: {model} is served at {', '.join(sizes)} for {frames} frames", "size",
        )  # fmt: skip
    return sizes[0]


def check_image(data: bytes, size: str) -> None:
    """IMAGE_FIELD's file read and fitted to the video as its batch will read it (runtime.generation.images):
    a bad one is the request's one-line 400, not its batch's failure."""
    width, height = map(int, size.split("x"))
    try:
        picture = images.read_image(data, what=IMAGE_FIELD)
        images.check_fit(picture, width, height, what=IMAGE_FIELD)
    except InputError as e:
        raise ApiError(400, "invalid_request", str(e), IMAGE_FIELD) from None


def _frames(body: VideoRequest, own: list[ServedBuild], model: str) -> int:
    """The request's frames: `frames`, or `seconds` at the model's frame rate, which must be a
    length some build of the model makes; both given, they must agree."""
    if body.seconds is None:
        if body.frames is None:
            raise ApiError(400, "invalid_request",
                           f"give seconds (served: {lengths(own)}) or frames", "seconds")  # fmt: skip
        return body.frames
    fps = own[0].fps  # one model, one frame rate
    exact = Fraction(body.seconds) * fps + 1
    frames = round(exact)
    whole = abs(exact - frames) <= FRAME_SLACK
    count = f"{frames} frames" if whole else "not a whole number of frames"
    # A contradiction first: which length is served matters only once the two agree.
    if body.frames is not None and (not whole or body.frames != frames):
        raise ApiError(
            400,
            "invalid_request",
            f"frames {body.frames} and seconds {body.seconds} ({count} at {fps} fps) "
            "disagree: give one of them",
            "frames",
        )
    if not whole or frames not in {b.route[2] for b in own}:
        raise ApiError(
            400,
            "unsupported_length",
            f"no loaded build of {model} makes {body.seconds} s ({count} at {fps} fps); "
            f"served: {lengths(own)}",
            "seconds",
        )
    return frames


async def read_video_request(
    request: Request, max_prompt_chars: int, max_body_bytes: int
) -> tuple[VideoRequest, bytes | None]:
    """POST /v1/videos' body, JSON or a form (multipart/form-data, the SDK's; or urlencoded),
    checked whole, and a form's IMAGE_FIELD file (not read as an image yet: `check_image`); the
    prompts at most `max_prompt_chars` each; a form's parts at most `max_body_bytes` (the body's
    own bound, runtime.serve.http_guards.BoundedBody)."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    image = None
    if media in ("multipart/form-data", "application/x-www-form-urlencoded"):
        fields, image = await _form_fields(request, max_body_bytes)
    elif media in ("", "application/json") or media.endswith("+json"):
        fields = parse_json(await request.body(), _not_json)
    else:
        raise ApiError(
            400, "invalid_request", f"a {media} body: send application/json or multipart/form-data"
        )
    if not isinstance(fields, dict):
        raise ApiError(400, "invalid_request", "the body is not a JSON object")
    if IMAGE_FIELD in fields:  # not a file: JSON's {"image_url": ...}, a form's text field
        raise ApiError(
            400,
            "invalid_request",
            f"{IMAGE_FIELD}: send the image file as a multipart/form-data file part, with a "
            f"filename (the SDK: {IMAGE_FIELD}=open(path, 'rb'); curl: -F {IMAGE_FIELD}=@cat.png); "
            "a file_id, an image_url or text is not taken",
            IMAGE_FIELD,
        )
    try:
        body = VideoRequest.model_validate(fields)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise ApiError(400, "invalid_request", message, param) from None
    for name in ("prompt", "negative_prompt"):
        if len(getattr(body, name)) > max_prompt_chars:
            raise ApiError(
                400,
                "invalid_request",
                f"{name}: {len(getattr(body, name))} characters, over the server's "
                f"{max_prompt_chars} (--max-prompt-chars): shorten it",
                name,
            )
    return body, image


def _not_json(reason: str) -> ApiError:
    return ApiError(400, "invalid_request", f"the body {reason}")


async def _form_fields(
    request: Request, max_part_bytes: int
) -> tuple[dict[str, Any], bytes | None]:
    """A form's fields as VideoRequest takes them (each field once, numbers read strictly as
    JSON numbers, an empty field of a number that may be null as null: the SDK sends a None so)
    and its one file, IMAGE_FIELD's. The body is whole already (runtime.serve.http_guards.BoundedBody)."""
    try:
        form = await request.form(
            max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS, max_part_size=max_part_bytes
        )
    except HTTPException as e:  # starlette's answer to a form that does not parse or is too big
        raise ApiError(400, "invalid_request", f"the form does not read: {e.detail}") from None
    fields: dict[str, Any] = {}
    image = None
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            if name != IMAGE_FIELD:
                raise ApiError(
                    400, "invalid_request", f"{name}: a file is taken only as {IMAGE_FIELD}", name
                )
            image = await value.read()
            continue
        if name in fields:
            raise ApiError(400, "invalid_request", f"{name}: given more than once", name)
        fields[name] = _form_value(name, value)
    return fields, image


def _form_value(name: str, text: str) -> Any:
    field = VideoRequest.model_fields.get(name)
    if field is None:
        return text  # refused by name as an unknown field
    kinds = set(typing.get_args(field.annotation)) or {field.annotation}
    if text == "" and types.NoneType in kinds:
        return None
    if not kinds - {types.NoneType} <= {int, float}:
        return text
    if len(text) > MAX_NUMBER_CHARS:  # before int(), which refuses 4,300 digits with a ValueError
        raise ApiError(
            400, "invalid_request",
            f"{name}: a number of {len(text)} characters: give at most {MAX_NUMBER_CHARS}", name,
        )  # fmt: skip
    if re.fullmatch(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?", text):
        value = float(text) if re.search(r"[.eE]", text) else int(text)
        if not isinstance(value, float) or math.isfinite(value):
            return value
    raise ApiError(400, "invalid_request", f"{name}: {text[:40]!r} is not a number", name)


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """Pydantic's errors as one line (field: problem; ...) and the first field at fault."""
    parts, params = [], []
    for err in errors:
        loc = [str(p) for p in err["loc"] if p not in ("body", "query", "path")]
        parts.append(f"{'.'.join(loc) or 'body'}: {err['msg']}")
        params += loc[:1]
    return "; ".join(parts), (params[0] if params else None)


def video_object(job: Job, fps: int, model: str | None) -> dict[str, Any]:
    """A job as OpenAI's video object and this server's fields (`build`, `frames`, `seed`,
    `steps`, `negative_prompt`, `guidance`, `input_reference`: whether an image was given);
    `fps` and `model`: its build's, for a request stored without its model. A request that does
    not read (the row damaged while serving) shows as nulls."""
    r = job.request or {}
    frames = r.get("frames")
    # A row that does not read shows why as its error (the worker fails it with that error).
    unreadable = {"code": "unreadable_job", "message": job.unreadable} if job.damage else None
    return {
        "id": job.id,
        "object": "video",
        "created_at": int(job.created_at),
        "completed_at": None if job.completed_at is None else int(job.completed_at),
        "expires_at": None,  # kept until deleted
        "error": job.error or unreadable,
        "model": r.get("model", model),
        "progress": job.progress,
        "prompt": r.get("prompt"),
        "remixed_from_video_id": None,
        "seconds": None if frames is None else seconds_text(frames, fps),
        "size": r.get("size"),
        "status": job.status,
        "build": job.group.build if job.group else None,
        "frames": frames,
        "seed": r.get("seed"),
        "steps": r.get("steps"),
        "negative_prompt": r.get("negative_prompt"),
        "guidance": r.get("guidance"),
        "input_reference": r.get(IMAGE_FIELD) is True if job.request else None,
    }


def list_page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: the SDK asks for the next one `after` its `last_id`."""
    return {
        "object": "list",
        "data": data,
        "has_more": more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


def model_object(name: str, created: int, builds: Iterable[ServedBuild]) -> dict[str, Any]:
    """OpenAI's model object, and this server's `served`: what a request of the model may ask,
    one entry per loaded build of it (its size, length, whether its guidance is above
    CFG_ABOVE, whether it takes an `input_reference` image)."""
    served = [
        {"size": f"{width}x{height}", "frames": frames, "seconds": seconds_text(frames, b.fps),
         "cfg": cfg, "image": image}
        for b in sorted(builds, key=_by_route) if b.model == name
        for width, height, frames, cfg, image in [b.route]
    ]  # fmt: skip
    return {"id": name, "object": "model", "created": created, "owned_by": "wan-aot",
            "served": served}  # fmt: skip


def form_schema(schema: dict[str, Any], image: bool = False) -> dict[str, Any]:
    """VideoRequest's JSON schema as a form takes it: a field that may be null is left out (or
    sent empty) instead, so the form's fields are never null; with `image` (an image-to-video
    build served), the IMAGE_FIELD file too."""
    properties = {}
    for name, prop in schema["properties"].items():
        options = [p for p in prop.get("anyOf", ()) if p.get("type") != "null"]
        rest = {k: v for k, v in prop.items() if k != "anyOf" and (k, v) != ("default", None)}
        properties[name] = (options[0] | rest) if len(options) == 1 else rest | (
            {"anyOf": options} if options else {}
        )  # fmt: skip
    if image:
        properties[IMAGE_FIELD] = {
            "type": "string",
            "format": "binary",
            "description": "Image to video: the first frame, a PNG, JPEG or WebP file.",
        }
    return schema | {"properties": properties, "title": "VideoRequestForm"}
