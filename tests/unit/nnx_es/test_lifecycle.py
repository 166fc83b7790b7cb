"""The lifecycle declaration: the compiled table and the ``transitions`` machine agree, and real paths pass."""

from __future__ import annotations

import pytest
from transitions import MachineError

from events import KINDS, NnxError
from nnx_es.lifecycle import (
    INITIAL,
    STATES,
    TRANSITIONS,
    IllegalTransitionError,
    Lifecycle,
    build_machine,
    compiled_table,
)

_START = ["run_started", "callback_began", "train_began", "checkpoint_stored", "last_committed"]
_EPOCH = [
    "epoch_began",
    "microbatch_done",
    "microbatch_done",
    "update_committed",
    "validation_done",
    "epoch_summarized",
    "monitor_decided",
    "scheduler_stepped",
    "history_appended",
    "checkpoint_stored",
    "last_committed",
    "best_committed",
]
_FINISH = ["callback_finalized", "checkpoint_stored", "last_committed", "run_finalized"]


def _walk(kinds: list[str], state: str = INITIAL) -> Lifecycle:
    lc = Lifecycle(state)
    for i, kind in enumerate(kinds):
        assert lc.accepts(kind), f"step {i}: {kind!r} refused in state {lc.state!r}"
        lc.advance(kind, seq=i)
    return lc


class _Model:
    """A bare model object: transitions binds ``state`` and ``trigger(name)`` onto it."""

    state: str

    def fire(self, kind: str) -> None:
        self.trigger(kind)  # type: ignore[attr-defined]


def _machine_step(state: str, kind: str) -> str | None:
    """Fire ``kind`` on a fresh machine forced into ``state``; the new state, or None if refused."""
    model = _Model()
    machine = build_machine(model)
    machine.set_state(state, model=model)
    assert model.state == state
    try:
        model.fire(kind)
    except MachineError:
        assert model.state == state, "a refused trigger must not move the machine"
        return None
    except AttributeError:  # a kind no transition names is not even a trigger
        assert model.state == state
        return None
    return str(model.state)


def test_compiled_table_agrees_with_transitions_machine_on_every_pair() -> None:
    table = compiled_table()
    disagreements = []
    accepted = 0
    for state in STATES:
        for kind in KINDS:
            got = _machine_step(state, kind)
            want = table.get((state, kind))
            accepted += got is not None
            if got != want:
                disagreements.append((state, kind, want, got))
    assert disagreements == []
    assert accepted == len(table)
    # the table is not trivially empty or total
    assert 0 < len(table) < len(STATES) * len(KINDS)


def test_table_only_names_declared_states_and_kinds() -> None:
    table = compiled_table()
    assert {s for s, _ in table} <= set(STATES)
    assert set(table.values()) <= set(STATES)
    assert {k for _, k in table} <= set(KINDS)
    assert {row["trigger"] for row in TRANSITIONS} == {k for _, k in table}


def test_every_state_is_reachable_from_initial() -> None:
    table = compiled_table()
    seen, todo = {INITIAL}, [INITIAL]
    while todo:
        s = todo.pop()
        for (src, _), dst in table.items():
            if src == s and dst not in seen:
                seen.add(dst)
                todo.append(dst)
    assert seen == set(STATES)


def test_illegal_transition_is_refused_naming_state_and_trigger() -> None:
    lc = _walk(_START[:3])
    assert lc.state == "training"
    with pytest.raises(IllegalTransitionError) as info:
        lc.advance("microbatch_done", seq=3)
    err = info.value
    assert (err.state, err.trigger, err.seq) == ("training", "microbatch_done", 3)
    assert "'training'" in str(err) and "'microbatch_done'" in str(err) and "seq 3" in str(err)
    assert isinstance(err, NnxError) and isinstance(err, RuntimeError)
    assert lc.state == "training", "a refused event leaves the state unchanged"
    assert not lc.accepts("microbatch_done")


def test_unknown_kind_is_refused() -> None:
    lc = Lifecycle()
    with pytest.raises(IllegalTransitionError):
        lc.advance("not_a_kind")
    assert lc.state == INITIAL


def test_lifecycle_rejects_an_unknown_state() -> None:
    with pytest.raises(ValueError, match="nirvana"):
        Lifecycle("nirvana")


def test_whole_legal_run_is_accepted_end_to_end() -> None:
    lc = _walk(_START + _EPOCH + _EPOCH + _FINISH)
    assert lc.state == "finalized"
    # the same path through the transitions machine
    model = _Model()
    build_machine(model)
    for kind in _START + _EPOCH + _EPOCH + _FINISH:
        model.fire(kind)
    assert model.state == "finalized"


