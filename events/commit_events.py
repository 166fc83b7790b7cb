"""The commit group's events (spec 000, durable commit order): ``checkpoint_stored``, then LAST and the
pointers and callback checkpoints committed with it, and the retention's ``checkpoint_pruned``. Part of
the event vocabulary (:mod:`events.schema`, which imports them: import them from there).
"""

from __future__ import annotations

from typing import ClassVar

from events.base import Event
from events.values import Counters

__all__ = ["BestCommitted", "CallbackCheckpointed", "CheckpointPruned", "CheckpointStored", "LastCommitted",
           "PhaseCommitted"]


class CheckpointStored(Event, frozen=True, kw_only=True, tag="checkpoint_stored"):
    """A checkpoint is stored: its large components as files under ``blobs/`` (durable before
    this event is written), its manifest (holding the small components) as a blob of the log,
    written in the same transaction as this event and the LAST after it.

    components: component name -> blob SHA-256 (hex). bytes: total size of the components.
    """

    KIND: ClassVar[str] = "checkpoint_stored"
    manifest: str
    epoch: int
    step: int
    components: dict[str, str]
    bytes: int = 0


class LastCommitted(Event, frozen=True, kw_only=True, tag="last_committed"):
    """LAST now names ``manifest``: the commit marker. Synced before it is acknowledged.

    epoch: the 0-based index of the last epoch the checkpoint contains
    (``-1`` before any epoch). final: the refresh after finalization.
    covers: the seq of the last event this commit makes durable; ``-1`` means
    every event before this one. A deferred commit (written while the next
    epoch already runs) covers its epoch's ``history_appended`` only.
    """

    KIND: ClassVar[str] = "last_committed"
    manifest: str
    epoch: int
    step: int
    counters: Counters
    final: bool = False
    covers: int = -1


class BestCommitted(Event, frozen=True, kw_only=True, tag="best_committed"):
    KIND: ClassVar[str] = "best_committed"
    manifest: str
    epoch: int
    monitor: str
    value: float


class PhaseCommitted(Event, frozen=True, kw_only=True, tag="phase_committed"):
    """A phase checkpoint (every N epochs). removed: phase names rotated out."""

    KIND: ClassVar[str] = "phase_committed"
    name: str
    manifest: str
    epoch: int
    removed: list[str] = []


class CallbackCheckpointed(Event, frozen=True, kw_only=True, tag="callback_checkpointed"):
    """A callback's deferred checkpoint, written after LAST/BEST/phase."""

    KIND: ClassVar[str] = "callback_checkpointed"
    name: str
    epoch: int
    blob: str


class CheckpointPruned(Event, frozen=True, kw_only=True, tag="checkpoint_pruned"):
    """Retention deleted a checkpoint no kept pointer names, in the commit group of the LAST that
    superseded it (the deletion follows that group's synced write, so a crash leaves the bytes,
    never a LAST without them).

    manifest: its SHA-256 (hex); epoch: its 0-based epoch; reason: the rule that let it go
    (e.g. ``"keep_last=1"``); blobs: the blob SHA-256s deleted with it (the manifest and the
    component files no kept checkpoint shares).
    """

    KIND: ClassVar[str] = "checkpoint_pruned"
    manifest: str
    epoch: int
    reason: str
    blobs: list[str] = []


# --- ending ----------------------------------------------------------------------------
