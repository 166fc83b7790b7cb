"""Files outside LMDB: atomic writes and the content-addressed blob store (run ids and leases:
:mod:`nnx_es.lease`, re-exported here).

Every file goes through an owned temporary file (``.<name>.<pid>.<rand>.tmp``
in the destination's directory), ``fsync``, atomic ``os.replace`` and a
directory fsync; a failed write removes its temporary and leaves the
destination's previous bytes (DESIGN.md "Failure semantics"). Files written
together (a checkpoint's large blobs, the two views) share the
directory fsyncs: each temporary is written and synced, all are renamed, then
each directory is synced once -- no file is ever visible with unsynced bytes,
and all are durable before the caller goes on (to LAST, which names them).

Nothing under a run directory is followed: writes walk from the run directory with
``O_NOFOLLOW`` and reads take regular files only, bounded (:mod:`events.paths`).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

from events.log import EventLog, LmdbLog
from events.paths import check_entry, open_dir, read_file
from nnx_es.errors import CheckpointWriteError, CorruptCheckpointError, UnsafePathError
from nnx_es.lease import Lease, validate_run_id

__all__ = [
    "BlobStore",
    "Lease",
    "atomic_write",
    "atomic_write_all",
    "RUN_ENTRIES",
    "check_run_dir",
    "clean_stale_temporaries",
    "fsync_dir",
    "UNSIZED_MAX",
    "validate_run_id",
]

_DIGEST = re.compile(r"[0-9a-f]{64}")
TMP_SUFFIX = ".tmp"

#: what a run directory holds, and what each must be when present (DESIGN.md "The run directory");
#: ``None``: anything but a link (the log's readers name a wrong kind themselves)
RUN_ENTRIES: tuple[tuple[str, str | None], ...] = (
    ("events.lmdb", None), ("events.lmdb/data.mdb", "file"), ("events.lmdb/lock.mdb", "file"),
    ("blobs", "dir"), ("blobs/sha256", "dir"), ("views", "dir"),
)

#: the most bytes a blob whose size nothing records (a manifest, a journal chunk) is read to:
#: a longer file is damage (a sparse terabyte is not read into memory)
UNSIZED_MAX = 1 << 30


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run directory whose log, blob or view directory (or the log's files) is a symbolic
    link or of the wrong kind (:data:`RUN_ENTRIES`), before a reader or writer opens anything in it.
    A check, not a guard against a swap after it: every later open walks without following a link.

    Raises:
        UnsafePathError: naming the entry and what it is.
    """
    for rel, kind in RUN_ENTRIES:
        check_entry(Path(run_dir, rel), kind)


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, root: Path | None = None) -> None:
    """Durably replace ``path`` with ``data`` (temporary, fsync, rename, dir fsync); ``root``: see
    :func:`atomic_write_all`.

    Raises:
        UnsafePathError: see :func:`atomic_write_all`.
        CheckpointWriteError: any OS error (ENOSPC, EIO, ...); the temporary is
            removed and ``path`` keeps its previous bytes.
    """
    atomic_write_all([(path, data)], root=root)


def atomic_write_all(items: Sequence[tuple[Path, bytes]], *, root: Path | None = None) -> None:
    """Durably replace each ``path`` with its ``data``, as one batch.

    Each temporary is written and fsynced, then all are renamed, then each
    directory holding them (and the parent of each directory created) is
    fsynced once. When this returns every file is durable.

    ``root``: the directory the paths lie under (a run directory, a writer's: named by runs root
    and id, or resolved); it and each directory between it and a file are opened without following
    a link (:mod:`events.paths`) and made when missing (its parent is opened as named). Without it,
    each file's own directory is opened as named.
    A temporary is created in its directory's descriptor (``O_EXCL | O_NOFOLLOW``); the rename
    into place names full paths (a directory swapped for a link after the walk does not hold
    the temporary: the rename fails), and replaces a link at the destination, never writes through it.

    Raises:
        UnsafePathError: ``root`` or a directory below it is a symbolic link or not a directory;
            nothing was written (earlier files of the batch were not renamed).
        CheckpointWriteError: any OS error (ENOSPC, EIO, ...), naming the file; every
            temporary is removed. Files renamed before the error hold their complete,
            synced bytes; the others keep their previous bytes.
    """
    staged: list[tuple[int, str, Path, Path]] = []  # (dir fd, temporary's name, temporary, destination)
    created: list[Path] = []
    fds: dict[Path, int] = {}  # each directory written into -> its descriptor
    path = Path()
    try:
        for path, data in items:
            path = Path(path)
            # the root's own name is not followed either: its parent (or the nearest existing) is the anchor
            anchor = _existing_ancestor(Path(root).parent if root is not None else path.parent)
            d = fds.get(path.parent)
            if d is None:
                d = fds[path.parent] = open_dir(anchor, path.parent.relative_to(anchor).parts, create=True,
                                                created=created)
            name = f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=d)
            staged.append((d, name, path.with_name(name), path))
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
            _, _, tmp, path = staged[0]
            os.replace(tmp, path)
            staged.pop(0)
            dirs[path.parent] = None
        for made in created:  # a new directory's entry is durable once its parent is synced
            dirs.setdefault(made.parent)
        for dir_path in dirs:
            path = dir_path
            fsync_dir(dir_path)
    except OSError as exc:
        for d, name, _, _ in staged:
            try:
                os.unlink(name, dir_fd=d)
            except FileNotFoundError:
                pass
        if isinstance(exc, UnsafePathError):
            raise
        raise CheckpointWriteError(f"writing {path} failed: {exc.strerror or exc}") from exc
    finally:
        for d in fds.values():
            os.close(d)


