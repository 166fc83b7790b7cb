"""What only the LMDB event log does, beyond the contract every log passes (``test_event_log.py``):
chunked reads over gaps and changed keys, reopening, blobs, readers beside a writer growing the
map, refusals of what is not a log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from events import (


    EventLogError,
    LmdbLog,
    RunStarted,
    SequenceGapError,
)
from events.errors import TruncatedLogError

from crashkit import change_key  # noqa: E402 (tests/faults is put on sys.path by conftest)
from logcases import REPO, Reader, microbatch, mixed, receipt


class TestLmdbOnly:
    """LmdbLog beyond the contract."""

    def test_a_gap_in_the_stored_seqs_starts_a_new_chunk(self, tmp_path: Path) -> None:
        with LmdbLog(tmp_path / "events.lmdb") as lg:
            for e in mixed(20):
                lg.append(e)
            lg.flush()
            for seq in (0, 5, 6, 13, 19):
                lg.delete_raw(seq)
            for size in (1, 2, 3, 4, 7, 64):
                lg.read_chunk = size
                for start, stop in [(0, None), (4, 14), (6, 13), (7, 13)]:
                    chunks = list(lg.read_chunks(start, stop))
                    flat = [(first + i, raw) for first, values in chunks for i, raw in enumerate(values)]
                    assert flat == list(lg.read_raw(start, stop)), (size, start, stop)
            lg.read_chunk = 64
            assert [(first, len(values)) for first, values in lg.read_chunks()] == [(1, 4), (7, 6), (14, 5)]

    @pytest.mark.parametrize("new", [11, 8, 9, 3, 1 << 40], ids=lambda k: f"key 10 -> {k}")
    def test_a_changed_key_loses_no_value_in_read_chunks_and_fails_check_keys(self, tmp_path: Path, new: int) -> None:
        """A key changed on disk (LMDB's order broken): every chunk boundary that sees it splits the chunk
        at the keys themselves, positionally: no value is dropped or read twice."""
        path = tmp_path / "events.lmdb"
        with LmdbLog(path) as lg:
            for e in mixed(20):
                lg.append(e)
            lg.flush()
        change_key(path, 10, new)
        with LmdbLog(path, readonly=True) as lg:
            raw = list(lg.read_raw())
            assert [s for s, _ in raw] == [*range(10), new, *range(11, 20)]
            for size in (1, 2, 3, 4, 7, 64):
                lg.read_chunk = size
                assert [v for _, values in lg.read_chunks() for v in values] == [v for _, v in raw], size
            lg.read_chunk = 1  # every key a chunk boundary: the seqs are the keys, as read_raw yields them
            for start, stop in [(0, None), (0, 20), (4, 14), (9, 12), (11, None)]:
                flat = [(first + i, v) for first, values in lg.read_chunks(start, stop) for i, v in enumerate(values)]
                assert flat == list(lg.read_raw(start, stop)), (start, stop)
            with pytest.raises(SequenceGapError, match=f"changed key: key {new} follows key 9 and precedes key 11"):
                lg.check_keys()

    @pytest.mark.parametrize("new", [1 << 40, 15, 19], ids=lambda k: f"key 10 -> {k}")
    def test_a_bounded_read_does_not_end_at_a_changed_key_past_its_stop(self, tmp_path: Path, new: int) -> None:
        """Bit rot turned key 10 into a key at or past ``stop``: the read goes on by position (the
        entries after it are not dropped silently) and ends at the first key past ``stop`` in order."""
        path = tmp_path / "events.lmdb"
        with LmdbLog(path) as lg:
            for e in mixed(20):
                lg.append(e)
            lg.flush()
        change_key(path, 10, new)
        with LmdbLog(path, readonly=True) as lg:
            for start, stop in [(0, 20), (0, 14), (4, 12), (10, 20)]:
                want = [*range(start, 10), new, *range(11, stop)] if start <= 10 else [*range(start, stop)]
                raw = list(lg.read_raw(start, stop))
                assert [s for s, _ in raw] == want, (start, stop)
                for size in (2, 3, 4, 7, 64):  # the same values (a key inside a chunk may read as its place)
                    lg.read_chunk = size
                    assert [v for _, values in lg.read_chunks(start, stop) for v in values] == [v for _, v in raw]
                lg.read_chunk = 1  # every key a chunk boundary: the seqs are the keys, as read_raw yields them
                flat = [(first + i, v) for first, values in lg.read_chunks(start, stop) for i, v in enumerate(values)]
                assert flat == raw, (start, stop)
                assert [s for s, _ in lg.read(start, stop)] == want

    def test_reopen_sees_same_events_and_continues_sequence(self, tmp_path: Path) -> None:
        path = tmp_path / "events.lmdb"
        events = mixed(6)
        with LmdbLog(path) as lg:
            for e in events:
                lg.append(e)
            lg.commit(receipt(9))
            lg.append(microbatch(42))  # never flushed: lost on close, like a crash
        with LmdbLog(path) as lg:
            assert lg.next_seq == 7
            assert lg.durable_seq == 7
            assert [e for _, e in lg.read()] == [*events, receipt(9)]
            assert lg.append(microbatch(7)) == 7
            lg.flush()
        with LmdbLog(path) as lg:
            assert lg.next_seq == 8
            assert list(lg.read(start=7)) == [(7, microbatch(7))]

    def test_blobs_survive_reopen_and_are_read_read_only(self, tmp_path: Path) -> None:
        path = tmp_path / "events.lmdb"
        big = os.urandom(300_000)  # overflow pages
        with LmdbLog(path) as lg:
            lg.commit(microbatch(0))
            lg.stage_blob(b"k", big)
            lg.commit(microbatch(1))
        with LmdbLog(path, readonly=True) as ro:
            assert ro.get_blob(b"k") == big and ro.get_blob(b"missing") is None
            with pytest.raises(EventLogError, match="read-only"):
                ro.stage_blob(b"x", b"y")

    def test_a_reader_mid_read_survives_a_writer_growing_the_map(self, tmp_path: Path) -> None:
        """A writer in another process grows the map far past its start while a reader has a read
        open (as the audit does, looking up manifests between chunks): nothing fails."""
        path = tmp_path / "events.lmdb"
        writer = (
            "import os, sys\nfrom events.log import LmdbLog\nfrom events.schema import EpochBegan\n"
            "w = LmdbLog(sys.argv[1])\nstart = w.next_seq\n"
            "for i in range(int(sys.argv[2])):\n"
            "    w.stage_blob(b'k%d' % (start + i), bytes([i % 251]) * int(sys.argv[3]))\n"
            "    w.append(EpochBegan(epoch=start + i)); w.flush(sync=True)\n"
            "print(w.map_size())\n"
        )

        def write(n: int, size: int) -> int:
            out = subprocess.run([sys.executable, "-c", writer, str(path), str(n), str(size)], check=True,
                                 capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
            return int(out.stdout)

        start_map = write(2100, 10)
        with LmdbLog(path, readonly=True) as ro:
            assert ro.get_blob(b"k0") == bytes([0]) * 10
            ro.read_chunk = 1024
            chunks = ro.read_chunks(0, ro.next_seq)
            assert next(chunks)[0] == 0
            assert write(10, 4 << 20) > start_map  # grown while the reader's read is open
            assert ro.get_blob(b"k2100") == bytes([0]) * (4 << 20)
            assert [first for first, _ in chunks] == [1024, 2048]
            assert ro.refresh() == 2110 and ro.get_blob(b"k2109") == bytes([9]) * (4 << 20)

    def test_a_reader_in_the_writers_process_shares_its_environment(self, tmp_path: Path) -> None:
        path = tmp_path / "events.lmdb"
        with LmdbLog(path) as lg:
            lg.stage_blob(b"k", b"manifest")
            lg.commit(microbatch(0))
            lg.append(microbatch(1))  # buffered: a reader does not see it
            with LmdbLog(tmp_path / "." / "events.lmdb", readonly=True) as ro:  # the same log, spelled otherwise
                assert [e for _, e in ro.read()] == [microbatch(0)] and ro.get_blob(b"k") == b"manifest"
                with pytest.raises(EventLogError, match="read-only"):
                    ro.append(microbatch(2))
            lg.commit(microbatch(2))  # the reader's close left the writer's environment open
            with LmdbLog(path, readonly=True) as ro:
                assert ro.next_seq == 3
        with LmdbLog(path, readonly=True) as ro:  # the writer closed: a reader opens its own
            assert [s for s, _ in ro.read_raw()] == [0, 1, 2] and not ro._shared

    def test_a_log_older_than_blobs_reads_none(self, tmp_path: Path) -> None:
        import lmdb

        path = tmp_path / "events.lmdb"
        with LmdbLog(path) as lg:
            lg.commit(microbatch(0))
        env = lmdb.open(str(path), max_dbs=8)
        with env.begin(write=True) as txn:
            txn.drop(env.open_db(b"blobs", txn=txn), delete=True)  # as a writer before blobs left it
        env.close()
        with LmdbLog(path, readonly=True) as ro:
            assert ro.get_blob(b"k") is None and [s for s, _ in ro.read_raw()] == [0]

    def test_a_blob_of_a_failed_write_is_not_stored(self, tmp_path: Path) -> None:
        with LmdbLog(tmp_path / "events.lmdb") as lg:
            lg.commit(microbatch(0))
            lg.append(microbatch(1))
            lg.stage_blob(b"k", b"manifest")
            lg._buffer[0] = (0, lg._buffer[0][1])  # a seq already stored: the write transaction aborts
            with pytest.raises(EventLogError, match="already stored"):
                lg.flush(sync=True)
            assert lg.get_blob(b"k") is None  # aborted with the events it was staged with

    def test_tiny_map_grows_on_demand_without_losing_events(self, tmp_path: Path) -> None:
        initial = 64 << 10
        path = tmp_path / "events.lmdb"
        payload = "x" * 3000
        events = [RunStarted(run_id=f"r{i}", seed=i, recipe={"blob": payload}) for i in range(150)]
        with LmdbLog(path, map_size=initial) as lg:
            assert lg.map_size() == initial
            # half in one big transaction, the rest in small flushes
            for e in events[:75]:
                lg.append(e)
            lg.flush()
            for i, e in enumerate(events[75:]):
                lg.append(e)
                if i % 10 == 0:
                    lg.flush()
            lg.commit(microbatch(0))
            grown = lg.map_size()
            assert grown >= 8 * initial, "450 KB of events need at least three doublings of 64 KiB"
            assert [e for _, e in lg.read()] == [*events, microbatch(0)]
        with LmdbLog(path, readonly=True) as ro:
            assert [s for s, _ in ro.read_raw()] == list(range(151))

    def test_readonly_reader_beside_live_writer(self, tmp_path: Path) -> None:
        # py-lmdb refuses a second open of one environment in a process, and readers
        # (replay, inspect, dashboards) are other processes anyway: the reader is a child.
        path = tmp_path / "events.lmdb"
        with LmdbLog(path, map_size=64 << 10) as writer:
            first = mixed(4)
            for e in first:
                writer.append(e)
            writer.flush()
            writer.append(microbatch(50))  # buffered, not flushed: invisible to readers
            # the reader maps only 64 KiB too, so the writer's growth outruns its map
            with Reader(path, map_size=64 << 10) as reader:
                seen = reader.ask("read")
                assert seen["next_seq"] == 4
                assert seen["raw"] == [raw.hex() for _, raw in writer.read_raw()]
                writer.flush()
                assert reader.ask("read")["next_seq"] == 4, "a reader sees new events only after refresh()"
                # the reader follows the writer after refresh(), even across a map growth
                big = [RunStarted(run_id="r", seed=i, recipe={"b": "y" * 4000}) for i in range(60)]
                for e in big:
                    writer.append(e)
                writer.commit(receipt(1))
                assert writer.map_size() > 64 << 10
                assert reader.ask("refresh")["n"] == 4 + 1 + 60 + 1
                seen = reader.ask("read")
                assert seen["next_seq"] == 66
                assert seen["raw"] == [raw.hex() for _, raw in writer.read_raw()]
                assert seen["kinds"] == [e.KIND for e in [*first, microbatch(50), *big, receipt(1)]]
                refused = reader.ask("write")
                assert refused["append"] == "EventLogError"
                assert refused["flush"] == "EventLogError"
                assert refused["next_seq"] == 66, "a refused append must not take a seq"
            # the writer's log is untouched by the reader's attempts
            assert [s for s, _ in writer.read_raw()] == list(range(66))

    def test_readonly_open_of_missing_dir_raises(self, tmp_path: Path) -> None:
        missing = tmp_path / "nope" / "events.lmdb"
        with pytest.raises(EventLogError) as info:
            LmdbLog(missing, readonly=True)
        assert str(missing) in str(info.value)
        assert not missing.exists(), "a read-only open must not create the log"

    def test_an_empty_data_file_is_refused_as_truncated_and_left_empty(self, tmp_path: Path) -> None:
        path = tmp_path / "events.lmdb"
        path.mkdir()
        (path / "data.mdb").write_bytes(b"")
        for readonly in (True, False):  # a writer would initialize it as a new, empty log
            with pytest.raises(TruncatedLogError, match=rf"is truncated: {re.escape(str(path / 'data.mdb'))} is empty"):
                LmdbLog(path, readonly=readonly)
        assert (path / "data.mdb").stat().st_size == 0 and sorted(p.name for p in path.iterdir()) == ["data.mdb"]
        with LmdbLog(tmp_path / "new" / "events.lmdb") as lg:  # a new log (no data.mdb yet) is created as before
            assert lg.next_seq == 0 and lg.check_keys() == 0

    def test_open_of_something_that_is_not_a_log_raises(self, tmp_path: Path) -> None:
        garbage = tmp_path / "garbage.lmdb"
        garbage.mkdir()
        (garbage / "data.mdb").write_bytes(b"\x00garbage" * 1000)
        with pytest.raises(EventLogError):
            LmdbLog(garbage, readonly=True)
        a_file = tmp_path / "a_file"
        a_file.write_bytes(b"not a directory")
        with pytest.raises(EventLogError):
            LmdbLog(a_file)

    def test_delete_raw_forges_a_gap_visible_in_read_raw(self, tmp_path: Path) -> None:
        with LmdbLog(tmp_path / "events.lmdb") as lg:
            for e in mixed(6):
                lg.append(e)
            lg.flush()
            lg.delete_raw(2)
            assert [s for s, _ in lg.read_raw()] == [0, 1, 3, 4, 5]
            assert [s for s, _ in lg.read()] == [0, 1, 3, 4, 5]

    def test_flush_refuses_a_seq_another_writer_stored_and_keeps_its_batch(self, tmp_path: Path) -> None:
        with LmdbLog(tmp_path / "events.lmdb") as lg:
            lg.append(microbatch(0))
            lg.flush()
            foreign = receipt(7)
            from events import encode

            lg.put_raw(1, encode(foreign))  # stands in for a second, lease-less writer
            lg.append(microbatch(1))
            lg.append(microbatch(2))
            with pytest.raises(EventLogError) as info:
                lg.flush()
            assert "seq 1" in str(info.value)
            # nothing of the batch was stored, the foreign event is intact, the batch is still buffered
            assert list(lg.read()) == [(0, microbatch(0)), (1, foreign)]
            assert lg.durable_seq == 1
            assert lg.next_seq == 3
