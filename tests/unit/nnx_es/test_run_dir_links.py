"""Nothing under a run directory is followed, and a blob is read only as a regular file of its recorded size.

Each place a run keeps something -- its log, blob directory, a blob, its views, its lease file, the
run directory in its runs root -- with a symbolic link (or a FIFO, a hard link) planted there: the
reader or writer refuses it naming the path (:class:`UnsafePathError`), and the link's target is
left byte for byte as it was. The lease also meets a second writer that reaches the same run
directory by another path (DESIGN.md "Trust boundaries").
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from events.log import LmdbLog
from nnx_es.errors import CorruptCheckpointError, LeaseHeldError, NnxError, UnsafePathError
from nnx_es.storage import UNSIZED_MAX, BlobStore, Lease, check_run_dir
from nnx_es.views import read_views, write_views
from projections import project


@pytest.fixture
def alarm():
    """Fail (not hang) a test whose open or read would block: SIGALRM after 10 s."""

    def expired(*_: object) -> None:
        raise TimeoutError("an open or read under a run blocked")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: a file's bytes, a link's target, a directory as ``"dir"``."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


def _victim(tmp_path: Path) -> Path:
    """A directory outside the run, holding a file, where a planted link points."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_bytes(b"the user's own file\n")
    return victim


def _stored(tmp_path: Path, data: bytes = b"model state" * 100) -> tuple[BlobStore, str, Path]:
    store = BlobStore(tmp_path / "run" / "blobs")
    digest = store.put(data)
    return store, digest, store.path(digest)


# --- blobs -------------------------------------------------------------------------------


