"""Checkpoint retention as events: what is kept, what is pruned and when, what the audit and readers say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from nnx_es import NNModel, Trainer, load_result
from nnx_es.audit import audit_run
from nnx_es.errors import CheckpointUnavailableError, ConfigError, ResumeError
from nnx_es.finetune import WeightsFrom
from nnx_es.testing import Fit, crash_test
from trainkit import blobs_data, loaders, params_of, read_events, write_blob
from torch.utils.data import DataLoader, TensorDataset


def _wide_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 300), nn.Tanh(), nn.Linear(300, 300), nn.Tanh(), nn.Linear(300, 3))


def _fit(tmp_path, run_id: str, epochs: int, resume_from=None, **kw):
    net = _wide_net()
    trainer = Trainer(net, torch.optim.Adam(net.parameters(), lr=1e-3), nn.CrossEntropyLoss(), monitor="val_loss",
                      runs_root=tmp_path, run_id=run_id, progress=False, **kw)
    return trainer, trainer.fit(*loaders(), epochs=epochs, resume_from=resume_from)


def _files(run_dir: Path) -> set[str]:
    return {p.name for p in (run_dir / "blobs" / "sha256").rglob("*") if p.is_file()}


def test_by_default_a_run_keeps_last_and_best_and_its_disk_stays_bounded(tmp_path):
    _, kept_all = _fit(tmp_path, "all", 5, keep_last=None)
    _, run = _fit(tmp_path, "bounded", 5)
    assert run.status == "completed"
    events = [e for _, e in read_events(run.run_dir)]
    pruned = [e for e in events if e.KIND == "checkpoint_pruned"]
    lasts = {e.manifest for e in events if e.KIND == "last_committed"}
    kept = {run.last.manifest, run.best.manifest}
    assert {e.manifest for e in pruned} == lasts - kept and all(e.reason == "keep_last=1" for e in pruned)
    assert set(run.pruned) == lasts - kept
    # the files of the two kept checkpoints only; the run keeping everything has six checkpoints' worth
    gone = {b for e in pruned for b in e.blobs}
    assert not gone & _files(Path(run.run_dir))
    assert len(_files(Path(run.run_dir))) < len(_files(Path(kept_all.run_dir))) / 2
    assert audit_run(Path(run.run_dir)).ok and audit_run(Path(kept_all.run_dir)).ok
    probe = NNModel(_wide_net(1))
    assert probe.load(run.run_dir, "best") == run.best.epoch


def test_each_prune_is_in_the_group_of_the_last_that_superseded_it(tmp_path):
    _, run = _fit(tmp_path, "r", 2, keep_best=False)
    kinds = [e.KIND for _, e in read_events(run.run_dir)]
    # after epoch 0's LAST the opening checkpoint goes, after epoch 1's LAST epoch 0's
    groups = []
    for i, k in enumerate(kinds):
        if k == "last_committed":
            j = i + 1
            while j < len(kinds) and kinds[j] in ("best_committed", "phase_committed", "checkpoint_pruned"):
                j += 1
            groups.append(kinds[i + 1:j])
    assert groups[0] == [] and groups[1] == ["best_committed", "checkpoint_pruned"]
    assert groups[2] == ["best_committed", "checkpoint_pruned"] or groups[2] == ["checkpoint_pruned"]


def test_a_missing_blob_of_a_kept_checkpoint_is_a_violation_a_pruned_one_is_not(tmp_path):
    _, run = _fit(tmp_path, "r", 3)
    report = audit_run(Path(run.run_dir))
    assert report.ok  # the pruned checkpoints' bytes are gone on purpose
    write_blob(run.run_dir, run.last.manifest, None)  # delete what LAST names
    violations = audit_run(Path(run.run_dir)).violations
    assert [v.invariant for v in violations] == [4] * len(violations) and violations


def test_loading_a_best_that_retention_pruned_is_refused_with_the_reason(tmp_path):
    x, y = blobs_data(48)
    # val loss rises after epoch 0 (lr too high): BEST stays at epoch 0, LAST moves on
    net = _wide_net()
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=5.0), nn.CrossEntropyLoss(), monitor="val_loss",
                      runs_root=tmp_path, run_id="r", progress=False, keep_best=False)
    run = trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8), loaders()[1], epochs=4)
    if run.best.manifest == run.last.manifest:
        pytest.skip("BEST is LAST on this machine's numerics: nothing of BEST to prune")
    # a load error, not ResumeError (nothing is resumed): NnxError and LookupError
    with pytest.raises(CheckpointUnavailableError, match=r"pruned by checkpoint retention \(keep_last=1, keep_best=False\)"):
        NNModel(_wide_net()).load(run.run_dir, "best")
    with pytest.raises(LookupError, match="keep_best=True"):
        fresh = _wide_net()
        Trainer(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                init_from=WeightsFrom(run.run_dir, "best"))


def test_a_resume_after_pruning_continues_bitwise(tmp_path):
    reference, _ = _fit(tmp_path, "ref", 4)
    first, _ = _fit(tmp_path, "r", 2)
    again, run = _fit(tmp_path, "r", 4, resume_from=tmp_path / "r")
    assert run.status == "completed" and len(run.history) == 4
    for k, v in params_of(reference.net).items():
        assert torch.equal(params_of(again.net)[k], v)
    assert audit_run(Path(run.run_dir)).ok


def test_retention_arguments_are_checked_by_name():
    net = _wide_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="keep_last must be"):
        Trainer(net, opt, nn.CrossEntropyLoss(), keep_last=0)
    with pytest.raises(ConfigError, match="keep_best must be"):
        Trainer(net, opt, nn.CrossEntropyLoss(), keep_best="yes")


def test_kills_before_during_and_after_a_prune_leave_a_resumable_run_that_audits_clean(tmp_path):
    x, y = blobs_data(32)

    def build(runs_root, run_id):
        net = _wide_net()
        trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                          runs_root=runs_root, run_id=run_id, seed=0, progress=False)  # keep_last=1: prunes
        return Fit(trainer, DataLoader(TensorDataset(x, y), batch_size=16))

    report = crash_test(build, epochs=3, points="all", runs_root=tmp_path)
    assert report.ok, report
    assert any("sync" in p for p in report.tried) and len(report.tried) == report.available


def test_a_fork_from_a_pruned_last_is_refused_with_the_reason(tmp_path):
    _, run = _fit(tmp_path, "src", 3)
    first_last = next(seq for seq, e in read_events(run.run_dir) if e.KIND == "last_committed")
    net = _wide_net()
    child = Trainer(net, torch.optim.Adam(net.parameters(), lr=1e-3), nn.CrossEntropyLoss(), monitor="val_loss",
                    runs_root=tmp_path, run_id="child", progress=False)
    with pytest.raises(ResumeError, match=r"checkpoint retention pruned it \(keep_last=1\)"):
        child.fit(*loaders(), epochs=1, resume_from=tmp_path / "src", resume_mode="weights_only",
                  resume_at=first_last)
    assert not (tmp_path / "child").exists()


def test_a_fork_refusal_lists_only_the_lasts_retention_kept_phase_checkpoints_included(tmp_path):
    _, run = _fit(tmp_path, "src", 5, phase_every=2, keep_phases=1)
    lasts = [(seq, e) for seq, e in read_events(run.run_dir) if e.KIND == "last_committed"]
    result = load_result(run.run_dir)
    kept = [seq for seq, e in lasts if e.manifest not in result.pruned]
    pruned = [seq for seq, e in lasts if e.manifest in result.pruned]
    assert pruned and len(kept) >= 2  # the latest, and a phase checkpoint's (or BEST's)
    net = _wide_net()

    def fork(at):
        child = Trainer(net, torch.optim.Adam(net.parameters(), lr=1e-3), nn.CrossEntropyLoss(), monitor="val_loss",
                        runs_root=tmp_path, run_id="child", progress=False)
        return child.fit(*loaders(), epochs=1, resume_from=tmp_path / "src", resume_mode="weights_only",
                         resume_at=at)

    with pytest.raises(ResumeError, match=re.escape(f"the LASTs at seqs {kept}")):
        fork(pruned[0])
    with pytest.raises(ResumeError, match=re.escape(f"keeps are at {kept} ({len(pruned)} more were pruned")):
        fork(10**9)
    assert not (tmp_path / "child").exists()
