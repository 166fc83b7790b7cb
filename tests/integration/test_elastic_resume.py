"""Elastic mode in one process (the torchrun cases are tests/distributed/test_resize.py): a run whose
train loader declares its global batch takes its window from it, may go on with another microbatch
split -- the same global batches, the parameters up to float summation order, a ``world_changed``
recorded and audited -- and every resume that cannot keep its global batch is refused before anything
is restored or written."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from nnx_es import Callback, Trainer
from nnx_es.audit import audit_run
from nnx_es.distributed import elastic_loader, train_loader
from nnx_es.distributed.global_batch import global_batches
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.rows import with_row_ids
from trainkit import of_kind

ROWS, G, SEED = 44, 8, 5  # 5 global batches of 8 rows an epoch


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(ROWS, 6, generator=g), torch.randint(0, 3, (ROWS,), generator=g))


class Rows(Callback):
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def on_batch_end(self, ctx) -> None:
        if isinstance(ctx.batch, dict):  # batches with row ids
            self.batches.append([int(i) for i in ctx.batch["idx"]])


def _fit(tmp_path, run_id: str, loader, epochs: int, **kw):
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    rows = Rows()
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.9), nn.CrossEntropyLoss(),
                      runs_root=tmp_path, run_id=run_id, progress=False, callbacks=[rows], **kw)
    trainer.fit(loader, epochs=epochs, resume="auto")
    return net, rows.batches


def _updates(batches: list[list[int]], k: int) -> list[list[int]]:
    return [[i for mb in batches[u * k:(u + 1) * k] for i in mb] for u in range(len(batches) // k)]


def _events(run) -> int:
    from nnx_es.result import load_result

    return load_result(run).events


def test_an_elastic_run_goes_on_with_another_microbatch_split_on_the_same_global_batches(tmp_path):
    data = with_row_ids(_data())
    _, first = _fit(tmp_path, "split", elastic_loader(data, G, microbatch=2, seed=SEED), 1)  # 4 x 2 rows
    net, second = _fit(tmp_path, "split", elastic_loader(data, G, microbatch=4, seed=SEED), 2)  # 2 x 4 rows
    ref, whole = _fit(tmp_path, "whole", elastic_loader(data, G, seed=SEED), 2)  # 1 x 8 rows, uninterrupted
    want = [b for e in range(2) for b in global_batches(ROWS, global_batch=G, epoch=e, seed=SEED)]
    assert _updates(first, 4) + _updates(second, 2) == _updates(whole, 1) == want
    # the same updates up to float32 summation order (measured 6e-8; see test_resize.TOLERANCE's reasoning)
    diff = max((a - b).abs().max().item() for a, b in zip(net.parameters(), ref.parameters()))
    assert diff <= 2e-6, diff
    run = tmp_path / "split"
    assert of_kind(run, "run_started")[0].accumulation == 4
    (changed,) = of_kind(run, "world_changed")
    assert (changed.old, changed.new, changed.global_batch, changed.epoch, changed.microbatch_rows,
            changed.accumulation, changed.global_batches) == (1, 1, G, 1, 4, 2, ROWS // G)
    assert [r.accumulation_steps for r in of_kind(run, "update_committed")] == [4] * 5 + [2] * 5
    assert not of_kind(tmp_path / "whole", "world_changed")
    for name in ("split", "whole"):
        report = audit_run(tmp_path / name)
        assert report.ok, [str(v) for v in report.violations]


def test_a_resume_that_cannot_keep_the_global_batch_is_refused_before_anything_is_restored(tmp_path):
    data = _data()
    _fit(tmp_path, "el", elastic_loader(data, G, seed=SEED), 1)
    _fit(tmp_path, "plain", train_loader(data, G, seed=SEED, policy="drop"), 1)
    kept = {name: _events(tmp_path / name) for name in ("el", "plain")}
    with pytest.raises(ResumeError, match=r"global_batch 8 -> 4"):  # another global batch
        _fit(tmp_path, "el", elastic_loader(data, 4, seed=SEED), 2)
    with pytest.raises(ResumeError, match=r"seed 5 -> 6"):  # another order of the rows
        _fit(tmp_path, "el", elastic_loader(data, G, seed=SEED + 1), 2)
    # a loader of the same geometry that is not an elastic_loader would deal other batches
    own = DataLoader(data, batch_size=G, sampler=SubsetRandomSampler(range(40)))
    with pytest.raises(ResumeError, match=r"is an elastic run's .*not an elastic_loader"):
        _fit(tmp_path, "el", own, 2)
    with pytest.raises(ResumeError, match=r"without elastic mode"):  # a run that declared no global batch
        _fit(tmp_path, "plain", elastic_loader(data, G, seed=SEED), 2)
    assert {name: _events(tmp_path / name) for name in ("el", "plain")} == kept  # nothing written


def test_an_elastic_loader_sets_the_window_and_refuses_one_of_the_trainers_own(tmp_path):
    with pytest.raises(ConfigError, match=r"accumulates 2 microbatches .* drop accumulation="):
        _fit(tmp_path, "acc", elastic_loader(_data(), G, seed=SEED), 1, accumulation=2)
    assert not (tmp_path / "acc" / "events.lmdb").exists()  # refused before the run began
