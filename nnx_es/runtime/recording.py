"""The recorder: every event passes the lifecycle machine, then enters the log.

It also folds the live counters from the same events (the counters projection's own fold,
``projections.counters.CountersAccumulator``),
so the counters a checkpoint stores are, by construction, the counters projection.

An emitted event passes the machine and the counters at once and takes its seq; it waits in
the recorder, in order, until the recorder's next write (:meth:`Recorder.flush`,
:meth:`Recorder.maybe_flush`, :meth:`Recorder.sync`) hands every waiting event to the log in
one append (:meth:`events.logbase.LogBase.extend`): per event, a check, a fold and a place in a
list. An event whose values still live on a device (a microbatch's loss, read back once per
window: :mod:`nnx_es.runtime.window`) is emitted *held*: its final values come with
:meth:`Recorder.release`. Before any write the recorder asks the holder to settle (the
``settle`` given to :meth:`Recorder.hold`), so nothing is ever written out of order or with a
placeholder value.

After each synced write (a commit) the recorder folds the events written since the last
commit (read back from the log, a chunk at a time, partially decoded) and, every
:data:`SNAPSHOT_EVERY` events or more, at a commit where the committed view holds nothing
back, stores a *projection snapshot* (:mod:`projections.snapshots`) in one unsynced
transaction of its own (:meth:`events.log.LmdbLog.put_snapshot`). The fold is incremental:
about one read and partial decode per event, paid at the commit that wrote it (measured in
``bench/scale.py``). A deferred LAST (``checkpoint_lag``) leaves the next epoch's events
pending, so a lagged run has no such point of its own: when a snapshot is due
(:meth:`Recorder.snapshot_due`), the committer completes that epoch's commit inline, and the
snapshot is stored after it -- one commit on the training thread every
:data:`SNAPSHOT_EVERY` events or more (single process; under data parallelism a lagged run
gets its snapshot at its final commit only). A snapshot is a cache: one that cannot be made
is dropped with a warning, and the run goes on without snapshots; it never fails the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from events.log import EventLog
from events.schema import Counters, Event
from nnx_es.lifecycle import Lifecycle
from projections.counters import CountersAccumulator
from projections.snapshots import Snapshot, SnapshotFolder, encode_snapshot, newest_usable
from projections.view import Projections

__all__ = ["SNAPSHOT_EVERY", "Recorder", "snapshot_folder", "store_snapshot"]

log = structlog.get_logger("nnx_es")

#: at least this many events between two projection snapshots (0: none are written)
SNAPSHOT_EVERY = 1 << 16


def snapshot_folder(log: EventLog, every: int) -> SnapshotFolder:
    """The writer's snapshot fold of ``log``, from its newest usable snapshot (or from 0)."""
    return SnapshotFolder(newest_usable(log.read_snapshots(log.durable_seq), []), every=every)


def store_snapshot(log: EventLog, folder: SnapshotFolder) -> int | None:
    """Fold what ``log`` stored since ``folder`` last looked and store the snapshot due, if one is
    (see the module docstring); return its seq, or None.

    Called at every commit, so each commit folds only its own events (no pause of a whole
    snapshot interval's fold at the commit that stores one).

    Raises:
        CorruptEventError / EventLogError: a stored value does not decode, or a read or the write failed.
    """
    durable = log.durable_seq
    if durable <= folder.next_seq:
        return None
    snapshot = folder.advance(log.read_chunks(folder.next_seq, durable))
    if snapshot is None:
        return None
    log.put_snapshot(snapshot.seq, encode_snapshot(snapshot))
    return snapshot.seq


