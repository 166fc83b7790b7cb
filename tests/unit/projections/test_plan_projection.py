"""The plan log's vocabulary round-trips through its own decoder only, and its fold tells each trial's progress."""

from __future__ import annotations

import pytest

from events.codec import decode, encode
from events.errors import CorruptEventError
from events.plans import PLAN_TYPES, PlanFinished, PlanResumed, PlanStarted, TrialEnded, TrialStarted, decode_plan_event
from events.schema import RunFinalized
from projections.plans import FOLDED, PlanState, fold_plan, project_plan
from samplekit import sample_instance


@pytest.mark.parametrize("cls", PLAN_TYPES)
def test_every_plan_event_round_trips_and_a_run_decoder_refuses_it(cls: type) -> None:
    event = sample_instance(cls)
    raw = encode(event)
    assert decode_plan_event(raw, 3) == event
    with pytest.raises(CorruptEventError):
        decode(raw, 3)
    assert fold_plan(PlanState(), event) != PlanState() or cls is PlanResumed


def test_a_run_event_is_not_a_plan_event() -> None:
    with pytest.raises(CorruptEventError, match="seq 7"):
        decode_plan_event(encode(RunFinalized(status="completed", epochs=1, steps=1)), 7)


def test_the_fold_tells_pending_started_and_ended_trials() -> None:
    started = PlanStarted(name="p", declaration={"trials": [{}, {}, {}]}, declaration_hash="h", trials=3)
    events = [started, TrialStarted(index=0, run_id="p-000", overrides={}, seed=0),
              TrialEnded(index=0, run_id="p-000", status="completed", best=0.5, best_epoch=1, epochs=2),
              TrialStarted(index=1, run_id="p-001", overrides={}, seed=1), PlanResumed(ended=1),
              TrialStarted(index=1, run_id="p-001", overrides={}, seed=1, resumed=True)]
    state = project_plan(list(enumerate(events)))
    assert state.started == started and state.resumes == 1 and not state.finished and state.ended == 1
    assert state.trials[0].state == "ended" and state.trials[0].ended.best == 0.5
    assert (state.trials[1].state, state.trials[1].starts) == ("started", 2) and 2 not in state.trials
    state = fold_plan(fold_plan(state, TrialEnded(index=1, run_id="p-001", status="failed", error="E")),
                      PlanFinished(statuses={"completed": 1, "failed": 1}))
    assert state.finished and state.ended == 2
    assert fold_plan(state, RunFinalized(status="completed", epochs=1, steps=1)) is state  # not a plan event
    assert set(FOLDED) == set(PLAN_TYPES)
