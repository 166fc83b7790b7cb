"""NNModel, the README's API: its arguments, and which weights loading a checkpoint gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnx_es import EMA, NNModel, Trainer
from nnx_es.runtime.engine import default_forward
from nnx_es.errors import CheckpointUnavailableError, ConfigError
from nnx_es.metrics import evaluate
from nnx_es.objective import Objective
from trainkit import loaders, params_of, small_net

torch.set_num_threads(1)


def _train(tmp_path, run_id: str, hooks=(), epochs: int = 4) -> tuple[NNModel, object, tuple]:
    model = NNModel(small_net(7))
    train, val = loaders(batch_size=8, n_train=48)
    run = model.train(train, val, epochs=epochs, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.9),
                      hooks=list(hooks), runs_root=tmp_path / "runs", run_id=run_id, progress=False)
    return model, run, (train, val)


def _scored(net: nn.Module, val) -> dict[str, float]:
    """The validation metrics of ``net`` as the trainer computes them (same loader, eval mode)."""
    metrics, _ = evaluate(net, val, Objective(nn.CrossEntropyLoss()), default_forward, ("accuracy",))
    return metrics


@pytest.mark.parametrize("which", ["best", "last"])
def test_loaded_ema_checkpoint_reproduces_the_recorded_validation_metrics_of_its_epoch(tmp_path, which):
    trained, run, (_, val) = _train(tmp_path, "ema", hooks=[EMA(0.8)])
    model = NNModel(small_net(0))  # another net: everything comes from the checkpoint
    epoch = model.load(run.run_dir, which)
    assert epoch == getattr(run, which).epoch
    assert _scored(model.net, val) == run.history[epoch].val  # exactly: these weights were scored
    # the raw weights are the net's own (what a stateful resume restores into it) and score otherwise
    model.load(run.run_dir, which, weights="raw")
    if which == "last":
        for k, v in params_of(trained.net).items():
            assert torch.equal(model.net.state_dict()[k], v), k
    assert _scored(model.net, val)["val_loss"] != run.history[epoch].val["val_loss"]
    # "averaged" names the default explicitly
    model.load(run.run_dir, which, weights="averaged")
    assert _scored(model.net, val) == run.history[epoch].val


def test_without_an_averaging_hook_the_evaluated_weights_are_the_raw_ones(tmp_path):
    trained, run, (_, val) = _train(tmp_path, "plain")
    model = NNModel(small_net(0))
    epoch = model.load(run.run_dir, "best")
    assert _scored(model.net, val) == run.history[epoch].val
    evaluated = params_of(model.net)
    model.load(run.run_dir, "best", weights="raw")
    assert all(torch.equal(v, evaluated[k]) for k, v in model.net.state_dict().items())
    with pytest.raises(CheckpointUnavailableError, match="holds no averaged weights"):  # a load error, not a resume's
        model.load(run.run_dir, "best", weights="averaged")


def test_load_refuses_unknown_choices_naming_them(tmp_path):
    _, run, _ = _train(tmp_path, "r", epochs=1)
    model = NNModel(small_net(0))
    with pytest.raises(ConfigError, match="weights must be one of 'evaluated', 'raw', 'averaged', got 'ema'"):
        model.load(run.run_dir, "best", weights="ema")
    with pytest.raises(ConfigError, match=r"which must be 'best', 'last' or a LAST's seq \(an int\), got 'first'"):
        model.load(run.run_dir, "first")


def test_train_refuses_an_unknown_keyword_naming_it_before_anything_is_written(tmp_path):
    model = NNModel(small_net())
    with pytest.raises(ConfigError, match=r"unknown keyword argument\(s\) 'lr'.*resume_from.*checkpoint_lag"):
        model.train(*loaders(), epochs=1, lr=0.1, runs_root=tmp_path / "runs", run_id="r")
    assert not (tmp_path / "runs").exists()


def test_train_passes_resume_mode_to_fit(tmp_path):
    _, src, (train, val) = _train(tmp_path, "src", epochs=1)
    model = NNModel(small_net(0))
    with pytest.raises(ConfigError, match="resume_mode must be"):
        model.train(train, val, epochs=1, resume_from=src.run_dir, resume_mode="weights")
    child = model.train(train, val, epochs=0, resume_from=src.run_dir, resume_mode="weights_only",
                        runs_root=tmp_path / "runs", run_id="child", progress=False)
    assert child.run_id == "child" and child.counters.step == 0
    reference = NNModel(small_net(0))
    reference.load(src.run_dir, "last", weights="raw")
    for k, v in params_of(reference.net).items():
        assert torch.equal(model.net.state_dict()[k], v), k


def test_two_averaging_hooks_of_one_name_are_refused():
    net = small_net()
    with pytest.raises(ConfigError, match="averaging hook names must be unique"):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), hooks=[EMA(0.9), EMA(0.99)])


@pytest.mark.parametrize("other, misfit", [
    (lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), r"2\.weight: \(3, 8\) in the checkpoint, \(2, 8\) here"),
    (lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.Linear(3, 3)), r"3\.bias only in this net; 3\.weight only in this net"),
])
def test_load_into_a_net_of_another_architecture_is_refused_before_any_weight_changes(tmp_path, other, misfit):
    model = NNModel(small_net(0))
    run = model.train(*loaders(batch_size=8, n_train=32), epochs=1, runs_root=tmp_path, run_id="r", progress=False)
    target = NNModel(other())  # the first layer fits: torch alone would overwrite it, then raise
    before = [p.detach().clone() for p in target.net.parameters()]
    with pytest.raises(ConfigError, match=r"the BEST checkpoint of run 'r' \(epoch 0\) does not fit this net.*" + misfit):
        target.load(run.run_dir, "best")
    assert all(torch.equal(a, b) for a, b in zip(before, target.net.parameters()))
