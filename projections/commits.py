"""The commit vocabulary, declared once: which events form a LAST's group, which close a run,
and what a (possibly deferred) LAST commits.

Every reader of the log's commit structure imports these names: the lifecycle machine
(:mod:`nnx_es.lifecycle`), the committed view (:mod:`projections.view`), resume
(:mod:`nnx_es.resume`) and the audit (:mod:`nnx_es.audit`). Semantics: spec 000,
"durable commit order"; DESIGN.md "The log".

* A ``last_committed`` is the commit marker. The events right after it whose kinds are in
  :data:`GROUP_KINDS` belong to its commit group (BEST, phase, callback checkpoints and the
  ``checkpoint_stored`` of a callback's blob) and are committed with it.
* A LAST's ``covers`` says what it commits (:func:`commits`): ``covers < 0`` (an inline
  commit) commits every event before it; ``covers >= 0`` (a deferred LAST, appended while
  the next epoch already runs) commits the events up to seq ``covers`` and every
  ``checkpoint_stored`` (its own), leaving the next epoch's events pending.
* A durable ``run_finalized`` also commits the :data:`CLOSING_KINDS` of its tail (how the
  run ended), nothing else of it; the ``evaluation_recorded`` and ``model_exported`` events
  appended (synced) after it are closing kinds too (:data:`AFTER_RUN_KINDS`: they belong to no commit).
"""

from __future__ import annotations

__all__ = ["AFTER_RUN_KINDS", "CLOSING_KINDS", "GROUP_KINDS", "GroupTracker", "commits", "commits_all"]

#: Kinds that belong to the commit group of the LAST they follow.
GROUP_KINDS: frozenset[str] = frozenset(
    {"best_committed", "phase_committed", "callback_checkpointed", "checkpoint_stored", "checkpoint_pruned"}
)

#: Kinds folded from a tail that ends in a durable ``run_finalized``.
CLOSING_KINDS: frozenset[str] = frozenset(
    {"stop_requested", "run_failed", "callback_finalized", "run_finalized", "evaluation_recorded", "model_exported"}
)

#: Kinds a finalized run may append after its ``run_finalized`` (the tail still ends the run).
AFTER_RUN_KINDS: frozenset[str] = frozenset({"evaluation_recorded", "model_exported"})


def commits_all(covers: int) -> bool:
    """Whether a LAST with this ``covers`` commits every event before it (an inline commit)."""
    return covers < 0


def commits(covers: int, seq: int, kind: str) -> bool:
    """Whether a LAST with this ``covers`` commits the pending event ``seq`` of ``kind``."""
    return covers < 0 or seq <= covers or kind == "checkpoint_stored"


class GroupTracker:
    """Follows a log in order and says which events sit in the commit group of the LAST before them.

    ``see(kind)`` returns True for a ``last_committed`` and for each event of its group
    (:data:`GROUP_KINDS` right after it); any other event closes the group.
    """

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = False

    def see(self, kind: str) -> bool:
        if kind == "last_committed":
            self.open = True
        elif not (self.open and kind in GROUP_KINDS):
            self.open = False
        return self.open
