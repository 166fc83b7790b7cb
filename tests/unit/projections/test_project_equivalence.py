"""The fast paths equal the reference definitions: chunked LMDB reads and the projection fold."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from events.log import LmdbLog, _LogBase
from events.schema import (
    BestCommitted, Counters, EpochBegan, EpochSummarized, HistoryAppended, HistoryRecord, LastCommitted,
    MicrobatchDone, RunFailed, RunFinalized, RunResumed, RunStarted, SchedulerDecl, SchedulerStepped,
    StopRequested, UpdateCommitted,
)
from projections.view import Projections, committed, fold, project

_M = "a" * 64


def _event(kind: int, i: int):
    return [
        lambda: MicrobatchDone(epoch=i % 3, batch=i, rows=4, examples=4.0, loss=0.5),
        lambda: UpdateCommitted(step=i // 2 + 1, epoch=i % 3, microbatches=1, local_examples=4.0,
                                global_examples=4.0, loss=0.5, lrs=[0.1], optimizer="adam" if i % 2 else "sgd",
                                data_parallel_size=1 + i % 2),
        lambda: EpochBegan(epoch=i % 5),
        lambda: EpochSummarized(epoch=i % 5, metrics={"loss": 1.0}, examples=4.0, microbatches=2, updates=1),
        lambda: SchedulerStepped(name="s", clock="epoch", epoch=i % 5, step=i, steps=i, lrs=[0.1]),
        lambda: HistoryAppended(record=HistoryRecord(epoch=i, train={"loss": 1.0}, val={})),
        lambda: LastCommitted(manifest=_M, epoch=i % 5, step=i, counters=Counters(), covers=-1 if i % 3 else i - 2),
        lambda: BestCommitted(manifest=_M, epoch=i % 5, monitor="val_loss", value=0.1),
        lambda: RunResumed(last_seq=0, manifest=_M, epoch=0, discard_from=0, discard_to=0),
        lambda: RunStarted(run_id="r", seed=0, schedulers=[SchedulerDecl(name="s", clock="epoch", cls="X", optimizer="o")]),
        lambda: StopRequested(epoch=0, step=0, reason="requested"),
        lambda: RunFailed(error_type="E", message="m", epoch=0, step=0),
        lambda: RunFinalized(status="failed", epochs=1, steps=1),
    ][kind]()


logs = st.lists(st.integers(min_value=0, max_value=12), max_size=80).map(
    lambda kinds: [(i, _event(k, i)) for i, k in enumerate(kinds)]
)


@settings(max_examples=300, deadline=None)
@given(logs)
def test_project_equals_folding_the_committed_view_event_by_event(pairs):
    reference = functools.reduce(lambda s, p: fold(s, p[0], p[1]), committed(pairs), Projections())
    assert project(pairs) == reference


@settings(max_examples=40, deadline=None)
@given(logs, st.integers(min_value=1, max_value=100), st.sets(st.integers(min_value=0, max_value=79), max_size=3))
def test_chunked_lmdb_reads_equal_event_by_event_reads_gaps_included(tmp_path_factory, pairs, chunk, holes):
    path = tmp_path_factory.mktemp("log") / "events.lmdb"
    with LmdbLog(path) as log:
        for _, e in pairs:
            log.append(e)
        log.flush()
        for h in holes:
            if h < len(pairs):
                log.delete_raw(h)
        log.read_chunk = chunk
        fast = list(log.read())
        slow = list(_LogBase.read(log))
        assert fast == slow
        assert list(log.read(2, 9)) == [p for p in slow if 2 <= p[0] < 9]
        assert list(log.read(kinds=["microbatch_done"])) == [p for p in slow if p[1].KIND == "microbatch_done"]
