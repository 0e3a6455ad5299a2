"""What both command lines (`aot`, `runtime`) share: the one-line error, argument parsing and
the trusted keys' option."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from wan.errors import InputError

# `aot check`, `runtime run` and `runtime serve`: the public keys whose signatures are trusted.
TRUSTED_KEY = click.option(
    "--trusted-key",
    "trusted_keys",
    multiple=True,
    type=click.Path(path_type=Path),
    metavar="FILE",
    help="Accept only builds signed by this public key (`aot keygen`'s .pub; repeatable): an "
    "unsigned or mis-signed build is refused before any executable is read.",
)


class CliError(click.ClickException):
    """One line on stderr, exit status 2."""

    exit_code = 2


class OneLineErrors(click.Group):
    """A command group whose commands end on unusable input (`InputError`) or a failed system
    call (`OSError`: a full disk, a permission) with one line and exit 2, never a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except InputError as e:
            raise CliError(str(e)) from None
        except OSError as e:
            raise CliError(os_error_text(e)) from None


def os_error_text(e: OSError) -> str:
    """'<file>: <reason>' for a failed system call."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}"


def parse_resolution(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height)."""
    m = re.fullmatch(r"(\d+)x(\d+)", text.lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not WxH (e.g. 720x1280)")
    return int(m.group(1)), int(m.group(2))
