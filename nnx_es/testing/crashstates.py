"""The states a disk may hold after a power cut, built from a trace of persistence operations.

In the spirit of ALICE (Pillai et al., "All File Systems Are Not Created Equal", OSDI '14):
replay the recorded calls (:mod:`nnx_es.testing.tracer`) against a model of a file system and,
at each *persistence point* -- each ``fsync``/``fdatasync`` of a file or a directory, and each
write through an ``O_SYNC``/``O_DSYNC`` descriptor -- construct states a cut after it (and
before the next one) may leave. The model is ext4 with ``data=ordered``, taken strictly (the
POSIX guarantees, not ext4's extra ones), as ALICE's abstract persistence models and
CrashMonkey's (OSDI '18) ``fsync``-bounded workloads do; SQLite's crash-test VFS makes the same
cuts at the sector level:

* a file's data writes and truncations are durable once that file is fsynced (``fsync`` or
  ``fdatasync``); until then each dirty 4 KiB page of the page cache may reach the disk in any
  version it held (none, or its content after any of the writes that touched it) independently
  of the other pages -- so LMDB's meta page may arrive without the data pages it points at, or
  the reverse -- and a page may be torn at 512-byte sectors (some sectors new, the rest old);
  the file's size may be any it had since the sync (bytes past the durable end that no kept
  page covers read as zeros);
* a directory-entry operation (create, rename, unlink, mkdir, rmdir) is durable once its
  directory is fsynced (a rename: the destination's directory); the others persist as a prefix
  of their issue order (a journaling file system commits metadata in order), possibly empty.

Every state keeps everything synced. A bounded sample is drawn per point with a seed: the
state with nothing unsynced kept, the state with everything kept (what a process kill leaves),
and random mixtures; identical states are generated once.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nnx_es.errors import NnxError
from nnx_es.testing.tracer import Op

__all__ = ["CrashState", "TraceError", "crash_states", "persistence_points"]

PAGE = 4096  # bytes: the page cache's unit of writeback
SECTOR = 512  # bytes: what a disk writes atomically
_SYNC_FLAGS = os.O_SYNC | os.O_DSYNC


class TraceError(NnxError, ValueError):
    """The trace holds something the model cannot replay (a shared writable mmap, a rename across
    the traced root, a path that was never created under it)."""


@dataclass(frozen=True)
class CrashState:
    """One state a power cut may leave. point: the 0-based persistence point it follows; where:
    the sync that point is (``fdatasync of events.lmdb/data.mdb``); files: relative path ->
    bytes (directories: ``None``); committed_events: events the log had durably committed (a
    synced flush had returned) before the next persistence point; digest: of the whole state."""

    point: int
    where: str
    files: dict[str, bytes | None]
    committed_events: int
    digest: str

    def write(self, dest: Path) -> None:
        """Create the state's directories and files under ``dest`` (created if missing: the traced root
        existed before the trace, so every state has it, empty or not)."""
        dest.mkdir(parents=True, exist_ok=True)
        for rel, data in sorted(self.files.items()):
            p = dest / rel
            if data is None:
                p.mkdir(parents=True, exist_ok=True)
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)


class _File:
    def __init__(self, ino: int, is_dir: bool) -> None:
        self.ino, self.is_dir = ino, is_dir
        self.live = bytearray()
        self.durable = b""
        self.pending: list[tuple[int, int, bytes]] = []  # (offset, new length or -1, data): since the last sync


class _Model:
    """The replay: inodes with live and durable content; directory-entry operations in order."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.files: dict[int, _File] = {0: _File(0, True)}
        self.names: dict[str, int] = {self.root: 0}  # live namespace: absolute path -> inode
        self.meta: list[tuple[str, str, str, int]] = []  # (op, path, path2, inode) in issue order
        self.meta_durable: list[bool] = []
        self.fds: dict[int, tuple[int, bool]] = {}  # fd -> (inode, writes are synced)
        self.marked = 0

    def _new(self, is_dir: bool) -> int:
        ino = len(self.files)
        self.files[ino] = _File(ino, is_dir)
        return ino

    def _meta(self, op: str, path: str, path2: str = "", ino: int = -1) -> None:
        self.meta.append((op, path, path2, ino))
        self.meta_durable.append(False)

    def apply(self, op: Op) -> tuple[int, str] | None:
        """Replay one call; when it is a persistence point return ``(inode, description)`` of the sync
        it makes, which the caller performs with :meth:`sync` (after drawing the states before it)."""
        if op.op == "open":
            ino = self.names.get(op.path)
            if ino is None:
                if not op.arg:
                    return None  # a read of something that is not ours (or already gone)
                ino = self._new(False)
                self.names[op.path] = ino
                self._meta("create", op.path, ino=ino)
            elif op.flags & os.O_TRUNC and op.flags & (os.O_WRONLY | os.O_RDWR):
                self._data(ino, 0, 0, b"")
            self.fds[op.fd] = (ino, bool(op.flags & _SYNC_FLAGS))
        elif op.op == "close":
            self.fds.pop(op.fd, None)
        elif op.op in ("write", "truncate"):
            bound = self.fds.get(op.fd)
            if bound is None:
                raise TraceError(f"trace writes fd {op.fd}, which no traced open bound")
            ino, synced = bound
            if op.op == "write":
                self._data(ino, op.offset, -1, op.data)
            else:
                self._data(ino, 0, op.arg, b"")
            if synced:
                return ino, f"O_DSYNC write of {self._name(ino)}"
        elif op.op in ("fsync", "fdatasync"):
            bound = self.fds.get(op.fd)
            if bound is not None:
                return bound[0], f"{op.op} of {self._name(bound[0])}"
        elif op.op in ("mkdir", "unlink", "rmdir", "rename"):
            if op.op == "mkdir":
                ino = self._new(True)
                self.names[op.path] = ino
            elif op.op == "rename":
                ino = self.names.pop(op.path, -1)
                if ino < 0:
                    raise TraceError(f"trace renames {op.path}, which was never created under the traced root")
                prefix = op.path + "/"
                for name in [n for n in self.names if n.startswith(prefix)]:
                    self.names[op.path2 + name[len(op.path):]] = self.names.pop(name)
                self.names[op.path2] = ino
            else:
                ino = self.names.pop(op.path, -1)
            self._meta(op.op, op.path, op.path2, ino)
        elif op.op == "mark":
            self.marked = max(self.marked, op.arg)
        elif op.op == "unsupported":
            raise TraceError(f"the power-loss model cannot replay {op.path2} on {op.path}")
        return None

    def _name(self, ino: int) -> str:
        name = next((n for n, i in self.names.items() if i == ino), None)
        return f"(removed inode {ino})" if name is None else os.path.relpath(name, self.root)

    def _data(self, ino: int, offset: int, length: int, data: bytes) -> None:
        f = self.files[ino]
        if length >= 0:
            del f.live[length:]
            f.live.extend(bytes(length - len(f.live)))
        else:
            end = offset + len(data)
            if end > len(f.live):
                f.live.extend(bytes(end - len(f.live)))
            f.live[offset:end] = data
        f.pending.append((offset, length, data))

    def sync(self, ino: int) -> None:
        """Make what the inode holds durable: a file's data, a directory's entries (issued so far)."""
        f = self.files[ino]
        if f.is_dir:
            path = next((n for n, i in self.names.items() if i == ino), None)  # None: a removed directory
            for k, (op, p, p2, _) in enumerate(self.meta):
                if os.path.dirname(p2 if op == "rename" else p) == path:
                    self.meta_durable[k] = True
        else:
            f.durable = bytes(f.live)
            f.pending.clear()

    # --- one state -----------------------------------------------------------------------

    def state(self, rng: random.Random | None, mode: str) -> dict[str, bytes | None]:
        """The tree a cut may leave: ``mode`` ``"synced"`` (nothing unsynced kept), ``"all"``
        (everything kept) or ``"random"`` (drawn from ``rng``)."""
        loose = [k for k, d in enumerate(self.meta_durable) if not d]
        keep = {"synced": 0, "all": len(loose)}.get(mode)
        if keep is None:
            keep = rng.randint(0, len(loose)) if rng else 0  # type: ignore[union-attr]
        applied = set(loose[:keep])
        names: dict[str, int] = {self.root: 0}
        for k, (op, p, p2, ino) in enumerate(self.meta):
            if not (self.meta_durable[k] or k in applied):
                continue
            if op in ("create", "mkdir"):
                names.setdefault(p, ino)
            elif op in ("unlink", "rmdir"):
                names.pop(p, None)
            elif op == "rename" and p in names:
                moved = names.pop(p)
                for name in [n for n in names if n.startswith(p + "/")]:
                    names[p2 + name[len(p):]] = names.pop(name)
                names[p2] = moved
        tree: dict[str, bytes | None] = {}
        contents: dict[int, bytes] = {}
        for path, ino in names.items():
            if ino == 0 or not _reachable(path, names, self.root):
                continue
            f = self.files[ino]
            if f.is_dir:
                tree[os.path.relpath(path, self.root)] = None
            else:
                if ino not in contents:
                    contents[ino] = _content(f, rng, mode)
                tree[os.path.relpath(path, self.root)] = contents[ino]
        return tree


