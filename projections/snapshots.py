"""Projection snapshots: the state of every projection at a seq, stored beside the log as a cache.

DESIGN.md "Projections": opening a long run costs O(events since the nearest snapshot),
not O(run). A snapshot under key ``seq`` holds :class:`~projections.view.Projections`
of the committed view of the log's events ``0..seq`` at a point where the view holds
nothing back (every event up to ``seq`` is folded or dropped, none pending), and whether
``seq`` sits in a LAST's commit group: with both, :class:`~projections.view.Projector`
resumes the fold at ``seq + 1`` exactly as a fold from 0 would go on (tested).

A snapshot is a cache, never the record:

* its stored value is a 4-byte CRC-32 (big-endian) of the msgpack that follows it, so a
  changed byte is seen before anything is decoded; a value that does not verify, does not
  decode, is of a schema version this code does not read, or names another seq than its
  key is *unusable*: readers skip it with a note (:func:`read`) and fold from an older one
  or from 0, never trusting it;
* ``tools/replay`` re-folds the log from 0 and compares every usable snapshot it meets
  with its own fold (a difference is a violation, invariant 9: a materialized projection
  that disagrees with the log).

:class:`SnapshotFolder` is the writer's side: it follows the log a commit at a time
(fed the events since the last call) and says when a snapshot is due (every
``every`` events, at a point where the view holds nothing back).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import msgspec

from events.chunks import RawChunk
from events.schema import Event
from projections.view import Projections, Projector

__all__ = ["SNAPSHOT_VERSION", "Snapshot", "SnapshotFolder", "Unusable", "decode_snapshot", "encode_snapshot",
           "newest_usable"]

#: the schema version of :class:`Snapshot` this code writes and reads (another is unusable, never upcast:
#: a snapshot can always be rebuilt from the log)
SNAPSHOT_VERSION = 1


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Every projection's state folded up to and including seq ``seq`` (see the module docstring).

    seq: the last seq of the log the state folds (0-based); in_group: whether the event at
    ``seq`` is a LAST or belongs to its commit group (the next group kinds are committed
    with it); projections: the state (``projections.seq`` is the last *committed* seq
    folded, at most ``seq``); version: :data:`SNAPSHOT_VERSION`.
    """

    seq: int
    in_group: bool
    projections: Projections
    version: int = SNAPSHOT_VERSION


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Snapshot)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    """The stored value of ``snapshot``: CRC-32 of the msgpack (4 bytes, big-endian), then the msgpack."""
    body = _ENCODER.encode(snapshot)
    return zlib.crc32(body).to_bytes(4, "big") + body


class Unusable(NamedTuple):
    """A stored snapshot a reader did not use: its key's seq and why."""

    seq: int
    reason: str

    def note(self) -> str:
        return f"the projection snapshot at seq {self.seq} is unusable ({self.reason}): ignored, folded without it"


def decode_snapshot(seq: int, value: bytes) -> Snapshot | Unusable:
    """The snapshot stored under ``seq``, or why it is :class:`Unusable` (never raises for a bad value)."""
    if len(value) < 5:
        return Unusable(seq, f"{len(value)} bytes, too short to hold a checksum and a state")
    body = memoryview(value)[4:]
    if zlib.crc32(body) != int.from_bytes(value[:4], "big"):
        return Unusable(seq, "its checksum does not match its bytes: a byte changed on disk")
    try:
        snapshot = _DECODER.decode(body)
    except msgspec.DecodeError as exc:
        return Unusable(seq, f"it does not decode: {exc}")
    if snapshot.version != SNAPSHOT_VERSION:
        return Unusable(seq, f"schema version {snapshot.version}, this code reads {SNAPSHOT_VERSION}")
    if snapshot.seq != seq or snapshot.projections.seq > seq:
        return Unusable(seq, f"it folds up to seq {snapshot.seq} (last committed {snapshot.projections.seq}), "
                             f"not the seq of its key")
    return snapshot


def newest_usable(stored: Iterable[tuple[int, bytes]], notes: list[str]) -> Snapshot | None:
    """The first usable snapshot of ``stored`` (``(seq, value)``, newest first), each unusable one
    before it noted in ``notes``; None when there is none."""
    for seq, value in stored:
        found = decode_snapshot(seq, value)
        if isinstance(found, Snapshot):
            return found
        notes.append(found.note())
    return None


class SnapshotFolder:
    """The writer's fold of its own log, for writing snapshots (see the module docstring).

    Args:
        start: the newest usable snapshot of the log being continued, or None (fold from 0).
        every: at least this many events between two snapshots (>= 1).

    Fed the events after the last seq it folded (:meth:`advance`), in seq order, it returns
    a snapshot to store when ``every`` events have gone by since the last one and the
    committed view holds nothing back there. Memory: what the view holds back plus the
    projections.

    Raises:
        ValueError: ``every`` < 1.
    """

    __slots__ = ("every", "_projector", "next_seq", "last_snapshot")

    def __init__(self, start: Snapshot | None = None, every: int = 1 << 16) -> None:
        if every < 1:
            raise ValueError(f"every={every!r}: expected a number of events >= 1")
        self.every = every
        self._projector = Projector(start.projections, start.in_group) if start is not None else Projector(
            Projections())
        #: the seq of the next event to feed
        self.next_seq = start.seq + 1 if start is not None else 0
        #: the seq of the last snapshot (the start's), -1: none
        self.last_snapshot = start.seq if start is not None else -1

    def due(self, durable: int) -> bool:
        """Whether a log of ``durable`` stored events has gone ``every`` past the last snapshot."""
        return durable - 1 - self.last_snapshot >= self.every

    def advance(self, chunks: Iterator[RawChunk] | Iterable[tuple[int, Event]], *, raw: bool = True) -> Snapshot | None:
        """Fold the next events (stored chunks from :attr:`next_seq` on, or decoded pairs with ``raw=False``);
        return the snapshot due at their end, or None.

        Raises:
            CorruptEventError: a value does not decode (the folder is then unusable).
            ValueError: the events do not start at :attr:`next_seq`.
        """
        p = self._projector
        end = self.next_seq
        if raw:
            for first, values in chunks:  # type: ignore[misc]
                if first != end:
                    raise ValueError(f"chunk at seq {first}: expected seq {end} next")
                p.feed_chunk(first, values)
                end = first + len(values)
        else:
            pairs = list(chunks)  # type: ignore[arg-type]
            if pairs and pairs[0][0] != end:
                raise ValueError(f"event at seq {pairs[0][0]}: expected seq {end} next")
            p.feed_pairs(pairs)
            end = pairs[-1][0] + 1 if pairs else end
        self.next_seq = end
        if not p.clean or not self.due(end):
            return None
        self.last_snapshot = end - 1
        return Snapshot(seq=end - 1, in_group=p.in_group, projections=p.state())

    def finish(self) -> Projections:
        """The projections of every event fed, a finalized tail's closing events folded (what
        :func:`projections.project` of the same prefix returns). Folds that tail into the state:
        call it once, when nothing more will be fed (the writer's views at finalization)."""
        return self._projector.finish()
