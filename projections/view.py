"""The committed view of a log and the aggregate of every projection.

The committed view is the prefix of the log that readers trust:

* events up to and including the last ``LastCommitted`` are committed, and so
  is the commit group that directly follows it (BEST, phase, callback
  checkpoints: :data:`GROUP_KINDS`), which only ever names durable blobs; a
  deferred LAST (``covers`` >= 0, written while the next epoch already runs)
  commits the events up to ``covers`` and its own ``checkpoint_stored``, while
  the next epoch's events before it stay pending;
* a ``RunResumed`` abandons the pending tail before it (the range it names)
  and is itself committed (it is synced when written);
* a tail after the last LAST is ignored, except that, when the log ends with a
  durable ``RunFinalized``, the closing events of that tail (stop requested,
  run failed, callback finalized, run finalized) are folded, so the status of
  a stopped or failed run is known while its unfinished epoch stays out; the
  evaluations recorded after the run (``evaluation_recorded``) may follow it.

:func:`committed` and :func:`fold` define the view and the aggregate one event at
a time; :func:`project` computes the same a segment at a time (a run of events
between commit markers), so replaying a long log costs a few C-level passes per
segment instead of Python work per event.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import or_
from typing import Any

import msgspec

from events.chunks import StoredPairs
from events.codec import EVENT_TYPES, TYPE_CODES, partial_decoder, partial_type, type_codes
from events.schema import (
    CheckpointStored,
    Counters,
    EpochBegan,
    EpochSummarized,
    Event,
    HistoryRecord,
    LastCommitted,
    MicrobatchDone,
    RunFinalized,
    RunResumed,
    UpdateCommitted,
)
from projections import checkpoints as checkpoints_mod
from projections import history as history_mod
from projections import schedulers as schedulers_mod
from projections import status as status_mod
from projections.checkpoints import CheckpointsState, fold_checkpoints
from projections.counters import CountersAccumulator, fold_counters
from projections.commits import AFTER_RUN_KINDS, CLOSING_KINDS, GROUP_KINDS, commits, commits_all
from projections.history import HistoryState, fold_history
from projections.schedulers import SchedulersState, fold_schedulers
from projections.status import StatusState, fold_status

__all__ = ["CLOSING_KINDS", "GROUP_KINDS", "MicrobatchRequired", "Projections", "Projector", "committed", "fold",
           "project", "tail_length"]



class Projections(msgspec.Struct, frozen=True, kw_only=True):
    """Every projection's state, plus the seq of the last folded event (``-1``: none)."""

    history: HistoryState = HistoryState()
    checkpoints: CheckpointsState = CheckpointsState()
    schedulers: SchedulersState = SchedulersState()
    counters: Counters = Counters()
    status: StatusState = StatusState()
    seq: int = -1


def fold(state: Projections, seq: int, event: Event) -> Projections:
    """Fold one committed event into every projection (pure)."""
    return Projections(
        history=fold_history(state.history, event),
        checkpoints=fold_checkpoints(state.checkpoints, event),
        schedulers=fold_schedulers(state.schedulers, event),
        counters=fold_counters(state.counters, event),
        status=fold_status(state.status, event),
        seq=seq,
    )


def _committed(pairs: Iterable[tuple[int, Event]], tail: list[int], in_group: bool = False) -> Iterator[tuple[int, Event]]:
    pending: list[tuple[int, Event]] = []
    for seq, event in pairs:
        t = type(event)
        if t is RunResumed:
            pending.clear()
            in_group = False
            yield seq, event
            continue
        if in_group:
            if event.KIND in GROUP_KINDS:
                yield seq, event
                continue
            in_group = False
        if t is LastCommitted:
            covers = event.covers  # type: ignore[attr-defined]
            if commits_all(covers) or not pending or pending[-1][0] <= covers:
                yield from pending
                pending.clear()
            else:  # a deferred LAST: later events stay pending, its own checkpoint_stored is committed
                keep = []
                for p in pending:
                    if commits(covers, p[0], p[1].KIND):
                        yield p
                    else:
                        keep.append(p)
                pending = keep
            yield seq, event
            in_group = True
            continue
        pending.append((seq, event))
    tail.append(len(pending))
    end = len(pending)
    while end and pending[end - 1][1].KIND in AFTER_RUN_KINDS:  # evaluations recorded after the run
        end -= 1
    if end and type(pending[end - 1][1]) is RunFinalized:
        closing = [(s, e) for s, e in pending if e.KIND in CLOSING_KINDS]
        tail[-1] -= len(closing)
        yield from closing


