"""The history journal: per-row records as immutable, content-addressed columnar chunks.

``Trainer(history=HistoryJournal(window=N, chunk_rows=M))`` (spec 000 "Lifecycle order", the
history journal). At each epoch's history step, before ``history_appended`` and LAST::

    the epoch's records (sorted by row id), per split, cut into chunks of at most M rows
    -> each chunk a blob (runs/<id>/blobs/sha256/<hash>: fsync'd file, atomic rename)
    -> the epoch's manifest, a blob naming its chunks with their first and last row id (the index)
       and the previous epoch's manifest
    -> journal_published(epoch, manifest)                 (buffered; durable with the epoch's LAST)

Readers (:func:`nnx_es.rows.read_rows`) trust a manifest only when the epoch's LAST commits its
``journal_published``: a crash between the chunks, the manifest and LAST leaves files no
committed event names (an ignored tail), and a failed LAST leaves the previous epoch's manifest
the newest committed one -- the next publication (a resume's) chains to it again. Chunks live in
the run's own blob store, so a continuation writes its own chunks, never its source's.
Memory: the trainer holds at most ``window`` epochs' records (plus the epoch being recorded).
``tools/replay`` verifies every committed manifest and chunk (:func:`verify_manifest`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import msgspec
import numpy as np

from events.schema import JournalPublished
from nnx_es.errors import ConfigError, CorruptCheckpointError
from nnx_es.rows.columns import SPLITS, EpochRows, Part
from nnx_es.storage import BlobStore

__all__ = ["ChunkRef", "HistoryJournal", "JournalChunk", "JournalManifest", "JournalPart", "RunJournal",
           "check_history", "manifest_parts", "read_manifest", "verify_manifest"]


class ChunkRef(msgspec.Struct, frozen=True, kw_only=True):
    """One chunk blob: its SHA-256 (hex), its first and last row id, and its record count."""

    blob: str
    first: int
    last: int
    rows: int


class JournalPart(msgspec.Struct, frozen=True, kw_only=True):
    """One split of an epoch: its records (count) and chunks, in row id order."""

    split: str
    rows: int
    chunks: list[ChunkRef]


class JournalManifest(msgspec.Struct, frozen=True, kw_only=True, tag="journal_manifest"):
    """One epoch's journal manifest (a blob). previous: the manifest of the epoch before, or ``""``."""

    run_id: str
    epoch: int
    previous: str
    parts: list[JournalPart]
    version: int = 1


class JournalChunk(msgspec.Struct, frozen=True, kw_only=True, tag="journal_chunk"):
    """At most ``chunk_rows`` records of one epoch and split, as columns (:mod:`nnx_es.rows.columns`)."""

    epoch: int
    split: str
    rows: int
    columns: dict[str, bytes]


_enc = msgspec.msgpack.Encoder()
_manifest_dec = msgspec.msgpack.Decoder(JournalManifest)
_chunk_dec = msgspec.msgpack.Decoder(JournalChunk)


