"""One streaming pass that folds the committed view and measures the uncommitted tail."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from events.schema import Counters, Event, HistoryAppended, HistoryRecord, RunResumed
from projections import Projections, committed
from projections import checkpoints as checkpoints_mod
from projections import counters as counters_mod
from projections import schedulers as schedulers_mod
from projections import status as status_mod
from projections.checkpoints import CheckpointsState
from projections.counters import CountersAccumulator
from projections.history import HistoryState
from projections.schedulers import SchedulersState
from projections.status import StatusState

#: event type -> the (state index, fold) pairs that react to it (``FOLDED`` of each projection;
#: every other event leaves a projection's state unchanged, tested there); history and the
#: counters are folded in place
_FOLDS: dict[type, list[tuple[int, Callable[[Any, Event], Any]]]] = {}
for _i, _mod, _fn in ((0, checkpoints_mod, checkpoints_mod.fold_checkpoints),
                      (1, schedulers_mod, schedulers_mod.fold_schedulers), (2, status_mod, status_mod.fold_status)):
    for _t in _mod.FOLDED:
        _FOLDS.setdefault(_t, []).append((_i, _fn))
_COUNTED = frozenset(counters_mod.FOLDED)

__all__ = ["CommittedFold"]


class CommittedFold:
    """Iterate ``(seq, event, fold)`` over the committed view of ``pairs``, folding as it goes (``fold.p``:
    the projections so far).

    The committed view (:func:`projections.committed`) is not a prefix in seq
    order: a deferred LAST commits its epoch while later events stay pending.
    So the pass counts, since the last ``run_resumed``, the events read and the
    events the view has yielded; the difference is what the view holds back.

    After iteration:

    * ``p``: the projection of the whole log; ``max_seq``: the highest committed seq;
    * ``tail``: events the committed view leaves out (:func:`projections.tail_length`);
    * ``closing``: closing events a finalized tail contributed at the end, and
      ``before_closing`` the projection just before them;
    * ``restart`` / ``restart_seq``: the projection at the last point where the
      view held nothing back; folding the committed view of the events after
      ``restart_seq`` onto ``restart`` gives the same state as the whole pass.

    The input is read once; memory is what :func:`projections.committed` holds back. Each
    event is folded into the projections that react to it, in place; ``p`` (also yielded, as
    the fold itself: read ``.p`` for the projections) is built only when read, so a pass over
    ten million microbatches builds it about once an epoch, not once an event.
    """

    def __init__(self, pairs: Iterable[tuple[int, Event]]) -> None:
        self._pairs = pairs
        self._records: list[HistoryRecord] = []
        self._states: list[Any] = [CheckpointsState(), SchedulersState(), StatusState()]
        self._counters = CountersAccumulator(Counters())
        self._seq = -1
        self._cache: Projections | None = Projections()
        self.before_closing = self._cache
        self.restart, self.restart_seq = self._cache, -1
        self.max_seq = -1
        self.last_read = -1  # seq of the last event read
        self.closing = 0
        self.read = 0  # decodable events read since the last run_resumed (it included)
        self.yielded = 0  # of those, yielded by the committed view before the input ended
        self.exhausted = False

    @property
    def p(self) -> Projections:
        """The projections of the committed events folded so far."""
        if self._cache is None:
            s = self._states
            self._cache = Projections(history=HistoryState(records=tuple(self._records)), checkpoints=s[0],
                                      schedulers=s[1], counters=self._counters.freeze(), status=s[2], seq=self._seq)
        return self._cache

    @property
    def tail(self) -> int:
        return self.read - self.yielded - self.closing

    def _source(self) -> Iterator[tuple[int, Event]]:
        for seq, event in self._pairs:
            if type(event) is RunResumed:  # the view drops what it held back
                self.read = self.yielded = 0
            self.read += 1
            self.last_read = seq
            yield seq, event
        self.exhausted = True

    def _fold(self, seq: int, event: Event) -> None:
        t = type(event)
        if t in _COUNTED:
            self._counters.apply(event)
        elif t is HistoryAppended:
            self._records.append(event.record)  # type: ignore[attr-defined]
        folds = _FOLDS.get(t)
        if folds is not None:
            states = self._states
            for index, fn in folds:
                states[index] = fn(states[index], event)
        self._seq = seq
        self._cache = None

    def __iter__(self) -> Iterator[tuple[int, Event, CommittedFold]]:
        for seq, event in committed(self._source()):
            if self.exhausted and not self.closing:
                self.before_closing = self.p
            self._fold(seq, event)
            self.max_seq = max(self.max_seq, seq)
            if self.exhausted:
                self.closing += 1
            else:
                self.yielded += 1
                if self.read == self.yielded:  # nothing held back: a fresh view may restart after seq
                    self.restart, self.restart_seq = self.p, seq
            yield seq, event, self