def test_run_with_phase_callback_checkpoints_and_opt_clock_scheduler() -> None:
    epoch = [
        "epoch_began",
        "microbatch_done",
        "update_committed",
        "update_committed",  # a second optimizer's receipt
        "scheduler_stepped",  # optimizer_update clock
        "microbatch_done",
        "update_skipped",
        "epoch_summarized",
        "scheduler_stepped",
        "stop_requested",  # early stopping: the epoch still commits
        "history_appended",
        "last_committed",
        "phase_committed",
        "checkpoint_stored",
        "callback_checkpointed",
    ]
    assert _walk(_START + epoch + _FINISH).state == "finalized"


@pytest.mark.parametrize("cut", [len(_START) + 2, len(_START) + 4, len(_START) + 9, len(_START)])
def test_failure_path_from_anywhere_is_accepted(cut: int) -> None:
    lc = _walk(_START + _EPOCH)
    lc = _walk((_START + _EPOCH)[:cut])
    _walk(["run_failed", "callback_finalized", "run_finalized"], lc.state)


def test_failure_from_mid_window() -> None:
    lc = _walk(_START + ["epoch_began", "microbatch_done"])
    assert lc.state == "in_window"
    lc = _walk(["run_failed", "callback_finalized", "run_finalized"], lc.state)
    assert lc.state == "finalized"


def test_stop_at_update_boundary() -> None:
    lc = _walk(_START + ["epoch_began", "microbatch_done", "update_committed"])
    lc = _walk(["stop_requested", "callback_finalized", "run_finalized"], lc.state)
    assert lc.state == "finalized"


def test_the_first_epoch_may_begin_before_the_initial_last_but_not_record_its_history() -> None:
    # a new run's initial LAST may be deferred into its first epoch (checkpoint_lag > 0)
    lc = _walk(["run_started", "callback_began", "train_began", "epoch_began", "microbatch_done",
                "update_committed", "epoch_summarized"])
    assert lc.state == "summarized~"
    with pytest.raises(IllegalTransitionError):
        lc.advance("history_appended")  # the first epoch's history waits for the initial LAST
    lc = _walk(["checkpoint_stored", "last_committed", "history_appended"], lc.state)
    assert lc.state == "recorded"
    with pytest.raises(IllegalTransitionError):  # and nothing but an epoch follows train_began
        _walk(["run_started", "train_began"]).advance("epoch_summarized")


@pytest.mark.parametrize(
    "path,refused",
    [
        (_START + ["epoch_began"], "history_appended"),  # no summary
        (_START + ["epoch_began", "microbatch_done"], "epoch_summarized"),  # window still open
        (_START + _EPOCH[:9], "best_committed"),  # BEST before LAST
        # a deferred LAST lets the next epoch begin, never append its history first
        (_START + _EPOCH[:9] + ["epoch_began", "microbatch_done", "update_committed", "epoch_summarized"],
         "history_appended"),
        (_START + _EPOCH[:9] + ["epoch_began"], "best_committed"),  # BEST before its deferred LAST
        (_START + _EPOCH + _FINISH, "epoch_began"),  # nothing after finalization
        (_START + _EPOCH + _FINISH, "run_failed"),
        ([], "train_began"),
    ],
)
def test_out_of_order_events_are_refused(path: list[str], refused: str) -> None:
    lc = _walk(path)
    before = lc.state
    with pytest.raises(IllegalTransitionError):
        lc.advance(refused)
    assert lc.state == before


def test_a_deferred_last_lands_inside_the_next_epoch_and_its_group_follows() -> None:
    lc = _walk(_START + _EPOCH[:9] + ["epoch_began", "microbatch_done", "update_committed"])
    assert lc.state == "updated~"
    lc = _walk(["checkpoint_stored", "last_committed", "best_committed", "phase_committed",
                "microbatch_done", "update_committed", "epoch_summarized", "history_appended",
                "checkpoint_stored", "last_committed"], lc.state)
    assert lc.state == "committed"


def test_finalization_waits_for_a_deferred_last() -> None:
    lc = _walk(_START + _EPOCH[:9] + ["epoch_began", "microbatch_done", "update_committed", "stop_requested"])
    assert lc.state == "stopping~"
    assert not lc.accepts("callback_finalized")
    _walk(["checkpoint_stored", "last_committed", "callback_finalized", "run_finalized"], lc.state)


def test_resume_after_a_crash_restarts_the_lifecycle() -> None:
    lc = _walk(_START + _EPOCH + ["epoch_began", "microbatch_done"])
    lc = _walk(["run_resumed", "callback_began", "train_began", "last_committed", *_EPOCH], lc.state)
    assert lc.state == "committed"
