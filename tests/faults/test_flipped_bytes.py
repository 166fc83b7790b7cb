"""Flipped bytes in a run's log: inside a stored event's value (before and after a projection
snapshot) and in LMDB's own pages. Each is refused with a named reason and nothing else: reading
raises :class:`CorruptEventError` naming the seq, or :class:`EventLogError` for LMDB's pages; the
audit names invariant 1 at the seq; a resume raises ``ResumeError`` or ``EventLogError``,
restores nothing and writes nothing. Truncations, unknown kinds, changed keys and fuzzed events:
``test_corrupt_inputs.py``."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import lmdb
import pytest

from crashkit import change_key, copy_run, flip_in_file, raw_values
from events.codec import decode
from events.errors import CorruptEventError, EventLogError
from events.log import LmdbLog
from nnx_es import load_result
from nnx_es.audit import audit_run
from nnx_es.cli import inspect as inspect_cli
from nnx_es.errors import ResumeError
from corruptkit import assert_refused_untouched, data_file, fit, make_trainer, RUN_ID, seq_of, template  # noqa: F401 (template: the fixture)


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
    seq = seq_of(run_dir, "history_appended", 1)  # inside the committed view
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
    assert_refused_untouched(run_dir, ResumeError, rf"cannot resume .*event at seq {seq} does not decode")
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
    seq = seq_of(run_dir, "history_appended", 0)
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
    assert_refused_untouched(run_dir, ResumeError, rf"cannot resume .*event at seq {seq} does not decode")


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
    _flip_in_file(run_dir, seq_of(run_dir, "history_appended", 0), "msgpack header")
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
    assert_refused_untouched(run_dir, EventLogError, r"failed: \w+Error: mdb_")
