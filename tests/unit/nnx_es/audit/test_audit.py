"""The audit (tools/replay): a clean run has no violation; each forged break names its invariant and seq."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
from helpers_runs import RUN_ID, Run, RunBuilder, clean, copy_run, find, resumed_events, template, write_run  # noqa: F401 (fixtures)

import nnx_es.audit.run as audit_run_module
from events.schema import (
    BestCommitted,
    CallbackFinalized,
    Counters,
    Event,
    LastCommitted,
    MicrobatchDone,
    PhaseCommitted,
    RunFinalized,
    StopRequested,
    ValidationDone,
)
from nnx_es.audit import AuditReport, NotARunError, audit_run
from nnx_es.checkpoint import component_bytes, read_manifest, write_checkpoint
from nnx_es.errors import NnxError
from projections import Projections, tail_length


def rewrite(template: Run, tmp_path: Path, events: list[Event]) -> Run:
    """A run with ``events`` as its log, the template's blobs, and views regenerated from the log."""
    run_dir = tmp_path / "runs" / RUN_ID
    shutil.copytree(template.run_dir / "blobs", run_dir / "blobs")
    return write_run(run_dir, events)


def found(report: AuditReport) -> set[tuple[int | None, int]]:
    return {(v.seq, v.invariant) for v in report.violations}


def invariants(report: AuditReport) -> set[int]:
    return {v.invariant for v in report.violations}


# --- the clean run ------------------------------------------------------------------------


def test_clean_two_epoch_run_has_no_violation(clean: Run) -> None:
    report = audit_run(clean.run_dir)
    assert report.violations == []
    assert report.ok
    assert report.events == len(clean.events) == 46
    assert report.committed_epoch == 1
    assert report.tail == 0
    assert report.status == "completed"
    assert report.run_id == RUN_ID


def test_a_run_copied_under_another_name_audits_clean_with_a_note_that_it_cannot_be_resumed_as_is(
        clean: Run) -> None:
    assert audit_run(clean.run_dir).notes == []
    backup = clean.run_dir.with_name(f"{RUN_ID}-backup")
    shutil.copytree(clean.run_dir, backup)
    report = audit_run(backup)
    assert report.ok and report.violations == [] and report.run_id == RUN_ID
    assert len(report.notes) == 1
    assert f"is named '{RUN_ID}-backup', not after its run: the run in it was started with run id '{RUN_ID}'" \
        in report.notes[0]
    assert "Resume it under its own name" in report.notes[0] and "--from best|SEQ --run-id NEW" in report.notes[0]


