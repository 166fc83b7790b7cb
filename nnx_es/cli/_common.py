"""What the command-line tools share: exit statuses, how an error is said (also as JSON), a reader
that left, whether a run has a live writer, opening a run's log to follow it."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from events.errors import NewLogError
from events.lmdbfile import held_lock
from events.log import LmdbLog
from nnx_es.cli._format import json_line, printable

__all__ = ["EXIT_INTERRUPTED", "EXIT_OK", "EXIT_UNUSABLE", "EXIT_VIOLATIONS", "Parser", "UsageError", "fail",
           "open_log", "reader_left", "wants_json", "writer_alive"]

EXIT_OK, EXIT_VIOLATIONS, EXIT_UNUSABLE = 0, 1, 2
_FLOCK = frozenset({"FLOCK"})
#: Stopped by Ctrl-C (SIGINT): 128 + 2, as a shell reports it.
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A command line :class:`Parser` refused (its message is argparse's)."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``error`` raises :class:`UsageError` instead of exiting, so a tool
    can also say it as JSON (``--help`` still exits 0)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def wants_json(argv: Sequence[str] | None) -> bool:
    """Whether ``argv`` (``sys.argv[1:]`` when None) asks for ``--json`` (or an abbreviation argparse
    accepts), read even when the rest of it does not parse."""
    args = sys.argv[1:] if argv is None else argv
    return any(len(a) > 2 and "--json".startswith(a) for a in args)


def fail(tool: str, message: str, *, error_type: str, as_json: bool, usage: str | None = None,
         status: int = 2) -> int:
    """Say why ``tool`` stopped; return ``status`` (2: unusable input, :data:`EXIT_UNUSABLE`).

    Always ``tool: message`` on stderr (a usage error as argparse says it: ``usage``, then
    ``tool: error: message``); in a ``--json`` mode also one line ``{"error": {"type": error_type,
    "message": message}}`` on stdout, so a program reading stdout learns why it got nothing (or
    less) rather than a silence. The message may quote a log or a path: its controls are escaped
    (:func:`nnx_es.cli._format.printable`).
    """
    if usage is not None:
        sys.stderr.write(usage)  # the tool's own text
    print(printable(f"{tool}: {'error: ' if usage is not None else ''}{message}"), file=sys.stderr)
    if as_json:
        try:
            sys.stdout.write(json_line({"error": {"type": error_type, "message": message}}) + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            reader_left()
    return status


def open_log(run_dir: Path, *, follow: bool = False, poll_s: float = 0.5) -> LmdbLog:
    """The run's log, read-only (:func:`nnx_es.audit.open_run_log`); with ``follow``, a log whose writer (alive:
    it holds the lease) is creating it right now is waited for, every ``poll_s`` seconds, as a follower waits
    for the events it will append.

    Raises:
        NotARunError / EventLogError: as :func:`nnx_es.audit.open_run_log` (NewLogError: not following, or
            no writer holds the lease).
    """
    from nnx_es.audit import open_run_log

    while True:
        try:
            return open_run_log(run_dir)
        except NewLogError:
            if not follow or not writer_alive(run_dir):
                raise
        time.sleep(poll_s)


def reader_left() -> None:
    """Stdout's reader went away (``tool ... | head``): drop further output quietly; not an error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def writer_alive(run_dir: Path) -> bool:
    """Whether a process on this machine still holds the writer lease of ``run_dir`` (read-only).

    The lease is an exclusive ``flock`` on ``<runs>/.leases/<id>.lock``
    (:class:`nnx_es.storage.Lease`), which the kernel drops when its holder dies,
    so a SIGKILLed writer leaves it free. It is never probed by locking it: a
    probe, however brief, would make a writer starting at that moment fail with
    ``LeaseHeldError``. Instead it reads ``/proc/locks`` (Linux): the writer is
    alive when a ``FLOCK`` is held on the lease file. Where that table cannot be
    read, the pid the holder wrote into the file is asked about instead (a reused
    pid then makes a dead writer look alive: the safe side, nothing is claimed).
    A writer on another machine sharing ``runs/``, or in another PID namespace (a
    container sharing the volume: the table lists only the locks of its own), is not seen. ``run_dir`` is
    resolved first (``.``, a symlink to the run). A writer that reached the run by another path (a
    bind mount, another runs root) holds a lease file of its own there, and the run directory's own
    ``flock`` (:mod:`nnx_es.lease`): that is looked for too.
    """
    run_dir = Path(run_dir).resolve()
    lease = run_dir.parent / ".leases" / f"{run_dir.name}.lock"
    held = _flocked(lease)
    if held is None:
        return _pid_alive(lease)
    return held or bool(_flocked(run_dir))  # a writer that reached the run by another path locks its directory


def _flocked(path: Path) -> bool | None:
    """Whether ``/proc/locks`` lists a held (not a waiting) ``flock`` on ``path``; None where it cannot tell."""
    return held_lock(path, _FLOCK)


def _pid_alive(path: Path) -> bool:
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    if pid <= 0:  # kill(0 or -n, 0) would ask about a process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
