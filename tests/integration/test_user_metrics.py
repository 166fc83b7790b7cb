"""metrics= with named per-row callables and torchmetrics objects: exact over the epoch's rows,
for training and validation, monitorable by name, and a bitwise resume after SIGKILL."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import NNModel, Trainer
from nnx_es.errors import ConfigError
from nnx_es.stages import TrainingStage
from nnx_es.testing import Fit, crash_test
from trainkit import kinds

torchmetrics = pytest.importorskip("torchmetrics")
sklearn_metrics = pytest.importorskip("sklearn.metrics")

torch.set_num_threads(1)


def _binary_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = ((x[:, 0] + 0.5 * x[:, 1] + 0.3 * torch.randn(n, generator=g)) > 0).float().unsqueeze(1)
    return TensorDataset(x, y)


class _Tap:
    """A stage hook keeping every training microbatch's outputs and targets, per epoch."""

    stage = TrainingStage.AFTER_FORWARD
    frequency = 1

    def __init__(self) -> None:
        self.seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __call__(self, ctx, stage) -> None:
        self.seen.setdefault(ctx.epoch, []).append((ctx.predictions.detach().clone(), ctx.targets.clone()))

    def epoch(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        outs, ys = zip(*self.seen[e])
        return torch.cat(outs), torch.cat(ys)


def _abs_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (torch.sigmoid(outputs) - targets).abs()[:, 0]


def _binary_trainer(tmp_path, run_id: str, hooks=(), **kw) -> Trainer:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    metrics = {"f1": torchmetrics.classification.BinaryF1Score(), "auroc": torchmetrics.classification.BinaryAUROC(),
               "abs_error": _abs_error}
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.3), nn.BCEWithLogitsLoss(), metrics=metrics,
                   hooks=list(hooks), runs_root=tmp_path / "runs", run_id=run_id, progress=False, **kw)


def _loaders(train_bs: int = 7):
    train = DataLoader(_binary_data(45, 1), batch_size=train_bs, shuffle=True, generator=torch.Generator().manual_seed(0))
    return train, DataLoader(_binary_data(31, 2), batch_size=6)


def test_f1_auroc_and_a_row_callable_are_exact_over_the_epochs_rows_in_training_and_validation(tmp_path):
    tap = _Tap()
    trainer = _binary_trainer(tmp_path, "bin", hooks=[tap], monitor="val_f1")
    train, val = _loaders()
    run = trainer.fit(train, val, epochs=2)
    for rec in run.history:
        out, y = tap.epoch(rec.epoch)  # every row of the epoch, as trained (weights changing between batches)
        p, t = torch.sigmoid(out)[:, 0].double().numpy(), y[:, 0].numpy()
        assert rec.train["f1"] == pytest.approx(sklearn_metrics.f1_score(t, p > 0.5), abs=1e-7)
        assert rec.train["auroc"] == pytest.approx(sklearn_metrics.roc_auc_score(t, p), abs=1e-6)
        assert rec.train["abs_error"] == pytest.approx(float(abs(p - t).mean()), rel=1e-6)
    # validation of the last epoch: the final weights on every validation row
    x, y = val.dataset.tensors
    with torch.no_grad():
        p = torch.sigmoid(trainer.net.eval()(x))[:, 0].double().numpy()
    t = y[:, 0].numpy()
    last = run.history[-1].val
    assert last["val_f1"] == pytest.approx(sklearn_metrics.f1_score(t, p > 0.5), abs=1e-7)
    assert last["val_auroc"] == pytest.approx(sklearn_metrics.roc_auc_score(t, p), abs=1e-6)
    assert last["val_abs_error"] == pytest.approx(float(abs(p - t).mean()), rel=1e-6)
    # monitorable by name; F1's higher_is_better makes the monitor maximize
    assert trainer.monitor.mode == "max"
    assert [rec.monitor_value for rec in run.history] == [rec.val["val_f1"] for rec in run.history]
    assert "monitor_decided" in kinds(run.run_dir)


