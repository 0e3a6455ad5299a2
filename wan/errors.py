"""The project's one error type for input it cannot use.

Outside data (artifacts, weights, LoRA files, tokenizers, requests, coordinator messages) is
hostile until checked; every check that refuses it raises an `InputError` (or a subclass named
for its source) whose message is one line saying what is wrong and what to do. Both command
lines print that line and exit 2 (`runtime.cli.args.OneLineErrors`); anything else escaping is a
bug in the project."""

from __future__ import annotations


class InputError(ValueError):
    """Input that cannot be used; the message says why and what to do."""
