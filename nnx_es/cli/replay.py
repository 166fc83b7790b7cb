"""``replay RUN_DIR [--json]``: audit a run against the eleven invariants of docs/INVARIANTS.md.

Exit status: 0 when every invariant holds, 1 when any is violated (each
violation is named: event seq, invariant, expected, found), 2 when the input
is unusable (missing directory, not a run, unreadable log, a symbolic link or a FIFO under the run); with ``--json`` such an error is
also printed on stdout as ``{"error": {"type", "message"}}``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from events.errors import EventLogError, UnsafePathError
from nnx_es.cli._common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNUSABLE,
    EXIT_VIOLATIONS,
    Parser,
    UsageError,
    fail,
    reader_left,
    wants_json,
)
from nnx_es.cli._format import json_line, printable
from nnx_es.audit import INVARIANTS, AuditReport, NotARunError, audit_run

__all__ = ["build_parser", "main", "render"]



def build_parser() -> argparse.ArgumentParser:
    """The ``tools/replay`` (``nnx-replay``) argument parser (the docs' CLI reference is generated from it)."""
    parser = Parser(
        prog="replay",
        description="Replay a run's event log and check the invariants of docs/INVARIANTS.md "
        "(exit 0: all hold, 1: violations, 2: unusable input).",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory, runs/<id>")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    return parser


def render(report: AuditReport) -> str:
    """The human-readable report, one line per item (a log's strings in it escaped: :func:`printable`)."""
    lines = [
        f"{'ok' if report.ok else 'FAILED'}: run {report.run_id!r} ({report.status}), "
        f"{len(report.violations)} violation{'s' if len(report.violations) != 1 else ''}",
        f"events: {report.events}",
        f"committed epoch: {report.committed_epoch if report.committed_epoch is not None else '-'}",
        f"tail: {report.tail} uncommitted event{'s' if report.tail != 1 else ''}",
    ]
    if report.violations:
        broken = sorted({v.invariant for v in report.violations})
        lines.append("violated: " + "; ".join(f"{k}. {INVARIANTS[k]}" for k in broken if k in INVARIANTS))
        lines.extend(v.line() for v in report.violations)
    lines.extend(f"note: {note}" for note in report.notes)
    return "\n".join(map(printable, lines))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``replay``; return the exit status.

    An error (a usage error, an unusable input) is said on stderr and, with ``--json``, also as
    one JSON object ``{"error": {"type", "message"}}`` on stdout (:func:`nnx_es.cli._common.fail`).
    """
    parser = build_parser()
    as_json = wants_json(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help
        return int(exc.code) if isinstance(exc.code, int) else EXIT_UNUSABLE
    except UsageError as exc:
        return fail("replay", str(exc), error_type="UsageError", as_json=as_json, usage=parser.format_usage())
    try:
        report = audit_run(args.run_dir)
    except (NotARunError, EventLogError, UnsafePathError) as exc:  # a link or a FIFO under the run: refused
        return fail("replay", str(exc), error_type=type(exc).__name__, as_json=as_json)
    except KeyboardInterrupt:  # Ctrl-C on a long audit: no traceback
        return EXIT_INTERRUPTED
    try:
        if args.json:
            sys.stdout.write(json_line(report) + "\n")
        else:
            print(render(report))
        sys.stdout.flush()
    except BrokenPipeError:
        reader_left()
    return EXIT_OK if report.ok else EXIT_VIOLATIONS


if __name__ == "__main__":
    sys.exit(main())
