"""Projections: each fold, and the committed view (LAST as the commit marker) over whole logs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events import (
    BestCommitted,
    CallbackBegan,
    CallbackCheckpointed,
    CallbackFinalized,
    CheckpointStored,
    Counters,
    EpochBegan,
    EpochSummarized,
    Event,
    HistoryAppended,
    HistoryRecord,
    LastCommitted,
    MicrobatchDone,
    MonitorDecided,
    MonitorSpec,
    PhaseCommitted,
    PlateauState,
    RunFailed,
    RunFinalized,
    RunResumed,
    RunStarted,
    SchedulerDecl,
    SchedulerStepped,
    StopRequested,
    TrainBegan,
    UpdateCommitted,
    UpdateSkipped,
    ValidationDone,
)
from projections import (
    CheckpointsState,
    HistoryState,
    Pointer,
    Projections,
    SchedulersState,
    StatusState,
    committed,
    fold,
    fold_checkpoints,
    fold_counters,
    fold_history,
    fold_schedulers,
    fold_status,
    project,
    tail_length,
)

SCHEDULERS = [
    SchedulerDecl(name="cosine", clock="epoch", cls="CosineAnnealingLR", optimizer="default"),
    SchedulerDecl(name="warmup", clock="optimizer_update", cls="LinearLR", optimizer="default"),
]


def _manifest(epoch: int, tag: str = "") -> str:
    return f"{tag}{epoch + 1:02d}".ljust(64, "a")


def _receipt(step: int, epoch: int, optimizer: str = "default", dp: int = 1) -> UpdateCommitted:
    return UpdateCommitted(
        step=step,
        epoch=epoch,
        microbatches=2,
        local_examples=64.0,
        global_examples=64.0 * dp,
        loss=1.0 / step,
        lrs=[0.1 / step],
        optimizer=optimizer,
        data_parallel_size=dp,
    )


class _Run:
    """Builds a realistic event sequence by hand, tracking step and batch counters."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.step = 0
        self.batch = 0

    def add(self, *events: Event) -> _Run:
        self.events.extend(events)
        return self

    def counters(self, epochs_done: int, epoch_step: int) -> Counters:
        return Counters(
            batch=self.batch, step=self.step, global_step=self.step, epoch=epochs_done, epoch_step=epoch_step
        )

    def start(self) -> _Run:
        return self.add(
            RunStarted(
                run_id="run-1",
                seed=7,
                callbacks=["ckpt"],
                optimizers=["default"],
                schedulers=SCHEDULERS,
                monitor=MonitorSpec(name="val_loss"),
            ),
            CallbackBegan(name="ckpt", index=0),
            TrainBegan(start_epoch=0, epochs=4),
            CheckpointStored(manifest=_manifest(-1), epoch=-1, step=0, components={"model": "b" * 64}),
            LastCommitted(manifest=_manifest(-1), epoch=-1, step=0, counters=Counters()),
        )

    def epoch_body(self, epoch: int, microbatches: int = 2, loss: float | None = None) -> _Run:
        """An epoch up to and including its history record (not yet committed)."""
        loss = 1.0 / (epoch + 1) if loss is None else loss
        self.add(EpochBegan(epoch=epoch))
        for i in range(microbatches):
            self.add(MicrobatchDone(epoch=epoch, batch=i, rows=32, examples=32.0, loss=loss))
            self.batch += 1
        self.step += 1
        self.add(
            _receipt(self.step, epoch),
            ValidationDone(epoch=epoch, metrics={"val_loss": loss}, examples=100, step=self.step),
            EpochSummarized(epoch=epoch, metrics={"loss": loss}, examples=64.0, microbatches=microbatches, updates=1),
            MonitorDecided(
                epoch=epoch,
                monitor="val_loss",
                mode="min",
                value=loss,
                improved=True,
                best=loss,
                best_epoch=epoch,
                bad_epochs=0,
            ),
            SchedulerStepped(name="cosine", clock="epoch", epoch=epoch, step=self.step, steps=epoch + 1, lrs=[loss]),
            HistoryAppended(
                record=HistoryRecord(
                    epoch=epoch,
                    train={"loss": loss},
                    val={"val_loss": loss},
                    monitor_value=loss,
                    improved=True,
                    lrs={"default": [loss]},
                    counters=self.counters(epoch + 1, microbatches),
                )
            ),
        )
        return self

    def commit_epoch(self, epoch: int, microbatches: int = 2, best: bool = True) -> _Run:
        self.add(
            CheckpointStored(manifest=_manifest(epoch), epoch=epoch, step=self.step, components={"model": "c" * 64}),
            LastCommitted(
                manifest=_manifest(epoch), epoch=epoch, step=self.step, counters=self.counters(epoch + 1, microbatches)
            ),
        )
        if best:
            self.add(BestCommitted(manifest=_manifest(epoch), epoch=epoch, monitor="val_loss", value=0.5))
        return self

    def epoch(self, epoch: int, microbatches: int = 2, best: bool = True) -> _Run:
        return self.epoch_body(epoch, microbatches).commit_epoch(epoch, microbatches, best)


