"""inspect RUN_DIR [COMMAND] [options]: read a run's event log, read-only (safe beside a live writer).

commands:
  events (default)  one row per event; filters --kind, --from, --to, --limit, --epoch, --rank;
                    --json: one object per line, {"seq", "kind", "version", every field}
                    (a float that is not finite prints as null; a value that does not decode
                    as {"seq", "kind": null, "error"})
    --follow        keep printing new events until the run finalizes or no process on this
                    machine holds its writer lease; Ctrl-C stops it (exit 130)
    --at SEQ        every projection's state after the log up to SEQ (with --json or not);
                    takes no filter, since projections fold every event
  summary           status, epochs, LAST, BEST, learning rates, counters, whether the values
                    it folds verify against their checksums, tail (--json: one
                    object, "writer_alive" among its keys); a run not finalized whose writer
                    lease no process on this machine holds is flagged: killed or crashed?
                    resume it with nnx-es resume RUN_DIR (a run nnx-es run started: its
                    run_started holds a spec), else fit(..., resume_from=RUN_DIR). It reads from the newest
                    projection snapshot on (O(events since it)) and verifies what it folds:
                    the snapshot's own checksum, the keys and values after it
    --verify        verify the whole log instead (every key, every event value's checksum; not
                    the checkpoints, whose SHA-256s tools/replay and a resume verify); the
                    full audit, every invariant, is tools/replay RUN_DIR. Exit 1 when values
                    it verified do not verify (2: a key out of place, the log unreadable)
  plot --out FILE   loss, metric and learning-rate curves (matplotlib, headless); FILE's
                    extension names the format (png, pdf, svg, ...)
  plot cartography --out FILE
                    the data map of the per-row records: each training row's variability
                    against its mean confidence in the true label, coloured by correctness
  rows [--hardest N] [--json]
                    each training row's dynamics across the committed epochs (confidence,
                    variability, fraction correct: nnx_es.rows.dynamics), the hardest first
  export --tensorboard DIR
                    TensorBoard scalars, into a DIR holding no TensorBoard event files yet
    --follow        keep exporting a live run: polls the log, writes each event's scalars once
                    its LAST commits it, stops when the run finalizes, when no process on this
                    machine holds its writer lease any more, or on Ctrl-C (exit 130)
  --schema          (no RUN_DIR) the JSON Schema of the event lines --json prints (not of --at or summary)

inspect RUNS_ROOT [--json]       (a directory of runs) one row per run: id, status, epochs, BEST's
                                 value, started (UTC), size on disk; status "damaged" for a run whose keys
                                 or checksums do not verify (every log is verified); an unreadable or
                                 damaged run's reason and what to do under the table (--json: "error",
                                 "advice"); exit 1 when a run is unreadable or damaged; a directory with
                                 nothing in it yet (hidden entries aside): "no runs under RUNS_ROOT yet", exit 0
inspect diff RUN_A RUN_B [--json]
                                 the first event where two runs differ (seq, kind, field, both values),
                                 wall clock times, ids and checkpoint hashes aside; exit 0 the same, 1 differ,
                                 2 a log damaged (keys or checksums that do not verify, a value that does not
                                 decode: said as damage, never as a difference)

An option the command would ignore is refused (e.g. summary --at, --at --kind).
Tables use rich when stdout is a terminal, plain aligned text otherwise. Every string read from a log is
printed with its control characters escaped (\\x1b, \\u202e: shown, never acted on by the terminal).
exit status: 0 ok; 130 interrupted (Ctrl-C); 2 unusable input (missing directory, not a run,
bad or inapplicable option, output that cannot be written or whose directory is missing, a
damaged log: a key out of place or a page LMDB refuses, named on stderr with where it is).
With --json, an error is also printed on stdout as {"error": {"type", "message"}}.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from events.codec import KINDS
from events.errors import EventLogError, SequenceGapError, UnsafePathError
from events.log import LmdbLog
from nnx_es.audit import NotARunError
from nnx_es.cli._common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNUSABLE,
    EXIT_VIOLATIONS,
    Parser,
    UsageError,
    fail,
    open_log,
    reader_left,
    wants_json,
)
from nnx_es.cli._format import printable
from nnx_es.cli._schema import json_schema, plot_format_error, tensorboard_error
from nnx_es.cli.listing import list_events
from nnx_es.cli.many import diff_command, is_empty_runs_root, is_runs_root, list_command
from nnx_es.cli.projected import at, summary
from nnx_es.errors import CorruptCheckpointError

__all__ = ["COMMANDS", "build_parser", "json_schema", "main"]

COMMANDS: tuple[str, ...] = ("events", "summary", "plot", "export", "rows")
#: what ``plot`` draws: the run's curves (default) or the per-row data map
PLOTS: tuple[str, ...] = ("curves", "cartography")


# --- arguments -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``tools/inspect`` (``nnx-inspect``) argument parser (the docs' CLI reference is generated from it)."""
    title, _, details = (__doc__ or "").partition("\n\n")  # the module docstring is the help
    parser = Parser(prog="inspect", description=title.partition(": ")[2], epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, nargs="?", metavar="RUN_DIR", help="the run directory, runs/<id>")
    parser.add_argument("command", nargs="?", choices=COMMANDS, default="events", help="what to show (default: events)")
    parser.add_argument("what", nargs="?", choices=PLOTS, default=None, metavar="PLOT",
                        help=f"plot: what to draw, one of {PLOTS} (default: curves)")
    parser.add_argument("--hardest", type=_seq, default=None, metavar="N", help="rows: the N hardest rows only")
    parser.add_argument("--kind", action="append", default=[], metavar="K",
                        help="events: only events of kind K (repeatable; K may be comma-separated)")
    parser.add_argument("--from", dest="start", type=_seq, default=None, metavar="SEQ", help="events: first seq shown")
    parser.add_argument("--to", dest="end", type=_seq, default=None, metavar="SEQ",
                        help="events: last seq shown (inclusive)")
    parser.add_argument("--limit", type=_seq, default=None, metavar="N", help="events: show at most N events")
    parser.add_argument("--epoch", type=_epochs, default=None, metavar="A[:B]",
                        help="events: only events of epochs A..B (0-based, inclusive)")
    parser.add_argument("--rank", type=_seq, default=None, metavar="R",
                        help="events: only events of data-parallel rank R (the log holds the writer rank's "
                             "events only: another rank matches none, and stderr says so)")
    parser.add_argument("--json", action="store_true",
                        help="events and --at: JSON lines; summary: one JSON object")
    parser.add_argument("--verify", action="store_true",
                        help="summary: verify the whole log (every key, every value's checksum) instead of "
                        "what it folds (the snapshot's checksum, the events after it)")
    parser.add_argument("--follow", action="store_true",
                        help="events: keep printing new events of a live run; export: keep exporting it")
    parser.add_argument("--at", type=_seq, default=None, metavar="SEQ",
                        help="events: every projection's state after the log up to SEQ")
    parser.add_argument("--schema", action="store_true", help="print the JSON Schema of the event lines --json prints (no RUN_DIR)")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE", help="plot: the image to write")
    parser.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                        help="export: TensorBoard log dir (without event files)")
    return parser


