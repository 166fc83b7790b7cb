"""Invariant 11 for an elastic run: a change of world size kept the global batch.

An elastic run (``nnx_es.distributed.elastic_loader``) commits every update on ``G`` rows, cut
from each epoch's permutation into ``global_batches`` = rows // G per epoch on any world size; a
resume on another world size records ``world_changed`` (:mod:`nnx_es.distributed.resize`). For a
run that records one, this check (fed the whole sequence in log order, tails included) demands:

* each ``world_changed`` says what was: ``old`` is the world size of the checkpoint its
  ``run_resumed`` continues (the size the LAST it names was committed at), and its ``epoch`` is
  the one after that LAST's; its deal splits the same ``G`` (``new * rows_per_rank == G``,
  ``microbatch_rows * accumulation == rows_per_rank``), with the ``G`` and ``global_batches`` of
  every other ``world_changed`` of the run;
* the training that follows (and, once ``G`` is known, the training before) kept it: every epoch's
  ``epoch_summarized`` counts whole windows of the deal in force (``microbatches == accumulation *
  (updates + skipped)``) and no more windows than ``global_batches``; a ``train_began`` counts
  ``global_batches * accumulation`` microbatches per epoch;
* with per-row records in the log (``rows_recorded``, split ``train``), each epoch's rows continue
  without a gap or a repeat: ``G`` rows per window of the epoch, each row id once.

It reads no hot kind (``microbatch_done``, ``update_committed``): windows are counted from each
epoch's summary. Memory: one small record per epoch of the run seen before its first
``world_changed``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from events.schema import (
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

__all__ = ["WorldCheck"]


class WorldCheck:
    """Invariant 11, an elastic run's world changes (module docstring)."""

    KINDS = frozenset({RunStarted.KIND, RunResumed.KIND, WorldChanged.KIND, LastCommitted.KIND, TrainBegan.KIND,
                       EpochSummarized.KIND, RowsRecorded.KIND})

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.size = 1  # world size of the segment being read
        self.accumulation = 1  # its microbatches per window
        self.committed: tuple[int, int, int, int] | None = None  # the latest LAST's (seq, epoch, size, accumulation)
        self.resumed: tuple[int, int, int | None] | None = None  # (seq, LAST epoch, its size) of the opening resume
        self.deal: WorldChanged | None = None  # the run's first world_changed: G and global_batches
        self.windows: dict[int, tuple[int, int, int, int]] = {}  # epoch -> (seq, windows, microbatches, accum)
        self.rows: dict[int, tuple[int, int, bool]] = {}  # epoch -> (seq, rows, each row id once) before the deal

    def feed(self, seq: int, event: Event) -> None:
        match event:
            case RunStarted(world_size=size, accumulation=accumulation):
                self.size, self.accumulation = size, accumulation
                self.committed = self.resumed = None
            case LastCommitted(epoch=epoch):
                self.committed = (seq, epoch, self.size, self.accumulation)
            case RunResumed(last_seq=last_seq, epoch=epoch):
                known = self.committed is not None and self.committed[0] == last_seq
                if known:
                    assert self.committed is not None
                    self.size, self.accumulation = self.committed[2], self.committed[3]
                self.resumed = (seq, epoch, self.size if known else None)
            case WorldChanged():
                self._changed(seq, event)
            case TrainBegan(train_batches=batches) if self.deal is not None and batches is not None:
                want = self.deal.global_batches * self.accumulation
                if batches != want:
                    self._add(seq, f"train_began counts {batches} microbatches per epoch; the deal in force is "
                              f"{self.deal.global_batches} global batches x {self.accumulation} microbatches",
                              want, batches)
            case EpochSummarized(epoch=epoch, microbatches=microbatches, updates=updates, skipped=skipped):
                if self.deal is not None:  # after the first world change, checked now: only this epoch is kept
                    self.windows.clear()
                self.windows[epoch] = (seq, updates + skipped, microbatches, self.accumulation)
                if self.deal is not None:
                    self._check_epoch(epoch)
            case RowsRecorded(epoch=epoch, split="train", rows=n, columns=columns):
                ids = np.frombuffer(columns.get("row_id", b""), dtype="<i8")
                once = len(ids) == n and bool(np.all(ids[1:] > ids[:-1]))  # sorted by id: each id once
                if self.deal is not None:
                    self._check_rows(seq, epoch, n, once)
                else:
                    self.rows[epoch] = (seq, n, once)
            case _:
                pass

    def _add(self, seq: int, message: str, expected: Any, found: Any) -> None:
        self.sink.add(seq, 11, message, expected=expected, found=found)

    def _changed(self, seq: int, event: WorldChanged) -> None:
        g = event.global_batch
        if self.resumed is not None:
            _, epoch, size = self.resumed
            if size is not None and event.old != size:
                self._add(seq, f"world_changed says the checkpoint was trained on {event.old} rank(s); the LAST its "
                          f"run_resumed continues was committed on {size}", size, event.old)
            if event.epoch != epoch + 1:
                self._add(seq, f"world_changed starts the new deal at epoch {event.epoch}; the resumed LAST is of "
                          f"epoch {epoch}", epoch + 1, event.epoch)
        if event.new < 1 or event.new * event.rows_per_rank != g or \
                event.microbatch_rows * event.accumulation != event.rows_per_rank:
            self._add(seq, f"world_changed's deal does not split its global batch of {g} rows: {event.new} rank(s) x "
                      f"{event.accumulation} microbatch(es) x {event.microbatch_rows} rows",
                      f"{g} rows", f"{event.new * event.accumulation * event.microbatch_rows} rows")
        first = self.deal
        if first is not None and (first.global_batch, first.global_batches) != (g, event.global_batches):
            self._add(seq, "world_changed changes the run's global batch (an elastic run keeps it on any world size)",
                      f"global_batch={first.global_batch}, global_batches={first.global_batches}",
                      f"global_batch={g}, global_batches={event.global_batches}")
        self.size, self.accumulation = event.new, event.accumulation
        if first is None:
            self.deal = event
            for epoch in sorted(self.windows):  # the training before the first world change kept it too
                self._check_epoch(epoch)
            for epoch, (at, n, once) in sorted(self.rows.items()):
                self._check_rows(at, epoch, n, once)
            self.rows.clear()

    def _check_epoch(self, epoch: int) -> None:
        assert self.deal is not None
        seq, windows, microbatches, accumulation = self.windows[epoch]
        if microbatches != accumulation * windows:
            self._add(seq, f"epoch {epoch} trained {microbatches} microbatches in {windows} windows; the deal in force "
                      f"is {accumulation} microbatches per window of the global batch", accumulation * windows,
                      microbatches)
        if windows > self.deal.global_batches:
            self._add(seq, f"epoch {epoch} closed {windows} windows; an epoch holds {self.deal.global_batches} global "
                      f"batches of {self.deal.global_batch} rows", f"<= {self.deal.global_batches}", windows)

    def _check_rows(self, seq: int, epoch: int, n: int, once: bool) -> None:
        assert self.deal is not None
        g = self.deal.global_batch
        windows = self.windows.get(epoch)
        if windows is not None and n != g * windows[1]:
            self._add(seq, f"epoch {epoch}'s per-row records hold {n} rows for {windows[1]} windows of {g} rows: rows "
                      "were left out or repeated", g * windows[1], n)
        if not once:
            self._add(seq, f"epoch {epoch}'s per-row records name a row twice (or are out of order)",
                      "each row id once, ascending", "a repeated id")