def _pairs(events: Sequence[Event]) -> list[tuple[int, Event]]:
    return list(enumerate(events))


def _fold_all(events: Sequence[Event]) -> Projections:
    """Fold every event, committed or not (what a naive reader would do)."""
    state = Projections()
    for seq, event in enumerate(events):
        state = fold(state, seq, event)
    return state


def _two_epochs() -> _Run:
    return _Run().start().epoch(0).epoch(1)


def _half_epoch_tail(run: _Run, epoch: int) -> list[Event]:
    """An uncommitted tail: a whole epoch body, history included, without its LAST."""
    before = len(run.events)
    run.epoch_body(epoch, loss=0.01)
    run.add(CheckpointStored(manifest=_manifest(epoch), epoch=epoch, step=run.step, components={"model": "d" * 64}))
    return run.events[before:]


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
    c = fold_counters(c, _receipt(1, 0, optimizer="gen", dp=4))
    c = fold_counters(c, _receipt(1, 0, optimizer="disc", dp=4))
    assert (c.step, c.global_step) == (1, 4)
    c = fold_counters(c, _receipt(2, 0, optimizer="gen", dp=4))
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


# --- the committed view -----------------------------------------------------------------


def test_committed_view_ignores_an_uncommitted_tail() -> None:
    run = _two_epochs()
    cut = list(run.events)
    tail = _half_epoch_tail(run, 2)
    full = run.events
    assert len(full) == len(cut) + len(tail)

    p_full, p_cut = project(_pairs(full)), project(_pairs(cut))
    for field in msgspec.structs.fields(Projections):
        assert getattr(p_full, field.name) == getattr(p_cut, field.name), field.name
    assert p_full == p_cut
    assert tail_length(_pairs(full)) == len(tail)
    assert tail_length(_pairs(cut)) == 0
    assert [s for s, _ in committed(_pairs(full))] == list(range(len(cut)))

    # the committed projection is the real thing, not an empty state...
    assert [r.epoch for r in p_cut.history.records] == [0, 1]
    assert p_cut.checkpoints.last == Pointer(manifest=_manifest(1), epoch=1, step=2)
    assert p_cut.checkpoints.best is not None and p_cut.checkpoints.best.epoch == 1
    assert p_cut.counters == Counters(batch=4, step=2, global_step=2, epoch=2, epoch_step=2)
    assert p_cut.schedulers.by_name["cosine"].steps == 2
    assert p_cut.status.status == "running"
    assert p_cut.seq == len(cut) - 1
    # ...and the tail would have changed every projection it touches if folded
    naive = _fold_all(full)
    assert [r.epoch for r in naive.history.records] == [0, 1, 2]
    assert naive.counters.batch == 6 and naive.counters.step == 3
    assert naive.schedulers != p_full.schedulers