_FILTERS = ("--kind", "--from", "--to", "--limit", "--epoch", "--rank")
#: The options each mode takes; any other one given would be ignored, so it is refused.
_TAKES: dict[str, frozenset[str]] = {
    "events": frozenset({*_FILTERS, "--json", "--follow", "--at"}),
    "--follow": frozenset({*_FILTERS, "--json", "--follow"}),
    "--at": frozenset({"--at", "--json"}),
    "summary": frozenset({"--json", "--verify"}),
    "plot": frozenset({"--out"}),
    "rows": frozenset({"--hardest", "--json"}),
    "export": frozenset({"--tensorboard", "--follow"}),
    "--schema": frozenset({"--schema"}),
}
_SHOWN = {"--follow": "events --follow", "--at": "events --at"}
_OPTION_DEST = {"--kind": "kind", "--from": "start", "--to": "end", "--limit": "limit", "--epoch": "epoch",
                "--rank": "rank", "--json": "json", "--follow": "follow", "--at": "at", "--schema": "schema",
                "--out": "out", "--tensorboard": "tensorboard", "--hardest": "hardest",
                "--verify": "verify"}


def _check_applicable(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``parser.error``: usage, message, exit 2) an option the chosen mode would ignore."""
    if args.schema:
        mode = "--schema"
        if args.run_dir is not None:
            parser.error(f"argument --schema: not allowed with RUN_DIR {str(args.run_dir)!r} "
                         "(the schema is that of every run's --json lines)")
    elif args.command == "events":
        mode = "--at" if args.at is not None else "--follow" if args.follow else "events"
    else:
        mode = args.command
    for flag, dest in _OPTION_DEST.items():
        value = getattr(args, dest)
        if value is None or value is False or value == [] or flag in _TAKES[mode]:  # not given, or taken
            continue
        where = ", ".join(_SHOWN.get(m, m) for m, takes in _TAKES.items() if flag in takes and m != flag)
        parser.error(f"argument {flag}: not allowed with {_SHOWN.get(mode, mode)} ({flag} applies to: {where})")


def _epochs(text: str) -> tuple[int, int]:
    a, sep, b = text.partition(":")
    try:
        lo = int(a)
        hi = int(b) if sep else lo
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected EPOCH or FIRST:LAST (0-based), got {text!r}") from None
    if lo < 0 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected 0 <= FIRST <= LAST, got {text!r}")
    return lo, hi


def _seq(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _kinds(values: list[str]) -> frozenset[str] | None:
    wanted = {k.strip() for v in values for k in v.split(",") if k.strip()}
    unknown = sorted(wanted - set(KINDS))
    if unknown:
        raise ValueError(f"--kind: unknown kind(s) {', '.join(unknown)}; known kinds: {', '.join(KINDS)}")
    return frozenset(wanted) or None



def main(argv: Sequence[str] | None = None) -> int:
    """Run ``inspect``; return the exit status.

    Every error is said on stderr and, in a ``--json`` mode, also as one JSON object on stdout
    (:func:`nnx_es.cli._common.fail`); a damaged log (a key out of place, a page LMDB refuses) is
    an error (exit 2) naming where, never a shorter listing or projection that exits 0.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = wants_json(argv)
    if argv[:1] == ["diff"]:
        return diff_command(argv[1:], as_json)
    parser = build_parser()
    try:
        args = parser.parse_intermixed_args(argv)
        _check_applicable(parser, args)
        if args.command == "plot" and args.out is not None and (why := plot_format_error(args.out)):
            parser.error(why)
        if args.command == "export" and args.tensorboard is not None and (why := tensorboard_error(args.tensorboard)):
            parser.error(why)
        kinds = _kinds(args.kind)
    except SystemExit as exc:  # --help
        return int(exc.code) if isinstance(exc.code, int) else EXIT_UNUSABLE
    except UsageError as exc:  # refusing --json itself (a mode without it, e.g. plot --json): not a --json mode
        return fail("inspect", str(exc), error_type="UsageError", usage=parser.format_usage(),
                    as_json=as_json and not str(exc).startswith("argument --json:"))
    except ValueError as exc:  # an unknown --kind
        return fail("inspect", str(exc), error_type="UsageError", as_json=as_json)
    args.poll_s = 0.5
    args.start = args.start or 0
    if (why := _missing_argument(args)) is not None:
        return fail("inspect", why, error_type="UsageError", as_json=as_json)
    if args.schema:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(json_schema())).decode() + "\n")
        return EXIT_OK
    if args.run_dir is not None and is_runs_root(args.run_dir) and len(set(argv) - {"--json"}) > 1:
        return fail("inspect", f"{args.run_dir} is a directory of runs: it takes --json only (one row per run); "
                    f"the other options read one run: inspect {args.run_dir / '<id>'} ...", error_type="UsageError",
                    as_json=as_json)
    if args.run_dir is not None and len(set(argv) - {"--json"}) == 1 and (
            is_runs_root(args.run_dir) or is_empty_runs_root(args.run_dir)):
        return list_command(args.run_dir, as_json)
    try:
        log = open_log(args.run_dir, follow=args.follow, poll_s=args.poll_s)
    except (NotARunError, EventLogError, UnsafePathError) as exc:
        return fail("inspect", str(exc), error_type=type(exc).__name__, as_json=as_json)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    try:
        return _run(log, args, kinds)
    except BrokenPipeError:
        reader_left()
    except KeyboardInterrupt:  # Ctrl-C, above all to end --follow: no traceback
        return EXIT_INTERRUPTED
    except SequenceGapError as exc:
        return fail("inspect", _damaged(args, exc), error_type=type(exc).__name__, as_json=as_json)
    except UnsafePathError as exc:  # a link or a FIFO under the run (a blob, a view): refused, never read
        return fail("inspect", str(exc), error_type=type(exc).__name__, as_json=as_json)
    except EventLogError as exc:
        return fail("inspect", f"{exc}; run tools/replay {args.run_dir} to audit the whole log",
                    error_type=type(exc).__name__, as_json=as_json)
    finally:
        log.close()
    return EXIT_OK


