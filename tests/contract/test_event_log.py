"""The event log contract: every implementation (memory, LMDB) must pass :class:`EventLogContract`.

Subclasses override the ``make_log`` fixture, a factory of fresh, writable logs. What only the
LMDB log does is in ``test_lmdb_log.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from events import (


    CorruptEventError,
    EventLogError,
    LmdbLog,
    LogClosedError,
    MemoryLog,
    UpdateCommitted,
)

from logcases import microbatch, mixed, receipt


class EventLogContract:
    """What every event log must do. ``make_log()`` returns a fresh writable log."""

    @pytest.fixture
    def make_log(self) -> Callable[[], Any]:
        raise NotImplementedError

    @pytest.fixture
    def log(self, make_log: Callable[[], Any]) -> Iterator[Any]:
        lg = make_log()
        yield lg
        lg.close()

    # --- sequencing and buffering ---------------------------------------------------

    def test_seqs_are_contiguous_from_zero(self, log: Any) -> None:
        seqs = [log.append(e) for e in mixed(7)]
        assert seqs == list(range(7))
        assert log.next_seq == 7
        log.flush()
        assert [s for s, _ in log.read_raw()] == list(range(7))
        # appends after a flush continue the sequence
        assert log.append(microbatch(99)) == 7

    def test_append_only_buffers_until_flush(self, log: Any) -> None:
        for e in mixed(4):
            log.append(e)
        assert list(log.read()) == []
        assert list(log.read_raw()) == []
        assert log.durable_seq == 0
        assert log.next_seq == 4

    def test_flush_writes_whole_buffer_at_once(self, log: Any) -> None:
        events = mixed(5)
        for e in events:
            log.append(e)
        log.flush()
        assert log.durable_seq == 5
        assert list(log.read()) == list(enumerate(events))
        # a second batch lands after the first, again in one go
        more = [microbatch(10), microbatch(11)]
        for e in more:
            log.append(e)
        assert len(list(log.read())) == 5
        log.flush()
        assert [e for _, e in log.read()] == events + more

    def test_commit_appends_flushes_and_syncs_exactly_once(self, log: Any) -> None:
        log.append(microbatch(0))
        log.append(microbatch(1))
        log.flush()
        assert log.syncs == 0, "a plain flush must not fsync"
        log.append(microbatch(2))
        before = log.syncs
        seq = log.commit(receipt(1))
        assert seq == 3
        assert log.syncs == before + 1
        assert log.durable_seq == 4
        assert [e for _, e in log.read(start=2)] == [microbatch(2), receipt(1)]
        log.flush()
        assert log.syncs == before + 1

    def test_flush_sync_counts_one_sync(self, log: Any) -> None:
        log.flush(sync=True)
        assert log.syncs == 1

    def test_read_by_range_is_half_open(self, log: Any) -> None:
        events = mixed(10)
        for e in events:
            log.append(e)
        log.flush()
        assert list(log.read(3, 6)) == [(s, events[s]) for s in range(3, 6)]
        assert list(log.read(start=8)) == [(8, events[8]), (9, events[9])]
        assert list(log.read(stop=2)) == [(0, events[0]), (1, events[1])]
        assert list(log.read(5, 5)) == []
        assert list(log.read(start=10)) == []
        assert list(log.read(start=50)) == []
        assert [s for s, _ in log.read_raw(4, 7)] == [4, 5, 6]

    def test_read_chunks_are_the_raw_values_in_runs_of_consecutive_seqs(self, log: Any) -> None:
        for e in mixed(23):
            log.append(e)
        log.flush()
        for size in range(1, 9):
            log.read_chunk = size
            for start, stop in [(0, None), (0, 23), (2, 9), (3, 8), (5, 6), (7, 7), (22, None), (23, None), (40, 50)]:
                chunks = list(log.read_chunks(start, stop))
                assert all(0 < len(values) <= size for _, values in chunks)
                flat = [(first + i, raw) for first, values in chunks for i, raw in enumerate(values)]
                assert flat == list(log.read_raw(start, stop)), (size, start, stop)

    def test_check_keys_counts_the_stored_keys(self, log: Any) -> None:
        assert log.check_keys() == 0
        for e in mixed(9):
            log.append(e)
        assert log.check_keys() == 0  # buffered, not stored
        log.flush()
        assert log.check_keys() == 9

    def test_read_filters_by_kinds(self, log: Any) -> None:
        events = mixed(10)
        for e in events:
            log.append(e)
        log.flush()
        receipts = list(log.read(kinds=["update_committed"]))
        assert receipts == [(s, e) for s, e in enumerate(events) if isinstance(e, UpdateCommitted)]
        assert [s for s, _ in receipts] == [3, 6, 9]
        both = list(log.read(kinds={"update_committed", "epoch_began"}))
        assert [s for s, _ in both] == [0, 3, 6, 9]
        assert list(log.read(2, 7, kinds=("update_committed",))) == [(3, events[3]), (6, events[6])]
        assert list(log.read(kinds=[])) == []

    def test_discard_buffer_drops_unflushed_events(self, log: Any) -> None:
        log.append(microbatch(0))
        log.flush()
        log.append(microbatch(1))
        log.append(microbatch(2))
        assert log.discard_buffer() == 2
        assert log.next_seq == 1
        log.flush()
        assert [e for _, e in log.read()] == [microbatch(0)]
        # the sequence continues from the last flushed event, without a gap
        assert log.append(microbatch(3)) == 1
        log.flush()
        assert [s for s, _ in log.read_raw()] == [0, 1]

    def test_a_staged_blob_is_stored_by_the_next_flush_with_the_buffered_events(self, log: Any) -> None:
        log.append(microbatch(0))
        log.stage_blob(b"k1", b"manifest bytes")
        assert log.get_blob(b"k1") is None  # staged, not stored
        log.commit(microbatch(1))  # the commit's one synced write holds the blob too
        assert log.get_blob(b"k1") == b"manifest bytes" and log.syncs == 1
        assert [s for s, _ in log.read_raw()] == [0, 1]  # a blob is no event: the seqs are untouched
        log.stage_blob(b"k1", b"other bytes")  # a key is written once: the first value stays
        log.stage_blob(b"k2", b"alone")
        log.flush()  # no event buffered: the blob is written all the same
        assert (log.get_blob(b"k1"), log.get_blob(b"k2")) == (b"manifest bytes", b"alone")
        assert log.next_seq == 2 and log.get_blob(b"k3") is None

    def test_discard_buffer_drops_staged_blobs(self, log: Any) -> None:
        log.append(microbatch(0))
        log.stage_blob(b"k", b"never durable")
        log.discard_buffer()
        log.flush()
        assert log.get_blob(b"k") is None

    def test_undecodable_value_raises_corrupt_event_naming_its_seq(self, log: Any) -> None:
        events = mixed(5)
        for e in events:
            log.append(e)
        log.flush()
        log.put_raw(3, b"\xc1 not msgpack")
        assert list(log.read(stop=3)) == list(enumerate(events[:3]))
        with pytest.raises(CorruptEventError) as info:
            list(log.read())
        assert info.value.seq == 3
        assert "seq 3" in str(info.value)
        # raw reads still see the stored bytes
        assert dict(log.read_raw())[3] == b"\xc1 not msgpack"

    def test_value_of_unknown_kind_is_corrupt(self, log: Any) -> None:
        log.append(microbatch(0))
        log.flush()
        import msgspec

        log.put_raw(0, msgspec.msgpack.encode({"kind": "no_such_kind", "epoch": 0}))
        with pytest.raises(CorruptEventError) as info:
            list(log.read())
        assert info.value.seq == 0

    def test_closed_log_refuses_append_flush_and_read(self, make_log: Callable[[], Any]) -> None:
        lg = make_log()
        lg.append(microbatch(0))
        lg.flush()
        lg.close()
        with pytest.raises(LogClosedError):
            lg.append(microbatch(1))
        with pytest.raises(LogClosedError):
            lg.flush()
        with pytest.raises(LogClosedError):
            list(lg.read())
        with pytest.raises(LogClosedError):
            list(lg.read_chunks())
        assert issubclass(LogClosedError, EventLogError)


class TestMemoryLog(EventLogContract):
    @pytest.fixture
    def make_log(self) -> Callable[[], Any]:
        return MemoryLog


class TestLmdbLog(EventLogContract):
    @pytest.fixture
    def make_log(self, tmp_path: Path) -> Callable[[], Any]:
        counter = iter(range(1000))
        return lambda: LmdbLog(tmp_path / f"log{next(counter)}" / "events.lmdb")