def test_run_resumed_discards_the_pending_tail_before_it() -> None:
    run = _two_epochs()
    tail_start = len(run.events)
    _half_epoch_tail(run, 2)
    last_seq = tail_start - 2  # the LAST of epoch 1 (a BEST follows it)
    assert isinstance(run.events[last_seq], LastCommitted)
    resumed_seq = len(run.events)
    run.step, run.batch = 2, 4  # the resume restores LAST's counters
    run.add(
        RunResumed(
            last_seq=last_seq, manifest=_manifest(1), epoch=1, discard_from=tail_start, discard_to=resumed_seq
        ),
        CallbackBegan(name="ckpt", index=0),
        TrainBegan(start_epoch=2, epochs=4),
    )
    run.epoch(2)
    p = project(_pairs(run.events))
    seqs = [s for s, _ in committed(_pairs(run.events))]
    assert not set(range(tail_start, resumed_seq)) & set(seqs)
    assert resumed_seq in seqs
    assert [r.epoch for r in p.history.records] == [0, 1, 2]
    assert p.history.records[2].train == {"loss": 1.0 / 3}, "the committed epoch 2, not the discarded one"
    assert p.counters.batch == 6 and p.counters.step == 3
    assert p.status.resumes == 1 and p.status.status == "running"
    assert tail_length(_pairs(run.events)) == 0
    # a resume right after the tail: nothing pending
    just_resumed = run.events[: resumed_seq + 1]
    assert tail_length(_pairs(just_resumed)) == 0
    assert [r.epoch for r in project(_pairs(just_resumed)).history.records] == [0, 1]


def test_failed_run_folds_its_closing_events_but_not_the_unfinished_epoch() -> None:
    run = _two_epochs()
    tail = _half_epoch_tail(run, 2)
    closing = [
        RunFailed(error_type="RuntimeError", message="CUDA out of memory", epoch=2, step=3),
        CallbackFinalized(name="ckpt", index=0),
        RunFinalized(status="failed", epochs=2, steps=2),
    ]
    run.add(*closing)
    p = project(_pairs(run.events))
    assert p.status.status == "failed"
    assert (p.status.error_type, p.status.error) == ("RuntimeError", "CUDA out of memory")
    assert [r.epoch for r in p.history.records] == [0, 1]
    assert p.counters.batch == 4 and p.counters.step == 2
    assert p.checkpoints.last is not None and p.checkpoints.last.epoch == 1
    assert tail_length(_pairs(run.events)) == len(tail)
    assert p.seq == len(run.events) - 1


def test_failed_last_commit_rolls_the_epochs_history_back() -> None:
    run = _two_epochs()
    run.epoch_body(2)  # history appended, then the LAST write failed
    run.add(
        RunFailed(error_type="CheckpointWriteError", message="ENOSPC", epoch=2, step=3),
        CallbackFinalized(name="ckpt", index=0),
        RunFinalized(status="failed", epochs=2, steps=2),
    )
    p = project(_pairs(run.events))
    assert [r.epoch for r in p.history.records] == [0, 1]
    assert p.status.status == "failed"


def test_run_without_durable_finalization_keeps_closing_events_out() -> None:
    run = _two_epochs()
    run.add(RunFailed(error_type="KeyboardInterrupt", message="", epoch=2, step=2))  # killed before RunFinalized
    p = project(_pairs(run.events))
    assert p.status.status == "running"
    assert tail_length(_pairs(run.events)) == 1


def test_completed_run_has_no_tail_and_is_completed() -> None:
    run = _two_epochs()
    final = _manifest(1, tag="f")
    run.add(
        CallbackFinalized(name="ckpt", index=0),
        CheckpointStored(manifest=final, epoch=1, step=2, components={"model": "c" * 64}),
        LastCommitted(manifest=final, epoch=1, step=2, counters=run.counters(2, 2), final=True),
        RunFinalized(status="completed", epochs=2, steps=2),
    )
    p = project(_pairs(run.events))
    assert tail_length(_pairs(run.events)) == 0
    assert p.status.status == "completed"
    assert p.checkpoints.last is not None and p.checkpoints.last.manifest == final
    assert len(list(committed(_pairs(run.events)))) == len(run.events)


def test_stop_at_update_boundary_is_stopped_without_the_partial_epoch() -> None:
    run = _two_epochs()
    run.add(
        EpochBegan(epoch=2),
        MicrobatchDone(epoch=2, batch=0, rows=32, examples=32.0, loss=0.2),
        _receipt(3, 2),
        StopRequested(epoch=2, step=3, reason="update_boundary"),
        CallbackFinalized(name="ckpt", index=0),
        RunFinalized(status="stopped", epochs=2, steps=3),
    )
    p = project(_pairs(run.events))
    assert (p.status.status, p.status.stop_reason) == ("stopped", "update_boundary")
    assert p.counters.step == 2 and p.counters.batch == 4
    assert tail_length(_pairs(run.events)) == 3


