"""Stored values a chunk at a time, and the ``(seq, event)`` pairs they decode to.

A chunk is ``(first_seq, values)``: ``values[i]`` is the stored value of seq
``first_seq + i`` (a gap in the stored seqs starts a new chunk). ``read()`` of an
event log returns :class:`StoredPairs` over its chunks: iterated, it decodes each
chunk in one msgspec call; a consumer that decodes for itself (the projections
decode only the fields they fold) takes the undecoded chunks instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from events.codec import decode_many
from events.schema import Event

if TYPE_CHECKING:
    import lmdb

__all__ = ["RawChunk", "StoredPairs", "cursor_chunks", "ends_read", "keys_back", "runs"]

#: ``(first_seq, values)``: ``values[i]`` is the stored msgpack value of seq ``first_seq + i``.
RawChunk = tuple[int, list[Any]]


class StoredPairs(Iterator[tuple[int, Event]]):
    """The ``(seq, event)`` pairs of stored values, read and decoded a chunk at a time.

    Args:
        chunks: the stored values as :data:`RawChunk` s, in seq order.
        kinds: when given, only events of these kinds are yielded.

    Iterating raises :class:`~events.errors.CorruptEventError` naming the seq of a
    value that does not decode.
    """

    __slots__ = ("_chunks", "_wanted", "_pairs")

    def __init__(self, chunks: Iterator[RawChunk], kinds: Iterable[str] | None = None) -> None:
        self._chunks = chunks
        self._wanted = frozenset(kinds) if kinds is not None else None
        self._pairs: Iterator[tuple[int, Event]] | None = None

    def __iter__(self) -> Iterator[tuple[int, Event]]:
        return self._started()  # the chained C iterator itself: a for loop never enters Python per pair

    def __next__(self) -> tuple[int, Event]:
        return next(self._started())

    def _started(self) -> Iterator[tuple[int, Event]]:
        if self._pairs is None:
            self._pairs = itertools.chain.from_iterable(map(self._decoded, self._chunks))
        return self._pairs

    def _decoded(self, chunk: RawChunk) -> Iterator[tuple[int, Event]]:
        first, values = chunk
        pairs = zip(range(first, first + len(values)), decode_many(values, first))
        wanted = self._wanted
        if wanted is None:
            return pairs
        return ((seq, e) for seq, e in pairs if e.KIND in wanted)

    def raw_chunks(self) -> Iterator[RawChunk] | None:
        """The chunks not yet read, undecoded; ``None`` once pairs were taken or when kinds are filtered.

        The chunks and the pairs share one read: what one consumes, the other no longer yields.
        """
        if self._pairs is not None or self._wanted is not None:
            return None
        return self._chunks


def keys_back(cur: lmdb.Cursor, n: int, resting: bool) -> list[int]:
    """The seqs of the ``n`` entries up to the cursor's, in stored order, read by walking back and forth.

    ``resting``: the cursor rests on the last of them; else it ran past the end and the
    last of them is the log's last entry. The cursor is left on that entry. Positional:
    correct whatever the keys are (``set_range`` would search a tree whose order broke).
    """
    if not resting:
        cur.last()
    keys = [cur.key()]
    for _ in range(n - 1):
        cur.prev()
        keys.append(cur.key())
    for _ in range(n - 1):
        cur.next()
    return [int.from_bytes(key, "big") for key in reversed(keys)]


def ends_read(key: int, final: int, following: int | None) -> bool:
    """Whether ``key``, met at or past a bounded read's ``stop``, ends the read: only when it is in order.

    ``final`` is the log's last key (its last entry, positionally); ``following`` the key stored
    after ``key`` (None: ``key``'s entry is the last). In a log whose keys run 0, 1, 2, ... the
    first key at or past ``stop`` ends the read. A key that is past ``final``, or that a lower key
    follows, is out of order (a changed key: bit rot); ending there would drop every entry after
    it without a word, so the read goes on and yields it as stored, as an unbounded read does
    (naming it is :meth:`~events.log.LmdbLog.check_keys`' and the audit's job).
    """
    return key <= final and (following is None or following >= key)


def runs(pairs: Iterable[tuple[int, bytes]], size: int) -> Iterator[RawChunk]:
    """``(seq, value)`` pairs in seq order as chunks: runs of consecutive seqs, at most ``size`` values each."""
    first, values = 0, list[bytes]()
    for seq, value in pairs:
        if values and (seq != first + len(values) or len(values) == size):
            yield first, values
            values = []
        if not values:
            first = seq
        values.append(value)
    if values:
        yield first, values


def cursor_chunks(cur: lmdb.Cursor, start: int, stop: int | None, size: int) -> Iterator[RawChunk]:
    """The values of an event database's cursor with ``start <= seq < stop`` as chunks of at most
    ``size`` (see ``LmdbLog.read_chunks``: keys are read only where a chunk's do not run on)."""
    if not cur.last():
        return
    final = int.from_bytes(cur.key(), "big")  # of this read's snapshot
    end = 1 << 64 if stop is None else stop  # not final + 1: a changed key past it must not end the read
    if not cur.set_range(max(start, 0).to_bytes(8, "big")):
        return
    first = int.from_bytes(cur.key(), "big")
    before = first - 1  # the key before the next chunk
    # a chunk's keys did not run on (or the first key is at or past ``end``, or the key after it
    # does not follow it): read on to a key at or past ``end`` that is in order, judging every
    # chunk that reaches ``end`` by its keys, as read_raw does
    suspect = first >= end
    if cur.next():
        suspect = suspect or int.from_bytes(cur.key(), "big") != first + 1
        cur.prev()
    else:  # the first key is the last: the cursor is put back on it
        cur.last()
    values_of = cur.iternext(keys=False, values=True)
    while suspect or before + 1 < end:
        values = list(itertools.islice(values_of, size))
        if not values:
            return
        # the cursor rests on the last value taken, unless the values ran out
        last = int.from_bytes(cur.key(), "big") if len(values) == size else final
        if last - before != len(values) or (suspect and last >= end):  # split at the keys
            suspect = True
            pairs = list(zip(keys_back(cur, len(values), len(values) == size), values))
            cut = _end_of(pairs, end, final, cur, len(values) == size)
            yield from runs(pairs[:cut], size)
            if cut < len(pairs):  # a key at or past ``end``, in order: read_raw stops there too
                return
        elif last >= end:
            if end - before > 1:
                yield before + 1, values[: end - before - 1]
            return
        else:
            yield before + 1, values
        before = last


def _end_of(pairs: list[tuple[int, Any]], end: int, final: int, cur: lmdb.Cursor, resting: bool) -> int:
    """The index of the pair of a chunk (keys read back) whose key ends the read at ``end``
    (:func:`ends_read`), or ``len(pairs)``. ``resting``: the cursor rests on the last pair's
    entry (else that entry is the log's last); the key after it is peeked at (and the cursor
    put back) only when that pair is the one to judge."""
    for i, (key, _) in enumerate(pairs):
        if key < end:
            continue
        if i + 1 < len(pairs):
            following: int | None = pairs[i + 1][0]
        elif not resting or not cur.next():  # the log's last entry: nothing follows
            following = None
        else:
            following = int.from_bytes(cur.key(), "big")
            cur.prev()
        if ends_read(key, final, following):
            return i
    return len(pairs)

