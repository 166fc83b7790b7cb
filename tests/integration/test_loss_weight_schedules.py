"""Loss-term weights on a schedule: values, recorded per update, exact after SIGKILL, recipes, resume refusal."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nnx_es import Objective, Trainer
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.loss_weights import Constant, Cosine, LinearWarmup, StepWeight
from nnx_es.recipes.core import from_spec, to_spec
from nnx_es.testing import Fit, crash_test
from trainkit import loaders, read_events, small_net

torch.set_num_threads(1)


def test_schedule_values():
    assert [LinearWarmup(0.0, 1.0, over=4).value(t) for t in (0, 1, 2, 4, 9)] == [0.0, 0.25, 0.5, 1.0, 1.0]
    c = Cosine(1.0, 0.0, over=4)
    assert [c.value(t) for t in (0, 2, 4, 5)] == [1.0, pytest.approx(0.5), 0.0, 0.0]
    assert c.value(1) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert [StepWeight(1.0, 0.5, every=2).value(t) for t in (0, 1, 2, 3, 4)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    assert Constant(0.3).value(7) == 0.3
    assert LinearWarmup(0.0, 1.0, over=3, clock="epoch").at(step=100, epoch=1) == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match="over must be an int >= 1"):
        LinearWarmup(0.0, 1.0, over=0)
    with pytest.raises(ConfigError, match="clock must be one of"):
        Cosine(1.0, 0.0, over=3, clock="batch")


def _aux(outputs, targets):  # a second term: the logits' squared norm per row
    return (outputs ** 2).mean(dim=1)


def _trainer(runs_root, run_id, schedule, **kw) -> Trainer:
    net = small_net(2)
    objective = Objective({"ce": nn.CrossEntropyLoss(), "aux": (_aux, schedule)})
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9), objective, monitor="val_loss",
                   runs_root=runs_root, run_id=run_id, progress=False, **kw)


@pytest.mark.parametrize("schedule", [LinearWarmup(0.0, 0.5, over=5), Cosine(0.5, 0.0, over=2, clock="epoch")])
def test_each_update_records_the_weights_its_window_used(tmp_path, schedule):
    trainer = _trainer(tmp_path / "runs", "w", schedule, accumulation=2)
    train, val = loaders(batch_size=8, n_train=48)
    run = trainer.fit(train, val, epochs=3)
    events = [e for _, e in read_events(run.run_dir)]
    receipts = [e for e in events if e.KIND == "update_committed"]
    assert len(receipts) == 9
    for r in receipts:
        assert r.loss_weights == {"ce": 1.0, "aux": schedule.at(r.step - 1, r.epoch)}
    # each microbatch's loss is its terms combined with the window's weight
    step, epoch_of = 0, {}
    for e in events:
        if e.KIND == "microbatch_done":
            w = schedule.at(step, e.epoch)
            assert e.loss == pytest.approx(e.terms["ce"] + w * e.terms["aux"], rel=1e-6)
        elif e.KIND == "update_committed":
            step = e.step


def test_without_a_schedule_the_receipts_are_unchanged(tmp_path):
    net = small_net(2)
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.2), {"ce": nn.CrossEntropyLoss(), "aux": (_aux, 0.1)},
                      runs_root=tmp_path / "runs", run_id="c", progress=False)
    run = trainer.fit(loaders()[0], epochs=1)
    assert all(e.loss_weights == {} for _, e in read_events(run.run_dir) if e.KIND == "update_committed")


def test_a_scheduled_weight_resumes_bitwise_after_sigkill(tmp_path):
    def build(runs_root, run_id):
        train, val = loaders(batch_size=8, n_train=48)
        return Fit(_trainer(runs_root, run_id, LinearWarmup(0.0, 0.5, over=7), seed=0), train, val)

    report = crash_test(build, epochs=3, points=4)
    assert report.ok, report


def test_a_schedule_is_a_recipe_and_a_resume_with_another_is_refused(tmp_path):
    objective = Objective({"ce": nn.CrossEntropyLoss(), "aux": (nn.L1Loss(), Cosine(0.5, 0.1, over=10))})
    spec = to_spec(objective)
    aux = spec.kwargs["terms"]["aux"]["kwargs"]["weight"]
    assert aux == {"@type": "recipe", "target": "nnx_es.loss_weights:Cosine",
                   "kwargs": {"start": 0.5, "end": 0.1, "over": 10, "clock": "optimizer_update"}}
    rebuilt = from_spec(spec)
    assert rebuilt.terms["aux"].schedule.describe() == objective.terms["aux"].schedule.describe()
    assert to_spec(Constant(0.2)).kwargs == {"value": 0.2, "clock": "optimizer_update"}

    train, val = loaders(batch_size=8, n_train=48)
    run = _trainer(tmp_path / "runs", "r", LinearWarmup(0.0, 0.5, over=5)).fit(train, val, epochs=1)
    with pytest.raises(ResumeError, match="aux"):
        _trainer(tmp_path / "runs", "r", LinearWarmup(0.0, 0.5, over=6)).fit(train, val, epochs=2,
                                                                             resume_from=run.run_dir)
