"""The per-update curves of ``nnx-es serve`` (:mod:`nnx_es.web.curves`), against the committed view of the log
(:func:`projections.committed`): once read, each bucket of ``steps_per_bucket`` steps is drawn as exactly the
least and the greatest value of the committed updates it holds, at the mean of their steps; a resume's
discarded updates and the uncommitted tail are never drawn; before the log is read, every value drawn is a
committed update's and the newest part is read first; each request reads a bounded number of events; over
HTTP the page's answers end complete, equal to one read of the whole log."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from events.log import LmdbLog
from events.schema import (
    Counters,
    EpochBegan,
    LastCommitted,
    MicrobatchDone,
    RunFinalized,
    RunResumed,
    RunStarted,
    TrainBegan,
    UpdateCommitted,
)
from nnx_es.web.curves import UpdateCurves, coarse_to_fine
from projections import committed

STEPS = 40  # updates an epoch; two optimizers, "a" and "b", commit each


def _receipts(step: int, epoch: int, shift: float) -> list[UpdateCommitted]:
    """Both optimizers' receipts of ``step`` (losses moved by ``shift``): a NaN loss at step 17, no gradient
    norm every 5th step of "a", no learning rate for "b" at even steps."""
    loss = math.nan if step == 17 else 2.0 / math.sqrt(step) + 0.3 * math.sin(step / 3.0) + shift
    a = UpdateCommitted(step=step, epoch=epoch, microbatches=1, local_examples=8.0, global_examples=8.0, loss=loss,
                        grad_norm=None if step % 5 == 0 else 10.0 + math.cos(step), lrs=[0.1 / (1 + step // 50)],
                        optimizer="a")
    b = UpdateCommitted(step=step, epoch=epoch, microbatches=1, local_examples=8.0, global_examples=8.0,
                        loss=loss * 0.5 + (step % 7), lrs=[] if step % 2 == 0 else [0.01], optimizer="b")
    return [a, b]


def write_curves_log(path: Path) -> None:
    """A log with every case the committed view decides: inline LASTs; a deferred LAST (written after the next
    epoch's first updates: those stay pending until the next LAST); an epoch that crashed and a resume that
    discards it (the same steps then committed again with other values); an uncommitted tail at the end."""
    m = "0" * 64
    events: list[Any] = [RunStarted(run_id="curves", seed=0, optimizers=["a", "b"]),
                         TrainBegan(start_epoch=0, epochs=6),
                         LastCommitted(manifest=m, epoch=-1, step=0, counters=Counters())]

    def epoch(e: int, first_step: int, shift: float = 0.0, deferred_after: int | None = None) -> None:
        events.append(EpochBegan(epoch=e))
        for i, step in enumerate(range(first_step, first_step + STEPS)):
            events.append(MicrobatchDone(epoch=e, batch=i, rows=8, examples=8.0, loss=1.0))
            events.extend(_receipts(step, e, shift))
            if deferred_after is not None and i == 3:  # the previous epoch's LAST, deferred: covers up to there
                events.append(LastCommitted(manifest=m, epoch=e - 1, step=first_step - 1, counters=Counters(),
                                            covers=deferred_after))

    epoch(0, 1)
    events.append(LastCommitted(manifest=m, epoch=0, step=STEPS, counters=Counters()))
    epoch(1, STEPS + 1)
    end_of_1 = len(events) - 1
    epoch(2, 2 * STEPS + 1, deferred_after=end_of_1)  # epoch 1 committed by a LAST inside epoch 2
    events.append(LastCommitted(manifest=m, epoch=2, step=3 * STEPS, counters=Counters()))
    crashed = len(events)
    epoch(3, 3 * STEPS + 1, shift=100.0)  # crashed: discarded by the resume below (values far off)
    events.append(RunResumed(last_seq=crashed - 1, manifest=m, epoch=2, discard_from=crashed, discard_to=len(events)))
    epoch(3, 3 * STEPS + 1)
    events.append(LastCommitted(manifest=m, epoch=3, step=4 * STEPS, counters=Counters()))
    epoch(4, 4 * STEPS + 1)
    events.append(LastCommitted(manifest=m, epoch=4, step=5 * STEPS, counters=Counters()))
    epoch(5, 5 * STEPS + 1, shift=100.0)  # the uncommitted tail
    with LmdbLog(path) as log:
        for event in events:
            log.append(event)
        log.flush(sync=True)


@pytest.fixture(scope="module")
def log_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("curves") / "run" / "events.lmdb"
    write_curves_log(path)
    return path


def _committed_points(path: Path) -> dict[str, list[tuple[int, int, float]]]:
    """Per series, ``(seq, step, value)`` of each committed update, from :func:`projections.committed`."""
    with LmdbLog(path, readonly=True) as log:
        pairs = list(committed(log.read()))
    out: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for seq, e in pairs:
        if e.KIND != "update_committed":
            continue
        out[f"loss/{e.optimizer}"].append((seq, e.step, e.loss))
        out[f"lr/{e.optimizer}"].append((seq, e.step, e.lrs[0] if e.lrs else math.nan))
        if e.grad_norm is not None:
            out[f"grad_norm/{e.optimizer}"].append((seq, e.step, e.grad_norm))
    return out


def _per_bucket(points: list[tuple[int, int, float]], buckets: int) -> tuple[int, list[float], list[float | None]]:
    """The envelope the module docstring promises: ``steps_per_bucket`` (the least power of two that fits the
    greatest step in ``buckets``), then per bucket, in order, its mean step with its least value and, when the
    bucket holds more than one update and they differ, its greatest (NaN left out; None for no value)."""
    w = 1
    while max(s for _, s, _ in points) // w >= buckets:
        w *= 2
    groups: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for _, step, value in points:
        groups[step // w].append((step, value))
    xs: list[float] = []
    ys: list[float | None] = []
    for b in sorted(groups):
        steps = [s for s, _ in groups[b]]
        values = [v for _, v in groups[b] if not math.isnan(v)]
        x = sum(steps) / len(steps)
        lo, hi = (min(values), max(values)) if values else (None, None)
        xs.append(x)
        ys.append(lo)
        if len(steps) > 1 and (lo != hi or lo is None):
            xs.append(x)
            ys.append(hi)
    return w, xs, ys


def test_coarse_to_fine_reads_the_newest_part_first_then_the_first_then_halves():
    assert coarse_to_fine(8) == [7, 0, 4, 2, 6, 1, 3, 5]
    assert coarse_to_fine(5) == [4, 0, 2, 1, 3]
    assert coarse_to_fine(1) == [0] and coarse_to_fine(0) == []
    assert sorted(coarse_to_fine(153)) == list(range(153))


@pytest.mark.parametrize(("part", "budget", "buckets"), [(1 << 16, 1 << 17, 2048), (64, 64, 8), (37, 5, 16),
                                                        (3, 1000, 4)])
def test_each_bucket_is_the_least_and_greatest_committed_value_once_read(log_path, part, budget, buckets):
    truth = _committed_points(log_path)
    assert set(truth) == {"loss/a", "loss/b", "lr/a", "lr/b", "grad_norm/a"}
    committed_values = {name: {(s, v) for _, s, v in pts} for name, pts in truth.items()}
    curves = UpdateCurves(buckets=buckets, part=part)
    docs = []
    with LmdbLog(log_path, readonly=True) as log:
        total = log.next_seq
        while not (docs and docs[-1]["complete"]):
            curves.read(log, budget)
            docs.append(curves.doc())
            assert len(docs) <= total + 1  # every read reads something
    first = docs[0]
    if budget >= part:  # the newest part is read first (its committed updates: up to the last LAST)
        assert first["read"][-1][1] == total
    for doc, later in zip(docs, docs[1:]):
        assert doc["parts_read"] <= later["parts_read"] and not doc["complete"]
        for name, s in doc["series"].items():
            assert s["updates"] <= later["series"][name]["updates"]
    for doc in docs:  # before the log is read, every value drawn is a committed update's, in its bucket
        for name, s in doc["series"].items():
            w = s["steps_per_bucket"]
            for x, y in zip(s["x"], s["y"]):
                if y is not None:
                    assert any(step // w == int(x) // w and value == y for step, value in committed_values[name])
    final = docs[-1]
    assert final["parts"] == final["parts_read"] == -(-total // part) and final["read"] == [[0, total]]
    for name, points in truth.items():
        w, xs, ys = _per_bucket(points, buckets)
        assert final["series"][name] == {"x": xs, "y": ys, "updates": len(points), "steps_per_bucket": w}, name
    assert final["steps_per_bucket"] == max(s["steps_per_bucket"] for s in final["series"].values())


def test_discarded_and_uncommitted_updates_are_never_drawn(log_path):
    curves = UpdateCurves(buckets=4096, part=50)  # one step a bucket: the exact values
    with LmdbLog(log_path, readonly=True) as log:
        while not curves.doc()["complete"] or not curves.total:
            curves.read(log, 40)
    loss = curves.doc()["series"]["loss/a"]
    assert max(v for v in loss["y"] if v is not None) < 50  # the crashed epoch and the tail carry +100
    assert loss["x"] == [float(s) for s in range(1, 5 * STEPS + 1)]  # steps 1..200: the tail's 201.. are not in


def test_a_growing_log_is_read_on_from_where_it_stopped(tmp_path, log_path):
    """A reader beside a live writer: the curves read while the log grows end equal to one read of the whole."""
    with LmdbLog(log_path, readonly=True) as log:
        events = [e for _, e in log.read()]
    path = tmp_path / "live" / "events.lmdb"
    curves = UpdateCurves(buckets=16, part=32)
    with LmdbLog(path) as writer:
        for i, event in enumerate(events):
            writer.append(event)
            if i % 97 == 0 or i == len(events) - 1:
                writer.flush()
                with LmdbLog(path, readonly=True) as log:
                    curves.read(log, 1000)
        writer.append(RunFinalized(status="completed", epochs=5, steps=5 * STEPS, wall_time_s=1.0))
        writer.flush(sync=True)
    with LmdbLog(path, readonly=True) as log:
        curves.read(log, 1000)
        whole = UpdateCurves(buckets=16, part=32)
        whole.read(log, 10**6)
    assert curves.doc() == whole.doc() and whole.doc()["complete"]
