"""The training lifecycle, declared once as data (states + transitions table).

Triggers are event kinds (:data:`events.KINDS`): a transition is legal when
the machine accepts the event's kind in its current state. The declaration
serves twice:

* the runtime (:class:`Lifecycle`) checks each event before it is appended;
* the audit (``tools/replay``) feeds a recorded log through the same machine.

Both use :func:`compiled_table`, a ``(state, kind) -> state`` dict built from
:data:`TRANSITIONS`; :func:`build_machine` builds the equivalent
``transitions.Machine`` (queued, as STYLE.md asks), and a test proves the two
agree on every (state, kind) pair. Order of one run (spec 000 "Lifecycle order")::

    run_started  callback_began*  train_began  checkpoint_stored?  last_committed(initial)
      (with checkpoint_lag > 0 a new run's initial LAST is deferred into its first epoch, like any epoch's)
      ( epoch_began
          ( microbatch_done+  (update_committed+ scheduler_stepped* params_digested? | update_skipped) )*
          params_digested?
          validation_done?  epoch_summarized  monitor_decided?  scheduler_stepped*
          diagnostics_recorded*  stop_requested?  (rows_recorded* | journal_published)?  history_appended
          checkpoint_stored?  last_committed
          best_committed?  phase_committed?  (checkpoint_stored? callback_checkpointed)*  checkpoint_pruned* )*
      params_digested(final)?  validation_done(final)?  callback_finalized* (reverse order)  checkpoint_stored?
      last_committed(final)
      checkpoint_pruned*  run_finalized
    failure anywhere:  run_failed  callback_finalized*  run_finalized
    stop at an update boundary:  ... update_committed  stop_requested  params_digested(final)?  callback_finalized*
      run_finalized
    resume:  run_resumed  world_changed?  callback_began*  train_began  ...
    after the run:  run_finalized  (evaluation_recorded | model_exported)*
    transforms:  model_transformed after the opening (after world_changed, before callback_began), after
      epoch_began, or at the epoch's end before its history (nnx_es.transforms)
"""

from __future__ import annotations

from functools import cache
from typing import Any

from events.codec import KINDS
from events.errors import NnxError
from projections.commits import GROUP_KINDS

__all__ = [
    "BASE_STATES",
    "DEFERRABLE",
    "INITIAL",
    "JUST_COMMITTED",
    "PENDING",
    "STATES",
    "TRANSITIONS",
    "IllegalTransitionError",
    "Lifecycle",
    "build_machine",
    "compiled_table",
]

INITIAL = "new"

#: Base states of the lifecycle machine (see :data:`STATES` for all, derived ones included).
BASE_STATES: tuple[str, ...] = (
    "new",  # nothing written yet
    "started",  # run_started / run_resumed: callbacks begin
    "training",  # train_began: the initial LAST is being committed
    "in_epoch",  # epoch_began, or after a window closed
    "in_window",  # microbatches of an open accumulation window
    "updated",  # a window committed: more receipts / opt-clock scheduler steps
    "validated",
    "summarized",
    "decided",
    "scheduled",
    "recorded",  # history_appended: the epoch waits for its LAST
    "committed",  # LAST for the epoch is durable
    "stopping",  # stopped at an update boundary
    "failed",
    "finalizing",  # callbacks are being finalized
    "closed",  # final LAST refreshed
    "finalized",
)

_IN_EPOCH_QUIET = ["in_epoch", "updated"]  # no window open
_EPOCH_END = ["summarized", "decided", "scheduled"]
_ALIVE = [s for s in BASE_STATES if s not in ("new", "failed", "finalizing", "closed", "finalized")]


def _t(trigger: str, source: str | list[str], dest: str) -> dict[str, Any]:
    return {"trigger": trigger, "source": source, "dest": dest}


