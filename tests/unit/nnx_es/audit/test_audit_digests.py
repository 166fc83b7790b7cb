"""Invariant 11's cadence (nnx_es.audit.digests.DigestCheck): a ``params_digested`` at every point of the
declared cadence (``run_started.digests``) the run reached, counted from a resume's LAST; agreement alone
for a run that declares none. Fed event by event, as both audit passes feed it."""

from __future__ import annotations

from events.schema import (
    Counters,
    DigestCadence,
    EpochSummarized,
    Event,
    HistoryAppended,
    HistoryRecord,
    LastCommitted,
    ParamsDigested,
    RunFinalized,
    RunResumed,
    RunStarted,
)
from nnx_es.audit.report import Sink
from nnx_es.audit.digests import DigestCheck

SAME = ["ab" * 16, "ab" * 16]


def check(events: list[Event]) -> list[tuple[int, str]]:
    """(seq, message) of every violation DigestCheck reports over ``events`` (seq = position)."""
    sink = Sink()
    c = DigestCheck(sink)
    for seq, e in enumerate(events):
        if e.KIND in c.KINDS:
            c.feed(seq, e)
    return [(v.seq, v.message) for v in sink.violations]


def started(every: int | None = None, declared: bool = True) -> RunStarted:
    return RunStarted(run_id="r", seed=0, world_size=2, digests=DigestCadence(every=every) if declared else None)


def digest(epoch: int, step: int) -> ParamsDigested:
    return ParamsDigested(epoch=epoch, step=step, digests=SAME)


def epoch_end(epoch: int, step: int) -> list[Event]:
    counters = Counters(step=step, epoch=epoch + 1)
    return [EpochSummarized(epoch=epoch, metrics={}, examples=1.0, microbatches=1, updates=1),
            HistoryAppended(record=HistoryRecord(epoch=epoch, train={}, val={}, counters=counters)),
            LastCommitted(manifest=f"m{epoch}", epoch=epoch, step=step, counters=counters)]


def every_three(steps_per_epoch: int, epochs: int, *, drop: int | None = None, final: bool = True) -> list[Event]:
    """A run with DDP(digest_every=3): each epoch's updates, a digest at every multiple of 3 (but ``drop``),
    and (``final``) the end of training's at the final step when that is not a multiple."""
    out: list[Event] = [started(3)]
    step = 0
    for epoch in range(epochs):
        for _ in range(steps_per_epoch):
            step += 1
            if step % 3 == 0 and step != drop:
                out.append(digest(epoch, step))
        out += epoch_end(epoch, step)
    if step % 3 and final:
        out.append(ParamsDigested(epoch=epochs - 1, step=step, digests=SAME, final=True))
    out.append(RunFinalized(status="completed", epochs=epochs, steps=step))
    return out


def test_every_k_updates_each_multiple_recorded_is_clean() -> None:
    assert check(every_three(4, 3)) == []  # steps 3, 6, 9, 12 over epochs of 4 updates


def test_a_digest_left_out_at_a_multiple_of_k_is_reported_once_naming_its_step() -> None:
    events = every_three(4, 3, drop=6)
    found = check(events)
    assert len(found) == 1, found
    seq, message = found[0]
    assert "no params_digested at step 6" in message and "digest_every=3" in message
    # noticed at the first event that says the run got past it: epoch 1's history (steps 5-8)
    assert type(events[seq]) is HistoryAppended and events[seq].record.epoch == 1
    events = [started(3), digest(0, 3), digest(0, 9)]  # or at the next digest, when that comes first
    ((seq, message),) = check(events)
    assert seq == 2 and "no params_digested at step 6" in message
    events = every_three(4, 3, drop=12)
    ((seq, message),) = check(events)
    assert "no params_digested at step 12" in message and type(events[seq]) is HistoryAppended


def test_a_digest_off_the_cadence_is_reported() -> None:
    events = [started(3), digest(0, 3), digest(0, 5), *epoch_end(0, 6)]
    found = [m for _, m in check(events)]
    assert any("step 5, off the cadence" in m for m in found), found
    assert any("no params_digested at step 6" in m for m in found), found


def test_a_resume_counts_from_its_lasts_step_and_may_change_the_cadence() -> None:
    events = every_three(4, 1)[:-1]  # epoch 0 (steps 1-4; digest at 3), LAST at step 4; then killed
    last_seq = next(i for i, e in enumerate(events) if type(e) is LastCommitted)
    events.append(digest(1, 6))  # the tail the resume discards: nothing is due from it
    resumed = RunResumed(last_seq=last_seq, manifest="m0", epoch=0, discard_from=last_seq + 1,
                         discard_to=len(events), digests=DigestCadence(every=2))
    ok = [*events, resumed, digest(1, 6), digest(1, 8), *epoch_end(1, 8)]
    assert check(ok) == []  # every 2 from step 4: 6, 8
    missing = [*events, resumed, digest(1, 8), *epoch_end(1, 8)]
    assert [m for _, m in check(missing)] == ["no params_digested at step 6 (DDP(digest_every=2)), though "
                                              "params_digested(step=8) says the run reached step 7"]


def test_each_epoch_one_digest_before_its_summary() -> None:
    events: list[Event] = [started(None)]
    for epoch in range(3):
        if epoch != 1:
            events.append(digest(epoch, 2 * epoch + 2))
        events += epoch_end(epoch, 2 * epoch + 2)
    found = check(events)
    assert len(found) == 1 and "no params_digested for epoch 1" in found[0][1]
    assert type(events[found[0][0]]) is EpochSummarized and events[found[0][0]].epoch == 1


def test_a_failed_run_and_a_run_without_a_declared_cadence_are_checked_for_agreement_only() -> None:
    failed = every_three(4, 1)[:-1]
    failed.append(RunFinalized(status="failed", epochs=1, steps=5))  # failed before step 6's digest: none due
    assert check(failed) == []
    older = [started(declared=False), digest(0, 2), *epoch_end(0, 7), digest(1, 9)]  # no cadence recorded
    assert check(older) == []
    apart = [started(3), ParamsDigested(epoch=0, step=3, digests=["ab" * 16, "cd" * 16])]
    assert "rank(s) [1] disagree" in check(apart)[0][1]
    three = [started(3), ParamsDigested(epoch=0, step=3, digests=SAME + SAME[:1])]
    assert [m for _, m in check(three)] == ["params_digested holds 3 digests in a run of 2 ranks"]


def test_a_completed_run_ends_with_a_digest_of_its_final_step() -> None:
    # found by a fresh user: DDP(digest_every=1000) on a 152-update run compared nothing, ever
    assert check(every_three(5, 2)) == []  # steps 3, 6, 9, then the final one at 10 (off the cadence: final)
    found = check(every_three(5, 2, final=False))
    assert [m for _, m in found] == ["a completed run's last params_digested is not of its final step 10: the "
                                     "replicas were not compared at the end of training"]
    beyond = [started(1000), *epoch_end(0, 152), RunFinalized(status="completed", epochs=1, steps=152)]
    assert "not of its final step 152" in check(beyond)[0][1]
    stopped = [started(None), digest(0, 2), *epoch_end(0, 2), digest(1, 3),  # epoch 1 stopped at an update
               RunFinalized(status="stopped", epochs=1, steps=4)]
    assert [m for _, m in check(stopped)] == ["a stopped run's last params_digested is not of its final step 4: "
                                              "the replicas were not compared at the end of training"]
    off = [started(3), digest(0, 3), ParamsDigested(epoch=0, step=4, digests=SAME)]  # not final: off the cadence
    assert "off the cadence" in check(off)[0][1]
