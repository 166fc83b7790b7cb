"""The batch contract (nnx_es.batches): a third element is per-row weights only when declared.

Expected values come from plain torch written here.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nnx_es import Trainer
from nnx_es.batches import split_batch, weighted_forward
from nnx_es.runtime.engine import default_forward
from nnx_es.errors import ConfigError, NnxError
from nnx_es.metrics import evaluate
from nnx_es.objective import Objective
from trainkit import blobs_data, of_kind, params_of, small_net

torch.set_num_threads(1)


def _trainer(tmp_path, net, **kw) -> Trainer:
    return Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                   runs_root=tmp_path / "runs", run_id="r", progress=False, **kw)


def test_a_row_id_column_in_a_tensor_dataset_is_refused_before_any_update_saying_how_to_declare_weights(tmp_path):
    x, y = blobs_data(24)
    row_ids = torch.arange(24)
    net = small_net(1)
    before = params_of(net)
    loader = DataLoader(TensorDataset(x, y, row_ids), batch_size=8)

    with pytest.raises(ConfigError, match=r"third element \(Tensor of shape \(8,\)\).*sample_weights=True") as err:
        _trainer(tmp_path, net).fit(loader, epochs=1)

    assert isinstance(err.value, NnxError) and isinstance(err.value, ValueError)
    assert "'weight'" in str(err.value)  # the mapping form is named too
    assert all(torch.equal(v, params_of(net)[k]) for k, v in before.items())  # nothing was trained
    assert of_kind(tmp_path / "runs" / "r", "microbatch_done") == []


def test_declared_sample_weights_train_the_weighted_mean_of_a_tensor_dataset(tmp_path):
    x, y = blobs_data(12, seed=2)
    w = torch.tensor([0.5, 1.0, 2.0, 0.0, 1.0, 3.0, 1.0, 1.0, 0.25, 1.0, 0.0, 2.0])
    net = small_net(3)
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss = (w * F.cross_entropy(ref(x), y, reduction="none")).sum() / w.sum()
    loss.backward()
    opt.step()

    loader = DataLoader(TensorDataset(x, y, w), batch_size=12)
    run = _trainer(tmp_path, net, sample_weights=True).fit(loader, epochs=1)

    (receipt,) = of_kind(run.run_dir, "update_committed")
    assert receipt.loss == pytest.approx(loss.item(), abs=1e-6)
    assert receipt.local_examples == pytest.approx(float(w.sum()))
    assert all(torch.allclose(v, params_of(ref)[k], atol=1e-6) for k, v in params_of(net).items())


def test_a_mapping_batch_declares_weights_by_its_weight_key_and_a_misspelt_key_is_refused():
    x, y = blobs_data(4)
    w = torch.ones(4)
    assert split_batch({"x": x, "y": y, "weight": w})[2] is w
    assert split_batch({"x": x, "y": y})[2] is None
    with pytest.raises(ConfigError, match=r"'weights' would be ignored"):
        split_batch({"x": x, "y": y, "weights": w})
    # declared weights: a 2-tuple still means every row weighs 1
    assert split_batch((x, y), sample_weights=True)[2] is None
    with pytest.raises(ConfigError, match="got int"):
        split_batch(3)


def test_a_negative_sample_weight_is_refused_naming_its_row_and_value(tmp_path):
    x, y = blobs_data(8)
    w = torch.tensor([1.0, 1.0, 2.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    loader = DataLoader(TensorDataset(x, y, w), batch_size=8)
    with pytest.raises(ConfigError, match=r"weight -1\.0 at row 3"):
        _trainer(tmp_path, small_net(1), sample_weights=True).fit(loader, epochs=1)


def test_weights_of_another_shape_than_one_per_row_are_refused_naming_the_shape():
    x, y = blobs_data(5)
    out = small_net(1)(x)
    with pytest.raises(ConfigError, match=r"shape \(5,\).*got shape \(5, 1\)"):
        Objective(nn.CrossEntropyLoss())(out, y, torch.ones(5, 1))


def test_validation_follows_the_same_batch_contract():
    x, y = blobs_data(10, seed=4)
    net = small_net(2)
    objective = Objective(nn.CrossEntropyLoss())
    ids = DataLoader(TensorDataset(x, y, torch.arange(10)), batch_size=5)
    with pytest.raises(ConfigError, match="sample_weights=True"):
        evaluate(net, ids, objective, default_forward)
    w = torch.tensor([1.0, 0.0, 2.0, 1.0, 1.0, 0.5, 1.0, 0.0, 1.0, 1.0])
    weighted = DataLoader(TensorDataset(x, y, w), batch_size=5)
    metrics, _ = evaluate(net, weighted, objective, weighted_forward)
    with torch.no_grad():
        expected = float((w * F.cross_entropy(net(x), y, reduction="none")).sum() / w.sum())
    assert metrics["val_loss"] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ConfigError, match=r"weight -2\.0 at row 1"):
        evaluate(net, [(x[:3], y[:3], torch.tensor([1.0, -2.0, 1.0]))], objective, weighted_forward)


def test_sample_weights_must_be_a_bool():
    net = small_net()
    with pytest.raises(ConfigError, match="sample_weights must be True or False, got 'yes'"):
        Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss(), sample_weights="yes")
