"""The fast paths equal the reference definitions: chunked LMDB reads and the projection fold.

``project`` folds the committed view a segment at a time, and over a log's stored chunks
it decodes the frequent kinds only as far as the folds read them. Each route must equal
folding :func:`fold` over :func:`committed` event by event, on logs mixing every kind:
deferred LASTs (``covers``) with checkpoints pending behind them, resumes, closing kinds
after a tail, several optimizers' receipts of one step, legacy receipts, sequence gaps.
"""

from __future__ import annotations

import functools
import itertools
import tracemalloc

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.chunks import StoredPairs
from events.codec import decode, encode
from events.errors import CorruptEventError
from events.log import LmdbLog, LogBase
from events.schema import (
    BestCommitted, CallbackBegan, CallbackCheckpointed, CallbackFinalized, CheckpointStored, Counters, EpochBegan,
    EpochSummarized, Event, HistoryAppended, HistoryRecord, LastCommitted, MicrobatchDone, MonitorDecided,
    PhaseCommitted, PlateauState, RunFailed, RunFinalized, RunResumed, RunStarted, SchedulerDecl, SchedulerStepped,
    StopRequested, TrainBegan, UpdateCommitted, UpdateCommittedV1, UpdateSkipped, ValidationDone,
)
from projections import counters as counters_mod
from projections.view import Projections, committed, fold, project

_M = "a" * 64


