"""Files outside LMDB: atomic writes, the content-addressed blob store, run ids and leases.

Every file goes through an owned temporary file (``.<name>.<pid>.<rand>.tmp``
in the destination's directory), ``fsync``, atomic ``os.replace`` and a
directory fsync; a failed write removes its temporary and leaves the
destination's previous bytes (DESIGN.md "Failure semantics"). Files written
together (a checkpoint's large blobs, the two views) share the
directory fsyncs: each temporary is written and synced, all are renamed, then
each directory is synced once -- no file is ever visible with unsynced bytes,
and all are durable before the caller goes on (to LAST, which names them).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

from events.log import EventLog, LmdbLog
from nnx_es.errors import CheckpointWriteError, CorruptCheckpointError, InvalidRunIdError, LeaseHeldError

__all__ = [
    "BlobStore",
    "Lease",
    "atomic_write",
    "atomic_write_all",
    "clean_stale_temporaries",
    "fsync_dir",
    "validate_run_id",
]

_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
TMP_SUFFIX = ".tmp"


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a safe directory name.

    Raises:
        InvalidRunIdError: empty, longer than 128 characters, ``.``, ``..``, ``.leases`` (the
            runs root's lease directory), or a character outside ``[A-Za-z0-9._-]``.
    """
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id) or run_id in (".", "..", ".leases"):
        raise InvalidRunIdError(
            f"run_id must be 1-128 characters of [A-Za-z0-9._-], not '.', '..' or '.leases' (the runs root's "
            f"lease directory), got {run_id!r}"
        )
    return run_id


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Durably replace ``path`` with ``data`` (temporary, fsync, rename, dir fsync).

    Raises:
        CheckpointWriteError: any OS error (ENOSPC, EIO, ...); the temporary is
            removed and ``path`` keeps its previous bytes.
    """
    atomic_write_all([(path, data)])


def atomic_write_all(items: Sequence[tuple[Path, bytes]]) -> None:
    """Durably replace each ``path`` with its ``data``, as one batch.

    Each temporary is written and fsynced, then all are renamed, then each
    directory holding them (and the parent of each directory created) is
    fsynced once. When this returns every file is durable.

    Raises:
        CheckpointWriteError: any OS error (ENOSPC, EIO, ...), naming the file; every
            temporary is removed. Files renamed before the error hold their complete,
            synced bytes; the others keep their previous bytes.
    """
    staged: list[tuple[Path, Path]] = []  # (temporary, destination) written and synced
    created: list[Path] = []
    path = Path()
    try:
        for path, data in items:
            path = Path(path)
            created += _make_dirs(path.parent)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            staged.append((tmp, path))
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
        dirs: dict[Path, None] = {}
        while staged:
            tmp, path = staged[0]
            os.replace(tmp, path)
            staged.pop(0)
            dirs[path.parent] = None
        for d in created:  # a new directory's entry is durable once its parent is synced
            dirs.setdefault(d.parent)
        for d in dirs:
            path = d
            fsync_dir(d)
    except OSError as exc:
        for tmp, _ in staged:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        raise CheckpointWriteError(f"writing {path} failed: {exc.strerror or exc}") from exc


def _make_dirs(d: Path) -> list[Path]:
    """mkdir -p ``d``; return the directories it created, deepest first."""
    missing = []
    while not d.exists():
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        try:
            m.mkdir()
        except FileExistsError:
            pass
    return missing


def clean_stale_temporaries(root: Path) -> list[Path]:
    """Remove temporaries a hard kill left under ``root``; return what was removed."""
    removed = []
    if root.exists():
        for p in root.rglob(f".*{TMP_SUFFIX}"):
            if p.is_file():
                p.unlink()
                removed.append(p)
    return removed


class BlobStore:
    """Immutable blobs named by their SHA-256: files under ``<run>/blobs/sha256/<hex digest>``,
    or values in the run's event log (its ``blobs`` database, key = the hex digest).

    Identical bytes are stored once, so BEST naming LAST's state costs nothing.
    One directory (no ``ab/`` shards): a checkpoint's blobs share one directory
    fsync. Blobs of the earlier sharded layout (``sha256/ab/abcd...``) are still read.

    :meth:`put_all` writes files, durable when it returns. :meth:`stage` (small blobs:
    a checkpoint's manifest, callback states) hands the bytes to the writer's log, which
    stores them in the transaction of its next flush: a manifest staged before LAST is
    durable with LAST, in one sync (no file, no directory fsync). Reads look in the
    files, then in the log.

    Args:
        root: the run's ``blobs`` directory.
        log: the run's event log (the writer passes its own: :meth:`stage` needs it). A
            reader may leave it out: the log beside ``root`` (``<run>/events.lmdb``) is then
            opened read-only for each blob that is not a file, and closed again (in the
            writer's process the reader shares the writer's handle, see ``LmdbLog``).
    """

    def __init__(self, root: Path, log: EventLog | None = None) -> None:
        self.root = Path(root)
        self.log = log

    def _in_log(self, digest: str) -> bytes | None:
        if self.log is not None:
            return self.log.get_blob(digest.encode())
        events = self.root.parent / "events.lmdb"
        if not (events / "data.mdb").exists():
            return None
        with LmdbLog(events, readonly=True) as log:
            return log.get_blob(digest.encode())

    def stage(self, data: bytes, digest: str | None = None) -> str:
        """Give ``data`` to the writer's log (durable with its next sync); return its SHA-256 hex.

        ``digest``: that hex when the caller has just computed it from these very bytes (a
        manifest's, by :func:`~nnx_es.checkpoint.encode_checkpoint`): not hashed again.
        Without a writable log the blob is written as a file (durable when this returns).

        Raises:
            CheckpointWriteError: writing the file failed.
        """
        log = self.log
        if log is None or log.readonly:
            return self.put(data)
        if digest is None:
            digest = hashlib.sha256(data).hexdigest()
        if self._existing(digest) is None:
            log.stage_blob(digest.encode(), data)
        return digest

    def path(self, digest: str) -> Path:
        if not _DIGEST.fullmatch(digest):
            raise CorruptCheckpointError(f"blob name must be 64 lowercase hex digits, got {digest!r}")
        return self.root / "sha256" / digest

    def _existing(self, digest: str) -> Path | None:
        """Where the blob is stored: this layout's path or the sharded one; ``None`` when absent."""
        if not _DIGEST.fullmatch(digest):
            self.path(digest)  # raises, naming it
        base = os.path.join(self.root, "sha256")  # strings: a commit asks this for every blob it stages
        for p in (os.path.join(base, digest), os.path.join(base, digest[:2], digest)):
            if os.path.exists(p):
                return Path(p)
        return None

    def put(self, data: bytes) -> str:
        """Store ``data`` durably (no-op when present); return its SHA-256 hex."""
        return self.put_all([data])[0]

    def put_all(self, datas: Sequence[bytes], digests: Sequence[str] | None = None) -> list[str]:
        """Store each of ``datas`` durably in one batch (see :func:`atomic_write_all`); return their SHA-256s.

        ``digests``: their SHA-256 hex, when the caller has just computed them from these very
        bytes (a checkpoint's parts, by :func:`~nnx_es.checkpoint.encode_checkpoint`): not hashed
        again (a large model's parts are hashed once per commit, not twice).

        Raises:
            CheckpointWriteError: a blob could not be written durably.
        """
        digests = list(digests) if digests is not None else [hashlib.sha256(d).hexdigest() for d in datas]
        new: dict[str, bytes] = {}
        for digest, data in zip(digests, datas):
            # files only: put_all may run on a commit's background thread, which must not read the
            # log while the training thread writes it (a map resize then would fail its transaction)
            if digest not in new and self._existing(digest) is None:
                new[digest] = data
        if new:
            atomic_write_all([(self.path(d), data) for d, data in new.items()])
        return digests

    def delete(self, digests: Sequence[str]) -> None:
        """Delete blobs: their files, and their values in the writer's log (retention, after the
        synced write that recorded their ``checkpoint_pruned``); missing ones are ignored."""
        for digest in digests:
            p = self._existing(digest)
            if p is not None:
                p.unlink(missing_ok=True)
        if self.log is not None and not self.log.readonly:
            self.log.delete_blobs([d.encode() for d in digests])

    def exists(self, digest: str) -> bool:
        """Whether the blob is stored (a file, or a value of the log)."""
        return self._existing(digest) is not None or self._in_log(digest) is not None

    def get(self, digest: str) -> bytes:
        """Read and verify a blob.

        Raises:
            CorruptCheckpointError: missing, or its bytes do not hash to ``digest``.
            EventLogError: the run's log could not be opened or read to look for it.
        """
        p = self._existing(digest)
        if p is not None:
            data, where = p.read_bytes(), f"at {p}"
        else:
            stored = self._in_log(digest)
            if stored is None:
                raise CorruptCheckpointError(
                    f"blob {digest} is missing (expected at {self.path(digest)} or in the event log's blobs)"
                )
            data, where = stored, f"in the event log at {self.root.parent / 'events.lmdb'}"
        found = hashlib.sha256(data).hexdigest()
        if found != digest:
            what = "empty (a truncated write?)" if not data else f"corrupt: its {len(data)} bytes hash to {found}"
            raise CorruptCheckpointError(f"blob {digest} {where} is {what}")
        return data


#: descriptors of the leases this process holds; a forked child closes its copies (see Lease)
_HELD: set[int] = set()


def _close_inherited_leases() -> None:
    """In a forked child (a DataLoader worker, a multiprocessing fork): close the lease descriptors
    it inherited -- closing, never unlocking, which would free the parent's lease."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited_leases)


class Lease:
    """The writer lease of one run: an exclusive ``flock`` on ``runs/.leases/<id>.lock``.

    The kernel drops the lock when no descriptor of it is left open, so a SIGKILLed
    writer frees it: a process forked from the writer (DataLoader workers) closes the
    copy it inherits at once, so it cannot keep the lease alive after the writer died.

    Raises:
        LeaseHeldError: from :meth:`acquire` when another process holds it.
    """

    def __init__(self, runs_root: Path, run_id: str) -> None:
        self.path = Path(runs_root) / ".leases" / f"{validate_run_id(run_id)}.lock"
        self._fd: int | None = None

    def acquire(self) -> Lease:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LeaseHeldError(
                    f"run {self.path.stem!r} is being written by another process (lease {self.path} is held)"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        _HELD.add(fd)
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # no pid left behind to be taken for a live writer
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            _HELD.discard(self._fd)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
