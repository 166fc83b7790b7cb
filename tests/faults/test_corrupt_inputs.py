"""Corrupt run directories: flipped bytes, truncated files, unknown kinds, wrong schema versions.

Every corruption is refused with a named reason and nothing else: reading the log raises
:class:`CorruptEventError` naming the seq (a value) or :class:`EventLogError` (LMDB's own
pages, a truncated file); the audit names invariant 1 at the seq, or raises
``EventLogError`` when LMDB cannot read the log at all; a resume raises ``ResumeError``
(naming the seq) or ``EventLogError``, restores nothing and writes nothing. The codec's
own fuzzing (arbitrary bytes, random tagged maps) lives in ``tests/unit/events/test_codec.py``;
here the fuzzed inputs are mutations of real stored events, in the decoder and in a whole run.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from crashkit import change_key, copy_run, flip_in_file, raw_values, run_in_child
from events.codec import CURRENT_TYPES, decode
from events.errors import CorruptEventError, EventLogError, NnxError, SequenceGapError, TruncatedLogError
from events.log import LmdbLog
from nnx_es import Trainer, load_result
from nnx_es.audit import NotARunError, audit_run
from nnx_es.cli import inspect as inspect_cli
from nnx_es.cli import replay as replay_cli
from nnx_es.errors import ResumeError
from trainkit import EpochCounter, loaders, small_net

torch.set_num_threads(1)

EPOCHS = 2
RUN_ID = "r"


Count = EpochCounter


def make_trainer(runs: Path, run_id: str | None) -> Trainer:
    net = small_net(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    return Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", schedulers=[plateau], callbacks=[Count()],
                   accumulation=2, runs_root=runs, run_id=run_id, seed=0, progress=False)


def fit(trainer: Trainer, **kw: Any):
    return trainer.fit(*loaders(batch_size=8, n_train=32), epochs=EPOCHS, **kw)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("template")
    fit(make_trainer(runs, RUN_ID))
    return runs / RUN_ID


def data_file(run_dir: Path) -> Path:
    return run_dir / "events.lmdb" / "data.mdb"


def _resume(run_dir: Path):
    return fit(make_trainer(run_dir.parent, None), resume_from=run_dir)


def _assert_refused_untouched(run_dir: Path, error: type[Exception], match: str) -> None:
    """A resume of ``run_dir`` raises ``error`` matching ``match`` and leaves data.mdb byte-identical."""
    before = data_file(run_dir).read_bytes()
    with pytest.raises(error, match=match):
        _resume(run_dir)
    assert data_file(run_dir).read_bytes() == before, "a refused resume changed the log"


def _seq_of(run_dir: Path, kind: str, occurrence: int = 0) -> int:
    return [s for s, raw in raw_values(run_dir) if decode(raw, s).KIND == kind][occurrence]


# --- flipped bytes inside a stored value ----------------------------------------------------


def _flip_in_file(run_dir: Path, seq: int, where: str) -> None:
    """Flip one byte of the value stored under ``seq``, in data.mdb itself (:func:`crashkit.flip_in_file`)."""
    raw = dict(raw_values(run_dir))[seq]
    if where == "kind tag":  # the last letter of the tag: "history_appended" -> "history_appendee"
        tag = decode(raw).KIND.encode()
        offset = raw.index(tag) + len(tag) - 1
        flip_in_file(run_dir, seq, offset, raw[offset] ^ 0x01)
    else:  # the msgpack map header becomes a byte msgpack never uses
        flip_in_file(run_dir, seq, 0, 0xC1)


@pytest.mark.parametrize("where", ["kind tag", "msgpack header"])
def test_a_flipped_byte_in_a_stored_event_is_refused_naming_its_seq(template, tmp_path, where):
    run_dir = copy_run(template, tmp_path)
    seq = _seq_of(run_dir, "history_appended", 1)  # inside the committed view
    _flip_in_file(run_dir, seq, where)
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        with pytest.raises(CorruptEventError) as info:
            list(log.read())
    assert info.value.seq == seq and f"event at seq {seq} does not decode" in str(info.value)
    report = audit_run(run_dir)
    assert not report.ok
    decoding = [v for v in report.violations if v.invariant == 1 and "checksum" not in v.message]
    assert [(v.seq, v.invariant) for v in decoding] == [(seq, 1)]
    (bad_sum,) = [v for v in report.violations if "checksum" in v.message]  # the batch holding it
    first, last = map(int, bad_sum.message.split()[2].split(".."))
    assert first <= seq <= last
    _assert_refused_untouched(run_dir, ResumeError, rf"cannot resume .*event at seq {seq} does not decode")
    with pytest.raises(CorruptEventError, match=f"seq {seq}"):
        load_result(run_dir)


def _snapshotted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Any, int]:
    """A finished run with a projection snapshot every few events: (run dir, result, newest snapshot's seq)."""
    from nnx_es.runtime import recording as recorder

    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", 5)
    runs = tmp_path / "runs"
    result = fit(make_trainer(runs, RUN_ID))
    with LmdbLog(runs / RUN_ID / "events.lmdb", readonly=True) as log:
        newest = max(s for s, _ in log.read_snapshots())
    return runs / RUN_ID, result, newest


def _summary(run_dir: Path, capsys: pytest.CaptureFixture[str], *flags: str, status: int = 0) -> dict[str, Any]:
    """``inspect summary --json`` of the run; its exit status must be ``status`` (1: values it verified do not)."""
    assert inspect_cli.main([str(run_dir), "summary", "--json", *flags]) == status
    return json.loads(capsys.readouterr().out)


def test_a_flipped_byte_before_a_projection_snapshot_is_reported_by_summary_verify_replay_and_resume(
        tmp_path, monkeypatch, capsys):
    """Deliberate: ``load_result``, ``inspect --at`` and ``inspect summary`` fold from the newest
    snapshot (issue 14: opening a run costs O(events since it)), so damage to a value before it is
    not seen there -- the state they return was folded from that value while intact, the run's own
    answer; the summary says from which seq it verified. The readers that must report damage still
    do: ``inspect summary --verify`` (every value's checksum), ``tools/replay`` (re-folds from 0)
    and a resume (reads the whole log)."""
    run_dir, result, newest = _snapshotted_run(tmp_path, monkeypatch)
    seq = _seq_of(run_dir, "history_appended", 0)
    assert seq < newest
    _flip_in_file(run_dir, seq, "msgpack header")
    assert load_result(run_dir) == result  # from the snapshot: the run's answer
    doc = _summary(run_dir, capsys)
    assert doc["checksums"] == "ok" and doc["verified"]["from_seq"] == newest + 1 > seq
    assert doc["verified"]["snapshot_seq"] == newest and "summary --verify" in doc["verified"]["whole_log"]
    doc = _summary(run_dir, capsys, "--verify", status=1)
    assert "do not verify: run tools/replay" in doc["checksums"] and doc["verified"]["from_seq"] == 0
    report = audit_run(run_dir)
    assert (seq, 1) in [(v.seq, v.invariant) for v in report.violations]
    _assert_refused_untouched(run_dir, ResumeError, rf"cannot resume .*event at seq {seq} does not decode")


def test_summary_verify_keeps_its_exit_status_when_the_reader_leaves_early(tmp_path, monkeypatch):
    """``inspect run summary --verify | head -1`` on a damaged log: exit 1 still (it exited 0 when the
    closed pipe cut the output short, and a script would have passed the run)."""
    import io
    import os
    import sys

    def to_a_gone_reader(*argv: str) -> int:
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first line
        out = io.TextIOWrapper(io.FileIO(write_end, "w"))
        monkeypatch.setattr(sys, "stdout", out)
        try:
            return inspect_cli.main([str(run_dir), *argv])
        finally:
            monkeypatch.undo()
            out.close()

    run_dir, _, _ = _snapshotted_run(tmp_path, monkeypatch)
    assert to_a_gone_reader("summary", "--verify") == 0  # intact: 0, quietly
    _flip_in_file(run_dir, _seq_of(run_dir, "history_appended", 0), "msgpack header")
    assert to_a_gone_reader("summary", "--verify") == 1
    assert to_a_gone_reader("summary", "--verify", "--json") == 1


def test_a_flipped_byte_after_the_newest_snapshot_is_reported_by_summary(tmp_path, monkeypatch, capsys):
    """What the summary folds it verifies: a value after the newest snapshot (here one that still
    decodes, so only its checksum tells) is reported, without ``--verify``."""
    run_dir, _, newest = _snapshotted_run(tmp_path, monkeypatch)
    seq = [s for s, _ in raw_values(run_dir)][-1]  # run_finalized
    assert seq > newest
    raw = dict(raw_values(run_dir))[seq]
    at = raw.index(b"completed")
    flip_in_file(run_dir, seq, at, ord("C"))  # "Completed": decodes, an unknown status
    doc = _summary(run_dir, capsys, status=1)
    assert doc["checksums"] == "1 range of values do not verify: run tools/replay"
    assert doc["verified"]["from_seq"] == newest + 1
    assert (seq, 1) in [(v.seq, v.invariant) for v in audit_run(run_dir).violations]


def test_summary_checks_the_keys_it_folds_and_verify_every_key(tmp_path, monkeypatch, capsys):
    """A changed key after the newest snapshot stops the summary (exit 2, named); one before it, only
    ``summary --verify`` (and tools/replay) see."""
    run_dir, _, newest = _snapshotted_run(tmp_path, monkeypatch)
    n = len(raw_values(run_dir))
    before, after = 3, n - 1
    assert before < newest < after
    change_key(run_dir / "events.lmdb", before, before | 1 << 40)
    assert _summary(run_dir, capsys)["checksums"] == "ok"
    assert inspect_cli.main([str(run_dir), "summary", "--verify"]) == 2
    assert f"damaged at seq {before}" in capsys.readouterr().err
    change_key(run_dir / "events.lmdb", after, after | 1 << 40)
    assert inspect_cli.main([str(run_dir), "summary"]) == 2
    assert f"damaged at seq {after}" in capsys.readouterr().err


# --- flipped bytes in LMDB's own pages --------------------------------------------------------


def _events_db_record(run_dir: Path) -> tuple[bytes, int, int, int]:
    """(the main DB's record of the ``events`` DB, its root page, page size, last used page)."""
    env = lmdb.open(str(run_dir / "events.lmdb"), readonly=True, max_dbs=4, lock=False)
    try:
        with env.begin() as txn:
            record = txn.get(b"events")
        return record, struct.unpack_from("<Q", record, 40)[0], env.stat()["psize"], env.info()["last_pgno"]
    finally:
        env.close()


def _root_beyond_the_file(run_dir: Path) -> None:
    record, _, _, last = _events_db_record(run_dir)
    path = data_file(run_dir)
    data = bytearray(path.read_bytes())
    at = data.find(b"events" + record) + len(b"events")
    struct.pack_into("<Q", data, at + 40, last + 7)  # md_root: a page past the last used one
    path.write_bytes(bytes(data))


def _root_page_of_the_wrong_type(run_dir: Path) -> None:
    _, root, psize, _ = _events_db_record(run_dir)
    path = data_file(run_dir)
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, root * psize + 10, 0)  # mp_flags: neither branch nor leaf
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", [_root_beyond_the_file, _root_page_of_the_wrong_type],
                         ids=["root beyond the file", "root page of the wrong type"])