def test_best_and_phase_directly_after_last_are_committed_but_not_after_epoch_began() -> None:
    run = _Run().start().epoch(0, best=False)
    run.add(
        BestCommitted(manifest=_manifest(0), epoch=0, monitor="val_loss", value=0.25),
        PhaseCommitted(name="phase-0", manifest=_manifest(0), epoch=0),
        CallbackCheckpointed(name="ckpt", epoch=0, blob="e" * 64),
    )
    p = project(_pairs(run.events))
    assert p.checkpoints.best == Pointer(manifest=_manifest(0), epoch=0, step=1, value=0.25)
    assert set(p.checkpoints.phases) == {"phase-0"}
    assert set(p.checkpoints.callbacks) == {"ckpt"}
    assert tail_length(_pairs(run.events)) == 0

    late = _Run().start().epoch(0, best=False)
    late.add(EpochBegan(epoch=1), BestCommitted(manifest=_manifest(0), epoch=0, monitor="val_loss", value=0.25))
    p_late = project(_pairs(late.events))
    assert p_late.checkpoints.best is None
    assert tail_length(_pairs(late.events)) == 2


def test_project_from_a_snapshot_equals_project_from_scratch() -> None:
    run = _two_epochs()
    pairs = _pairs(run.events)
    mid = next(i for i, e in enumerate(run.events) if isinstance(e, LastCommitted) and e.epoch == 0)
    snapshot = project(pairs[: mid + 1])
    assert project(pairs[mid + 1 :], start=snapshot) == project(pairs)


# --- property: a prefix never shows history whose LAST is missing ---------------------------


@st.composite
def _logs(draw: st.DrawFn) -> list[Event]:
    run = _Run().start()
    epochs = draw(st.integers(min_value=1, max_value=4))
    for e in range(epochs):
        run.epoch(e, microbatches=draw(st.integers(min_value=1, max_value=3)), best=draw(st.booleans()))
    ending = draw(st.sampled_from(["open", "tail", "failed", "completed"]))
    if ending in ("tail", "failed"):
        run.epoch_body(epochs)
    if ending == "failed":
        run.add(
            RunFailed(error_type="E", message="boom", epoch=epochs, step=run.step),
            CallbackFinalized(name="ckpt", index=0),
            RunFinalized(status="failed", epochs=epochs, steps=run.step),
        )
    if ending == "completed":
        run.add(
            CallbackFinalized(name="ckpt", index=0),
            LastCommitted(manifest="f" * 64, epoch=epochs - 1, step=run.step, counters=Counters(), final=True),
            RunFinalized(status="completed", epochs=epochs, steps=run.step),
        )
    return run.events


@settings(max_examples=150, deadline=None)
@given(log=_logs(), data=st.data())
def test_prefix_never_shows_history_whose_last_is_missing(log: list[Event], data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=0, max_value=len(log)), label="cut")
    prefix = _pairs(log[:k])
    p = project(prefix)
    lasts = [e for _, e in prefix if isinstance(e, LastCommitted)]
    committed_epochs = [e.epoch for e in lasts if e.epoch >= 0 and not e.final]
    assert [r.epoch for r in p.history.records] == committed_epochs
    assert p.checkpoints.last == (
        Pointer(manifest=lasts[-1].manifest, epoch=lasts[-1].epoch, step=lasts[-1].step) if lasts else None
    )
    assert p.counters.epoch == len(committed_epochs)
    assert p.schedulers.by_name.get("cosine", None) is None or p.schedulers.by_name["cosine"].steps == len(
        committed_epochs
    )
    # every event is either committed or in the tail (no resumes in these logs)
    assert len(list(committed(prefix))) + tail_length(prefix) == k
    # a prefix ending at a LAST has nothing pending
    if k and isinstance(log[k - 1], LastCommitted):
        assert tail_length(prefix) == 0
        assert p.seq == k - 1
