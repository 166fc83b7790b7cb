"""``inspect RUN_DIR [events]``: one row per event (a table, or ``--json`` lines), filtered, followed.

Rows are read as stored, by position (a damaged key is listed under its key as stored, then named:
:func:`list_events` raises), and every string from the log is escaped for the terminal
(:func:`nnx_es.cli._format.printable`; JSON lines: :func:`~nnx_es.cli._format.json_line`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

import msgspec

from events.codec import KINDS, decode
from events.errors import CorruptEventError, EventLogError
from events.log import LmdbLog
from events.schema import EvaluationRecorded, Event, HistoryAppended, ModelExported, RunFinalized, RunStarted
from nnx_es.cli._common import writer_alive
from nnx_es.cli._format import fields, fmt, json_line, printable

__all__ = ["compact", "event_epoch", "event_json", "list_events"]

_UNDECODABLE = "<undecodable>"
_BULKY = frozenset({"recipe", "library_versions", "traceback", "components", "columns"})  # columns: per-row records
_VALUE_CHARS = 80


def event_epoch(event: Event) -> int | None:
    """The 0-based epoch an event belongs to (a history record's for ``history_appended``), None for none."""
    if isinstance(event, HistoryAppended):
        return event.record.epoch
    return getattr(event, "epoch", None)


def compact(event: Event) -> str:
    """The event's non-default fields on one line (``name=value``, long values cut, bulky ones as ``<size>``)."""
    parts = []
    for name, value in fields(event):
        if name in _BULKY:
            size = len(value) if hasattr(value, "__len__") else 0
            parts.append(f"{name}=<{size}>")
            continue
        text = fmt(value)
        if len(text) > _VALUE_CHARS:
            text = text[: _VALUE_CHARS - 3] + "..."
        parts.append(f"{name}={text}")
    return " ".join(parts)


def event_json(seq: int, event: Event) -> dict[str, Any]:
    """The event as ``--json`` prints it: ``{"seq", "kind", "version", every field}`` (JSON-ready builtins)."""
    fields = msgspec.to_builtins(event)
    fields.pop("kind", None)  # the tag carries the version; kind/version are given separately
    return {"seq": seq, "kind": event.KIND, "version": event.VERSION, **fields}


class _Out:
    """Rows to stdout: rich styling on a terminal, plain aligned text otherwise."""

    def __init__(self, stream: TextIO, seq_width: int) -> None:
        self.stream = stream
        self.seq_width = max(seq_width, 3)
        self.kind_width = max(len(k) for k in (*KINDS, _UNDECODABLE))
        self.console: Any = None
        if stream.isatty():
            from rich.console import Console

            self.console = Console(file=stream, highlight=False, soft_wrap=True)

    def header(self) -> None:
        self._row("seq", "kind", "fields", style="bold")

    def row(self, seq: int, kind: str, fields: str) -> None:
        style = "red" if kind == _UNDECODABLE else "cyan" if kind.endswith("_committed") else ""
        self._row(str(seq), kind, fields, style=style)

    def _row(self, seq: str, kind: str, fields: str, style: str) -> None:
        line = printable(f"{seq:>{self.seq_width}}  {kind:<{self.kind_width}}  {fields}".rstrip())
        if self.console is not None:
            from rich.text import Text

            self.console.print(Text(line, style=style))
        else:
            self.stream.write(line + "\n")


def list_events(log: LmdbLog, args: argparse.Namespace, kinds: frozenset[str] | None) -> None:
    """Print the rows ``inspect``'s arguments ask for (``--from/--to/--limit/--kind/--epoch/--rank``, ``--json``),
    then, with ``--follow``, the rows a live writer appends, polling every ``args.poll_s`` seconds, until the run
    finalizes or no process on this machine writes it.

    Raises:
        EventLogError: LMDB refused a read (a corrupted page), naming the last seq read before it.
        SequenceGapError: a key read is out of place (the rows were printed under their keys as stored).
    """
    stop = log.next_seq if args.end is None else min(args.end + 1, log.next_seq)
    out = sys.stdout
    table = None if args.json else _Out(out, len(str(max(stop - 1, 0))))
    if table is not None:
        table.header()
    state = {"shown": 0, "writer_rank": 0, "finalized": False, "expected": args.start, "broken": False}
    next_seq = _checked_rows(log, args, kinds, args.start, stop, table, state)
    _no_rank_rows(args, state)
    while args.follow and not state["finalized"] and (args.end is None or next_seq <= args.end):
        if args.limit is not None and state["shown"] >= args.limit:
            break
        alive = writer_alive(args.run_dir)  # read before the log: a writer that dies after it flushed is seen
        time.sleep(args.poll_s)
        end = log.refresh() if args.end is None else min(args.end + 1, log.refresh())
        if end > next_seq:
            next_seq = _checked_rows(log, args, kinds, next_seq, end, table, state)
        elif not alive:
            print(f"inspect: no process writes {args.run_dir} any more; stopped following", file=sys.stderr)
            break
        out.flush()


def _no_rank_rows(args: argparse.Namespace, state: dict[str, Any]) -> None:
    """Say on stderr why ``--rank R`` matched nothing when R is not the writer rank: only the
    writer rank appends to the log (the others fold the same events in memory)."""
    if args.rank is not None and state["shown"] == 0 and args.rank != state["writer_rank"]:
        print(f"inspect: no event of rank {args.rank}: the log holds the writer rank's events (rank "
              f"{state['writer_rank']}); rank {args.rank}'s are not recorded (only the writer rank writes the run)",
              file=sys.stderr)


def _checked_rows(log: LmdbLog, args: argparse.Namespace, kinds: frozenset[str] | None, start: int, stop: int,
                  table: _Out | None, state: dict[str, Any]) -> int:
    """:func:`_rows`, then the damage it met named.

    Raises:
        EventLogError: LMDB refused a read (a corrupted page), naming the last seq read before it.
        SequenceGapError: the keys read did not run on (a changed, missing or duplicated key: the
            rows were printed under their keys as stored), naming the first damaged key of the log.
    """
    try:
        next_seq = _rows(log, args, kinds, start, stop, table, state)
    except EventLogError as exc:
        sys.stdout.flush()
        read = "before any event" if state["expected"] == args.start else f"after seq {state['expected'] - 1}"
        raise EventLogError(f"{exc}; the listing stopped {read}") from exc
    if state["broken"]:
        sys.stdout.flush()
        log.check_keys()  # names the first damaged key (the read went on past it, by position)
    return next_seq


def _rows(log: LmdbLog, args: argparse.Namespace, kinds: frozenset[str] | None, start: int, stop: int,
          table: _Out | None, state: dict[str, Any]) -> int:
    """Print the rows of ``[start, stop)``; return the seq after the last one read.

    ``state["broken"]`` becomes true when a key read is not the seq due after the one before it.
    """
    out = sys.stdout
    seq = start - 1
    for seq, raw in log.read_raw(start, stop):
        if args.limit is not None and state["shown"] >= args.limit:
            return seq
        if seq != state["expected"]:
            state["broken"] = True
        state["expected"] = seq + 1
        try:
            event = decode(raw, seq)
        except CorruptEventError as exc:
            if kinds is not None or args.epoch is not None:
                continue
            if table is None:
                out.write(json_line({"seq": seq, "kind": None, "error": exc.reason}) + "\n")
            else:
                table.row(seq, _UNDECODABLE, f"error={exc.reason} bytes={len(raw)}")
            state["shown"] += 1
            continue
        if isinstance(event, RunStarted):
            state["writer_rank"] = event.writer_rank
        state["finalized"] = isinstance(event, (RunFinalized, EvaluationRecorded, ModelExported))
        if kinds is not None and event.KIND not in kinds:
            continue
        if args.rank is not None and getattr(event, "rank", state["writer_rank"]) != args.rank:
            continue
        if args.epoch is not None:
            e = event_epoch(event)
            if e is None or not args.epoch[0] <= e <= args.epoch[1]:
                continue
        if table is None:
            out.write(json_line(event_json(seq, event)) + "\n")
        else:
            table.row(seq, event.KIND, compact(event))
        state["shown"] += 1
    return seq + 1
