"""Killing a training process at a chosen point, from a warm parent (fork, no new interpreter).

``run_killed(target, kill)`` forks; the child installs ``kill`` (a function
that monkeypatches a seam to SIGKILL the process at the chosen moment), runs
``target`` and exits. The parent waits and reports how the child ended.

``copy_run``, ``raw_values`` and ``change_key``: a private copy of a template run to
damage, the stored values of a run's log as written, a key changed in ``data.mdb``.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from events.log import LmdbLog
from nnx_es import injection
from nnx_es.injection import Point, install_kill
from nnx_es.testing.harness import read_until_exit
from nnx_es.testing.harness import run_in_child as run_forked


def copy_run(template: Path, dest: Path) -> Path:
    """Copy the run directory ``template`` to ``dest/<its name>`` (without LMDB's lock file)."""
    run_dir = dest / template.name
    shutil.copytree(template, run_dir, ignore=shutil.ignore_patterns("lock.mdb"))
    return run_dir


def raw_values(run_dir: Path) -> list[tuple[int, bytes]]:
    """``(seq, stored bytes)`` of every value of ``run_dir``'s event log."""
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        return list(log.read_raw())


def flip_in_file(run_dir: Path, seq: int, offset: int, byte: int) -> None:
    """Set byte ``offset`` of the value stored under ``seq`` to ``byte``, in data.mdb itself (bit rot under LMDB).

    Copy-on-write leaves stale copies of a value in free pages; every copy gets the same
    change, so whichever page holds the live one, it is the live value that rots.
    """
    raw = dict(raw_values(run_dir))[seq]
    path = run_dir / "events.lmdb" / "data.mdb"
    data = bytearray(path.read_bytes())
    copies = []
    at = data.find(raw)
    while at >= 0:
        copies.append(at)
        at = data.find(raw, at + 1)
    assert copies, "the value must be stored contiguously in data.mdb"
    for at in copies:
        data[at + offset] = byte
    path.write_bytes(bytes(data))


def change_key(log_dir: Path, seq: int, new_seq: int) -> int:
    """Store the value of ``seq`` under the key ``new_seq`` in ``log_dir/data.mdb`` itself (a changed key on disk).

    LMDB's API cannot store keys out of order: the bytes of the key are changed where
    the entry lies (key then value, in a leaf page), in every copy copy-on-write left,
    so the live one is changed whichever it is. The value and its checksum are
    untouched. Returns the number of copies changed.
    """
    with LmdbLog(log_dir, readonly=True) as log:
        raw = dict(log.read_raw())[seq]
    path = Path(log_dir) / "data.mdb"
    data = path.read_bytes()
    entry = seq.to_bytes(8, "big") + raw
    copies = data.count(entry)
    assert copies, f"the entry of seq {seq} must be stored contiguously in {path}"
    path.write_bytes(data.replace(entry, new_seq.to_bytes(8, "big") + raw))
    return copies


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run_killed(target: Callable[[], Any], kill: Callable[[], None] | None = None) -> str:
    """Run ``target`` in a forked child (the harness's :func:`nnx_es.testing.harness.run_in_child`),
    after installing ``kill``; return ``"killed"``, ``"completed"`` or ``"error: ..."``."""
    return run_forked(lambda: (kill() if kill is not None else None, target()))


def kill_at_event(n: int) -> Callable[[], None]:
    """A ``kill`` that SIGKILLs the process just before its n-th (0-based) event of this session is checked
    (the public point ``event:<n>`` of :mod:`nnx_es.injection`)."""
    return lambda: install_kill(Point("event", n))


def kill_at_call(module: Any, name: str, n: int, *, after: bool = False) -> Callable[[], None]:
    """A ``kill`` that SIGKILLs at the n-th (0-based) call of ``module.name`` (before it, or after it returns)."""

    def install() -> None:
        original = getattr(module, name)
        count = [0]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            hit = count[0] == n
            count[0] += 1
            if hit and not after:
                sigkill()
            result = original(*args, **kwargs)
            if hit and after:
                sigkill()
            return result

        setattr(module, name, wrapper)

    return install


# --- storage I/O and commit-sync seams (crash matrix, write faults): the public ones of
# nnx_es.injection, which nnx_es.testing uses on users' set-ups ---------------------------

#: The os calls of :func:`nnx_es.storage.atomic_write_all` (and its directory fsync) that the
#: crash matrix and the write-fault suite count: the write of the temporary, its fsync,
#: the rename, the directory fsync.
STORAGE_OPS = injection.STORAGE_OPS
install_storage_hook = injection.install_storage_hook


def uninstall_storage_hook() -> None:
    import nnx_es.storage as storage

    if isinstance(storage.os, injection._OsProxy):
        storage.os = storage.os._real  # type: ignore[assignment]


def kill_in_storage_io(n: int, *, after: bool) -> Callable[[], None]:
    """A ``kill`` that SIGKILLs just before (or just after) the n-th (0-based) counted
    os call of ``atomic_write_all``/``fsync_dir`` (the public point ``io:<n>:before|after``)."""
    return lambda: install_kill(Point("io", n, "after" if after else "before"))


def install_sync_hook(hook: Callable[[int, str], None]) -> None:
    """Call ``hook(index, "before"|"after")`` around every ``LmdbLog.flush(sync=True)`` (index from 0)."""
    injection.install_sync_hook(lambda index, when, log: hook(index, when))


def kill_at_sync(n: int, *, after: bool) -> Callable[[], None]:
    """A ``kill`` that SIGKILLs just before (or just after) the n-th (0-based) synced commit of the log
    (the public point ``sync:<n>:before|after``)."""
    return lambda: install_kill(Point("sync", n, "after" if after else "before"))


def _real_lmdb_open() -> Any:
    import lmdb

    return lmdb.open


_REAL_LMDB_OPEN = _real_lmdb_open()  # captured at import, before any test patches it


class LmdbFaults:
    """Errors to inject into the LMDB environments opened through :meth:`open` (one-shot each).

    ``commit_errno``: the next write transaction's commit aborts and raises ``lmdb.Error``
    (nothing of it is stored); ``sync_errno``: the next ``env.sync`` raises ``lmdb.Error``
    after the transaction was written. ``skip`` write commits / syncs pass first.
    """

    def __init__(self) -> None:
        self.commit_errno: int | None = None
        self.sync_errno: int | None = None
        self.skip = 0
        self.injected: list[str] = []
        import lmdb

        self._lmdb = lmdb
        self._open = _REAL_LMDB_OPEN

    def _take(self, which: str) -> int | None:
        code = getattr(self, f"{which}_errno")
        if code is None:
            return None
        if self.skip > 0:
            self.skip -= 1
            return None
        setattr(self, f"{which}_errno", None)
        self.injected.append(which)
        return code

    def error(self, call: str, code: int) -> Exception:
        return self._lmdb.Error(f"{call}: {os.strerror(code)}")

    def open(self, *args: Any, **kwargs: Any) -> Any:
        """Stands in for ``lmdb.open``: the real environment behind a fault-injecting proxy."""
        return _EnvProxy(self._open(*args, **kwargs), self)


class _TxnProxy:
    def __init__(self, txn: Any, faults: LmdbFaults) -> None:
        self._txn, self._faults = txn, faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def __enter__(self) -> Any:
        self._txn.__enter__()
        return self._txn

    def __exit__(self, et: Any, ev: Any, tb: Any) -> Any:
        if et is None:
            code = self._faults._take("commit")
            if code is not None:
                self._txn.abort()
                raise self._faults.error("mdb_txn_commit", code)
        return self._txn.__exit__(et, ev, tb)


class _EnvProxy:
    def __init__(self, env: Any, faults: LmdbFaults) -> None:
        self._env, self._faults = env, faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        txn = self._env.begin(*args, **kwargs)
        return _TxnProxy(txn, self._faults) if kwargs.get("write") else txn

    def sync(self, *args: Any) -> Any:
        code = self._faults._take("sync")
        if code is not None:
            raise self._faults.error("mdb_env_sync", code)
        return self._env.sync(*args)


def run_in_child(target: Callable[[], Any]) -> str:
    """Run ``target`` in a forked child; return ``"returned"``, ``"raised <Type>: <message>"``
    or ``"signal <name>"`` (a crash such as SIGBUS or SIGSEGV that would kill the test run)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            target()
            out = "returned"
        except BaseException as exc:  # noqa: BLE001
            out = f"raised {type(exc).__name__}: {exc}"
        os.write(w, out.encode()[:4000])
        os._exit(0)
    os.close(w)
    data, status = read_until_exit(pid, r)  # not the pipe's end: a forked DataLoader worker may hold it
    message = data.decode(errors="replace")
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return message
