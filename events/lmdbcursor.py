"""Reads inside one LMDB read transaction of :class:`events.log.LmdbLog`: its stored pairs, its sum
records, the record covering a seq, and the snapshot next to a key.

Each takes the transaction (and the database) its caller opened, so a reader that needs two of them
(the checksums and the values, :meth:`~events.log.LmdbLog.verify_sums`) sees one snapshot of a live
writer's log. Keys are 8-byte big-endian seqs (:func:`events.logbase.seq_key`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import lmdb

from events.chunks import RawChunk, ends_read
from events.logbase import seq_key
from events.sums import SumRecord, unpack_sum

__all__ = ["covering", "nearest", "passing", "stored", "sum_records"]


def stored(txn: lmdb.Transaction, db: lmdb._Database, start: int, stop: int | None) -> Iterator[tuple[int, bytes]]:
    """``(seq, value)`` of the stored values from ``start`` on, in key order, ending at ``stop``.

    A bounded read ends at the first key at or past ``stop`` that is in order
    (:func:`events.chunks.ends_read`): a changed key (bit rot) is yielded as stored, never taken
    for the end of the range, so no entry after it is dropped silently.
    """
    cur = txn.cursor(db)
    if stop is None:
        if cur.set_range(seq_key(max(start, 0))):
            yield from ((int.from_bytes(key, "big"), value) for key, value in cur)
        return
    if not cur.last():
        return
    final = int.from_bytes(cur.key(), "big")
    if not cur.set_range(seq_key(max(start, 0))):
        return
    entries = iter(cur)
    entry = next(entries, None)
    while entry is not None:
        seq, following = int.from_bytes(entry[0], "big"), next(entries, None)
        if seq >= stop and ends_read(seq, final, None if following is None else int.from_bytes(following[0], "big")):
            return  # in order: the end of the range (a changed key past it does not end the read)
        yield seq, entry[1]
        entry = following


def sum_records(txn: lmdb.Transaction, db: lmdb._Database | None, start: int, stop: int | None) -> Iterator[SumRecord]:
    """The sum records (:mod:`events.sums`) whose first seq is in ``[start, stop)``; none without a sums database."""
    if db is None:
        return
    cur = txn.cursor(db)
    if not cur.set_range(seq_key(max(start, 0))):
        return
    for key, value in cur:
        record = unpack_sum(key, value)
        if stop is not None and record.first >= stop:
            return
        yield record


def covering(txn: lmdb.Transaction, db: lmdb._Database | None, seq: int) -> int:
    """The first seq of the last sum record starting at or before ``seq`` (``seq`` when there is none)."""
    found = None if db is None else nearest(txn, db, seq_key(seq + 1), below=True)
    return seq if found is None else int.from_bytes(found[0], "big")


def nearest(txn: lmdb.Transaction, db: lmdb._Database, key: bytes, *, below: bool) -> tuple[bytes, bytes] | None:
    """The entry with the last key below ``key`` (``below``), or the first at or past it; None when there is none."""
    cur = txn.cursor(db)
    found = (cur.prev() if cur.set_range(key) else cur.last()) if below else cur.set_range(key)
    return (bytes(cur.key()), bytes(cur.value())) if found else None


def passing(chunks: Iterator[RawChunk], each: Callable[[int, list[bytes]], None]) -> Iterator[RawChunk]:
    """``chunks``, each handed to ``each`` before it is yielded."""
    for first, values in chunks:
        each(first, values)
        yield first, values
