"""StoredPairs: the pairs of stored chunks, and the undecoded chunks for a consumer that decodes itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from events import CorruptEventError, EpochBegan, MicrobatchDone, encode
from events.chunks import RawChunk, StoredPairs


def _mb(i: int) -> MicrobatchDone:
    return MicrobatchDone(epoch=0, batch=i, rows=1, examples=1.0, loss=0.0)


def _chunks() -> Iterator[RawChunk]:
    yield 3, [encode(EpochBegan(epoch=0)), encode(_mb(0))]
    yield 7, [encode(_mb(1))]  # seqs 5 and 6 are missing


def test_pairs_number_each_chunk_from_its_first_seq() -> None:
    assert list(StoredPairs(_chunks())) == [(3, EpochBegan(epoch=0)), (4, _mb(0)), (7, _mb(1))]
    assert list(StoredPairs(_chunks(), kinds=["microbatch_done"])) == [(4, _mb(0)), (7, _mb(1))]
    assert list(StoredPairs(iter([]))) == []


def test_next_and_iteration_share_one_read() -> None:
    pairs = StoredPairs(_chunks())
    assert next(pairs) == (3, EpochBegan(epoch=0))
    assert [seq for seq, _ in pairs] == [4, 7]
    with pytest.raises(StopIteration):
        next(pairs)


def test_raw_chunks_are_offered_only_before_pairs_are_taken_and_without_a_kind_filter() -> None:
    fresh = StoredPairs(_chunks())
    raw = fresh.raw_chunks()
    assert raw is not None and next(raw)[0] == 3
    assert list(fresh) == [(7, _mb(1))]  # what the raw consumer took is gone from the pairs
    started = StoredPairs(_chunks())
    next(started)
    assert started.raw_chunks() is None
    assert StoredPairs(_chunks(), kinds=["epoch_began"]).raw_chunks() is None


def test_a_value_that_does_not_decode_is_named_by_its_seq() -> None:
    pairs = StoredPairs(iter([(10, [encode(_mb(0)), b"\xc1", encode(_mb(2))])]))
    with pytest.raises(CorruptEventError) as info:
        list(pairs)
    assert info.value.seq == 11