def test_a_corrupted_lmdb_page_is_an_event_log_error_everywhere(template, tmp_path, corrupt):
    run_dir = copy_run(template, tmp_path)
    corrupt(run_dir)
    with pytest.raises(EventLogError, match=r"event log at .* failed: \w+Error: mdb_"):
        with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
            list(log.read())
    with pytest.raises(EventLogError, match=r"failed: \w+Error: mdb_"):
        audit_run(run_dir)
    _assert_refused_untouched(run_dir, EventLogError, r"failed: \w+Error: mdb_")


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
    for what, target in (("read", read), ("audit", lambda: audit_run(run_dir)), ("resume", lambda: _resume(run_dir))):
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
    _assert_refused_untouched(run_dir, TruncatedLogError, empty)
    assert data_file(run_dir).stat().st_size == 0 and not (run_dir / "events.lmdb" / "lock.mdb").exists()


def test_a_run_without_its_event_log_is_refused(template, tmp_path):
    run_dir = copy_run(template, tmp_path)
    shutil.rmtree(run_dir / "events.lmdb")
    with pytest.raises(NotARunError, match="holds a run.s blobs or views but no event log: .* is missing"):
        audit_run(run_dir)
    with pytest.raises(ResumeError, match="has no event log"):
        _resume(run_dir)
    assert not (run_dir / "events.lmdb").exists()