def committed(pairs: Iterable[tuple[int, Event]], *, in_group: bool = False) -> Iterator[tuple[int, Event]]:
    """Yield the committed ``(seq, event)`` pairs of a log (see the module docstring).

    ``pairs`` may start after seq 0 where the view holds nothing back (a projection snapshot's
    seq + 1); ``in_group``: whether the event before them is a LAST or in its commit group
    (:attr:`projections.snapshots.Snapshot.in_group`).
    """
    return _committed(pairs, [], in_group)


def tail_length(pairs: Iterable[tuple[int, Event]]) -> int:
    """How many events the committed view leaves out after the last resume (the uncommitted tail)."""
    tail: list[int] = []
    for _ in _committed(pairs, tail):
        pass
    return tail[0]


_FOLDS = (
    ("history", fold_history, history_mod.FOLDED),
    ("checkpoints", fold_checkpoints, checkpoints_mod.FOLDED),
    ("schedulers", fold_schedulers, schedulers_mod.FOLDED),
    ("status", fold_status, status_mod.FOLDED),
)
_BY_TYPE: dict[type, tuple[tuple[int, Callable[[Any, Event], Any]], ...]] = {}
for _i, (_name, _fn, _types) in enumerate(_FOLDS):
    for _t in _types:
        _BY_TYPE[_t] = (*_BY_TYPE.get(_t, ()), (_i, _fn))

#: the event types a projection other than the counters folds (every other type is only counted)
FOLDED_BEYOND_COUNTERS: frozenset[type] = frozenset(_BY_TYPE)


#: a ``microbatch_done`` as a fold that only counts it reads it: its required fields checked,
#: ``terms`` skipped (for :func:`events.codec.partial_decoder`; the projections and the curves use it)
MicrobatchRequired = partial_type(MicrobatchDone)

#: an ``update_committed`` as the projections read it: its required fields checked, the step and
#: the data-parallel size kept, its other optional ones (``lrs``, ``grad_norm``, ...) skipped
_StepReceipt = partial_type(UpdateCommitted, "data_parallel_size")


#: decodes a stored chunk for :func:`project`: the frequent kinds to what the folds read
_decode_for_folds = partial_decoder({MicrobatchDone: MicrobatchRequired, UpdateCommitted: _StepReceipt})


_MICROBATCH, _RECEIPT, _EPOCH_BEGAN, _EPOCH_SUMMARIZED, _RESUMED, _FINALIZED = (
    TYPE_CODES[t] for t in (MicrobatchDone, UpdateCommitted, EpochBegan, EpochSummarized, RunResumed, RunFinalized)
)


def _marks(types: Iterable[type]) -> bytes:
    """A ``bytes.translate`` table: the codes of ``types`` to 1, every other code to 0."""
    table = bytearray(256)
    for t in types:
        table[TYPE_CODES[t]] = 1
    return bytes(table)


_IS_BOUNDARY = _marks([LastCommitted, RunResumed])
_IS_GROUP = _marks(t for t in EVENT_TYPES if t.KIND in GROUP_KINDS)
_IS_CLOSING = _marks(t for t in EVENT_TYPES if t.KIND in CLOSING_KINDS)
_IS_AFTER_RUN = _marks(t for t in EVENT_TYPES if t.KIND in AFTER_RUN_KINDS)
_IS_CHECKPOINT = _marks([CheckpointStored])
_IS_RECEIPT = _marks([UpdateCommitted])
_IS_OTHER = _marks(_BY_TYPE)  # folded by a projection other than the counters
_NOT = bytes([1]) + bytes(255)  # for masks of 0 and 1

#: ``(seqs, events, codes)``: consecutive events of the log, in log order, and their type codes
_Segment = tuple[Sequence[int], Sequence[Any], bytes]


