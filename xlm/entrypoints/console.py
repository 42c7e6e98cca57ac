"""What the `xlm` commands write for their user: results on stdout, errors and notices on
stderr, one line at a time (library code logs through `xlm.logger` instead)."""

from __future__ import annotations

import sys


def out(text: str) -> None:
    """Write one line of a command's result to stdout, flushed."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def err(text: str) -> None:
    """Write one line for the user (an error, a notice) to stderr, flushed."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
