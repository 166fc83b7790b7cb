"""The audit's pass a segment at a time: the same checks as :mod:`nnx_es.audit.run`'s pass event by event.

A long run is mostly microbatches and their receipts (``microbatch_done``,
``update_committed``: the *hot* kinds, :data:`HOT_KINDS`). Event by event, the audit
spends about 5 µs of Python on each; here the log is read a chunk at a time (one
read transaction, with the checksums: :meth:`~events.log.LmdbLog.verify_sums`'s
``each_chunk``), each chunk decoded in one call and classified by one byte per event
(:data:`~events.codec.TYPE_CODES`), and a run of hot events is taken at once where
every check would do nothing but move on:

* the lifecycle machine (invariant 2) looks up the state after the run
  (:meth:`~nnx_es.audit.sequence.LifecycleCheck.feed_run`); no other sequence check
  reads a hot kind (asserted at import);
* the committed view and the folds are :class:`projections.view.Projector`'s, a segment
  at a time; the committed-view checks (:class:`~nnx_es.audit.committed.CommittedCheck`)
  take a committed hot run at once when it is inert there
  (:meth:`~nnx_es.audit.committed.CommittedCheck.hot_inert`), else event by event;
  every other committed event is folded alone and checked with the projections folded
  through it, as before; the snapshots (:class:`~nnx_es.audit.snapshots.SnapshotCheck`)
  are met at the same points (the seq the log was read to, whether the view holds
  anything back).

It covers only a log whose every value is where its key says and decodes, and whose
checksums all verify (:func:`run_segments` returns None otherwise): on anything else
the audit runs its pass event by event, whose findings on damaged logs are the
reference. Whether every key is in place and every value decodes with the full types
(optional fields included) is :func:`keys_and_values_ok`: in this process, or, for a
long log, in a second one (``python -m nnx_es.audit.segments LMDB_DIR STOP SPLIT``: every key,
the values below SPLIT, :data:`_WORKER_SHARE` of the log) while this one folds those values
with the lighter decoding of the hot kinds that reads only the fields the checks and folds
read, and decodes the values from SPLIT on fully itself (the same answer, on two cores; the
answer is ``ok`` or ``damaged``, so the result cannot depend on which process finishes first).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from events.codec import TYPE_CODES, partial_decoder, skimming_decoder
from events.errors import CorruptEventError, EventLogError, SequenceGapError
from events.log import LmdbLog, quiet_readers
from events.schema import Event, MicrobatchDone, RunStarted, UpdateCommitted
from events.sums import SumProblem
from nnx_es.audit.committed import CommittedCheck
from nnx_es.audit.report import Sink
from nnx_es.audit.digests import DigestCheck
from nnx_es.audit.sequence import CommitOrderCheck, FinalizationCheck, LifecycleCheck
from nnx_es.audit.snapshots import SnapshotCheck
from nnx_es.audit.spec import SpecHashCheck
from nnx_es.audit.world import WorldCheck
from projections import Projections
from projections.history import HistoryState
from projections.view import FOLDED_BEYOND_COUNTERS, Projector

__all__ = ["HOT_KINDS", "PARALLEL_FROM", "AuditProjector", "keys_and_values_ok", "run_segments"]

#: kinds taken a run at once (they are only counted by the folds and read by the lifecycle machine)
HOT_KINDS = frozenset({MicrobatchDone.KIND, UpdateCommitted.KIND})
# what taking a run at once relies on
for _check in (CommitOrderCheck, FinalizationCheck, DigestCheck, SpecHashCheck, WorldCheck):
    if not HOT_KINDS.isdisjoint(_check.KINDS):
        raise ImportError(f"{_check.__name__} reads a hot kind: nnx_es.audit.segments must feed it event by event")
if {MicrobatchDone, UpdateCommitted} & FOLDED_BEYOND_COUNTERS:
    raise ImportError("a projection other than the counters folds a hot kind: nnx_es.audit.segments must fold it")

_IS_HOT = bytes(int(t is not None and t.KIND in HOT_KINDS) for t in
                [None, *sorted(TYPE_CODES, key=TYPE_CODES.__getitem__)]).ljust(256, b"\0")

def _stretches(codes: bytes) -> Iterator[tuple[int, int]]:
    """A chunk's events (their type ``codes``) as stretches ``(i, j)``: events ``i .. j-1`` are hot (none when
    ``i == j``), event ``j`` is the next one that is not (``j == len(codes)``: the chunk ends there)."""
    hot = codes.translate(_IS_HOT)
    n, i = len(codes), 0
    while i < n:
        j = hot.find(0, i)
        j = n if j < 0 else j
        yield i, j
        i = j + 1


#: a log at least this long is checked for its keys and full decoding in a second process
PARALLEL_FROM = 1 << 18
#: the share of the log (from seq 0) whose values the second process decodes fully; this one decodes
#: the rest fully in its pass (the second process also reads every key: about equal work on each core)
_WORKER_SHARE = 0.8

#: the full types, coded (what the event-by-event pass decodes)
_full = partial_decoder({})


class _Counted(Event, frozen=True, kw_only=True, tag=MicrobatchDone.__struct_config__.tag):  # type: ignore[misc]
    """A ``microbatch_done`` as this process reads it beside the second one: its kind (it is counted)."""

    KIND: ClassVar[str] = MicrobatchDone.KIND
    VERSION: ClassVar[int] = MicrobatchDone.VERSION


class _Receipt(Event, frozen=True, kw_only=True, tag=UpdateCommitted.__struct_config__.tag):  # type: ignore[misc]
    """An ``update_committed`` as this process reads it beside the second one: what the folds and checks read."""

    KIND: ClassVar[str] = UpdateCommitted.KIND
    VERSION: ClassVar[int] = UpdateCommitted.VERSION
    step: int
    optimizer: str = "default"
    data_parallel_size: int = 1


#: the hot kinds as the checks and folds read them (the second process decodes them fully)
_light = skimming_decoder({MicrobatchDone: _Counted, UpdateCommitted: _Receipt})


class AuditProjector(Projector):
    """A :class:`~projections.view.Projector` that feeds each committed event to the committed-view checks
    and the snapshot check, as :class:`~nnx_es.audit.fold.CommittedFold` does event by event.

    After :meth:`finish` it has the attributes ``_check_tail`` of :mod:`nnx_es.audit.run` reads:
    ``p``, ``max_seq``, ``last_read``, ``tail``, ``restart`` / ``restart_seq``, ``closing`` and
    ``before_closing`` (same meanings as :class:`~nnx_es.audit.fold.CommittedFold`'s).
    """

    __slots__ = ("check", "snapshots", "run_id_of", "max_seq", "last_read", "restart_seq", "closing", "tail",
                 "exhausted", "before_closing", "_mark", "_at", "_cache")

    def __init__(self, check: CommittedCheck, snapshots: SnapshotCheck, run_id_of: Any) -> None:
        super().__init__(Projections())
        self.check, self.snapshots, self.run_id_of = check, snapshots, run_id_of
        self.max_seq = self.last_read = self.restart_seq = -1
        self.closing = self.tail = 0
        self.exhausted = False
        self.before_closing = Projections()
        self._mark: Projections | tuple[Any, ...] = self.before_closing  # the state at restart_seq
        self._at = -1  # inside a LAST's commit: its seq (the point the log was read to)
        self._cache: Projections | None = self.before_closing

    @property
    def p(self) -> Projections:
        """The projections of the committed events folded so far."""
        if self._cache is None:
            s = self.states
            self._cache = Projections(history=HistoryState(records=tuple(self.records)), checkpoints=s[1],
                                      schedulers=s[2], counters=self.counters.freeze(), status=s[3], seq=self.last)
        return self._cache

    @property
    def restart(self) -> Projections:
        """The projections at ``restart_seq``, the last point where the view held nothing back."""
        if isinstance(self._mark, tuple):
            states, n, counters, seq = self._mark
            self._mark = Projections(history=HistoryState(records=tuple(self.records[:n])), checkpoints=states[1],
                                     schedulers=states[2], counters=counters, status=states[3], seq=seq)
        return self._mark

    def chunk(self, seqs: range, events: list[Any], codes: bytes) -> None:
        """Feed the next chunk of the log (every event decodable, in seq order)."""
        self.last_read = seqs[-1]
        self.feed(seqs, events, codes)

    def _commit(self, covers: int, at: int = -1) -> None:
        self._at = at
        try:
            super()._commit(covers, at)
        finally:
            self._at = -1

    def fold(self, seqs: Sequence[int], events: Sequence[Any], codes: bytes) -> None:
        n = len(codes)
        for i, j in _stretches(codes):
            if j > i:
                self._fold_hot(seqs[i:j], events[i:j], codes[i:j])
            if j < n:
                self._fold_one(seqs[j:j + 1], events[j:j + 1], codes[j:j + 1])

    def _where(self) -> tuple[bool, int]:
        """(whether the view holds nothing back now, the seq the log was read to) for the event being folded."""
        if self.exhausted:
            return False, self.last_read
        if self._at >= 0:  # folded by a LAST from what was pending: read to the LAST
            return False, self._at
        return not self.pending, -1

    def _fold_hot(self, seqs: Sequence[int], events: Sequence[Any], codes: bytes) -> None:
        super().fold(seqs, events, codes)
        self._cache = None
        self.max_seq = max(self.max_seq, seqs[-1])
        check = self.check
        clean, read_to = self._where()
        if not check.run_id:
            check.run_id = self.run_id_of(seqs[0] if read_to < 0 else read_to)
        if check.hot_inert():
            check.prev_kind = events[-1].KIND
        else:
            for seq, event in zip(seqs, events):
                check.feed(seq, event, self)
        snaps = self.snapshots
        if seqs[-1] >= snaps.next_seq or max(read_to, seqs[-1]) > snaps.next_seq:
            for seq, event in zip(seqs, events):
                to = seq if read_to < 0 else read_to
                if seq >= snaps.next_seq or to > snaps.next_seq:
                    snaps.feed(seq, event, clean, to, self)

    def _fold_one(self, seqs: Sequence[int], events: Sequence[Any], codes: bytes) -> None:
        seq, event = seqs[0], events[0]
        if self.exhausted:
            if not self.closing:
                self.before_closing = self.p
            self.closing += 1
        super().fold(seqs, events, codes)
        self._cache = None
        self.max_seq = max(self.max_seq, seq)
        clean, read_to = self._where()
        read_to = seq if read_to < 0 else read_to
        if clean:  # nothing held back: a fresh view may restart after seq
            self.restart_seq = seq
            s = self.states
            self._mark = (tuple(s), len(self.records), self.counters.freeze(), seq)
        check = self.check
        if not check.run_id:
            check.run_id = self.run_id_of(read_to)
        check.feed(seq, event, self)
        snaps = self.snapshots
        if seq >= snaps.next_seq or read_to > snaps.next_seq:
            snaps.feed(seq, event, clean, read_to, self)

    def finish(self) -> Projections:
        self.tail = sum(len(segment[0]) for segment in self.pending)
        self.exhausted = True
        super().finish()
        self.tail -= self.closing
        self._cache = None
        return self.p


class _Sequence:
    """The sequence checks (invariants 2, 3, 7's early stopping, 8, 11) fed a chunk at a time, in log order."""

    def __init__(self, sink: Sink) -> None:
        self.lifecycle = LifecycleCheck(sink)
        checks = (self.lifecycle, CommitOrderCheck(sink), FinalizationCheck(sink), DigestCheck(sink),
                  SpecHashCheck(sink), WorldCheck(sink))
        self.routes = {kind: [c.feed for c in checks if kind in c.KINDS] for kind in LifecycleCheck.KINDS}
        self.run_started: tuple[int, RunStarted] | None = None  # the first, and its seq

    def chunk(self, seqs: range, events: list[Any], codes: bytes) -> None:
        n = len(codes)
        routes, lifecycle = self.routes, self.lifecycle
        for i, j in _stretches(codes):
            if j > i:
                lifecycle.feed_run(seqs[i:j], events[i:j], codes[i:j])
            if j == n:
                return
            seq, event = seqs[j], events[j]
            if self.run_started is None and type(event) is RunStarted:
                self.run_started = (seq, event)
            for feed in routes[event.KIND]:
                feed(seq, event)


def run_segments(run_dir: Path, log: LmdbLog, stop: int, sink: Sink, store: Any,
                 parallel: bool | None = None) -> tuple[AuditProjector, SnapshotCheck, list[SumProblem]] | None:
    """The audit's pass over ``log``'s first ``stop`` values, a segment at a time (the module docstring).

    Returns the fold (after :meth:`AuditProjector.finish`, the committed check finished),
    the snapshot check (finished) and the checksum problems -- or None when the log is not one
    this pass covers (a key out of place, a value that does not decode, a checksum problem):
    then ``sink`` holds partial findings and the caller audits event by event with a new sink.
    ``parallel``: check keys and full decoding in a second process (default: for ``stop >=``
    :data:`PARALLEL_FROM`).

    Raises:
        EventLogError: LMDB refused a read.
    """
    if parallel is None:
        parallel = stop >= PARALLEL_FROM
    split = int(stop * _WORKER_SHARE) if parallel else 0  # the second process decodes the values below it
    worker = _start_worker(log.path, stop, split) if parallel else None
    try:
        if worker is None and not keys_and_values_ok(log, stop, values=0):  # the pass decodes them fully
            return None
        sequence = _Sequence(sink)
        check = CommittedCheck(sink, store, run_id="")

        def run_id_of(read_to: int) -> str:  # the first run_started read by then names the run
            found = sequence.run_started
            return found[1].run_id if found is not None and found[0] <= read_to else run_dir.name

        snapshots = SnapshotCheck(log, stop, sink)
        folded = AuditProjector(check, snapshots, run_id_of)
        if worker is None:
            split = 0

        def each_chunk(first: int, values: list[bytes]) -> None:
            if not values:
                return
            events, codes = (_light if first + len(values) <= split else _full)(values, first)
            seqs = range(first, first + len(values))
            sequence.chunk(seqs, events, codes)
            folded.chunk(seqs, events, codes)

        try:
            problems = list(log.verify_sums(stop, each_chunk=each_chunk))
        except CorruptEventError:
            return None
        if problems or (worker is not None and not _worker_ok(worker, log, stop, split)):
            return None
        worker = None
        folded.finish()
        check.finish()
        snapshots.finish()
        return folded, snapshots, problems
    finally:
        if worker is not None:
            worker.kill()
            worker.wait()


def keys_and_values_ok(log: LmdbLog, stop: int, *, values: int | None = None) -> bool:
    """Whether the first ``stop`` stored keys are 0 .. stop - 1 and each value below seq ``values``
    (default: ``stop``) decodes with the full types; one cursor pass (:meth:`~events.log.LmdbLog.check_keys`).

    Raises:
        EventLogError: LMDB refused a read.
    """
    try:
        end = stop if values is None else values

        def decodes(first: int, chunk: list[bytes]) -> None:
            if first < end:
                _full(chunk, first)

        return log.check_keys(0, stop, each_chunk=decodes if end > 0 else None) == stop
    except (SequenceGapError, CorruptEventError):
        return False


def _start_worker(path: Path, stop: int, split: int) -> subprocess.Popen[bytes] | None:
    root = Path(__file__).resolve().parent.parent.parent
    try:
        return subprocess.Popen([sys.executable, "-m", "nnx_es.audit.segments", str(path), str(stop), str(split)], cwd=root,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    except OSError:
        return None  # checked in this process instead


def _worker_ok(worker: subprocess.Popen[bytes], log: LmdbLog, stop: int, split: int) -> bool:
    """The second process's answer; when it gave none (it failed), the check is done here."""
    out, _ = worker.communicate()
    answer = out.strip()
    if worker.returncode == 0 and answer in (b"ok", b"damaged"):
        return answer == b"ok"
    return keys_and_values_ok(log, stop, values=split)


def _main(argv: list[str]) -> int:
    """``python -m nnx_es.audit.segments LMDB_DIR STOP [SPLIT]``: print ``ok`` or ``damaged``
    (:func:`keys_and_values_ok` of the keys below STOP and the values below SPLIT, default STOP)."""
    path, stop = Path(argv[0]), int(argv[1])
    split = int(argv[2]) if len(argv) > 2 else stop
    try:  # its parent reads this log: quiet when the parent is (no other process holds LMDB's lock)
        with quiet_readers(), LmdbLog(path, readonly=True) as log:
            ok = keys_and_values_ok(log, stop, values=split)
    except EventLogError:
        ok = False
    sys.stdout.write("ok\n" if ok else "damaged\n")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
