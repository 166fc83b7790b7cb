"""Corrupt run directories: truncated files, values the codec does not know, sequence gaps,
changed keys, and mutations of real stored events (flipped bytes: ``test_flipped_bytes.py``).

Every corruption is refused with a named reason and nothing else: reading the log raises
:class:`CorruptEventError` naming the seq (a value) or :class:`EventLogError` (a truncated
file); the audit names invariant 1 at the seq, or raises ``EventLogError`` when LMDB cannot
read the log at all; a resume raises ``ResumeError`` (naming the seq) or ``EventLogError``,
restores nothing and writes nothing. The codec's own fuzzing (arbitrary bytes, random tagged
maps) lives in ``tests/unit/events/test_codec.py``; here the fuzzed inputs are mutations of real
stored events, in the decoder and in a whole run."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crashkit import change_key, copy_run, raw_values, run_in_child
from events.codec import CURRENT_TYPES, decode
from events.errors import CorruptEventError, EventLogError, NnxError, SequenceGapError, TruncatedLogError
from events.log import LmdbLog
from nnx_es import load_result
from nnx_es.audit import NotARunError, audit_run
from nnx_es.cli import inspect as inspect_cli
from nnx_es.cli import replay as replay_cli
from nnx_es.errors import ResumeError
from corruptkit import assert_refused_untouched, data_file, resume_run, seq_of, template  # noqa: F401 (template: the fixture)


# --- truncated files --------------------------------------------------------------------------

TRUNCATIONS = {
    # name -> (bytes kept: int, or negative = cut that many from the end; what the refusal says)
    "one byte": (1, "not an LMDB file|cannot open"),
    "first page": (4096, "not an LMDB file"),
    "both meta pages": (8192, "is truncated: data.mdb has 8192 bytes"),
    "half": (0.5, "is truncated"),
    "last page missing": (-4096, "is truncated"),
    "one byte short": (-1, "is truncated"),
}


def _truncate(run_dir: Path, keep: float) -> int:
    path = data_file(run_dir)
    data = path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(data) + keep)
    path.write_bytes(data[:n])
    return n


@pytest.mark.parametrize("name", list(TRUNCATIONS))
def test_a_truncated_data_file_is_refused_with_a_named_reason_never_a_crash(template, tmp_path, name):
    """LMDB reads through a memory map: without the size check a read of a truncated data.mdb
    dies of SIGBUS (the whole process, not an exception)."""
    keep, reason = TRUNCATIONS[name]
    run_dir = copy_run(template, tmp_path)
    _truncate(run_dir, keep)
    before = data_file(run_dir).read_bytes()

    def read() -> None:
        with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
            list(log.read())

    # in a forked child each: a regression here is a SIGBUS, which would kill the test run
    for what, target in (("read", read), ("audit", lambda: audit_run(run_dir)), ("resume", lambda: resume_run(run_dir))):
        outcome = run_in_child(target)
        error = "TruncatedLogError" if "is truncated" in reason else "EventLogError"
        assert re.fullmatch(rf"raised {error}: .*({reason}).*", outcome), f"{what}: {outcome}"
    assert data_file(run_dir).read_bytes() == before


def test_an_empty_data_file_is_refused_by_readers_and_never_resumed(template, tmp_path, capsys):
    run_dir = copy_run(template, tmp_path)
    data_file(run_dir).write_bytes(b"")
    empty = rf"event log at .* is truncated: {re.escape(str(data_file(run_dir)))} is empty \(0 bytes"
    with pytest.raises(TruncatedLogError, match=empty):
        audit_run(run_dir)
    with pytest.raises(TruncatedLogError, match=empty):
        load_result(run_dir)
    for tool, argv in ((replay_cli, [str(run_dir)]), (inspect_cli, [str(run_dir), "summary"])):
        assert tool.main(argv) == 2
        assert re.search(empty, capsys.readouterr().err)
    # a writer would make the empty file a new, empty log: refused before LMDB opens it
    assert_refused_untouched(run_dir, TruncatedLogError, empty)
    assert data_file(run_dir).stat().st_size == 0 and not (run_dir / "events.lmdb" / "lock.mdb").exists()


def test_a_run_without_its_event_log_is_refused(template, tmp_path):
    run_dir = copy_run(template, tmp_path)
    shutil.rmtree(run_dir / "events.lmdb")
    with pytest.raises(NotARunError, match="holds a run.s blobs or views but no event log: .* is missing"):
        audit_run(run_dir)
    with pytest.raises(ResumeError, match="has no event log"):
        resume_run(run_dir)
    assert not (run_dir / "events.lmdb").exists()


def test_garbage_in_place_of_the_data_file_is_refused(template, tmp_path):
    run_dir = copy_run(template, tmp_path)
    data_file(run_dir).write_bytes(b"this is not an LMDB environment\n" * 512)
    with pytest.raises(EventLogError, match="not an LMDB file"):
        audit_run(run_dir)
    assert_refused_untouched(run_dir, EventLogError, "not an LMDB file")


# --- values the codec does not know ------------------------------------------------------------


def _replace_value(run_dir: Path, seq: int, payload: bytes) -> None:
    with LmdbLog(run_dir / "events.lmdb") as log:
        log.put_raw(seq, payload)


def _retagged(raw: bytes, tag: str) -> bytes:
    fields = msgspec.msgpack.decode(raw)
    return msgspec.msgpack.encode({**fields, "kind": tag})


FORGERIES = {
    # name -> (kind of the victim event, forged payload from its raw bytes, what the reason names)
    "unknown kind": ("epoch_began", lambda raw: _retagged(raw, "epoch_exploded"), "epoch_exploded"),
    "future schema version": ("last_committed", lambda raw: _retagged(raw, "last_committed@9"), "last_committed@9"),
    "legacy version missing a field": (
        "update_committed", lambda raw: _retagged(raw, "update_committed"), "missing required field"),
    "field of the wrong type": (
        "history_appended", lambda raw: msgspec.msgpack.encode({**msgspec.msgpack.decode(raw), "record": 7}),
        "Expected `object`"),
}


@pytest.mark.parametrize("name", list(FORGERIES))
@pytest.mark.parametrize("placement", ["inside the committed view", "appended as a tail"])
def test_an_event_the_codec_does_not_know_is_refused_naming_its_seq(template, tmp_path, name, placement):
    kind, forge, reason = FORGERIES[name]
    run_dir = copy_run(template, tmp_path)
    values = raw_values(run_dir)
    victim = seq_of(run_dir, kind, 0)
    seq = victim if placement == "inside the committed view" else len(values)
    _replace_value(run_dir, seq, forge(dict(values)[victim]))
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        with pytest.raises(CorruptEventError) as info:
            list(log.read())
    assert info.value.seq == seq and reason in info.value.reason
    report = audit_run(run_dir)
    assert [(v.seq, v.invariant) for v in report.violations if v.invariant == 1] == [(seq, 1)]
    assert reason in next(v.message for v in report.violations if v.invariant == 1)
    assert_refused_untouched(run_dir, ResumeError, rf"event at seq {seq} does not decode")


def test_a_sequence_gap_is_refused_by_the_resume_and_named_by_the_audit(template, tmp_path):
    run_dir = copy_run(template, tmp_path)
    seq = seq_of(run_dir, "microbatch_done", 3)
    with LmdbLog(run_dir / "events.lmdb") as log:
        log.delete_raw(seq)
    report = audit_run(run_dir)
    gap = [v for v in report.violations if v.invariant == 1]
    assert len(gap) == 1 and gap[0].seq == seq + 1 and "sequence gap" in gap[0].message
    # never continued: a resume would append behind a hole in the run's record
    assert_refused_untouched(run_dir, ResumeError, rf"sequence gap: expected seq {seq}, found seq {seq + 1}")


# --- changed keys: the checksums cover values only ------------------------------------------------

KEY_CHANGES = {
    # name -> the key the entry of seq 20 is stored under
    "to the next key (a duplicate)": 21,  # bit 0: 0x14 -> 0x15
    "to an earlier key": 16,  # bit 2
    "past the log's end": 20 | 1 << 40,  # a high bit
}


@pytest.mark.parametrize("name", list(KEY_CHANGES))
def test_a_changed_key_is_named_by_the_audit_and_refused_by_the_resume(template, tmp_path, name):
    run_dir = copy_run(template, tmp_path)
    n, new = len(raw_values(run_dir)), KEY_CHANGES[name]
    assert n > 30
    change_key(run_dir / "events.lmdb", 20, new)
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        assert [s for s, _ in log.read_raw()] == [*range(20), new, *range(21, n)]
        with pytest.raises(SequenceGapError) as info:
            log.check_keys()
    assert (info.value.kind, info.value.expected, info.value.found) == ("changed", 20, new)
    named = f"changed key: key {new} follows key 19 and precedes key 21, in the place of seq 20"
    report = audit_run(run_dir)
    assert report.events == n
    assert [(v.seq, v.message) for v in report.violations if v.invariant == 1] == [(20, named)]
    # never continued: the values (and their checksums) are intact, the key is not
    assert_refused_untouched(run_dir, ResumeError, rf"cannot resume .*: its event log has a {re.escape(named)}; "
                                                    "nothing was restored or written")


def test_two_changed_keys_in_a_row_are_named_without_a_cascade(template, tmp_path):
    """Keys 0..19, 16, 17, 22, ...: the key after an out-of-place key does not explain it."""
    run_dir = copy_run(template, tmp_path)
    change_key(run_dir / "events.lmdb", 20, 16)
    change_key(run_dir / "events.lmdb", 21, 17)
    messages = [(v.seq, v.message) for v in audit_run(run_dir).violations if v.invariant == 1]
    # the pass goes on from the key found: one violation where the keys jump back, one where they jump ahead
    assert messages == [
        (16, "key out of order: key 16 follows key 19 (expected seq 20)"),
        (22, "sequence gap: expected seq 18, found seq 22 (key 22 follows key 17; seqs 18..21 are missing)"),
    ]
    assert_refused_untouched(run_dir, ResumeError, r"its event log has a key out of order: key 16 follows key 19")


# --- fuzzing: mutations of real stored events ----------------------------------------------------


@pytest.fixture(scope="module")
def real_payloads(template) -> list[bytes]:
    """One stored payload of every kind the template run wrote."""
    seen: dict[str, bytes] = {}
    for seq, raw in raw_values(template):
        seen.setdefault(decode(raw, seq).KIND, raw)
    return list(seen.values())


@st.composite
def mutations(draw: Any, payloads: list[bytes]) -> bytes:
    raw = bytearray(draw(st.sampled_from(payloads)))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        i = draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and raw:
            raw[i] = draw(st.integers(0, 255))
        elif op == "truncate":
            del raw[i:]
        elif op == "insert":
            raw[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and raw:
            del raw[i]
    return bytes(raw)


def test_decode_of_mutated_real_events_raises_only_corrupt_event_error(real_payloads):
    assert len(real_payloads) >= 15  # every lifecycle kind of a run with a plateau scheduler and BEST

    @settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(mutations(real_payloads))
    def check(payload: bytes) -> None:
        try:
            event = decode(payload, 17)
        except CorruptEventError as exc:
            assert exc.seq == 17 and exc.reason
            return
        assert type(event) in CURRENT_TYPES  # a mutation that still decodes is a well-formed event

    check()


def test_a_run_with_a_mutated_event_is_audited_and_resumed_or_refused_never_crashed(template, tmp_path_factory):
    """One stored value mutated anywhere in a real run: the audit reports (never raises), and a
    resume either succeeds or raises the library's own error; an undecodable value is always
    named by seq, by both."""
    values = raw_values(template)

    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(seq=st.integers(0, len(values) - 1), data=st.data())
    def check(seq: int, data: Any) -> None:
        payload = data.draw(mutations([values[seq][1]]))
        run_dir = copy_run(template, tmp_path_factory.mktemp("fuzz"))
        _replace_value(run_dir, seq, payload)
        try:
            decode(payload, seq)
            decodable = True
        except CorruptEventError:
            decodable = False
        report = audit_run(run_dir)
        if not decodable:
            assert (seq, 1) in [(v.seq, v.invariant) for v in report.violations]
        try:
            resume_run(run_dir)
        except NnxError as exc:
            if not decodable:
                assert isinstance(exc, ResumeError) and f"seq {seq}" in str(exc), exc
        else:
            assert decodable, "a run with an undecodable event was resumed"
        shutil.rmtree(run_dir.parent, ignore_errors=True)

    check()
