"""Opening what lies under a run directory without following a link: the one helper every
reader and writer of a run uses (the log, the blob store, the views, the lease).

A run directory is the *anchor*: the caller named it (a path the user gave, resolved, or
``runs_root/<id>`` after the lease refused a link there), so it is opened as named. Every
component below it is opened relative to its parent's descriptor with ``O_NOFOLLOW`` (an
``openat`` walk), so a directory swapped for a link between a check and the open is refused too.
A file is opened ``O_NONBLOCK`` (a FIFO cannot block the open), ``fstat``-ed, and read only when
it is a regular file, never past a bound the caller gives (a regular file is finite, but it may
be a sparse terabyte). Where a library opens the files itself (LMDB), :func:`check_entry`
``lstat``-s them first.

Every refusal is an :class:`~events.errors.UnsafePathError` naming the path and what it is.
DESIGN.md "Trust boundaries".
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from events.errors import UnsafePathError

__all__ = ["check_entry", "create_file", "describe", "open_dir", "open_file", "read_file"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # no O_TRUNC: checked first
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))
_READ_MAX = 0x7FFFF000  # the most one read(2) returns on Linux


def describe(mode: int) -> str:
    """What a ``st_mode`` is, in words (``"a FIFO"``, ``"a symbolic link"``, ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse(path: Path, found: str, want: str) -> UnsafePathError:
    if found == "a symbolic link":
        try:
            found += f" (to {os.readlink(path)!r})"
        except OSError:
            pass
        return UnsafePathError(f"{path} is {found}: nothing under a run directory is followed; replace the link "
                               f"with {want} itself (nothing was read or written through it)")
    return UnsafePathError(f"{path} is {found}, not {want}: refused, nothing was read or written through it; "
                           "remove it (or restore the run directory from a copy)")


#: what :func:`check_entry` wants of each kind: (in words, the test of an ``st_mode``)
_WANTED: dict[str, tuple[str, Callable[[int], bool]]] = {"dir": ("a directory", stat.S_ISDIR),
                                                          "file": ("a regular file", stat.S_ISREG)}
_ANY: tuple[str, Callable[[int], bool]] = ("what it names", lambda mode: not stat.S_ISLNK(mode))


def check_entry(path: str | os.PathLike[str], kind: str | None) -> os.stat_result | None:
    """``lstat`` ``path``; return its stat, or ``None`` when it does not exist.

    ``kind``: ``"dir"`` or ``"file"`` (a regular file): what ``path`` must be when it exists;
    ``None``: anything but a link (the caller's own checks name a wrong kind).

    Raises:
        UnsafePathError: ``path`` is a symbolic link, or exists and is not of ``kind``.
    """
    try:
        st = os.lstat(path)  # the name as given: no Path built unless it is refused (a commit checks every blob)
    except (FileNotFoundError, NotADirectoryError):  # (a parent is not a directory: nothing is there)
        return None
    want, ok = _WANTED[kind] if kind in _WANTED else _ANY
    if not ok(st.st_mode):
        raise _refuse(Path(path), describe(st.st_mode), want)
    return st


def open_dir(anchor: str | os.PathLike[str], parts: Sequence[str] = (), *, create: bool = False,
             created: list[Path] | None = None) -> int:
    """Open the directory ``anchor/parts[0]/parts[1]/...``; return its descriptor (the caller closes it).

    ``anchor`` is opened as named; each of ``parts`` relative to its parent with ``O_NOFOLLOW``.
    ``create``: a missing part is made (mode 0o777 less the umask) and, when ``created`` is given,
    appended to it.

    Raises:
        UnsafePathError: a part is a symbolic link, or not a directory.
        FileNotFoundError: ``anchor``, or (without ``create``) a part, does not exist.
        OSError: any other failure of ``open``/``mkdir``.
    """
    fd = os.open(anchor, _DIR)
    path = Path(anchor)
    try:
        for part in parts:
            path = path / part
            while True:
                try:
                    nfd = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
                    break
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)
                    except FileExistsError:
                        continue  # made beside us: open what is there now
                    if created is not None:
                        created.append(path)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _refuse(path, _what(fd, part), "a directory") from None
                    raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _what(dir_fd: int, name: str) -> str:
    try:
        return describe(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return "not a directory"


def open_file(dir_fd: int, name: str, *, path: Path) -> tuple[int, os.stat_result]:
    """Open the regular file ``name`` in the directory ``dir_fd`` for reading; return (descriptor, its fstat).

    ``O_NOFOLLOW | O_NONBLOCK``: a link is refused, a FIFO opens at once (and is then refused).
    ``path``: how the file is named in messages.

    Raises:
        UnsafePathError: ``name`` is a symbolic link, or not a regular file.
        FileNotFoundError: there is no ``name``.
    """
    try:
        fd = os.open(name, _FILE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link", "a regular file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refuse(path, describe(st.st_mode), "a regular file")
    return fd, st


def read_file(anchor: str | os.PathLike[str], parts: Sequence[str], *, limit: int) -> bytes | None:
    """The bytes of the regular file ``anchor/parts...`` (see :func:`open_dir`), or ``None`` when it
    (or a directory on the way) does not exist.

    At most ``limit + 1`` bytes are read: more than ``limit`` tells the caller the file is longer
    than it may be (damage, which the caller names); nothing past that is read.

    Raises:
        UnsafePathError: a component is a symbolic link or of the wrong kind.
        OSError: the file could not be read.
    """
    *dirs, name = parts
    try:
        dir_fd = open_dir(anchor, dirs)
    except FileNotFoundError:
        return None
    try:
        fd, st = open_file(dir_fd, name, path=Path(anchor, *parts))
    except FileNotFoundError:
        return None
    finally:
        os.close(dir_fd)
    try:
        want = min(st.st_size, limit) + 1  # one past what it holds: a file growing while read is seen
        data = os.read(fd, min(want, _READ_MAX))  # one read, one buffer: a regular file's whole size
        rest: list[bytes] = []
        got = len(data)
        while got < want:
            chunk = os.read(fd, min(want - got, _READ_MAX))
            if not chunk:
                break
            rest.append(chunk)
            got += len(chunk)
        return b"".join([data, *rest]) if rest else data  # (no second copy of a file read whole)
    finally:
        os.close(fd)


def create_file(anchor: str | os.PathLike[str], parts: Sequence[str]) -> int:
    """Open ``anchor/parts...`` for writing, emptied; return its descriptor (the caller closes it).

    The directories are walked (and made) as by :func:`open_dir`; the file is created when missing
    (``O_CREAT | O_NOFOLLOW``, mode 0o644 less the umask). One that exists must be a regular file of
    one link: it is emptied only after that is checked (a hard link to another file is never truncated).

    Raises:
        UnsafePathError: a component is a symbolic link, or the file is a FIFO, a device, a
            directory, or a hard link; nothing was written.
        OSError: any other failure of ``open``/``mkdir``.
    """
    *dirs, name = parts
    path = Path(anchor, *parts)
    dir_fd = open_dir(anchor, dirs, create=True)
    try:
        fd = os.open(name, _NEW, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link", "a regular file") from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO no one reads; a directory
            raise _refuse(path, _what(dir_fd, name), "a regular file") from None
        raise
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        found = describe(st.st_mode) if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} links"
        raise _refuse(path, found, "a regular file of its own")
    os.ftruncate(fd, 0)
    return fd
