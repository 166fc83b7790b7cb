"""What both event logs share: the contract's protocol, buffering and sequencing, and the in-memory log.

:class:`MemoryLog` keeps the contract of :mod:`events.log` in a Python list (fast unit tests);
:class:`~events.log.LmdbLog` builds on the same :class:`LogBase`.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from events.chunks import RawChunk, runs
from events.codec import decode, encode
from events.errors import EventLogError, LogClosedError
from events.schema import Event
from events.sums import SumProblem

__all__ = ["EventLog", "LogBase", "MemoryLog", "seq_key"]


_KEY = struct.Struct(">Q")  # a key: 8 bytes, big-endian
_SEQ, _VALUE = operator.itemgetter(0), operator.itemgetter(1)


def seq_key(seq: int) -> bytes:
    """The 8-byte big-endian key of sequence number ``seq``."""
    return _KEY.pack(seq)


def keyed(buffer: Sequence[tuple[int, bytes]]) -> Iterator[tuple[bytes, bytes]]:
    """``(seq_key(seq), value)`` of each buffered ``(seq, value)``, in order: no Python call per item."""
    return zip(map(_KEY.pack, map(_SEQ, buffer)), map(_VALUE, buffer))


class EventLog(Protocol):
    """What every event log offers (see the module docstring for the contract)."""

    @property
    def next_seq(self) -> int: ...

    @property
    def durable_seq(self) -> int: ...

    @property
    def syncs(self) -> int: ...

    def append(self, event: Event) -> int: ...

    def extend(self, events: Sequence[Event]) -> int: ...

    def flush(self, *, sync: bool = False) -> None: ...

    def commit(self, event: Event) -> int: ...

    def stage_blob(self, key: bytes, value: bytes) -> None: ...

    def get_blob(self, key: bytes) -> bytes | None: ...

    def delete_blobs(self, keys: list[bytes]) -> None: ...

    def read_raw(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, bytes]]: ...

    def read_chunks(self, start: int = 0, stop: int | None = None) -> Iterator[RawChunk]: ...

    def read(
        self, start: int = 0, stop: int | None = None, kinds: Iterable[str] | None = None
    ) -> Iterator[tuple[int, Event]]: ...

    def verify_sums(self, stop: int | None = None) -> Iterator[SumProblem]: ...

    def put_snapshot(self, seq: int, value: bytes) -> None: ...

    def read_snapshots(self, stop: int | None = None, *, newest_first: bool = True) -> Iterator[tuple[int, bytes]]: ...

    def check_keys(self, start: int = 0, stop: int | None = None) -> int: ...

    def close(self) -> None: ...


class LogBase:
    """Buffering, sequencing and decoding shared by both logs."""

    readonly = False

    def __init__(self, next_seq: int) -> None:
        self._buffer: list[tuple[int, bytes]] = []
        self._staged: dict[bytes, bytes] = {}  # blobs written with the next flush
        self._doomed: list[bytes] = []  # blobs deleted with the next flush (LmdbLog.delete_blobs)
        self._flushed = next_seq
        self._next = next_seq
        self._syncs = 0
        self._closed = False

    @property
    def next_seq(self) -> int:
        """The seq the next append gets (buffered events included)."""
        return self._next

    @property
    def durable_seq(self) -> int:
        """Number of flushed events (the seq the first unflushed event has)."""
        return self._flushed

    @property
    def syncs(self) -> int:
        """fsyncs this log object performed (for benchmarks and tests)."""
        return self._syncs

    def append(self, event: Event) -> int:
        """Buffer ``event``; return its seq. Nothing is written until ``flush``."""
        return self.extend((event,))

    def extend(self, events: Sequence[Event]) -> int:
        """Buffer ``events`` in order, all or none (each is encoded first); return the last one's seq.
        Nothing is written until ``flush``."""
        if self._closed:
            raise LogClosedError("append on a closed event log")
        if self.readonly:
            raise EventLogError("append on an event log opened read-only")
        raws = list(map(encode, events))  # no Python call per event
        seq = self._next
        self._next = end = seq + len(raws)
        self._buffer.extend(zip(range(seq, end), raws))
        return end - 1

    def stage_blob(self, key: bytes, value: bytes) -> None:
        """Buffer blob ``value`` under ``key``: the next flush writes it with the buffered events
        (durable with the next sync). A key already stored or staged keeps its first value."""
        if self._closed:
            raise LogClosedError("stage_blob on a closed event log")
        if self.readonly:
            raise EventLogError("stage_blob on an event log opened read-only")
        self._staged.setdefault(bytes(key), value)

    def commit(self, event: Event) -> int:
        """Append ``event`` and make it and everything before it durable (synced)."""
        seq = self.append(event)
        self.flush(sync=True)
        return seq

    def discard_buffer(self) -> int:
        """Drop unflushed events (what a crash does); return how many were dropped."""
        n = len(self._buffer)
        self._buffer.clear()
        self._staged.clear()
        self._next = self._flushed
        return n

    def read(
        self, start: int = 0, stop: int | None = None, kinds: Iterable[str] | None = None
    ) -> Iterator[tuple[int, Event]]:
        """Yield ``(seq, event)`` for flushed events with ``start <= seq < stop``.

        Raises:
            CorruptEventError: a value does not decode (names its seq).
        """
        wanted = frozenset(kinds) if kinds is not None else None
        for seq, raw in self.read_raw(start, stop):
            event = decode(raw, seq)
            if wanted is None or event.KIND in wanted:
                yield seq, event

    def read_raw(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, bytes]]:
        raise NotImplementedError

    #: most values per chunk of :meth:`read_chunks`
    read_chunk = 1024

    def read_chunks(self, start: int = 0, stop: int | None = None) -> Iterator[RawChunk]:
        """Yield :meth:`read_raw` as ``(first_seq, values)`` chunks of at most ``read_chunk`` consecutive seqs."""
        return runs(self.read_raw(start, stop), self.read_chunk)

    def __enter__(self) -> LogBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True


class MemoryLog(LogBase):
    """An event log in a Python list, for fast unit tests. ``sync`` is counted, not done."""

    def __init__(self) -> None:
        super().__init__(0)
        self._stored: list[bytes] = []
        self._blobs: dict[bytes, bytes] = {}
        self._snapshots: dict[int, bytes] = {}

    def flush(self, *, sync: bool = False) -> None:
        if self._closed:
            raise LogClosedError("flush on a closed event log")
        self._stored.extend(raw for _, raw in self._buffer)
        self._buffer.clear()
        for key, value in self._staged.items():
            self._blobs.setdefault(key, value)
        self._staged.clear()
        self._flushed = self._next
        if sync:
            self._syncs += 1

    def read_raw(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, bytes]]:
        if self._closed:
            raise LogClosedError("read on a closed event log")
        end = len(self._stored) if stop is None else min(stop, len(self._stored))
        for seq in range(max(start, 0), end):
            yield seq, self._stored[seq]

    def get_blob(self, key: bytes) -> bytes | None:
        """The stored (flushed) blob under ``key``, or None."""
        if self._closed:
            raise LogClosedError("read on a closed event log")
        return self._blobs.get(bytes(key))

    def delete_blobs(self, keys: list[bytes]) -> None:
        """Delete stored blobs (missing keys are ignored)."""
        if self._closed:
            raise LogClosedError("delete_blobs on a closed event log")
        for key in keys:
            self._blobs.pop(bytes(key), None)

    def put_snapshot(self, seq: int, value: bytes) -> None:
        """Store the projection snapshot ``value`` under ``seq`` (see :mod:`events.log`)."""
        if self._closed:
            raise LogClosedError("put_snapshot on a closed event log")
        self._snapshots[seq] = value

    def read_snapshots(self, stop: int | None = None, *, newest_first: bool = True) -> Iterator[tuple[int, bytes]]:
        """``(seq, value)`` of the stored snapshots with ``seq < stop``, newest first (or oldest first)."""
        if self._closed:
            raise LogClosedError("read on a closed event log")
        seqs = sorted((s for s in self._snapshots if stop is None or s < stop), reverse=newest_first)
        return iter([(s, self._snapshots[s]) for s in seqs])

    def verify_sums(self, stop: int | None = None) -> Iterator[SumProblem]:
        """Nothing: a memory log keeps no checksums (nothing on a disk can rot under it)."""
        return iter(())

    def check_keys(self, start: int = 0, stop: int | None = None) -> int:
        """The number of stored values in ``[start, stop)``: a list's positions are its keys, always 0, 1, 2, ..."""
        end = len(self._stored) if stop is None else min(stop, len(self._stored))
        return max(end - start, 0)

    def put_raw(self, seq: int, raw: bytes) -> None:
        """Overwrite or add a stored value (tests use it to forge broken logs)."""
        if seq == len(self._stored):
            self._stored.append(raw)
            self._flushed = self._next = seq + 1
        else:
            self._stored[seq] = raw
