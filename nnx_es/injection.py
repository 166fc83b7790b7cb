"""Crash and write-fault points of a run: where a crash test ends the process or fails a write.

A *point* names one moment of a run, counted from 0 in the process that trains:

==================  ================================================================
``event:<n>``       just before the n-th event this process emits is checked and appended
``io:<n>:<when>``   before / after the n-th counted os call of a durable file write
                    (:func:`nnx_es.storage.atomic_write_all`: the temporary's ``write``, its
                    ``fsync``, the ``replace`` (rename); :func:`nnx_es.storage.fsync_dir`: the
                    directory's ``fsync``)
``sync:<n>:<when>`` before / after the n-th synced commit of the event log (the write
                    transaction and fsync that make a LAST and everything before it durable)
==================  ================================================================

Two ways to arm one, for the rest of the process:

* :func:`install_kill` / :func:`install_fault` (what :mod:`nnx_es.testing` does in a forked child);
* the environment variable :data:`ENV_VAR` (``NNX_ES_KILL_AT=event:120``), read once when
  :mod:`nnx_es.runtime.session` (the run opener) is imported. Unset (the default) nothing is installed and nothing
  costs anything; set, it does nothing but SIGKILL the process at that point
  (``nnx-es crashtest`` uses it on a script that calls ``fit`` itself).

The seams are the ones a run's persistence goes through: ``Recorder.emit`` (every event),
the ``os`` module seen by :mod:`nnx_es.storage` (replaced by a counting proxy) and
``LmdbLog.flush(sync=True)``. A fault makes the point's os call raise ``OSError(errno)``
before it runs, or the log's synced commit raise :class:`~events.errors.EventLogError`
with the errno's text before anything of it is written (what LMDB reports for a commit
that fails).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ENV_VAR",
    "STORAGE_OPS",
    "kills_expected",
    "Point",
    "Recording",
    "install_fault",
    "install_from_environment",
    "install_kill",
    "install_storage_hook",
    "install_sync_hook",
    "mark_kills_expected",
    "parse_point",
    "record_persistence",
    "uninstall",
]

#: the environment variable naming a point to SIGKILL the process at (unset: off)
ENV_VAR = "NNX_ES_KILL_AT"

#: the os calls of ``atomic_write_all`` / ``fsync_dir`` that are counted as persistence steps
STORAGE_OPS = ("write", "fsync", "replace")
_STORAGE_CALLERS = frozenset({"atomic_write_all", "fsync_dir"})
_POINT = re.compile(r"(event):(\d+)|(io|sync):(\d+):(before|after)")


@dataclass(frozen=True, order=True)
class Point:
    """One crash or fault point. kind: ``"event"``, ``"io"`` or ``"sync"``; index: 0-based
    count of that kind in the training process; when: ``"before"`` or ``"after"`` (events:
    always ``"before"``)."""

    kind: str
    index: int
    when: str = "before"

    def __str__(self) -> str:
        return f"event:{self.index}" if self.kind == "event" else f"{self.kind}:{self.index}:{self.when}"


def parse_point(text: str) -> Point:
    """Read ``event:<n>``, ``io:<n>:before|after`` or ``sync:<n>:before|after``.

    Raises:
        ValueError: anything else (the value and the accepted forms are named).
    """
    m = _POINT.fullmatch(text.strip())
    if m is None:
        raise ValueError(
            f"{ENV_VAR} must be 'event:<n>', 'io:<n>:before|after' or 'sync:<n>:before|after', got {text!r}"
        )
    if m.group(1):
        return Point("event", int(m.group(2)))
    return Point(m.group(3), int(m.group(4)), m.group(5))


# --- the seams ---------------------------------------------------------------------------

_Hook = Callable[[str, str, int, str, tuple[Any, ...]], None]


class _OsProxy:
    """Stands in for ``nnx_es.storage.os``: every attribute is the real one, except the
    :data:`STORAGE_OPS` called from ``atomic_write_all`` / ``fsync_dir``, which go through
    ``hook(op, caller, index, when, args)`` (``when``: ``"before"`` then ``"after"``; ``args``:
    the call's positional arguments). ``index`` counts those calls from 0; calls from
    elsewhere in the module (the lease's pid write) pass through uncounted."""

    def __init__(self, real: Any, hook: _Hook) -> None:
        self._real, self._hook, self.count = real, hook, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in STORAGE_OPS:
            return attr

        def op(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_name
            if caller not in _STORAGE_CALLERS:
                return attr(*args, **kwargs)
            index = self.count
            self.count += 1
            self._hook(name, caller, index, "before", args)
            result = attr(*args, **kwargs)
            self._hook(name, caller, index, "after", args)
            return result

        return op


def install_storage_hook(hook: _Hook) -> _OsProxy:
    """Route :mod:`nnx_es.storage`'s counted os calls through ``hook`` (until :func:`uninstall`)."""
    import nnx_es.storage as storage

    real = storage.os._real if isinstance(storage.os, _OsProxy) else storage.os
    proxy = _OsProxy(real, hook)
    storage.os = proxy  # type: ignore[assignment]
    return proxy


_FLUSH: list[Any] = []  # the real LmdbLog.flush while a sync hook is installed
_EMIT: list[Any] = []  # the real Recorder.emit while an event hook is installed


def install_sync_hook(hook: Callable[[int, str, Any], None]) -> None:
    """Call ``hook(index, "before"|"after", log)`` around every ``LmdbLog.flush(sync=True)``."""
    from events.log import LmdbLog

    original = _FLUSH[0] if _FLUSH else LmdbLog.flush
    _FLUSH[:] = [original]
    count = [0]

    def flush(self: LmdbLog, *, sync: bool = False) -> None:
        if not sync:
            return original(self, sync=sync)
        index = count[0]
        count[0] += 1
        hook(index, "before", self)
        original(self, sync=sync)
        hook(index, "after", self)

    LmdbLog.flush = flush  # type: ignore[method-assign]


def _install_event_hook(hook: Callable[[int], None]) -> None:
    from nnx_es.runtime.recording import Recorder

    original = _EMIT[0] if _EMIT else Recorder.emit
    _EMIT[:] = [original]
    count = [0]

    def emit(self: Recorder, event: Any) -> int:
        hook(count[0])
        count[0] += 1
        return original(self, event)

    Recorder.emit = emit  # type: ignore[method-assign]


def uninstall() -> None:
    """Put every seam back as it was (the real ``os``, ``LmdbLog.flush``, ``Recorder.emit``)."""
    import nnx_es.storage as storage

    if isinstance(storage.os, _OsProxy):
        storage.os = storage.os._real  # type: ignore[assignment]
    if _FLUSH:
        from events.log import LmdbLog

        LmdbLog.flush = _FLUSH.pop()  # type: ignore[method-assign]
    if _EMIT:
        from nnx_es.runtime.recording import Recorder

        Recorder.emit = _EMIT.pop()  # type: ignore[method-assign]


# --- what a run does, and ending or failing it at a point ----------------------------------


@dataclass
class Recording:
    """What :func:`record_persistence` saw: ``(op, caller)`` of every counted os call, in order;
    for each, and for each synced commit of the log, how many events had been emitted before it."""

    storage_ops: list[tuple[str, str]] = field(default_factory=list)
    storage_at: list[int] = field(default_factory=list)
    sync_at: list[int] = field(default_factory=list)
    events: int = 0

    @property
    def syncs(self) -> int:
        return len(self.sync_at)


def record_persistence() -> Recording:
    """Count the events and persistence steps of what runs next in this process (until :func:`uninstall`)."""
    rec = Recording()

    def on_event(n: int) -> None:
        rec.events = n + 1

    def on_io(op: str, caller: str, index: int, when: str, args: tuple[Any, ...]) -> None:
        if when == "before":
            rec.storage_ops.append((op, caller))
            rec.storage_at.append(rec.events)

    def on_sync(index: int, when: str, log: Any) -> None:
        if when == "after":
            rec.sync_at.append(rec.events)

    _install_event_hook(on_event)
    install_storage_hook(on_io)
    install_sync_hook(on_sync)
    return rec


def _sigkill() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(point: Point) -> None:
    """SIGKILL this process at ``point`` (for the rest of its life: meant for a child)."""
    if point.kind == "event":
        _install_event_hook(lambda n: _sigkill() if n == point.index else None)
    elif point.kind == "io":
        install_storage_hook(
            lambda op, caller, n, when, args: _sigkill() if n == point.index and when == point.when else None
        )
    else:
        install_sync_hook(lambda n, when, log: _sigkill() if n == point.index and when == point.when else None)


def install_fault(point: Point, code: int) -> None:
    """Make the persistence step at ``point`` (``io`` or ``sync``, ``"before"``) fail once with errno ``code``.

    Raises:
        ValueError: ``point`` is an event boundary (nothing is written there to fail).
    """
    if point.kind == "event":
        raise ValueError(f"a write fault needs an 'io' or 'sync' point, got {point}")
    message = os.strerror(code)
    if point.kind == "io":

        def on_io(op: str, caller: str, n: int, when: str, args: tuple[Any, ...]) -> None:
            if n == point.index and when == "before":
                raise OSError(code, message)

        install_storage_hook(on_io)
        return
    from events.errors import EventLogError

    def on_sync(n: int, when: str, log: Any) -> None:
        if n == point.index and when == "before":
            raise EventLogError(f"write to {log.path} failed: mdb_txn_commit: {message} (injected)")

    install_sync_hook(on_sync)


_KILLS_EXPECTED = [False]


def mark_kills_expected() -> None:
    """Mark this process as a crash harness's (for the rest of its life: meant for a forked
    child): the runs it resumes were killed on purpose, so a resume removing their stale
    temporaries is expected and logged at debug level, not as a warning (:mod:`nnx_es.runtime.session`)."""
    _KILLS_EXPECTED[0] = True


def kills_expected() -> bool:
    """Whether :func:`mark_kills_expected` marked this process."""
    return _KILLS_EXPECTED[0]


def install_from_environment() -> Point | None:
    """Arm a kill at the point :data:`ENV_VAR` names; return it (``None`` when unset or empty).

    Raises:
        ValueError: the variable is set to something that is not a point.
    """
    value = os.environ.get(ENV_VAR, "")
    if not value:
        return None
    point = parse_point(value)
    install_kill(point)
    return point
