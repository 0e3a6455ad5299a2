"""What both command lines (`aot`, `runtime`) share: the one-line error and argument parsing."""

from __future__ import annotations

import re

import click


class CliError(click.ClickException):
    """One line on stderr, exit status 2."""

    exit_code = 2


def parse_resolution(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height)."""
    m = re.fullmatch(r"(\d+)x(\d+)", text.lower())
    if not m:
        raise click.BadParameter(f"{text!r} is not WxH (e.g. 720x1280)")
    return int(m.group(1)), int(m.group(2))
