"""The append-only event log: the LMDB one here, an in-memory one in :mod:`events.logbase`.

Both keep one contract (``tests/contract/test_event_log.py``):

* sequence numbers are contiguous from 0; ``append`` returns the event's seq;
* ``append`` only buffers; ``flush()`` writes the buffer in one transaction
  (the LMDB log syncs its pages but not its meta page: a power cut may undo the
  newest flush, never damage what an earlier sync made durable); ``commit(event)``
  appends, flushes and syncs, so a commit marker is durable before the call returns;
* ``read``/``read_raw``/``read_chunks`` see flushed events only, by sequence
  range; ``read(kinds=...)`` filters by kind;
* a value that does not decode raises :class:`CorruptEventError` naming its seq;
* ``check_keys`` reads the stored keys themselves and raises :class:`SequenceGapError`
  unless they are 0, 1, 2, ... in stored order (``read_chunks`` may not see a changed key);
* ``verify_sums`` yields the ranges of stored values whose checksum does not verify.

The LMDB log stores key = 8-byte big-endian seq, value = msgpack
(:mod:`events.codec`); the map doubles on ``MapFullError`` and the buffered
batch is retried, so a full map never loses an event. Each flush also stores the
batch's CRC-32 in the same transaction (:mod:`events.sums`).

Beside the events, a log keeps *blobs*: immutable byte values under a caller's
key (nnx_es stores small checkpoint manifests there, keyed by their SHA-256).
``stage_blob`` buffers one; the next flush writes it in the same transaction as
the buffered events, so a blob staged before a commit marker is durable with
it, in one sync. A key is written once (a second stage of it changes nothing);
blobs carry no checksum record: the caller's key (a hash) verifies them.

And it keeps *projection snapshots* (DESIGN.md "Projections"): opaque values under the
seq they fold up to, in their own ``snapshots`` database. ``put_snapshot`` writes one in
a transaction of its own, unsynced (durable with the next synced commit): a snapshot is a
cache that its reader verifies (:mod:`projections.snapshots`), never part of the record,
so losing one to a crash costs a longer fold, nothing else.

A reader takes LMDB's lock file (``lock.mdb``: a slot in its table of readers, created when
missing) as LMDB prescribes beside a live writer. Inside :func:`quiet_readers` (a server that
must leave what it reads untouched: ``nnx-es serve``), a read-only handle of a log that no other
process has open is opened without it and writes nothing; it raises
:class:`~events.errors.WriterAppearedError` when a process opened the log during one of its reads
(read again: the new handle takes the lock).

Opening (the checks before LMDB, the sync flags, quiet readers) is :mod:`events.lmdbenv`; the reads
inside one transaction are :mod:`events.lmdbcursor`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import lmdb

from events.chunks import RawChunk, StoredPairs, cursor_chunks
from events.errors import EventLogError, LogClosedError
from events.keys import check_items, check_keys
from events.lmdbcursor import covering, nearest, passing, stored, sum_records
from events.lmdbenv import BLOBS_DB, SNAPSHOTS_DB, check_files, open_environment, quiet_readers
from events.lmdbread import Reads
from events.logbase import EventLog, MemoryLog, LogBase, keyed, seq_key  # noqa: F401 (EventLog, MemoryLog: re-exported)
from events.sums import SUMS_DB, SumProblem, SumRecord, batch_crc, pack_sum, unpack_sum, verify

__all__ = ["EventLog", "LmdbLog", "MemoryLog", "quiet_readers", "seq_key"]

_WRITERS: dict[str, LmdbLog] = {}  # resolved path -> the writable log this process has open there


class LmdbLog(LogBase):
    """The event log of one run, in an LMDB environment (``runs/<id>/events.lmdb``).

    Args:
        path: the environment directory; created when ``readonly`` is false.
        readonly: open for reading beside a live writer; appends are refused. In the
            process that has the log open for writing (a callback reading its own run),
            the reader shares the writer's environment (LMDB allows one handle per
            process); it must not keep a read open across the writer's next flush.
        map_size: initial map size in bytes; doubled whenever a write finds it full. Default: 32 MiB
            for a writer; for a reader, the file and room to grow (:func:`events.lmdbfile.reader_map_size`).

    Raises:
        EventLogError: the directory is missing (read-only) or is not an LMDB log; reads
            raise it for a page LMDB finds corrupted.
        UnsafePathError: the directory, its ``data.mdb`` or ``lock.mdb`` is a symbolic link, or
            one of the two files is not a regular file (:mod:`events.paths`); nothing was opened.
        TruncatedLogError: its ``data.mdb`` is shorter than its pages need, or exists and is
            empty (0 bytes; refused before LMDB opens it: a writer would make it a new log).
        DamagedLogError: a meta page is damaged, or the last key is not a seq (:mod:`events.lmdbfile`).
        NewLogError: (read-only) the data file has no events database yet: its writer is creating it.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, readonly: bool = False, map_size: int | None = None
    ) -> None:
        self.path = Path(path)
        self.readonly = readonly
        check_files(self.path, readonly=readonly)
        self._shared = False
        writer = _WRITERS.get(str(self.path.resolve())) if readonly else None
        if writer is not None:  # LMDB allows one handle an environment per process: read through the writer's
            self._env, self._shared, self._reads = writer._env, True, Reads(writer._env, self.path, remap_to_file=False,
                                                                             quiet=False)
            self._events, self._sums, self._blobs = writer._events, writer._sums, writer._blobs
            self._snapshots = writer._snapshots
            super().__init__(self._reads.count(self._events))
            return
        (self._env, self._events, self._sums, self._blobs, self._snapshots,
         quiet) = open_environment(self.path, readonly=readonly, map_size=map_size)
        self._reads = Reads(self._env, self.path, remap_to_file=readonly, quiet=quiet)
        try:
            self._open_sums()
            super().__init__(self._reads.count(self._events))
        except EventLogError:
            self._env.close()
            raise
        if not readonly:
            _WRITERS[str(self.path.resolve())] = self

    def _open_sums(self) -> None:
        """Open the sums database of a read-only log when it exists (a writer may create it later)."""
        if self._sums is None:
            self._sums = self._reads.existing_db(SUMS_DB)

    @property
    def quiet(self) -> bool:
        """Whether this handle reads without LMDB's lock file (:func:`quiet_readers`, no other process there)."""
        return self._reads.quiet

    def refresh(self) -> int:
        """Re-read the stored length (a reader following a live writer); return it."""
        n = self._reads.count(self._events)
        self._flushed = self._next = n
        return n

    def flush(self, *, sync: bool = False) -> None:
        """Write the buffer and its sum record (:mod:`events.sums`) in one transaction; with ``sync`` also fsync.

        Raises:
            EventLogError: the write or its sync failed; the buffer is kept and nothing
                of it stays stored (a batch whose sync failed is taken back: it was
                never durable, so a commit marker in it must not count).
        """
        if self._closed:
            raise LogClosedError("flush on a closed event log")
        if self.readonly:
            raise EventLogError(f"event log at {self.path} is open read-only")
        if self._buffer or self._staged or self._doomed:
            # the batch's checksum record, written atomically with it (none for blobs alone)
            record = (seq_key(self._buffer[0][0]), pack_sum(self._buffer[-1][0], batch_crc(
                [raw for _, raw in self._buffer]))) if self._buffer else None
            while True:
                try:
                    with self._env.begin(write=True, db=self._events) as txn:
                        for key in self._doomed:  # retention's deletions first: a blob staged again stays
                            txn.delete(key, db=self._blobs)
                        # the blobs this write adds (a key stored before keeps its value)
                        added = {key: value for key, value in self._staged.items()
                                 if txn.put(key, value, db=self._blobs, overwrite=False)}
                        # one C call for the batch (no Python call per event); MDB_APPEND refuses a key
                        # at or below the last one stored (another writer stored it) and goes on: a refusal
                        # aborts the whole batch, never drops silently. The buffer's seqs ascend by
                        # one, so the refused ones are its first: its first seq is named.
                        buffer = self._buffer
                        consumed, added_events = txn.cursor().putmulti(keyed(buffer), append=True)
                        if added_events != consumed:
                            raise EventLogError(
                                f"write to {self.path} refused: seq {buffer[0][0]} is already stored "
                                "(another writer appended to this log)"
                            )
                        if record is not None:
                            txn.put(*record, db=self._sums)
                    break
                except lmdb.MapFullError:
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
                except lmdb.Error as exc:
                    raise EventLogError(f"write to {self.path} failed: {exc}") from exc
            batch = list(self._buffer)
            self._buffer.clear()
            self._staged.clear()
            self._doomed.clear()
            self._flushed = self._next
        else:
            batch, added = [], {}
        if sync:
            try:
                self._env.sync(True)
            except lmdb.Error as exc:
                raise EventLogError(f"sync of {self.path} failed: {exc}{self._take_back(batch, added)}") from exc
            self._syncs += 1

    def _take_back(self, batch: list[tuple[int, bytes]], blobs: dict[bytes, bytes]) -> str:
        """Delete ``batch`` and the ``blobs`` its write added (their sync failed: never trusted) and
        buffer / stage them again; return a note for the error."""
        if not batch and not blobs:
            return ""
        what = f"events {batch[0][0]}..{batch[-1][0]}" if batch else "events (none)"
        what += f" and {len(blobs)} blob(s)" if blobs else ""
        try:
            with self._env.begin(write=True, db=self._events) as txn:
                for seq, _ in batch:
                    txn.delete(seq_key(seq))
                if batch:
                    txn.delete(seq_key(batch[0][0]), db=self._sums)  # its sum record goes with it
                for key in blobs:
                    txn.delete(key, db=self._blobs)
        except lmdb.Error as exc:
            return f"; taking back its unsynced {what} failed too: {exc}"
        self._buffer[:0] = batch
        if batch:
            self._flushed = batch[0][0]
        self._staged = {**blobs, **self._staged}
        return f"; its unsynced {what} were taken back"

    def read_raw(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, bytes]]:
        """Yield ``(seq, raw bytes)`` of stored values in key order, ``start <= seq < stop``.

        Keys are yielded as stored: a gap in the sequence shows as a jump in seq. A key out of
        order (a changed key: bit rot) is yielded as stored too, never taken for the end of the
        range: a bounded read ends at the first key at or past ``stop`` that is in order
        (:func:`events.chunks.ends_read`), so no entry after a damaged key is dropped silently.
        :meth:`check_keys` names such a key.
        """
        if self._closed:
            raise LogClosedError("read on a closed event log")
        with self._reads.txn() as txn:
            yield from stored(txn, self._events, start, stop)

    def read_chunks(self, start: int = 0, stop: int | None = None) -> Iterator[RawChunk]:
        """Yield the stored values with ``start <= seq < stop`` as ``(first_seq, values)`` chunks.

        Values are taken ``read_chunk`` at a time in one C-level pass over the cursor,
        without their keys: a chunk's seqs follow from the key before it and its last
        key. A chunk whose last key is not that many past the one before it (a gap, a
        duplicate or a key out of order at its end) gets the keys of its own entries
        (the cursor walks back over them) and is split where they do not run on, as
        :meth:`read_raw` yields them: no value is dropped or repeated. A changed key
        inside a chunk whose ends still agree is not seen (its values get the seqs of
        their positions): :meth:`check_keys` reads every key. A key out of order at or past
        ``stop`` does not end the read, as in :meth:`read_raw`.

        Raises:
            EventLogError: LMDB refused a read (a corrupted page).
        """
        if self._closed:
            raise LogClosedError("read on a closed event log")
        with self._reads.txn() as txn:
            yield from cursor_chunks(txn.cursor(self._events), start, stop, self.read_chunk)

    def check_keys(
        self, start: int = 0, stop: int | None = None, *, each_chunk: Callable[[int, list[bytes]], None] | None = None,
    ) -> int:
        """Check that the stored keys are 0, 1, 2, ... in stored order; return how many there are.

        With ``start`` / ``stop``: only the keys of the entries from the first at or past
        ``start`` (it must be ``start``), at most ``stop - start`` of them, are read (a reader
        folding from a snapshot checks the keys it folds); the count returned is theirs.

        One key-only pass of the cursor (no value is read; ``events.keys``): about
        0.1 µs a key. With ``each_chunk``, the values are read in the same pass and handed on a
        chunk (:attr:`read_chunk` values) at a time, each once its keys are checked
        (:func:`events.keys.check_items`: a reader that checks both pays for one cursor pass).

        Raises:
            SequenceGapError: naming the first key out of place, the seq due there and the
                key before it (a gap, a duplicate, a key out of order).
            EventLogError: LMDB refused a read (a corrupted page).
        """
        if self._closed:
            raise LogClosedError("read on a closed event log")
        with self._reads.txn() as txn:
            cur = txn.cursor(self._events)
            if start > 0 and not cur.set_range(seq_key(start)):
                return 0
            keys = cur.iternext(keys=True, values=each_chunk is not None)
            if stop is not None:
                keys = itertools.islice(keys, max(stop - start, 0))
            if each_chunk is not None:
                return check_items(keys, each_chunk, start, self.read_chunk)  # type: ignore[arg-type]
            return check_keys(keys, start)

    def read(
        self, start: int = 0, stop: int | None = None, kinds: Iterable[str] | None = None
    ) -> StoredPairs:
        """The ``(seq, event)`` pairs of stored events with ``start <= seq < stop``, in seq order.

        Values are read and decoded a chunk at a time (:meth:`read_chunks`, one msgspec
        call per chunk); :func:`projections.view.project` takes the chunks undecoded.

        Raises:
            CorruptEventError: a value does not decode (names its seq).
        """
        return StoredPairs(self.read_chunks(start, stop), kinds)

    def read_sums(self, start: int = 0, stop: int | None = None) -> Iterator[SumRecord]:
        """Yield the sum records (:mod:`events.sums`) whose first seq is in ``[start, stop)``, in seq order.

        None for a log written before checksums existed.
        """
        if self._closed:
            raise LogClosedError("read on a closed event log")
        self._open_sums()  # before the transaction: a database opened during one is not valid in it
        with self._reads.txn() as txn:
            yield from sum_records(txn, self._sums, start, stop)

    def verify_sums(
        self, stop: int | None = None, *, start: int = 0,
        each_chunk: Callable[[int, list[bytes]], None] | None = None,
    ) -> Iterator[SumProblem]:
        """Yield the ranges of stored values with seq < ``stop`` that do not verify (:func:`events.sums.verify`).

        ``start``: verify only from the sum record that covers seq ``start`` (the last one whose
        first seq is at or before it; with none, from ``start``, its values uncovered) on: a reader
        that folds from a snapshot verifies the values it folds, O(those) not O(log).

        One read transaction: the sum records and the values (:meth:`read_chunks`' reading)
        are one snapshot, so a live writer's batches are seen whole or not at all.

        ``each_chunk(first_seq, values)``: called with each chunk of values read (every value
        below ``stop``, in seq order, once) before its checksum is accumulated, so a reader that
        needs the values too (the audit, :mod:`nnx_es.audit.segments`) reads them once. Its
        exceptions end the read and propagate. The problems are the same with it or without.

        Raises:
            EventLogError: LMDB refused a read (a corrupted page).
        """
        if self._closed:
            raise LogClosedError("read on a closed event log")
        self._open_sums()  # before the transaction: a database opened during one is not valid in it
        with self._reads.txn() as txn:
            begin = covering(txn, self._sums, start) if start > 0 else 0
            chunks = cursor_chunks(txn.cursor(self._events), begin, stop, self.read_chunk)
            if each_chunk is not None:
                chunks = passing(chunks, each_chunk)
            yield from verify(sum_records(txn, self._sums, begin, stop), chunks, stop)

    def put_snapshot(self, seq: int, value: bytes) -> None:
        """Store the projection snapshot ``value`` under ``seq`` (replacing one there), in one unsynced
        transaction of its own (see the module docstring).

        Raises:
            EventLogError: the log is read-only, or the write failed (nothing of it is stored).
        """
        if self._closed:
            raise LogClosedError("put_snapshot on a closed event log")
        if self.readonly:
            raise EventLogError(f"event log at {self.path} is open read-only")
        while True:
            try:
                with self._env.begin(write=True, db=self._snapshots) as txn:
                    txn.put(seq_key(seq), value)
                return
            except lmdb.MapFullError:
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
            except lmdb.Error as exc:
                raise EventLogError(f"write of a snapshot to {self.path} failed: {exc}") from exc

    def read_snapshots(self, stop: int | None = None, *, newest_first: bool = True) -> Iterator[tuple[int, bytes]]:
        """Yield ``(seq, value)`` of the stored snapshots with ``seq < stop``, newest first (or oldest first).

        Each value is read in its own short transaction (a reader taking the newest
        usable one reads one or two). None for a log written before snapshots existed.

        Raises:
            EventLogError: LMDB refused a read (a corrupted page).
        """
        if self._closed:
            raise LogClosedError("read on a closed event log")
        if self._snapshots is None:
            self._snapshots = self._reads.existing_db(SNAPSHOTS_DB)
            if self._snapshots is None:
                return
        end = (1 << 64) - 1 if stop is None else stop
        key = seq_key(end) if newest_first else seq_key(0)  # where the next one is looked for
        while True:
            with self._reads.txn() as txn:
                found = nearest(txn, self._snapshots, key, below=newest_first)
            if found is None:
                return
            found_key, value = found
            seq = int.from_bytes(found_key, "big")
            if seq >= end:
                return
            yield seq, value
            key = found_key if newest_first else seq_key(seq + 1)

    def put_snapshot_raw(self, seq: int, value: bytes | None) -> None:
        """Overwrite, add or (``None``) delete a stored snapshot (tests use it to forge damaged ones)."""
        with self._env.begin(write=True, db=self._snapshots) as txn:
            if value is None:
                txn.delete(seq_key(seq))
            else:
                txn.put(seq_key(seq), value)

    def put_raw(self, seq: int, raw: bytes) -> None:
        """Store ``raw`` under ``seq`` directly (tests use it to forge broken logs).

        The log is forged as its writer would have written it: the sum record covering
        ``seq`` is recomputed, and a value stored past every record gets one of its own
        (to forge a changed byte on disk, change ``data.mdb`` itself).
        """
        with self._env.begin(write=True, db=self._events) as txn:
            txn.put(seq_key(seq), raw)
            record = nearest(txn, self._sums, seq_key(seq + 1), below=True)
            if record is None:
                return  # before every record (written before checksums): stays uncovered
            first, last, _ = unpack_sum(*record)
            if last < seq:
                first = last = seq
            values = [v for _, v in stored(txn, self._events, first, last + 1)]
            txn.put(seq_key(first), pack_sum(last, batch_crc(values)), db=self._sums)

    def get_blob(self, key: bytes) -> bytes | None:
        """The stored (flushed) blob under ``key``, or None (also for a log older than blobs).

        Raises:
            EventLogError: LMDB found the page holding it corrupted.
        """
        if self._closed:
            raise LogClosedError("read on a closed event log")
        if self._blobs is None:
            self._blobs = self._reads.existing_db(BLOBS_DB)  # a writer may have created it since
            if self._blobs is None:
                return None
        with self._reads.txn() as txn:
            value = txn.get(bytes(key), db=self._blobs)
        return None if value is None else bytes(value)

    def delete_blobs(self, keys: list[bytes]) -> None:
        """Delete stored blobs with the next flush, in its transaction (retention: no write of their
        own; unsynced: a crash may leave them, which is harmless, since a durable ``checkpoint_pruned``
        already says they are gone on purpose). Missing keys are ignored."""
        if self._closed:
            raise LogClosedError("delete_blobs on a closed event log")
        if self.readonly:
            raise EventLogError(f"event log at {self.path} is open read-only")
        if keys and self._blobs is not None:
            self._doomed.extend(bytes(key) for key in keys)

    def put_blob_raw(self, key: bytes, value: bytes | None) -> None:
        """Overwrite, add or (``None``) delete a stored blob (tests use it to forge damaged ones)."""
        with self._env.begin(write=True, db=self._blobs) as txn:
            if value is None:
                txn.delete(bytes(key))
            else:
                txn.put(bytes(key), value)

    def delete_raw(self, seq: int) -> None:
        """Delete the value under ``seq`` (tests use it to forge a sequence gap)."""
        with self._env.begin(write=True, db=self._events) as txn:
            txn.delete(seq_key(seq))

    def map_size(self) -> int:
        """The environment's current map size in bytes."""
        return int(self._env.info()["map_size"])

    def close(self) -> None:
        if not self._closed and not self._shared:
            if _WRITERS.get(str(self.path.resolve())) is self:
                del _WRITERS[str(self.path.resolve())]
            self._env.close()
        super().close()

