"""History projection: one record per committed epoch, in epoch order."""

from __future__ import annotations

import msgspec

from events.schema import Event, HistoryAppended, HistoryRecord

__all__ = ["FOLDED","HistoryState", "fold_history"]


class HistoryState(msgspec.Struct, frozen=True, kw_only=True):
    records: tuple[HistoryRecord, ...] = ()


def fold_history(state: HistoryState, event: Event) -> HistoryState:
    match event:
        case HistoryAppended(record=record):
            return HistoryState(records=(*state.records, record))
        case _:
            return state


#: The event types fold_history reacts to; every other event leaves its state unchanged (tested).
FOLDED: tuple[type[Event], ...] = (HistoryAppended,)
