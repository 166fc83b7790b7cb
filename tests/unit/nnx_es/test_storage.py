"""Files outside LMDB: run ids, atomic writes, the blob store, leases, stale temporaries."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from nnx_es.errors import (
    CheckpointWriteError,
    CorruptCheckpointError,
    InvalidRunIdError,
    LeaseHeldError,
    NnxError,
)
from nnx_es.storage import BlobStore, Lease, atomic_write, clean_stale_temporaries, validate_run_id


def _temporaries(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


# --- run ids ---------------------------------------------------------------------------


@pytest.mark.parametrize("good", ["run-1", "a", "digits_mlp.2024-06-01", "A.b_C-9", ".hidden", "x" * 128, "..."])
def test_validate_run_id_accepts_safe_names(good: str) -> None:
    assert validate_run_id(good) == good


@pytest.mark.parametrize(
    "bad", ["", ".", "..", ".leases", "a/b", "../etc", "a\\b", "x" * 129, "a b", "run\n", "ünïcode",
            "a\x00b", "a:b"]
)
def test_validate_run_id_refuses_unsafe_names(bad: str) -> None:
    with pytest.raises(InvalidRunIdError) as info:
        validate_run_id(bad)
    assert isinstance(info.value, ValueError) and isinstance(info.value, NnxError)
    assert repr(bad) in str(info.value)


def test_validate_run_id_refuses_non_strings() -> None:
    with pytest.raises(InvalidRunIdError):
        validate_run_id(7)  # type: ignore[arg-type]


# --- atomic writes ---------------------------------------------------------------------


def test_atomic_write_creates_and_replaces_without_temporaries(tmp_path: Path) -> None:
    dest = tmp_path / "views" / "history.csv"
    atomic_write(dest, b"epoch,loss\n0,1.0\n")
    assert dest.read_bytes() == b"epoch,loss\n0,1.0\n"
    atomic_write(dest, b"epoch,loss\n0,1.0\n1,0.5\n")
    assert dest.read_bytes() == b"epoch,loss\n0,1.0\n1,0.5\n"
    atomic_write(dest, b"")
    assert dest.read_bytes() == b""
    assert _temporaries(tmp_path) == []
    assert sorted(p.name for p in dest.parent.iterdir()) == ["history.csv"]


def test_atomic_write_of_a_large_payload(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    atomic_write(tmp_path / "big", data)
    assert (tmp_path / "big").read_bytes() == data


def test_failed_fsync_keeps_previous_bytes_and_removes_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "summary.json"
    atomic_write(dest, b"previous")

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(CheckpointWriteError) as info:
        atomic_write(dest, b"new bytes that never land")
    monkeypatch.undo()
    err = info.value
    assert isinstance(err, OSError) and isinstance(err, NnxError)
    assert str(dest) in str(err)
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC
    assert dest.read_bytes() == b"previous"
    assert _temporaries(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_failed_first_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def eio(fd: int, data: object) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "write", eio)
    with pytest.raises(CheckpointWriteError):
        atomic_write(tmp_path / "new", b"data")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


# --- blob store ------------------------------------------------------------------------


def test_blob_round_trip_and_content_addressing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = b"model state bytes"
    digest = store.put(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.get(digest) == data
    assert store.exists(digest)
    assert store.path(digest) == tmp_path / "blobs" / "sha256" / digest
    other = store.put(b"optimizer state bytes")
    assert other != digest and store.get(other) == b"optimizer state bytes"


@pytest.mark.parametrize("damage", ["truncated to nothing", "one bit flipped"])
def test_a_damaged_blob_is_refused_saying_where_and_how(tmp_path: Path, damage: str) -> None:
    store = BlobStore(tmp_path / "blobs")
    digest = store.put(b"model state bytes")
    path = store.path(digest)
    data = b"" if damage == "truncated to nothing" else bytes([path.read_bytes()[0] ^ 1]) + path.read_bytes()[1:]
    path.write_bytes(data)
    words = ["empty (a truncated write?)"] if not data else ["corrupt: its 17 bytes hash to",
                                                             hashlib.sha256(data).hexdigest()]
    with pytest.raises(CorruptCheckpointError) as info:
        store.get(digest)
    assert all(w in str(info.value) for w in [digest, str(path), *words]), str(info.value)


def test_a_blob_of_the_earlier_sharded_layout_is_still_read(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = b"written by an earlier version"
    digest = hashlib.sha256(data).hexdigest()
    old = tmp_path / "blobs" / "sha256" / digest[:2] / digest
    old.parent.mkdir(parents=True)
    old.write_bytes(data)
    assert store.exists(digest) and store.get(digest) == data
    assert store.put(data) == digest and not store.path(digest).exists()  # present: not written again


def test_a_batch_is_written_with_one_directory_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nnx_es.storage as storage

    store = BlobStore(tmp_path / "blobs")
    store.put(b"first")  # the directories exist
    synced: list[str] = []
    real = storage.fsync_dir
    monkeypatch.setattr(storage, "fsync_dir", lambda d: (synced.append(str(d)), real(d))[1])
    datas = [b"model", b"optimizer", b"manifest", b"model"]
    digests = store.put_all(datas)
    assert digests == [hashlib.sha256(d).hexdigest() for d in datas]
    assert synced == [str(tmp_path / "blobs" / "sha256")]
    assert all(store.get(d) == data for d, data in zip(digests, datas))
    assert sorted(p.name for p in (tmp_path / "blobs" / "sha256").iterdir()) == sorted(set(digests) | {
        hashlib.sha256(b"first").hexdigest()})


def test_a_failed_batch_leaves_no_temporary_and_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nnx_es.storage as storage

    calls = [0]
    real = os.fsync

    def second_fails(fd: int) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(storage.os, "fsync", second_fails)
    with pytest.raises(CheckpointWriteError, match="b.bin"):
        storage.atomic_write_all([(tmp_path / "a.bin", b"a"), (tmp_path / "b.bin", b"b")])
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []  # nothing renamed: neither file is visible


def test_identical_bytes_are_stored_once(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    first = store.put(b"same")
    mtime = store.path(first).stat().st_mtime_ns
    second = store.put(b"same")
    assert first == second
    files = [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    assert files == [store.path(first)]
    assert store.path(first).stat().st_mtime_ns == mtime, "an existing blob is not rewritten"


def test_flipped_byte_in_a_stored_blob_is_detected(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    digest = store.put(b"\x00\x01\x02\x03" * 100)
    p = store.path(digest)
    raw = bytearray(p.read_bytes())
    raw[17] ^= 0x01
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError) as info:
        store.get(digest)
    assert digest in str(info.value)
    assert hashlib.sha256(bytes(raw)).hexdigest() in str(info.value)


def test_missing_blob_is_corrupt_checkpoint(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    digest = hashlib.sha256(b"never stored").hexdigest()
    assert not store.exists(digest)
    with pytest.raises(CorruptCheckpointError) as info:
        store.get(digest)
    assert digest in str(info.value) and "missing" in str(info.value)


def test_a_staged_blob_goes_to_the_log_with_its_next_sync_and_never_to_a_file(tmp_path: Path) -> None:
    from events.log import LmdbLog
    from events.schema import EpochBegan

    with LmdbLog(tmp_path / "events.lmdb") as log:
        store = BlobStore(tmp_path / "blobs", log=log)
        digest = store.stage(b"a manifest")
        assert digest == hashlib.sha256(b"a manifest").hexdigest()
        assert not store.exists(digest)  # not stored before the log's next write
        log.commit(EpochBegan(epoch=0))
        assert store.exists(digest) and store.get(digest) == b"a manifest" and log.syncs == 1
        assert not (tmp_path / "blobs").exists()  # no file, no directory
        file_digest = store.put(b"a large component")  # put_all still writes files
        assert store.path(file_digest).read_bytes() == b"a large component"
        assert store.stage(b"a large component") == file_digest  # present as a file: not staged again
        log.flush()
        assert log.get_blob(file_digest.encode()) is None
    # a reader without the log opens it read-only for each blob that is not a file
    reader = BlobStore(tmp_path / "blobs")
    assert reader.get(digest) == b"a manifest" and reader.get(file_digest) == b"a large component"


def test_put_all_looks_only_at_files_never_at_the_log(tmp_path: Path) -> None:
    """put_all runs on a commit's background thread: it must not read the log the training thread writes."""

    class Untouchable:
        readonly = False

        def get_blob(self, key: bytes) -> bytes | None:
            raise AssertionError("put_all read the log")

    store = BlobStore(tmp_path / "blobs", log=Untouchable())  # type: ignore[arg-type]
    digests = store.put_all([b"large one", b"large two", b"large one"])
    assert [store.path(d).read_bytes() for d in digests] == [b"large one", b"large two", b"large one"]
    assert store.put_all([b"large one"]) == digests[:1]  # present as a file: not written again


