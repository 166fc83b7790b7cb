"""Run ``nnx-es`` commands in one process and say their exit statuses and which watched modules they imported
(the spec tests' check in a separate process: nothing ran, nothing was imported past the registry check).

The process is a child of the suite's warm process (tests/warmkit.py): a watched module the warm process has
imported already could not be seen being imported, so that is refused (take it out of ``warmserver.PRELOAD``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["REPO", "drive"]

REPO = Path(__file__).resolve().parents[1]


def drive(cwd: Path, commands: list[list[str]], watch: list[str]) -> tuple[dict, str]:
    import warmkit  # here: the child imports this file for run_commands, with the warm process's sys.path

    out = warmkit.call(__file__, "run_commands", json.dumps(watch), json.dumps(commands), cwd=cwd)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def run_commands(args: list[str]) -> int:
    """The child's job: ``nnx-es`` in-process for each command, then one JSON line: the exit statuses and the
    watched modules imported meanwhile."""
    watch, commands = json.loads(args[0]), json.loads(args[1])
    preloaded = [m for m in watch if m in sys.modules]
    if preloaded:
        raise RuntimeError(f"the warm process has imported {preloaded} already: their import cannot be watched")
    from nnx_es.cli.main import main

    codes = [main(argv) for argv in commands]
    print(json.dumps({"codes": codes, "imported": [m for m in watch if m in sys.modules]}))
    return 0