def test_a_blob_that_is_a_link_is_refused_naming_it_and_its_target_is_untouched(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    store, digest, path = _stored(tmp_path)
    shutil.copy(path, victim / "copy")
    path.unlink()
    path.symlink_to(victim / "copy")
    before = _tree(victim)
    with pytest.raises(UnsafePathError, match=rf"{digest} is a symbolic link") as info:
        store.get(digest)
    assert isinstance(info.value, NnxError) and isinstance(info.value, PermissionError)
    with pytest.raises(UnsafePathError, match=rf"{digest} is a symbolic link"):
        store.put(b"model state" * 100)  # never taken for the blob, never written through
    assert _tree(victim) == before


def test_a_blob_directory_that_is_a_link_is_refused_on_write_and_read(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "blobs").symlink_to(victim, target_is_directory=True)
    before = _tree(victim)
    store = BlobStore(run / "blobs")
    with pytest.raises(UnsafePathError, match=r"run/blobs is a symbolic link"):
        store.put(b"x" * 10)
    with pytest.raises(UnsafePathError, match=r"run/blobs is a symbolic link"):
        store.get("a" * 64)
    with pytest.raises(UnsafePathError, match=r"run/blobs is a symbolic link"):
        check_run_dir(run)
    assert _tree(victim) == before


def test_a_sha256_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    (tmp_path / "run" / "blobs").mkdir(parents=True)
    (tmp_path / "run" / "blobs" / "sha256").symlink_to(victim, target_is_directory=True)
    before = _tree(victim)
    with pytest.raises(UnsafePathError, match=r"blobs/sha256 is a symbolic link"):
        BlobStore(tmp_path / "run" / "blobs").put(b"x" * 10)
    assert _tree(victim) == before


def test_a_fifo_in_place_of_a_blob_is_refused_at_once(tmp_path: Path, alarm) -> None:
    store, digest, path = _stored(tmp_path)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(UnsafePathError, match=rf"{digest} is a FIFO, not a regular file"):
        store.get(digest, size=1100)
    with pytest.raises(UnsafePathError, match="is a FIFO"):
        store.put(b"model state" * 100)


def test_a_blob_linked_to_dev_zero_is_refused_not_read_without_bound(tmp_path: Path, alarm) -> None:
    store, digest, path = _stored(tmp_path)
    path.unlink()
    path.symlink_to("/dev/zero")
    with pytest.raises(UnsafePathError, match=r"is a symbolic link \(to '/dev/zero'\)"):
        store.get(digest, size=1100)


def test_a_blob_longer_than_its_manifest_records_is_damage_read_no_further(tmp_path: Path) -> None:
    data = b"model state" * 100
    store, digest, path = _stored(tmp_path, data)
    assert store.get(digest, size=len(data)) == data
    with open(path, "r+b") as f:
        f.truncate(1 << 36)  # 64 GiB, sparse: reading it whole would not fit in memory
    with pytest.raises(CorruptCheckpointError, match=rf"blob {digest} at .* is damaged: it holds more than the "
                                                      rf"{len(data)} bytes its manifest records"):
        store.get(digest, size=len(data))
    with pytest.raises(CorruptCheckpointError, match=rf"more than {UNSIZED_MAX} bytes, the most a blob of no "
                                                      "recorded size may hold"):
        store.get(digest)


# --- views ---------------------------------------------------------------------------------


def test_a_views_directory_that_is_a_link_is_refused_and_nothing_lands_in_its_target(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "views").symlink_to(victim, target_is_directory=True)
    before = _tree(victim)
    with pytest.raises(UnsafePathError, match=r"run/views is a symbolic link"):
        write_views(run, project([]))
    with pytest.raises(UnsafePathError, match=r"run/views is a symbolic link"):
        read_views(run)
    assert _tree(victim) == before


def test_a_view_file_that_is_a_fifo_or_a_link_is_refused_when_read(tmp_path: Path, alarm) -> None:
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    (run / "views").mkdir(parents=True)
    os.mkfifo(run / "views" / "history.csv")
    with pytest.raises(UnsafePathError, match=r"history.csv is a FIFO"):
        read_views(run)
    (run / "views" / "history.csv").unlink()
    (run / "views" / "history.csv").symlink_to(victim / "notes.txt")
    with pytest.raises(UnsafePathError, match=r"history.csv is a symbolic link"):
        read_views(run)
    write_views(run, project([]))  # a writer replaces the link itself: never writes through it
    assert not (run / "views" / "history.csv").is_symlink()
    assert (victim / "notes.txt").read_bytes() == b"the user's own file\n"


# --- the log --------------------------------------------------------------------------------


def test_an_event_log_that_is_a_link_is_refused_by_readers_and_writers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    real = tmp_path / "victim.lmdb"
    with LmdbLog(real):
        pass
    (run / "events.lmdb").symlink_to(real, target_is_directory=True)
    before = _tree(real)
    for readonly in (True, False):
        with pytest.raises(UnsafePathError, match=r"run/events.lmdb is a symbolic link"):
            LmdbLog(run / "events.lmdb", readonly=readonly)
    assert _tree(real) == before


@pytest.mark.parametrize("name", ["data.mdb", "lock.mdb"])
def test_a_log_file_that_is_a_link_or_a_fifo_is_refused_before_lmdb_opens_it(tmp_path: Path, name: str,
                                                                           alarm) -> None:
    victim = _victim(tmp_path)
    log_dir = tmp_path / "run" / "events.lmdb"
    with LmdbLog(log_dir):
        pass
    (log_dir / name).unlink()
    (log_dir / name).symlink_to(victim / "notes.txt")
    with pytest.raises(UnsafePathError, match=rf"{name} is a symbolic link"):
        LmdbLog(log_dir)
    assert (victim / "notes.txt").read_bytes() == b"the user's own file\n"
    (log_dir / name).unlink()
    os.mkfifo(log_dir / name)
    with pytest.raises(UnsafePathError, match=rf"{name} is a FIFO"):
        LmdbLog(log_dir, readonly=True)


# --- the lease ------------------------------------------------------------------------------


def test_a_lease_file_that_is_a_link_is_refused_and_its_target_is_not_truncated(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    runs = tmp_path / "runs"
    (runs / ".leases").mkdir(parents=True)
    (runs / ".leases" / "r.lock").symlink_to(victim / "notes.txt")
    with pytest.raises(UnsafePathError, match=r"lease file .*r.lock is a symbolic link"):
        Lease(runs, "r").acquire()
    (runs / ".leases" / "r.lock").unlink()
    (runs / ".leases" / "r.lock").symlink_to(victim / "absent")  # a dangling link: nothing created there
    with pytest.raises(UnsafePathError, match=r"r.lock is a symbolic link"):
        Lease(runs, "r").acquire()
    assert _tree(victim) == {"notes.txt": b"the user's own file\n"}


def test_a_lease_file_hard_linked_to_another_file_is_refused_and_not_truncated(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    runs = tmp_path / "runs"
    (runs / ".leases").mkdir(parents=True)
    os.link(victim / "notes.txt", runs / ".leases" / "r.lock")
    with pytest.raises(UnsafePathError, match=r"r.lock is a file with 2 links"):
        Lease(runs, "r").acquire()
    assert (victim / "notes.txt").read_bytes() == b"the user's own file\n"


def test_a_lease_file_that_is_a_fifo_is_refused_at_once(tmp_path: Path, alarm) -> None:
    runs = tmp_path / "runs"
    (runs / ".leases").mkdir(parents=True)
    os.mkfifo(runs / ".leases" / "r.lock")
    with pytest.raises(UnsafePathError, match=r"r.lock is a FIFO"):
        Lease(runs, "r").acquire()


def test_a_lease_directory_that_is_a_link_is_refused_and_nothing_is_created_in_its_target(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / ".leases").symlink_to(victim, target_is_directory=True)
    with pytest.raises(UnsafePathError, match=r"runs/.leases is a symbolic link"):
        Lease(runs, "r").acquire()
    assert _tree(victim) == {"notes.txt": b"the user's own file\n"}


def test_a_run_directory_that_is_a_link_in_its_runs_root_is_refused_by_the_lease(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "r").symlink_to(victim, target_is_directory=True)
    with pytest.raises(UnsafePathError, match=r"runs/r is a symbolic link"):
        Lease(runs, "r").acquire()
    assert _tree(victim) == {"notes.txt": b"the user's own file\n"}
    with Lease(runs, "other") as lease:  # the lease file of the refused one is free again
        assert lease.held


def test_a_run_directory_moved_to_another_runs_root_meets_the_same_lease(tmp_path: Path) -> None:
    """Two paths to one run directory, without a link: it was moved (the same inode) to another runs
    root, whose ``.leases`` holds no lease of it. The directory's own lock refuses the second writer."""
    first_root, second_root = tmp_path / "a", tmp_path / "b"
    (first_root / "r").mkdir(parents=True)
    second_root.mkdir()
    held = Lease(first_root, "r").acquire()
    try:
        os.rename(first_root / "r", second_root / "r")
        with pytest.raises(LeaseHeldError, match=r"run 'r' at .*b/r is being written by another process that "
                                                  "reached the same directory by another path"):
            Lease(second_root, "r").acquire()
        assert not (second_root / ".leases" / "r.lock").read_bytes()  # its own lease file: never given a pid
    finally:
        held.release()
    with Lease(second_root, "r") as again:
        assert again.held


def test_a_lease_through_a_linked_runs_root_is_the_same_lease(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    (runs / "r").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(runs, target_is_directory=True)
    with Lease(runs, "r"):
        with pytest.raises(LeaseHeldError, match=r"run 'r' is being written by another process"):
            Lease(tmp_path / "alias", "r").acquire()


def test_a_process_forked_by_the_writer_does_not_hold_the_run_directory_lock(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    lease = Lease(tmp_path, "r").acquire()
    pid = os.fork()
    if pid == 0:  # the child closed its copies of both descriptors at fork
        os._exit(0 if not any(os.path.exists(f"/proc/self/fd/{fd}") for fd in (lease._fd, lease._dir_fd)) else 1)
    _, status = os.waitpid(pid, 0)
    lease.release()
    assert os.WEXITSTATUS(status) == 0


@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("mount") is None, reason="needs unshare(1)")
def test_a_bind_mount_of_a_live_run_meets_its_lease(tmp_path: Path) -> None:
    """A bind mount (in a user and mount namespace of its own: no root needed) names the live run's
    directory under another runs root; a writer there is refused by the directory's own lock."""
    runs, other = tmp_path / "runs", tmp_path / "other"
    (runs / "r").mkdir(parents=True)
    (other / "r").mkdir(parents=True)
    repo = Path(__file__).resolve().parents[3]
    script = ("import sys; from nnx_es.storage import Lease\n"
              "try:\n    Lease(sys.argv[1], 'r').acquire()\nexcept Exception as e:\n"
              "    print(type(e).__name__, e); sys.exit(3)\nprint('acquired')\n")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"user namespaces are not available here: {probe.stderr.decode().strip()}")
    with Lease(runs, "r"):
        out = subprocess.run(
            ["unshare", "-rm", "sh", "-c", 'mount --bind "$1" "$2" && exec "$3" -c "$4" "$5"', "sh",
             str(runs / "r"), str(other / "r"), sys.executable, script, str(other)],
            capture_output=True, text=True, timeout=120, cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert out.returncode == 3, out.stdout + out.stderr
    assert "LeaseHeldError" in out.stdout and "reached the same directory by another path" in out.stdout


# --- live sinks writing under the run -------------------------------------------------------


def _history_event():
    from events.schema import Counters, HistoryAppended, HistoryRecord

    return HistoryAppended(record=HistoryRecord(epoch=0, train={"loss": 1.0}, val={}, monitor_value=None,
                                                improved=None, lrs={}, counters=Counters(), wall_time_s=0.0))


def test_a_csv_sink_refuses_a_linked_or_hard_linked_file_in_views_and_never_truncates_its_target(
        tmp_path: Path) -> None:
    from nnx_es.sinks import CsvSink

    victim = _victim(tmp_path)
    run = tmp_path / "run"
    (run / "views").mkdir(parents=True)
    (run / "views" / "epochs.csv").symlink_to(victim / "notes.txt")
    sink = CsvSink()
    sink.open(run)
    with pytest.raises(UnsafePathError, match=r"views/epochs.csv is a symbolic link"):
        sink.write(0, _history_event())
    (run / "views" / "epochs.csv").unlink()
    os.link(victim / "notes.txt", run / "views" / "epochs.csv")
    with pytest.raises(UnsafePathError, match=r"views/epochs.csv is a file with 2 links"):
        sink.write(0, _history_event())
    sink.close()
    assert (victim / "notes.txt").read_bytes() == b"the user's own file\n"
    (run / "views" / "epochs.csv").unlink()
    sink = CsvSink()
    sink.open(run)
    sink.write(0, _history_event())
    sink.close()
    assert (run / "views" / "epochs.csv").read_text().splitlines()[0] == "epoch,loss"


def test_a_csv_sink_refuses_a_linked_views_directory(tmp_path: Path) -> None:
    from nnx_es.sinks import CsvSink

    victim = _victim(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "views").symlink_to(victim, target_is_directory=True)
    with pytest.raises(UnsafePathError, match=r"run/views is a symbolic link"):
        CsvSink().open(tmp_path / "run")
    assert _tree(victim) == {"notes.txt": b"the user's own file\n"}


def test_a_runs_root_lists_a_linked_run_as_unreadable_without_following_it(tmp_path: Path) -> None:
    from nnx_es.cli.many import list_runs

    victim = tmp_path / "victim"
    (victim / "events.lmdb").mkdir(parents=True)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r").symlink_to(victim, target_is_directory=True)
    [row] = list_runs(tmp_path / "runs")
    assert row.run_id == "r" and row.status == "unreadable" and row.bytes == 0
    assert "runs/r is a symbolic link" in row.error


def test_a_run_directory_swapped_for_a_link_under_a_writer_takes_no_blob_or_view(tmp_path: Path) -> None:
    """A writer names its run by runs root and id: when ``runs/r`` becomes a link (someone sharing the
    runs root moved the run and left a link), its next blob or view write is refused; a reader that
    names the link itself still reads the run (the user's own naming)."""
    victim = _victim(tmp_path)
    store, digest, _ = _stored(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r").symlink_to(tmp_path / "run", target_is_directory=True)
    shutil.move(tmp_path / "run", victim / "run")
    (tmp_path / "run").symlink_to(victim / "run", target_is_directory=True)
    before = _tree(victim)
    with pytest.raises(UnsafePathError, match=r"/run is a symbolic link"):
        store.put(b"new state")
    with pytest.raises(UnsafePathError, match=r"/run is a symbolic link"):
        write_views(tmp_path / "run", project([]))
    assert _tree(victim) == before
    assert BlobStore(tmp_path / "runs" / "r" / "blobs").get(digest) == b"model state" * 100
