"""Exact resume of a validation loader that shuffles with generators of its own, and the refusal
of a resume whose validation loader differs in them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from crashkit import kill_at_event, run_killed
from events.schema import ValidationDone
from nnx_es import Callback, Trainer
from nnx_es.runtime.engine import default_forward
from nnx_es.errors import ResumeError
from projections import committed
from trainkit import blobs_data, loaders, read_events, small_net

torch.set_num_threads(1)  # fork-safe parent

EPOCHS = 4
N_TRAIN, N_VAL = 48, 30


class ValOrder(Callback):
    """Records the targets of every validation batch, one list per pass (``eval_step`` is the
    trainer's ``eval_step_fn``). Nothing of it is checkpointed."""

    def __init__(self) -> None:
        self.passes: list[list[list[int]]] = []
        self._pass: list[list[int]] = []

    def eval_step(self, net, batch):
        self._pass.append(batch[1].tolist())
        return default_forward(net, batch)

    def on_validation_end(self, ctx, metrics):
        self.passes.append(self._pass)
        self._pass = []


def val_loader(own: str | None) -> DataLoader:
    """The validation rows, reshuffled every pass: by the DataLoader's generator (``own="loader"``),
    by a sampler's own (``"sampler"``), by both, or by the global torch RNG (``None``)."""
    x, y = blobs_data(N_TRAIN + N_VAL)
    ds = TensorDataset(x[N_TRAIN:], y[N_TRAIN:])
    if own in ("sampler", "both"):
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(11))
        return DataLoader(ds, batch_size=7, sampler=sampler,
                          generator=torch.Generator().manual_seed(12) if own == "both" else None)
    return DataLoader(ds, batch_size=7, shuffle=True,
                      generator=torch.Generator().manual_seed(11) if own == "loader" else None)


def make_trainer(runs: Path, run_id: str | None, order: ValOrder | None = None, lag: int = 0) -> Trainer:
    order = order or ValOrder()
    net = small_net(0)
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    return Trainer(
        net, opt, nn.CrossEntropyLoss(), monitor="val_loss", schedulers=[plateau], callbacks=[order],
        eval_step_fn=order.eval_step, accumulation=2, validate_every_steps=2, checkpoint_lag=lag,
        runs_root=runs, run_id=run_id, progress=False,
    )


def fit(trainer: Trainer, own: str | None, **kw):
    train = loaders(batch_size=8, n_train=N_TRAIN, n_val=N_VAL)[0]
    return trainer.fit(train, val_loader(own), epochs=EPOCHS, **kw)


def _validations(run_dir: Path) -> list[ValidationDone]:
    return [e for _, e in committed(read_events(run_dir)) if isinstance(e, ValidationDone)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """(own, lag) -> the uninterrupted run: its result, weights, validation order and event kinds."""
    cache: dict[tuple[str, int], dict] = {}

    def get(own: str, lag: int) -> dict:
        if (own, lag) not in cache:
            order = ValOrder()
            trainer = make_trainer(tmp_path_factory.mktemp("ref"), "ref", order, lag)
            run = fit(trainer, own)
            cache[own, lag] = {"run": run, "params": trainer.net.state_dict(), "passes": order.passes,
                               "kinds": [e.KIND for _, e in read_events(run.run_dir)]}
        return cache[own, lag]

    return get


# 48 rows in batches of 8, 2 microbatches per update: 3 updates an epoch; a step-cadence validation
# every 2 updates (steps 2, 4, 6, 8, 10, 12) besides each epoch's own
CASES = {
    # name -> (own generators, checkpoint_lag, (kind, occurrence)): SIGKILL just before that event
    "loader_epoch_2_after_a_step_validation": ("loader", 0, ("update_committed", 8)),
    # LAST of epoch 1 lands after step 8, whose validation drew from the generator after the capture
    "loader_lagged_last_after_a_step_validation": ("loader", 2, ("update_committed", 8)),
    "sampler_epoch_3_before_history": ("sampler", 0, ("history_appended", 3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_with_a_shuffled_validation_loader_sees_the_uninterrupted_validation_order(case, references,
                                                                                          tmp_path):
    own, lag, (kind, occurrence) = CASES[case]
    reference = references(own, lag)
    at = [i for i, k in enumerate(reference["kinds"]) if k == kind][occurrence]
    runs = tmp_path / "runs"
    assert run_killed(lambda: fit(make_trainer(runs, "r", lag=lag), own), kill_at_event(at)) == "killed"
    order = ValOrder()
    resumed = make_trainer(runs, None, order, lag)
    run = fit(resumed, own, resume_from=runs / "r")
    assert order.passes and order.passes == reference["passes"][-len(order.passes):]
    assert _validations(runs / "r") == _validations(reference["run"].run_dir)  # metrics bitwise
    strip = [msgspec.structs.replace(r, wall_time_s=0.0) for r in run.history]
    assert strip == [msgspec.structs.replace(r, wall_time_s=0.0) for r in reference["run"].history]
    for k, v in resumed.net.state_dict().items():
        assert torch.equal(v, reference["params"][k]), k


@pytest.mark.parametrize(("run_with", "resume_with", "says"), [
    # the run's validation loader had a DataLoader generator, this one has ...
    ("loader", None, "a DataLoader generator and 0 sampler .*, this one has no DataLoader generator and 0 "),
    ("loader", "both", "a DataLoader generator and 0 sampler .*, this one has a DataLoader generator and 1 "),
    ("loader", "sampler", "a DataLoader generator and 0 sampler .*, this one has no DataLoader generator and 1 "),
    # a run that shuffled its validation rows with the global RNG, resumed with a generator of their own
    (None, "loader", "no DataLoader generator and 0 sampler .*, this one has a DataLoader generator and 0 "),
])
def test_a_resume_whose_validation_loader_differs_in_its_generators_is_refused_before_anything_is_applied(
        run_with, resume_with, says, references, tmp_path):
    at = [i for i, k in enumerate(references("loader", 0)["kinds"]) if k == "epoch_began"][2]
    runs = tmp_path / "runs"
    assert run_killed(lambda: fit(make_trainer(runs, "r"), run_with), kill_at_event(at)) == "killed"
    before = read_events(runs / "r")
    refused = make_trainer(runs, None)
    weights = {k: v.clone() for k, v in refused.net.state_dict().items()}
    with pytest.raises(ResumeError, match=f"cannot restore the data order: the run's validation loader had {says}"):
        fit(refused, resume_with, resume_from=runs / "r")
    assert read_events(runs / "r") == before  # nothing appended
    assert all(torch.equal(v, refused.net.state_dict()[k]) for k, v in weights.items())  # nothing applied
    fit(make_trainer(runs, None), run_with, resume_from=runs / "r")  # the run's own set-up still resumes


def test_a_weights_only_continuation_neither_checks_nor_restores_the_validation_generators(references, tmp_path):
    source = references("loader", 0)
    for own in (None, "both", "loader"):  # other generators than the source's are fine; its own are not restored
        order = ValOrder()
        child = make_trainer(tmp_path / "runs", f"child-{own}", order)
        child.fit(loaders(batch_size=8, n_train=N_TRAIN, n_val=N_VAL)[0], val_loader(own), epochs=1,
                  resume_from=source["run"].run_dir, resume_mode="weights_only")
        if own == "loader":  # a fresh generator's first pass, as the source run's first pass
            assert order.passes[0] == source["passes"][0]
