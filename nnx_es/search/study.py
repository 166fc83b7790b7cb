"""Where a search's study lives, and which process runs which of its trials.

* **The study directory** ``RUNS_ROOT/studies/<name>/`` (opened without following a link) holds the
  default storage -- Optuna's journal file storage, ``journal.log`` (nothing to start: several
  processes on one machine share it through the file) -- and the claims below, whatever the storage.
  Any Optuna storage URL works instead (``sqlite:///search.db``, a MySQL or PostgreSQL URL for workers
  on several machines, which then share the runs root).
* **Claims**: a worker runs a trial while it holds that trial's lease (``.leases/trial-<n>.lock``
  under the study directory, :class:`nnx_es.lease.Lease`: an ``flock`` the kernel frees when the
  process dies). Taking a trial -- finding a RUNNING trial nobody holds, or asking Optuna for a new
  one -- happens under the study's own lease (``claim``), one worker at a time. So a trial whose
  worker was killed is found RUNNING and unclaimed, and continued under its own number by the next
  worker (its run resumes from its LAST) instead of being marked FAIL and sampled again (Optuna's
  heartbeat + ``RetryFailedTrialCallback`` re-run a killed trial from scratch under a new number);
  a trial a live worker holds is never taken twice.

Claims rest on ``flock``: they hold between processes of one machine, and across machines on a
shared file system whose ``flock`` spans clients (NFSv4 does; check yours).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from events.paths import check_entry, open_dir, read_file
from nnx_es.errors import LeaseHeldError, NnxError
from nnx_es.lease import Lease, validate_run_id

__all__ = ["JOURNAL_READ_LIMIT", "STUDIES_DIR", "Claims", "default_storage", "journal_copy", "study_dir", "study_names"]

#: the directory of a runs root that holds the studies (``studies/<name>/``)
STUDIES_DIR = "studies"
#: the longest study journal :func:`journal_copy` reads (bytes)
JOURNAL_READ_LIMIT = 1 << 30
#: how long a worker waits between two tries of the study's claim lease (seconds)
_CLAIM_POLL_S = 0.01


def study_dir(runs_root: Path, name: str) -> Path:
    """``runs_root/studies/<name>``, made if missing, no part of it a link.

    Raises:
        InvalidRunIdError: ``name`` is no safe directory name. UnsafePathError: a link on the way.
    """
    runs_root = Path(runs_root)
    runs_root.mkdir(parents=True, exist_ok=True)  # the runs root is the caller's: as named
    os.close(open_dir(runs_root, (STUDIES_DIR, validate_run_id(name)), create=True))
    return runs_root / STUDIES_DIR / name


def default_storage(directory: Path) -> Any:
    """Optuna's journal file storage in ``directory/journal.log``.

    Raises:
        UnsafePathError: ``journal.log`` is a link or not a regular file (Optuna would append through it).
    """
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    check_entry(directory / "journal.log", "file")
    return JournalStorage(JournalFileBackend(str(directory / "journal.log")))


def study_names(runs_root: Path) -> list[str]:
    """The studies under ``runs_root`` (``studies/<name>/journal.log``, no part a link), by name."""
    directory = Path(runs_root) / STUDIES_DIR
    if check_entry(directory, "dir") is None:
        return []
    names = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if check_entry(directory / validate_run_id(entry.name) / "journal.log", "file") is not None:
                names.append(entry.name)
        except NnxError:  # no study name, or a link where the journal goes: not listed
            continue
    return names


def journal_copy(runs_root: Path, name: str) -> Any | None:
    """Optuna's journal storage over a copy in memory of study ``name``'s ``journal.log``, or None: no such
    journal. Writes nothing: Optuna's :class:`JournalFileBackend` would create the file if missing and
    take its lock file to append; this reads the journal's bytes once (``O_NOFOLLOW`` on every part, so
    a read-only runs root is read too) and replays its complete lines -- a line a worker is appending is
    left out, as Optuna's file reader does. The storage refuses to append.

    Raises:
        InvalidRunIdError: ``name`` is no safe directory name. UnsafePathError: a link on the way.
        ValueError: the journal is longer than :data:`JOURNAL_READ_LIMIT`, or a complete line is no JSON.
    """
    import json

    from optuna.storages import JournalStorage
    from optuna.storages.journal import BaseJournalBackend

    data = read_file(runs_root, (STUDIES_DIR, validate_run_id(name), "journal.log"), limit=JOURNAL_READ_LIMIT)
    if data is None:
        return None
    if len(data) > JOURNAL_READ_LIMIT:
        raise ValueError(f"study {name!r}: its journal is longer than {JOURNAL_READ_LIMIT} bytes: not read")
    lines = data.split(b"\n")[:-1]  # the part after the last newline is a line being written

    class _Copy(BaseJournalBackend):
        def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
            for line in lines[log_number_from:]:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"study {name!r}: a damaged journal line: {exc}") from None

        def append_logs(self, logs: list[dict[str, Any]]) -> None:
            raise PermissionError(f"study {name!r} was opened read-only (a copy of its journal)")

    return JournalStorage(_Copy())


class Claims:
    """The leases of a study's trials (see the module docstring), under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the study's claim lease (waiting for it) for the block: one worker takes trials at a time."""
        lease = Lease(self.directory, "claim")
        while True:
            try:
                lease.acquire()
                break
            except LeaseHeldError:
                time.sleep(_CLAIM_POLL_S)
        try:
            yield
        finally:
            lease.release()

    def take(self, number: int) -> Lease | None:
        """Trial ``number``'s lease, held now (release it when the trial is told), or None: another process holds it."""
        lease = Lease(self.directory, f"trial-{int(number)}")
        try:
            return lease.acquire()
        except LeaseHeldError:
            return None
