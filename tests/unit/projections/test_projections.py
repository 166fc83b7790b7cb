"""Projections: each fold on its own (the committed view over whole logs: ``test_committed_view.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from events import (


    BestCommitted,
    CallbackCheckpointed,
    Counters,
    EpochBegan,
    EpochSummarized,
    HistoryAppended,
    HistoryRecord,
    LastCommitted,
    MicrobatchDone,
    PhaseCommitted,
    PlateauState,
    RunFailed,
    RunFinalized,
    RunResumed,
    RunStarted,
    SchedulerStepped,
    StopRequested,
    UpdateSkipped,
)
from projections import (
    CheckpointsState,
    HistoryState,
    Pointer,
    SchedulersState,
    StatusState,
    fold_checkpoints,
    fold_counters,
    fold_history,
    fold_schedulers,
    fold_status,
)
from runcases import receipt_at, SCHEDULERS


# --- single folds ---------------------------------------------------------------------


def test_fold_history_appends_records_in_order() -> None:
    r0 = HistoryRecord(epoch=0, train={"loss": 1.0}, val={})
    r1 = HistoryRecord(epoch=1, train={"loss": 0.5}, val={"val_loss": 0.7})
    state = fold_history(HistoryState(), HistoryAppended(record=r0))
    state = fold_history(state, HistoryAppended(record=r1))
    assert state.records == (r0, r1)


def test_fold_checkpoints_last_best_phase_rotation_and_callbacks() -> None:
    s = CheckpointsState()
    s = fold_checkpoints(s, LastCommitted(manifest="m0", epoch=0, step=10, counters=Counters(step=10)))
    assert s.last == Pointer(manifest="m0", epoch=0, step=10)
    assert s.commits == 1
    s = fold_checkpoints(s, BestCommitted(manifest="m0", epoch=0, monitor="val_loss", value=0.3))
    assert s.best == Pointer(manifest="m0", epoch=0, step=10, value=0.3)
    s = fold_checkpoints(s, LastCommitted(manifest="m1", epoch=1, step=20, counters=Counters(step=20)))
    assert s.last == Pointer(manifest="m1", epoch=1, step=20)
    assert s.best is not None and s.best.manifest == "m0", "a new LAST leaves BEST alone"
    assert s.commits == 2
    s = fold_checkpoints(s, PhaseCommitted(name="phase-0", manifest="p0", epoch=0))
    s = fold_checkpoints(s, PhaseCommitted(name="phase-1", manifest="p1", epoch=1))
    s = fold_checkpoints(s, PhaseCommitted(name="phase-2", manifest="p2", epoch=2, removed=["phase-0"]))
    assert set(s.phases) == {"phase-1", "phase-2"}
    assert s.phases["phase-2"] == Pointer(manifest="p2", epoch=2, step=20)  # the step of the LAST it follows
    s = fold_checkpoints(s, CallbackCheckpointed(name="ema", epoch=1, blob="e1"))
    s = fold_checkpoints(s, CallbackCheckpointed(name="ema", epoch=2, blob="e2"))
    assert s.callbacks == {"ema": Pointer(manifest="e2", epoch=2)}


def test_fold_schedulers_declared_from_run_started_then_stepped() -> None:
    s = fold_schedulers(SchedulersState(), RunStarted(run_id="r", seed=0, schedulers=SCHEDULERS))
    assert set(s.by_name) == {"cosine", "warmup"}
    assert s.by_name["warmup"].clock == "optimizer_update"
    assert s.by_name["cosine"].steps == 0 and s.by_name["cosine"].lrs == []
    plateau = PlateauState(best=0.4, num_bad_epochs=1, cooldown_counter=0)
    s = fold_schedulers(
        s,
        SchedulerStepped(name="cosine", clock="epoch", epoch=0, step=5, steps=1, lrs=[0.05], plateau=plateau),
    )
    cos = s.by_name["cosine"]
    assert (cos.steps, cos.lrs, cos.plateau, cos.last_epoch, cos.last_step) == (1, [0.05], plateau, 0, 5)
    assert s.by_name["warmup"].steps == 0, "stepping one scheduler leaves the others"
    # a second RunStarted (e.g. folded twice) does not erase scheduler state
    again = fold_schedulers(s, RunStarted(run_id="r", seed=0, schedulers=SCHEDULERS))
    assert again.by_name["cosine"].steps == 1


def test_fold_counters_microbatches_receipts_epochs() -> None:
    c = Counters()
    for _ in range(3):
        c = fold_counters(c, MicrobatchDone(epoch=0, batch=0, rows=8, examples=8.0, loss=0.1))
    assert (c.batch, c.epoch_step, c.step) == (3, 3, 0)
    # two optimizers' receipts of one commit share a step; global_step advances once by dp
    c = fold_counters(c, receipt_at(1, 0, optimizer="gen", dp=4))
    c = fold_counters(c, receipt_at(1, 0, optimizer="disc", dp=4))
    assert (c.step, c.global_step) == (1, 4)
    c = fold_counters(c, receipt_at(2, 0, optimizer="gen", dp=4))
    assert (c.step, c.global_step) == (2, 8)
    c = fold_counters(c, UpdateSkipped(step=2, epoch=0, microbatches=2, reason="nonfinite"))
    assert (c.step, c.global_step) == (2, 8), "a skipped update is not a step"
    c = fold_counters(c, EpochSummarized(epoch=0, metrics={}, examples=24.0, microbatches=3, updates=2))
    assert c.epoch == 1
    c = fold_counters(c, EpochBegan(epoch=1))
    assert (c.epoch_step, c.batch, c.epoch) == (0, 3, 1)
    c = fold_counters(c, MicrobatchDone(epoch=1, batch=0, rows=8, examples=8.0, loss=0.1))
    assert (c.epoch_step, c.batch) == (1, 4)
    c = fold_counters(c, EpochSummarized(epoch=4, metrics={}, examples=8.0, microbatches=1, updates=0))
    assert c.epoch == 5, "epoch counts epochs completed: the summarized 0-based index + 1"


def test_fold_status_lifecycle() -> None:
    s = fold_status(StatusState(), RunStarted(run_id="run-9", seed=3))
    assert (s.status, s.run_id, s.seed) == ("running", "run-9", 3)
    s = fold_status(s, StopRequested(epoch=2, step=9, reason="early_stopping"))
    assert (s.status, s.stop_reason) == ("running", "early_stopping")
    s = fold_status(s, RunFinalized(status="stopped", epochs=3, steps=9))
    assert s.status == "stopped" and s.run_id == "run-9"

    f = fold_status(StatusState(), RunStarted(run_id="run-9", seed=3))
    f = fold_status(f, RunFailed(error_type="ValueError", message="bad batch", epoch=1, step=4))
    assert (f.error_type, f.error) == ("ValueError", "bad batch")
    assert f.status != "running"
    f = fold_status(f, RunFinalized(status="failed", epochs=1, steps=4))
    assert (f.status, f.error) == ("failed", "bad batch")
    r = fold_status(f, RunResumed(last_seq=10, manifest="m", epoch=0, discard_from=11, discard_to=20))
    assert (r.status, r.resumes, r.error, r.error_type) == ("running", 1, None, None)


# (fold, kinds it reacts to)
_FOLDS: list[tuple[Any, Any, frozenset[str]]] = [
    (fold_history, HistoryState(), frozenset({"history_appended"})),
    (
        fold_checkpoints,
        CheckpointsState(),
        frozenset({"last_committed", "best_committed", "phase_committed", "callback_checkpointed", "checkpoint_pruned"}),
    ),
    (fold_schedulers, SchedulersState(), frozenset({"run_started", "scheduler_stepped"})),
    (fold_counters, Counters(), frozenset({"microbatch_done", "update_committed", "epoch_began", "epoch_summarized"})),
    (
        fold_status,
        StatusState(),
        frozenset({"run_started", "run_resumed", "stop_requested", "run_failed", "run_finalized"}),
    ),
]


@pytest.mark.parametrize("fold_fn,initial,handled", _FOLDS, ids=[f[0].__name__ for f in _FOLDS])
def test_irrelevant_events_leave_state_unchanged(
    fold_fn: Any, initial: Any, handled: frozenset[str], sample_events: dict[type, Any]
) -> None:
    reacted = set()
    for cls, event in sample_events.items():
        out = fold_fn(initial, event)
        if event.KIND in handled:
            reacted.add(event.KIND)
        else:
            assert out is initial, f"{fold_fn.__name__} changed its state on {event.KIND}"
    assert reacted == handled
    # a non-event value also falls through to the default case
    assert fold_fn(initial, object()) is initial
