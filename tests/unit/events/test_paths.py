"""events.paths: what lies under a run is opened without following a link, regular files only, bounded."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from events.errors import NnxError, UnsafePathError
from events.paths import check_entry, open_dir, read_file


@pytest.fixture
def alarm():
    """Fail (not hang) a test whose read would block: SIGALRM after 10 s."""

    def expired(*_: object) -> None:
        raise TimeoutError("a read under a run blocked")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_a_link_is_refused_naming_it_and_its_target(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "views").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePathError, match=r"views is a symbolic link \(to '.*elsewhere'\)") as info:
        check_entry(tmp_path / "views", "dir")
    assert isinstance(info.value, NnxError) and isinstance(info.value, PermissionError)
    assert check_entry(tmp_path / "missing", "dir") is None
    assert check_entry(tmp_path / "elsewhere", "dir") is not None


def test_an_entry_of_the_wrong_kind_is_refused_unless_any_kind_but_a_link_is_asked(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "data.mdb")
    with pytest.raises(UnsafePathError, match=r"data.mdb is a FIFO, not a regular file"):
        check_entry(tmp_path / "data.mdb", "file")
    assert check_entry(tmp_path / "data.mdb", None) is not None
    (tmp_path / "link").symlink_to(tmp_path / "data.mdb")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        check_entry(tmp_path / "link", None)


def test_a_walk_refuses_a_linked_directory_below_the_anchor_and_creates_nothing_through_it(tmp_path: Path) -> None:
    run, target = tmp_path / "run", tmp_path / "target"
    run.mkdir()
    target.mkdir()
    (run / "blobs").symlink_to(target, target_is_directory=True)
    with pytest.raises(UnsafePathError, match=r"run/blobs is a symbolic link"):
        open_dir(run, ("blobs", "sha256"), create=True)
    assert list(target.iterdir()) == []


def test_a_walk_creates_missing_directories_and_reports_them(tmp_path: Path) -> None:
    made: list[Path] = []
    fd = open_dir(tmp_path, ("blobs", "sha256"), create=True, created=made)
    os.close(fd)
    assert made == [tmp_path / "blobs", tmp_path / "blobs" / "sha256"]
    with pytest.raises(FileNotFoundError):
        open_dir(tmp_path, ("views",))


def test_a_fifo_is_refused_at_once_not_read(tmp_path: Path, alarm) -> None:
    os.mkfifo(tmp_path / "blob")
    with pytest.raises(UnsafePathError, match="is a FIFO, not a regular file"):
        read_file(tmp_path, ("blob",), limit=10)


def test_a_link_to_dev_zero_is_refused_not_read(tmp_path: Path, alarm) -> None:
    (tmp_path / "blob").symlink_to("/dev/zero")
    with pytest.raises(UnsafePathError, match=r"blob is a symbolic link \(to '/dev/zero'\)"):
        read_file(tmp_path, ("blob",), limit=10)


def test_a_file_longer_than_the_limit_is_read_to_one_byte_past_it_only(tmp_path: Path) -> None:
    sparse = tmp_path / "blob"
    with open(sparse, "wb") as f:
        f.truncate(1 << 36)  # 64 GiB of holes: reading it whole would not fit in memory
    assert read_file(tmp_path, ("blob",), limit=100) == bytes(101)
    (tmp_path / "small").write_bytes(b"abc")
    assert read_file(tmp_path, ("small",), limit=100) == b"abc"
    assert read_file(tmp_path, ("absent",), limit=100) is None
    assert read_file(tmp_path, ("nodir", "absent"), limit=100) is None