class HistoryJournal:
    """Opt-in storage of per-row records in chunks (see the module docstring): the settings a
    trainer keeps; each fit writes through a :class:`RunJournal` of its own (:meth:`open`).

    Args:
        window: epochs of records the trainer keeps in memory (``ctx.idps``), >= 1.
        chunk_rows: records per chunk blob, >= 1 (a chunk of float32 columns takes 28 bytes a row).

    Raises:
        ConfigError: ``window`` or ``chunk_rows`` is not an int >= 1.
    """

    def __init__(self, window: int = 1, chunk_rows: int = 65536) -> None:
        for name, value in (("window", window), ("chunk_rows", chunk_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"HistoryJournal({name}=...) must be an int >= 1, got {value!r}")
        self.window = window
        self.chunk_rows = chunk_rows

    def __repr__(self) -> str:
        return f"HistoryJournal(window={self.window}, chunk_rows={self.chunk_rows})"

    def open(self, store: BlobStore, run_id: str, committed: Sequence[tuple[int, str]]) -> RunJournal:
        """This journal for one run: written into ``store`` for run ``run_id``, after the run's committed
        publications ``committed`` (a resume's; none for a new run)."""
        return RunJournal(store, run_id, committed, chunk_rows=self.chunk_rows)


def check_history(history: object) -> HistoryJournal | None:
    """``history`` (a trainer's argument) when it is a :class:`HistoryJournal` or None.

    Raises:
        ConfigError: anything else.
    """
    if history is not None and not isinstance(history, HistoryJournal):
        raise ConfigError(f"history must be a nnx_es.rows.HistoryJournal or None, got {history!r}")
    return history


class RunJournal:
    """One run's history journal (one fit's, built by :meth:`HistoryJournal.open`): the chunks and
    manifests it publishes into ``store`` for ``run_id``, chained to the publications it knows."""

    def __init__(self, store: BlobStore, run_id: str, committed: Sequence[tuple[int, str]], *,
                 chunk_rows: int) -> None:
        self.store = store
        self.run_id = run_id
        self.chunk_rows = chunk_rows
        #: (epoch, manifest) of every publication of this run the trainer knows, oldest first
        self.published: list[tuple[int, str]] = list(committed)

    @property
    def head(self) -> str:
        """The newest published manifest (``""`` before the first)."""
        return self.published[-1][1] if self.published else ""

    def publish(self, epoch: int, parts: Sequence[EpochRows]) -> JournalPublished:
        """Write the epoch's chunks, then its manifest (both durable files); return the event to append.

        Raises:
            CheckpointWriteError: a blob could not be written (nothing is published).
        """
        store = self.store
        datas: list[bytes] = []
        layout: list[tuple[str, int, list[tuple[int, int, int]]]] = []
        for part in parts:
            spans = []
            for start in range(0, part.rows, self.chunk_rows):
                piece = part.slice(start, min(start + self.chunk_rows, part.rows))
                datas.append(_enc.encode(JournalChunk(epoch=epoch, split=part.split, rows=piece.rows,
                                                      columns=piece.encode())))
                spans.append((int(piece.row_id[0]), int(piece.row_id[-1]), piece.rows))
            layout.append((part.split, part.rows, spans))
        digests = iter(store.put_all(datas))  # the chunks are durable before the manifest names them
        manifest = JournalManifest(run_id=self.run_id, epoch=epoch, previous=self.head, parts=[
            JournalPart(split=split, rows=rows, chunks=[ChunkRef(blob=next(digests), first=f, last=last, rows=n)
                                                        for f, last, n in spans])
            for split, rows, spans in layout
        ])
        digest = store.put(_enc.encode(manifest))
        event = JournalPublished(epoch=epoch, manifest=digest, previous=self.head,
                                 rows=sum(p.rows for p in parts), chunks=len(datas))
        # a previous publication whose LAST failed ended the run, so every one before this is committed
        self.published.append((epoch, digest))
        return event

    def parts(self) -> list[Part]:
        """Lazy parts of every publication this journal knows (see :func:`manifest_parts`)."""
        return [p for _, digest in self.published for p in manifest_parts(self.store, digest)]


def read_manifest(store: BlobStore, digest: str) -> JournalManifest:
    """Read and verify a journal manifest blob.

    Raises:
        CorruptCheckpointError: the blob is missing, does not hash to ``digest``, or is not a manifest.
    """
    data = store.get(digest)
    try:
        return _manifest_dec.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptCheckpointError(f"journal manifest {digest} does not decode: {exc}") from None


def _read_chunk(store: BlobStore, ref: ChunkRef, epoch: int, split: str) -> EpochRows:
    data = store.get(ref.blob)
    try:
        chunk = _chunk_dec.decode(data)
    except msgspec.DecodeError as exc:
        raise CorruptCheckpointError(f"journal chunk {ref.blob} does not decode: {exc}") from None
    if (chunk.epoch, chunk.split, chunk.rows) != (epoch, split, ref.rows):
        raise CorruptCheckpointError(
            f"journal chunk {ref.blob} holds epoch {chunk.epoch} {chunk.split} ({chunk.rows} rows), its manifest "
            f"names epoch {epoch} {split} ({ref.rows} rows)")
    rows = EpochRows.decode(epoch, split, chunk.rows, chunk.columns)
    if rows.rows and (int(rows.row_id[0]), int(rows.row_id[-1])) != (ref.first, ref.last):
        raise CorruptCheckpointError(f"journal chunk {ref.blob} spans row ids {int(rows.row_id[0])}.."
                                     f"{int(rows.row_id[-1])}, its manifest says {ref.first}..{ref.last}")
    return rows


def manifest_parts(store: BlobStore, digest: str) -> list[Part]:
    """One lazy :class:`~nnx_es.rows.columns.Part` per split of a manifest: ``load()`` reads (and
    verifies) every chunk, ``find(row_id)`` only the chunk whose row id range holds it.

    Raises:
        CorruptCheckpointError: the manifest does not verify (chunks raise when loaded).
    """
    manifest = read_manifest(store, digest)
    out = []
    for part in manifest.parts:
        refs, epoch, split = part.chunks, manifest.epoch, part.split

        def load(refs: list[ChunkRef] = refs, epoch: int = epoch, split: str = split) -> EpochRows:
            pieces = [_read_chunk(store, r, epoch, split) for r in refs]
            if not pieces:
                return EpochRows(epoch, split, np.empty(0, np.int64), np.empty((5, 0), np.float32))
            return EpochRows(epoch, split, np.concatenate([p.row_id for p in pieces]),
                             np.concatenate([p.values for p in pieces], axis=1))

        def find(row_id: int, refs: list[ChunkRef] = refs, epoch: int = epoch, split: str = split) -> EpochRows | None:
            i = bisect.bisect_right([r.first for r in refs], row_id) - 1
            if i < 0 or row_id > refs[i].last:
                return None
            return _read_chunk(store, refs[i], epoch, split)

        out.append(Part(epoch, split, part.rows, load, find))
    return out


def verify_manifest(store: BlobStore, digest: str, *, epoch: int, previous: str) -> list[str]:
    """What is wrong with a committed publication: its manifest, its chunks, its place in the chain.

    Returns one sentence per problem (empty: it verifies). Reads every chunk (SHA-256 checked).
    """
    try:
        manifest = read_manifest(store, digest)
    except CorruptCheckpointError as exc:
        return [str(exc)]
    problems = []
    if manifest.epoch != epoch:
        problems.append(f"journal manifest {digest} is of epoch {manifest.epoch}, its journal_published says {epoch}")
    if manifest.previous != previous:
        problems.append(f"journal manifest {digest} chains to {manifest.previous!r}, the event says {previous!r}")
    for part in manifest.parts:
        if part.split not in SPLITS:
            problems.append(f"journal manifest {digest} names an unknown split {part.split!r}")
            continue
        if sum(r.rows for r in part.chunks) != part.rows:
            problems.append(f"journal manifest {digest}: the {part.split} chunks hold {sum(r.rows for r in part.chunks)}"
                            f" rows, the manifest says {part.rows}")
        last = None
        for ref in part.chunks:
            try:
                rows = _read_chunk(store, ref, manifest.epoch, part.split)
            except CorruptCheckpointError as exc:
                problems.append(str(exc))
                continue
            if rows.rows > 1 and not bool(np.all(np.diff(rows.row_id) > 0)):
                problems.append(f"journal chunk {ref.blob}: row ids are not strictly increasing")
            if last is not None and ref.first <= last:
                problems.append(f"journal chunk {ref.blob} starts at row id {ref.first}, not after {last}")
            last = ref.last
    return problems