def test_a_row_metric_is_the_mean_over_rows_not_the_mean_of_batch_means(tmp_path):
    # batches of 7 and a last one of 3: a mean of batch means would weigh the last 3 rows more
    seen = []

    def row_index(outputs, targets):  # per-row values that differ by batch
        v = targets[:, 0] * 0 + float(len(seen))
        seen.append(len(targets))
        return v

    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    t2 = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.BCEWithLogitsLoss(), metrics=[row_index],
                 runs_root=tmp_path / "runs", run_id="rows2", progress=False)
    train, _ = _loaders(train_bs=7)
    run = t2.fit(train, epochs=1)
    sizes = seen[:len(train)]
    exact = sum(i * s for i, s in enumerate(sizes)) / sum(sizes)
    assert run.history[0].train["row_index"] == pytest.approx(exact, rel=1e-12)
    assert exact != pytest.approx(sum(range(len(sizes))) / len(sizes))


def test_mae_of_a_regression_through_torchmetrics_and_nnmodel_evaluate(tmp_path):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    torch.manual_seed(0)
    model = NNModel(nn.Linear(3, 1), head="regression")
    loader = DataLoader(TensorDataset(x, y), batch_size=9)
    run = model.train(loader, loader, epochs=2, loss=nn.MSELoss(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
                      metrics={"mae": torchmetrics.MeanAbsoluteError()}, runs_root=tmp_path / "runs", run_id="reg",
                      progress=False)
    with torch.no_grad():
        out = model.net(x)
    expected = sklearn_metrics.mean_absolute_error(y.numpy(), out.numpy())
    assert run.history[-1].val["val_mae"] == pytest.approx(expected, rel=1e-6)
    got = model.evaluate(loader, metrics={"mae": torchmetrics.MeanAbsoluteError()})
    assert got["mae"] == run.history[-1].val["val_mae"]


def test_bad_metrics_are_refused_by_name_before_training(tmp_path):
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="has no name"):
        Trainer(net, opt, nn.BCEWithLogitsLoss(), metrics=[lambda o, t: o], runs_root=tmp_path)
    with pytest.raises(ConfigError, match="unique"):
        Trainer(net, opt, nn.BCEWithLogitsLoss(), metrics={"loss": _abs_error}, runs_root=tmp_path)
    with pytest.raises(ConfigError, match="is no|a callable"):
        Trainer(net, opt, nn.BCEWithLogitsLoss(), metrics={"x": 3}, runs_root=tmp_path)
    bad = Trainer(net, opt, nn.BCEWithLogitsLoss(), metrics={"mean": lambda o, t: o.mean()},
                  runs_root=tmp_path / "runs", run_id="bad", progress=False)
    train, _ = _loaders()
    with pytest.raises(ConfigError, match="metric 'mean' must return one value per row"):
        bad.fit(train, epochs=1)


def test_a_metric_named_like_a_loss_term_is_refused_before_training(tmp_path):
    # found in review: metrics={"ce": fn} beside a loss term "ce" replaced the term's reported
    # per-epoch value with the metric's, silently (history's "ce" was no longer the loss)
    from nnx_es import Objective
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    objective = Objective({"bce": nn.BCEWithLogitsLoss(), "l1": (nn.L1Loss(), 0.5)})
    with pytest.raises(ConfigError, match="'bce'.*loss term"):
        Trainer(net, opt, objective, metrics={"bce": _abs_error}, runs_root=tmp_path)
    with pytest.raises(ConfigError, match="'l1'.*loss term"):
        NNModel(net, head="binary").evaluate([(torch.zeros(2, 4), torch.zeros(2, 1))], loss=objective,
                                            metrics={"l1": _abs_error})
    # one term is reported as "loss" alone: its name is free for a metric
    Trainer(net, opt, Objective({"bce": nn.BCEWithLogitsLoss()}), metrics={"bce": _abs_error}, runs_root=tmp_path)