def test_garbage_in_place_of_the_data_file_is_refused(template, tmp_path):
    run_dir = copy_run(template, tmp_path)
    data_file(run_dir).write_bytes(b"this is not an LMDB environment\n" * 512)
    with pytest.raises(EventLogError, match="not an LMDB file"):
        audit_run(run_dir)
    _assert_refused_untouched(run_dir, EventLogError, "not an LMDB file")


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
    victim = _seq_of(run_dir, kind, 0)
    seq = victim if placement == "inside the committed view" else len(values)
    _replace_value(run_dir, seq, forge(dict(values)[victim]))
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        with pytest.raises(CorruptEventError) as info:
            list(log.read())
    assert info.value.seq == seq and reason in info.value.reason
    report = audit_run(run_dir)
    assert [(v.seq, v.invariant) for v in report.violations if v.invariant == 1] == [(seq, 1)]
    assert reason in next(v.message for v in report.violations if v.invariant == 1)
    _assert_refused_untouched(run_dir, ResumeError, rf"event at seq {seq} does not decode")


def test_a_sequence_gap_is_refused_by_the_resume_and_named_by_the_audit(template, tmp_path):
    run_dir = copy_run(template, tmp_path)
    seq = _seq_of(run_dir, "microbatch_done", 3)
    with LmdbLog(run_dir / "events.lmdb") as log:
        log.delete_raw(seq)
    report = audit_run(run_dir)
    gap = [v for v in report.violations if v.invariant == 1]
    assert len(gap) == 1 and gap[0].seq == seq + 1 and "sequence gap" in gap[0].message
    # never continued: a resume would append behind a hole in the run's record
    _assert_refused_untouched(run_dir, ResumeError, rf"sequence gap: expected seq {seq}, found seq {seq + 1}")


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
    _assert_refused_untouched(run_dir, ResumeError, rf"cannot resume .*: its event log has a {re.escape(named)}; "
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
    _assert_refused_untouched(run_dir, ResumeError, r"its event log has a key out of order: key 16 follows key 19")


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
            _resume(run_dir)
        except NnxError as exc:
            if not decodable:
                assert isinstance(exc, ResumeError) and f"seq {seq}" in str(exc), exc
        else:
            assert decodable, "a run with an undecodable event was resumed"
        shutil.rmtree(run_dir.parent, ignore_errors=True)

    check()
