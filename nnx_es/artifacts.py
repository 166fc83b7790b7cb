"""Files an export writes outside the log: where one may go, how it is written, how its digest is read.

An export's output path is the user's (``nnx-es export --out``, ``NNModel.export(out=)``). It may lie
anywhere but inside another run; inside the run it comes from, it is written with the ``openat`` walk
of :mod:`events.paths` (no component followed through a symbolic link) and never into the run's own
parts (``events.lmdb``, ``blobs``, ``views``). Everywhere a file is written to an owned temporary
beside its destination, fsynced and renamed over it, so a reader sees the old file or the whole new one.

:func:`file_sha256` reads a recorded artifact back for ``tools/replay`` without following a link at its
last component or blocking on a FIFO (:func:`events.paths.open_file`).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path

from events.paths import create_file, open_dir, open_file
from nnx_es.errors import ConfigError

__all__ = ["RUN_PARTS", "Destination", "destination", "file_sha256", "refuse_inside_run", "write_artifact",
           "write_output"]

#: a run directory's own parts: an artifact is never written there
RUN_PARTS = frozenset({"events.lmdb", "blobs", "views"})

_CHUNK = 1 << 20


class Destination:
    """Where an artifact goes: ``path`` (absolute, as given: links not resolved); ``run_dir`` and ``parts``
    when it lies inside the run it comes from (then written by the ``openat`` walk below ``run_dir``)."""

    def __init__(self, path: Path, run_dir: Path | None = None, parts: tuple[str, ...] = ()) -> None:
        self.path, self.run_dir, self.parts = path, run_dir, parts


def _run_above(path: Path) -> Path | None:
    """The nearest directory at or above ``path`` that holds an ``events.lmdb`` (a run), or None."""
    for d in (path, *path.parents):
        if (d / "events.lmdb").exists():
            return d
    return None


def refuse_inside_run(directory: str | os.PathLike[str], said: str) -> None:
    """Refuse to write in ``directory`` when it is, or lies inside, a run directory (one holding ``events.lmdb``),
    looked for both as written and with its links resolved: nothing is written into a run but its own (an
    artifact, a predictions file, a runs root a command would create runs under). ``said``: how the user gave
    it (``"--out 'm.onnx'"``, ``"--runs-dir 'runs/a'"``).

    Raises:
        ConfigError: naming ``said`` and the run found.
    """
    lexical = Path(os.path.abspath(directory))
    for found in {_run_above(lexical), _run_above(lexical.resolve())} - {None}:
        raise ConfigError(f"{said} lies inside a run ({found}): nothing is written into a run but its own (it may "
                          "be someone else's); give a path outside it")


def destination(out: str | os.PathLike[str], run_dir: str | os.PathLike[str] | None) -> Destination:
    """Check the user's output path ``out`` for an artifact of the run at ``run_dir`` (None: no run).

    Raises:
        ConfigError: ``out`` is a directory, lies inside another run (:func:`refuse_inside_run`), or inside
            this run's own parts.
    """
    lexical = Path(os.path.abspath(out))
    if lexical.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a directory: give the artifact's file name")
    real_parent = lexical.parent.resolve()
    own = Path(run_dir).resolve() if run_dir is not None else None
    own_lexical = Path(os.path.abspath(run_dir)) if run_dir is not None else None
    for base, where in ((own_lexical, lexical), (own, real_parent / lexical.name)):
        if base is not None and where.is_relative_to(base) and where != base:
            parts = where.relative_to(base).parts
            if parts[0] in RUN_PARTS:
                raise ConfigError(f"--out {str(out)!r} lies in the run's own {parts[0]!r}: write the artifact "
                                  f"elsewhere (e.g. {str(base / 'exports' / lexical.name)!r})")
            assert own is not None
            return Destination(lexical, own, parts)
    refuse_inside_run(lexical.parent, f"--out {str(out)!r}")
    return Destination(lexical)


def write_artifact(source: Path, dest: Destination) -> None:
    """Copy the finished file ``source`` to ``dest``: a temporary beside it, fsynced, then renamed over it.

    Raises:
        UnsafePathError: inside the run, a directory on the way or the file is a symbolic link or of
            the wrong kind (nothing written).
        OSError: the copy failed (the temporary is removed; a file already at ``dest`` is left as it was).
    """
    if dest.run_dir is not None:
        *dirs, name = dest.parts
        tmp_parts = (*dirs, f".{name}.{secrets.token_hex(4)}.tmp")
        fd = create_file(dest.run_dir, tmp_parts)
        dir_fd = open_dir(dest.run_dir, dirs)
        rename = (dir_fd, tmp_parts[-1], name)
    else:
        dest.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.path.parent / f".{dest.path.name}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        dir_fd = os.open(dest.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        rename = (dir_fd, tmp.name, dest.path.name)
    try:
        try:
            with open(source, "rb") as src:
                while chunk := src.read(_CHUNK):
                    os.write(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(rename[1], rename[2], src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except BaseException:
        try:
            os.unlink(rename[1], dir_fd=dir_fd)
        except OSError:
            pass
        raise
    finally:
        os.close(dir_fd)


def write_output(out: str | os.PathLike[str], write: Callable[[Path], object], *,
                 run_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write a user's output file ``out`` (predictions, a plot) by ``write(path)`` into a private temporary
    directory, then :func:`write_artifact` it to ``out``: checked by :func:`destination` (never inside a run
    but ``run_dir``'s, nor its own parts), renamed over ``out`` (a link there is replaced, never followed).

    Raises:
        ConfigError: ``out`` is a directory or lies inside another run (:func:`destination`).
        UnsafePathError, OSError: as :func:`write_artifact`.
    """
    dest = destination(out, run_dir)
    with tempfile.TemporaryDirectory(prefix="nnx_es-out-") as tmp:
        staged = Path(tmp) / dest.path.name
        write(staged)
        write_artifact(staged, dest)
    return dest.path


def file_sha256(path: str | os.PathLike[str]) -> str | None:
    """SHA-256 (hex) of the regular file at ``path``, or None when nothing is there.

    Raises:
        UnsafePathError: ``path`` is a symbolic link, a FIFO, a directory, ... (never followed or read).
        OSError: it could not be read.
    """
    p = Path(os.path.abspath(path))
    try:
        dir_fd = os.open(p.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fd, _ = open_file(dir_fd, p.name, path=p)
    except FileNotFoundError:
        return None
    finally:
        os.close(dir_fd)
    h = hashlib.sha256()
    try:
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()

