"""How the web app reaches runs: confined to one runs root, read-only, one reader of a run at a time.

* **Confinement.** The runs root is the anchor, named by the person who started the server and
  resolved once. A run is reached only by its id: checked as a run id (:func:`nnx_es.lease.validate_run_id`:
  ``[A-Za-z0-9._-]``, no separator, not ``..``), then ``lstat``-ed as a real directory under the root
  (:func:`events.paths.check_entry`: a link is refused, never followed); below it, every reader of the
  project walks with ``O_NOFOLLOW`` (docs/SECURITY.md "The run directory").
* **Read-only.** Every read runs inside :func:`events.log.quiet_readers`: a log no other process has
  open is opened without LMDB's lock file, so nothing under the root is created or written -- not even
  ``lock.mdb`` -- and a live writer's log is read with LMDB's lock, as any reader beside a writer. A
  read during which a writer opened the log (:class:`~events.errors.WriterAppearedError`) is read again
  once.
* **One reader of a run at a time** in this process (a lock per run id): LMDB must not have one
  environment open twice in a process (closing one would drop the other's ``fcntl`` lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TypeVar

from events.errors import WriterAppearedError
from events.log import quiet_readers
from events.paths import check_entry
from nnx_es.audit import NotARunError
from nnx_es.cli.many import run_dirs
from nnx_es.errors import MissingDirectoryError
from nnx_es.lease import validate_run_id

__all__ = ["RunsRoot"]

T = TypeVar("T")


class RunsRoot:
    """The runs root a server reads (see the module docstring).

    Args:
        root: a directory of runs (``runs/``); it may hold no run yet.

    Raises:
        MissingDirectoryError: ``root`` does not exist or is not a directory.
    """

    def __init__(self, root: str | Path) -> None:
        root = Path(root)
        if not root.is_dir():
            raise MissingDirectoryError(f"runs root {str(root)!r} does not exist or is not a directory: give the "
                                        "directory your runs are written under (Trainer(runs_root=...), default runs/)")
        self.path = root.resolve()  # the anchor: the person who started the server named it
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def run_ids(self) -> list[str]:
        """The names of the entries of the root that hold a run's parts, by name (hidden entries left out)."""
        return [p.name for p in run_dirs(self.path)]

    def run_dir(self, run_id: str) -> Path:
        """The directory of run ``run_id`` under the root.

        Raises:
            InvalidRunIdError: ``run_id`` is not a run id (a separator, ``..``, a character outside
                ``[A-Za-z0-9._-]``): nothing was looked up.
            UnsafePathError: ``root/run_id`` is a symbolic link or not a directory: not followed.
            NotARunError: there is no such entry.
        """
        validate_run_id(run_id)
        path = self.path / run_id
        if check_entry(path, "dir") is None:
            raise NotARunError(f"no run {run_id!r} under {self.path}")
        return path

    def _lock(self, run_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(run_id, threading.Lock())

    @contextmanager
    def reading(self, *run_ids: str) -> Iterator[list[Path]]:
        """The directories of ``run_ids`` (see :meth:`run_dir`), each held by this process's one reader of it,
        with every log opened inside read quietly (:func:`events.log.quiet_readers`)."""
        dirs = [self.run_dir(run_id) for run_id in run_ids]
        with ExitStack() as stack:
            for run_id in sorted(set(run_ids)):  # one order: two readers of the same pair never wait on each other
                stack.enter_context(self._lock(run_id))
            stack.enter_context(quiet_readers())
            yield dirs

    def read(self, fn: Callable[..., T], *run_ids: str) -> T:
        """``fn(*run_dirs)`` inside :meth:`reading`, called again once when a writer opened a log during it.

        Raises:
            WriterAppearedError: a writer opened a log during the second call too.
        """
        for attempt in (1, 2):
            try:
                with self.reading(*run_ids) as dirs:
                    return fn(*dirs)
            except WriterAppearedError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")
