"""NNModel.evaluate / predict over a whole loader (any head), and an evaluation recorded in its run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import NNModel
from nnx_es.audit import audit_run
from nnx_es.errors import ConfigError, ResumeError
from nnx_es.result import load_result
from trainkit import loaders, read_events, small_net

torch.set_num_threads(1)


def _trained(tmp_path, run_id="src", epochs=2):
    model = NNModel(small_net(3))
    train, val = loaders(batch_size=8, n_train=48)
    model.train(train, val, epochs=epochs, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.2),
                runs_root=tmp_path / "runs", run_id=run_id, progress=False)
    return model, val


def test_evaluate_is_exact_over_the_loader_rows_whatever_the_batch_size(tmp_path):
    model, val = _trained(tmp_path)
    x, y = val.dataset.tensors
    with torch.no_grad():
        logits = model.net.eval()(x)
    expected_loss = nn.functional.cross_entropy(logits, y, reduction="sum").item() / len(y)
    expected_acc = (logits.argmax(1) == y).sum().item() / len(y)
    for bs in (5, 7, 64):  # batches of unequal sizes: a mean of batch means would differ
        got = model.evaluate(DataLoader(TensorDataset(x, y), batch_size=bs))
        assert set(got) == {"loss", "accuracy"}
        assert got["accuracy"] == expected_acc
        assert got["loss"] == pytest.approx(expected_loss, rel=1e-6)


def test_predict_over_a_loader_equals_predict_on_the_whole_tensor(tmp_path):
    model, val = _trained(tmp_path)
    x, y = val.dataset.tensors
    by_rows = model.predict(x)
    assert by_rows.dtype == torch.int64 and by_rows.shape == (len(x),)
    assert torch.equal(model.predict(DataLoader(TensorDataset(x, y), batch_size=5)), by_rows)
    assert torch.equal(model.predict(DataLoader(TensorDataset(x), batch_size=5)), by_rows)  # inputs only
    proba = model.predict_proba(DataLoader(TensorDataset(x, y), batch_size=5))
    assert proba.shape == (len(x), 3) and torch.allclose(proba.sum(1), torch.ones(len(x)))
    assert torch.allclose(proba, model.predict_proba(x), atol=1e-6)  # another batching: rounding only


def test_binary_and_regression_heads_predict_and_evaluate(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(30, 4)
    y_bin = (x[:, 0] > 0).float().unsqueeze(1)
    binary = NNModel(nn.Linear(4, 1))
    with torch.no_grad():
        logit = binary.net(x)
    got = binary.evaluate(DataLoader(TensorDataset(x, y_bin), batch_size=7))
    assert got["accuracy"] == ((logit > 0).float() == y_bin).sum().item() / len(x)
    assert got["loss"] == pytest.approx(nn.functional.binary_cross_entropy_with_logits(logit, y_bin).item(), rel=1e-6)
    assert torch.equal(binary.predict(DataLoader(TensorDataset(x), batch_size=7)), (logit[:, 0] > 0).long())

    y_reg = x[:, :1] * 2.0
    reg = NNModel(nn.Linear(4, 1), head="regression")
    with torch.no_grad():
        out = reg.net(x)
    got = reg.evaluate(DataLoader(TensorDataset(x, y_reg), batch_size=7))
    assert set(got) == {"loss"}
    assert got["loss"] == pytest.approx(((out - y_reg) ** 2).mean().item(), rel=1e-6)
    assert torch.allclose(reg.predict(DataLoader(TensorDataset(x), batch_size=7)), out, atol=1e-6)
    with pytest.raises(ValueError, match="regression head has no class probabilities"):
        reg.predict_proba(x)
    with pytest.raises(ConfigError, match="head must be one of"):
        NNModel(nn.Linear(4, 1), head="ordinal")


def test_an_evaluation_is_recorded_after_run_finalized_and_the_run_audits_clean(tmp_path):
    model, val = _trained(tmp_path)
    before = load_result(model.run.run_dir)
    loaded = NNModel(small_net(0))
    epoch = loaded.load(model.run.run_dir, "best")
    metrics = loaded.evaluate(val, record=True, name="test")
    events = read_events(model.run.run_dir)
    kinds = [e.KIND for _, e in events]
    assert kinds[-2:] == ["run_finalized", "evaluation_recorded"]
    ev = events[-1][1]
    assert (ev.name, ev.checkpoint, ev.manifest, ev.epoch, ev.weights) == (
        "test", "best", before.best.manifest, epoch, "evaluated")
    assert ev.metrics == metrics and ev.examples == len(val.dataset)
    # the epoch's recorded validation is what these weights score
    assert {f"val_{k}": v for k, v in metrics.items()} == before.history[epoch].val
    # a second one after it; the run's projections are the same, and the audit is clean
    model.evaluate(val, record=True, name="val-again")
    after = load_result(model.run.run_dir)
    assert (after.status, after.history, after.best, after.last, after.counters) == (
        before.status, before.history, before.best, before.last, before.counters)
    report = audit_run(model.run.run_dir)
    assert report.ok, report.violations


def test_recording_is_refused_without_a_source_or_after_the_weights_changed(tmp_path):
    model, val = _trained(tmp_path)
    fresh = NNModel(small_net(0))
    with pytest.raises(ConfigError, match="train\\(\\) or load\\(\\) a run first"):
        fresh.evaluate(val, record=True)
    with torch.no_grad():
        next(model.net.parameters()).add_(1.0)
    with pytest.raises(ConfigError, match="weights changed since"):
        model.evaluate(val, record=True)
    assert read_events(model.run.run_dir)[-1][1].KIND == "run_finalized"  # nothing written


def test_recording_into_a_run_that_is_not_finalized_is_refused(tmp_path):
    from events.log import LmdbLog
    from nnx_es.evaluation import evaluation_event, record_evaluation

    model, _ = _trained(tmp_path)
    run_dir = model.run.run_dir
    with LmdbLog(f"{run_dir}/events.lmdb") as log:  # cut the log before its end: a killed run
        n = log.next_seq
        log.delete_raw(n - 1)
    with pytest.raises(ResumeError, match="not finalized"):
        record_evaluation(run_dir, evaluation_event(name="x", checkpoint="last", manifest="0" * 64, epoch=0,
                                                    weights="raw", metrics={}, examples=0))


def test_evaluate_iterates_the_loader_once(tmp_path):
    model, val = _trained(tmp_path)

    class Counting:
        def __init__(self, loader):
            self.loader, self.iterations = loader, 0

        def __iter__(self):
            self.iterations += 1
            return iter(self.loader)

        def __len__(self):
            return len(self.loader)

    counted = Counting(val)
    assert model.evaluate(counted) == model.evaluate(val)
    assert counted.iterations == 1  # a shuffling loader's generator is drawn from as by one pass
