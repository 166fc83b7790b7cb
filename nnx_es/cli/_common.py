"""What both command-line tools share."""

from __future__ import annotations

import os
import sys

__all__ = ["EXIT_OK", "EXIT_UNUSABLE", "EXIT_VIOLATIONS", "reader_left"]

EXIT_OK, EXIT_VIOLATIONS, EXIT_UNUSABLE = 0, 1, 2


def reader_left() -> None:
    """Stdout's reader went away (``tool ... | head``): drop further output quietly; not an error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