_BASE: tuple[dict[str, Any], ...] = (
    _t("run_started", "new", "started"),
    _t("callback_began", "started", "started"),
    # an elastic run's new deal of its global batch (nnx_es.distributed.resize), before callbacks begin
    _t("world_changed", "started", "started"),
    _t("train_began", "started", "training"),
    _t("epoch_began", "committed", "in_epoch"),
    _t("microbatch_done", ["in_epoch", "in_window", "updated", "validated"], "in_window"),
    _t("update_committed", ["in_window", "updated"], "updated"),
    _t("update_skipped", "in_window", "in_epoch"),
    _t("scheduler_stepped", "updated", "updated"),
    # data parallelism: the ranks' parameter digests, after an update or at the epoch's last one
    _t("params_digested", [*_IN_EPOCH_QUIET, "validated"], "="),
    # ... and once more at the end of training, at the final step, when the cadence's last was not of it
    _t("params_digested", ["committed", "stopping"], "="),
    _t("validation_done", [*_IN_EPOCH_QUIET, "validated"], "validated"),
    # the final validation once training ended (after the last epoch's commit, or a stop at an update)
    _t("validation_done", ["committed", "stopping"], "="),
    _t("epoch_summarized", [*_IN_EPOCH_QUIET, "validated"], "summarized"),
    _t("monitor_decided", "summarized", "decided"),
    _t("scheduler_stepped", ["summarized", "decided", "scheduled"], "scheduled"),
    _t("stop_requested", _EPOCH_END, "scheduled"),
    # a resumed run that had decided to stop records that it stops before any epoch
    _t("stop_requested", "committed", "committed"),
    # the epoch's per-row records (nnx_es.rows), at its history step, before its history
    _t("rows_recorded", _EPOCH_END, "="),
    _t("journal_published", _EPOCH_END, "="),
    # per-layer diagnostics of the epoch's updates (nnx_es.diagnostics), written by its on_epoch_end
    _t("diagnostics_recorded", _EPOCH_END, "="),
    _t("history_appended", _EPOCH_END, "recorded"),
    _t("checkpoint_stored", ["recorded", "committed", "finalizing", "training"], "="),
    _t("last_committed", ["training", "recorded"], "committed"),
    _t("best_committed", "committed", "committed"),
    _t("phase_committed", "committed", "committed"),
    _t("callback_checkpointed", "committed", "committed"),
    _t("checkpoint_pruned", ["committed", "closed"], "="),  # retention, in a LAST's group (the final one too)
    _t("stop_requested", ["updated", "validated"], "stopping"),
    _t("callback_finalized", ["committed", "stopping", "finalizing"], "finalizing"),
    _t("last_committed", ["committed", "finalizing"], "closed"),
    _t("run_finalized", ["closed", "stopping", "finalizing"], "finalized"),
    _t("run_failed", _ALIVE + ["finalizing", "closed"], "failed"),
    _t("callback_finalized", "failed", "failed"),
    _t("run_finalized", "failed", "finalized"),
    # an evaluation of one of the run's checkpoints, recorded after the run (NNModel.evaluate)
    _t("evaluation_recorded", "finalized", "finalized"),
    # a model transform (nnx_es.transforms): the ones a session applied before training, after its opening;
    # a callback's at an epoch boundary (on_epoch_begin, or on_epoch_end before the epoch's history)
    _t("model_transformed", ["started", "in_epoch", *_EPOCH_END], "="),
    # an export of one of the run's checkpoints, verified and recorded after the run (nnx_es.export)
    _t("model_exported", "finalized", "finalized"),
)

#: States of the epoch body in which the previous epoch's LAST may still be in flight.
DEFERRABLE: tuple[str, ...] = (
    "in_epoch", "in_window", "updated", "validated", "summarized", "decided", "scheduled", "stopping",
)
#: Suffix of a deferrable state while the previous epoch's LAST is pending.
PENDING = "~"
#: Suffix of a deferrable state right after that LAST committed (its BEST/phase/callback group may follow).
JUST_COMMITTED = "^"
_GROUP = tuple(sorted(GROUP_KINDS))


