"""Killing a training process at a chosen point, from a warm parent (fork, no new interpreter).

``run_killed(target, kill)`` forks; the child installs ``kill`` (a function
that monkeypatches a seam to SIGKILL the process at the chosen moment), runs
``target`` and exits. The parent waits and reports how the child ended.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from nnx_es.recorder import Recorder


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def run_killed(target: Callable[[], Any], kill: Callable[[], None] | None = None) -> str:
    """Run ``target`` in a forked child; return ``"killed"``, ``"completed"`` or ``"error: ..."``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            if kill is not None:
                kill()
            target()
        except BaseException as exc:  # noqa: BLE001
            os.write(w, f"{type(exc).__name__}: {exc}".encode()[:2000])
            code = 3
        finally:
            os.close(w)
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        message = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "completed"
    return f"error: {message or status}"


def kill_at_event(n: int) -> Callable[[], None]:
    """A ``kill`` that SIGKILLs the process just before its n-th (0-based) event of this session is checked."""

    def install() -> None:
        original = Recorder.emit
        count = [0]

        def emit(self: Recorder, event: Any) -> int:
            if count[0] == n:
                sigkill()
            count[0] += 1
            return original(self, event)

        Recorder.emit = emit  # type: ignore[method-assign]

    return install


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


# --- storage I/O and commit-sync seams (crash matrix, write faults) ------------------------

#: The os calls of :func:`nnx_es.storage.atomic_write` (and its directory fsync) that the
#: crash matrix and the write-fault suite count: the write of the temporary, its fsync,
#: the rename, the directory fsync.
STORAGE_OPS = ("write", "fsync", "replace")
_STORAGE_CALLERS = frozenset({"atomic_write", "fsync_dir"})


class _OsProxy:
    """Stands in for ``nnx_es.storage.os``: every attribute is the real one, except the
    :data:`STORAGE_OPS` called from ``atomic_write``/``fsync_dir``, which go through
    ``hook(op, caller, index, when, call)`` (``when``: ``"before"`` then ``"after"``).

    ``index`` counts those calls from 0 in this process; calls from anywhere else in
    the module (the lease's pid write) pass through uncounted.
    """

    def __init__(self, real: Any, hook: Callable[..., Any]) -> None:
        self._real, self._hook, self.count = real, hook, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in STORAGE_OPS:
            return attr

        def op(*args: Any, **kwargs: Any) -> Any:
            import sys

            caller = sys._getframe(1).f_code.co_name
            if caller not in _STORAGE_CALLERS:
                return attr(*args, **kwargs)
            index = self.count
            self.count += 1
            self._hook(name, caller, index, "before")
            result = attr(*args, **kwargs)
            self._hook(name, caller, index, "after")
            return result

        return op


def install_storage_hook(hook: Callable[..., Any]) -> _OsProxy:
    """Route ``nnx_es.storage``'s counted os calls through ``hook`` (for the rest of this process)."""
    import nnx_es.storage as storage

    real = storage.os._real if isinstance(storage.os, _OsProxy) else storage.os
    proxy = _OsProxy(real, hook)
    storage.os = proxy  # type: ignore[assignment]
    return proxy


def uninstall_storage_hook() -> None:
    import nnx_es.storage as storage

    if isinstance(storage.os, _OsProxy):
        storage.os = storage.os._real  # type: ignore[assignment]


def kill_in_storage_io(n: int, *, after: bool) -> Callable[[], None]:
    """A ``kill`` that SIGKILLs just before (or just after) the n-th (0-based) counted
    os call of ``atomic_write``/``fsync_dir`` (write, fsync of the file or the directory, rename)."""

    def install() -> None:
        when = "after" if after else "before"

        def hook(op: str, caller: str, index: int, moment: str) -> None:
            if index == n and moment == when:
                sigkill()

        install_storage_hook(hook)

    return install


def install_sync_hook(hook: Callable[[int, str], None]) -> None:
    """Call ``hook(index, "before"|"after")`` around every ``LmdbLog.flush(sync=True)`` (index from 0)."""
    from events.log import LmdbLog

    original = LmdbLog.flush
    count = [0]

    def flush(self: LmdbLog, *, sync: bool = False) -> None:
        if not sync:
            return original(self, sync=sync)
        index = count[0]
        count[0] += 1
        hook(index, "before")
        original(self, sync=sync)
        hook(index, "after")

    LmdbLog.flush = flush  # type: ignore[method-assign]


def kill_at_sync(n: int, *, after: bool) -> Callable[[], None]:
    """A ``kill`` that SIGKILLs just before (or just after) the n-th (0-based) synced commit of the log."""

    def install() -> None:
        when = "after" if after else "before"

        def hook(index: int, moment: str) -> None:
            if index == n and moment == when:
                sigkill()

        install_sync_hook(hook)

    return install
