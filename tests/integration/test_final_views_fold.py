"""The writer's views at finalization come from its recorder's snapshot fold (no second fold of
the log): they must be exactly what a fold of the whole log gives, for a fresh run, a resumed
one (its fold starts from the log's newest snapshot), and with snapshots due mid-run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nnx_es.runtime.finalize as finalize
import nnx_es.runtime.recording as recorder
from events.log import LmdbLog
from nnx_es import Trainer
from nnx_es.audit.snapshots import project_log
from nnx_es.views import expected_views, read_views
from projections.view import project
from tests.trainkit import loaders, small_net


@pytest.fixture
def spy(monkeypatch):
    seen: list[tuple[bool, object]] = []
    original = finalize.Finalization._write_views

    def write_views(self):  # noqa: ANN001, ANN202
        rec = self.state.recorder
        original(self)
        seen.append((rec._snapshots is False, self.projection[0]))

    monkeypatch.setattr(finalize.Finalization, "_write_views", write_views)
    return seen


@pytest.mark.parametrize("every", [1 << 16, 7])
def test_views_from_the_recorders_fold_equal_a_fold_of_the_whole_log(tmp_path, spy, monkeypatch, every):
    monkeypatch.setattr(recorder, "SNAPSHOT_EVERY", every)
    train, val = loaders()
    for epochs in (2, 4):  # a fresh run, then its resume (the fold starts at the log's newest snapshot)
        net = small_net()
        t = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), runs_root=tmp_path,
                    run_id="r", progress=False)
        t.fit(train, val, epochs=epochs, resume="auto")
        reused, p = spy[-1]
        assert reused  # the recorder's fold was used, not a second fold
        with LmdbLog(tmp_path / "r" / "events.lmdb", readonly=True) as log:
            whole = project(log.read(0, log.next_seq))
            assert p == whole == project_log(log).projections
        assert read_views(tmp_path / "r") == expected_views(whole)