def _deferred(base: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Rows for a deferred LAST commit (``Trainer(checkpoint_lag=N)``).

    The epoch after ``history_appended`` may begin before its LAST is durable
    (state ``recorded`` -> ``in_epoch~``). In a pending state ``s~`` the epoch
    body moves as in ``s`` but may not append history; ``checkpoint_stored`` and
    ``last_committed`` lead to ``s^``, which accepts the LAST's group and
    otherwise moves exactly as ``s``.
    """
    rows: list[dict[str, Any]] = []
    for row in base:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        for src in sources:
            if src not in DEFERRABLE:
                continue
            dest = src if row["dest"] == "=" else row["dest"]
            if dest in DEFERRABLE:
                rows.append(_t(row["trigger"], src + PENDING, dest + PENDING))
            elif dest == "failed":
                rows.append(_t(row["trigger"], src + PENDING, dest))
            rows.append(_t(row["trigger"], src + JUST_COMMITTED, dest))
    for st in DEFERRABLE:
        rows.append(_t("checkpoint_stored", st + PENDING, st + PENDING))
        rows.append(_t("last_committed", st + PENDING, st + JUST_COMMITTED))
        rows.extend(_t(kind, st + JUST_COMMITTED, st + JUST_COMMITTED) for kind in _GROUP)
    rows.append(_t("epoch_began", "recorded", "in_epoch" + PENDING))
    rows.append(_t("epoch_began", "training", "in_epoch" + PENDING))  # a new run's opening LAST, deferred
    return rows


#: Every state: the base ones and their pending / just-committed variants.
STATES: tuple[str, ...] = BASE_STATES + tuple(s + PENDING for s in DEFERRABLE) + tuple(
    s + JUST_COMMITTED for s in DEFERRABLE
)

#: The transitions table: trigger (event kind), source state(s), destination.
TRANSITIONS: tuple[dict[str, Any], ...] = (
    *_BASE,
    *_deferred(_BASE),
    _t("run_resumed", [s for s in STATES if s != "new"], "started"),
)


class IllegalTransitionError(NnxError, RuntimeError):
    """An event's kind is not accepted by the lifecycle machine in its current state."""

    def __init__(self, state: str, trigger: str, seq: int | None = None) -> None:
        where = f" (seq {seq})" if seq is not None else ""
        super().__init__(
            f"illegal lifecycle transition{where}: trigger {trigger!r} is not accepted in state {state!r}; "
            f"accepted there: {sorted(k for (s, k) in compiled_table() if s == state)}"
        )
        self.state = state
        self.trigger = trigger
        self.seq = seq


@cache
def compiled_table() -> dict[tuple[str, str], str]:
    """``(state, kind) -> next state``, compiled from :data:`TRANSITIONS`."""
    table: dict[tuple[str, str], str] = {}
    for row in TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        for src in sources:
            dest = src if row["dest"] == "=" else row["dest"]
            key = (src, row["trigger"])
            if key in table and table[key] != dest:
                raise AssertionError(f"ambiguous transition {key}: {table[key]} / {dest}")
            table[key] = dest
    unknown = {k for (_, k) in table} - set(KINDS)
    if unknown:
        raise AssertionError(f"transitions name unknown event kinds: {sorted(unknown)}")
    return table


def build_machine(model: object | None = None) -> Any:
    """The declaration as a ``transitions.Machine`` (queued; triggers are event kinds)."""
    from transitions import Machine

    return Machine(
        model=model,
        states=list(STATES),
        transitions=[dict(row) for row in TRANSITIONS],
        initial=INITIAL,
        queued=True,
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )


class Lifecycle:
    """The runtime's view of the machine: one state, advanced by event kinds.

    Raises:
        IllegalTransitionError: from :meth:`advance` when ``kind`` is not
            accepted in the current state; the state is left unchanged.
    """

    __slots__ = ("state", "table")

    def __init__(self, state: str = INITIAL) -> None:
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}")
        self.state = state
        #: :func:`compiled_table` (read-only): the recorder looks a transition up here itself on the hot path
        self.table = compiled_table()

    @property
    def base_state(self) -> str:
        """The state without its deferred-LAST suffix (:data:`PENDING` / :data:`JUST_COMMITTED`)."""
        return self.state.rstrip(PENDING + JUST_COMMITTED)

    def accepts(self, kind: str) -> bool:
        return (self.state, kind) in self.table

    def advance(self, kind: str, seq: int | None = None) -> str:
        """Take the transition ``kind`` from the current state; return the new state (every event
        of a run passes here: a membership test and a lookup, no call).

        Raises:
            IllegalTransitionError: the machine has no such transition from the current state.
        """
        key = (self.state, kind)
        table = self.table
        if key not in table:
            raise IllegalTransitionError(self.state, kind, seq)
        nxt = self.state = table[key]
        return nxt
