"""Quiet readers (events.log.quiet_readers): a read-only log no other process has open is read without
LMDB's lock file -- none created, none written -- and a log a writer holds is read with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from events.errors import WriterAppearedError
from events.lmdbfile import env_in_use
from events.log import LmdbLog, quiet_readers
from events.schema import EpochBegan

ROOT = str(Path(__file__).resolve().parents[3])


def _log(path: Path, n: int = 5000) -> Path:
    with LmdbLog(path) as log:
        for i in range(n):
            log.append(EpochBegan(epoch=i))
        log.flush(sync=True)
    return path


def _state(path: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(path.iterdir())}


def test_a_plain_reader_writes_the_lock_file_and_a_quiet_one_leaves_it_as_it_was(tmp_path):
    path = _log(tmp_path / "events.lmdb")
    before = _state(path)
    with quiet_readers(), LmdbLog(path, readonly=True) as log:
        assert len(list(log.read())) == 5000
    assert _state(path) == before
    with LmdbLog(path, readonly=True) as log:  # why it exists: LMDB's reader takes a slot in lock.mdb
        list(log.read(0, 10))
    assert _state(path)["lock.mdb"] != before["lock.mdb"]


def test_a_quiet_reader_creates_no_lock_file_where_there_is_none(tmp_path):
    path = _log(tmp_path / "events.lmdb")
    os.remove(path / "lock.mdb")
    with quiet_readers(), LmdbLog(path, readonly=True) as log:
        assert log.next_seq == 5000 and len(list(log.read(10, 20))) == 10
    assert sorted(p.name for p in path.iterdir()) == ["data.mdb"]
    with LmdbLog(path, readonly=True):  # outside quiet_readers: as before
        pass
    assert (path / "lock.mdb").exists()


_HOLD = """
import sys
sys.path.insert(0, {root!r})
from events.log import LmdbLog
log = LmdbLog({path!r})
print("open", flush=True)
sys.stdin.readline()
"""


def _writer(path: Path) -> subprocess.Popen[str]:
    """A process holding the log open for writing until its stdin closes."""
    p = subprocess.Popen([sys.executable, "-c", _HOLD.format(root=ROOT, path=str(path))], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "open"
    return p


def test_beside_a_writer_a_quiet_reader_takes_lmdbs_lock_and_a_writer_that_appears_mid_read_is_said(tmp_path):
    path = _log(tmp_path / "events.lmdb")
    assert not env_in_use(path)
    writer = _writer(path)
    try:
        assert env_in_use(path)
        with quiet_readers(), LmdbLog(path, readonly=True) as log:
            assert not log.quiet and len(list(log.read(0, 100))) == 100  # read as any reader beside a writer
    finally:
        writer.communicate("")
    assert not env_in_use(path)
    with quiet_readers(), LmdbLog(path, readonly=True) as log:
        assert log.quiet
        reading = log.read_raw()
        next(reading)  # a read is open ...
        late = _writer(path)  # ... when a writer opens the log: its pages may be reused under the read
        try:
            with pytest.raises(WriterAppearedError, match="read again"):
                list(reading)
        finally:
            late.communicate("")
