"""The audit's pass a segment at a time (nnx_es.audit.segments) reports exactly what the pass event by event does."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
from helpers_runs import RUN_ID, Run, clean, template  # noqa: F401 (fixtures)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logkit import logs

import nnx_es.audit.run as audit_run_module
import nnx_es.audit.segments as segments
from events.codec import encode
from events.log import LmdbLog
from events.logbase import LogBase
from events.schema import Event, MicrobatchDone, RunStarted, SchedulerDecl, UpdateCommitted
from nnx_es.audit import audit_run
from nnx_es.audit.report import AuditReport
from projections import project
from projections.commits import GROUP_KINDS
from projections.snapshots import Snapshot, encode_snapshot


def by_event(run_dir: Path) -> AuditReport:
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        return audit_run_module._audit_by_event(run_dir, log, log.next_seq)


def by_segment(run_dir: Path, parallel: bool = False) -> AuditReport:
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        return audit_run_module._audit(run_dir, log, parallel)


def same(a: AuditReport, b: AuditReport) -> None:
    assert msgspec.json.encode(a) == msgspec.json.encode(b)


def write(run_dir: Path, events: list[Event], flushes: list[int], snapshots: list[tuple[int, bool, bool]]) -> None:
    """``events`` in a run's log, flushed after each index of ``flushes`` (one checksum record per
    flush); a snapshot at each ``(seq, true_fold, in_group)``: the fold of the prefix through seq,
    or of a shorter one (a wrong snapshot), with the flag given."""
    with LmdbLog(run_dir / "events.lmdb") as log:
        for i, event in enumerate(events):
            log.append(event)
            if i in flushes:
                log.flush()
        log.flush()
        pairs = list(enumerate(events))
        for seq, true_fold, in_group in snapshots:
            if seq < len(events):
                state = project(pairs[: seq + 1 if true_fold else seq])
                log.put_snapshot(seq, encode_snapshot(Snapshot(seq=seq, in_group=in_group, projections=state)))


_STARTED = RunStarted(run_id=RUN_ID, seed=0, optimizers=["adam"], schedulers=[
    SchedulerDecl(name="s", clock="optimizer_update", cls="StepLR", optimizer="adam")])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=logs, started=st.sampled_from([None, 0, 1]), flushes=st.lists(st.integers(0, 80), max_size=6),
       snapshots=st.lists(st.tuples(st.integers(0, 80), st.booleans(), st.booleans()), max_size=4))
def test_random_logs_get_the_same_report_by_segment_and_by_event(tmp_path_factory, pairs, started, flushes,
                                                                 snapshots):
    """Random logs (deferred commits, resumes, finalized tails, lifecycle breaks; a run_started first,
    later or none, with an optimizer_update-clock scheduler) and snapshots right and wrong, held back or not."""
    events = [e for _, e in pairs]
    if started is not None:
        events.insert(min(started, len(events)), _STARTED)
    run_dir = tmp_path_factory.mktemp("seg") / RUN_ID
    write(run_dir, events, flushes, snapshots)
    same(by_segment(run_dir), by_event(run_dir))


def test_a_clean_training_run_is_audited_by_segment(clean: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    want = by_event(clean.run_dir)

    def refuse(*_: object) -> AuditReport:
        raise AssertionError("a clean log fell back to the pass event by event")

    monkeypatch.setattr(audit_run_module, "_audit_by_event", refuse)
    same(audit_run(clean.run_dir), want)
    assert want.ok
    same(by_segment(clean.run_dir, parallel=True), want)  # keys and full decoding in a second process


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_the_second_process_may_decode_any_share_of_the_log(clean: Run, share: float, small_chunks,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "_WORKER_SHARE", share)
    same(by_segment(clean.run_dir, parallel=True), by_event(clean.run_dir))


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 8 values in this process (a short log then has many; the second process keeps its own)."""
    monkeypatch.setattr(LogBase, "read_chunk", 8)


