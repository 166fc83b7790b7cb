"""Opening a run's LMDB environment for :class:`events.log.LmdbLog`: the checks before LMDB sees the
files, the sync flags, quiet readers, and what an open that fails is said as.

Before LMDB opens anything, :func:`check_files` refuses a link or a non-regular file where the log's
directory, ``data.mdb`` or ``lock.mdb`` should be (:mod:`events.paths`), a missing log (read-only),
and an empty ``data.mdb`` (a writer would take it for a new log). :func:`open_environment` then
opens the environment and its named databases (``events``, ``sums``, ``blobs``, ``snapshots``) and
refuses a data file shorter than the pages it says are in use (:func:`check_size`: LMDB reads through
a memory map, so a page past the end would kill the process with SIGBUS instead of raising).

Sync flags (:data:`DURABILITY`, docs/INVARIANTS.md "Power loss"): each write transaction syncs its
data pages before its meta page points at them. With ``MDB_NOSYNC`` (``sync=False``, what the log
used before 2026-12-03) a power cut could keep a meta page whose pages never reached the disk, or the
synced snapshot's pages reused by later unsynced transactions: committed events lost. The meta page
itself is written unsynced (``MDB_NOMETASYNC``: a cut may undo the newest transaction, never corrupt
the file); ``LmdbLog.flush(sync=True)`` syncs it. Benchmarks and the power-loss tests swap in the old
flags (``DURABILITY.update(...)``) to measure and to plant the bug.

Quiet readers: inside :func:`quiet_readers` (a server that must leave what it reads untouched:
``nnx-es serve``), a read-only environment no other process has open (:func:`events.lmdbfile.env_in_use`)
is opened without LMDB's lock file (``MDB_NOLOCK``): no ``lock.mdb`` is created or written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import NamedTuple

import lmdb

from events.errors import DamagedLogError, EventLogError, NewLogError, TruncatedLogError
from events.lmdbfile import env_in_use, meta_damage, reader_map_size
from events.paths import check_entry
from events.sums import SUMS_DB

__all__ = ["BLOBS_DB", "DURABILITY", "EVENTS_DB", "SNAPSHOTS_DB", "Environment", "check_files", "check_size",
           "open_environment", "quiet_readers"]

EVENTS_DB = b"events"
SNAPSHOTS_DB = b"snapshots"
BLOBS_DB = b"blobs"
DEFAULT_MAP_SIZE = 32 << 20  # bytes; a writer doubles it on demand
#: LMDB's sync flags for every handle (see the module docstring)
DURABILITY: dict[str, bool] = {"sync": True, "metasync": False}
_QUIET: ContextVar[bool] = ContextVar("events_quiet_readers", default=False)


@contextmanager
def quiet_readers() -> Iterator[None]:
    """Within it (in this thread or task), a read-only :class:`~events.log.LmdbLog` of a log no other
    process has open is opened without LMDB's lock file: nothing under the log is created or written
    (LMDB's ``MDB_NOLOCK``). A log another process has open (a live writer) is read with LMDB's lock as
    always. Such a quiet handle checks, as each of its reads ends, that no process opened the log
    meanwhile, and raises :class:`~events.errors.WriterAppearedError` when one did (its pages may
    have been reused under the read); a handle opened beside a writer never does.
    """
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


class Environment(NamedTuple):
    """An open LMDB environment and its databases (None: a read-only log written before it existed)."""

    env: lmdb.Environment
    events: lmdb._Database
    sums: lmdb._Database | None
    blobs: lmdb._Database | None
    snapshots: lmdb._Database | None
    quiet: bool  # opened without LMDB's lock file (quiet_readers)


def check_files(path: Path, *, readonly: bool) -> None:
    """Refuse what LMDB must not open (see the module docstring); nothing is opened or created.

    Raises:
        UnsafePathError: the directory, ``data.mdb`` or ``lock.mdb`` is a link or not of its kind.
        EventLogError: (read-only) there is no ``data.mdb``.
        TruncatedLogError: ``data.mdb`` exists and is empty.
    """
    for entry, kind in ((path, None), (path / "data.mdb", "file"), (path / "lock.mdb", "file")):
        check_entry(entry, kind)  # LMDB opens them itself: a link (or a FIFO) is refused first
    data = path / "data.mdb"
    if readonly and not data.exists():
        raise EventLogError(f"no event log at {path}: expected {data}")
    if data.is_file() and data.stat().st_size == 0:
        raise TruncatedLogError(f"event log at {path} is truncated: {data} is empty (0 bytes; a truncated "
                                "write or copy?): not opened, nothing was written")


def open_environment(path: Path, *, readonly: bool, map_size: int | None) -> Environment:
    """Open the log's environment at ``path`` (created when not ``readonly``) and its databases.

    A read-only open creates nothing: a database an older log lacks is None (``events`` must exist).
    ``map_size`` defaults to 32 MiB for a writer and, for a reader, the file and room to grow
    (:func:`events.lmdbfile.reader_map_size`: a reader runs under a ``ulimit -v``).

    Raises:
        NewLogError: (read-only) no events database yet: its writer is creating it.
        DamagedLogError: LMDB refused the file and a meta page is damaged (:func:`events.lmdbfile.meta_damage`).
        TruncatedLogError: the data file is shorter than its pages need (:func:`check_size`).
        EventLogError: any other refusal, LMDB's words included.
    """
    data = path / "data.mdb"
    env = None
    try:
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
        quiet = readonly and _QUIET.get() and not env_in_use(path)
        env = lmdb.open(
            str(path),
            map_size=map_size or (reader_map_size(data) if readonly else DEFAULT_MAP_SIZE),
            subdir=True,
            readonly=readonly,
            max_dbs=8,
            **DURABILITY,
            lock=not quiet,
            readahead=False,
        )
        check_size(env, path)
        if readonly:  # creates nothing: an older log has no sums (or blobs, or snapshots) database
            events = env.open_db(EVENTS_DB, create=False)
            sums = blobs = snapshots = None
        else:
            events, snapshots = env.open_db(EVENTS_DB), env.open_db(SNAPSHOTS_DB)
            sums, blobs = env.open_db(SUMS_DB), env.open_db(BLOBS_DB)
        return Environment(env, events, sums, blobs, snapshots, quiet)
    except (lmdb.Error, OSError) as exc:
        if env is not None:
            env.close()
        if isinstance(exc, EventLogError):
            raise
        if isinstance(exc, lmdb.NotFoundError):  # only a read-only open looks its databases up
            raise NewLogError(f"event log at {path} has no events database yet: its writer is creating it "
                              "(a run starting now: try again), or it is another LMDB environment") from None
        if isinstance(exc, lmdb.Error) and (why := meta_damage(data)):  # bit rot reads as a data format
            raise DamagedLogError(f"event log at {path} is damaged: {why}: not opened; restore the run "
                                  "directory from a copy") from None
        raise EventLogError(f"cannot open event log at {path}: {exc}") from None


def check_size(env: lmdb.Environment, path: Path | os.PathLike[str]) -> None:
    """Refuse a data file shorter than the pages its environment says are in use.

    Raises:
        TruncatedLogError: the file is truncated (sizes named).
    """
    used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = (Path(path) / "data.mdb").stat().st_size
    if size < used:
        raise TruncatedLogError(f"event log at {path} is truncated: data.mdb has {size} bytes, its pages need {used}")