def test_resumed_run_with_discarded_tail_is_clean(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / RUN_ID
    write_run(run_dir, resumed_events(run_dir))
    report = audit_run(run_dir)
    assert report.violations == []
    assert (report.committed_epoch, report.tail, report.status) == (1, 0, "completed")


def _deferred_run(run_dir: Path, *, crash: bool = False) -> RunBuilder:
    """Epoch 0's LAST is written after epoch 1's first window (a checkpoint lag), as with ``checkpoint_lag``."""
    b = RunBuilder(run_dir)
    b.start(epochs=3)
    b.epoch(0, val_loss=0.8, defer=True)
    if crash:
        b.crash_in_epoch(1)  # epoch_began, window, then epoch 0's commit group; then the kill
        b.add(MicrobatchDone(epoch=1, batch=2, rows=8, examples=8.0, loss=0.3))
        return b
    b.epoch(1, val_loss=0.7, defer=True)
    b.epoch(2, val_loss=0.75)
    b.finish(epochs=3)
    return b


def test_deferred_last_commits_audit_clean(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / RUN_ID
    b = _deferred_run(run_dir)
    last0 = find(b.events, "last_committed", epoch=0)
    assert b.events[last0].covers == find(b.events, "history_appended") < find(b.events, "epoch_began", 1) < last0
    write_run(run_dir, b.events)
    report = audit_run(run_dir)
    assert report.violations == []
    assert (report.committed_epoch, report.tail, report.status) == (2, 0, "completed")


def test_crash_after_a_deferred_last_counts_the_held_back_events_as_tail(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / RUN_ID
    b = _deferred_run(run_dir, crash=True)
    write_run(run_dir, b.events)
    report = audit_run(run_dir)
    assert report.violations == []
    # epoch 1's epoch_began, 2 microbatches, update and step before epoch 0's LAST, one microbatch after it
    assert (report.committed_epoch, report.tail) == (0, 6)
    assert report.tail == tail_length(enumerate(b.events))


def test_deferred_last_not_covering_its_history_is_invariant_3(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / RUN_ID
    b = _deferred_run(run_dir)
    events = b.events
    seq = find(events, "last_committed", epoch=0)
    events[seq] = msgspec.structs.replace(events[seq], covers=events[seq].covers - 1)
    write_run(run_dir, events)
    assert (seq, 3) in found(audit_run(run_dir))


def test_missing_or_empty_directory_raises_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(NotARunError, match="does not exist"):
        audit_run(tmp_path / "runs" / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotARunError, match="not a run") as info:
        audit_run(tmp_path / "empty")
    assert isinstance(info.value, NnxError) and isinstance(info.value, FileNotFoundError)


# --- invariant 1 ---------------------------------------------------------------------------


def _raw_log(run: Run):
    from events.log import LmdbLog

    return LmdbLog(run.log_path)


def test_sequence_gap_is_invariant_1_at_the_seq_after_it(clean: Run) -> None:
    seq = find(clean.events, "callback_checkpointed", 0)
    with _raw_log(clean) as log:
        log.delete_raw(seq)
    report = audit_run(clean.run_dir)
    assert found(report) == {(seq + 1, 1)}
    (v,) = report.violations
    assert (v.expected, v.found) == (f"seq {seq}", f"seq {seq + 1}")
    assert report.events == len(clean.events) - 1


def test_undecodable_value_is_invariant_1_at_its_seq(clean: Run) -> None:
    seq = find(clean.events, "callback_checkpointed", 0)
    with _raw_log(clean) as log:
        log.put_raw(seq, b"\xc1 not msgpack")
    report = audit_run(clean.run_dir)
    assert found(report) == {(seq, 1)}


# --- invariant 2 ---------------------------------------------------------------------------


def test_illegal_transition_is_one_invariant_2_violation(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    seq = find(events, "microbatch_done", 4) + 1  # inside epoch 1's first window
    events.insert(seq, ValidationDone(epoch=1, metrics={"val_loss": 0.9}, examples=24, trigger="steps"))
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert found(report) == {(seq, 2)}
    (v,) = report.violations
    assert v.found == "validation_done" and "update_committed" in (v.expected or "")


# --- invariant 3 ---------------------------------------------------------------------------


def test_last_before_its_history_is_invariant_3(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    h = find(events, "history_appended", 1)
    record = events.pop(h)  # history, checkpoint_stored, LAST -> checkpoint_stored, LAST, history
    events.insert(h + 2, record)
    last = find(events, "last_committed", epoch=1, final=False)
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert (last, 3) in found(report)
    assert invariants(report) <= {2, 3}


def test_best_naming_another_manifest_than_last_is_invariant_3(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    seq = find(events, "best_committed", 0)
    other = events[find(events, "last_committed", epoch=-1)].manifest
    events[seq] = msgspec.structs.replace(events[seq], manifest=other)
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert found(report) == {(seq, 3)}


# --- invariant 4 ---------------------------------------------------------------------------


def test_flipped_blob_bytes_is_invariant_4_at_the_last_naming_it(clean: Run) -> None:
    seq = find(clean.events, "last_committed", epoch=0)
    manifest = read_manifest(clean.store, clean.events[seq].manifest)
    path = clean.store.path(manifest.components["model"].blob)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    report = audit_run(clean.run_dir)
    assert found(report) == {(seq, 4)}  # BEST names the same manifest: reported once
    assert "corrupt" in report.violations[0].message


def test_missing_callback_blob_is_invariant_4(clean: Run) -> None:
    seq = find(clean.events, "callback_checkpointed", 1)
    clean.store.path(clean.events[seq].blob).unlink()
    assert found(audit_run(clean.run_dir)) == {(seq, 4)}


# --- invariant 5 ---------------------------------------------------------------------------


def test_crash_tail_is_reported_and_changes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / RUN_ID
    b = RunBuilder(run_dir)
    b.start()
    b.epoch(0, val_loss=0.8)
    b.crash_in_epoch(1)
    write_run(run_dir, b.events)
    report = audit_run(run_dir)
    assert report.violations == []
    assert (report.tail, report.committed_epoch, report.status) == (5, 0, "running")


def _stopped_run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "runs" / RUN_ID
    b = RunBuilder(run_dir)
    b.start()
    b.epoch(0, val_loss=0.8)
    b.crash_in_epoch(1)  # epoch_began, mb, mb, update, warmup step: then stop
    b.add(StopRequested(epoch=1, step=b.p.counters.step, reason="update_boundary"))
    b.add(CallbackFinalized(name="saver", index=1))
    b.add(CallbackFinalized(name="logger", index=0))
    b.add(RunFinalized(status="stopped", epochs=1, steps=b.p.counters.step))
    write_run(run_dir, b.events)
    return run_dir


def test_stop_at_update_boundary_folds_only_closing_events(tmp_path: Path) -> None:
    report = audit_run(_stopped_run(tmp_path))
    assert report.violations == []
    assert (report.tail, report.status, report.committed_epoch) == (5, "stopped", 0)


def test_prefix_projection_disagreeing_is_invariant_5(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = _stopped_run(tmp_path)
    # as if re-projecting the committed prefix gave another state than the whole log's fold
    monkeypatch.setattr(audit_run_module, "project", lambda pairs, start=None: Projections())
    report = audit_run(run_dir)
    assert found(report) == {(None, 5)}
    assert "changes the projections" in report.violations[0].message


def test_tail_length_disagreeing_is_invariant_5(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "runs" / RUN_ID
    b = RunBuilder(run_dir)
    b.start()
    b.epoch(0, val_loss=0.8)
    b.crash_in_epoch(1)
    write_run(run_dir, b.events)
    monkeypatch.setattr(audit_run_module, "tail_length", lambda pairs: 99)
    report = audit_run(run_dir)
    assert found(report) == {(None, 5)}


# --- invariant 6 ---------------------------------------------------------------------------


def test_scheduler_stepped_after_update_skipped_is_invariant_6(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / RUN_ID
    b = RunBuilder(run_dir)
    b.start()
    b.epoch(0, val_loss=0.8, skip_second=True, stray_step=True)
    b.epoch(1, val_loss=0.9)
    b.finish()
    write_run(run_dir, b.events)
    seq = find(b.events, "update_skipped") + 1
    report = audit_run(run_dir)
    assert (seq, 6) in found(report)
    assert found(report) == {(seq, 6), (seq, 2)}  # the machine refuses it too, once


def test_epoch_scheduler_not_stepped_is_invariant_6(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    seq = find(events, "scheduler_stepped", name="plateau")
    del events[seq]
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    # the history right after is where epoch 0's count is checked; the next plateau step counts 1 again
    assert (seq, 6) in found(report)
    assert 6 in invariants(report)


def test_optimizer_clock_scheduler_missing_a_step_is_invariant_6_at_the_receipt(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    receipt = find(events, "update_committed", 1)
    assert events[receipt + 1].KIND == "scheduler_stepped"
    del events[receipt + 1]
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert (receipt, 6) in found(report)  # named at the receipt that went unanswered
    assert invariants(report) <= {6, 10}  # later steps counters and LAST's scheduler state disagree too


# --- invariant 7 ---------------------------------------------------------------------------


def test_second_decision_in_an_epoch_is_invariant_7(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    seq = find(events, "monitor_decided", 1) + 1
    events.insert(seq, events[seq - 1])
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert (seq, 7) in found(report)
    assert invariants(report) == {2, 7}


def test_decision_on_an_unvalidated_epoch_is_invariant_7(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    seq = find(events, "validation_done", 1)
    del events[seq]
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert (seq + 1, 7) in found(report)  # the decision, now one seq earlier
    assert invariants(report) == {7}


def test_best_for_an_epoch_that_did_not_improve_is_invariant_7(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    last = find(events, "last_committed", epoch=1, final=False)
    events.insert(last + 1, BestCommitted(manifest=events[last].manifest, epoch=1, monitor="val_loss", value=0.9))
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert found(report) == {(last + 1, 7)}


def test_improved_epoch_without_best_is_invariant_7(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    best = find(events, "best_committed", 0)
    del events[best]
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert found(report) == {(best - 1, 7)}  # named at epoch 0's LAST


def test_early_stop_after_an_improving_decision_is_invariant_7(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    seq = find(events, "scheduler_stepped", name="plateau") + 1  # epoch 0 improved
    events.insert(seq, StopRequested(epoch=0, step=1, reason="early_stopping"))
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert found(report) == {(seq, 7)}


# --- invariant 8 ---------------------------------------------------------------------------


def test_finalization_out_of_order_is_invariant_8(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    first = find(events, "callback_finalized", 0)
    events[first], events[first + 1] = events[first + 1], events[first]
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert found(report) == {(first, 8)}
    assert (report.violations[0].expected, report.violations[0].found) == ("saver#1", "logger#0")


def test_callback_never_finalized_is_invariant_8(template: Run, tmp_path: Path) -> None:
    events = list(template.events)
    del events[find(events, "callback_finalized", 1)]
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert found(report) == {(len(events) - 1, 8)}


def test_completed_run_without_final_last_is_invariant_8(template: Run, tmp_path: Path) -> None:
    events = [e for e in template.events if not (isinstance(e, LastCommitted) and e.final)]
    del events[-2]  # the checkpoint_stored of the final LAST
    report = audit_run(rewrite(template, tmp_path, events).run_dir)
    assert found(report) == {(len(events) - 1, 8)}


# --- invariant 9 ---------------------------------------------------------------------------


def test_edited_view_is_invariant_9(clean: Run) -> None:
    path = clean.run_dir / "views" / "history.csv"
    text = path.read_text()
    path.write_text(text.replace("0.0729", "0.073"))
    report = audit_run(clean.run_dir)
    assert found(report) == {(None, 9)}
    (v,) = report.violations
    assert "views/history.csv" in v.message and "0.0729" in (v.expected or "") and "0.073," in (v.found or "")


def test_absent_views_are_not_checked(clean: Run) -> None:
    shutil.rmtree(clean.run_dir / "views")
    assert audit_run(clean.run_dir).ok


# --- invariant 10 --------------------------------------------------------------------------


def _replace_manifest(events: list[Event], run: Run, epoch: int, **changes: object) -> int:
    """Point epoch's LAST (and its phase pointer) at a copy of its manifest with ``changes``; return LAST's seq."""
    seq = find(events, "last_committed", epoch=epoch, final=False)
    m = read_manifest(run.store, events[seq].manifest)
    parts = {name: (c.codec, component_bytes(run.store, name, c)) for name, c in m.components.items()}
    parts.update(changes.pop("parts", {}))  # type: ignore[arg-type]
    counters = changes.get("counters", m.counters)
    digest, _ = write_checkpoint(run.store, run_id=m.run_id, epoch=m.epoch, step=m.step,
                                 counters=counters, parts=parts)  # type: ignore[arg-type]
    events[seq] = msgspec.structs.replace(events[seq], manifest=digest)
    for i, e in enumerate(events):
        if isinstance(e, (PhaseCommitted, BestCommitted)) and e.epoch == epoch:
            events[i] = msgspec.structs.replace(e, manifest=digest)
    return seq


def test_manifest_counters_differing_from_projection_is_invariant_10(template: Run, tmp_path: Path) -> None:
    run = copy_run(template, tmp_path)
    events = list(template.events)
    seq = _replace_manifest(events, run, 1, counters=Counters(batch=7, step=3, global_step=3, epoch=2, epoch_step=4))
    shutil.rmtree(run.run_dir / "events.lmdb")
    write_run(run.run_dir, events)
    report = audit_run(run.run_dir)
    assert found(report) == {(seq, 10)}
    (v,) = report.violations
    assert '"batch":8' in (v.expected or "") and '"batch":7' in (v.found or "")


def test_scheduler_state_differing_from_projection_is_invariant_10(template: Run, tmp_path: Path) -> None:
    run = copy_run(template, tmp_path)
    events = list(template.events)
    stale = {"warmup": {"steps": 1, "lrs": [0.09], "plateau": None},
             "plateau": {"steps": 1, "lrs": [0.09], "plateau": {"best": 0.8, "num_bad_epochs": 0, "cooldown_counter": 0}}}
    seq = _replace_manifest(events, run, 1, parts={"schedulers": ("msgpack", msgspec.msgpack.encode(stale))})
    shutil.rmtree(run.run_dir / "events.lmdb")
    write_run(run.run_dir, events)
    report = audit_run(run.run_dir)
    assert found(report) == {(seq, 10)}
    assert sorted(v.message for v in report.violations) == [
        "scheduler 'plateau' state in LAST's checkpoint differs from the projection",
        "scheduler 'warmup' state in LAST's checkpoint differs from the projection",
    ]


# --- scale ---------------------------------------------------------------------------------


def test_audit_streams_a_long_run(tmp_path: Path) -> None:
    """Many epochs audit clean; the pass keeps O(epoch) memory (projections are folded, not listed)."""
    run_dir = tmp_path / "runs" / RUN_ID
    b = RunBuilder(run_dir)
    b.start(epochs=30)
    for e in range(30):
        b.epoch(e, val_loss=1.0 - 0.01 * e if e % 3 else 2.0)
    b.finish(epochs=30)
    write_run(run_dir, b.events)
    report = audit_run(run_dir)
    assert report.violations == [] and report.committed_epoch == 29


@pytest.mark.parametrize("mode, value", [("min", float("-inf")), ("max", float("inf")), ("min", float("nan"))])
def test_the_audit_judges_a_decision_by_the_monitors_own_rule_a_value_not_finite_never_improves(mode, value) -> None:
    # the audit once had a copy of the rule that let -inf improve a "min" monitor (and +inf a "max" one):
    # it would have called the monitor's "not improved" a violation
    import nnx_es.audit.committed as committed
    from nnx_es.monitor import Monitor, improves

    assert committed.improves is improves  # one rule
    monitor = Monitor("val_loss", mode=mode)
    assert not improves(value, monitor.best, mode, 0.0)
    assert monitor.decide(0, value).improved is False
    assert improves(1.0, monitor.best, mode, 0.0)  # a finite value improves on the start