class Projector:
    """The committed view and every projection, folded a segment at a time.

    Fed the log's events in order (:meth:`feed`), it keeps the state of
    :func:`committed` (the pending events, as segments; whether a LAST's group is
    open) and folds each committed segment at once. Events are classified by one
    byte each (:data:`~events.codec.TYPE_CODES`), so finding commit markers and
    counting microbatches are ``bytes`` searches; the counters are folded by
    counting, the other projections event by event over the few events they react to.

    It can be fed a log in pieces (:meth:`feed_chunk`, :meth:`feed_pairs`): a writer keeps
    one open to snapshot its run (:mod:`projections.snapshots`), whose state it freezes
    (:meth:`state`) whenever the view holds nothing back (:attr:`clean`). ``start`` and
    ``in_group`` resume one from such a state: the projections of the log up to
    ``start.seq``... and whether that point sits in a LAST's commit group.
    """

    __slots__ = ("states", "records", "counters", "last", "pending", "in_group")

    def __init__(self, start: Projections, in_group: bool = False) -> None:
        self.states: list[Any] = [start.history, start.checkpoints, start.schedulers, start.status]
        #: the history projection's records, appended in place (a tuple per record would be O(epochs²))
        self.records: list[HistoryRecord] = list(start.history.records)
        self.counters = CountersAccumulator(start.counters)
        self.last = start.seq
        self.pending: list[_Segment] = []
        self.in_group = in_group

    @property
    def clean(self) -> bool:
        """Whether the committed view holds nothing back: every event fed is folded."""
        return not self.pending

    def feed_chunk(self, first: int, values: Sequence[bytes]) -> None:
        """Feed a stored chunk (:data:`~events.chunks.RawChunk`), decoding what the folds read.

        Raises:
            CorruptEventError: a value does not decode (names its seq); nothing of the chunk is fed.
        """
        self.feed(range(first, first + len(values)), *_decode_for_folds(values, first))

    def feed_pairs(self, pairs: Iterable[tuple[int, Event]]) -> None:
        """Feed decoded ``(seq, event)`` pairs in seq order (a :class:`~events.chunks.StoredPairs`
        is taken as its undecoded chunks)."""
        chunks = pairs.raw_chunks() if isinstance(pairs, StoredPairs) else None
        if chunks is not None:
            for first, values in chunks:
                self.feed_chunk(first, values)
            return
        it = iter(pairs)
        while batch := list(itertools.islice(it, 1024)):
            seqs, events = zip(*batch)
            self.feed(seqs, events, type_codes(events))

    def state(self) -> Projections:
        """The projections of what was fed, without a finalized tail's closing events; only while
        :attr:`clean` (the state a snapshot holds; then :meth:`finish` returns the same).

        Raises:
            ValueError: the view holds events back (not clean).
        """
        if self.pending:
            raise ValueError(f"the committed view holds {sum(len(s[0]) for s in self.pending)} events back: "
                             "no state to snapshot")
        s = self.states
        return Projections(
            history=HistoryState(records=tuple(self.records)), checkpoints=s[1], schedulers=s[2],
            counters=self.counters.freeze(), status=s[3], seq=self.last,
        )

    def feed(self, seqs: Sequence[int], events: Sequence[Any], codes: bytes) -> None:
        """Take the next events of the log: ``seqs[i]`` is the seq of ``events[i]``, ``codes[i]`` its type code."""
        n = len(codes)
        bounds = codes.translate(_IS_BOUNDARY)
        group = b""
        i = 0
        while True:
            if self.in_group:
                group = group or codes.translate(_IS_GROUP)
                j = group.find(0, i)
                j = n if j < 0 else j
                if j > i:
                    self.fold(seqs[i:j], events[i:j], codes[i:j])
                if j < n:  # any other event closes the group
                    self.in_group = False
                i = j
            b = bounds.find(1, i)
            b = n if b < 0 else b
            if i < b:
                self.pending.append((seqs[i:b], events[i:b], codes[i:b]))
            if b == n:
                return
            if codes[b] == _RESUMED:
                self.pending.clear()
            else:
                self._commit(events[b].covers, seqs[b])
                self.in_group = True
            self.fold(seqs[b : b + 1], events[b : b + 1], codes[b : b + 1])
            i = b + 1

    def _commit(self, covers: int, at: int = -1) -> None:
        """Fold what a LAST commits: every pending event, or, deferred, those up to ``covers`` and checkpoints.

        ``at``: the LAST's seq (for a subclass that folds with checks: the point the log was read to)."""
        pending = self.pending
        if not pending:
            return
        if commits_all(covers) or pending[-1][0][-1] <= covers or self._only_checkpoints_after(covers):
            for segment in pending:
                self.fold(*segment)
            pending.clear()
            return
        keep: list[_Segment] = []
        for segment in pending:
            seqs, _, codes = segment
            done = bytes(map(covers.__ge__, seqs))
            checkpoints = codes.translate(_IS_CHECKPOINT)
            if 1 in checkpoints:
                done = bytes(map(or_, done, checkpoints))
            if 1 in done:
                self.fold(*_select(segment, done))
            if 0 in done:
                keep.append(_select(segment, done.translate(_NOT)))
        self.pending = keep

    def _only_checkpoints_after(self, covers: int) -> bool:
        """Whether every pending event after seq ``covers`` is a ``checkpoint_stored`` -- a LAST's own
        checkpoint after the history it covers, as every epoch's commit writes it: then the LAST
        commits all that is pending, in order."""
        for seqs, _, codes in reversed(self.pending):
            after = codes[bisect.bisect_right(seqs, covers):]
            if 0 in after.translate(_IS_CHECKPOINT):
                return False
            if len(after) < len(codes):  # this segment reaches back to covers: nothing earlier is after it
                return True
        return True

    def fold(self, seqs: Sequence[int], events: Sequence[Any], codes: bytes) -> None:
        """Fold committed events, in order, into every projection."""
        self.last = seqs[-1]
        acc = self.counters  # the counters fold (CountersAccumulator.apply), by counting
        done = codes.count(_MICROBATCH)
        acc.batch += done
        k = codes.rfind(_EPOCH_BEGAN)
        acc.epoch_step = codes.count(_MICROBATCH, k) if k >= 0 else acc.epoch_step + done
        k = codes.rfind(_EPOCH_SUMMARIZED)
        if k >= 0:
            acc.epoch = events[k].epoch + 1
        if _RECEIPT in codes:
            step, added = acc.step, 0
            for receipt in itertools.compress(events, codes.translate(_IS_RECEIPT)):
                if receipt.step != step:  # else another optimizer's receipt of the same commit
                    step = receipt.step
                    added += receipt.data_parallel_size
            acc.step = step
            acc.global_step += added
        others = codes.translate(_IS_OTHER)
        if 1 in others:
            states, by_type, records = self.states, _BY_TYPE, self.records
            for event in itertools.compress(events, others):
                for index, fn in by_type[type(event)]:
                    if index == 0:  # fold_history: append its record
                        records.append(event.record)
                    else:
                        states[index] = fn(states[index], event)

    def finish(self) -> Projections:
        """Fold the closing events of a tail that ends in ``RunFinalized``; return the aggregate."""
        pending = self.pending
        if pending and _ends_finalized(pending):
            for segment in pending:
                closing = segment[2].translate(_IS_CLOSING)
                if 1 in closing:
                    self.fold(*_select(segment, closing))
        s = self.states
        return Projections(
            history=HistoryState(records=tuple(self.records)), checkpoints=s[1], schedulers=s[2],
            counters=self.counters.freeze(), status=s[3], seq=self.last,
        )