def _existing_ancestor(d: Path) -> Path:
    while not os.path.lexists(d) and d != d.parent:
        d = d.parent
    return d


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
        self._files = os.path.join(self.root, "sha256")  # a string: a commit looks for every blob it stages here

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
        base = self._files
        if check_entry(os.path.join(base, digest), "file") is not None:  # a link or a FIFO: refused, never taken
            return Path(base, digest)
        shard = os.path.join(base, digest[:2])  # the sharded layout: its directory no more followed than the file
        if check_entry(shard, "dir") is not None and check_entry(os.path.join(shard, digest), "file") is not None:
            return Path(shard, digest)
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
            UnsafePathError: ``blobs/`` or ``blobs/sha256/`` is a symbolic link (or not a
                directory), or a link or FIFO stands where one of the blobs would be.
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
            atomic_write_all([(self.path(d), data) for d, data in new.items()], root=self.root.parent)
        return digests

    def delete(self, digests: Sequence[str]) -> None:
        """Delete blobs: their files, and their values in the writer's log (retention, after the
        synced write that recorded their ``checkpoint_pruned``); missing ones are ignored.

        Raises:
            UnsafePathError: a blob, or the directory holding it (a shard of the older layout), is a
                symbolic link or of the wrong kind: nothing is deleted through it.
        """
        for digest in digests:
            p = self._existing(digest)
            if p is not None:  # unlinked in its directory, walked from the run without following a link
                fd = open_dir(self.root.parent, p.parent.relative_to(self.root.parent).parts)
                try:
                    os.unlink(p.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
                finally:
                    os.close(fd)
        if self.log is not None and not self.log.readonly:
            self.log.delete_blobs([d.encode() for d in digests])

    def exists(self, digest: str) -> bool:
        """Whether the blob is stored (a file, or a value of the log)."""
        return self._existing(digest) is not None or self._in_log(digest) is not None

    def get(self, digest: str, *, size: int | None = None) -> bytes:
        """Read and verify a blob.

        ``size``: its length as a manifest records it (``Component.bytes``); a file is read to at
        most one byte more, and one that holds more is damage. Without it, at most
        :data:`UNSIZED_MAX` bytes. Only a regular file is read (:func:`events.paths.read_file`):
        a FIFO or a device in place of a blob is refused at once, a link is never followed.

        Raises:
            UnsafePathError: the blob, or the directory holding it, is a symbolic link or not a
                regular file (directory); nothing was read.
            CorruptCheckpointError: missing, longer than ``size`` (or :data:`UNSIZED_MAX`), or its
                bytes do not hash to ``digest``.
            EventLogError: the run's log could not be opened or read to look for it.
        """
        self.path(digest)  # a malformed name is refused, naming it
        limit = size if size is not None else UNSIZED_MAX
        data: bytes | None = None
        for parts in ((self.root.name, "sha256", digest), (self.root.name, "sha256", digest[:2], digest)):
            data = read_file(self.root.parent, parts, limit=limit)
            if data is not None:
                where = f"at {Path(self.root.parent, *parts)}"
                break
        if data is None:
            data = self._in_log(digest)
            if data is None:
                raise CorruptCheckpointError(
                    f"blob {digest} is missing (expected at {self.path(digest)} or in the event log's blobs)"
                )
            where = f"in the event log at {self.root.parent / 'events.lmdb'}"
        if len(data) > limit:
            said = f"the {size} bytes its manifest records" if size is not None else \
                f"{UNSIZED_MAX} bytes, the most a blob of no recorded size may hold"
            raise CorruptCheckpointError(f"blob {digest} {where} is damaged: it holds more than {said} "
                                         "(read no further)")
        found = hashlib.sha256(data).hexdigest()
        if found != digest:
            what = "empty (a truncated write?)" if not data else f"corrupt: its {len(data)} bytes hash to {found}"
            raise CorruptCheckpointError(f"blob {digest} {where} is {what}")
        return data
