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
  a stopped or failed run is known while its unfinished epoch stays out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec

from events.schema import Counters, Event, LastCommitted, RunFinalized, RunResumed
from projections import checkpoints as checkpoints_mod
from projections import history as history_mod
from projections import schedulers as schedulers_mod
from projections import status as status_mod
from projections.checkpoints import CheckpointsState, fold_checkpoints
from projections.counters import CountersAccumulator, fold_counters
from projections.history import HistoryState, fold_history
from projections.schedulers import SchedulersState, fold_schedulers
from projections.status import StatusState, fold_status

__all__ = ["CLOSING_KINDS", "GROUP_KINDS", "Projections", "committed", "fold", "project", "tail_length"]

#: Kinds folded from a tail that ends in a durable ``RunFinalized``.
CLOSING_KINDS = frozenset({"stop_requested", "run_failed", "callback_finalized", "run_finalized"})


#: Kinds that belong to the commit group of the LAST they follow.
GROUP_KINDS = frozenset({"best_committed", "phase_committed", "callback_checkpointed", "checkpoint_stored"})


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


def _committed(pairs: Iterable[tuple[int, Event]], tail: list[int]) -> Iterator[tuple[int, Event]]:
    pending: list[tuple[int, Event]] = []
    in_group = False
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
            if covers < 0 or not pending or pending[-1][0] <= covers:
                yield from pending
                pending.clear()
            else:  # a deferred LAST: later events stay pending, its own checkpoint_stored is committed
                keep = []
                for p in pending:
                    if p[0] <= covers or p[1].KIND == "checkpoint_stored":
                        yield p
                    else:
                        keep.append(p)
                pending = keep
            yield seq, event
            in_group = True
            continue
        pending.append((seq, event))
    tail.append(len(pending))
    if pending and type(pending[-1][1]) is RunFinalized:
        closing = [(s, e) for s, e in pending if e.KIND in CLOSING_KINDS]
        tail[-1] -= len(closing)
        yield from closing


def committed(pairs: Iterable[tuple[int, Event]]) -> Iterator[tuple[int, Event]]:
    """Yield the committed ``(seq, event)`` pairs of a log (see the module docstring)."""
    return _committed(pairs, [])


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


def project(pairs: Iterable[tuple[int, Event]], start: Projections | None = None) -> Projections:
    """Fold the committed view of ``pairs`` into :class:`Projections`.

    Equal to folding :func:`fold` over :func:`committed` (tested), but each
    event only visits the projections that react to it, and the counters are
    folded in place and frozen once.
    """
    state = start if start is not None else Projections()
    states: list[Any] = [state.history, state.checkpoints, state.schedulers, state.status]
    acc = CountersAccumulator(state.counters)
    apply = acc.apply
    by_type = _BY_TYPE
    last = state.seq
    for seq, event in committed(pairs):
        last = seq
        apply(event)
        folds = by_type.get(type(event))
        if folds is not None:
            for index, fn in folds:
                states[index] = fn(states[index], event)
    return Projections(
        history=states[0], checkpoints=states[1], schedulers=states[2], counters=acc.freeze(), status=states[3],
        seq=last,
    )
