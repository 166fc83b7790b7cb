"""What a rank that is not the writer records into: an in-memory log and blob store.

Only the writer rank holds the lease and writes ``runs/`` (spec 000 §3 "One writer"). Every
other rank folds the same lifecycle events through its own :class:`~nnx_es.runtime.recording.Recorder`
-- so its machine, counters and projections decide alike -- over a
:class:`~events.logbase.MemoryLog`, and keeps the checkpoint blobs its committer forms in a
:class:`FollowerBlobStore` in memory: it never creates, reads or writes a file of the run.

A history journal's chunks are not kept here at all (:class:`NamingBlobStore`): a follower only names them.
Memory stays bounded by the run's retention (``keep_last``/``keep_best``): a pruned checkpoint's
blobs are deleted here as the writer deletes its files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from collections.abc import Iterator

from events.logbase import LogBase, MemoryLog
from nnx_es.errors import CorruptCheckpointError
from nnx_es.storage import BlobStore

__all__ = ["FollowerBlobStore", "FollowerLog", "NamingBlobStore"]


class FollowerLog(MemoryLog):
    """The event log of a rank that is not the writer: sequenced like the writer's (it starts at
    ``next_seq``, the writer's next seq), in memory, and it keeps no event once flushed (bounded
    memory: the writer's log is the record; a follower only folds the events as they pass).
    Reading it yields nothing."""

    def __init__(self, next_seq: int = 0) -> None:
        LogBase.__init__(self, next_seq)
        self._stored: list[bytes] = []
        self._blobs: dict[bytes, bytes] = {}
        self._snapshots: dict[int, bytes] = {}

    def put_snapshot(self, seq: int, value: bytes) -> None:
        """Nothing: projection snapshots are the writer's log's cache."""

    def flush(self, *, sync: bool = False) -> None:
        self._buffer.clear()
        self._staged.clear()
        self._flushed = self._next
        if sync:
            self._syncs += 1

    def read_raw(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, bytes]]:
        return iter(())


class FollowerBlobStore(BlobStore):
    """A :class:`~nnx_es.storage.BlobStore` in memory: the same names (SHA-256), no file.

    ``root`` is the writer's blob directory, named in messages only: nothing is created there.
    """

    def __init__(self, root: Path) -> None:
        super().__init__(root, log=None)
        self._blobs: dict[str, bytes] = {}

    def stage(self, data: bytes, digest: str | None = None) -> str:
        if digest is None:
            return self.put(data)
        self._blobs.setdefault(digest, data)
        return digest

    def put_all(self, datas: Sequence[bytes], digests: Sequence[str] | None = None) -> list[str]:
        digests = list(digests) if digests is not None else [hashlib.sha256(d).hexdigest() for d in datas]
        for digest, data in zip(digests, datas):
            self._blobs.setdefault(digest, data)
        return digests

    def delete(self, digests: Sequence[str]) -> None:
        for digest in digests:
            self._blobs.pop(digest, None)

    def exists(self, digest: str) -> bool:
        return digest in self._blobs

    def get(self, digest: str, *, size: int | None = None) -> bytes:
        data = self._blobs.get(digest)
        if data is None:
            raise CorruptCheckpointError(f"blob {digest} is not held by this rank (only the writer rank stores "
                                         f"checkpoints, under {self.root})")
        return data


class NamingBlobStore(FollowerBlobStore):
    """A follower's store for blobs only the writer keeps (a history journal's chunks and manifests):
    it names each blob (SHA-256), as the writer's store does, and keeps none -- the follower's
    journal events carry the same names with no memory of the chunks.

    Raises:
        CorruptCheckpointError: from :meth:`get` (nothing is held here).
    """

    def stage(self, data: bytes, digest: str | None = None) -> str:
        return digest if digest is not None else hashlib.sha256(data).hexdigest()

    def put_all(self, datas: Sequence[bytes], digests: Sequence[str] | None = None) -> list[str]:
        return list(digests) if digests is not None else [hashlib.sha256(d).hexdigest() for d in datas]
