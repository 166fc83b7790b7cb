"""What a reader learns from a log's LMDB file before (or instead of) LMDB: how much to map, what is damaged.

A read-only handle maps :func:`reader_map_size` bytes: the file's size and room for a live
writer to grow into (:data:`HEADROOM_MIN` .. :data:`HEADROOM_MAX`), never a fixed terabyte, so
a reader runs under any ``ulimit -v`` that holds the file (a 4 GB limit holds a small run's
reader with torch imported). A writer that outgrows the map makes the reader's next
transaction fail with ``MapResizedError``; the reader maps :func:`reader_map_size` of the file
as it is then (:class:`events.lmdbread.Reads`), and LMDB raises that to the pages in use.

:func:`meta_damage` reads LMDB's two meta pages itself when LMDB refuses to open a file as
not an LMDB file or of another data format: a byte changed in a meta page (bit rot) reads
as "data format v254 is not supported", which is damage, not a version. The meta page's
layout is LMDB 0.9's on a 64-bit machine (``mdb.c``: a 16-byte page header, then
``MDB_meta``: magic, version, address, map size, two ``MDB_db``, last page, txnid).

Who has it open: :func:`env_in_use` says whether another process holds the log's environment
open (LMDB keeps a shared ``fcntl`` lock on ``lock.mdb`` while it does), read from the kernel's
table of locks (:func:`held_lock`), so a reader can leave ``lock.mdb`` alone when nobody else is
there (:func:`events.log.quiet_readers`).

Keys: :func:`valid_key` says whether a stored key is a seq at all: 8 bytes (big-endian, as
:func:`events.logbase.seq_key` writes them) below :data:`MAX_SEQ`, 2^62: a log's length, the
last seq + 1, and the sums readers form from it stay below Python's ``sys.maxsize`` (2^63 - 1,
what ``itertools.islice`` and ``range`` take) and msgpack's signed int64.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

__all__ = ["HEADROOM_MAX", "HEADROOM_MIN", "MAX_SEQ", "env_in_use", "held_lock", "meta_damage", "reader_map_size",
           "valid_key"]

#: bytes a read-only map holds past the file's size, at least / at most (the headroom is the file's own size
#: between them: a live writer doubles its map as it grows, so a follower remaps O(log size) times)
HEADROOM_MIN = 64 << 20
HEADROOM_MAX = 1 << 30
_ROUND = 1 << 20  # the map is a whole number of MiB (a multiple of every page size)

#: one past the largest seq a log may hold: a key at or past it is not a seq (damage, or a forged log)
MAX_SEQ = 1 << 62

_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1  # LMDB 0.9's MDB_DATA_VERSION
_HEADER = 16  # bytes of a page header before MDB_meta (pgno, pad, flags, lower, upper)
_META = struct.Struct("<IIQQI")  # magic, version, address, map size, psize (mm_dbs[FREE_DBI].md_pad)
_DEFAULT_PSIZE = 4096


def reader_map_size(data: Path) -> int:
    """The bytes a read-only handle of ``data`` (a log's ``data.mdb``) maps: its size plus headroom.

    Raises:
        OSError: ``data`` cannot be stat'ed.
    """
    size = os.stat(data).st_size
    want = size + min(max(size, HEADROOM_MIN), HEADROOM_MAX)
    return -(-want // _ROUND) * _ROUND


def held_lock(path: Path, kinds: frozenset[str]) -> bool | None:
    """Whether the kernel's table of locks (``/proc/locks``, Linux) lists a held -- not a waiting -- lock
    of one of ``kinds`` (``"FLOCK"``, ``"POSIX"``, ``"OFDLCK"``) on the file ``path``; False when ``path``
    does not exist; None where the table cannot be read. Reading the table takes no lock itself.

    A lock held in another PID namespace (a container sharing the volume) or on another machine is not
    listed: the table shows the locks of this namespace.
    """
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return False
    # "1: FLOCK  ADVISORY  WRITE 8531 fe:00:2146564 0 EOF"; a waiter reads "1: -> FLOCK ..."
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(len(fields) > 1 and fields[1] in kinds and where in fields for fields in map(str.split, lines))


_LMDB_LOCKS = frozenset({"POSIX", "OFDLCK"})


def env_in_use(env_dir: Path) -> bool:
    """Whether a process holds the LMDB environment ``env_dir`` (a log's ``events.lmdb``) open with
    LMDB's lock file: LMDB keeps a shared ``fcntl`` lock on ``lock.mdb`` for as long as an environment
    is open (``mdb_env_setup_locks``), and its writer always opens it so. False when ``lock.mdb`` does
    not exist (no process ever opened it in place) or nobody holds it; True where the table of locks
    cannot be read (the safe side: take LMDB's lock as before)."""
    held = held_lock(Path(env_dir) / "lock.mdb", _LMDB_LOCKS)
    return True if held is None else held


def valid_key(key: bytes) -> bool:
    """Whether ``key`` is a seq's key: 8 bytes, big-endian, below :data:`MAX_SEQ`."""
    return len(key) == 8 and key[0] < MAX_SEQ >> 56


def meta_damage(data: Path) -> str | None:
    """What is damaged in ``data``'s two LMDB meta pages, or None when both read as LMDB 0.9 metas.

    A meta page whose magic is not LMDB's, or whose data format is not the other page's or
    not LMDB's, is named with what it reads. None when neither page has LMDB's magic (not an LMDB
    file at all), and when ``data`` cannot be read or is too short to hold both meta pages (a
    truncated file): LMDB's own refusal says so.
    """
    try:
        with open(data, "rb") as f:
            head = f.read(2 * 65536)
    except OSError:
        return None
    first = _meta(head, 0)
    psize = first[4] if first is not None and first[0] == _MAGIC and first[4] in _PAGE_SIZES else _DEFAULT_PSIZE
    metas = [first, _meta(head, psize)]
    if None in metas or all(meta[0] != _MAGIC for meta in metas):  # type: ignore[index]
        return None
    a, b = metas
    assert a is not None and b is not None
    if a[0] == b[0] == _MAGIC and a[1] == b[1] != _DATA_VERSION:  # said once, not once per page
        return (f"both meta pages read data format v{a[1]} (LMDB 0.9 writes v{_DATA_VERSION}): another LMDB's file, "
                "or both damaged")
    problems = []
    for i, meta in enumerate(metas):
        assert meta is not None
        if meta[0] != _MAGIC:
            problems.append(f"meta page {i} has magic {meta[0]:#010x}, not LMDB's {_MAGIC:#010x}")
        elif meta[1] != _DATA_VERSION:
            problems.append(f"meta page {i} reads data format v{meta[1]} (LMDB 0.9 writes v{_DATA_VERSION}, and the "
                            "other meta page does not agree)")
    return "; ".join(problems) or None


_PAGE_SIZES = frozenset(1 << n for n in range(9, 17))  # 512 B .. 64 KiB


def _meta(head: bytes, offset: int) -> tuple[int, int, int, int, int] | None:
    at = offset + _HEADER
    if at + _META.size > len(head):
        return None
    return _META.unpack_from(head, at)  # type: ignore[return-value]
