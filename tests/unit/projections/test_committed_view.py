"""The committed view (LAST as the commit marker) over whole logs: tails, resumes, failures,
stops, snapshots, and the property that a prefix never shows history whose LAST is missing."""

from __future__ import annotations

import msgspec
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
    Event,
    LastCommitted,
    MicrobatchDone,
    PhaseCommitted,
    RunFailed,
    RunFinalized,
    RunResumed,
    StopRequested,
    TrainBegan,
)
from projections import Pointer, Projections, committed, project, tail_length
from runcases import fold_all, half_epoch_tail, manifest_id, receipt_at, RunLog, seq_pairs, two_epochs


# --- the committed view -----------------------------------------------------------------


def test_committed_view_ignores_an_uncommitted_tail() -> None:
    run = two_epochs()
    cut = list(run.events)
    tail = half_epoch_tail(run, 2)
    full = run.events
    assert len(full) == len(cut) + len(tail)

    p_full, p_cut = project(seq_pairs(full)), project(seq_pairs(cut))
    for field in msgspec.structs.fields(Projections):
        assert getattr(p_full, field.name) == getattr(p_cut, field.name), field.name
    assert p_full == p_cut
    assert tail_length(seq_pairs(full)) == len(tail)
    assert tail_length(seq_pairs(cut)) == 0
    assert [s for s, _ in committed(seq_pairs(full))] == list(range(len(cut)))

    # the committed projection is the real thing, not an empty state...
    assert [r.epoch for r in p_cut.history.records] == [0, 1]
    assert p_cut.checkpoints.last == Pointer(manifest=manifest_id(1), epoch=1, step=2)
    assert p_cut.checkpoints.best is not None and p_cut.checkpoints.best.epoch == 1
    assert p_cut.counters == Counters(batch=4, step=2, global_step=2, epoch=2, epoch_step=2)
    assert p_cut.schedulers.by_name["cosine"].steps == 2
    assert p_cut.status.status == "running"
    assert p_cut.seq == len(cut) - 1
    # ...and the tail would have changed every projection it touches if folded
    naive = fold_all(full)
    assert [r.epoch for r in naive.history.records] == [0, 1, 2]
    assert naive.counters.batch == 6 and naive.counters.step == 3
    assert naive.schedulers != p_full.schedulers


def test_run_resumed_discards_the_pending_tail_before_it() -> None:
    run = two_epochs()
    tail_start = len(run.events)
    half_epoch_tail(run, 2)
    last_seq = tail_start - 2  # the LAST of epoch 1 (a BEST follows it)
    assert isinstance(run.events[last_seq], LastCommitted)
    resumed_seq = len(run.events)
    run.step, run.batch = 2, 4  # the resume restores LAST's counters
    run.add(
        RunResumed(
            last_seq=last_seq, manifest=manifest_id(1), epoch=1, discard_from=tail_start, discard_to=resumed_seq
        ),
        CallbackBegan(name="ckpt", index=0),
        TrainBegan(start_epoch=2, epochs=4),
    )
    run.epoch(2)
    p = project(seq_pairs(run.events))
    seqs = [s for s, _ in committed(seq_pairs(run.events))]
    assert not set(range(tail_start, resumed_seq)) & set(seqs)
    assert resumed_seq in seqs
    assert [r.epoch for r in p.history.records] == [0, 1, 2]
    assert p.history.records[2].train == {"loss": 1.0 / 3}, "the committed epoch 2, not the discarded one"
    assert p.counters.batch == 6 and p.counters.step == 3
    assert p.status.resumes == 1 and p.status.status == "running"
    assert tail_length(seq_pairs(run.events)) == 0
    # a resume right after the tail: nothing pending
    just_resumed = run.events[: resumed_seq + 1]
    assert tail_length(seq_pairs(just_resumed)) == 0
    assert [r.epoch for r in project(seq_pairs(just_resumed)).history.records] == [0, 1]


def test_failed_run_folds_its_closing_events_but_not_the_unfinished_epoch() -> None:
    run = two_epochs()
    tail = half_epoch_tail(run, 2)
    closing = [
        RunFailed(error_type="RuntimeError", message="CUDA out of memory", epoch=2, step=3),
        CallbackFinalized(name="ckpt", index=0),
        RunFinalized(status="failed", epochs=2, steps=2),
    ]
    run.add(*closing)
    p = project(seq_pairs(run.events))
    assert p.status.status == "failed"
    assert (p.status.error_type, p.status.error) == ("RuntimeError", "CUDA out of memory")
    assert [r.epoch for r in p.history.records] == [0, 1]
    assert p.counters.batch == 4 and p.counters.step == 2
    assert p.checkpoints.last is not None and p.checkpoints.last.epoch == 1
    assert tail_length(seq_pairs(run.events)) == len(tail)
    assert p.seq == len(run.events) - 1


