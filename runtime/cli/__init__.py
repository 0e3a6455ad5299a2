"""The `runtime` command: `run` (runtime.cli.run) and `serve` (runtime.cli.serve), each imported
when it is the command (`runtime run` never loads the HTTP stack; `aot` shares runtime.cli.args
without loading either)."""

from __future__ import annotations

import importlib
import signal

import click

from runtime.cli.args import OneLineErrors

COMMANDS = {"run": "runtime.cli.run:run_cmd", "serve": "runtime.cli.serve:serve_cmd"}


class _Commands(OneLineErrors):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attribute = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attribute)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Run WAN text-to-video from `aot build` artifacts."""


def main() -> None:
    # SIGTERM ends a run as Ctrl-C does (KeyboardInterrupt), so staged outputs are removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    cli(prog_name="runtime")
