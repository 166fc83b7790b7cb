"""Bit rot in a real run's log: a flip that still decodes is caught by the checksums (events/sums.py).

Every flip inside a stored value's bytes in ``data.mdb`` is named by the audit
(invariant 1, with the seq range of its write transaction) and refused by a
resume; a log written before checksums existed is audited with a note, not a
violation, and is continued with covered batches.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from crashkit import copy_run, raw_values
from events.log import LmdbLog
from events.sums import SUMS_DB
from nnx_es import Trainer
from nnx_es.audit import audit_run
from nnx_es.cli import replay as replay_cli
from nnx_es.errors import ResumeError
from trainkit import loaders, small_net

torch.set_num_threads(1)

RUN_ID = "r"


def _trainer(runs: Path) -> Trainer:
    net = small_net(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", runs_root=runs, run_id=RUN_ID,
                   seed=0, progress=False)


def _fit(runs: Path, epochs: int, **kw: Any):
    return _trainer(runs).fit(*loaders(batch_size=8, n_train=32), epochs=epochs, **kw)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("template")
    _fit(runs, 2)
    return runs / RUN_ID


def _flip_bit(run_dir: Path, raw: bytes, bit: int) -> None:
    """Flip bit ``bit`` of the value ``raw`` in data.mdb itself, in every copy (stale pages hold old ones)."""
    path = run_dir / "events.lmdb" / "data.mdb"
    data = bytearray(path.read_bytes())
    at = data.find(raw)
    assert at >= 0, "the value must be stored contiguously in data.mdb"
    while at >= 0:
        data[at + bit // 8] ^= 1 << (bit % 8)
        at = data.find(raw, at + 1)
    path.write_bytes(bytes(data))


def _checksum_ranges(report: Any) -> list[tuple[int, int]]:
    out = []
    for v in report.violations:
        if v.invariant == 1 and "do not match their checksum" in v.message:
            first, last = map(int, v.message.split()[2].split(".."))
            assert v.seq == first
            out.append((first, last))
    return out


def _strip_sums(run_dir: Path) -> None:
    """Make ``run_dir``'s log look written before checksums existed: drop its ``sums`` database."""
    env = lmdb.open(str(run_dir / "events.lmdb"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(SUMS_DB, txn=txn), delete=True)
    env.close()


def test_a_clean_run_is_covered_end_to_end_and_audits_clean(template: Path) -> None:
    with LmdbLog(template / "events.lmdb", readonly=True) as log:
        assert list(log.verify_sums()) == []
        records = list(log.read_sums())
        assert records[0].first == 0 and records[-1].last == log.next_seq - 1
    report = audit_run(template)
    assert report.ok and report.violations == [] and report.notes == []


def test_a_flipped_float_digit_that_still_decodes_is_a_checksum_violation(template: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = copy_run(template, tmp_path)
    seq, raw = next((s, r) for s, r in raw_values(run_dir) if b"microbatch_done" in r)
    _flip_bit(run_dir, raw, 8 * (len(raw) - 2) + 3)  # a mantissa bit of the trailing float (the loss)
    report = audit_run(run_dir)
    (rng,) = _checksum_ranges(report)
    assert rng[0] <= seq <= rng[1]
    assert [(v.seq, v.invariant) for v in report.violations] == [(rng[0], 1)]  # nothing else saw it
    assert replay_cli.main([str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert f"seq {rng[0]}  invariant 1  values seq {rng[0]}..{rng[1]} do not match their checksum" in out
    before = (run_dir / "events.lmdb" / "data.mdb").read_bytes()
    with pytest.raises(ResumeError, match=rf"values seq {rng[0]}..{rng[1]} do not match their checksum"):
        _fit(run_dir.parent, 3, resume_from=run_dir)
    assert (run_dir / "events.lmdb" / "data.mdb").read_bytes() == before, "a refused resume changed the log"


def test_every_bit_flip_inside_a_stored_value_is_named_by_the_audit(template: Path, tmp_path_factory) -> None:
    values = raw_values(template)

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(index=st.integers(0, len(values) - 1), data=st.data())
    def check(index: int, data: Any) -> None:
        seq, raw = values[index]
        bit = data.draw(st.integers(0, 8 * len(raw) - 1))
        run_dir = copy_run(template, tmp_path_factory.mktemp("flip"))
        _flip_bit(run_dir, raw, bit)
        report = audit_run(run_dir)
        assert not report.ok
        assert any(a <= seq <= b for a, b in _checksum_ranges(report)), report.violations
        shutil.rmtree(run_dir.parent, ignore_errors=True)

    check()


def test_a_log_written_before_checksums_audits_with_a_note_and_is_continued_covered(
        template: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = copy_run(template, tmp_path)
    _strip_sums(run_dir)
    n = len(raw_values(run_dir))
    before = (run_dir / "events.lmdb" / "data.mdb").read_bytes()
    report = audit_run(run_dir)
    assert report.ok and report.violations == []
    assert report.notes == [f"values seq 0..{n - 1} ({n} events) were written before checksums existed: "
                            "not verified against bit rot"]
    assert (run_dir / "events.lmdb" / "data.mdb").read_bytes() == before, "a read-only audit created something"
    assert replay_cli.main([str(run_dir)]) == 0
    assert "note: values seq 0.." in capsys.readouterr().out

    _fit(run_dir.parent, 3, resume_from=run_dir)  # appends to the old log
    with LmdbLog(run_dir / "events.lmdb", readonly=True) as log:
        problems = list(log.verify_sums())
        records = list(log.read_sums())
        total = log.next_seq
    assert [p[:3] for p in problems] == [(0, n - 1, "uncovered")]
    assert records[0].first == n and records[-1].last == total - 1
    report = audit_run(run_dir)
    assert report.ok and len(report.notes) == 1
