"""Checking that a log's stored keys are the seqs 0, 1, 2, ... in stored order.

The checksums (:mod:`events.sums`) cover values only, and the chunked reads
(:meth:`events.log.LmdbLog.read_chunks`) derive seqs from the key at each chunk
boundary: a changed key (20 stored as 21, a duplicate; or as 16, out of order)
inside a chunk is seen by neither. :func:`check_keys` reads the keys themselves:
a block of keys is joined and compared with the expected seqs as one array of
unsigned 64-bit integers (C-level), so the check costs about what the cursor
takes to yield the keys; only a block that differs is walked key by key to name
the first key out of place.
"""

from __future__ import annotations

import itertools
import sys
from array import array
from collections.abc import Callable, Iterator
from typing import NoReturn

from events.errors import SequenceGapError

__all__ = ["check_items", "check_keys"]

#: keys compared per block
_BLOCK = 1 << 16

if array("Q").itemsize != 8:  # pragma: no cover - every platform CPython supports has 8-byte unsigned long long
    raise ImportError("events.keys needs array typecode 'Q' of 8 bytes")


def check_keys(keys: Iterator[bytes], first: int = 0) -> int:
    """Check that ``keys`` (8-byte big-endian seqs, in stored order) are ``first``, ``first + 1``, ...; return how
    many there are.

    Raises:
        SequenceGapError: at the first key that is not the seq of its position, naming the
            seq due there, the key found and the keys around it (a changed key, a gap, a
            duplicate, a key out of order; a key that is not 8 bytes long reads as the
            integer its bytes spell).
    """
    n = first
    while block := list(itertools.islice(keys, _BLOCK)):
        if not _in_order(block, n):
            _raise_first([*block, *itertools.islice(keys, 1)], n)  # with the key after the block
        n += len(block)
    return n - first


def check_items(items: Iterator[tuple[bytes, bytes]], each: Callable[[int, list[bytes]], None], first: int = 0,
                size: int = 1024) -> int:
    """:func:`check_keys` over ``(key, value)`` items, in one pass: each block of at most ``size`` values is
    handed to ``each(first_seq, values)`` once its keys are checked; returns how many there are.

    Raises:
        SequenceGapError: as :func:`check_keys` (the values of that block are not handed on).
    """
    n = first
    while block := list(itertools.islice(items, size)):
        keys, values = zip(*block)
        if not _in_order(keys, n):  # type: ignore[arg-type]
            _raise_first([*keys, *(k for k, _ in itertools.islice(items, 1))], n)
        each(n, list(values))
        n += len(block)
    return n - first


def _in_order(block: list[bytes], first: int) -> bool:
    joined = b"".join(block)
    if len(joined) != 8 * len(block):
        return False
    found = array("Q", joined)
    if sys.byteorder == "little":
        found.byteswap()
    return found == array("Q", range(first, first + len(block)))


def _raise_first(keys: list[bytes], first: int) -> NoReturn:
    """Raise at the first of ``keys`` (the first at seq ``first``) that is not its position's seq."""
    previous = first - 1 if first > 0 else None
    for i, key in enumerate(keys):
        expected, seq = first + i, int.from_bytes(key, "big")
        if seq != expected or len(key) != 8:
            following = int.from_bytes(keys[i + 1], "big") if i + 1 < len(keys) else None
            raise SequenceGapError(expected, seq, previous, following)
        previous = seq
    raise AssertionError(f"keys from seq {first} were compared unequal yet each is in its place")
