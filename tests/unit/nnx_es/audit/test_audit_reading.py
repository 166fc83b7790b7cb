"""Reading a run's log for the tools: decodable events a chunk at a time, the tail read back from the end."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

from hypothesis import given, settings
from logkit import logs, memory_log

import nnx_es.audit.reading as reading
from bench.logbench import long_run_log
from events.codec import encode
from events.log import LmdbLog, MemoryLog
from events.schema import EpochBegan
from nnx_es.audit import committed_tail, decoded
from projections import tail_length


@settings(max_examples=300, deadline=None)
@given(logs)
def test_committed_tail_equals_the_tail_of_the_whole_prefix(pairs):
    log = memory_log(pairs)
    with mock.patch.object(reading, "_BACK_WINDOW", 2):  # several doubling windows on short logs
        for stop in range(len(pairs) + 1):
            assert committed_tail(log, stop) == tail_length(pairs[:stop]), stop


def test_decoded_skips_undecodable_values_and_keeps_every_other():
    log = MemoryLog()
    for epoch in range(3000):
        log.append(EpochBegan(epoch=epoch))
    log.flush()
    log.put_raw(5, b"\xc1")
    log.put_raw(2500, encode(EpochBegan(epoch=1))[:-1])
    seqs = [seq for seq, _ in decoded(log, 1, 2999)]
    assert seqs == [s for s in range(1, 2999) if s not in (5, 2500)]
    assert [e.epoch for s, e in decoded(log, 2995)] == list(range(2995, 3000))


def test_committed_tail_reads_the_end_of_a_long_log_not_the_log(tmp_path: Path):
    n = long_run_log(tmp_path / "events.lmdb", 200_000, batches=500)  # epochs of about 1,000 events
    stops = (n, n - 2, n - 700)  # finished; before the final LAST; crashed mid-epoch
    with LmdbLog(tmp_path / "events.lmdb", readonly=True) as log:
        expected = [tail_length(log.read(0, stop)) for stop in stops]
        read = 0
        chunks = log.read_chunks

        def counted(start: int = 0, stop: int | None = None):
            nonlocal read
            for first, values in chunks(start, stop):
                read += len(values)
                yield first, values

        log.read_chunks = counted  # type: ignore[method-assign]
        for stop, tail in zip(stops, expected):
            read = 0
            assert committed_tail(log, stop) == tail
            assert read <= 8 * 1024, (stop, read)  # a few epochs, not the 200,000 events
    assert expected[:2] == [0, 0] and expected[2] > 100
