"""Run ids and the writer lease of a run.

A run has one writer (DESIGN.md "The run directory"). Its lease is two exclusive ``flock``\\ s:

* on ``runs/.leases/<id>.lock``: the run's name in its runs root (a new run of that id is
  refused while its directory does not exist yet);
* on the run directory ``runs/<id>`` itself: the run's identity (its device and inode), so two
  paths to one run -- a bind mount, another runs root naming the same directory, another
  spelling on a case-insensitive file system -- meet the same lock. The kernel keys a ``flock``
  by inode: no file names the identity, nothing is left to clean up.

Both are created and opened without following a link (DESIGN.md "Trust boundaries"):
``.leases`` and the run directory must be directories, the lease file a regular file with one
link; it is opened ``O_RDWR | O_CREAT | O_NOFOLLOW`` (never truncated before it is locked), so a
link planted there cannot make a writer truncate another file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from pathlib import Path

from events.paths import describe, open_dir
from nnx_es.errors import InvalidRunIdError, LeaseHeldError, UnsafePathError

__all__ = ["Lease", "validate_run_id"]

_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_LEASE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)


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


def _lock(fd: int) -> bool:
    """``flock(LOCK_EX | LOCK_NB)``: whether it was taken (False: another holds it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        raise
    return True


class Lease:
    """The writer lease of one run: an exclusive ``flock`` on ``runs/.leases/<id>.lock`` and one on
    the run directory ``runs/<id>`` (see the module docstring).

    The kernel drops a lock when no descriptor of it is left open, so a SIGKILLed
    writer frees it: a process forked from the writer (DataLoader workers) closes the
    copies it inherits at once, so it cannot keep the lease alive after the writer died.

    :meth:`acquire` locks the run directory when it exists; a writer that creates it calls
    :meth:`hold_run_dir` (``create=True``) before it puts anything in it.

    Raises:
        InvalidRunIdError: from the constructor, for a run id :func:`validate_run_id` refuses.
        LeaseHeldError: from :meth:`acquire` / :meth:`hold_run_dir` when another process holds
            the lease file or the run directory's lock (it reached the run by another path).
        UnsafePathError: ``.leases``, the lease file or the run directory is a symbolic link or
            of the wrong kind (the lease file: not a regular file, or a hard link to another file);
            nothing was locked, created or written through it.
    """

    def __init__(self, runs_root: Path, run_id: str) -> None:
        self.runs_root = Path(runs_root)
        self.path = self.runs_root / ".leases" / f"{validate_run_id(run_id)}.lock"
        self.run_dir = self.runs_root / run_id
        self._fd: int | None = None
        self._dir_fd: int | None = None

    def acquire(self) -> Lease:
        self.runs_root.mkdir(parents=True, exist_ok=True)  # the runs root is the caller's: as named
        leases = open_dir(self.runs_root, (".leases",), create=True)
        try:
            fd = os.open(self.path.name, _LEASE_FLAGS, 0o644, dir_fd=leases)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(f"lease file {self.path} is a symbolic link: refused, nothing was written "
                                      "through it; remove the link (a lease file is created by the writer)") from None
            raise
        finally:
            os.close(leases)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                found = describe(st.st_mode) if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} links"
                raise UnsafePathError(f"lease file {self.path} is {found}, not a regular file of its own: refused, "
                                      "nothing was written to it; remove it (the writer creates it)")
            if not _lock(fd):
                raise LeaseHeldError(
                    f"run {self.path.stem!r} is being written by another process (lease {self.path} is held)"
                )
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _HELD.add(fd)
        try:
            self.hold_run_dir()
        except BaseException:
            self.release()
            raise
        os.ftruncate(fd, 0)  # a regular file of one link, locked by us: only the lease file changes
        os.write(fd, f"{os.getpid()}\n".encode())
        return self

    def hold_run_dir(self, *, create: bool = False) -> bool:
        """Lock the run directory (its identity); a no-op when it is held already, or when it does not
        exist and ``create`` is false. Return whether this call created it.

        Raises:
            LeaseHeldError: another process holds the directory's lock (through another path).
            UnsafePathError: ``runs/<id>`` is a symbolic link or not a directory.
        """
        if self._dir_fd is not None:
            return False
        made = []
        try:
            fd = open_dir(self.runs_root, (self.run_dir.name,), create=create, created=made)
        except FileNotFoundError:
            return False
        if not _lock(fd):
            os.close(fd)
            raise LeaseHeldError(
                f"run {self.run_dir.name!r} at {self.run_dir} is being written by another process that reached the "
                "same directory by another path (its directory is locked)"
            )
        self._dir_fd = fd
        _HELD.add(fd)
        return bool(made)

    def release(self) -> None:
        if self._dir_fd is not None:
            fcntl.flock(self._dir_fd, fcntl.LOCK_UN)
            _HELD.discard(self._dir_fd)
            os.close(self._dir_fd)
            self._dir_fd = None
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
