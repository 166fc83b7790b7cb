"""Projections of a run's log from its newest usable snapshot on (:mod:`projections.snapshots`).

What ``load_result``, ``inspect --at`` and ``inspect summary`` fold: the newest snapshot
at or below the point they need, whose own checksum verifies, then the events after it
(O(events since that snapshot), not O(run)). An unusable snapshot is skipped with a note;
a log without snapshots (written before they existed, or too short to have one) is folded
from 0, as before.

What a snapshot does not see: damage to the log's values *before* it. The state it holds
was folded from those values when they were intact, so the answer is the run's; the damage
itself is for the readers that must report it: ``inspect summary`` verifies every value's
checksum and key, a resume reads the whole log, and ``tools/replay`` re-folds from 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import msgspec

from events.errors import CorruptEventError
from events.log import LmdbLog
from events.schema import Event
from nnx_es.audit.committed import Folded
from nnx_es.audit.reading import decoded
from nnx_es.audit.report import Sink
from projections.commits import GROUP_KINDS
from projections.snapshots import Snapshot, decode_snapshot, newest_usable
from projections.view import Projections, Projector

__all__ = ["Projected", "SnapshotCheck", "project_log"]

_FIELDS = ("history", "checkpoints", "schedulers", "counters", "status", "seq")
_ENCODE = msgspec.msgpack.encode


class Projected(NamedTuple):
    """The projections of a log's events ``[0, stop)``; ``start``: the seq the fold started at
    (0, or a snapshot's seq + 1); ``notes``: the snapshots skipped as unusable, and why."""

    projections: Projections
    start: int
    notes: list[str]


def project_log(log: LmdbLog, stop: int | None = None, *, skip_undecodable: bool = False) -> Projected:
    """Fold the committed view of ``log``'s events ``[0, stop)`` from its newest usable snapshot below ``stop``.

    Equal to :func:`projections.project` of the whole prefix (tested, snapshot by snapshot).

    Args:
        stop: the end of the prefix (default: the log's stored length).
        skip_undecodable: fold past a value that does not decode (the tools' reading),
            instead of raising.

    Raises:
        CorruptEventError: a value after the snapshot does not decode (names its seq), unless skipped.
        EventLogError: LMDB refused a read.
    """
    end = log.next_seq if stop is None else min(stop, log.next_seq)
    notes: list[str] = []
    snapshot = newest_usable(log.read_snapshots(end), notes) if end > 0 else None
    start = 0 if snapshot is None else snapshot.seq + 1
    try:
        p = _fold(snapshot, log.read(start, end))
    except CorruptEventError:
        if not skip_undecodable:
            raise
        p = _fold(snapshot, decoded(log, start, end))
    return Projected(p, start, notes)


def _fold(snapshot: Snapshot | None, pairs: Iterable[tuple[int, Event]]) -> Projections:
    projector = Projector(snapshot.projections, snapshot.in_group) if snapshot is not None else Projector(
        Projections())
    projector.feed_pairs(pairs)
    return projector.finish()


class SnapshotCheck:
    """``tools/replay``'s check of the stored snapshots against its own fold from 0 (invariant 9).

    Fed each event the committed view yields with the fold's state after it (:meth:`feed`),
    in the audit's one pass; each usable snapshot must be met at its seq with the view holding
    nothing back there, and hold exactly the fold's state (and its commit-group flag). An
    unusable snapshot is a note, as for every reader: a cache that rotted is not a wrong run.
    """

    def __init__(self, log: LmdbLog, stop: int, sink: Sink) -> None:
        self.sink = sink
        self.notes: list[str] = []
        self.checked = 0
        self._stored = log.read_snapshots(stop, newest_first=False)
        self._next: Snapshot | None = None
        self._body = memoryview(b"")  # the stored msgpack of ``_next`` (after its checksum)
        #: the seq of the next snapshot to meet (a pass need not call :meth:`feed` before it)
        self.next_seq = 1 << 64
        self._advance()

    def _advance(self) -> None:
        for seq, value in self._stored:
            found = decode_snapshot(seq, value)
            if isinstance(found, Snapshot):
                self._next, self.next_seq, self._body = found, found.seq, memoryview(value)[4:]
                return
            self.notes.append(found.note())
        self._next, self.next_seq = None, 1 << 64

    def feed(self, seq: int, event: Event, clean: bool, read_to: int, folded: Folded) -> None:
        """The view yielded ``event`` at ``seq`` (``folded.p``: the projections through it); ``clean``: it
        holds nothing back now; ``read_to``: the last seq the pass has read. Needed only once ``seq`` or
        ``read_to`` reaches :attr:`next_seq`."""
        snap = self._next
        while snap is not None and (seq == snap.seq or read_to > snap.seq):
            if seq == snap.seq and clean and read_to == seq:
                self._compare(snap, event, folded.p)
            else:
                self._held_back(snap)
            self._advance()
            snap = self._next

    def finish(self) -> None:
        """Every snapshot not met: its seq was never a point where the view held nothing back."""
        while self._next is not None:
            self._held_back(self._next)
            self._advance()

    def _held_back(self, snap: Snapshot) -> None:
        self.checked += 1
        self.sink.add(snap.seq, 9, f"the projection snapshot at seq {snap.seq} claims a point where the committed "
                      "view holds nothing back; the view holds events back there",
                      expected="a snapshot only where every event is folded", found=f"a snapshot at seq {snap.seq}")

    def _compare(self, snap: Snapshot, event: Event, p: Projections) -> None:
        self.checked += 1
        in_group = event.KIND == "last_committed" or event.KIND in GROUP_KINDS
        if _ENCODE(Snapshot(seq=snap.seq, in_group=in_group, projections=p, version=snap.version)) == self._body:
            return  # byte for byte the snapshot the fold would store: every field equal (one encoding, not two)
        differ = [name for name in _FIELDS
                  if _ENCODE(getattr(p, name)) != _ENCODE(getattr(snap.projections, name))]
        if snap.in_group != in_group:
            differ.append("in_group")
        if differ:
            self.sink.add(snap.seq, 9, f"the projection snapshot at seq {snap.seq} differs from the fold of the "
                          f"log up to it: {', '.join(differ)}", expected="the fold's state",
                          found=f"{', '.join(differ)} differ")
