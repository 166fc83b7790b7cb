"""Curves and TensorBoard export of long runs: one pass, a batch held at a time, every receipt exported."""

from __future__ import annotations

import math
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from logkit import logs, memory_log

from bench.logbench import long_run_log
from events.schema import HistoryAppended, UpdateCommitted
from nnx_es.plotting import Envelope, committed_curves, export_tensorboard, run_curves
from projections import committed, project


@settings(max_examples=300, deadline=None)
@given(logs)
def test_curves_take_exactly_the_committed_receipts_and_history(pairs):
    log = memory_log(pairs)
    taken: list = []
    history = committed_curves(log, taken.extend)
    view = [e for _, e in committed(log.read())]  # legacy receipts read back upcast
    assert [(r.step, r.loss, r.optimizer, r.grad_norm, r.lrs) for r in taken] == [
        (e.step, e.loss, e.optimizer, e.grad_norm, e.lrs) for e in view if type(e) is UpdateCommitted
    ]
    assert history == project(pairs).history.records == tuple(e.record for e in view if type(e) is HistoryAppended)


def test_envelope_is_exact_while_every_step_has_its_bucket():
    env = Envelope(buckets=8)
    env.add(np.array([1, 2, 3]), np.array([0.5, 0.25, math.nan]))
    env.add(np.array([5]), np.array([2.0]))
    xs, ys = env.line()
    assert env.steps_per_bucket == 1
    assert xs.tolist() == [1, 2, 3, 5] and ys[[0, 1, 3]].tolist() == [0.5, 0.25, 2.0] and math.isnan(ys[2])


def test_envelope_keeps_each_buckets_least_and_greatest_as_buckets_merge():
    env = Envelope(buckets=4)
    steps = np.arange(1, 41)
    values = np.sin(steps.astype(float))
    for part in np.array_split(np.arange(40), 7):  # batches that straddle buckets
        env.add(steps[part], values[part])
    assert env.steps_per_bucket == 16  # step 40 >> 4 == 2 < 4 buckets
    xs, ys = env.line()
    for b in range(3):
        inside = (steps >> 4) == b
        assert ys[2 * b] == values[inside].min() and ys[2 * b + 1] == values[inside].max()
        assert xs[2 * b] == xs[2 * b + 1] == steps[inside].mean()
    assert env.count.sum() == 40


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> tuple[Path, int]:
    run = tmp_path_factory.mktemp("runs") / "long"
    return run, long_run_log(run / "events.lmdb", 150_000, batches=250)


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_curves_of_a_long_run_hold_a_batch_not_every_update(long_run):
    run, _ = long_run
    run_curves(run)  # imports and first-call allocations out of the measure
    curves = []
    peak = _peak(lambda: curves.append(run_curves(run)))
    (history, envelope), = curves
    assert len(history) > 250 and envelope.count.sum() == len(history) * 250
    # 70,000 receipts as Python objects take well over 15 MB; the plot keeps 4,096 buckets
    assert peak < 5 * 2**20, peak


@pytest.fixture(scope="module")
def medium_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "medium"
    long_run_log(run / "events.lmdb", 12_000, batches=250)
    return run


def test_export_writes_every_receipt_holding_a_batch(medium_run, tmp_path):
    run = medium_run
    history = run_curves(run)[0]
    epochs = len(history)
    export_tensorboard(run, tmp_path / "warm")  # imports and first-call allocations out of the measure
    written = []
    peak = _peak(lambda: written.append(export_tensorboard(run, tmp_path / "tb")))
    assert written == [3 * 250 * epochs + 3 * epochs]  # loss, grad norm, lr per update; loss, val_loss, lr per epoch
    # the receipts as Python objects would take several MB; the export holds a batch of them
    assert peak < 3 * 2**20, peak
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    losses = acc.Scalars("update/loss/adam")
    assert len(losses) == 250 * epochs and [e.step for e in losses] == sorted(e.step for e in losses)
    assert [e.value for e in acc.Scalars("epoch/loss")] == pytest.approx([r.train["loss"] for r in history])
