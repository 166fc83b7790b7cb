"""A binary head (one output logit, BCEWithLogitsLoss), and metric/monitor mismatches refused early."""

from __future__ import annotations

import pytest
import torch
from sklearn.datasets import load_breast_cancer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import Monitor, NNModel, Trainer
from nnx_es.errors import ConfigError
from nnx_es.metrics import check_monitor
from nnx_es.objective import Objective, accuracy
from trainkit import loaders, of_kind, params_of, small_net

torch.set_num_threads(1)


def _breast_cancer() -> tuple[DataLoader, DataLoader, torch.Tensor, torch.Tensor]:
    """Standardized features (569, 30) float32 and 0/1 targets (569, 1) float32; train 400 / val 169."""
    x, y = load_breast_cancer(return_X_y=True)
    x = torch.as_tensor(x, dtype=torch.float32)
    x = (x - x.mean(dim=0)) / x.std(dim=0)
    y = torch.as_tensor(y, dtype=torch.float32).reshape(-1, 1)
    train = DataLoader(TensorDataset(x[:400], y[:400]), batch_size=32, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    val = DataLoader(TensorDataset(x[400:], y[400:]), batch_size=64)
    return train, val, x[400:], y[400:]


def test_a_one_logit_binary_model_on_breast_cancer_predicts_both_classes_and_reports_accuracy(tmp_path):
    train, val, xv, yv = _breast_cancer()
    torch.manual_seed(0)
    model = NNModel(nn.Linear(30, 1))
    run = model.train(train, val, epochs=3, loss=nn.BCEWithLogitsLoss(), monitor="val_accuracy",
                      optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
                      runs_root=tmp_path / "runs", run_id="bc", progress=False)

    assert run.status == "completed" and run.best is not None
    assert all("accuracy" in r.train and "val_accuracy" in r.val for r in run.history)
    proba = model.predict_proba(xv)
    assert proba.shape == (len(xv), 2) and proba.dtype == torch.float32
    assert torch.allclose(proba.sum(dim=1), torch.ones(len(xv)))
    with torch.no_grad():
        p = torch.sigmoid(model.net(xv)).reshape(-1)
    assert torch.allclose(proba[:, 1], p)
    pred = model.predict(xv)
    assert pred.dtype == torch.int64 and torch.equal(pred, (p > 0.5).long())
    assert set(pred.tolist()) == {0, 1}  # not all one class
    accuracy = (pred == yv.reshape(-1).long()).double().mean().item()
    assert accuracy > 0.9
    assert run.history[-1].val["val_accuracy"] == pytest.approx(accuracy, abs=1e-9)


def test_binary_accuracy_takes_targets_of_shape_b_or_b_1_at_probability_one_half():
    logits = torch.tensor([[2.0], [-1.0], [0.5], [-3.0]])
    for y in (torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([[1], [1], [0], [0]])):
        assert accuracy(logits, y) == (2.0, 4.0)  # logit 0.5 > 0 predicts 1 against target 0
        assert accuracy(logits, y, torch.tensor([3.0, 2.0, 0.0, 1.0])) == (4.0, 6.0)


def test_a_metric_that_cannot_score_the_outputs_is_refused_on_the_first_batch_before_backward(tmp_path):
    # NNModel's default metrics=("accuracy",) on a 3-output regression: refused, not dropped
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 3, generator=g)
    torch.manual_seed(0)
    model = NNModel(nn.Linear(4, 3))
    before = params_of(model.net)
    with pytest.raises(ConfigError, match=r"'accuracy' cannot score outputs of shape \(8, 3\) against targets of "
                                          r"shape \(8, 3\).*metrics=\(\)"):
        model.train(DataLoader(TensorDataset(x, y), batch_size=8), epochs=2, loss=nn.MSELoss(),
                    runs_root=tmp_path / "runs", run_id="reg", progress=False)
    assert all(torch.equal(v, params_of(model.net)[k]) for k, v in before.items())  # no backward, no step
    assert of_kind(tmp_path / "runs" / "reg", "microbatch_done") == []


def test_accuracy_on_one_output_regression_targets_is_refused_naming_a_target(tmp_path):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    y = x[:, :1] * 0.7 + 0.1
    torch.manual_seed(0)
    model = NNModel(nn.Linear(4, 1))
    with pytest.raises(ConfigError, match="needs targets of 0/1, got the target"):
        model.train(DataLoader(TensorDataset(x, y), batch_size=8), epochs=1, loss=nn.MSELoss(),
                    runs_root=tmp_path / "runs", run_id="reg1", progress=False)
    assert of_kind(tmp_path / "runs" / "reg1", "microbatch_done") == []


def test_a_monitor_naming_no_reported_metric_is_refused_before_the_run_by_a_function_of_its_own(tmp_path):
    net = small_net()
    objective = Objective(nn.CrossEntropyLoss())
    check_monitor(Monitor("val_accuracy", "max"), objective, ("accuracy",))
    with pytest.raises(ConfigError, match="monitor 'val_acc' names no reported metric"):
        check_monitor(Monitor("val_acc", "max"), objective, ("accuracy",))
    with pytest.raises(ConfigError, match="monitor 'val_accuracy' names no reported metric"):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), monitor="val_accuracy",
                runs_root=tmp_path / "runs", run_id="m")
    assert not (tmp_path / "runs" / "m").exists()
    # a multi-class run keeps its accuracy as before
    train, val = loaders()
    run = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), metrics=["accuracy"],
                  monitor="val_accuracy", runs_root=tmp_path / "runs", run_id="ok", progress=False).fit(
        train, val, epochs=1)
    assert "val_accuracy" in run.history[0].val and "accuracy" in run.history[0].train