def test_failed_last_commit_rolls_the_epochs_history_back() -> None:
    run = two_epochs()
    run.epoch_body(2)  # history appended, then the LAST write failed
    run.add(
        RunFailed(error_type="CheckpointWriteError", message="ENOSPC", epoch=2, step=3),
        CallbackFinalized(name="ckpt", index=0),
        RunFinalized(status="failed", epochs=2, steps=2),
    )
    p = project(seq_pairs(run.events))
    assert [r.epoch for r in p.history.records] == [0, 1]
    assert p.status.status == "failed"


def test_run_without_durable_finalization_keeps_closing_events_out() -> None:
    run = two_epochs()
    run.add(RunFailed(error_type="KeyboardInterrupt", message="", epoch=2, step=2))  # killed before RunFinalized
    p = project(seq_pairs(run.events))
    assert p.status.status == "running"
    assert tail_length(seq_pairs(run.events)) == 1


def test_completed_run_has_no_tail_and_is_completed() -> None:
    run = two_epochs()
    final = manifest_id(1, tag="f")
    run.add(
        CallbackFinalized(name="ckpt", index=0),
        CheckpointStored(manifest=final, epoch=1, step=2, components={"model": "c" * 64}),
        LastCommitted(manifest=final, epoch=1, step=2, counters=run.counters(2, 2), final=True),
        RunFinalized(status="completed", epochs=2, steps=2),
    )
    p = project(seq_pairs(run.events))
    assert tail_length(seq_pairs(run.events)) == 0
    assert p.status.status == "completed"
    assert p.checkpoints.last is not None and p.checkpoints.last.manifest == final
    assert len(list(committed(seq_pairs(run.events)))) == len(run.events)


def test_stop_at_update_boundary_is_stopped_without_the_partial_epoch() -> None:
    run = two_epochs()
    run.add(
        EpochBegan(epoch=2),
        MicrobatchDone(epoch=2, batch=0, rows=32, examples=32.0, loss=0.2),
        receipt_at(3, 2),
        StopRequested(epoch=2, step=3, reason="update_boundary"),
        CallbackFinalized(name="ckpt", index=0),
        RunFinalized(status="stopped", epochs=2, steps=3),
    )
    p = project(seq_pairs(run.events))
    assert (p.status.status, p.status.stop_reason) == ("stopped", "update_boundary")
    assert p.counters.step == 2 and p.counters.batch == 4
    assert tail_length(seq_pairs(run.events)) == 3


def test_best_and_phase_directly_after_last_are_committed_but_not_after_epoch_began() -> None:
    run = RunLog().start().epoch(0, best=False)
    run.add(
        BestCommitted(manifest=manifest_id(0), epoch=0, monitor="val_loss", value=0.25),
        PhaseCommitted(name="phase-0", manifest=manifest_id(0), epoch=0),
        CallbackCheckpointed(name="ckpt", epoch=0, blob="e" * 64),
    )
    p = project(seq_pairs(run.events))
    assert p.checkpoints.best == Pointer(manifest=manifest_id(0), epoch=0, step=1, value=0.25)
    assert set(p.checkpoints.phases) == {"phase-0"}
    assert set(p.checkpoints.callbacks) == {"ckpt"}
    assert tail_length(seq_pairs(run.events)) == 0

    late = RunLog().start().epoch(0, best=False)
    late.add(EpochBegan(epoch=1), BestCommitted(manifest=manifest_id(0), epoch=0, monitor="val_loss", value=0.25))
    p_late = project(seq_pairs(late.events))
    assert p_late.checkpoints.best is None
    assert tail_length(seq_pairs(late.events)) == 2


def test_project_from_a_snapshot_equals_project_from_scratch() -> None:
    run = two_epochs()
    pairs = seq_pairs(run.events)
    mid = next(i for i, e in enumerate(run.events) if isinstance(e, LastCommitted) and e.epoch == 0)
    snapshot = project(pairs[: mid + 1])
    assert project(pairs[mid + 1 :], start=snapshot) == project(pairs)


# --- property: a prefix never shows history whose LAST is missing ---------------------------


@st.composite
def _logs(draw: st.DrawFn) -> list[Event]:
    run = RunLog().start()
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
    prefix = seq_pairs(log[:k])
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