def _event(kind: int, i: int, x: int) -> Event:
    """Event number ``i`` of a log, of kind ``kind``; ``x`` varies its fields (steps, covers, names)."""
    return [
        lambda: MicrobatchDone(epoch=x % 3, batch=i, rows=4, examples=4.0, loss=0.5),
        lambda: MicrobatchDone(epoch=x % 3, batch=i, rows=4, examples=4.0, loss=0.5, terms={"a": 1.0}),
        # several receipts of one step (one per optimizer) share it: steps repeat
        lambda: UpdateCommitted(step=i // 3 + 1, epoch=x % 3, microbatches=1, local_examples=4.0,
                                global_examples=4.0, loss=0.5, lrs=[0.1], optimizer="adam" if x % 2 else "sgd",
                                data_parallel_size=1 + x % 3),
        lambda: UpdateCommittedV1(step=i // 3 + 1, epoch=0, microbatches=1, examples=4.0, loss=0.5, lr=0.1),
        lambda: EpochBegan(epoch=x % 5),
        lambda: EpochSummarized(epoch=x % 5, metrics={"loss": 1.0}, examples=4.0, microbatches=2, updates=1),
        lambda: SchedulerStepped(name="s" if x % 2 else "t", clock="epoch", epoch=x % 5, step=i, steps=i,
                                 lrs=[0.1], plateau=PlateauState(best=1.0, num_bad_epochs=x, cooldown_counter=0)),
        lambda: HistoryAppended(record=HistoryRecord(epoch=i, train={"loss": 1.0}, val={})),
        # covers: -1 (everything before it) or a seq before it, often with later events pending
        lambda: LastCommitted(manifest=_M, epoch=x % 5, step=i, counters=Counters(), covers=-1 if x % 2 else i - x),
        lambda: BestCommitted(manifest=_M, epoch=x % 5, monitor="val_loss", value=0.1),
        lambda: PhaseCommitted(name=f"p{x % 2}", manifest=_M, epoch=x % 5, removed=["p1"] if x % 3 == 0 else []),
        lambda: CallbackCheckpointed(name=f"cb{x % 2}", epoch=x % 5, blob=_M),
        lambda: CheckpointStored(manifest=_M, epoch=x % 5, step=i, components={"model": _M}),
        lambda: RunResumed(last_seq=0, manifest=_M, epoch=0, discard_from=0, discard_to=0),
        lambda: RunStarted(run_id=f"r{x}", seed=x, schedulers=[
            SchedulerDecl(name="s", clock="epoch", cls="X", optimizer="o")]),
        lambda: StopRequested(epoch=0, step=0, reason="requested"),
        lambda: RunFailed(error_type="E", message="m", epoch=0, step=0),
        lambda: CallbackFinalized(name="cb0", index=0),
        lambda: RunFinalized(status="failed" if x % 2 else "stopped", epochs=1, steps=1),
        lambda: CallbackBegan(name="cb0", index=0),
        lambda: TrainBegan(start_epoch=0, epochs=3),
        lambda: UpdateSkipped(step=i, epoch=0, microbatches=1, reason="masked"),
        lambda: ValidationDone(epoch=0, metrics={"val_loss": 0.5}, examples=10),
        lambda: MonitorDecided(epoch=0, monitor="val_loss", mode="min", value=0.5, improved=bool(x % 2), best=0.5,
                               best_epoch=0, bad_epochs=0),
    ][kind]()


_KINDS = 24
_LAST, _GROUP, _CLOSING = 8, [9, 10, 11, 12], [15, 16, 17, 18]
_x = st.integers(0, 6)
# the frequent kinds weigh more, as in real logs; LAST often enough to commit and defer
_one = st.one_of(st.integers(0, 4), st.sampled_from([_LAST, _LAST, 12]), st.integers(0, _KINDS - 1)).map(
    lambda k: [k]
)
_commit = st.lists(st.sampled_from(_GROUP), max_size=4).map(lambda group: [_LAST, *group])
_ending = st.lists(st.sampled_from(_CLOSING), max_size=3).map(lambda closing: [*closing, 18])


@st.composite
def _logs(draw: st.DrawFn) -> list[tuple[int, Event]]:
    blocks = draw(st.lists(st.one_of(_one, _one, _commit), max_size=50))
    kinds = [k for block in blocks for k in block] + (draw(_ending) if draw(st.booleans()) else [])
    return [(i, _event(k, i, draw(_x))) for i, k in enumerate(kinds)]


logs = _logs()


def _reference(pairs: list[tuple[int, Event]], start: Projections | None = None) -> Projections:
    return functools.reduce(lambda s, p: fold(s, p[0], p[1]), committed(pairs), start or Projections())


def _current(pairs: list[tuple[int, Event]]) -> list[tuple[int, Event]]:
    """The pairs as a log reads them back: legacy receipts upcast."""
    return [(seq, decode(encode(e))) for seq, e in pairs]


@settings(max_examples=300, deadline=None)
@given(logs)
def test_project_equals_folding_the_committed_view_event_by_event(pairs):
    assert project(pairs) == _reference(pairs)
    assert project(iter(pairs)) == _reference(pairs)


@settings(max_examples=100, deadline=None)
@given(logs, logs)
def test_project_from_a_start_state_equals_folding_from_it(before, pairs):
    start = _reference(before)
    assert project(pairs, start=start) == _reference(pairs, start)


@st.composite
def _stored(draw: st.DrawFn) -> tuple[list[tuple[int, Event]], list[tuple[int, list[bytes]]]]:
    """A log's pairs with seq gaps, and its stored values cut into chunks at arbitrary places."""
    pairs = draw(logs)
    gaps = draw(st.lists(st.integers(0, 3), min_size=len(pairs), max_size=len(pairs)))
    seqs = list(itertools.accumulate((1 + g if g == 3 else 1 for g in gaps), initial=draw(st.integers(0, 5))))
    stored = [(seq, e) for seq, (_, e) in zip(seqs, pairs)]
    chunks: list[tuple[int, list[bytes]]] = []
    for seq, e in stored:
        last = chunks[-1] if chunks else None
        if last is None or last[0] + len(last[1]) != seq or draw(st.integers(0, 3)) == 0:
            chunks.append((seq, []))
        chunks[-1][1].append(encode(e))
    return stored, chunks


@settings(max_examples=300, deadline=None)
@given(_stored())
def test_project_of_stored_chunks_equals_folding_the_decoded_log(stored):
    pairs, chunks = stored
    assert project(StoredPairs(iter(chunks))) == _reference(_current(pairs))


@settings(max_examples=40, deadline=None)
@given(logs, st.integers(min_value=1, max_value=100), st.sets(st.integers(min_value=0, max_value=150), max_size=3))
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
        slow = list(LogBase.read(log))
        assert fast == slow
        assert list(log.read(2, 9)) == [p for p in slow if 2 <= p[0] < 9]
        assert list(log.read(kinds=["microbatch_done"])) == [p for p in slow if p[1].KIND == "microbatch_done"]
        assert [p for c in log.read_chunks(3) for p in zip(itertools.count(c[0]), c[1])] == list(log.read_raw(3))
        assert project(log.read()) == _reference(slow)
        assert project(log.read(1, 40)) == _reference([p for p in slow if 1 <= p[0] < 40])


def test_a_stored_value_that_does_not_decode_is_named_by_seq(tmp_path):
    events = [_event(k, i, i) for i, k in enumerate([4, 0, 2, 0, 2, 8, 0])]
    bad = {
        "not msgpack": b"\xc1",
        "unknown kind": msgspec.msgpack.encode({"kind": "no_such_kind"}),
        "a read field missing": msgspec.msgpack.encode({"kind": "update_committed@2", "epoch": 0}),
        "a read field of the wrong type": msgspec.msgpack.encode({"kind": "update_committed@2", "step": "7"}),
        "a required field missing": msgspec.msgpack.encode({"kind": "microbatch_done", "epoch": 0, "batch": 0}),
    }
    for name, raw in bad.items():
        with LmdbLog(tmp_path / name.replace(" ", "_")) as log:
            for e in events:
                log.append(e)
            log.flush()
            log.put_raw(4, raw)
            log.put_raw(5, raw)
            with pytest.raises(CorruptEventError) as info:
                project(log.read())
            assert info.value.seq == 4, name


def test_project_skips_the_optional_fields_it_does_not_read_that_read_refuses(tmp_path):
    """The documented trade: a microbatch is counted whatever its ``terms`` hold; read() still refuses it."""
    fields = msgspec.structs.asdict(_event(0, 1, 0))
    with LmdbLog(tmp_path / "log") as log:
        for e in [EpochBegan(epoch=0), _event(0, 1, 0), _event(_LAST, 2, 1)]:
            log.append(e)
        log.flush()
        log.put_raw(1, msgspec.msgpack.encode({"kind": "microbatch_done", **fields, "terms": "not a dict"}))
        assert project(log.read()).counters.batch == 1
        with pytest.raises(CorruptEventError, match="seq 1"):
            list(log.read())
        log.put_raw(1, msgspec.msgpack.encode({"kind": "microbatch_done", **fields, "loss": "not a float"}))
        with pytest.raises(CorruptEventError, match="seq 1"):
            project(log.read())  # a required field is checked


def test_the_segment_fold_counts_exactly_what_the_counters_fold_reacts_to():
    # view._Projector.fold counts these four kinds; a new one needs teaching it
    assert set(counters_mod.FOLDED) == {MicrobatchDone, UpdateCommitted, EpochBegan, EpochSummarized}


def test_project_of_a_long_log_holds_a_chunk_and_an_epoch_not_the_log(tmp_path):
    epoch_events = 2 * 500 + 2
    with LmdbLog(tmp_path / "log") as log:
        step = 0
        for epoch in range(150):  # 150k events, about 25 MB stored
            log.append(EpochBegan(epoch=epoch))
            for b in range(500):
                step += 1
                log.append(MicrobatchDone(epoch=epoch, batch=b, rows=32, examples=32.0, loss=0.5))
                log.append(UpdateCommitted(step=step, epoch=epoch, microbatches=1, local_examples=32.0,
                                           global_examples=32.0, loss=0.5, lrs=[1e-3]))
            log.append(LastCommitted(manifest=_M, epoch=epoch, step=step, counters=Counters()))
            log.flush()
        n = log.next_seq
        tracemalloc.start()
        try:
            p = project(log.read())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert n == 150 * epoch_events
    assert p.counters == Counters(batch=75_000, step=75_000, global_step=75_000, epoch=0, epoch_step=500)
    assert p.seq == n - 1
    # the whole log decoded would be tens of MB; a chunk and an epoch pending stay under a few
    assert peak < 4 * 2**20, peak
