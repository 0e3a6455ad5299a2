"""What stands between a connection and `runtime serve`'s routes: the bounds on what one request
may take (its head's time, its body's bytes and time: `HttpLimits`), the API keys, and the JSON
500 for a bug. ASGI middlewares around the app (runtime.serve.server.make_app) and uvicorn's HTTP/1.1
protocol with a deadline on heads; every answer in OpenAI's error shape
(runtime.serve.openai_dialect.error_response)."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import logging
import re
from pathlib import Path
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.serve.openai_dialect import error_response
from wan.bounded_read import read_text
from wan.errors import InputError

API_KEYS_ENV = "WAN_API_KEYS"  # comma-separated keys, beside --api-key and --api-key-file
MAX_KEY_FILE_BYTES = 64 << 10
# A key: what a Bearer header carries (RFC 6750's token68), long enough not to be guessed.
KEY = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}")
GUARDED = "/v1/"  # the paths a key is required on; /healthz, /metrics, the schema, / stay open
# The default --max-body-bytes: a request with an input_reference image (a photo is a few MiB;
# runtime.generation.images.MAX_IMAGE_BYTES is the most any image file may be).
MAX_BODY_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What one request may take of the server (the flags of `runtime serve`)."""

    max_body_bytes: int  # a larger body is 413, refused by its Content-Length before it is read
    max_prompt_chars: int  # each of prompt and negative_prompt; longer is 400
    header_timeout: float  # seconds to send a request's head, else the connection is closed
    body_timeout: float  # seconds to send its body, else 408


class ApiKeyError(InputError):
    """An API key that cannot be used (too short, a character no header carries, an unreadable
    key file): one line."""


def load_api_keys(given: tuple[str, ...], file: Path | None, env: str | None) -> tuple[str, ...]:
    """The server's keys: those of --api-key, of --api-key-file (one a line; blank lines and
    lines starting with # skipped) and of $WAN_API_KEYS (comma-separated; `env` None when it is
    unset), each checked. A source given that yields no key is refused: whoever gave it meant
    the server to take keys, and an open server is what they would get."""

    def refuse(reason: str) -> ApiKeyError:
        return ApiKeyError(f"--api-key-file {file} {reason}: give a file of keys, one a line")

    keys = [*given]
    if file is not None:
        lines = read_text(file, MAX_KEY_FILE_BYTES, refuse).splitlines()
        from_file = [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
        if not from_file:
            raise refuse("holds no key (only blank lines or # comments)")
        keys += from_file
    if env is not None:
        from_env = [k.strip() for k in env.split(",") if k.strip()]
        if not from_env:
            raise ApiKeyError(
                f"${API_KEYS_ENV} is set but holds no key: give comma-separated keys, or unset it "
                "(a server without keys is open to whoever reaches it)"
            )
        keys += from_env
    for i, key in enumerate(keys, 1):
        if not KEY.fullmatch(key):
            raise ApiKeyError(
                f"API key {i} (of --api-key, --api-key-file, ${API_KEYS_ENV} in that order) is "
                f"{len(key)} characters: give 16 to 512 of A-Z a-z 0-9 . _ ~ + / = - (e.g. "
                "`openssl rand -hex 32`)"
            )
    return tuple(dict.fromkeys(keys))


def check_open(host: str, address: str, keys: tuple[str, ...]) -> None:
    """A server without keys only on loopback (`address`: the IP its socket is bound to, for
    --host `host`): anywhere else anyone who reaches the port could queue videos and read
    everyone's."""
    ip = ipaddress.ip_address(address.partition("%")[0])  # an IPv6 scope id is no part of it
    if keys or (getattr(ip, "ipv4_mapped", None) or ip).is_loopback:
        return
    raise ApiKeyError(
        f"--host {host or repr(host)} ({address}) without an API key would serve /v1/ to anyone "
        f"who reaches it: give --api-key-file FILE or ${API_KEYS_ENV}, or serve on 127.0.0.1 "
        "behind a proxy that authenticates"
    )


class ApiKeys:
    """ASGI middleware: with keys set, every request under /v1/ carries `Authorization: Bearer
    KEY` with one of them (else 401 before its body is read), compared in constant time with
    each key (hmac.compare_digest over all of them, whichever matches). Other paths (/healthz,
    /metrics, the schema, the playground's page, which asks for the key) stay open."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]):
        self.app, self.keys = app, tuple(k.encode() for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not scope["path"].startswith(GUARDED):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        scheme, _, token = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer" and self.allows(token.strip()):
            await self.app(scope, receive, send)
            return
        why = "no API key given" if given is None else "the API key is not one of this server's"
        message = f"{why}: send Authorization: Bearer KEY"
        headers = {"WWW-Authenticate": "Bearer", "Connection": "close"}
        await error_response(401, "invalid_api_key", message, headers)(scope, receive, send)

    def allows(self, token: bytes) -> bool:
        found = False
        for key in self.keys:  # every key compared, so the time says nothing of which matched
            found |= hmac.compare_digest(token, key)
        return found


class BoundedBody:
    """ASGI middleware: a request's body is read whole before the app sees it, at most `limit`
    bytes (413; a larger Content-Length is refused before a byte is read) within `timeout`
    seconds (408). Either answer closes the connection, whose unread body is dropped. JSON and
    forms alike: the form parser reads the body read here."""

    def __init__(self, app: ASGIApp, limit: int, timeout: float):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        close = {"Connection": "close"}
        too_large = error_response(
            413,
            "body_too_large",
            f"the request body is over {self.limit} bytes (--max-body-bytes)",
            close,
        )
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.limit:  # h11 checked its digits
            await too_large(scope, receive, send)
            return
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    body += message.get("body", b"")
                    more = message.get("more_body", False)
                    if len(body) > self.limit:
                        await too_large(scope, receive, send)
                        return
        except TimeoutError:
            message = f"the request body did not arrive within {self.timeout:g} s (--body-timeout)"
            await error_response(408, "body_timeout", message, close)(scope, receive, send)
            return
        whole: list[Message] = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)


class JsonErrors:
    """ASGI middleware: an exception nothing else answered (a bug) is a JSON 500 and one line in
    the log, never a traceback."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:
            what = f"{type(e).__name__}: {e}"
            where = f"{scope.get('method', '')} {scope.get('path', '')}"
            logging.getLogger("uvicorn.error").error("internal error in %s: %s", where, what)
            if not started and scope["type"] == "http":
                await error_response(500, "internal_error", what)(scope, receive, send)


class HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on a request's head: a connection that has
    not sent one whole within `header_timeout` seconds of opening, or of its last answer, is
    closed (uvicorn alone waits forever; the body's deadline is BoundedBody's)."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """A deadline runs while the next request's head is awaited (h11: they are IDLE)."""
        if self.conn.their_state is not h11.IDLE:
            self._stop()
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout, self.transport.close)

    def _stop(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