def test_a_store_without_a_writable_log_stages_as_a_durable_file(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    digest = store.stage(b"state")
    assert store.path(digest).read_bytes() == b"state"


def test_a_damaged_blob_in_the_log_is_refused_naming_where_it_is(tmp_path: Path) -> None:
    from events.log import LmdbLog
    from events.schema import EpochBegan

    with LmdbLog(tmp_path / "events.lmdb") as log:
        digest = BlobStore(tmp_path / "blobs", log=log).stage(b"\x00" * 64)
        log.commit(EpochBegan(epoch=0))
        log.put_blob_raw(digest.encode(), b"\x00" * 63)
    with pytest.raises(CorruptCheckpointError, match=rf"blob {digest} in the event log at .*events.lmdb is corrupt"):
        BlobStore(tmp_path / "blobs").get(digest)
    with LmdbLog(tmp_path / "events.lmdb") as log:
        log.put_blob_raw(digest.encode(), None)
    with pytest.raises(CorruptCheckpointError, match=rf"blob {digest} is missing .*or in the event log"):
        BlobStore(tmp_path / "blobs").get(digest)


@pytest.mark.parametrize("name", ["", "ABCD" * 16, "../" + "a" * 61, "a" * 63, "g" * 64])
def test_malformed_blob_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(CorruptCheckpointError):
        BlobStore(tmp_path).path(name)


# --- leases ----------------------------------------------------------------------------


def test_second_acquire_is_refused_until_release(tmp_path: Path) -> None:
    first = Lease(tmp_path, "run-1").acquire()
    assert first.held
    with pytest.raises(LeaseHeldError) as info:
        Lease(tmp_path, "run-1").acquire()
    assert "run-1" in str(info.value)
    assert isinstance(info.value, BlockingIOError) and isinstance(info.value, NnxError)
    # another run's lease is independent
    with Lease(tmp_path, "run-2") as other:
        assert other.held
    first.release()
    assert not first.held
    with Lease(tmp_path, "run-1") as again:
        assert again.held
        assert again.path.read_text().strip() == str(os.getpid())


def test_lease_refuses_an_invalid_run_id(tmp_path: Path) -> None:
    with pytest.raises(InvalidRunIdError):
        Lease(tmp_path, "../escape")


def _hold_lease(root: Path, ready: Connection) -> None:
    Lease(root, "run-1").acquire()
    ready.send("held")
    time.sleep(60)


def test_lease_of_a_sigkilled_holder_is_free(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")  # the child inherits imports: fast
    parent_end, child_end = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_hold_lease, args=(tmp_path, child_end), daemon=True)
    child.start()
    try:
        assert parent_end.poll(30), "the child never took the lease"
        assert parent_end.recv() == "held"
        with pytest.raises(LeaseHeldError):
            Lease(tmp_path, "run-1").acquire()
    finally:
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
    assert child.exitcode == -signal.SIGKILL
    with Lease(tmp_path, "run-1") as lease:
        assert lease.held


# --- stale temporaries -----------------------------------------------------------------


def test_clean_stale_temporaries_removes_only_owned_temporaries(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs" / "sha256" / "ab"
    blobs.mkdir(parents=True)
    stale = [tmp_path / ".x.tmp", blobs / ".abcd.1234.beef.tmp"]
    keep = [tmp_path / "history.csv", tmp_path / "notes.tmp", blobs / "abcd"]
    for p in stale + keep:
        p.write_bytes(b"x")
    removed = clean_stale_temporaries(tmp_path)
    assert sorted(removed) == sorted(stale)
    assert all(not p.exists() for p in stale)
    assert all(p.exists() for p in keep)
    assert clean_stale_temporaries(tmp_path) == []
    assert clean_stale_temporaries(tmp_path / "missing") == []
