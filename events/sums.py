"""Checksums of the event log: one CRC-32 per write transaction, and their verification.

Each flush of :class:`events.log.LmdbLog` writes, in the same transaction as its
values, one *sum record* in the environment's ``sums`` database:

* key: the batch's first seq (8-byte big-endian, like the events' keys);
* value: the batch's last seq (8-byte big-endian) and the CRC-32
  (:func:`zlib.crc32`, 4 bytes big-endian) of the batch's stored values
  concatenated in seq order.

So a value and its checksum are durable together or not at all, and the CRC
costs one C call per flush, nothing per append. A log written before sums
existed has no ``sums`` database, or values before its first record: those are
*uncovered* (read, never verified). CRC-32 catches every flip of 1 to 32 bits
in a batch (any burst up to 32 bits) and other changes with probability
1 - 2**-32; it protects against rot, not against a deliberate forger who
recomputes it.

:func:`verify` walks the sum records and the stored values side by side, both
in seq order, and yields a :class:`SumProblem` for each range that does not
verify.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Literal, NamedTuple

from events.chunks import RawChunk

__all__ = ["SUMS_DB", "SumProblem", "SumRecord", "batch_crc", "pack_sum", "unpack_sum", "verify"]

#: name of the LMDB database holding the sum records
SUMS_DB = b"sums"

#: what can be wrong with a range (see :class:`SumProblem`)
Problem = Literal["mismatch", "missing", "uncovered", "stray", "malformed"]


class SumRecord(NamedTuple):
    """One write transaction's checksum: seqs ``first..last`` (inclusive) and their CRC-32."""

    first: int
    last: int
    crc: int


class SumProblem(NamedTuple):
    """A range of seqs (``first..last``, inclusive) whose values are not verified.

    problem:

    * ``"mismatch"``: every value of a sum record's range is stored and their CRC-32
      differs from the record's (a byte of a value, or of the record, changed);
    * ``"missing"``: a sum record names values that are not stored (``found`` of them are);
    * ``"uncovered"``: values before the first sum record, or in a log without sums
      (written before checksums existed): not verified, not wrong;
    * ``"stray"``: values after the first sum record that no record covers
      (a lost record, or a value written outside the log's writer);
    * ``"malformed"``: a record ending before it starts, or overlapping the one before it.

    expected / found: the record's CRC and the values' CRC (``"mismatch"``); the
    values the record names and those stored (``"missing"``); else the count of values.
    """

    first: int
    last: int
    problem: Problem
    expected: int = 0
    found: int = 0


def batch_crc(values: list[bytes]) -> int:
    """CRC-32 of ``values`` concatenated (one C call over the joined bytes)."""
    return zlib.crc32(b"".join(values))


def pack_sum(last: int, crc: int) -> bytes:
    """The stored value of a sum record: ``last`` (8 bytes) then ``crc`` (4 bytes), big-endian."""
    return last.to_bytes(8, "big") + crc.to_bytes(4, "big")


def unpack_sum(key: bytes, value: bytes) -> SumRecord:
    """The :class:`SumRecord` stored as ``key -> value``; a value of the wrong size reads as malformed (last < first)."""
    first = int.from_bytes(key, "big")
    if len(value) != 12:
        return SumRecord(first, -1, 0)
    return SumRecord(first, int.from_bytes(value[:8], "big"), int.from_bytes(value[8:], "big"))


class _Values:
    """Stored values a run at a time from :data:`RawChunk` s, consumed in seq order."""

    __slots__ = ("_chunks", "_first", "_values", "_i")

    def __init__(self, chunks: Iterable[RawChunk]) -> None:
        self._chunks = iter(chunks)
        self._first, self._values, self._i = 0, list[bytes](), 0
        self._advance()

    def _advance(self) -> None:
        chunk = next(self._chunks, None)
        if chunk is None:
            self._values = None  # type: ignore[assignment]
        else:
            self._first, self._values = chunk
            self._i = 0

    def until(self, end: int) -> Iterator[tuple[int, list[bytes]]]:
        """``(first_seq, values)`` runs of the stored values with seq < ``end`` not yet consumed."""
        while self._values is not None:
            seq = self._first + self._i
            if seq >= end:
                return
            n = min(len(self._values) - self._i, end - seq)
            if self._i == 0 and n == len(self._values):
                yield seq, self._values
            else:
                yield seq, self._values[self._i:self._i + n]
            self._i += n
            if self._i == len(self._values):
                self._advance()


def _unsummed(runs: Iterator[tuple[int, list[bytes]]], problem: Problem) -> Iterator[SumProblem]:
    lo = hi = -1
    count = 0
    for first, values in runs:
        if lo < 0:
            lo = first
        hi, count = first + len(values) - 1, count + len(values)
    if count:
        yield SumProblem(lo, hi, problem, count, count)


def verify(sums: Iterable[SumRecord], chunks: Iterable[RawChunk], stop: int | None = None) -> Iterator[SumProblem]:
    """Yield a :class:`SumProblem` for every range of stored values with seq < ``stop`` that does not verify.

    Args:
        sums: the sum records in key (first seq) order.
        chunks: the stored values in seq order (``read_chunks``), from seq 0 -- or from the first seq
            of the first record of ``sums`` (a verification of the log from that record on).
        stop: records starting at or after it, and values from it on, are not read
            (``None``: all of them).

    One pass over both; a record's CRC is accumulated chunk piece by chunk piece
    (``crc32(b, crc32(a)) == crc32(a + b)``), so no range is held in memory twice.
    """
    end = stop if stop is not None else 1 << 64
    values = _Values(chunks)
    seen = False  # a record was read: from here on an unsummed value is stray, not old
    prev_last = -1
    for first, last, crc in sums:
        if first >= end:
            break
        if last < first or first <= prev_last:
            yield SumProblem(first, max(last, first), "malformed")
            continue
        yield from _unsummed(values.until(first), "stray" if seen else "uncovered")
        seen, prev_last = True, last
        got, acc = 0, 0
        for _, run in values.until(min(last + 1, end)):
            acc = zlib.crc32(b"".join(run), acc)
            got += len(run)
        if got != last - first + 1:
            yield SumProblem(first, last, "missing", last - first + 1, got)
        elif acc != crc:
            yield SumProblem(first, last, "mismatch", crc, acc)
    yield from _unsummed(values.until(end), "stray" if seen else "uncovered")
