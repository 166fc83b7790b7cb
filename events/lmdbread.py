"""How an :class:`events.log.LmdbLog` handle reads: one read transaction at a time, remapped when a
writer grew the file, checked when read quietly, LMDB's errors said as :class:`EventLogError`.

* **Remap.** A writer that grew the file past a reader's map makes LMDB refuse the reader's next
  transaction (``MapResizedError``): the reader maps the file as it is now
  (:func:`events.lmdbfile.reader_map_size`) and begins again, unless another of its reads is open
  (a remap would end that read: :class:`EventLogError`, read again).
* **Quiet reads** (:func:`events.lmdbenv.quiet_readers`): a handle opened without LMDB's lock file
  checks, as each read ends, that no process opened the log meanwhile, and raises
  :class:`~events.errors.WriterAppearedError` when one did (garbage read from reused pages is said
  as the writer that reused them).
* **Errors.** An ``lmdb.Error`` inside a read (a corrupted page) is raised as :class:`EventLogError`
  naming the log, the original chained.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from events.errors import DamagedLogError, EventLogError, WriterAppearedError
from events.lmdbfile import env_in_use, reader_map_size, valid_key

__all__ = ["Reads"]


class Reads:
    """The read transactions of one handle of the log at ``path`` (see the module docstring).

    Args:
        env: the handle's environment (a writer's own, when ``shared``).
        path: the log's directory, for messages and the file's size.
        remap_to_file: a read-only handle of its own: remap to the file's size (else LMDB's choice).
        quiet: opened without LMDB's lock file.
    """

    def __init__(self, env: lmdb.Environment, path: Path, *, remap_to_file: bool, quiet: bool) -> None:
        self.env, self.path, self.quiet = env, path, quiet
        self._remap_to_file = remap_to_file
        self._open = 0  # read transactions open (a generator suspended mid-read holds one)

    @contextmanager
    def txn(self) -> Iterator[lmdb.Transaction]:
        """One read transaction.

        Raises:
            EventLogError: LMDB refused a read (a corrupted page), or the map must grow while
                another read of this handle is open.
            WriterAppearedError: (quiet) a process opened the log during the read.
        """
        try:
            with self._txn() as txn:
                yield txn
        except lmdb.Error as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: lmdb.Error) -> EventLogError:
        return EventLogError(f"read of event log at {self.path} failed: {type(exc).__name__}: {exc}")

    @contextmanager
    def _txn(self) -> Iterator[lmdb.Transaction]:
        try:
            txn = self.env.begin()
        except lmdb.MapResizedError:
            if self._open:
                raise EventLogError(f"event log at {self.path} grew past this reader's map while one of its reads "
                                    "was open (remapping would end that read): read again") from None
            self.env.set_mapsize(reader_map_size(self.path / "data.mdb") if self._remap_to_file else 0)
            txn = self.env.begin()
        self._open += 1
        try:
            with txn:
                yield txn
        except Exception as exc:
            if self.quiet and env_in_use(self.path):
                raise self._writer_appeared() from exc
            raise
        finally:
            self._open -= 1
        if self.quiet and env_in_use(self.path):
            raise self._writer_appeared()

    def _writer_appeared(self) -> WriterAppearedError:
        return WriterAppearedError(f"a process opened the event log at {self.path} while this reader read it without "
                                   "LMDB's lock file (no process had it open when it was opened): read again")

    def existing_db(self, name: bytes) -> lmdb._Database | None:
        """The named database, or None while no writer has created it (a map a writer outgrew is
        remapped first: LMDB's own lookup transaction would fail)."""
        with self.txn():
            pass
        try:
            return self.env.open_db(name, create=False)  # (one opened in a read of ours is not kept)
        except lmdb.NotFoundError:
            return None
        except lmdb.Error as exc:
            raise self._failed(exc) from exc

    def count(self, events: lmdb._Database) -> int:
        """The stored length: the last key + 1 (0 for an empty log).

        Raises:
            DamagedLogError: the last key is not a seq (8 bytes below 2^62).
        """
        with self.txn() as txn:
            cur = txn.cursor(events)
            if not cur.last():
                return 0
            if not valid_key(key := cur.key()):  # the log's length would be no count (2^63, 2^64 + 1, ...)
                raise DamagedLogError(f"event log at {self.path} is damaged: its last key, {bytes(key).hex()}, is not "
                                      "a seq (8 bytes below 2^62): not read; restore the run directory from a copy")
            return int.from_bytes(key, "big") + 1
