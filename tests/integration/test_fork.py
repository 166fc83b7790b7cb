"""A fork: a new run from another run's committed LAST, with its whole state -- a branch of history."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnx_es import Scheduler, Trainer
from nnx_es.audit import audit_run
from nnx_es.errors import ConfigError, ResumeError
from trainkit import loaders, params_of, read_events, small_net


def _trainer(tmp_path, run_id, *, step_size=2, lr=0.1):
    net = small_net(5)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    decay = Scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=0.5), name="decay")
    return Trainer(net, opt, nn.CrossEntropyLoss(), monitor="val_loss", schedulers=[decay], runs_root=tmp_path,
                   run_id=run_id, progress=False, keep_last=None)


def test_a_fork_from_an_older_last_continues_its_whole_state_and_never_writes_the_source(tmp_path):
    source = _trainer(tmp_path, "src")
    run = source.fit(*loaders(), epochs=4)
    lasts = [(seq, e) for seq, e in read_events(run.run_dir) if e.KIND == "last_committed"]
    at_seq = lasts[2][0]  # the LAST of epoch 1 (after the opening LAST and epoch 0's)
    assert lasts[2][1].epoch == 1
    before = (tmp_path / "src" / "events.lmdb" / "data.mdb").read_bytes()

    fork = _trainer(tmp_path, "fork")
    forked = fork.fit(*loaders(), epochs=2, resume_from=tmp_path / "src", resume_mode="fork", resume_at=at_seq)
    # its epochs 0 and 1 are the source's epochs 2 and 3: the same data order, optimizer and schedule
    for k, v in params_of(source.net).items():
        assert torch.equal(params_of(fork.net)[k], v), k
    assert [r.train for r in forked.history] == [r.train for r in run.history[2:]]
    assert [r.lrs for r in forked.history] == [r.lrs for r in run.history[2:]]
    started = next(e for _, e in read_events(forked.run_dir) if e.KIND == "run_started")
    assert (started.source.run_id, started.source.last_seq, started.source.state) == ("src", at_seq, "full")
    assert started.source.manifest == lasts[2][1].manifest
    assert forked.best is not None and forked.best.epoch in (0, 1)  # its own BEST, of its own epochs
    assert (tmp_path / "src" / "events.lmdb" / "data.mdb").read_bytes() == before
    assert audit_run(tmp_path / "fork").ok and audit_run(tmp_path / "src").ok


def test_a_fork_needs_the_sources_recipe_and_its_own_run(tmp_path):
    _trainer(tmp_path, "src").fit(*loaders(), epochs=1)
    with pytest.raises(ResumeError, match="different schedulers"):
        net = small_net(5)
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(),
                monitor="val_loss", runs_root=tmp_path, run_id="other", progress=False).fit(
            *loaders(), epochs=1, resume_from=tmp_path / "src", resume_mode="fork")
    assert not (tmp_path / "other").exists()
    with pytest.raises(ConfigError, match="a fork or a weights_only continuation writes its own run"):
        _trainer(tmp_path, "src").fit(*loaders(), epochs=2, resume_from=tmp_path / "src", resume_mode="fork",
                                      resume_at="best")