def _reachable(path: str, names: dict[str, int], root: str) -> bool:
    """Whether every directory above ``path`` (up to the root) has a durable entry."""
    parent = os.path.dirname(path)
    while parent != root:
        if parent not in names:
            return False
        parent = os.path.dirname(parent)
    return True


def _content(f: _File, rng: random.Random | None, mode: str) -> bytes:
    """A file's bytes after a cut: durable content, then per dirty page one version, maybe torn."""
    if not f.pending or mode == "synced":
        return f.durable
    if mode == "all":
        return bytes(f.live)
    assert rng is not None
    work = bytearray(f.durable)
    versions: dict[int, list[bytes]] = {}  # page index -> contents after each op touching it
    sizes = [len(work)]
    for offset, length, data in f.pending:
        if length >= 0:
            first, last = min(length, len(work)) // PAGE, max(length, len(work)) // PAGE
            del work[length:]
            work.extend(bytes(length - len(work)))
        else:
            end = offset + len(data)
            if end > len(work):
                work.extend(bytes(end - len(work)))
            work[offset:end] = data
            first, last = offset // PAGE, max(end - 1, offset) // PAGE
        for page in range(first, last + 1):
            versions.setdefault(page, []).append(bytes(work[page * PAGE:(page + 1) * PAGE]))
        sizes.append(len(work))
    size = rng.choice(sizes)
    out = bytearray(f.durable[:size])
    out.extend(bytes(size - len(out)))
    for page, kept in versions.items():
        start = page * PAGE
        if start >= size:
            continue
        pick = rng.randrange(len(kept) + 1)  # 0: the page never left the cache
        if pick == 0:
            continue
        new = kept[pick - 1]
        old = bytes(out[start:start + PAGE])
        if rng.random() < 0.25:  # torn: the cut fell while the page was being written
            sectors = [rng.random() < 0.5 for _ in range(PAGE // SECTOR)]
            new = b"".join((new if s else old)[i * SECTOR:(i + 1) * SECTOR] for i, s in enumerate(sectors))
        end = min(start + PAGE, size)
        out[start:end] = new[:end - start].ljust(end - start, b"\0")
    return bytes(out)


def persistence_points(ops: list[Op], root: str) -> list[str]:
    """The persistence points of a trace, in order (a description of each).

    Raises:
        TraceError: the trace cannot be replayed (see :class:`TraceError`).
    """
    model = _Model(root)
    points = []
    for op in ops:
        if (sync := model.apply(op)) is not None:
            model.sync(sync[0])
            points.append(sync[1])
    return points


def _digest(tree: dict[str, bytes | None]) -> str:
    h = hashlib.sha256()
    for rel, data in sorted(tree.items()):
        h.update(rel.encode() + b"\0" + (b"d" if data is None else hashlib.sha256(data).digest()))
    return h.hexdigest()


#: random draws in a row that repeat a state already yielded, after which a point's window counts as
#: exhausted (a budget beyond its distinct states would otherwise draw ``3 * per_point`` times)
_EXHAUSTED = 64


def crash_states(ops: list[Op], root: str, *, per_point: int, seed: int = 0,
                 distinct: bool = True) -> Iterator[CrashState]:
    """Yield the states after each persistence point of ``ops`` (recorded under ``root``): at most
    ``per_point`` distinct ones each (the synced-only and the everything-kept states first, then
    random ones drawn with ``random.Random(seed)``, until ``_EXHAUSTED`` draws in a row repeat). A
    state is drawn at the end of its window -- just before the next persistence point -- so every
    unsynced operation issued before that point may or may not have reached the disk. With
    ``distinct``, a state identical to one already yielded (with as many events committed) is
    skipped, at any point; without, only within a point.

    Raises:
        TraceError: the trace cannot be replayed.
    """
    rng = random.Random(seed)
    model = _Model(root)
    seen: set[tuple[str, int]] = set()
    point, where = 0, "the start of the run (nothing synced yet)"
    for i in range(len(ops) + 1):
        sync = model.apply(ops[i]) if i < len(ops) else (-1, "the end of the trace")
        if sync is None:
            continue
        # the window of ``point`` ends here, before the next sync: draw its states
        made = repeats = 0
        if not distinct:
            seen.clear()
        for attempt in range(per_point * 3):
            mode = "synced" if attempt == 0 else "all" if attempt == 1 else "random"
            tree = model.state(rng, mode)
            key = (_digest(tree), model.marked)
            if key in seen:
                repeats += 1
                if repeats >= _EXHAUSTED:  # this window's states are (nearly) all drawn: a large budget ends here
                    break
                continue
            seen.add(key)
            repeats = 0
            yield CrashState(point, where, tree, model.marked, key[0])
            made += 1
            if made >= per_point:
                break
        if sync[0] >= 0:
            model.sync(sync[0])
        point, where = point + 1, sync[1]