def _missing_argument(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot be run (an argument missing, a range backwards), or None."""
    if args.end is not None and args.end < args.start:
        return f"--to {args.end} is before --from {args.start}"
    if args.schema:
        return None
    if args.run_dir is None:
        return "RUN_DIR is required (or --schema)"
    if args.what is not None and args.command != "plot":
        return f"{args.what!r} names a plot: inspect RUN_DIR plot {args.what} --out FILE"
    if args.command == "plot" and args.out is None:
        return "plot needs --out FILE (its extension names the format: .png, .pdf, .svg, ...)"
    if args.command == "plot":
        from nnx_es.plotting import missing_parent

        return missing_parent(args.out)
    if args.command == "export" and args.tensorboard is None:
        return "export needs --tensorboard DIR"
    return None


def _damaged(args: argparse.Namespace, exc: SequenceGapError) -> str:
    """What ``inspect`` says of a log whose keys are damaged."""
    if args.command == "events" and args.at is None:
        done = "the events were listed by position, each under its key as stored"
    else:
        done = f"no {'summary' if args.command == 'summary' else args.command if args.at is None else 'projection'} " \
               "is made from a log whose keys are damaged"
    return (f"the event log of {args.run_dir} is damaged at seq {exc.expected}: {exc}; {done}; "
            f"run tools/replay {args.run_dir} to audit the whole log")


def _run(log: LmdbLog, args: argparse.Namespace, kinds: frozenset[str] | None) -> int:
    """Run the command on the opened ``log``; return the exit status.

    The commands that fold the whole log (plot, export, rows; summary with ``--verify``) first
    check its keys (:meth:`~events.log.LmdbLog.check_keys`, a key-only pass): a projection over a
    damaged key could be silently wrong. ``--at`` and ``summary`` check the keys they fold (from
    their snapshot on).

    Raises:
        SequenceGapError: a key of the log is out of place (for --at: at or before SEQ).
        EventLogError: LMDB refused a read.
    """
    if args.command != "events" and (args.command != "summary" or args.verify):
        log.check_keys()
    if args.command == "summary":
        if not summary(log, args.run_dir, args.json, verify=args.verify):  # (it met a closed pipe itself)
            return EXIT_VIOLATIONS  # values it verified do not: a script checking the run must not pass it
    elif args.command == "rows" or (args.command == "plot" and args.what == "cartography"):
        from nnx_es.cli.rows import plot_cartography, rows_command

        log.close()  # the records' reader opens the log itself
        try:
            if args.command == "rows":
                return rows_command(args.run_dir, args.hardest, args.json)
            print(f"wrote {plot_cartography(args.run_dir, args.out)}")
        except (CorruptCheckpointError, UnsafePathError) as exc:  # a journal chunk or manifest that does not verify
            print(printable(f"inspect: the per-row records of {args.run_dir} do not verify: {exc}; run tools/replay "
                            f"{args.run_dir} to audit the run"), file=sys.stderr)
            return EXIT_UNUSABLE
        except (OSError, ImportError, ValueError) as exc:
            print(printable(f"inspect: cannot write the data map to {args.out}: {exc}"), file=sys.stderr)
            return EXIT_UNUSABLE
    elif args.command == "plot":
        from nnx_es.plotting import plot_run

        log.close()  # the plot opens the log itself (LMDB allows one handle per process)
        try:
            print(f"wrote {plot_run(args.run_dir, args.out)}")
        except (OSError, ImportError, RuntimeError) as exc:  # RuntimeError: .pgf without a TeX system
            print(printable(f"inspect: cannot write the plot to {args.out}: {exc}"), file=sys.stderr)
            return EXIT_UNUSABLE
    elif args.command == "export":
        from nnx_es.plotting import export_tensorboard

        log.close()
        try:
            if args.follow:
                from nnx_es.cli.follow import follow_tensorboard

                n = follow_tensorboard(args.run_dir, args.tensorboard, args.poll_s)
            else:
                n = export_tensorboard(args.run_dir, args.tensorboard)
        except (OSError, ImportError) as exc:
            print(printable(f"inspect: cannot export to {args.tensorboard}: {exc}"), file=sys.stderr)
            return EXIT_UNUSABLE
        print(f"wrote {n} scalars to {args.tensorboard}")
    elif args.at is not None:
        at(log, args.at, args.json)
    else:
        list_events(log, args, kinds)
    sys.stdout.flush()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
