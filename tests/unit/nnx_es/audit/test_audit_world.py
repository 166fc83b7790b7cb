"""Invariant 11 for an elastic run (nnx_es.audit.world.WorldCheck): a ``world_changed`` says what was and
splits the run's global batch, and the epochs before and after it kept that global batch (whole windows of
the deal in force, no more than the epoch's global batches, ``G`` rows per window, each row once). Fed event
by event, as both audit passes feed it."""

from __future__ import annotations

import numpy as np

from events.schema import (
    Counters,
    EpochSummarized,
    Event,
    LastCommitted,
    RowsRecorded,
    RunResumed,
    RunStarted,
    TrainBegan,
    WorldChanged,
)
from nnx_es.audit.report import Sink
from nnx_es.audit.world import WorldCheck

G, PER_EPOCH = 8, 5  # 44 rows: 5 global batches of 8 an epoch


def check(events: list[Event]) -> list[tuple[int, str]]:
    sink = Sink()
    c = WorldCheck(sink)
    for seq, e in enumerate(events):
        if e.KIND in c.KINDS:
            c.feed(seq, e)
    assert all(v.invariant == 11 for v in sink.violations)
    return [(v.seq, v.message) for v in sink.violations]


def epoch(e: int, accumulation: int, *, windows: int = PER_EPOCH, rows: int | None = None,
          ids: list[int] | None = None) -> list[Event]:
    ids = list(range(G * windows)) if ids is None else ids
    n = len(ids) if rows is None else rows
    columns = {"row_id": np.asarray(ids, dtype="<i8").tobytes()}
    return [EpochSummarized(epoch=e, metrics={}, examples=float(n), microbatches=accumulation * windows,
                            updates=windows),
            RowsRecorded(epoch=e, split="train", rows=n, columns=columns),
            LastCommitted(manifest=f"m{e}", epoch=e, step=PER_EPOCH * (e + 1), counters=Counters(epoch=e + 1))]


def change(old: int, new: int, at: int, **kw) -> WorldChanged:
    fields = dict(old=old, new=new, global_batch=G, epoch=at, rows_per_rank=G // new, microbatch_rows=2,
                  accumulation=G // new // 2, global_batches=PER_EPOCH, streams_kept=min(old, new))
    fields.update(kw)
    return WorldChanged(**fields)


def resumed(e: int, last_seq: int) -> RunResumed:
    return RunResumed(last_seq=last_seq, manifest=f"m{e}", epoch=e, discard_from=0, discard_to=0)


def run(*, shrink: WorldChanged | None = None, grow: WorldChanged | None = None,
        after: list[Event] | None = None) -> list[Event]:
    """2 ranks (2 microbatches of 2 rows a window) for epoch 0; resumed on 1 rank for epoch 1; on 4 for epoch 2."""
    out: list[Event] = [RunStarted(run_id="r", seed=0, world_size=2, accumulation=2), *epoch(0, 2)]
    out += [resumed(0, len(out) - 1), shrink or change(2, 1, 1), TrainBegan(start_epoch=1, epochs=3,
                                                                          train_batches=4 * PER_EPOCH), *epoch(1, 4)]
    out += [resumed(1, len(out) - 1), grow or change(1, 4, 2)]
    return out + (after if after is not None else epoch(2, 1))


def test_a_run_resized_twice_that_kept_its_global_batch_is_clean():
    assert check(run()) == []


def test_a_world_changed_that_misstates_the_checkpoint_or_its_epoch_is_named():
    found = check(run(shrink=change(4, 1, 1)))
    assert len(found) == 1 and "trained on 4 rank(s); the LAST its run_resumed continues was committed on 2" in found[0][1]
    found = check(run(grow=change(1, 4, 3)))
    assert len(found) == 1 and "starts the new deal at epoch 3; the resumed LAST is of epoch 1" in found[0][1]


def test_a_deal_that_does_not_split_the_global_batch_or_changes_it_is_named():
    found = check(run(grow=change(1, 4, 2, rows_per_rank=3)))
    assert any("does not split its global batch of 8 rows" in m for _, m in found), found
    found = check(run(grow=change(1, 4, 2, global_batch=16, rows_per_rank=4, accumulation=2)))
    assert any("changes the run's global batch" in m for _, m in found), found


def test_training_that_left_the_deal_is_named_before_and_after_the_change():
    # after the change: epoch 2 trained 2 microbatches a window on 4 ranks, whose deal is 1
    found = check(run(after=epoch(2, 2)))
    assert [m for _, m in found] == ["epoch 2 trained 10 microbatches in 5 windows; the deal in force is 1 microbatches "
                                     "per window of the global batch"]
    # before the first change (known once it is read): epoch 0 closed 6 windows, one more than its global batches
    events = run()
    events[1:4] = epoch(0, 2, windows=6)
    events[4] = resumed(0, 3)
    found = check(events)
    assert any("epoch 0 closed 6 windows; an epoch holds 5 global batches of 8 rows" in m for _, m in found), found


def test_per_row_records_that_leave_out_or_repeat_rows_are_named():
    found = check(run(after=epoch(2, 1, ids=list(range(39)))))  # a row missing from a window
    assert [m for _, m in found] == ["epoch 2's per-row records hold 39 rows for 5 windows of 8 rows: rows were left "
                                     "out or repeated"]
    found = check(run(after=epoch(2, 1, ids=[0, *range(39)])))  # row 0 twice
    assert [m for _, m in found] == ["epoch 2's per-row records name a row twice (or are out of order)"]


def test_a_run_that_never_changed_world_is_not_held_to_a_global_batch():
    events: list[Event] = [RunStarted(run_id="r", seed=0, world_size=2, accumulation=3), *epoch(0, 2, windows=7)]
    assert check(events) == []
