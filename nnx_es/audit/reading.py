"""Reading a run's log for the tools: open it read-only, what of it is damaged, its decodable events, its
uncommitted tail."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from events.codec import decode, decode_many
from events.errors import CorruptEventError, SequenceGapError
from events.log import LmdbLog
from events.schema import Event, LastCommitted, RunResumed
from nnx_es.audit.report import NotARunError
from nnx_es.storage import check_run_dir
from projections import tail_length
from projections.commits import commits_all

__all__ = ["committed_tail", "decoded", "log_damage", "open_run_log", "restart_seq"]

#: events a backward search for a restart point of the committed view reads first (doubled each time)
_BACK_WINDOW = 1024


def open_run_log(run_dir: Path) -> LmdbLog:
    """Open ``run_dir/events.lmdb`` read-only.

    Raises:
        NotARunError: ``run_dir`` does not exist, is not a directory, or holds no event log.
        UnsafePathError: its log, blob or view directory is a symbolic link or of the wrong kind
            (:func:`nnx_es.storage.check_run_dir`).
        EventLogError: the log exists but LMDB cannot open it.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotARunError(f"run directory {str(run_dir)!r} does not exist or is not a directory")
    check_run_dir(run_dir)
    path = run_dir / "events.lmdb"
    if path.is_dir() and not (path / "data.mdb").is_file():
        raise NotARunError(f"{str(run_dir)!r} has an event log directory without its data file: {path / 'data.mdb'} "
                           "is missing (deleted, or a partial copy): the run's events are gone; restore the "
                           "directory from a copy")
    if not path.exists() and any((run_dir / part).is_dir() for part in ("blobs", "views")):
        raise NotARunError(f"{str(run_dir)!r} holds a run's blobs or views but no event log: {path} is missing "
                           "(deleted, or a partial copy): the run's events are gone; restore the directory from "
                           "a copy")
    if not (path / "data.mdb").is_file():
        raise NotARunError(f"{str(run_dir)!r} is not a run: expected an event log at {path}")
    return LmdbLog(path, readonly=True)


def log_damage(log: LmdbLog) -> str | None:
    """What is damaged in ``log``: its first key out of place, or the ranges of values whose checksums do not
    verify (:meth:`~events.log.LmdbLog.verify_sums`); None when every key is in place and every value a sum
    record covers verifies (values written before checksums existed are not damage).

    Bit rot, found by one key-only pass and one pass over the values (C-level, ~0.3 s a million events): a
    value rewritten with its checksum is not found here (a forged log is another run: ``tools/replay`` audits
    what it says).

    Raises:
        EventLogError: LMDB refused a read (a corrupted page).
    """
    try:
        log.check_keys()
    except SequenceGapError as exc:
        return str(exc)
    bad = [p for p in log.verify_sums() if p.problem != "uncovered"]
    if not bad:
        return None
    shown = ", ".join(f"seqs {p.first}..{p.last} ({p.problem})" for p in bad[:3])
    return (f"{len(bad)} range{'s' if len(bad) != 1 else ''} of values do not verify against their checksums: "
            f"{shown}{', ...' if len(bad) > 3 else ''}")


def decoded(log: LmdbLog, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, Event]]:
    """``(seq, event)`` of the decodable values in ``[start, stop)``; the others are skipped.

    Read a chunk at a time (:meth:`~events.log.LmdbLog.read_chunks`), each chunk decoded
    in one call (:func:`~events.codec.decode_many`); a chunk holding a value that does
    not decode is decoded value by value.
    """
    for first, values in log.read_chunks(start, stop):
        try:
            events = decode_many(values, first)
        except CorruptEventError:
            for seq, raw in enumerate(values, first):
                try:
                    yield seq, decode(raw, seq)
                except CorruptEventError:
                    continue
            continue
        yield from zip(range(first, first + len(events)), events)


def restart_seq(log: LmdbLog, stop: int) -> int:
    """A seq from which the committed view of the events in ``[0, stop)`` can be restarted.

    The committed view (:func:`projections.committed`) restarted at the seq returned,
    over the decodable events from there to ``stop``, holds back exactly what the view
    of the whole prefix holds back at ``stop``. Found reading backwards from ``stop``
    (windows of :data:`_BACK_WINDOW` events, doubling), it is the last of:

    * a ``run_resumed``: the view drops what it held back before it;
    * a ``last_committed`` with ``covers < 0``: it commits everything before it;
    * a ``last_committed`` L followed by a LAST whose ``covers`` is L's seq or later:
      that LAST commits whatever the whole view held back at L (all of it before L),
      and keeps back the same events (after ``covers``) in both views.

    Both views agree from the point found on, so a run committed epoch by epoch is
    read back about two epochs; 0 when there is no such point.
    """
    hi, size = stop, _BACK_WINDOW
    later = None  # ``covers`` of the LAST after the marks read so far
    while hi > 0:
        lo = max(0, hi - size)
        marks = [(s, e) for s, e in decoded(log, lo, hi) if isinstance(e, (LastCommitted, RunResumed))]
        for seq, event in reversed(marks):
            match event:
                case RunResumed():
                    return seq
                case LastCommitted(covers=covers):
                    if commits_all(covers) or (later is not None and later >= seq):
                        return seq
                    later = covers
        hi, size = lo, size * 2
    return 0


def committed_tail(log: LmdbLog, stop: int) -> int:
    """:func:`projections.tail_length` of the decodable events in ``[0, stop)``, read from :func:`restart_seq` on.

    O(tail) reads for a run committed epoch by epoch, not O(run).
    """
    return tail_length(decoded(log, restart_seq(log, stop), stop))
