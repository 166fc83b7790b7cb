"""projections.snapshots: the stored form of a snapshot, its verification, and the writer's fold."""

from __future__ import annotations

import zlib

import msgspec
import pytest

from events.log import LmdbLog, MemoryLog
from events.schema import (Counters, EpochBegan, HistoryAppended, HistoryRecord, LastCommitted, MicrobatchDone,
                           RunStarted, TrainBegan)
from projections.snapshots import (SNAPSHOT_VERSION, Snapshot, SnapshotFolder, Unusable, decode_snapshot,
                                   encode_snapshot, newest_usable)
from projections.view import Projections, Projector, project


def _events(epochs: int = 4, batches: int = 3) -> list:
    out: list = [RunStarted(run_id="u", seed=0, optimizers=["sgd"]), TrainBegan(start_epoch=0, epochs=epochs)]
    for e in range(epochs):
        out.append(EpochBegan(epoch=e))
        out += [MicrobatchDone(epoch=e, batch=b, rows=4, examples=4.0, loss=0.1) for b in range(batches)]
        out.append(HistoryAppended(record=HistoryRecord(epoch=e, train={"loss": 0.1}, val={})))
        out.append(LastCommitted(manifest=f"{e:064x}", epoch=e, step=0, counters=Counters(epoch=e + 1)))
    return out


def _snap(seq: int = 7) -> Snapshot:
    return Snapshot(seq=seq, in_group=True, projections=Projections(seq=seq))


def test_a_snapshot_round_trips_through_its_stored_form():
    snap = _snap()
    assert decode_snapshot(7, encode_snapshot(snap)) == snap


@pytest.mark.parametrize("damage, reason", [
    (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "its checksum does not match its bytes"),
    (lambda v: v[:3], "3 bytes, too short"),
    (lambda v: zlib.crc32(b"\x01").to_bytes(4, "big") + b"\x01", "it does not decode"),
])
def test_a_damaged_snapshot_is_unusable_with_its_reason(damage, reason):
    got = decode_snapshot(7, damage(encode_snapshot(_snap())))
    assert isinstance(got, Unusable) and got.seq == 7 and reason in got.reason
    assert got.note().startswith("the projection snapshot at seq 7 is unusable (")


def test_a_snapshot_of_another_seq_or_version_is_unusable():
    assert "not the seq of its key" in decode_snapshot(8, encode_snapshot(_snap(7))).reason
    future = msgspec.structs.replace(_snap(), version=SNAPSHOT_VERSION + 1)
    assert "schema version 2" in decode_snapshot(7, encode_snapshot(future)).reason


def test_newest_usable_skips_and_notes_the_unusable_ones():
    notes: list[str] = []
    stored = [(9, b"junk!"), (7, encode_snapshot(_snap(7))), (3, encode_snapshot(_snap(3)))]
    assert newest_usable(stored, notes) == _snap(7)
    assert len(notes) == 1 and "seq 9" in notes[0]
    assert newest_usable([], notes) is None


@pytest.mark.parametrize("make", ["memory", "lmdb"])
def test_both_logs_store_snapshots_by_seq_newest_or_oldest_first(make, tmp_path):
    log = MemoryLog() if make == "memory" else LmdbLog(tmp_path / "l")
    with log:
        assert list(log.read_snapshots()) == []
        for seq in (5, 1, 9):
            log.put_snapshot(seq, f"v{seq}".encode())
        log.put_snapshot(5, b"again")
        assert list(log.read_snapshots()) == [(9, b"v9"), (5, b"again"), (1, b"v1")]
        assert list(log.read_snapshots(9)) == [(5, b"again"), (1, b"v1")]
        assert list(log.read_snapshots(2, newest_first=False)) == [(1, b"v1")]
        assert list(log.read_snapshots(newest_first=False)) == [(1, b"v1"), (5, b"again"), (9, b"v9")]
    if make == "lmdb":  # a reader of a log written before snapshots sees none; read-only refuses to write
        with LmdbLog(tmp_path / "l", readonly=True) as reader:
            assert [s for s, _ in reader.read_snapshots()] == [9, 5, 1]
            with pytest.raises(Exception, match="read-only"):
                reader.put_snapshot(3, b"x")


@pytest.mark.parametrize("every", [1, 4, 11, 1000])
def test_the_writers_fold_snapshots_only_clean_points_each_equal_to_a_fold_from_zero(every):
    events = _events()
    log = MemoryLog()
    folder = SnapshotFolder(every=every)
    made = []
    for event in events:  # a commit after every event: the folder sees each prefix
        log.append(event)
        log.flush()
        if folder.due(log.durable_seq):
            snap = folder.advance(log.read_chunks(folder.next_seq, log.durable_seq))
            if snap is not None:
                made.append(snap)
    assert all(type(events[s.seq]) is LastCommitted for s in made)  # clean: right after a LAST
    gaps = [b.seq - a.seq for a, b in zip(made, made[1:])]
    assert all(g >= every for g in gaps)
    for snap in made:
        assert snap.projections == project(list(enumerate(events[: snap.seq + 1])))
        # resumed from the snapshot, the fold of the rest equals the fold of everything
        projector = Projector(snap.projections, snap.in_group)
        projector.feed_pairs(list(enumerate(events))[snap.seq + 1:])
        assert projector.finish() == project(list(enumerate(events)))
    if every == 1000:
        assert made == []


def test_the_writers_fold_refuses_events_out_of_turn_and_a_bad_cadence():
    with pytest.raises(ValueError, match="every=0"):
        SnapshotFolder(every=0)
    folder = SnapshotFolder(every=1)
    with pytest.raises(ValueError, match="expected seq 0 next"):
        folder.advance(iter([(3, [b""])]))
