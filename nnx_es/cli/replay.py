"""``replay RUN_DIR [--json]``: audit a run against the ten invariants of docs/INVARIANTS.md.

Exit status: 0 when every invariant holds, 1 when any is violated (each
violation is named: event seq, invariant, expected, found), 2 when the input
is unusable (missing directory, not a run, unreadable log).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from events.errors import EventLogError
from nnx_es.cli._common import EXIT_INTERRUPTED, EXIT_OK, EXIT_UNUSABLE, EXIT_VIOLATIONS, reader_left
from nnx_es.audit import INVARIANTS, AuditReport, NotARunError, audit_run

__all__ = ["main", "render"]



def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="replay",
        description="Replay a run's event log and check the invariants of docs/INVARIANTS.md "
        "(exit 0: all hold, 1: violations, 2: unusable input).",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory, runs/<id>")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    return parser


def render(report: AuditReport) -> str:
    """The human-readable report."""
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
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``replay``; return the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on a usage error, 0 on --help
        return int(exc.code) if isinstance(exc.code, int) else EXIT_UNUSABLE
    try:
        report = audit_run(args.run_dir)
    except (NotARunError, EventLogError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    except KeyboardInterrupt:  # Ctrl-C on a long audit: no traceback
        return EXIT_INTERRUPTED
    try:
        if args.json:
            sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
        else:
            print(render(report))
        sys.stdout.flush()
    except BrokenPipeError:
        reader_left()
    return EXIT_OK if report.ok else EXIT_VIOLATIONS


if __name__ == "__main__":
    sys.exit(main())