def test_logits_that_all_lie_in_0_1_are_scored_as_logits_by_torchmetrics(tmp_path):
    # found in review: torchmetrics takes floats all within [0, 1] as probabilities (per update
    # call), so one-logit outputs of 0.3 were scored as class 0 although sigmoid(0.3) > 0.5
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 1, generator=g)  # the logits: every one in [0, 1), every row predicted 1
    y = (torch.rand(40, 1, generator=g) > 0.5).float()
    loader = DataLoader(TensorDataset(x, y), batch_size=10)
    expected_f1 = sklearn_metrics.f1_score(y[:, 0].numpy(), (x[:, 0] > 0).numpy())
    net = nn.Linear(1, 1)
    with torch.no_grad():
        net.weight.fill_(1.0)
        net.bias.zero_()
    run = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.0), nn.BCEWithLogitsLoss(),
                  metrics={"f1": torchmetrics.classification.BinaryF1Score(),
                           "acc": torchmetrics.classification.BinaryAccuracy()},
                  runs_root=tmp_path, run_id="r", progress=False).fit(loader, loader, epochs=1)
    record = run.history[-1]
    assert record.train["f1"] == pytest.approx(expected_f1, rel=1e-6)
    assert record.val["val_f1"] == pytest.approx(expected_f1, rel=1e-6)
    assert record.val["val_acc"] == pytest.approx(float((y[:, 0] == 1).float().mean()), rel=1e-6)
    got = NNModel(net, head="binary").evaluate(loader, metrics={"f1": torchmetrics.classification.BinaryF1Score()})
    assert got["f1"] == pytest.approx(expected_f1, rel=1e-6)
    # (B, C) logits under a cross-entropy reach a score-based metric as their softmax
    logits = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.3, 0.1], [0.0, 0.6, 0.5], [0.4, 0.0, 0.9]])
    classes = torch.tensor([0, 2, 1, 2])
    auroc = torchmetrics.classification.MulticlassAUROC(num_classes=3, average="macro")
    got = NNModel(nn.Identity(), head="multiclass").evaluate([(logits, classes)], metrics={"auroc": auroc})
    assert got["auroc"] == pytest.approx(float(auroc(logits.softmax(1), classes)), rel=1e-6)
    # multi-label logits under BCEWithLogitsLoss: elementwise sigmoid
    labels = torch.tensor([[1, 0, 0], [0, 0, 1], [0, 1, 1], [0, 0, 0]])
    f1 = torchmetrics.classification.MultilabelF1Score(num_labels=3, average="micro")
    got = NNModel(nn.Identity(), head="multiclass").evaluate([(logits, labels.float())], loss=nn.BCEWithLogitsLoss(),
                                                             metrics={"f1": f1})
    assert got["f1"] == pytest.approx(sklearn_metrics.f1_score(labels.numpy(), (logits > 0).int().numpy(),
                                                               average="micro"), rel=1e-6)


def test_a_torchmetrics_metric_resumes_bitwise_after_sigkill(tmp_path):
    # a metric's state is not checkpointed: LAST is at epoch boundaries, so a resumed run restarts
    # the epoch and the metric starts it reset, as the uninterrupted run did
    def build(runs_root, run_id):
        train, val = _loaders()
        return Fit(_trainer_at(runs_root, run_id), train, val)

    report = crash_test(build, epochs=3, points=4)
    assert report.ok, report


def _trainer_at(runs_root, run_id) -> Trainer:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.3), nn.BCEWithLogitsLoss(),
                   metrics={"f1": torchmetrics.classification.BinaryF1Score(),
                            "auroc": torchmetrics.classification.BinaryAUROC()},
                   monitor="val_auroc", runs_root=runs_root, run_id=run_id, progress=False, seed=0)


def test_builtin_accuracy_under_a_bce_of_probabilities_is_refused_before_training(tmp_path):
    # found in review: under nn.BCELoss (a net ending in Sigmoid) the built-in accuracy read each
    # probability as a logit (> 0), i.e. scored "always 1", and the run completed with that number
    net = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="BCELoss.*BCEWithLogitsLoss"):
        Trainer(net, opt, nn.BCELoss(), metrics=["accuracy"], runs_root=tmp_path)
    loader = [(torch.randn(6, 4), torch.ones(6, 1))]
    with pytest.raises(ConfigError, match="BCELoss"):
        NNModel(net, head="binary").evaluate(loader, loss=nn.BCELoss())
    # a torchmetrics accuracy reads the probabilities as they are
    x, y = torch.randn(20, 4), (torch.rand(20, 1) > 0.5).float()
    got = NNModel(net, head="binary").evaluate([(x, y)], loss=nn.BCELoss(),
                                                metrics={"accuracy": torchmetrics.classification.BinaryAccuracy()})
    with torch.no_grad():
        expected = float(((net(x) > 0.5).float() == y).float().mean())
    assert got["accuracy"] == pytest.approx(expected, rel=1e-6)