class Recorder:
    """Checks, appends and folds events of one run.

    Raises:
        IllegalTransitionError: from :meth:`emit` / :meth:`commit` when the
            machine refuses the event's kind; nothing is appended then.
    """

    __slots__ = ("log", "lifecycle", "live", "_frozen", "last_seq", "flush_interval_s", "_last_flush", "_written",
                 "_waiting", "_hold", "_holding", "_settle_held", "_snapshots", "_snapshot_start")

    def __init__(self, log: EventLog, lifecycle: Lifecycle | None = None, counters: Counters | None = None, *,
                 snapshot_start: Snapshot | None | bool = True) -> None:
        self.log = log
        self.lifecycle = lifecycle or Lifecycle()
        #: the counters fold applied in place (``live.step`` etc. are read on the hot path)
        self.live = CountersAccumulator(counters or Counters())
        self._frozen: Counters | None = None
        #: the seq of the latest event emitted (the log's next seq - 1 before any)
        self.last_seq = log.next_seq - 1
        self.flush_interval_s = 0.5
        self._last_flush = time.monotonic()
        #: (lifecycle state, counters, last seq) as of the last successful write: what a dropped buffer returns to
        self._written = (self.lifecycle.state, self.live.freeze(), self.last_seq)
        #: the events emitted since the last write, in seq order (the first has seq ``last_seq + 1 - len``)
        self._waiting: list[Event] = []
        self._hold = False  # the next emitted event is held
        self._holding = False  # some waiting events are held (see the module docstring)
        #: the holder's settle: called before a write while events are held; must :meth:`release` them
        self._settle_held: Callable[[], None] | None = None
        #: the fold behind the projection snapshots: None until the first commit, False when off
        self._snapshots: SnapshotFolder | None | bool = None if SNAPSHOT_EVERY > 0 else False
        #: where the snapshot fold starts: True, the log's newest usable snapshot; else this one (None:
        #: seq 0) -- a resume's, checked against the log's LASTs (:func:`nnx_es.resume.find_resume_point`)
        self._snapshot_start = snapshot_start

    @property
    def counters(self) -> Counters:
        """The counters projection of every event emitted so far."""
        if self._frozen is None:
            self._frozen = self.live.freeze()
        return self._frozen

    def emit(self, event: Event) -> int:
        """Check and fold ``event`` and give it the next seq (returned); it waits for the next write
        (see the module docstring), held after :meth:`hold`."""
        hold, self._hold = self._hold, False
        self.lifecycle.advance(event.KIND)  # raises IllegalTransitionError
        if hold:
            self._holding = True
        if self.live.apply(event):
            self._frozen = None
        self._waiting.append(event)
        self.last_seq = seq = self.last_seq + 1
        return seq

    def hold(self, settle: Callable[[], None]) -> None:
        """Hold the next emitted event: its values are not final yet; it waits for :meth:`release`.
        ``settle()``: called before any write while events are held; it must :meth:`release` them
        (see the module docstring)."""
        self._hold = True
        self._settle_held = settle

    @property
    def holding(self) -> bool:
        """Whether events are held (see the module docstring)."""
        return self._holding

    def release(self, final: dict[int, Event]) -> None:
        """Release the held events, each replaced by ``final[seq]`` when given."""
        waiting = self._waiting
        first = self.last_seq + 1 - len(waiting)
        for seq, event in final.items():
            waiting[seq - first] = event
        self._holding = False

    def _settle(self) -> None:
        if self._holding:
            try:
                if self._settle_held is not None:
                    self._settle_held()
            finally:
                self._holding = False  # nobody settled them (or settling failed): written as they are

    def _hand_off(self) -> None:
        """Hand the waiting events (settled) to the log, in one append."""
        waiting = self._waiting
        if waiting:
            self.log.extend(waiting)  # all or none
            self._waiting = []

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
        self._settle()
        try:
            self._hand_off()
            self.log.flush(sync=True)
        except BaseException:
            self._waiting = []
            self.log.discard_buffer()
            state, counters, self.last_seq = self._written
            self.lifecycle.state = state
            self.live = CountersAccumulator(counters)
            self._frozen = None
            raise
        self._wrote()
        if self._snapshots is not False:
            self._snapshot()

    def _snapshot(self) -> None:
        """Store a projection snapshot when one is due (see the module docstring); never raises."""
        try:
            store_snapshot(self.log, self._folder())
        except Exception as exc:  # a cache: the run goes on without it
            self._snapshots_off(exc)

    def snapshot_due(self) -> bool:
        """Whether a projection snapshot is due at the next commit (:data:`SNAPSHOT_EVERY` events
        appended since the last one); False when snapshots are off. Never raises.

        The committer completes such a commit inline even with a ``checkpoint_lag``
        (:meth:`nnx_es.runtime.commit.Committer.submit`): a deferred LAST leaves the next epoch's events
        pending, and a snapshot can only be stored where the committed view holds nothing back.
        """
        if self._snapshots is False:
            return False
        try:
            return self._folder().due(self.last_seq + 1)
        except Exception as exc:  # a cache: the run goes on without it
            self._snapshots_off(exc)
            return False

    def _folder(self) -> SnapshotFolder:
        folder = self._snapshots
        if folder is None:  # the first use: continue from the newest snapshot the log holds, or the resume's
            start = self._snapshot_start
            folder = self._snapshots = snapshot_folder(self.log, SNAPSHOT_EVERY) if start is True else \
                SnapshotFolder(start or None, every=SNAPSHOT_EVERY)
        assert isinstance(folder, SnapshotFolder)
        return folder

    def _snapshots_off(self, exc: Exception) -> None:
        self._snapshots = False
        log.warning("projection snapshots turned off for this run: one could not be made; readers fold "
                    "the log from the last snapshot written", error=f"{type(exc).__name__}: {exc}",
                    durable_seq=self.log.durable_seq)

    def final_projections(self) -> Projections | None:
        """The projections of the whole log from the snapshot fold, when it has folded every
        stored event (after the run's last synced write), else None; the fold is spent then
        (no more snapshots from this recorder). Saves the writer a second fold of its own log
        at finalization (:mod:`nnx_es.runtime.finalize`)."""
        folder = self._snapshots
        if not isinstance(folder, SnapshotFolder) or folder.next_seq != self.log.next_seq or self._waiting \
                or self.log.durable_seq != self.log.next_seq:
            return None
        self._snapshots = False
        return folder.finish()

    def _wrote(self) -> None:
        self._last_flush = time.monotonic()
        self._written = (self.lifecycle.state, self.counters, self.last_seq)

    def maybe_flush(self) -> None:
        """Flush (no sync) when ``flush_interval_s`` has passed: live readers see progress."""
        now = time.monotonic()
        if now - self._last_flush >= self.flush_interval_s:
            self.flush()

    def accepts(self, kind: str) -> bool:
        return self.lifecycle.accepts(kind)

    def flush(self) -> None:
        self._settle()
        self._hand_off()
        self.log.flush()
        self._wrote()

