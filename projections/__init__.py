"""Pure folds over the event log: history, checkpoints, schedulers, counters, status; their snapshots.

No I/O, no clock, no torch: ``fold(state, event) -> state``.
"""

from projections.checkpoints import CheckpointsState, Pointer, fold_checkpoints
from projections.counters import fold_counters
from projections.history import HistoryState, fold_history
from projections.schedulers import SchedulersState, SchedulerState, fold_schedulers
from projections.status import StatusState, fold_status
from projections.commits import CLOSING_KINDS
from projections.view import Projections, Projector, committed, fold, project, tail_length
from projections.snapshots import Snapshot, SnapshotFolder, decode_snapshot, encode_snapshot

__all__ = [
    "CLOSING_KINDS",
    "CheckpointsState",
    "HistoryState",
    "Pointer",
    "Projections",
    "Projector",
    "SchedulerState",
    "SchedulersState",
    "Snapshot",
    "SnapshotFolder",
    "StatusState",
    "committed",
    "decode_snapshot",
    "encode_snapshot",
    "fold",
    "fold_checkpoints",
    "fold_counters",
    "fold_history",
    "fold_schedulers",
    "fold_status",
    "project",
    "tail_length",
]