@pytest.mark.parametrize("mode", ["one process", "second process decodes all", "this one decodes all"])
@pytest.mark.parametrize("damage", ["undecodable", "optional field", "checksum"])
def test_a_damaged_log_is_audited_event_by_event(clean: Run, damage: str, mode: str, small_chunks,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that does not decode (also one whose only flaw is in an optional field, which the
    lighter decoding of this process skips when the second one decodes it) or a byte changed on
    disk under its checksum: the same findings as the pass event by event, which the audit falls
    back to -- whichever process decodes the value."""
    monkeypatch.setattr(segments, "_WORKER_SHARE", 0.0 if mode == "this one decodes all" else 1.0)
    parallel = mode != "one process"
    seq = next(i for i, e in enumerate(clean.events) if isinstance(e, UpdateCommitted))
    if damage == "checksum":
        raw = encode(clean.events[seq])
        path = clean.log_path / "data.mdb"
        data = path.read_bytes()
        at = data.find(raw)
        assert at >= 0 and data.find(raw, at + 1) < 0
        path.write_bytes(data[:at] + raw.replace(b"kind", b"kinD", 1) + data[at + len(raw):])
    else:
        raw = {
            "undecodable": b"\x81\xa4kind\xa7garbage",
            "optional field": encode(msgspec.structs.replace(clean.events[seq], lrs="not a list")),  # type: ignore
        }[damage]
        with LmdbLog(clean.log_path) as log:
            log.put_raw(seq, raw)  # its checksum recomputed: the value is as its writer wrote it
    want = by_event(clean.run_dir)
    assert not want.ok and any(v.invariant == 1 and v.seq == seq for v in want.violations)
    same(by_segment(clean.run_dir, parallel), want)


def test_hot_kinds_are_read_by_no_check_but_the_lifecycle_and_only_counted_by_the_folds() -> None:
    assert segments.HOT_KINDS == {MicrobatchDone.KIND, UpdateCommitted.KIND}
    assert not segments.HOT_KINDS & GROUP_KINDS


def test_the_second_process_answers_damaged_for_a_changed_key(clean: Run, tmp_path: Path, capsys) -> None:
    run = tmp_path / "copy"
    shutil.copytree(clean.run_dir, run)
    with LmdbLog(run / "events.lmdb") as log:
        n = log.next_seq
        raw = next(v for s, v in log.read_raw(n - 1))
        log.delete_raw(n - 1)
        log.put_raw(n + 5, raw)  # a gap at the end
    assert segments._main([str(run / "events.lmdb"), str(n)]) == 0
    assert capsys.readouterr().out == "damaged\n"
    with LmdbLog(run / "events.lmdb", readonly=True) as log:
        assert not segments.keys_and_values_ok(log, log.next_seq)
    same(by_segment(run, parallel=True), by_event(run))


_MB = MicrobatchDone(epoch=0, batch=0, rows=1, examples=1.0, loss=0.5)
_UC = UpdateCommitted(step=1, epoch=0, microbatches=1, local_examples=1.0, global_examples=1.0, loss=0.5)


@settings(max_examples=200, deadline=None)
@given(lead=st.lists(st.sampled_from(["epoch", "started", "train"]), max_size=3),
       runs=st.lists(st.one_of(st.lists(st.sampled_from("mu"), min_size=1, max_size=200),
                               st.tuples(st.integers(1, 150), st.integers(0, 400)).map(  # legal, one break maybe
                                   lambda kb: [*("mu" * kb[0])[:kb[1]], "u", *("mu" * kb[0])[kb[1]:]])),
                     max_size=4))
def test_the_lifecycle_machine_takes_a_run_at_once_as_event_by_event(lead, runs):
    """Runs of microbatches and receipts (long ones span several 64-code blocks; an illegal pair
    anywhere), after a few events that leave the machine in a legal state or resynchronizing."""
    from events.codec import type_codes
    from events.schema import EpochBegan, TrainBegan
    from nnx_es.audit.report import Sink
    from nnx_es.audit.sequence import LifecycleCheck

    heads = {"epoch": EpochBegan(epoch=0), "started": _STARTED, "train": TrainBegan(start_epoch=0, epochs=1)}
    one, many = LifecycleCheck(Sink()), LifecycleCheck(Sink())
    seq = 0
    for name in lead:
        one.feed(seq, heads[name])
        many.feed(seq, heads[name])
        seq += 1
    for run in runs:
        events = [_MB if c == "m" else _UC for c in run]
        seqs = range(seq, seq + len(events))
        for s, e in zip(seqs, events):
            one.feed(s, e)
        many.feed_run(seqs, events, type_codes(events))
        seq += len(events)
        assert (many.state, many.candidates) == (one.state, one.candidates)
    assert many.sink.violations == one.sink.violations
