"""The recorder: every event passes the lifecycle machine, then enters the log.

It also folds the live counters from the same events (the counters projection's own fold,
``projections.counters.CountersAccumulator``),
so the counters a checkpoint stores are, by construction, the counters projection.
"""

from __future__ import annotations

import os
import time

from events.log import EventLog
from events.schema import Counters, Event
from nnx_es.lifecycle import Lifecycle
from projections.counters import CountersAccumulator

__all__ = ["Recorder"]


class Recorder:
    """Checks, appends and folds events of one run.

    Raises:
        IllegalTransitionError: from :meth:`emit` / :meth:`commit` when the
            machine refuses the event's kind; nothing is appended then.
    """

    __slots__ = ("log", "lifecycle", "live", "_frozen", "last_seq", "flush_interval_s", "_last_flush", "_written")

    def __init__(self, log: EventLog, lifecycle: Lifecycle | None = None, counters: Counters | None = None) -> None:
        self.log = log
        self.lifecycle = lifecycle or Lifecycle()
        #: the counters fold applied in place (``live.step`` etc. are read on the hot path)
        self.live = CountersAccumulator(counters or Counters())
        self._frozen: Counters | None = None
        self.last_seq = -1
        self.flush_interval_s = 0.5
        self._last_flush = time.monotonic()
        #: (lifecycle state, counters, last seq) as of the last successful write: what a dropped buffer returns to
        self._written = (self.lifecycle.state, self.live.freeze(), -1)

    @property
    def counters(self) -> Counters:
        """The counters projection of every event emitted so far."""
        if self._frozen is None:
            self._frozen = self.live.freeze()
        return self._frozen

    def emit(self, event: Event) -> int:
        """Append ``event`` to the buffer (written at the next flush)."""
        self.lifecycle.advance(event.KIND)
        if self.live.apply(event):
            self._frozen = None
        self.last_seq = self.log.append(event)
        return self.last_seq

    def commit(self, event: Event) -> int:
        """Append ``event`` and make it and everything before it durable (one sync).

        When the write fails, the unwritten buffer (the commit marker with it) is
        dropped, so a failed commit can never become durable later.
        """
        seq = self.emit(event)
        self.sync()
        return seq

    def sync(self) -> None:
        """Make every event appended so far durable (one synced write).

        When the write fails, the unwritten buffer is dropped (see :meth:`commit`), and the
        lifecycle state and counters return to what the log holds: the next event follows the
        last one written (a failed first commit leaves an empty log, never a ``run_failed`` at
        seq 0 without its ``run_started``).
        """
        try:
            self.log.flush(sync=True)
        except BaseException:
            self.log.discard_buffer()
            state, counters, self.last_seq = self._written
            self.lifecycle.state = state
            self.live = CountersAccumulator(counters)
            self._frozen = None
            raise
        self._wrote()

    def _wrote(self) -> None:
        self._last_flush = time.monotonic()
        self._written = (self.lifecycle.state, self.counters, self.last_seq)

    def maybe_flush(self) -> None:
        """Flush (no sync) when ``flush_interval_s`` has passed: live readers see progress."""
        now = time.monotonic()
        if now - self._last_flush >= self.flush_interval_s:
            self.log.flush()
            self._wrote()

    def accepts(self, kind: str) -> bool:
        return self.lifecycle.accepts(kind)

    def flush(self) -> None:
        self.log.flush()
        self._wrote()


# NNX_ES_KILL_AT (nnx_es.injection): read once, here; unset, nothing is installed and the hot
# path is the class above as written
if os.environ.get("NNX_ES_KILL_AT"):
    from nnx_es.injection import install_from_environment

    install_from_environment()
