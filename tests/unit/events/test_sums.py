"""Checksums of the LMDB log (events/sums.py): one record per write transaction, verified range by range."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.codec import encode
from events.errors import EventLogError
from events.log import LmdbLog, seq_key
from events.schema import EpochBegan
from events.sums import SUMS_DB, SumProblem, SumRecord, verify

REPO = Path(__file__).resolve().parents[3]


def _fill(log: LmdbLog, batches: list[int]) -> None:
    """Append ``batches[i]`` events and flush, for each i."""
    n = log.next_seq
    for size in batches:
        for _ in range(size):
            log.append(EpochBegan(epoch=n))
            n += 1
        log.flush()


def write_old_format(path: Path, n: int) -> None:
    """A log as written before checksums existed: the same environment, no ``sums`` database."""
    path.mkdir(parents=True)
    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    events = env.open_db(b"events")
    env.open_db(b"snapshots")
    with env.begin(write=True, db=events) as txn:
        for seq in range(n):
            txn.put(seq_key(seq), encode(EpochBegan(epoch=seq)), append=True)
    env.close()


def _db_names(path: Path) -> set[bytes]:
    env = lmdb.open(str(path), readonly=True, max_dbs=4, lock=False)
    try:
        with env.begin() as txn:
            return {k for k, _ in txn.cursor()}
    finally:
        env.close()


def test_each_flush_stores_one_record_with_the_crc_of_its_values(tmp_path: Path) -> None:
    with LmdbLog(tmp_path / "l") as log:
        _fill(log, [3, 1, 5])
        log.flush()  # an empty flush writes nothing
        records = list(log.read_sums())
        assert [(r.first, r.last) for r in records] == [(0, 2), (3, 3), (4, 8)]
        for r in records:
            values = [raw for _, raw in log.read_raw(r.first, r.last + 1)]
            assert r.crc == zlib.crc32(b"".join(values))
        assert list(log.verify_sums()) == []
        assert [(r.first, r.last) for r in log.read_sums(3, 4)] == [(3, 3)]


class _FailingSync:
    """Stands in for the LMDB environment; its sync fails (the disk refused the fsync)."""

    def __init__(self, env: Any) -> None:
        self._env = env

    def sync(self, force: bool) -> None:
        raise lmdb.Error("injected sync failure")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def test_a_batch_taken_back_after_its_sync_failed_leaves_no_sum_record(tmp_path: Path) -> None:
    with LmdbLog(tmp_path / "l") as log:
        _fill(log, [2])
        real = log._env
        log._env = _FailingSync(real)
        log.append(EpochBegan(epoch=2))
        with pytest.raises(EventLogError, match="taken back"):
            log.commit(EpochBegan(epoch=3))
        log._env = real
        assert [(r.first, r.last) for r in log.read_sums()] == [(0, 1)]
        assert list(log.verify_sums()) == []
        log.flush(sync=True)  # the batch, retried, gets its record again
        assert [(r.first, r.last) for r in log.read_sums()] == [(0, 1), (2, 3)]
        assert list(log.verify_sums()) == []


def test_blobs_written_with_a_batch_whose_sync_failed_are_taken_back_and_staged_again(tmp_path: Path) -> None:
    """A blob of an unsynced write is never trusted: a later LAST naming it must write it again."""
    with LmdbLog(tmp_path / "l") as log:
        _fill(log, [2])
        log.stage_blob(b"old", b"synced before")
        log.flush(sync=True)
        real = log._env
        log._env = _FailingSync(real)
        log.stage_blob(b"manifest", b"bytes of the failed write")
        log.stage_blob(b"old", b"synced before")  # already stored: not added, so not taken back
        with pytest.raises(EventLogError, match=r"events 2\.\.2 and 1 blob\(s\) were taken back"):
            log.commit(EpochBegan(epoch=2))
        log._env = real
        assert log.get_blob(b"manifest") is None and log.get_blob(b"old") == b"synced before"
        log.flush(sync=True)  # retried: the blob goes with its events again
        assert log.get_blob(b"manifest") == b"bytes of the failed write"
        assert [s for s, _ in log.read_raw()] == [0, 1, 2]


def test_a_changed_value_is_a_mismatch_naming_its_batch(tmp_path: Path) -> None:
    with LmdbLog(tmp_path / "l") as log:
        _fill(log, [3, 4, 2])
        with log._env.begin(write=True, db=log._events) as txn:  # bypass put_raw: no reseal
            txn.put(seq_key(5), encode(EpochBegan(epoch=50)))
        (problem,) = log.verify_sums()
        assert problem[:3] == (3, 6, "mismatch")
        values = [raw for _, raw in log.read_raw(3, 7)]
        assert problem.found == zlib.crc32(b"".join(values)) != problem.expected


def test_values_lost_at_the_end_are_missing_and_a_hole_inside_too(tmp_path: Path) -> None:
    with LmdbLog(tmp_path / "l") as log:
        _fill(log, [3, 4])
        log.delete_raw(6)
        log.delete_raw(1)
        assert list(log.verify_sums()) == [SumProblem(0, 2, "missing", 3, 2), SumProblem(3, 6, "missing", 4, 3)]


def test_put_raw_forges_as_the_writer_would_have_written(tmp_path: Path) -> None:
    with LmdbLog(tmp_path / "l") as log:
        _fill(log, [3, 4])
        log.put_raw(4, encode(EpochBegan(epoch=40)))
        log.put_raw(7, encode(EpochBegan(epoch=70)))  # past every record: a record of its own
        assert [(r.first, r.last) for r in log.read_sums()] == [(0, 2), (3, 6), (7, 7)]
        assert list(log.verify_sums()) == []


def test_an_old_log_opens_read_only_without_creating_anything_and_is_uncovered(tmp_path: Path) -> None:
    path = tmp_path / "old"
    write_old_format(path, 5)
    before = (path / "data.mdb").read_bytes()
    with LmdbLog(path, readonly=True) as log:
        assert log.next_seq == 5
        assert list(log.read_sums()) == []
        assert list(log.verify_sums()) == [SumProblem(0, 4, "uncovered", 5, 5)]
    assert (path / "data.mdb").read_bytes() == before
    assert SUMS_DB not in _db_names(path)


def _append_in_another_process(path: Path, batches: list[int]) -> None:
    """Open ``path`` for appending in a subprocess (LMDB allows one environment per path per process)."""
    code = (
        "import sys; from pathlib import Path; from events.log import LmdbLog; from events.schema import EpochBegan\n"
        f"with LmdbLog(Path({str(path)!r})) as log:\n"
        f"    for size in {batches!r}:\n"
        "        for _ in range(size): log.append(EpochBegan(epoch=log.next_seq))\n"
        "        log.flush(sync=True)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_appends_to_an_old_log_are_covered_and_a_live_reader_sees_them(tmp_path: Path) -> None:
    path = tmp_path / "old"
    write_old_format(path, 5)
    with LmdbLog(path, readonly=True) as reader:  # opened before a writer creates the sums database
        assert list(reader.verify_sums()) == [SumProblem(0, 4, "uncovered", 5, 5)]
        _append_in_another_process(path, [2, 3])
        assert reader.refresh() == 10
        assert [(r.first, r.last) for r in reader.read_sums()] == [(5, 6), (7, 9)]
        assert list(reader.verify_sums()) == [SumProblem(0, 4, "uncovered", 5, 5)]
        assert list(reader.verify_sums(stop=7)) == [SumProblem(0, 4, "uncovered", 5, 5)]
    assert SUMS_DB in _db_names(path)
    with LmdbLog(path) as log:  # reopened for appending (a resume)
        assert log.next_seq == 10
        _fill(log, [1])
        assert list(log.verify_sums()) == [SumProblem(0, 4, "uncovered", 5, 5)]
        assert [(r.first, r.last) for r in log.read_sums()][-1] == (10, 10)


def test_verify_stops_at_stop_and_names_stray_and_malformed_records() -> None:
    chunks = [(0, [b"a", b"b", b"c"]), (3, [b"d", b"e"])]
    crc = zlib.crc32
    good = [SumRecord(0, 1, crc(b"ab")), SumRecord(2, 4, crc(b"cde"))]
    assert list(verify(good, chunks)) == []
    assert list(verify(good, chunks, stop=2)) == []
    assert list(verify(good[:1], chunks)) == [SumProblem(2, 4, "stray", 3, 3)]
    assert list(verify(good[1:], chunks)) == [SumProblem(0, 1, "uncovered", 2, 2)]
    overlapping = [good[0], SumRecord(1, 4, 0), good[1]]
    assert list(verify(overlapping, chunks)) == [SumProblem(1, 4, "malformed")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=8), st.integers(1, 5), st.data())
def test_verify_catches_any_changed_value_whatever_the_chunking(batches: list[int], chunk: int, data: Any) -> None:
    values = [bytes([i % 251]) * (1 + i % 5) for i in range(sum(batches))]
    records, first = [], 0
    for size in batches:
        records.append(SumRecord(first, first + size - 1, zlib.crc32(b"".join(values[first:first + size]))))
        first += size
    at = data.draw(st.integers(0, len(values) - 1))
    bit = data.draw(st.integers(0, 8 * len(values[at]) - 1))
    changed = list(values)
    changed[at] = bytes(b ^ (1 << bit % 8) if i == bit // 8 else b for i, b in enumerate(values[at]))
    chunks = [(i, changed[i:i + chunk]) for i in range(0, len(changed), chunk)]
    (problem,) = verify(records, chunks)
    assert problem.problem == "mismatch" and problem.first <= at <= problem.last