def _ends_finalized(pending: Sequence[_Segment]) -> bool:
    """Whether the pending tail's last event, evaluations recorded after the run aside, is ``run_finalized``."""
    for _, _, codes in reversed(pending):
        k = codes.translate(_IS_AFTER_RUN).rfind(0)
        if k >= 0:
            return codes[k] == _FINALIZED
    return False


def _select(segment: _Segment, mask: bytes) -> _Segment:
    """The events of ``segment`` whose mask byte is 1, in order."""
    seqs, events, codes = segment
    return (
        list(itertools.compress(seqs, mask)),
        list(itertools.compress(events, mask)),
        bytes(itertools.compress(codes, mask)),
    )


def project(pairs: Iterable[tuple[int, Event]], start: Projections | None = None) -> Projections:
    """Fold the committed view of ``pairs`` into :class:`Projections`.

    Equal to folding :func:`fold` over :func:`committed` (tested by property), but
    folded a segment at a time. Given the :class:`~events.chunks.StoredPairs` of a
    log's ``read()``, it takes the stored chunks and decodes the two frequent kinds
    as far as the folds need them (``microbatch_done`` is counted, ``update_committed``
    gives its step and data-parallel size): their required fields are checked, their
    other optional fields (``terms``; ``lrs``, ``grad_norm``, ...) skipped, so a value
    malformed only there is folded here, while ``read()`` and the audit refuse it.
    Any other pairs are folded as given.

    Raises:
        CorruptEventError: a stored value does not decode (names its seq).
    """
    projector = Projector(start if start is not None else Projections())
    projector.feed_pairs(pairs)
    return projector.finish()
