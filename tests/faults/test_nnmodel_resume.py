"""A run through ``NNModel.train`` SIGKILLed mid-run and resumed through ``NNModel.train(resume_from=...)``."""

from __future__ import annotations

import msgspec
import pytest
import torch

from crashkit import kill_at_event, run_killed
from nnx_es import EMA, NNModel
from trainkit import kinds, loaders, params_of, small_net

torch.set_num_threads(1)  # fork-safe parent

EPOCHS = 4


def train(model: NNModel, runs, run_id: str | None, ema: EMA | None, **kw):
    return model.train(
        *loaders(batch_size=8, n_train=48), epochs=EPOCHS,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
        hooks=[ema] if ema is not None else [], runs_root=runs, run_id=run_id, seed=3, progress=False, **kw,
    )


def _history(run) -> list:
    return [msgspec.structs.replace(r, wall_time_s=0.0) for r in run.history]


@pytest.fixture(scope="module", params=["plain", "ema"])
def reference(request, tmp_path_factory):
    runs = tmp_path_factory.mktemp("ref")
    ema = EMA(0.8) if request.param == "ema" else None
    model = NNModel(small_net(5))
    run = train(model, runs, "ref", ema)
    return {"hook": request.param, "run": run, "params": params_of(model.net), "kinds": kinds(run.run_dir),
            "averaged": ema.averaged.state_dict() if ema is not None else None}


CASES = {  # name -> (kind, occurrence): SIGKILL just before that event is written
    "mid_first_epoch": ("update_committed", 2),
    "between_epochs_after_best": ("best_committed", 1),
    "mid_epoch_2": ("microbatch_done", 2 * 6 + 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_nnmodel_train_resumed_after_sigkill_ends_bitwise_equal_to_the_uninterrupted_run(case, reference, tmp_path):
    kind, occurrence = CASES[case]
    at = [i for i, k in enumerate(reference["kinds"]) if k == kind][occurrence]
    runs = tmp_path / "runs"
    make_ema = (lambda: EMA(0.8)) if reference["hook"] == "ema" else (lambda: None)
    outcome = run_killed(lambda: train(NNModel(small_net(5)), runs, "r", make_ema()), kill_at_event(at))
    assert outcome == "killed"
    model, ema = NNModel(small_net(5)), make_ema()
    run = train(model, runs, None, ema, resume_from=runs / "r")
    assert run.status == "completed" and "run_resumed" in kinds(run.run_dir)
    assert _history(run) == _history(reference["run"])
    # the raw weights went back into the net, the averaged ones into the hook: both bitwise
    for k, v in params_of(model.net).items():
        assert torch.equal(v, reference["params"][k]), k
    if ema is not None:
        for k, v in ema.averaged.state_dict().items():
            assert torch.equal(v, reference["averaged"][k]), k
    assert run.best.epoch == reference["run"].best.epoch
