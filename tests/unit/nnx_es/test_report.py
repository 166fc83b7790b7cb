"""Curves and TensorBoard export of long runs: one pass, a batch held at a time, every receipt exported."""

from __future__ import annotations

import math
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from logkit import logs, memory_log

from bench.logbench import long_run_log
from events.schema import HistoryAppended, UpdateCommitted
from nnx_es.report import Envelope, _committed_curves, export_tensorboard, run_curves
from nnx_es.tfevents import ScalarFileWriter, masked_crc32c
from projections import committed, project


@settings(max_examples=300, deadline=None)
@given(logs)
def test_curves_take_exactly_the_committed_receipts_and_history(pairs):
    log = memory_log(pairs)
    taken: list = []
    history = _committed_curves(log, taken.extend)
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


def test_scalar_records_are_what_protobuf_and_tensorboard_write(tmp_path: Path):
    event_pb2 = pytest.importorskip("tensorboard.compat.proto.event_pb2")
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference_crc

    rows = np.random.default_rng(0).integers(0, 256, (20, 33), dtype=np.uint8)
    assert masked_crc32c(rows).tolist() == [reference_crc(r.tobytes()) for r in rows]
    steps = [1, 127, 128, 16_383, 16_384, 2**21 + 5, 3 * 2**28]
    with ScalarFileWriter(tmp_path) as writer:
        writer.add_scalars("update/loss/adam", np.array(steps), np.array([0.5, 1, 2, 3, -4, 5e-3, 6]), wall_time=7.5)
    data = writer.path.read_bytes()
    records = []
    while data:
        n = int.from_bytes(data[:8], "little")
        records.append(data[12 : 12 + n])
        data = data[16 + n :]
    assert event_pb2.Event.FromString(records[0]).file_version == "brain.Event:2"
    for record, step, value in zip(records[1:], steps, [0.5, 1, 2, 3, -4, np.float32(5e-3), 6], strict=True):
        expected = event_pb2.Event(wall_time=7.5, step=step, summary=summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag="update/loss/adam", simple_value=value)]))
        assert record == expected.SerializeToString()


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


def test_export_of_a_long_run_writes_every_receipt_quickly_holding_a_batch(long_run, tmp_path):
    run, _ = long_run
    epochs = len(run_curves(run)[0])
    export_tensorboard(run, tmp_path / "warm")
    t0 = time.perf_counter()
    written = []
    peak = _peak(lambda: written.append(export_tensorboard(run, tmp_path / "tb")))
    elapsed = time.perf_counter() - t0
    assert written == [3 * 250 * epochs + 3 * epochs]  # loss, grad norm, lr per update; loss, val_loss, lr per epoch
    assert peak < 5 * 2**20, peak
    # a SummaryWriter takes tens of µs a scalar (over 10 s here); a column at a time, well under one
    assert elapsed < 5, elapsed
