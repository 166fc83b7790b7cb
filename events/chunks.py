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
from typing import Any

from events.codec import decode_many
from events.schema import Event

__all__ = ["RawChunk", "StoredPairs"]

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
